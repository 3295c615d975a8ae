//! `meshca-agent`: get SPIFFE certificates from meshca (or istiod) and keep
//! them fresh in a directory (`--out`) and/or serve them on a Unix socket
//! (`--workload-api-socket`: the SPIFFE Workload API and Envoy SDS), for
//! the configured identity (pod mode) or for each pod of the node that
//! calls (`--node-agent`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};
use meshca_certs::{parse_duration, KeyAlgorithm, SpiffeId, TrustDomain};
use meshca_client::caclient::{
    CaClient, CaClientConfig, RequestOptions, DEFAULT_CA_ADDR, DEFAULT_TOKEN_FILE,
};
use meshca_client::output::write_credentials;
use meshca_client::workload_api::{
    self, watch_node_pods, CallerPolicy, Callers, Feeds, NodePods, WorkloadApiConfig,
    DEFAULT_BUNDLE_REFRESH, DEFAULT_MAX_STREAMS, DEFAULT_MAX_STREAMS_PER_POD,
};
use meshca_client::{CertManager, CertState, ManagerConfig};
use tokio::sync::watch;
use tracing_subscriber::EnvFilter;

/// `--attestation-wait`'s default as the flag reads it:
/// [`workload_api::DEFAULT_ATTESTATION_WAIT`] (a test checks they agree).
const DEFAULT_ATTESTATION_WAIT_TEXT: &str = "30s";

/// Gets SPIFFE certificates from the CA and keeps them fresh in --out and/or
/// serves them on --workload-api-socket.
#[derive(Parser)]
#[command(name = "meshca-agent", version, about)]
struct Args {
    /// CA address (an `http://` or `https://` URL).
    #[arg(long, env = "MESHCA_CA_ADDR", default_value = DEFAULT_CA_ADDR, value_parser = parse_ca_addr)]
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
    #[arg(long, env = "MESHCA_TTL", value_parser = parse_positive_duration, allow_hyphen_values = true)]
    ttl: Option<Duration>,
    /// Output directory: cert-chain.pem key.pem root-cert.pem.
    #[arg(
        long,
        env = "MESHCA_OUT",
        required_unless_present = "workload_api_socket"
    )]
    out: Option<PathBuf>,
    /// Serve the SPIFFE Workload API and Envoy SDS on this Unix socket.
    #[arg(long, env = "MESHCA_WORKLOAD_API_SOCKET")]
    workload_api_socket: Option<PathBuf>,
    /// Node mode: serve each calling pod of this node its service account's
    /// identity (attested from the caller's cgroups and the pod watch),
    /// fetched with this agent's token as a trusted node agent.
    #[arg(
        long,
        env = "MESHCA_NODE_AGENT",
        requires_all = ["workload_api_socket", "node_name"],
        conflicts_with_all = ["out", "spiffe_id", "namespace", "once"]
    )]
    node_agent: bool,
    /// Node mode: this node's name (the pods watched are those with this
    /// `spec.nodeName`; set it from the downward API).
    #[arg(long, env = "MESHCA_NODE_NAME")]
    node_name: Option<String>,
    /// Node mode: where the callers' `<pid>/cgroup` files are.
    #[arg(long, env = "MESHCA_PROC_ROOT", default_value = "/proc")]
    proc_root: PathBuf,
    /// Node mode: kubeconfig for the pod watch (default: in-cluster).
    #[arg(long, env = "MESHCA_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Most streams open on the socket at once (also the most connections).
    #[arg(long, env = "MESHCA_MAX_STREAMS", default_value_t = DEFAULT_MAX_STREAMS, value_parser = parse_positive_count)]
    max_streams: usize,
    /// Node mode: most connections one pod may hold open on the socket,
    /// and most streams (callers outside any pod count as one pod).
    #[arg(long, env = "MESHCA_MAX_STREAMS_PER_POD", default_value_t = DEFAULT_MAX_STREAMS_PER_POD, value_parser = parse_positive_count)]
    max_streams_per_pod: usize,
    /// Node mode: how long a caller whose pod, or container, the pod watch
    /// does not list yet waits for it before it is refused (0: not at all).
    #[arg(long, env = "MESHCA_ATTESTATION_WAIT", default_value = DEFAULT_ATTESTATION_WAIT_TEXT, value_parser = parse_duration)]
    attestation_wait: Duration,
    /// The CA's CRL (PEM: meshca's ca-crl.pem, or the istio-ca-crl
    /// ConfigMap mounted), re-read every --bundle-refresh and served on
    /// the socket (the Workload API's crl, the SDS validation context)
    /// while a trusted CA's signature verifies and its nextUpdate is ahead.
    /// A certificate from the CA whose leaf or intermediate it lists is
    /// refused (logged) and never written or served.
    #[arg(long, env = "MESHCA_CRL_FILE")]
    crl_file: Option<PathBuf>,
    /// How often to check --root-cert for a new trust bundle to push.
    #[arg(long, env = "MESHCA_BUNDLE_REFRESH", value_parser = parse_positive_duration, default_value = DEFAULT_BUNDLE_REFRESH, allow_hyphen_values = true)]
    bundle_refresh: Duration,
    /// TLS name to verify the CA's certificate against.
    #[arg(long, env = "MESHCA_CA_SERVER_NAME")]
    server_name: Option<String>,
    /// `clusterid` header to send.
    #[arg(long, env = "MESHCA_CLUSTER_ID")]
    cluster_id: Option<String>,
    /// Fetch one certificate, write it, print a summary and exit.
    #[arg(long, requires = "out")]
    once: bool,
}

