//! Wiring of `meshca serve`: load the CA material, build the authenticators,
//! serve gRPC over TLS and the monitoring endpoints, drain on shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use meshca_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateServiceServer;
use meshca_proto::meshca::v1::jwt_svid_service_server::JwtSvidServiceServer;
use prometheus_client::registry::Registry;
use time::OffsetDateTime;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tonic_health::pb::health_server::{Health, HealthServer};

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
use crate::caller_gate::CallerGate;
use crate::cluster::leader::{self, candidate_identity, LeaderElector, LeaderTiming};
use crate::cluster::root_secret::{RotationPhase, RotationPolicy};
use crate::cluster::{self, bundle_publisher, ClusterError};
use crate::config::Config;
use crate::metrics::{encode_text, IstioCounter, Metrics};
use crate::reload;
use crate::server_identity;
pub use crate::server_identity::TlsError;
use crate::service::CaService;
use crate::store::{self, CaMaterial, StoreError};
use crate::transport::{self, AcceptLimits, Accepted, Http2Settings};
use meshca_kube::{self as kube_api, StepError};
use tokio_stream::wrappers::ReceiverStream;

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
    #[error("TLS configuration: {}", meshca_certs::error_chain(.0))]
    TlsConfig(rustls::Error),
    /// The JWT-SVID signing keys could not be loaded or made.
    #[error(transparent)]
    JwtKeys(#[from] crate::jwt_svid::JwtKeyError),
    /// A listen address could not be bound.
    #[error("cannot listen on {flag} {addr}: {cause}")]
    Bind {
        /// The flag.
        flag: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        cause: std::io::Error,
    },
}

impl From<rustls::Error> for ServeError {
    fn from(e: rustls::Error) -> Self {
        Self::TlsConfig(e)
    }
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
pub(crate) fn load_material(config: &Config) -> Result<CaMaterial, StoreError> {
    let now = OffsetDateTime::now_utc();
    if let Some(hsm) = &config.hsm {
        // Without --ca-dir (and without a cluster), the data directory
        // holds the HSM key's root certificate.
        let dir = match &config.ca_dir {
            Some(dir) => dir,
            None => {
                hsm.ensure_data_dir_root(
                    &config.data_dir,
                    &config.trust_domain,
                    time::Duration::try_from(config.cluster.root_ttl)
                        .unwrap_or(time::Duration::MAX),
                    now,
                )?;
                &config.data_dir
            }
        };
        return hsm.open(dir, &config.trust_domain)?.material(now);
    }
    match &config.ca_dir {
        Some(dir) => store::load_ca_dir(dir, now),
        None => store::load_or_create_data_dir(
            &config.data_dir,
            &config.trust_domain,
            // At most 100 years (the flag's parser checks it).
            time::Duration::try_from(config.cluster.root_ttl).unwrap_or(time::Duration::MAX),
            now,
        ),
    }
}

/// Offline validation with the API server's own keys, found by OIDC
/// discovery and refreshed every [`JWKS_REFRESH_PERIOD`] and on unknown key IDs.
async fn discovered_jwt_authenticator(
    config: &Config,
    cache_hits: IstioCounter,
    issuer: &str,
    client: kube::Client,
    startup: &StartupWait,
    background: &mut tokio::task::JoinSet<()>,
) -> Result<Arc<JwtAuthenticator>, ServeError> {
    let fetcher = Arc::new(KubernetesJwks::new(client).with_timeout(config.kubernetes.api_timeout));
    let jwks = kube_api::wait_for_api(
        "OIDC discovery of the Kubernetes API",
        config.kubernetes.startup_timeout,
        &startup.waiting,
        ServeError::Kubernetes,
        || async {
            let discovery = fetcher.discover().await.map_err(StepError::Transient)?;
            if discovery.issuer != issuer {
                return Err(StepError::Fatal(ServeError::Kubernetes(format!(
                    "--jwt-issuer {issuer:?}, but the Kubernetes API's OIDC discovery says its issuer is {:?}",
                    discovery.issuer
                ))));
            }
            fetcher.fetch_jwks().await.map_err(StepError::Transient)
        },
    )
    .await?;
    let authn = JwtAuthenticator::from_jwks(
        "kubernetes-oidc",
        issuer,
        &jwks,
        config.token_audiences.clone(),
        config.trust_domain.clone(),
    )
    .map_err(|e| ServeError::Kubernetes(format!("the Kubernetes API's JWKS: {e}")))?
    .with_refresher(fetcher)
    .with_fetch_timeout(config.kubernetes.api_timeout * 2)
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
pub(crate) const JWKS_REFRESH_PERIOD: Duration = Duration::from_secs(300);

/// Start-up step: who is calling. In order: client certificates (unless
/// renewal is off), the local issuer (embedded mode only: it writes the
/// issuer's files to the data directory), `--jwks`, and with a cluster the
/// API server's OIDC keys (`--jwt-issuer` alone) and TokenReview.
async fn build_authenticators(
    config: &Config,
    metrics: &Metrics,
    authority: &Arc<Authority>,
    kube: Option<kube::Client>,
    startup: &StartupWait,
    background: &mut tokio::task::JoinSet<()>,
) -> Result<AuthenticatorChain, ServeError> {
    let mut chain = AuthenticatorChain::new();
    if config.allow_cert_renewal {
        chain = chain.with(Arc::new(ClientCertAuthenticator::new(
            authority.clone(),
            config.trust_domain.clone(),
        )));
    }
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
                    startup,
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
                    refusal_cache_ttl: config.kubernetes.token_review_refusal_cache_ttl,
                    timeout: config.kubernetes.api_timeout,
                    max_in_flight: config.kubernetes.api_max_in_flight,
                    // As many as could wait for a signing slot.
                    max_waiting: config.max_concurrent_requests.max(1)
                        * crate::admission::QUEUE_PER_SLOT_MAX,
                },
            )
            .counting_cache_hits(metrics.token_cache_hits.clone())
            .counting_waiting(metrics.token_reviews_waiting.clone()),
        ));
    }
    tracing::info!(authenticators = ?chain, "authentication configured");
    Ok(chain)
}

