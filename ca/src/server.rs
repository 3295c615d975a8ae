//! Wiring of `meshca serve`: load the CA material, build the authenticators,
//! serve gRPC over TLS and the monitoring endpoints, drain on shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use meshca_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateServiceServer;
use prometheus_client::registry::Registry;
use time::OffsetDateTime;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::authn::oidc::KubernetesJwks;
use crate::authn::token_review::kube_client;
use crate::authn::JwksFetcher;
use crate::authn::{
    AuthenticatorChain, ClientCertAuthenticator, JwksError, JwtAuthenticator,
    TokenReviewAuthenticator, TokenReviewConfig,
};
use crate::authority::Authority;
use crate::authz::node_agent::{watch_pods, NodeAgentPolicy, PodIndex};
use crate::authz::Authorizer;
use crate::cluster::leader::{self, candidate_identity, LeaderElector, LeaderTiming};
use crate::cluster::root_secret::{RotationPhase, RotationPolicy};
use crate::cluster::{self, bundle_publisher, ClusterError, SecretLoad};
use crate::config::Config;
use crate::event_loops::EventLoops;
use crate::metrics::{encode_text, IstioCounter, Metrics};
use crate::reload;
use crate::service::CaService;
use crate::store::{self, CaMaterial, StoreError};
use crate::tls::{self, TlsError};

/// Largest gRPC request message accepted (a CSR is at most 32 KiB of PEM).
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// HTTP/2 streams (requests) one connection may have open at once unless
/// `--max-concurrent-streams` says otherwise. A node agent such as ztunnel
/// asks for every pod of its node over one connection; beyond this many
/// its HTTP/2 client holds further requests until an answer frees a
/// stream, so a burst waits in the clients, not in the CA's memory: in the
/// 10,000-identity restart over 64 connections peak RSS was 66–68 MiB with
/// 256 streams, 58–61 MiB with 128, 42–45 MiB with 64, drain time the same;
/// 10,000 pods over one connection drained 5–15 % slower with 128 or 64
/// than with 256 (1.3 against 1.2 s). 128 is nginx's
/// default and above the 100 RFC 9113 recommends as the least; a node
/// (110 pods by Kubernetes' default) fits in it.
pub const DEFAULT_MAX_STREAMS_PER_CONNECTION: u32 = 128;