/// A duration flag's value: zero is refused (a zero interval or lifetime
/// means nothing useful, and a zero timer period panics).
fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let duration = parse_duration(text)?;
    if duration.is_zero() {
        return Err(format!(
            "{text:?} is zero; give a positive duration (e.g. 10s)"
        ));
    }
    Ok(duration)
}

/// A count flag's value: at least 1.
fn parse_positive_count(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(0) => Err("0 serves nothing; give at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{text:?} is not a count: {e}")),
    }
}

/// `--ca-addr`: an `http://` or `https://` URL with a host.
fn parse_ca_addr(text: &str) -> Result<String, String> {
    let uri: tonic::transport::Uri = text.parse().map_err(|e| {
        format!("{text:?} is not a URL: {e} (write e.g. https://meshca.istio-system.svc:15012)")
    })?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => {
            return Err(format!(
                "{text:?} is not an http:// or https:// URL (write e.g. https://meshca.istio-system.svc:15012)"
            ))
        }
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("{text:?} names no host"));
    }
    Ok(text.to_string())
}

/// The flags only node mode reads (clap's `requires` cannot say so: a
/// `bool` flag counts as present through its default).
const NODE_MODE_FLAGS: [&str; 5] = [
    "node_name",
    "proc_root",
    "kubeconfig",
    "max_streams_per_pod",
    "attestation_wait",
];

/// Parses the command line (and the environment), refusing a node-mode
/// flag given on the command line without `--node-agent`, where it would
/// do nothing (from the environment: a warning).
fn parse_args<I, T>(args: I) -> Result<Args, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let mut command = Args::command();
    let matches = command.try_get_matches_from_mut(args)?;
    if !matches.get_flag("node_agent") {
        for id in NODE_MODE_FLAGS {
            let flag = format!("--{}", id.replace('_', "-"));
            match matches.value_source(id) {
                Some(ValueSource::CommandLine) => {
                    return Err(command.error(
                        ErrorKind::MissingRequiredArgument,
                        format!("{flag} is a node-mode flag: it needs --node-agent (pod mode would ignore it)"),
                    ));
                }
                // A manifest's environment is often shared between modes.
                Some(ValueSource::EnvVariable) => {
                    let variable = format!("MESHCA_{}", id.to_uppercase());
                    eprintln!("meshca-agent: warning: {variable} ({flag}) is set without --node-agent; pod mode ignores it");
                }
                _ => {}
            }
        }
    }
    Args::from_arg_matches(&matches).map_err(|e| e.format(&mut command))
}

