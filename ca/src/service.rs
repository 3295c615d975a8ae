//! The gRPC service `istio.v1.auth.IstioCertificateService`:
//! authenticate, authorize, verify the CSR, sign, answer with the chain.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshca_certs::VerifiedCsr;
use meshca_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateService;
use meshca_proto::{IstioCertificateRequest, IstioCertificateResponse, IMPERSONATED_IDENTITY_KEY};
use time::OffsetDateTime;
use tokio::sync::Semaphore;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use crate::authn::{AuthenticatorChain, AuthnError, CallerKind, Credentials};
use crate::authority::{Authority, SignError};
use crate::authz::Authorizer;
use crate::event_loops::SpareLoops;
use crate::metrics::Metrics;

/// Header naming the cluster a request is for (empty: this one).
pub const CLUSTER_ID_HEADER: &str = "clusterid";
/// How long a request waits for a signing slot before `RESOURCE_EXHAUSTED`.
pub const QUEUE_WAIT: Duration = Duration::from_secs(2);
/// Requests that may wait for a slot, per slot; beyond that a request is
/// refused at once with `RESOURCE_EXHAUSTED`, so a burst (a mass restart)
/// gets fast answers to back off on instead of a pile of timeouts.
pub const QUEUE_PER_SLOT: usize = 8;

/// The CA service.
#[derive(Clone)]
pub struct CaService {
    authority: Arc<Authority>,
    authn: AuthenticatorChain,
    authz: Authorizer,
    metrics: Metrics,
    cluster_id: String,
    limiter: Arc<Semaphore>,
    waiting: Arc<AtomicUsize>,
    max_waiting: usize,
    spare_loops: Option<SpareLoops>,
}

impl std::fmt::Debug for CaService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaService")
            .field("authn", &self.authn)
            .field("cluster_id", &self.cluster_id)
            .finish_non_exhaustive()
    }
}

impl CaService {
    /// A service signing with `authority`.
    pub fn new(
        authority: Arc<Authority>,
        authn: AuthenticatorChain,
        authz: Authorizer,
        metrics: Metrics,
        cluster_id: String,
        max_concurrent_requests: usize,
    ) -> Self {
        Self {
            authority,
            authn,
            authz,
            metrics,
            cluster_id,
            limiter: Arc::new(Semaphore::new(max_concurrent_requests.max(1))),
            waiting: Arc::new(AtomicUsize::new(0)),
            max_waiting: max_concurrent_requests.max(1) * QUEUE_PER_SLOT,
            spare_loops: None,
        }
    }

    /// Served from [`crate::event_loops`]: a request whose loop is backed
    /// up runs on an idle loop instead.
    pub fn with_spare_loops(mut self, spare_loops: SpareLoops) -> Self {
        self.spare_loops = Some(spare_loops);
        self
    }