/// Connections the kernel may hold completed but not yet accepted on the
/// gRPC port. When thousands of sidecars restart at once their connects
/// arrive faster than one accept loop takes them off the queue; tokio's
/// default of 1,024 then drops SYNs, and every dropped client waits a
/// second before its TCP retry. The kernel caps the value at
/// `net.core.somaxconn` (4,096 by default since Linux 5.4; Go, and so
/// istiod, listens with that value too).
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds a listening TCP socket with `backlog` (and `SO_REUSEADDR`, as
/// tokio's `TcpListener::bind` sets it, so a restarted server binds at once).
pub fn bind_with_backlog(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// CA material could not be loaded.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The CA Secret could not be read or created.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The external JWKS could not be read.
    #[error("--jwks {path}: {reason}")]
    Jwks {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The Kubernetes API configuration is unusable.
    #[error("{0}")]
    Kubernetes(String),
    /// The server's TLS identity could not be made.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The TLS configuration is invalid.
    #[error("TLS configuration: {0}")]
    TlsConfig(#[from] rustls::Error),
    /// A listen address could not be bound.
    #[error("cannot listen on {flag} {addr}: {source}")]
    Bind {
        /// The flag.
        flag: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// The event loops could not be started.
    #[error("cannot start the event loops: {0}")]
    EventLoops(std::io::Error),
    /// An event loop's server stopped abnormally.
    #[error("an event loop failed: {0}")]
    EventLoopFailed(String),
}

/// A running server's addresses (useful when binding port 0).
#[derive(Debug, Clone, Copy)]
pub struct BoundAddrs {
    /// gRPC+TLS.
    pub grpc: SocketAddr,
    /// Monitoring.
    pub monitoring: SocketAddr,
}

/// Loads the CA material the configuration names.
pub fn load_material(config: &Config) -> Result<CaMaterial, StoreError> {
    let now = OffsetDateTime::now_utc();
    match &config.ca_dir {
        Some(dir) => store::load_ca_dir(dir, now),
        None => store::load_or_create_data_dir(&config.data_dir, &config.trust_domain, now),
    }
}

/// Offline validation with the API server's own keys, found by OIDC
/// discovery and refreshed every [`JWKS_REFRESH_PERIOD`] and on unknown key IDs.
async fn discovered_jwt_authenticator(
    config: &Config,
    cache_hits: IstioCounter,
    issuer: &str,
    client: kube::Client,
    background: &mut tokio::task::JoinSet<()>,
) -> Result<Arc<JwtAuthenticator>, ServeError> {
    let fetcher = Arc::new(KubernetesJwks::new(client));
    let discovery = fetcher.discover().await.map_err(ServeError::Kubernetes)?;
    if discovery.issuer != issuer {
        return Err(ServeError::Kubernetes(format!(
            "--jwt-issuer {issuer:?}, but the Kubernetes API's OIDC discovery says its issuer is {:?}",
            discovery.issuer
        )));
    }
    let jwks = fetcher.fetch_jwks().await.map_err(ServeError::Kubernetes)?;
    let authn = JwtAuthenticator::from_jwks(
        "kubernetes-oidc",
        issuer,
        &jwks,
        config.token_audiences.clone(),
        config.trust_domain.clone(),
    )
    .map_err(|e| ServeError::Kubernetes(format!("the Kubernetes API's JWKS: {e}")))?
    .with_refresher(fetcher)
    .with_cache_ttl(config.jwt_cache_ttl)
    .counting_cache_hits(cache_hits);
    let authn = Arc::new(authn);
    let refreshing = authn.clone();
    background.spawn(async move {
        loop {
            tokio::time::sleep(JWKS_REFRESH_PERIOD).await;
            if let Err(e) = refreshing.refresh().await {
                tracing::warn!(error = %e, "refreshing the Kubernetes API's JWKS failed; keeping the old keys");
            }
        }
    });
    tracing::info!(
        issuer,
        "offline token validation with the Kubernetes API's OIDC keys"
    );
    Ok(authn)
}

/// How often discovered keys are fetched again.
pub const JWKS_REFRESH_PERIOD: Duration = Duration::from_secs(300);

async fn build_authenticators(
    config: &Config,
    metrics: &Metrics,
    authority: &Arc<Authority>,
    kube: Option<kube::Client>,
    background: &mut tokio::task::JoinSet<()>,
) -> Result<AuthenticatorChain, ServeError> {
    let mut chain = AuthenticatorChain::new().with(Arc::new(ClientCertAuthenticator::new(
        authority.clone(),
        config.trust_domain.clone(),
    )));
    // The local issuer is the embedded mode's: off when a cluster is configured.
    if kube.is_none() {
        let local = store::load_or_create_token_issuer(&config.data_dir)?;
        let local_authn = JwtAuthenticator::from_jwks(
            "local-issuer",
            local.issuer(),
            &local.jwks_json(),
            config.token_audiences.clone(),
            config.trust_domain.clone(),
        )
        .map_err(|e: JwksError| ServeError::Jwks {
            path: config.data_dir.display().to_string(),
            reason: e.to_string(),
        })?
        .with_cache_ttl(config.jwt_cache_ttl)
        .counting_cache_hits(metrics.token_cache_hits.clone());
        chain = chain.with(Arc::new(local_authn));
    }
    if let Some((path, issuer)) = &config.external_jwt {
        let text = std::fs::read_to_string(path).map_err(|e| ServeError::Jwks {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let authn = JwtAuthenticator::from_jwks(
            "jwks",
            issuer,
            &text,
            config.token_audiences.clone(),
            config.trust_domain.clone(),
        )
        .map_err(|e| ServeError::Jwks {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?
        .with_cache_ttl(config.jwt_cache_ttl)
        .counting_cache_hits(metrics.token_cache_hits.clone());
        chain = chain.with(Arc::new(authn));
    }
    if let Some(client) = kube {
        if let Some(issuer) = &config.discovered_jwt_issuer {
            chain = chain.with(
                discovered_jwt_authenticator(
                    config,
                    metrics.token_cache_hits.clone(),
                    issuer,
                    client.clone(),
                    background,
                )
                .await?,
            );
        }
        chain = chain.with(Arc::new(
            TokenReviewAuthenticator::new(
                client,
                TokenReviewConfig {
                    audiences: config.token_audiences.clone(),
                    trust_domain: config.trust_domain.clone(),
                    cache_ttl: config.kubernetes.token_review_cache_ttl,
                    timeout: config.kubernetes.api_timeout,
                    max_in_flight: config.kubernetes.api_max_in_flight,
                },
            )
            .counting_cache_hits(metrics.token_cache_hits.clone()),
        ));
    }
    Ok(chain)
}

#[derive(Clone)]
struct MonitoringState {
    registry: Arc<Registry>,
    metrics: Metrics,
    authority: Arc<Authority>,
    serving: Arc<AtomicBool>,
}

async fn metrics_handler(State(state): State<MonitoringState>) -> impl IntoResponse {
    update_expiry_metrics(&state.authority, &state.metrics);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        encode_text(&state.registry),
    )
}

async fn ready_handler(State(state): State<MonitoringState>) -> impl IntoResponse {
    let now = OffsetDateTime::now_utc();
    if !state.serving.load(Ordering::Relaxed) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: shutting down\n".to_string(),
        );
    }
    if let Some(reason) = state.authority.cannot_sign_reason(now) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        );
    }
    match state.authority.refused() {
        // Still able to sign with the previous material: taking every
        // replica out of the Service would be an outage, so stay ready and say why.
        Some(reason) => (
            StatusCode::OK,
            format!("ready (warning: new CA material was refused and the previous one still signs: {reason})\n"),
        ),
        None => (StatusCode::OK, "ready\n".to_string()),
    }
}

/// Serves the monitoring endpoints on a thread of their own with its own
/// event loop, so `/healthz` and `/ready` answer at once even while every
/// worker of the main runtime is busy signing (a mass restart): a kubelet
/// probe that times out would restart a CA that is merely busy. Completes
/// when the server has stopped after `stop` turned true.
fn spawn_monitoring_thread(
    listener: TcpListener,
    app: axum::Router,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::sync::oneshot::Receiver<()>, ServeError> {
    let addr = listener
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let bind_error = move |source: std::io::Error| ServeError::Bind {
        flag: "--monitoring-listen",
        addr,
        source,
    };
    let std_listener = listener.into_std().map_err(bind_error)?;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("meshca-monitoring".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(e) => {
                    tracing::error!(error = %e, "cannot start the monitoring endpoints' event loop");
                    return;
                }
            };
            runtime.block_on(async move {
                let listener = match TcpListener::from_std(std_listener) {
                    Ok(listener) => listener,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot serve the monitoring endpoints");
                        return;
                    }
                };
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stop.wait_for(|stopped| *stopped).await;
                    })
                    .await;
            });
            let _ = done_tx.send(());
        })
        .map_err(bind_error)?;
    Ok(done_rx)
}

