//! # meshca-bench
//!
//! A load generator for `IstioCertificateService` CAs (meshca, istiod) and,
//! for comparison, cfssl's sign endpoint. Key generation happens before the
//! clock starts: N CSRs and tokens for N identities are made up front, then
//! M HTTP/2 connections over TLS carry `CreateCertificate` calls at
//! concurrency C for a duration or a count. It reports throughput,
//! latency percentiles, errors by status code and, given the server's pid,
//! its CPU seconds and peak RSS from `/proc`. `--crypto-baseline` measures
//! in the same run what one core can do with the cryptography alone
//! (CSR signature check + certificate signature + token signature check),
//! so the result reads as a fraction of that limit.
//!
//! ```text
//! meshca serve --data-dir d &
//! meshca-bench --data-dir d --server-pid $! --concurrency 16 --duration 10s --crypto-baseline
//! meshca-bench mass-restart --identities 10000 --api-latency 5ms
//! meshca-bench attack cancelled-junk --requests 200000 --deadline 20ms
//! meshca-bench pod-certificates --requests 10000 --api-latency 5ms
//! meshca-bench hostile-pods --pods 10 --duration 30s
//! meshca-bench mass-restart --kube-apiserver --identities 10000
//! meshca-bench pod-certificates --kube-apiserver --requests 1000
//! ```

mod attack;
mod baseline;
mod hostile_pods;
mod jwt_load;
mod load;
mod mass_restart;
mod pod_certificates;
mod proc_stats;
mod real_kube;
mod report;
mod revocation;
mod server_process;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use meshca_certs::{parse_duration, KeyAlgorithm};

#[derive(Debug, Parser)]
#[command(
    name = "meshca-bench",
    version,
    about = "Load generator for Istio-compatible CAs"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start meshca against a fake Kubernetes API (TokenReview with latency)
    /// or, with --kube-apiserver, a real one, and have N distinct
    /// identities ask at once, as after a mass restart.
    MassRestart(mass_restart::MassRestartArgs),
    /// Start meshca against a fake Kubernetes API and attack it (junk
    /// tokens, reset floods, connection floods, idle connections); report
    /// the server's memory and what real clients saw meanwhile.
    Attack(attack::AttackArgs),
    /// Start meshca with --pod-certificate-signer against a fake Kubernetes
    /// API (or, with --kube-apiserver, a real one) holding N pending
    /// PodCertificateRequests; time until all are answered and count the
    /// API calls per certificate.
    PodCertificates(pod_certificates::PodCertificatesArgs),
    /// Start meshca and a node agent (`meshca-agent --node-agent`) with
    /// --pods hostile pods at their limits on its node: the agent's memory,
    /// CPU and log lines, and a well-behaved pod's SVID and rotations
    /// alone and during the attack.
    HostilePods(hostile_pods::HostilePodsArgs),
    /// The load run with JWT-SVIDs: `MintJwtSvid` (one audience) instead
    /// of `CreateCertificate`, the same flags; the crypto limit is one
    /// ES256 signature plus the token check.
    JwtSvid(jwt_load::JwtSvidArgs),
    /// Start meshca and revoke N serials at once: the CRL's size, the time
    /// to take the list and sign it, and to publish it (`ca-crl.pem`; with
    /// --kube-apiserver also the `istio-ca-crl` ConfigMap).
    Revocation(revocation::RevocationArgs),
    /// One pod of `hostile-pods` (a process of its own, so that the
    /// node agent attributes it to its pod): started by the scenario.
    #[command(hide = true)]
    PodProcess(hostile_pods::PodProcessArgs),
}