#[derive(Clone)]
struct MonitoringState {
    registry: Arc<Registry>,
    metrics: Metrics,
    /// Set once start-up has loaded the CA material.
    authority: Arc<OnceLock<Arc<Authority>>>,
    serving: Arc<AtomicBool>,
    /// What start-up waits for (the Kubernetes API), while it waits.
    waiting: tokio::sync::watch::Receiver<Option<String>>,
}

/// What start-up is waiting for, shown by `/ready` until the CA serves.
struct StartupWait {
    waiting: tokio::sync::watch::Sender<Option<String>>,
}

async fn metrics_handler(State(state): State<MonitoringState>) -> impl IntoResponse {
    if let Some(authority) = state.authority.get() {
        update_expiry_metrics(
            authority,
            &state.metrics,
            state.serving.load(Ordering::Relaxed),
        );
    }
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
    let Some(authority) = state.authority.get() else {
        let waiting = state.waiting.borrow().clone();
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            match waiting {
                Some(reason) => {
                    format!("not ready: starting: waiting for the Kubernetes API: {reason}\n")
                }
                None => "not ready: starting\n".to_string(),
            },
        );
    };
    if let Some(reason) = authority.cannot_sign_reason(now) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        );
    }
    match authority.refused() {
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
/// probe that times out would restart a CA that is merely busy. Connections
/// are bounded ([`crate::monitoring`]). Completes when the server has
/// stopped after `stop` turned true.
fn spawn_monitoring_thread(
    listener: TcpListener,
    app: axum::Router,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::sync::oneshot::Receiver<()>, ServeError> {
    let addr = listener
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let bind_error = move |cause: std::io::Error| ServeError::Bind {
        flag: "--monitoring-listen",
        addr,
        cause,
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
                let stop = async move {
                    let _ = stop.wait_for(|stopped| *stopped).await;
                };
                crate::monitoring::serve(listener, app, crate::monitoring::Limits::default(), stop)
                    .await;
            });
            let _ = done_tx.send(());
        })
        .map_err(bind_error)?;
    Ok(done_rx)
}

/// Sets the gauges that follow the clock and the state: expiries, and
/// `meshca_ready`, which says what `/ready` says (0 while shutting down).
fn update_expiry_metrics(authority: &Authority, metrics: &Metrics, serving: bool) {
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
    metrics
        .ready
        .set(i64::from(serving && authority.can_sign(now)));
    metrics
        .reload_refused
        .set(i64::from(authority.refused().is_some()));
}

/// Writes the bundle in use to `root-cert.pem` in the data directory
/// (best effort: a read-only data directory only gets a warning).
fn write_bundle_file(dir: &std::path::Path, authority: &Authority) {
    let bundle = authority.bundle();
    if let Err(e) =
        store::create_private_dir(dir).and_then(|()| store::publish_bundle(dir, &bundle))
    {
        tracing::warn!(error = %e, "could not write the trust bundle to the data directory");
    }
}