fn main() -> ExitCode {
    let args = parse_args(std::env::args_os()).unwrap_or_else(|e| e.exit());
    // kube-client's own ERROR line per failed request is dropped: the pod
    // watch logs its failures itself, aggregated (meshca_kube).
    let directives = meshca_kube::log_directives(std::env::var("MESHCA_LOG").ok().as_deref());
    let filter = EnvFilter::try_new(&directives)
        .unwrap_or_else(|_| EnvFilter::new(meshca_kube::log_directives(None)));
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

/// Writes the CRL `crl` holds as `out/ca-crl.pem` (Istio's name, beside
/// `root-cert.pem`) when the CA of `svid` signed it and it is not stale;
/// else leaves the last one (logged).
async fn write_crl(
    out: Option<&std::path::Path>,
    crl: &watch::Receiver<Option<Arc<workload_api::ServedCrl>>>,
    svid: Option<&Arc<meshca_client::issuer::Svid>>,
) {
    let (Some(out), Some(svid)) = (out, svid) else {
        return;
    };
    let Some(crl) = crl.borrow().clone() else {
        return;
    };
    if !crl.is_signed_for(svid, time::OffsetDateTime::now_utc()) {
        tracing::warn!("the CRL is not signed by the certificate's CA or is past its nextUpdate; ca-crl.pem not written");
        return;
    }
    let path = out.join(meshca_certs::crl::CRL_FILE);
    let written = tokio::task::spawn_blocking(move || {
        meshca_certs::bundle::write_file_atomic(&path, crl.pem().as_bytes(), 0o644).map(|()| path)
    })
    .await;
    match written {
        Ok(Ok(path)) => tracing::info!(file = %path.display(), "CRL written"),
        Ok(Err(e)) => tracing::error!(error = %e, "writing ca-crl.pem failed"),
        Err(e) => tracing::error!(error = %e, "the CRL writer task failed"),
    }
}

/// The `--crl-file` watch (none without the flag).
fn crl_of(args: &Args) -> watch::Receiver<Option<Arc<workload_api::ServedCrl>>> {
    match &args.crl_file {
        Some(path) => workload_api::watch_crl_file(path.clone(), args.bundle_refresh),
        None => watch::channel(None).1,
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
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
            impersonate: args.node_agent,
            ..Default::default()
        },
    })
    .with_context(|| format!("--root-cert {}", args.root_cert.display()))?;
    // One reader of --crl-file: every fetched chain is checked against it
    // before anything publishes it, and the socket serves it.
    let mut crl = crl_of(&args);
    let client = client.with_crl(crl.clone());
    if args.node_agent {
        return run_node_agent(args, client, crl).await;
    }
    let identity = match (&args.spiffe_id, &args.namespace, &args.service_account) {
        (Some(id), _, _) => id.clone(),
        (None, Some(ns), Some(sa)) => SpiffeId::for_workload(&args.trust_domain, ns, sa)
            .with_context(|| format!("--namespace {ns:?} --service-account {sa:?}"))?,
        _ => anyhow::bail!("name the identity: --spiffe-id, or --namespace with --service-account"),
    };

    if args.once {
        let out = args.out.as_ref().context("--once needs --out")?;
        let svid = client.fetch_default(&identity).await.with_context(|| {
            format!(
                "fetching a certificate for {identity} from {}",
                args.ca_addr
            )
        })?;
        write_credentials(out, &svid)
            .with_context(|| format!("writing credentials to --out {}", out.display()))?;
        println!(
            "identity={} serial={} not_after={} out={}",
            svid.leaf.spiffe_id,
            svid.leaf.serial_hex,
            meshca_certs::Rfc3339(svid.leaf.not_after),
            out.display()
        );
        return Ok(());
    }

    let bundle = workload_api::watch_root_file(client.clone(), args.bundle_refresh);
    let jwt = args
        .workload_api_socket
        .is_some()
        .then(|| start_jwt_svids(&client));
    let manager = Arc::new(CertManager::new(Arc::new(client), ManagerConfig::default()));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut socket = None;
    let mut socket_file = None;
    let mut crl_open = args.crl_file.is_some();
    let mut last_svid: Option<Arc<meshca_client::issuer::Svid>> = None;
    if let Some(path) = &args.workload_api_socket {
        let listener = workload_api::bind(path)
            .await
            .with_context(|| format!("--workload-api-socket {}", path.display()))?;
        socket_file = SocketFile::of(path);
        let feeds = Feeds::with_crl(manager.clone(), bundle, crl.clone());
        // Pinned: the configured identity is fetched now and kept managed
        // with no stream open.
        let pinned = feeds.get(&identity);
        let callers = Callers::new(
            CallerPolicy::Pod(identity.clone()),
            feeds,
            args.max_streams,
            args.max_streams_per_pod,
        );
        let config = WorkloadApiConfig {
            socket: path.clone(),
            max_streams: args.max_streams,
            proc_root: None,
            jwt: jwt.clone(),
        };
        tracing::info!(socket = %path.display(), identity = %identity, mode = "pod", "serving the Workload API and SDS");
        socket = Some(spawn_socket(
            listener,
            config,
            callers,
            stop_rx.clone(),
            pinned,
        ));
    }
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
                break;
            }
            result = wait_socket(&mut socket) => return result,
            changed = crl.changed(), if crl_open => {
                crl_open = changed.is_ok();
                write_crl(args.out.as_deref(), &crl, last_svid.as_ref()).await;
                // The certificate in use listed by the new CRL (or its CA):
                // renewed now, not at its half-life (with or without a socket).
                let served = crl.borrow().clone();
                if let (Some(crl), Some(svid)) = (served, last_svid.as_ref()) {
                    if let Err(e) = crl.check_chain(svid, time::OffsetDateTime::now_utc()) {
                        tracing::warn!(identity = %identity, serial = %svid.leaf.serial_hex, error = %e, "the CRL lists the certificate in use: renewing it now");
                        manager.renew_now(&identity);
                    }
                }
                continue;
            }
        }
        let state = updates.borrow_and_update().clone();
        if let CertState::Available(svid) = &state {
            if last_svid.as_ref().map(|s| &s.leaf.serial_hex) != Some(&svid.leaf.serial_hex) {
                last_svid = Some(svid.clone());
                write_crl(args.out.as_deref(), &crl, last_svid.as_ref()).await;
            }
        }
        match state {
            CertState::Available(svid) if last_serial.as_ref() != Some(&svid.leaf.serial_hex) => {
                let Some(out) = &args.out else {
                    tracing::info!(
                        identity = %svid.leaf.spiffe_id,
                        serial = %svid.leaf.serial_hex,
                        not_after = %meshca_certs::Rfc3339(svid.leaf.not_after),
                        rotation = last_serial.is_some(),
                        "certificate received"
                    );
                    last_serial = Some(svid.leaf.serial_hex.clone());
                    continue;
                };
                // File I/O (fsyncs, and a wait for another writer's lock)
                // off the runtime's threads.
                let written = {
                    let (out, svid) = (out.clone(), svid.clone());
                    tokio::task::spawn_blocking(move || write_credentials(&out, &svid)).await
                };
                match written.context("the credential writer task")? {
                    Ok(()) => {
                        tracing::info!(
                            identity = %svid.leaf.spiffe_id,
                            serial = %svid.leaf.serial_hex,
                            not_after = %meshca_certs::Rfc3339(svid.leaf.not_after),
                            out = %out.display(),
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
    let _ = stop_tx.send(true);
    if let Some(task) = socket {
        task.await.context("the socket server task")??;
    }
    remove_socket(socket_file);
    Ok(())
}

/// JWT-SVIDs from `client`'s CA, and the task that follows its JWT bundle
/// (it ends with the process).
fn start_jwt_svids(client: &CaClient) -> Arc<workload_api::JwtSvids> {
    let jwt = workload_api::JwtSvids::new(client.clone());
    tokio::spawn(jwt.clone().follow_bundle());
    jwt
}

/// Node mode: attest each caller, serve its pod's identity.
async fn run_node_agent(
    args: Args,
    client: CaClient,
    crl: watch::Receiver<Option<Arc<workload_api::ServedCrl>>>,
) -> anyhow::Result<()> {
    let path = args
        .workload_api_socket
        .clone()
        .context("--node-agent needs --workload-api-socket")?;
    let node = args
        .node_name
        .clone()
        .context("--node-agent needs --node-name")?;
    let kube = kube_client(args.kubeconfig.as_deref()).await?;
    let pods = NodePods::new(node.clone());
    let watch_task = tokio::spawn(watch_node_pods(kube, pods.clone()));
    let listener = workload_api::bind(&path)
        .await
        .with_context(|| format!("--workload-api-socket {}", path.display()))?;
    let socket_file = SocketFile::of(&path);
    let bundle = workload_api::watch_root_file(client.clone(), args.bundle_refresh);
    let jwt = start_jwt_svids(&client);
    let manager = Arc::new(CertManager::new(Arc::new(client), ManagerConfig::default()));
    let feeds = Feeds::with_crl(manager, bundle, crl);
    let callers = Callers::new(
        CallerPolicy::Node {
            trust_domain: args.trust_domain.clone(),
            pods,
            attestation_wait: args.attestation_wait,
        },
        feeds,
        args.max_streams,
        args.max_streams_per_pod,
    );
    let config = WorkloadApiConfig {
        socket: path.clone(),
        max_streams: args.max_streams,
        proc_root: Some(args.proc_root.clone()),
        jwt: Some(jwt),
    };
    tracing::info!(socket = %path.display(), node = %node, proc_root = %args.proc_root.display(), mode = "node", "serving the Workload API and SDS");
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut socket = Some(spawn_socket(listener, config, callers, stop_rx, ()));
    let result = tokio::select! {
        _ = shutdown_signal() => {
            tracing::info!("shutting down");
            let _ = stop_tx.send(true);
            match socket.take() {
                Some(task) => task.await.context("the socket server task")?,
                None => Ok(()),
            }
        }
        result = wait_socket(&mut socket) => result,
    };
    watch_task.abort();
    remove_socket(socket_file);
    result
}

/// Connects to the Kubernetes API: `kubeconfig` if given, else in-cluster.
async fn kube_client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<kube::Client> {
    let mut config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("--kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("--kubeconfig {}", path.display()))?
        }
        None => kube::Config::incluster()
            .context("--node-agent needs the Kubernetes API: run in a pod or give --kubeconfig")?,
    };
    // No read timeout: the pod watch stays open for minutes.
    config.connect_timeout = Some(Duration::from_secs(10));
    config.write_timeout = Some(Duration::from_secs(10));
    kube::Client::try_from(config).context("building the Kubernetes client")
}

type SocketTask = tokio::task::JoinHandle<anyhow::Result<()>>;

/// Runs the socket server until `stop` turns true; `keep` (the pinned
/// feed of pod mode) lives as long as the server.
fn spawn_socket<K: Send + 'static>(
    listener: tokio::net::UnixListener,
    config: WorkloadApiConfig,
    callers: Arc<Callers>,
    mut stop: watch::Receiver<bool>,
    keep: K,
) -> SocketTask {
    tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|stop| *stop).await;
        };
        let result = workload_api::serve(listener, &config, callers, shutdown)
            .await
            .with_context(|| format!("--workload-api-socket {}", config.socket.display()));
        drop(keep);
        result
    })
}