/// Flags of a load run against a running CA.
#[derive(Debug, Clone, Args)]
pub(crate) struct RunArgs {
    /// The CA: https://HOST:PORT for meshca/istiod, http://HOST:PORT for cfssl.
    #[arg(long, default_value = "https://127.0.0.1:15012")]
    pub(crate) addr: String,
    /// What speaks at --addr.
    #[arg(long, value_enum, default_value = "istio")]
    pub(crate) target: Target,
    /// meshca's data directory: root-cert.pem to trust and the local token
    /// issuer to mint one token per identity (offline JWT validation).
    #[arg(long)]
    pub(crate) data_dir: Option<PathBuf>,
    /// Root bundle to trust (default: DATA_DIR/root-cert.pem).
    #[arg(long)]
    pub(crate) root_cert: Option<PathBuf>,
    /// Tokens instead of minting: one line per identity, `NAMESPACE SERVICE_ACCOUNT TOKEN`.
    #[arg(long)]
    pub(crate) tokens: Option<PathBuf>,
    /// Distinct identities (CSRs and tokens made before the clock starts).
    #[arg(long, default_value_t = 1000)]
    pub(crate) identities: usize,
    /// HTTP/2 connections.
    #[arg(long, default_value_t = 4)]
    pub(crate) connections: usize,
    /// Requests in flight.
    #[arg(long, default_value_t = 16)]
    pub(crate) concurrency: usize,
    /// How long to measure (after the warm-up).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// Stop after this many requests instead of after --duration.
    #[arg(long)]
    pub(crate) requests: Option<u64>,
    /// Requests before the clock starts (TLS handshakes, caches).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) warmup: Duration,
    /// Key type of the CSRs.
    #[arg(long, default_value = "ecdsa-p256")]
    pub(crate) key: KeyAlgorithm,
    /// Trust domain of the identities.
    #[arg(long, default_value = "cluster.local")]
    pub(crate) trust_domain: String,
    /// The server's pid, for its CPU seconds and peak RSS (/proc/<pid>).
    #[arg(long)]
    pub(crate) server_pid: Option<u32>,
    /// Also measure the crypto limit on one core, in this process.
    #[arg(long)]
    pub(crate) crypto_baseline: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// Threads of the load generator. 1 (the default) is a single event
    /// loop, like h2load: it drives thousands of requests per second on
    /// about half a core and leaves the rest of the machine to the server.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) threads: u16,
}

/// The protocol at --addr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Target {
    /// `istio.v1.auth.IstioCertificateService/CreateCertificate` over TLS.
    Istio,
    /// cfssl's `POST /api/v1/cfssl/sign` (JSON over HTTP/1.1).
    Cfssl,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The mass-restart scenario also runs the fake Kubernetes API in this
    // process, so it keeps a thread per core.
    let builder = match (&cli.command, cli.run.threads) {
        (None, 1) => tokio::runtime::Builder::new_current_thread(),
        (None, n) => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(usize::from(n));
            builder
        }
        // The JWT-SVID load run: one event loop by default, as above.
        (Some(Command::JwtSvid(args)), _) if args.run.threads == 1 => {
            tokio::runtime::Builder::new_current_thread()
        }
        (Some(Command::JwtSvid(args)), _) => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(usize::from(args.run.threads));
            builder
        }
        (Some(_), _) => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = match { builder }.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("meshca-bench: error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let scenario = async {
            match cli.command {
                Some(Command::MassRestart(args)) => mass_restart::run(args).await,
                Some(Command::Attack(args)) => attack::run(args).await,
                Some(Command::PodCertificates(args)) => pod_certificates::run(args).await,
                Some(Command::HostilePods(args)) => hostile_pods::run(args).await,
                Some(Command::JwtSvid(args)) => jwt_load::run(args.run).await,
                Some(Command::PodProcess(args)) => hostile_pods::pod_process(args).await,
                Some(Command::Revocation(args)) => revocation::run(args).await,
                None => load::run(cli.run).await,
            }
        };
        // On SIGTERM (`timeout`) or SIGINT the scenario is dropped, and
        // with it the meshca server it started (killed on drop): no
        // server is left running behind an interrupted benchmark.
        tokio::select! {
            result = scenario => result,
            signal = interrupted() => Err(anyhow::anyhow!("interrupted by {signal}")),
        }
    });
    match result {
        Ok(clean) if clean => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(2),
        Err(e) => {
            eprintln!("meshca-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Completes with the signal's name when SIGTERM or SIGINT arrives (never,
/// if the handlers cannot be installed).
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}