fn update_expiry_metrics(authority: &Authority, metrics: &Metrics) {
    let now = OffsetDateTime::now_utc();
    let state = authority.current();
    let root_not_after = meshca_certs::inspect::CertSummary::from_der(&state.material.anchor_root)
        .map(|s| s.not_after)
        .unwrap_or(now);
    let chain_not_after = state
        .material
        .chain
        .iter()
        .filter_map(|der| meshca_certs::inspect::CertSummary::from_der(der).ok())
        .map(|s| s.not_after)
        .chain(std::iter::once(state.material.signing.validity().not_after))
        .min()
        .unwrap_or(now);
    metrics.set_expiry(root_not_after, chain_not_after, now);
    metrics.ready.set(i64::from(authority.can_sign(now)));
    metrics
        .reload_refused
        .set(i64::from(authority.refused().is_some()));
}

/// Keeps `root-cert.pem` in the data directory equal to the bundle in use
/// (best effort: a read-only data directory only gets a warning).
async fn publish_bundle_file(dir: std::path::PathBuf, authority: Arc<Authority>) {
    let mut changes = authority.subscribe();
    loop {
        let bundle = authority.bundle();
        if let Err(e) =
            store::create_private_dir(&dir).and_then(|()| store::publish_bundle(&dir, &bundle))
        {
            tracing::warn!(error = %e, "could not write the trust bundle to the data directory");
        }
        if changes.changed().await.is_err() {
            return;
        }
    }
}