/// Completes when the socket server ends (never, if there is none).
async fn wait_socket(socket: &mut Option<SocketTask>) -> anyhow::Result<()> {
    match socket.as_mut() {
        Some(task) => {
            let result = task.await.context("the socket server task")?;
            *socket = None;
            result.and_then(|()| anyhow::bail!("the socket server stopped"))
        }
        None => std::future::pending().await,
    }
}

/// The socket file this agent bound: its path, and the file's identity
/// right after the bind (device, inode, and change time: a file made
/// after ours was removed may get our inode number back).
struct SocketFile {
    path: std::path::PathBuf,
    id: (u64, u64, i64, i64),
}

impl SocketFile {
    /// The file now at `path`, if any.
    fn of(path: &std::path::Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::symlink_metadata(path).ok()?;
        Some(Self {
            path: path.to_path_buf(),
            id: (meta.dev(), meta.ino(), meta.ctime(), meta.ctime_nsec()),
        })
    }
}

/// Removes our socket file on a clean exit, only if it is still ours: a
/// successor that bound the path meanwhile (it found ours refusing
/// connections, so stale) keeps its socket.
fn remove_socket(bound: Option<SocketFile>) {
    let Some(bound) = bound else { return };
    match SocketFile::of(&bound.path) {
        Some(now) if now.id == bound.id => {
            if let Err(e) = std::fs::remove_file(&bound.path) {
                tracing::debug!(socket = %bound.path.display(), error = %e, "removing the socket file");
            }
        }
        Some(_) => {
            tracing::info!(socket = %bound.path.display(), "the socket path holds another agent's socket now; left in place")
        }
        None => {}
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

#[cfg(test)]
mod tests {
    use meshca_client::workload_api::DEFAULT_ATTESTATION_WAIT;

    use super::*;

    #[test]
    fn on_exit_only_our_own_socket_file_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let ours = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let bound = SocketFile::of(&path).unwrap();
        // A successor replaced the file meanwhile: it stays.
        drop(ours);
        std::fs::remove_file(&path).unwrap();
        let _successor = std::os::unix::net::UnixListener::bind(&path).unwrap();
        remove_socket(Some(bound));
        assert!(path.exists(), "the successor's socket is left in place");
        // Our own file is removed.
        remove_socket(SocketFile::of(&path));
        assert!(!path.exists());
    }

    const REQUIRED: [&str; 5] = [
        "meshca-agent",
        "--root-cert",
        "root.pem",
        "--workload-api-socket",
        "s.sock",
    ];

    /// The error of parsing `REQUIRED` plus `extra`, as the user sees it.
    fn refusal(extra: &[&str]) -> String {
        match parse_args(REQUIRED.iter().chain(extra)) {
            Ok(_) => panic!("{extra:?} was accepted"),
            Err(e) => {
                assert_eq!(e.exit_code(), 2, "{e}");
                e.to_string()
            }
        }
    }

    #[test]
    fn zero_durations_and_counts_are_refused_naming_the_flag() {
        for (flag, value) in [
            ("--bundle-refresh", "0s"),
            ("--ttl", "0s"),
            ("--ttl", "-5s"),
            ("--max-streams", "0"),
            ("--max-streams-per-pod", "0"),
        ] {
            let message = refusal(&[flag, value, "--spiffe-id", "spiffe://td/x"]);
            assert!(message.contains(flag), "{flag} {value}: {message}");
        }
        let ok = parse_args(REQUIRED.iter().chain(&[
            "--bundle-refresh",
            "1s",
            "--max-streams",
            "1",
            "--ttl",
            "1h",
        ]));
        assert!(ok.is_ok());
    }

    #[test]
    fn node_mode_flags_without_node_mode_are_refused_naming_the_flag() {
        for (flag, value) in [
            ("--node-name", "node-a"),
            ("--proc-root", "/host/proc"),
            ("--kubeconfig", "kubeconfig"),
            ("--max-streams-per-pod", "8"),
            ("--attestation-wait", "5s"),
        ] {
            let message = refusal(&[flag, value, "--spiffe-id", "spiffe://td/x"]);
            assert!(
                message.contains(flag) && message.contains("--node-agent"),
                "{flag}: {message}"
            );
        }
        let node = parse_args(REQUIRED.iter().chain(&[
            "--node-agent",
            "--node-name",
            "node-a",
            "--max-streams-per-pod",
            "8",
        ]))
        .expect("node mode takes them");
        assert_eq!(node.attestation_wait, DEFAULT_ATTESTATION_WAIT);
        assert_eq!(node.max_streams_per_pod, 8);
    }

    #[test]
    fn the_ca_address_must_be_an_http_url() {
        for bad in ["notaurl", "ftp://ca:15012", "127.0.0.1:15012", "https://"] {
            let message = refusal(&["--ca-addr", bad]);
            assert!(message.contains("--ca-addr"), "{bad}: {message}");
        }
        for good in [
            "https://meshca.istio-system.svc:15012",
            "http://127.0.0.1:15010",
        ] {
            assert_eq!(parse_ca_addr(good).as_deref(), Ok(good));
        }
    }
}