    async fn handle(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let started = Instant::now();
        let overloaded = || {
            self.metrics.sign_error("overloaded");
            Status::resource_exhausted(
                "the CA is overloaded: too many certificate requests in flight; retry with backoff",
            )
        };
        let _permit = match self.limiter.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                // A bounded queue: wait briefly if there is room, else refuse now.
                if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.max_waiting {
                    self.waiting.fetch_sub(1, Ordering::AcqRel);
                    return Err(overloaded());
                }
                let acquired =
                    tokio::time::timeout(QUEUE_WAIT, self.limiter.clone().acquire_owned()).await;
                self.waiting.fetch_sub(1, Ordering::AcqRel);
                match acquired {
                    Ok(Ok(permit)) => permit,
                    _ => return Err(overloaded()),
                }
            }
        };

        let metadata = request.metadata();
        if let Some(cluster) = metadata.get(CLUSTER_ID_HEADER) {
            let cluster = cluster.to_str().unwrap_or("<non-ascii>");
            if !cluster.is_empty() && cluster != self.cluster_id {
                self.metrics.authentication_failure_count.inc();
                return Err(Status::unauthenticated(format!(
                    "unknown cluster {:?}: this CA serves cluster {:?}",
                    cluster.chars().take(128).collect::<String>(),
                    self.cluster_id
                )));
            }
        }
        let credentials = Credentials {
            bearer: bearer_token(metadata),
            peer_chain: request.peer_certs(),
        };
        let caller = match self.authn.authenticate(&credentials).await {
            Ok(caller) => caller,
            Err(e) => {
                self.metrics.authentication_failure_count.inc();
                tracing::info!(error = %e, "authentication failed");
                return Err(match e {
                    AuthnError::Unavailable(_) => Status::unavailable(e.to_string()),
                    _ => Status::unauthenticated(e.to_string()),
                });
            }
        };

        let request = request.into_inner();
        let csr = VerifiedCsr::from_pem(&request.csr).map_err(|e| {
            self.metrics.csr_parsing_err_count.inc();
            tracing::info!(caller = %caller.identity, error = %e, "CSR refused");
            Status::invalid_argument(e.to_string())
        })?;

        let impersonated = request
            .metadata
            .as_ref()
            .and_then(|m| m.fields.get(IMPERSONATED_IDENTITY_KEY))
            .and_then(|v| match &v.kind {
                Some(prost_types::value::Kind::StringValue(s)) => Some(s.as_str()),
                _ => None,
            });
        let identity = self
            .authz
            .authorize(&caller, impersonated, csr.uri_sans())
            .await
            .map_err(|e| {
                self.metrics.id_extraction_err_count.inc();
                tracing::info!(caller = %caller.identity, error = %e, "request not authorized");
                match e {
                    crate::authz::AuthzError::Unavailable(_) => Status::unavailable(e.to_string()),
                    _ => Status::permission_denied(e.to_string()),
                }
            })?;

        let issued = self
            .authority
            .sign_workload(
                csr.subject_key(),
                &identity,
                request.validity_duration,
                OffsetDateTime::now_utc(),
            )
            .map_err(|e| {
                match &e {
                    SignError::TtlTooLong { .. } => self.metrics.sign_error("ttl_too_long"),
                    SignError::CaOutsideValidity { .. } => self.metrics.sign_error("ca_cert_invalid"),
                    SignError::Signing(_) => self.metrics.sign_error("signing"),
                }
                tracing::warn!(caller = %caller.identity, identity = %identity, error = %e, "signing refused");
                match e {
                    SignError::TtlTooLong { .. } => Status::invalid_argument(e.to_string()),
                    SignError::CaOutsideValidity { .. } => Status::unavailable(e.to_string()),
                    SignError::Signing(_) => Status::internal("signing the certificate failed"),
                }
            })?;

        let method = match &caller.kind {
            CallerKind::Token { .. } => "token",
            CallerKind::ClientCertificate { .. } => "client-certificate",
        };
        tracing::info!(
            target: "meshca::audit",
            caller = %caller.identity,
            authn = method,
            pod = caller.pod_name.as_deref().unwrap_or(""),
            identity = %identity,
            serial = %issued.serial_hex,
            not_after = %issued.not_after,
            "issued certificate"
        );
        self.metrics.success_cert_issuance_count.inc();
        self.metrics
            .issuance_duration_seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(Response::new(IstioCertificateResponse {
            cert_chain: issued.chain_pem,
        }))
    }
}

#[tonic::async_trait]
impl IstioCertificateService for CaService {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        self.metrics.csr_count.inc();
        if let Some(idle) = self.spare_loops.as_ref().and_then(SpareLoops::claim) {
            self.metrics.requests_moved.inc();
            let service = self.clone();
            return idle
                .spawn(async move { service.handle(request).await })
                .await
                .unwrap_or_else(|e| {
                    Err(if e.is_panic() {
                        Status::internal("issuing the certificate failed")
                    } else {
                        Status::unavailable("the CA is shutting down; retry")
                    })
                });
        }
        self.handle(request).await
    }
}

/// The first `authorization` value of the form `Bearer <token>`.
pub fn bearer_token(metadata: &MetadataMap) -> Option<String> {
    metadata.get_all("authorization").iter().find_map(|value| {
        let value = value.to_str().ok()?;
        let (scheme, token) = value.split_once(' ')?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return None;
        }
        let token = token.trim();
        (!token.is_empty()).then(|| token.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_is_the_first_bearer_value() {
        let mut md = MetadataMap::new();
        md.append("authorization", "Basic abc".parse().unwrap());
        md.append("authorization", "Bearer tok1".parse().unwrap());
        md.append("authorization", "Bearer tok2".parse().unwrap());
        assert_eq!(bearer_token(&md).as_deref(), Some("tok1"));
        assert_eq!(bearer_token(&MetadataMap::new()), None);
        let mut md = MetadataMap::new();
        md.append("authorization", "Bearer ".parse().unwrap());
        assert_eq!(bearer_token(&md), None);
    }
}