/// Starts the in-cluster work: leader election, and under leadership the
/// bundle ConfigMaps and (root in the Secret) the root rotation; every
/// replica follows the Secret. Returns the elector's task, which releases
/// the Lease once `draining` turns true.
#[allow(clippy::too_many_arguments)]
fn start_cluster_tasks(
    config: &Config,
    client: &kube::Client,
    namespace: &str,
    root_in_secret: bool,
    authority: &Arc<Authority>,
    metrics: &Metrics,
    draining: tokio::sync::watch::Receiver<bool>,
    background: &mut tokio::task::JoinSet<()>,
) -> tokio::task::JoinHandle<()> {
    let (leader_tx, leader_rx) = tokio::sync::watch::channel(false);
    let elector = LeaderElector::new(
        client.clone(),
        namespace,
        candidate_identity(),
        LeaderTiming::for_lease(config.cluster.lease_duration),
    );
    tracing::info!(
        identity = elector.identity(),
        namespace,
        lease = leader::LEASE_NAME,
        "joining leader election"
    );
    let elector = tokio::spawn(elector.run(leader_tx, draining));

    let gauge = metrics.leader.clone();
    let mut leadership = leader_rx.clone();
    background.spawn(async move {
        loop {
            gauge.set(i64::from(*leadership.borrow_and_update()));
            if leadership.changed().await.is_err() {
                return;
            }
        }
    });

    let (latest_tx, latest_rx) = tokio::sync::watch::channel(None);
    if root_in_secret {
        background.spawn(cluster::follow_root_secret(
            client.clone(),
            namespace.to_string(),
            authority.clone(),
            metrics.clone(),
            latest_tx,
        ));
    }
    let policy = RotationPolicy {
        root_ttl: config.cluster.root_ttl,
        rotate_at: config.cluster.rotation_at,
        grace: config.cluster.rotation_grace,
        max_leaf_ttl: config.ttl.max,
    };
    let (client, namespace, authority, metrics) = (
        client.clone(),
        namespace.to_string(),
        authority.clone(),
        metrics.clone(),
    );
    let excluded = config.cluster.bundle_excluded_namespaces.clone();
    let trust_domain = config.trust_domain.clone();
    if let Some(signer_name) = config.cluster.pod_certificate_signer.clone() {
        background.spawn(leader::while_leader(
            leader_rx.clone(),
            cluster::pod_certificates::leader_work(
                client.clone(),
                authority.clone(),
                metrics.clone(),
                cluster::pod_certificates::PodSignerConfig {
                    signer_name,
                    trust_domain: trust_domain.clone(),
                    max_ttl: config.ttl.max,
                },
            ),
        ));
    }
    background.spawn(leader::while_leader(leader_rx, move || {
        let publish = bundle_publisher::publish_bundles(
            client.clone(),
            authority.clone(),
            excluded.clone(),
            metrics.clone(),
        );
        let rotate = cluster::rotate_root(
            client.clone(),
            namespace.clone(),
            trust_domain.clone(),
            policy,
            authority.clone(),
            metrics.clone(),
            latest_rx.clone(),
        );
        async move {
            if root_in_secret {
                futures::join!(publish, rotate);
            } else {
                publish.await;
            }
        }
    }));
    elector
}

/// Rewrites tonic's `OUT_OF_RANGE` for an oversized request message into
/// `INVALID_ARGUMENT` (DESIGN §2); the service itself never answers
/// `OUT_OF_RANGE`.
fn oversized_is_invalid_argument<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    if headers.get("grpc-status").is_some_and(|v| v == "11") {
        headers.insert("grpc-status", http::HeaderValue::from_static("3"));
    }
    response
}

