//! `meshca`: the CA server.

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use meshca_ca::config::{Config, ServeArgs};
use tracing_subscriber::EnvFilter;

/// meshca: an Istio-compatible certificate authority for service meshes.
#[derive(Parser)]
#[command(name = "meshca", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the CA: gRPC over TLS, plus /metrics, /ready and /healthz.
    Serve(ServeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Command::Serve(args) = cli.command;
    init_logging(&args.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("meshca: error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "meshca failed");
            eprintln!("meshca: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: &str) {
    // kube-client logs an ERROR of its own for every failed HTTP request;
    // meshca logs each failure itself, at WARN and aggregated
    // (meshca_kube). Kept only when MESHCA_LOG names kube_client.
    let directives = meshca_kube::log_directives(std::env::var("MESHCA_LOG").ok().as_deref());
    let filter = EnvFilter::try_new(&directives)
        .unwrap_or_else(|_| EnvFilter::new(meshca_kube::log_directives(None)));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colours only on a terminal: log files and collectors get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // Each event is formatted whole, then written with one `write_all`.
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let config = Config::try_from(args).context("invalid configuration")?;
    meshca_ca::server::run(config, shutdown_signal(), |_| {}).await?;
    Ok(())
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