/// Start-up step: the in-cluster work, when there is a cluster: leader
/// election, and under leadership the bundle ConfigMaps and (root in the
/// Secret) the root rotation; every replica follows the Secret. Returns
/// the elector's task, which releases the Lease once `draining` turns true.
// One argument per start-up product it uses, as the other steps take them.
#[allow(clippy::too_many_arguments)]
fn start_cluster_tasks(
    config: &Config,
    cluster: Option<&ClusterAccess>,
    root_in_secret: bool,
    authority: &Arc<Authority>,
    (revocations, crl): (
        &Arc<crate::revocation::Revocations>,
        tokio::sync::watch::Receiver<Option<Arc<String>>>,
    ),
    remote: &Arc<cluster::remote::RemoteClusters>,
    metrics: &Metrics,
    draining: tokio::sync::watch::Receiver<bool>,
    background: &mut tokio::task::JoinSet<()>,
) -> Option<tokio::task::JoinHandle<()>> {
    let ClusterAccess { client, namespace } = cluster?;
    let namespace = namespace.as_str();
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
    if root_in_secret {
        cluster::warn_if_rotation_unsafe(&policy, config.ttl.default, config.ca_expiry_margin);
    }
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
                    revocations: Some(revocations.clone()),
                },
            ),
        ));
    }
    let (to_remotes, remote) = (
        (authority.clone(), excluded.clone(), metrics.clone()),
        remote.clone(),
    );
    background.spawn(leader::while_leader(leader_rx.clone(), move || {
        let (authority, excluded, metrics) = to_remotes.clone();
        cluster::remote::publish_to_remote_clusters(remote.clone(), authority, excluded, metrics)
    }));
    background.spawn(leader::while_leader(leader_rx, move || {
        let bundles = bundle_publisher::publish_bundles(
            client.clone(),
            authority.clone(),
            excluded.clone(),
            metrics.clone(),
        );
        let crls = bundle_publisher::publish_everywhere(
            client.clone(),
            bundle_publisher::Published::CRL,
            crl.clone(),
            excluded.clone(),
            metrics.revocation.crl_configmap_writes.clone(),
        );
        let publish = async move {
            futures::join!(bundles, crls);
        };
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
    Some(elector)
}

/// Start-up step: the revocation list (the data directory's
/// `revocations.yaml`, in a cluster the ConfigMap `meshca-revocations`),
/// the CRL kept in the data directory, and with the Kubernetes API the
/// `istio-ca-crl` ConfigMaps (leader only, beside the bundle's).
fn start_revocations(
    config: &Config,
    cluster: Option<&ClusterAccess>,
    authority: &Arc<Authority>,
    metrics: &Metrics,
    background: &mut tokio::task::JoinSet<()>,
) -> (
    Arc<crate::revocation::Revocations>,
    tokio::sync::watch::Receiver<Option<Arc<String>>>,
) {
    use crate::revocation;
    let revocations = Arc::new(revocation::Revocations::new(
        config.issued_record_size,
        metrics.revocation.clone(),
    ));
    background.spawn(revocations.clone().follow_signing_ca(authority.clone()));
    background.spawn(revocation::watch_file(
        config.data_dir.clone(),
        revocations.clone(),
        revocation::FILE_CHECK_INTERVAL,
    ));
    if let Some(ClusterAccess { client, namespace }) = cluster {
        background.spawn(revocation::watch_configmap(
            client.clone(),
            namespace.clone(),
            revocations.clone(),
        ));
        // Every replica's revoked serials reach every replica's CRL.
        background.spawn(revocation::share_with_replicas(
            client.clone(),
            namespace.clone(),
            revocation::shared_configmap_name(),
            revocations.clone(),
        ));
    }
    let (crl_tx, crl_rx) = tokio::sync::watch::channel(None);
    background.spawn(revocation::maintain_crl(
        config.data_dir.clone(),
        authority.clone(),
        revocations.clone(),
        config.crl_refresh,
        crl_tx,
    ));
    (revocations, crl_rx)
}

/// The Kubernetes API, when there is one: the client and the namespace
/// meshca runs in.
struct ClusterAccess {
    client: kube::Client,
    namespace: String,
}

/// Start-up step: connects to the Kubernetes API (`--kubeconfig`, or the
/// pod's service account), if there is one.
async fn connect_to_cluster(config: &Config) -> Result<Option<ClusterAccess>, ServeError> {
    let client = kube_client(
        config.kubernetes.kubeconfig.as_deref(),
        config.kubernetes.api_timeout,
    )
    .await
    .map_err(ServeError::Kubernetes)?;
    Ok(client.map(|client| ClusterAccess {
        namespace: cluster::own_namespace(config.cluster.namespace.as_deref(), &client),
        client,
    }))
}

/// What meshca says when a flag needs the Kubernetes API and there is none.
fn needs_cluster(flag: &str, what_for: &str) -> ServeError {
    ServeError::Kubernetes(format!(
        "{flag} needs the Kubernetes API (--kubeconfig, or running in a pod) {what_for}"
    ))
}

/// Start-up step, before anything is written: refuses flags that need the
/// Kubernetes API when there is none (`has_cluster`), so a refused start
/// leaves the data directory as it was.
fn check_cluster_requirements(config: &Config, has_cluster: bool) -> Result<(), ServeError> {
    if has_cluster {
        return Ok(());
    }
    if config.cluster.pod_certificate_signer.is_some() {
        return Err(needs_cluster(
            "--pod-certificate-signer",
            "to watch PodCertificateRequests",
        ));
    }
    if config.discovered_jwt_issuer.is_some() {
        return Err(needs_cluster(
            "--jwt-issuer without --jwks",
            "for OIDC discovery",
        ));
    }
    if !config.trusted_node_agents.is_empty() {
        return Err(needs_cluster("--trusted-node-agent", "to check pods"));
    }
    Ok(())
}

/// Start-up step: with `--pod-certificate-signer`, checks (API discovery)
/// that the API server serves what the signer uses, so a cluster without
/// them gets one clear error at start instead of failing watches for ever.
async fn check_served_apis(
    config: &Config,
    cluster: Option<&ClusterAccess>,
    startup: &StartupWait,
) -> Result<(), ServeError> {
    let (Some(_), Some(ClusterAccess { client, .. })) =
        (&config.cluster.pod_certificate_signer, cluster)
    else {
        return Ok(());
    };
    kube_api::wait_for_api(
        "API discovery",
        config.kubernetes.startup_timeout,
        &startup.waiting,
        ServeError::Kubernetes,
        || async {
            kube_api::check_served(
                client,
                cluster::pod_certificates::API_GROUP_VERSION,
                cluster::pod_certificates::SERVED_RESOURCES,
                "--pod-certificate-signer",
            )
            .await
            .map_err(|e| match e {
                StepError::Transient(reason) => StepError::Transient(reason),
                StepError::Fatal(reason) => StepError::Fatal(ServeError::Kubernetes(reason)),
            })
        },
    )
    .await
}

/// Start-up step: loads the CA material. The root lives in the cluster's
/// Secret when there is a cluster and no plugged-in CA (`--ca-dir`); else
/// in the data directory. The flag tells whether it is in the Secret.
/// The Secret is waited for while the API server cannot answer (see
/// [`kube_api`]); an unusable Secret ends the start at once.
async fn load_ca_material(
    config: &Config,
    cluster: Option<&ClusterAccess>,
    startup: &StartupWait,
) -> Result<(CaMaterial, bool), ServeError> {
    let (None, Some(ClusterAccess { client, namespace })) = (&config.ca_dir, cluster) else {
        return Ok((load_material(config)?, false));
    };
    if config.hsm.is_some() {
        return Err(StoreError::HsmInClusterNeedsCaDir.into());
    }
    let material = kube_api::wait_for_api(
        "the CA Secret",
        config.kubernetes.startup_timeout,
        &startup.waiting,
        ServeError::Kubernetes,
        || async {
            cluster::load_or_create_root_secret(
                client,
                namespace,
                &config.trust_domain,
                config.cluster.root_ttl,
            )
            .await
            .map_err(|e| match &e {
                ClusterError::Api { cause, .. } if kube_api::is_transient(cause) => {
                    StepError::Transient(e.to_string())
                }
                _ => StepError::Fatal(ServeError::from(e)),
            })
        },
    )
    .await?;
    Ok((material, true))
}

/// Start-up step: the signing authority over `material`, with the
/// lifetime rules of the configuration. A CA that cannot sign still
/// serves, so `/ready` and the metrics can tell why.
fn start_authority(config: &Config, material: CaMaterial) -> Arc<Authority> {
    tracing::info!(
        source = ?material.source,
        trust_domain = %config.trust_domain,
        ca_not_after = %meshca_certs::Rfc3339(material.signing.validity().not_after),
        "CA material loaded"
    );
    let authority =
        Arc::new(Authority::new(material, config.ttl).with_expiry_margin(config.ca_expiry_margin));
    if let Some(reason) = authority.cannot_sign_reason(OffsetDateTime::now_utc()) {
        tracing::error!(error = %reason, "the CA cannot sign; serving anyway so /ready and the metrics can tell");
    }
    authority
}

/// Start-up step: who may ask for which identity. Only its own unless
/// node agents are trusted to ask for their node's pods, which needs the
/// pods watched.
fn build_authorizer(
    config: &Config,
    kube: Option<kube::Client>,
    remote: &Arc<cluster::remote::RemoteClusters>,
    background: &mut tokio::task::JoinSet<()>,
) -> Result<Authorizer, ServeError> {
    if config.trusted_node_agents.is_empty() {
        return Ok(Authorizer::own_identity_only());
    }
    let Some(client) = kube else {
        return Err(needs_cluster("--trusted-node-agent", "to check pods"));
    };
    let pods = Arc::new(PodIndex::with_max_watch_failure(
        config.pod_watch_failure_limit,
    ));
    background.spawn(watch_pods(client, pods.clone()));
    tracing::info!(agents = ?config.trusted_node_agents, "node-agent impersonation enabled");
    // Each remote cluster's callers are judged on that cluster's own pods.
    let local = Arc::new(NodeAgentPolicy::new(
        config.trusted_node_agents.clone(),
        pods,
    ));
    Ok(Authorizer::with_impersonation(Arc::new(
        cluster::remote::ClusterPolicies::new(local, remote.clone()),
    )))
}

/// Start-up step: registers the metrics.
fn register_metrics(metrics: &Metrics) -> Arc<Registry> {
    let registry = Arc::new(metrics.register());
    metrics.set_rotation_phase(
        RotationPhase::Stable.name(),
        &RotationPhase::ALL.map(RotationPhase::name),
    );
    registry
}

/// Start-up step: writes the data directory's `root-cert.pem` and keeps
/// it equal to the bundle in use, and takes a changed `--ca-dir` into use.
fn follow_ca_material(
    config: &Config,
    authority: &Arc<Authority>,
    metrics: &Metrics,
    background: &mut tokio::task::JoinSet<()>,
) {
    // Written before anything is served, so a client that finds the server
    // up finds the file too; then again on every change.
    let mut changes = authority.subscribe();
    write_bundle_file(&config.data_dir, authority);
    let (dir, bundle_of) = (config.data_dir.clone(), authority.clone());
    background.spawn(async move {
        while changes.changed().await.is_ok() {
            write_bundle_file(&dir, &bundle_of);
        }
    });
    if let Some(ca) = config.hsm.as_ref().and_then(|hsm| hsm.opened()) {
        background.spawn(crate::hsm::keep_fresh(
            ca,
            authority.clone(),
            metrics.clone(),
            config.ca_dir_check_interval,
        ));
    } else if let Some(dir) = &config.ca_dir {
        background.spawn(reload::watch_ca_dir(
            dir.clone(),
            authority.clone(),
            metrics.clone(),
            config.ca_dir_check_interval,
        ));
    }
}

/// The gRPC listening socket, bound once the CA can sign.
struct Listeners {
    grpc: TcpListener,
    bound: BoundAddrs,
    /// How connections on the gRPC port are accepted.
    limits: AcceptLimits,
}

/// First start-up step: binds the monitoring port, so `/healthz` answers
/// and `/ready` says what start-up waits for.
async fn bind_monitoring(config: &Config) -> Result<TcpListener, ServeError> {
    TcpListener::bind(config.monitoring_listen)
        .await
        .map_err(|cause| ServeError::Bind {
            flag: "--monitoring-listen",
            addr: config.monitoring_listen,
            cause,
        })
}

/// Start-up step: binds the gRPC port (with a deep accept queue).
async fn bind_grpc(config: &Config, monitoring: SocketAddr) -> Result<Listeners, ServeError> {
    let grpc = transport::bind_with_backlog(config.listen, transport::LISTEN_BACKLOG).map_err(
        |cause| ServeError::Bind {
            flag: "--listen",
            addr: config.listen,
            cause,
        },
    )?;
    let bound = BoundAddrs {
        grpc: grpc.local_addr().unwrap_or(config.listen),
        monitoring,
    };
    Ok(Listeners {
        grpc,
        bound,
        limits: AcceptLimits {
            max_connections: config.max_connections,
            max_connections_per_source: config.max_connections_per_source,
            evict_idle_after: config.evict_idle_connections_after,
            handshake_timeout: config.tls_handshake_timeout,
        },
    })
}

/// Start-up step: with `--oidc-listen`, serves the OIDC discovery
/// document and the JWKS of `jwt` on the monitoring port's bounded
/// HTTP/1.1 server until `stop` turns true.
async fn start_oidc(
    config: &Config,
    jwt: Option<&Arc<crate::jwt_svid::JwtIssuer>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), ServeError> {
    let Some(addr) = config.jwt_svid.oidc_listen else {
        return Ok(());
    };
    let Some(jwt) = jwt else {
        tracing::warn!(addr = %addr, "--oidc-listen ignored: JWT-SVIDs are off");
        return Ok(());
    };
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|cause| ServeError::Bind {
            flag: "--oidc-listen",
            addr,
            cause,
        })?;
    let bound = listener.local_addr().unwrap_or(addr);
    tracing::info!(oidc = %bound, "serving OIDC discovery for JWT-SVIDs");
    let app = crate::jwt_svid::oidc::router(jwt.clone());
    tokio::spawn(async move {
        let stop = async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        };
        crate::monitoring::serve(listener, app, crate::monitoring::Limits::default(), stop).await;
    });
    Ok(())
}