/// Runs the CA until `shutdown` completes, then drains in-flight requests
/// (up to `config.shutdown_grace`) and returns. `on_bound` is called with
/// the bound addresses once both listeners are up.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(BoundAddrs) + Send,
) -> Result<(), ServeError> {
    let kube = kube_client(
        config.kubernetes.kubeconfig.as_deref(),
        config.kubernetes.api_timeout,
    )
    .await
    .map_err(ServeError::Kubernetes)?;
    let namespace = kube
        .as_ref()
        .map(|client| cluster::own_namespace(config.cluster.namespace.as_deref(), client));
    // The root lives in the cluster's Secret when there is a cluster and no
    // plugged-in CA; else in the data directory.
    let mut root_in_secret = false;
    let material = match (&config.ca_dir, &kube, &namespace) {
        (None, Some(client), Some(ns)) => {
            match cluster::load_or_create_root_secret(
                client,
                ns,
                &config.trust_domain,
                config.cluster.root_ttl,
            )
            .await?
            {
                SecretLoad::Loaded(material) => {
                    root_in_secret = true;
                    *material
                }
                SecretLoad::NotServed => {
                    tracing::warn!(
                        namespace = %ns,
                        data_dir = %config.data_dir.display(),
                        "the Kubernetes API does not serve Secrets in this namespace; keeping the root in the data directory (replicas will not share it)"
                    );
                    load_material(&config)?
                }
            }
        }
        _ => load_material(&config)?,
    };
    tracing::info!(
        source = ?material.source,
        trust_domain = %config.trust_domain,
        ca_not_after = %material.signing.validity().not_after,
        "CA material loaded"
    );
    let authority =
        Arc::new(Authority::new(material, config.ttl).with_expiry_margin(config.ca_expiry_margin));
    if let Some(reason) = authority.cannot_sign_reason(OffsetDateTime::now_utc()) {
        tracing::error!(error = %reason, "the CA cannot sign; serving anyway so /ready and the metrics can tell");
    }
    let mut background = tokio::task::JoinSet::new();
    let metrics = Metrics::default();
    let authn =
        build_authenticators(&config, &metrics, &authority, kube.clone(), &mut background).await?;
    if config.discovered_jwt_issuer.is_some() && kube.is_none() {
        return Err(ServeError::Kubernetes(
            "--jwt-issuer without --jwks needs the Kubernetes API (--kubeconfig, or running in a pod) for OIDC discovery"
                .into(),
        ));
    }
    let authz = if config.trusted_node_agents.is_empty() {
        Authorizer::own_identity_only()
    } else {
        let Some(client) = kube.clone() else {
            return Err(ServeError::Kubernetes(
                "--trusted-node-agent needs the Kubernetes API (--kubeconfig, or running in a pod) to check pods"
                    .into(),
            ));
        };
        let pods = Arc::new(PodIndex::default());
        background.spawn(watch_pods(client, pods.clone()));
        tracing::info!(agents = ?config.trusted_node_agents, "node-agent impersonation enabled");
        Authorizer::with_impersonation(Arc::new(NodeAgentPolicy::new(
            config.trusted_node_agents.clone(),
            pods,
        )))
    };
    tracing::info!(authenticators = ?authn, "authentication configured");
    let registry = Arc::new(metrics.register());
    update_expiry_metrics(&authority, &metrics);
    metrics.set_rotation_phase(RotationPhase::Stable);
    let (draining_tx, mut draining_rx) = tokio::sync::watch::channel(false);

    background.spawn(publish_bundle_file(
        config.data_dir.clone(),
        authority.clone(),
    ));
    if let Some(dir) = &config.ca_dir {
        background.spawn(reload::watch_ca_dir(
            dir.clone(),
            authority.clone(),
            metrics.clone(),
            config.ca_dir_check_interval,
        ));
    }
    let elector = match (&kube, &namespace) {
        (Some(client), Some(ns)) => Some(start_cluster_tasks(
            &config,
            client,
            ns,
            root_in_secret,
            &authority,
            &metrics,
            draining_rx.clone(),
            &mut background,
        )),
        _ => None,
    };

    let resolver = tls::new_resolver(&authority, &config.server_dns)?;
    let tls_config = tls::server_config(resolver.clone())?;
    let acceptor = TlsAcceptor::from(Arc::new(tls_config));

    let grpc_listener =
        bind_with_backlog(config.listen, LISTEN_BACKLOG).map_err(|source| ServeError::Bind {
            flag: "--listen",
            addr: config.listen,
            source,
        })?;
    let monitoring_listener =
        TcpListener::bind(config.monitoring_listen)
            .await
            .map_err(|source| ServeError::Bind {
                flag: "--monitoring-listen",
                addr: config.monitoring_listen,
                source,
            })?;
    let bound = BoundAddrs {
        grpc: grpc_listener.local_addr().unwrap_or(config.listen),
        monitoring: monitoring_listener
            .local_addr()
            .unwrap_or(config.monitoring_listen),
    };

    let loops = EventLoops::start(config.event_loops).map_err(ServeError::EventLoops)?;
    let service = CaService::new(
        authority.clone(),
        authn,
        authz,
        metrics.clone(),
        config.cluster_id.clone(),
        config.max_concurrent_requests,
    )
    .with_spare_loops(loops.spare());
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<IstioCertificateServiceServer<CaService>>()
        .await;

    let serving = Arc::new(AtomicBool::new(true));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);

    // Monitoring endpoints.
    let monitoring_state = MonitoringState {
        registry,
        metrics: metrics.clone(),
        authority: authority.clone(),
        serving: serving.clone(),
    };
    let app = axum::Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/ready", get(ready_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(monitoring_state);
    let monitoring = spawn_monitoring_thread(monitoring_listener, app, stop_rx.clone())?;

    // Server certificate renewal.
    let renewal = tokio::spawn(tls::renew_server_cert(
        resolver,
        authority.clone(),
        config.server_dns.clone(),
        stop_rx.clone(),
    ));

    on_bound(bound);
    tracing::info!(
        grpc = %bound.grpc,
        monitoring = %bound.monitoring,
        "meshca is serving IstioCertificateService over TLS"
    );

    // Shutdown: mark not ready, report NOT_SERVING, then let tonic stop
    // accepting and drain in-flight requests, for at most the grace period.
    let (drain_tx, drain_rx) = tokio::sync::watch::channel(false);
    let serving_flag = serving.clone();
    let reporter = health_reporter.clone();
    tokio::spawn(async move {
        shutdown.await;
        tracing::info!("shutdown requested: draining in-flight requests");
        serving_flag.store(false, Ordering::Relaxed);
        reporter
            .set_not_serving::<IstioCertificateServiceServer<CaService>>()
            .await;
        let _ = drain_tx.send(true);
        let _ = draining_tx.send(true);
    });

    // One gRPC server per event loop, each serving the connections placed on it.
    let grpc =
        IstioCertificateServiceServer::new(service).max_decoding_message_size(MAX_REQUEST_BYTES);
    let incoming = tls::tls_incoming(grpc_listener, acceptor, loops.handles(), &metrics);
    let servers = incoming
        .into_iter()
        .zip(loops.handles())
        .map(|(incoming, handle)| {
            let mut drain = drain_rx.clone();
            let builder = tonic::transport::Server::builder()
                .max_concurrent_streams(Some(config.max_concurrent_streams))
                .timeout(config.request_timeout);
            // No `max_connection_age_grace`: tonic 0.14 then closes at
            // age + grace without a GOAWAY first. Without it the connection
            // gets a GOAWAY at its age and closes once its requests in flight
            // are answered, which `--request-timeout` bounds.
            let builder = match config.max_connection_age {
                Some(age) => builder.max_connection_age(age),
                None => builder,
            };
            let server = builder
                // Large flow-control windows: no WINDOW_UPDATE round trip every
                // few dozen small requests.
                .initial_connection_window_size(Some(4 << 20))
                .initial_stream_window_size(Some(1 << 20))
                .http2_keepalive_interval(Some(Duration::from_secs(30)))
                .http2_keepalive_timeout(Some(Duration::from_secs(10)))
                .layer(tower::util::MapResponseLayer::new(
                    oversized_is_invalid_argument,
                ))
                .add_service(health_service.clone())
                .add_service(grpc.clone())
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = drain.wait_for(|d| *d).await;
                });
            handle.spawn(server)
        });
    let server = futures::future::try_join_all(servers);
    tokio::pin!(server);
    let finished = tokio::select! {
        r = &mut server => Some(r),
        _ = draining_rx.wait_for(|d| *d) => {
            match tokio::time::timeout(config.shutdown_grace, &mut server).await {
                Ok(r) => Some(r),
                Err(_) => {
                    tracing::warn!(grace = ?config.shutdown_grace, "shutdown grace period over; stopping with requests still in flight");
                    None
                }
            }
        }
    };
    let result = match finished {
        None => Ok(()),
        Some(Ok(results)) => results
            .into_iter()
            .collect::<Result<(), _>>()
            .map_err(ServeError::from),
        Some(Err(e)) => Err(ServeError::EventLoopFailed(e.to_string())),
    };
    let _ = stop_tx.send(true);
    let _ = monitoring.await;
    renewal.abort();
    background.abort_all();
    if let Some(elector) = elector {
        // Give the Lease back so another replica takes over at once.
        let _ = tokio::time::timeout(Duration::from_secs(3), elector).await;
    }
    // Off the runtime: joining the loops' threads blocks.
    let _ = tokio::task::spawn_blocking(move || loops.stop()).await;
    tracing::info!("meshca stopped");
    result
}
