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
use crate::config::Config;
use crate::metrics::{encode_text, Metrics};
use crate::service::CaService;
use crate::store::{self, CaMaterial, StoreError};
use crate::tls::{self, TlsError};

/// Largest gRPC request message accepted (a CSR is at most 32 KiB of PEM).
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// CA material could not be loaded.
    #[error(transparent)]
    Store(#[from] StoreError),
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
    .with_refresher(fetcher);
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
        })?;
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
        })?;
        chain = chain.with(Arc::new(authn));
    }
    if let Some(client) = kube {
        if let Some(issuer) = &config.discovered_jwt_issuer {
            chain = chain.with(
                discovered_jwt_authenticator(config, issuer, client.clone(), background).await?,
            );
        }
        chain = chain.with(Arc::new(TokenReviewAuthenticator::new(
            client,
            TokenReviewConfig {
                audiences: config.token_audiences.clone(),
                trust_domain: config.trust_domain.clone(),
                cache_ttl: config.kubernetes.token_review_cache_ttl,
                timeout: config.kubernetes.api_timeout,
                max_in_flight: config.kubernetes.api_max_in_flight,
            },
        )));
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
    let serving = state.serving.load(Ordering::Relaxed);
    let can_sign = state.authority.can_sign(now);
    if serving && can_sign {
        (StatusCode::OK, "ready\n".to_string())
    } else if !serving {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: shutting down\n".to_string(),
        )
    } else {
        let v = state.authority.current().material.signing.validity();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: the CA cannot sign (its certificate is valid from {} until {})\n",
                v.not_before, v.not_after
            ),
        )
    }
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
    let material = load_material(&config)?;
    tracing::info!(
        source = ?material.source,
        trust_domain = %config.trust_domain,
        ca_not_after = %material.signing.validity().not_after,
        "CA material loaded"
    );
    let authority = Arc::new(Authority::new(material, config.ttl));
    let kube = kube_client(
        config.kubernetes.kubeconfig.as_deref(),
        config.kubernetes.api_timeout,
    )
    .await
    .map_err(ServeError::Kubernetes)?;
    let mut background = tokio::task::JoinSet::new();
    let authn = build_authenticators(&config, &authority, kube.clone(), &mut background).await?;
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
    let metrics = Metrics::default();
    let registry = Arc::new(metrics.register());
    update_expiry_metrics(&authority, &metrics);

    let resolver = tls::new_resolver(&authority, &config.server_dns)?;
    let tls_config = tls::server_config(resolver.clone())?;
    let acceptor = TlsAcceptor::from(Arc::new(tls_config));

    let grpc_listener =
        TcpListener::bind(config.listen)
            .await
            .map_err(|source| ServeError::Bind {
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

    let service = CaService::new(
        authority.clone(),
        authn,
        authz,
        metrics.clone(),
        config.cluster_id.clone(),
        config.max_concurrent_requests,
    );
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
    let mut monitoring_stop = stop_rx.clone();
    let monitoring = tokio::spawn(async move {
        let _ = axum::serve(monitoring_listener, app)
            .with_graceful_shutdown(async move {
                let _ = monitoring_stop.changed().await;
            })
            .await;
    });

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
    let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
    let (draining_tx, mut draining_rx) = tokio::sync::watch::channel(false);
    let serving_flag = serving.clone();
    let reporter = health_reporter.clone();
    tokio::spawn(async move {
        shutdown.await;
        tracing::info!("shutdown requested: draining in-flight requests");
        serving_flag.store(false, Ordering::Relaxed);
        reporter
            .set_not_serving::<IstioCertificateServiceServer<CaService>>()
            .await;
        let _ = drain_tx.send(());
        let _ = draining_tx.send(true);
    });

    let grpc =
        IstioCertificateServiceServer::new(service).max_decoding_message_size(MAX_REQUEST_BYTES);
    let incoming = tls::tls_incoming(grpc_listener, acceptor);
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(1024))
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .layer(tower::util::MapResponseLayer::new(
            oversized_is_invalid_argument,
        ))
        .add_service(health_service)
        .add_service(grpc)
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = drain_rx.await;
        });
    tokio::pin!(server);
    let result = tokio::select! {
        r = &mut server => r,
        _ = draining_rx.wait_for(|d| *d) => {
            match tokio::time::timeout(config.shutdown_grace, &mut server).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!(grace = ?config.shutdown_grace, "shutdown grace period over; stopping with requests still in flight");
                    Ok(())
                }
            }
        }
    };
    let _ = stop_tx.send(true);
    let _ = monitoring.await;
    renewal.abort();
    background.abort_all();
    tracing::info!("meshca stopped");
    result.map_err(ServeError::from)
}