/// Start-up step: the server's own TLS identity, issued by `authority`
/// for `--server-dns` and renewed in `background` until `stop` turns true;
/// returns the TLS acceptor that presents it.
fn start_server_identity(
    config: &Config,
    authority: &Arc<Authority>,
    stop: tokio::sync::watch::Receiver<bool>,
    background: &mut tokio::task::JoinSet<()>,
) -> Result<TlsAcceptor, ServeError> {
    let resolver = server_identity::new_resolver(authority, &config.server_dns)?;
    let acceptor = TlsAcceptor::from(Arc::new(transport::server_config(resolver.clone())?));
    background.spawn(server_identity::renew_server_cert(
        resolver,
        authority.clone(),
        config.server_dns.clone(),
        stop,
    ));
    Ok(acceptor)
}

/// The gRPC service and what reports whether it serves: gRPC health, and
/// the flag `/ready` reads.
struct Service<H> {
    ca: CaService,
    health: HealthServer<H>,
    health_reporter: tonic_health::server::HealthReporter,
    serving: Arc<AtomicBool>,
}

/// Start-up step: the CA service (authentication, authorization, signing,
/// the rate limit) and its health, reported serving.
async fn build_service(
    config: &Config,
    authority: &Arc<Authority>,
    authn: AuthenticatorChain,
    authz: Authorizer,
    metrics: &Metrics,
    serving: Arc<AtomicBool>,
) -> Service<impl Health> {
    let ca = CaService::new(
        authority.clone(),
        authn,
        authz,
        metrics.clone(),
        config.cluster_id.clone(),
        config.max_concurrent_requests,
    )
    .with_rate_limit(config.rate_limit);
    let (health_reporter, health) = tonic_health::server::health_reporter();
    // A health request names one service: far below the CA's own limit.
    let health = health.max_decoding_message_size(transport::MAX_REQUEST_BYTES);
    health_reporter
        .set_serving::<IstioCertificateServiceServer<CaService>>()
        .await;
    Service {
        ca,
        health,
        health_reporter,
        serving,
    }
}

