//! `meshca-agent`: get a SPIFFE certificate from meshca (or istiod) and keep
//! it fresh in a directory.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use meshca_certs::{parse_duration, KeyAlgorithm, SpiffeId, TrustDomain};
use meshca_client::caclient::{
    CaClient, CaClientConfig, RequestOptions, DEFAULT_CA_ADDR, DEFAULT_TOKEN_FILE,
};
use meshca_client::output::write_credentials;
use meshca_client::{CertManager, CertState, ManagerConfig};
use tracing_subscriber::EnvFilter;

/// Gets a SPIFFE certificate from the CA and keeps it fresh in --out.
#[derive(Parser)]
#[command(name = "meshca-agent", version, about)]
struct Args {
    /// CA address.
    #[arg(long, env = "MESHCA_CA_ADDR", default_value = DEFAULT_CA_ADDR)]
    ca_addr: String,
    /// PEM bundle the CA's TLS certificate must chain to.
    #[arg(long, env = "MESHCA_ROOT_CERT")]
    root_cert: PathBuf,
    /// Service-account token file, read on every request.
    #[arg(long, env = "MESHCA_TOKEN_FILE", default_value = DEFAULT_TOKEN_FILE)]
    token_file: PathBuf,
    /// Trust domain.
    #[arg(long, env = "MESHCA_TRUST_DOMAIN", default_value = meshca_certs::spiffe::DEFAULT_TRUST_DOMAIN)]
    trust_domain: TrustDomain,
    /// Namespace (with --service-account).
    #[arg(
        long,
        env = "MESHCA_NAMESPACE",
        requires = "service_account",
        conflicts_with = "spiffe_id"
    )]
    namespace: Option<String>,
    /// Service account (with --namespace).
    #[arg(long, env = "MESHCA_SERVICE_ACCOUNT", requires = "namespace")]
    service_account: Option<String>,
    /// The whole SPIFFE ID instead of --namespace/--service-account.
    #[arg(long, env = "MESHCA_SPIFFE_ID")]
    spiffe_id: Option<SpiffeId>,
    /// Key algorithm.
    #[arg(long, env = "MESHCA_KEY", default_value = "ecdsa-p256")]
    key: KeyAlgorithm,
    /// Requested lifetime (the CA may refuse or cap it).
    #[arg(long, env = "MESHCA_TTL", value_parser = parse_duration)]
    ttl: Option<Duration>,
    /// Output directory: cert-chain.pem key.pem root-cert.pem.
    #[arg(long, env = "MESHCA_OUT")]
    out: PathBuf,
    /// TLS name to verify the CA's certificate against.
    #[arg(long, env = "MESHCA_CA_SERVER_NAME")]
    server_name: Option<String>,
    /// `clusterid` header to send.
    #[arg(long, env = "MESHCA_CLUSTER_ID")]
    cluster_id: Option<String>,
    /// Fetch one certificate, write it, print a summary and exit.
    #[arg(long)]
    once: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let filter = EnvFilter::try_from_env("MESHCA_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("meshca-agent: error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshca-agent: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let identity = match (&args.spiffe_id, &args.namespace, &args.service_account) {
        (Some(id), _, _) => id.clone(),
        (None, Some(ns), Some(sa)) => SpiffeId::for_workload(&args.trust_domain, ns, sa)
            .with_context(|| format!("--namespace {ns:?} --service-account {sa:?}"))?,
        _ => anyhow::bail!("name the identity: --spiffe-id, or --namespace with --service-account"),
    };
    let client = CaClient::new(CaClientConfig {
        ca_addr: args.ca_addr.clone(),
        root_cert: args.root_cert.clone(),
        server_name: args.server_name.clone(),
        token_file: Some(args.token_file.clone()),
        cluster_id: args.cluster_id.clone(),
        timeout: Duration::from_secs(10),
        request: RequestOptions {
            algorithm: args.key,
            ttl: args.ttl,
            ..Default::default()
        },
    })
    .with_context(|| format!("--root-cert {}", args.root_cert.display()))?;

    if args.once {
        let svid = client.fetch_default(&identity).await.with_context(|| {
            format!(
                "fetching a certificate for {identity} from {}",
                args.ca_addr
            )
        })?;
        write_credentials(&args.out, &svid)
            .with_context(|| format!("writing credentials to --out {}", args.out.display()))?;
        println!(
            "identity={} serial={} not_after={} out={}",
            svid.leaf.spiffe_id,
            svid.leaf.serial_hex,
            svid.leaf.not_after,
            args.out.display()
        );
        return Ok(());
    }

    let manager = CertManager::new(Arc::new(client), ManagerConfig::default());
    let mut updates = manager.add(identity.clone());
    let mut last_serial = None;
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            changed = updates.changed() => {
                if changed.is_err() {
                    anyhow::bail!("the certificate manager stopped");
                }
            }
            _ = &mut shutdown => {
                tracing::info!("shutting down");
                return Ok(());
            }
        }
        let state = updates.borrow_and_update().clone();
        match state {
            CertState::Available(svid) if last_serial.as_ref() != Some(&svid.leaf.serial_hex) => {
                match write_credentials(&args.out, &svid) {
                    Ok(()) => {
                        tracing::info!(
                            identity = %svid.leaf.spiffe_id,
                            serial = %svid.leaf.serial_hex,
                            not_after = %svid.leaf.not_after,
                            out = %args.out.display(),
                            rotation = last_serial.is_some(),
                            "certificate written"
                        );
                        last_serial = Some(svid.leaf.serial_hex.clone());
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "writing credentials failed; will retry with the next certificate")
                    }
                }
            }
            CertState::Unavailable(error) => {
                tracing::warn!(identity = %identity, error = %error, "no valid certificate");
            }
            _ => {}
        }
    }
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
