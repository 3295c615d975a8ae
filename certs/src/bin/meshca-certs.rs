//! `meshca-certs`: CA material and test credentials for meshca.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use clap::{Parser, Subcommand};
use meshca_certs::token::{TokenIssuer, TokenRequest, DEFAULT_AUDIENCE};
use meshca_certs::SpiffeId;

/// CA material and test credentials for meshca.
#[derive(Parser)]
#[command(name = "meshca-certs", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a service-account token that `meshca serve` (embedded mode) accepts.
    Token {
        /// meshca's data directory (holds the local token issuer key).
        #[arg(long, default_value = "./meshca-data")]
        data_dir: PathBuf,
        /// Namespace of the service account.
        #[arg(long)]
        namespace: String,
        /// Name of the service account.
        #[arg(long)]
        service_account: String,
        /// Audience; repeatable.
        #[arg(long = "audience", default_value = DEFAULT_AUDIENCE)]
        audiences: Vec<String>,
        /// Lifetime, e.g. 10m, 1h.
        #[arg(long, default_value = "1h", value_parser = meshca_certs::parse_duration)]
        ttl: Duration,
        /// Bind the token to a pod name (optional).
        #[arg(long)]
        pod_name: Option<String>,
        /// The bound pod's UID (optional).
        #[arg(long, default_value = "")]
        pod_uid: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshca-certs: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Token {
            data_dir,
            namespace,
            service_account,
            audiences,
            ttl,
            pod_name,
            pod_uid,
        } => {
            // Validate the names the way the CA will use them.
            SpiffeId::for_workload(&Default::default(), &namespace, &service_account)
                .with_context(|| {
                    format!("--namespace {namespace:?} / --service-account {service_account:?}")
                })?;
            if ttl.is_zero() {
                anyhow::bail!("--ttl must be more than zero");
            }
            let issuer = TokenIssuer::load(&data_dir).with_context(|| {
                format!(
                    "loading the local token issuer from --data-dir {} (start `meshca serve --data-dir {}` once to create it)",
                    data_dir.display(),
                    data_dir.display()
                )
            })?;
            let token = issuer.mint(
                &TokenRequest {
                    namespace,
                    service_account,
                    audiences,
                    ttl,
                    pod: pod_name.map(|name| meshca_certs::token::ObjectRef { name, uid: pod_uid }),
                },
                SystemTime::now(),
            )?;
            println!("{token}");
            Ok(())
        }
    }
}