/// Start-up step: tells the caller and the log where the server listens.
fn announce(bound: BoundAddrs, on_bound: impl FnOnce(BoundAddrs)) {
    on_bound(bound);
    tracing::info!(
        grpc = %bound.grpc,
        monitoring = %bound.monitoring,
        "meshca is serving IstioCertificateService over TLS"
    );
}

/// Start-up step: serves `/metrics`, `/ready` and `/healthz` on the
/// monitoring port, on a thread of its own, until `stop` turns true.
fn start_monitoring(
    listener: TcpListener,
    registry: Arc<Registry>,
    metrics: &Metrics,
    authority: &Arc<OnceLock<Arc<Authority>>>,
    serving: &Arc<AtomicBool>,
    waiting: tokio::sync::watch::Receiver<Option<String>>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::sync::oneshot::Receiver<()>, ServeError> {
    let state = MonitoringState {
        registry,
        metrics: metrics.clone(),
        authority: authority.clone(),
        serving: serving.clone(),
        waiting,
    };
    let app = axum::Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/ready", get(ready_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(state);
    spawn_monitoring_thread(listener, app, stop)
}

/// Start-up step: once `shutdown` completes, marks the server not ready,
/// reports `NOT_SERVING` and turns `draining` true, so the gRPC servers
/// stop accepting and finish what is in flight.
fn drain_on_shutdown<H>(
    shutdown: impl Future<Output = ()> + Send + 'static,
    service: &Service<H>,
    draining: tokio::sync::watch::Sender<bool>,
) {
    let (serving, health) = (service.serving.clone(), service.health_reporter.clone());
    tokio::spawn(async move {
        shutdown.await;
        tracing::info!("shutdown requested: draining in-flight requests");
        serving.store(false, Ordering::Relaxed);
        health
            .set_not_serving::<IstioCertificateServiceServer<CaService>>()
            .await;
        let _ = draining.send(true);
    });
}

/// Serves gRPC until the listener stops, or, once draining, until the
/// connections have finished their requests in flight or
/// `--shutdown-grace` is over.
async fn serve_until_drained(
    config: &Config,
    incoming: ReceiverStream<Accepted>,
    service: Service<impl Health>,
    jwt: Option<Arc<crate::jwt_svid::JwtIssuer>>,
    metrics: &Metrics,
    mut draining: tokio::sync::watch::Receiver<bool>,
) {
    let Service { ca, health, .. } = service;
    // The same caller gate (authentication at HEADERS) for both services.
    let jwt = CallerGate::new(
        JwtSvidServiceServer::new(crate::jwt_svid::JwtSvidGrpc::new(ca.clone(), jwt))
            .max_decoding_message_size(transport::MAX_REQUEST_BYTES),
        ca.clone(),
    );
    let grpc = CallerGate::new(
        IstioCertificateServiceServer::new(ca.clone())
            .max_decoding_message_size(transport::MAX_REQUEST_BYTES),
        ca,
    );
    let settings = Http2Settings {
        max_concurrent_streams: config.max_concurrent_streams,
        request_timeout: config.request_timeout,
        max_connection_age: config.max_connection_age,
        max_connection_idle: config.max_connection_idle,
    };
    let open_requests = transport::OpenRequests::new(
        config.max_open_requests,
        metrics.open_requests_refused.clone(),
    );
    crate::heap_trim::spawn(open_requests.clone());
    let server = transport::serve_grpc(
        incoming,
        settings,
        grpc,
        jwt,
        health,
        draining.clone(),
        transport::SharedByConnections {
            idle_closes: metrics.grpc_idle_connections_closed.clone(),
            evictions: metrics.grpc_connections_evicted.clone(),
            open_requests,
            // Not counted in the metric of refused certificate requests.
            health_requests: transport::OpenRequests::new(
                crate::config::MAX_HEALTH_REQUESTS,
                Default::default(),
            ),
        },
    );
    tokio::pin!(server);
    tokio::select! {
        () = &mut server => {}
        _ = draining.wait_for(|d| *d) => {
            if tokio::time::timeout(config.shutdown_grace, &mut server).await.is_err() {
                tracing::warn!(grace = ?config.shutdown_grace, "shutdown grace period over; stopping with requests still in flight");
            }
        }
    }
}

/// Last step: stops the monitoring thread and the background tasks
/// (the server certificate's renewal included) and gives the Lease back,
/// so another replica takes over at once.
async fn stop(
    stop: tokio::sync::watch::Sender<bool>,
    monitoring: tokio::sync::oneshot::Receiver<()>,
    mut background: tokio::task::JoinSet<()>,
    elector: Option<tokio::task::JoinHandle<()>>,
) {
    let _ = stop.send(true);
    let _ = monitoring.await;
    background.abort_all();
    if let Some(elector) = elector {
        let _ = tokio::time::timeout(Duration::from_secs(3), elector).await;
    }
    tracing::info!("meshca stopped");
}

/// Runs the CA until `shutdown` completes, then drains in-flight requests
/// (up to `config.shutdown_grace`) and returns. `on_bound` is called with
/// the bound addresses once both listeners are up.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(BoundAddrs) + Send,
) -> Result<(), ServeError> {
    let cluster = connect_to_cluster(&config).await?;
    check_cluster_requirements(&config, cluster.is_some())?;
    let (mut background, metrics) = (tokio::task::JoinSet::new(), Metrics::default());
    let registry = register_metrics(&metrics);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let serving = Arc::new(AtomicBool::new(true));
    let (waiting_tx, waiting_rx) = tokio::sync::watch::channel(None);
    let startup = StartupWait {
        waiting: waiting_tx,
    };
    let loaded = Arc::new(OnceLock::new());
    let monitoring_listener = bind_monitoring(&config).await?;
    let monitoring_addr = monitoring_listener
        .local_addr()
        .unwrap_or(config.monitoring_listen);
    let monitoring = start_monitoring(
        monitoring_listener,
        registry,
        &metrics,
        &loaded,
        &serving,
        waiting_rx,
        stop_rx.clone(),
    )?;
    check_served_apis(&config, cluster.as_ref(), &startup).await?;
    let (material, root_in_secret) = load_ca_material(&config, cluster.as_ref(), &startup).await?;
    let authority = start_authority(&config, material);
    let kube = cluster.as_ref().map(|c| c.client.clone());
    let authn = build_authenticators(
        &config,
        &metrics,
        &authority,
        kube.clone(),
        &startup,
        &mut background,
    )
    .await?;
    let local = cluster
        .as_ref()
        .map(|c| (c.client.clone(), c.namespace.clone()));
    let remote = cluster::remote::start(&config, &authority, &metrics, local, &mut background)
        .await
        .map_err(ServeError::Kubernetes)?;
    let authz = build_authorizer(&config, kube, &remote, &mut background)?;
    let (draining_tx, draining) = tokio::sync::watch::channel(false);
    follow_ca_material(&config, &authority, &metrics, &mut background);
    let (revocations, crl) = start_revocations(
        &config,
        cluster.as_ref(),
        &authority,
        &metrics,
        &mut background,
    );
    let elector = start_cluster_tasks(
        &config,
        cluster.as_ref(),
        root_in_secret,
        &authority,
        (&revocations, crl),
        &remote,
        &metrics,
        draining.clone(),
        &mut background,
    );
    let jwt = Some(crate::jwt_svid::start_in(
        &config.jwt_svid,
        &config.data_dir,
        cluster
            .as_ref()
            .map(|c| (c.client.clone(), c.namespace.clone())),
        config.hsm.is_some(),
        &metrics.jwt_svid,
        stop_rx.clone(),
        &mut background,
    )?);
    start_oidc(&config, jwt.as_ref(), stop_rx.clone()).await?;
    let acceptor = start_server_identity(&config, &authority, stop_rx.clone(), &mut background)?;
    let listeners = bind_grpc(&config, monitoring_addr).await?;
    let service = build_service(&config, &authority, authn, authz, &metrics, serving).await;
    let service = Service {
        ca: service
            .ca
            .with_revocations(revocations)
            .with_remote_clusters(remote),
        ..service
    };
    // From here /ready looks at the CA: it can sign and gRPC is bound.
    update_expiry_metrics(&authority, &metrics, true);
    let _ = loaded.set(authority.clone());
    announce(listeners.bound, on_bound);
    drain_on_shutdown(shutdown, &service, draining_tx);
    let incoming = transport::tls_incoming(listeners.grpc, acceptor, listeners.limits, &metrics);
    serve_until_drained(&config, incoming, service, jwt, &metrics, draining).await;
    stop(stop_tx, monitoring, background, elector).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: crate::config::ServeArgs,
    }

    fn config(args: &[&str]) -> Config {
        let cli = Cli::parse_from(std::iter::once("meshca").chain(args.iter().copied()));
        Config::try_from(cli.serve).unwrap()
    }

    #[test]
    fn the_ready_gauge_says_what_ready_says_and_is_0_while_shutting_down() {
        let dir = tempfile::tempdir().unwrap();
        let material = store::load_or_create_data_dir(
            dir.path(),
            &Default::default(),
            time::Duration::days(365),
            OffsetDateTime::now_utc(),
        )
        .unwrap();
        let authority = Authority::new(material, Default::default());
        let metrics = Metrics::default();
        update_expiry_metrics(&authority, &metrics, true);
        assert_eq!(metrics.ready.get(), 1);
        update_expiry_metrics(&authority, &metrics, false);
        assert_eq!(metrics.ready.get(), 0, "shutting down: /ready answers 503");
    }

    #[test]
    fn flags_that_need_the_kubernetes_api_are_refused_without_one() {
        for (flags, expected) in [
            (
                &["--jwt-issuer", "https://kubernetes.default.svc"][..],
                "--jwt-issuer without --jwks needs the Kubernetes API",
            ),
            (
                &["--trusted-node-agent", "istio-system/ztunnel"][..],
                "--trusted-node-agent needs the Kubernetes API",
            ),
            (
                &["--pod-certificate-signer", "meshca.io/spiffe"][..],
                "--pod-certificate-signer needs the Kubernetes API",
            ),
        ] {
            let config = config(flags);
            let refusal = check_cluster_requirements(&config, false).unwrap_err();
            assert!(refusal.to_string().starts_with(expected), "{refusal}");
            assert!(check_cluster_requirements(&config, true).is_ok());
        }
        assert!(check_cluster_requirements(&config(&[]), false).is_ok());
    }
}
