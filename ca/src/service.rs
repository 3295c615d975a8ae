//! The gRPC service `istio.v1.auth.IstioCertificateService`:
//! authenticate, take a signing slot, verify the CSR, authorize, sign,
//! answer with the chain.
//!
//! Authentication comes before the slot: a caller that cannot
//! authenticate is refused without taking a slot or a place in the queue
//! ([`Admission`]), so junk does not compete with real renewals (the
//! TokenReview calls it may cost have bounds of their own). Refusals are
//! counted exactly but logged at most once per
//! [`meshca_serve::rate_limited_log::DEFAULT_LOG_INTERVAL`]
//! per kind, each line saying how many it stands for.

use std::sync::Arc;
use std::time::Instant;

use meshca_certs::{SpiffeId, VerifiedCsr};
use meshca_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateService;
use meshca_proto::{IstioCertificateRequest, IstioCertificateResponse, IMPERSONATED_IDENTITY_KEY};
use time::OffsetDateTime;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use crate::admission::Admission;
use crate::authn::{AuthenticatorChain, AuthnError, Caller, CallerKind, Credentials};
use crate::authority::{Authority, SignError};
use crate::authz::Authorizer;
use crate::metrics::Metrics;
use crate::rate_limit::{IssuanceRateLimit, RateLimitPolicy, Throttled};
use meshca_certs::profile::ProfileError;
use meshca_serve::rate_limited_log::RateLimitedLog;

/// Response metadata telling a gRPC client how long to wait before it
/// retries (gRPC's retry-pushback, in milliseconds).
pub(crate) const RETRY_PUSHBACK_HEADER: &str = "grpc-retry-pushback-ms";
/// Header naming the cluster a request is for (empty: this one).
pub(crate) const CLUSTER_ID_HEADER: &str = "clusterid";

/// One [`RateLimitedLog`] per kind of refusal.
#[derive(Debug, Default)]
struct RefusalLogs {
    cluster: RateLimitedLog,
    authentication: RateLimitedLog,
    csr: RateLimitedLog,
    authorization: RateLimitedLog,
    signing: RateLimitedLog,
}

/// The CA service.
#[derive(Clone)]
pub(crate) struct CaService {
    authority: Arc<Authority>,
    authn: AuthenticatorChain,
    authz: Authorizer,
    metrics: Metrics,
    cluster_id: String,
    admission: Arc<Admission>,
    refusal_logs: Arc<RefusalLogs>,
    rate_limit: Arc<IssuanceRateLimit>,
    revocations: Option<Arc<crate::revocation::Revocations>>,
    remote_clusters: Option<Arc<crate::cluster::remote::RemoteClusters>>,
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
    pub(crate) fn new(
        authority: Arc<Authority>,
        authn: AuthenticatorChain,
        authz: Authorizer,
        metrics: Metrics,
        cluster_id: String,
        max_concurrent_requests: usize,
    ) -> Self {
        let admission = Admission::new(max_concurrent_requests, metrics.requests_waiting.clone());
        Self {
            authority,
            authn,
            authz,
            metrics,
            cluster_id,
            admission: Arc::new(admission),
            refusal_logs: Arc::default(),
            rate_limit: Arc::new(IssuanceRateLimit::new(RateLimitPolicy::default())),
            revocations: None,
            remote_clusters: None,
        }
    }

    /// Authenticates a request whose `clusterid` names one of
    /// `remote_clusters` against that cluster only.
    pub(crate) fn with_remote_clusters(
        mut self,
        remote_clusters: Arc<crate::cluster::remote::RemoteClusters>,
    ) -> Self {
        self.remote_clusters = Some(remote_clusters);
        self
    }

    /// Refuses what `revocations` revokes and records what is issued.
    pub(crate) fn with_revocations(
        mut self,
        revocations: Arc<crate::revocation::Revocations>,
    ) -> Self {
        self.revocations = Some(revocations);
        self
    }

    /// Limits how often one identity gets a certificate (default:
    /// [`RateLimitPolicy::default`]).
    pub(crate) fn with_rate_limit(mut self, policy: RateLimitPolicy) -> Self {
        self.rate_limit = Arc::new(IssuanceRateLimit::new(policy));
        self
    }

    /// Counts a CreateCertificate request refused before it reached the
    /// handler (`citadel_server_csr_count` counts every request, as
    /// istiod's does).
    pub(crate) fn count_request_refused_at_headers(&self) {
        self.metrics.csr_count.inc();
    }

    /// Who is calling, from what the request's HEADERS carry (the
    /// `clusterid` and `authorization` headers) and the connection's client
    /// certificate chain: the cluster check and authentication, counted
    /// and logged (at most once per interval per kind). The caller gate
    /// runs this before the request's message is read.
    pub(crate) async fn who_is_calling(
        &self,
        headers: &http::HeaderMap,
        peer_chain: Option<Arc<Vec<rustls_pki_types::CertificateDer<'static>>>>,
    ) -> Result<Caller, Status> {
        let logs = &self.refusal_logs;
        let mut remote = None;
        if let Some(cluster) = headers.get(CLUSTER_ID_HEADER) {
            let cluster = cluster.to_str().unwrap_or("<non-ascii>");
            if !cluster.is_empty() && cluster != self.cluster_id {
                remote = self.remote_clusters.as_ref().and_then(|r| r.get(cluster));
            }
            if !cluster.is_empty() && cluster != self.cluster_id && remote.is_none() {
                self.metrics.authentication_failure_count.inc();
                let cluster = cluster.chars().take(128).collect::<String>();
                if let Some(unlogged) = logs.cluster.record() {
                    tracing::info!(requested = %cluster, served = %self.cluster_id, unlogged, "request for another cluster refused");
                }
                // The caller is not told which cluster this CA serves.
                return Err(Status::unauthenticated(format!(
                    "unknown cluster {cluster:?}: this CA does not serve it"
                )));
            }
        }
        let credentials = Credentials {
            bearer: bearer_token(headers),
            peer_chain,
        };
        let authenticated = match &remote {
            Some(cluster) => cluster.authenticate(&credentials).await,
            None => self.authn.authenticate(&credentials).await,
        };
        let cluster = remote.as_ref().map_or(self.cluster_id.as_str(), |c| c.id());
        match authenticated {
            Ok(caller) => Ok(caller),
            Err(AuthnError::Overloaded(what)) => {
                self.metrics.sign_error("overloaded");
                Err(Status::resource_exhausted(format!(
                    "the CA is overloaded: {what}; retry with backoff"
                )))
            }
            Err(e) => {
                self.metrics.authentication_failure_count.inc();
                tracing::debug!(cluster = %cluster, error = %e, "authentication failed");
                if let Some(unlogged) = logs.authentication.record() {
                    tracing::info!(cluster = %cluster, error = %e, unlogged, "authentication failed");
                }
                Err(match e {
                    AuthnError::Unavailable(_) => Status::unavailable(e.to_string()),
                    _ => Status::unauthenticated(e.to_string()),
                })
            }
        }
    }

    async fn handle(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let started = Instant::now();
        let logs = &self.refusal_logs;

        let caller = self.caller_of(&request).await?;
        let _slot = self.admit("certificate").await?;
        // Authenticated: the clusterid is the local cluster or a known remote one.
        let cluster = request
            .metadata()
            .get(CLUSTER_ID_HEADER)
            .and_then(|c| c.to_str().ok())
            .filter(|c| !c.is_empty())
            .unwrap_or(&self.cluster_id)
            .to_string();
        let request = request.into_inner();
        let csr = VerifiedCsr::from_pem(&request.csr).map_err(|e| {
            self.metrics.csr_parsing_err_count.inc();
            if let Some(unlogged) = logs.csr.record() {
                tracing::info!(caller = %caller.identity, error = %e, unlogged, "CSR refused");
            }
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
            .authorize_issuance(&caller, impersonated, csr.uri_sans(), Issued::Certificate)
            .await?;
        // A renewal by client certificate never extends the credential.
        let max_lifetime = match &caller.kind {
            CallerKind::ClientCertificate { lifetime, .. } => Some(*lifetime),
            CallerKind::Token { .. } => None,
        };
        let sign = || {
            self.authority.sign_workload_within(
                csr.subject_key(),
                &identity,
                request.validity_duration,
                max_lifetime,
                OffsetDateTime::now_utc(),
            )
        };
        // A key in an HSM (direct mode) may make the call wait for a
        // session: the runtime moves its other tasks off this thread.
        let signed = if self.authority.signs_externally() {
            tokio::task::block_in_place(sign)
        } else {
            sign()
        };
        let issued = signed
            .map_err(|e| {
                match &e {
                    SignError::TtlTooLong { .. } => self.metrics.sign_error("ttl_too_long"),
                    SignError::CaOutsideValidity { .. } => self.metrics.sign_error("ca_cert_invalid"),
                    SignError::Signing(ProfileError::KeyBusy(_)) => self.metrics.sign_error("hsm_busy"),
                    SignError::Signing(ProfileError::KeyUnavailable(_)) => self.metrics.sign_error("hsm_unavailable"),
                    SignError::Signing(_) => self.metrics.sign_error("signing"),
                }
                if let Some(unlogged) = logs.signing.record() {
                    tracing::warn!(caller = %caller.identity, identity = %identity, error = %e, unlogged, "signing refused");
                }
                match e {
                    SignError::TtlTooLong { .. } => Status::invalid_argument(e.to_string()),
                    SignError::CaOutsideValidity { .. } => Status::unavailable(e.to_string()),
                    SignError::Signing(ProfileError::KeyBusy(_)) => Status::resource_exhausted(
                        "the CA is overloaded: every HSM session is signing and the queue is full; retry with backoff",
                    ),
                    SignError::Signing(ProfileError::KeyUnavailable(_)) => {
                        Status::unavailable("the CA's HSM key cannot sign now; retry with backoff")
                    }
                    SignError::Signing(_) => Status::internal("signing the certificate failed"),
                }
            })?;

        let method = match &caller.kind {
            CallerKind::Token { .. } => "token",
            CallerKind::ClientCertificate { .. } => "client-certificate",
        };
        tracing::info!(
            target: "meshca::audit",
            cluster = %cluster,
            caller = %caller.identity,
            authn = method,
            pod = caller.pod_name.as_deref().unwrap_or(""),
            identity = %identity,
            serial = %issued.serial_hex,
            not_after = %meshca_certs::Rfc3339(issued.not_after),
            "issued certificate"
        );
        if let Some(revocations) = &self.revocations {
            revocations.record(&issued, &identity, self.authz.node_of(&caller).as_deref());
        }
        self.metrics.success_cert_issuance_count.inc();
        self.metrics
            .issuance_duration_seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(Response::new(IstioCertificateResponse {
            cert_chain: issued.chain_pem,
        }))
    }
}

/// What a request has issued: each kind has its own budget in the
/// per-identity rate limit (one table, so one bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Issued {
    /// An X.509-SVID (`CreateCertificate`).
    Certificate,
    /// A JWT-SVID (`MintJwtSvid`).
    JwtSvid,
}

impl Issued {
    fn plural(self) -> &'static str {
        match self {
            Issued::Certificate => "certificates",
            Issued::JwtSvid => "JWT-SVIDs",
        }
    }
}

impl CaService {
    /// Who is calling `request`: known already when the request came
    /// through the caller gate (at its HEADERS), else authenticated now.
    pub(crate) async fn caller_of<T>(&self, request: &Request<T>) -> Result<Caller, Status> {
        match request.extensions().get::<Caller>() {
            Some(caller) => Ok(caller.clone()),
            None => {
                self.who_is_calling(request.metadata().as_ref(), request.peer_certs())
                    .await
            }
        }
    }

    /// A signing slot ([`Admission`]), or `RESOURCE_EXHAUSTED` when the CA
    /// is overloaded; `what` names the requests in the message.
    pub(crate) async fn admit(&self, what: &str) -> Result<crate::admission::Slot<'_>, Status> {
        match self.admission.admit().await {
            Some(slot) => Ok(slot),
            None => {
                self.metrics.sign_error("overloaded");
                Err(Status::resource_exhausted(format!(
                    "the CA is overloaded: too many {what} requests in flight; retry with backoff"
                )))
            }
        }
    }

    /// Which identity `caller` gets (its own, or the one it impersonates,
    /// under the same rules for every kind of SVID), then the
    /// per-identity rate limit of `issued`. Refusals are counted and
    /// logged (at most once per interval).
    pub(crate) async fn authorize_issuance(
        &self,
        caller: &Caller,
        impersonated: Option<&str>,
        requested: &[SpiffeId],
        issued: Issued,
    ) -> Result<SpiffeId, Status> {
        let identity = self
            .authz
            .authorize(caller, impersonated, requested)
            .await
            .map_err(|e| {
                self.metrics.id_extraction_err_count.inc();
                if let Some(unlogged) = self.refusal_logs.authorization.record() {
                    tracing::info!(caller = %caller.identity, error = %e, unlogged, "request not authorized");
                }
                match e {
                    crate::authz::AuthzError::Unavailable(_) => Status::unavailable(e.to_string()),
                    _ => Status::permission_denied(e.to_string()),
                }
            })?;
        if let Some(revocations) = &self.revocations {
            revocations.refuse_revoked(caller, &identity, self.authz.node_of(caller).as_deref())?;
        }
        self.check_rate(caller, &identity, issued)?;
        Ok(identity)
    }

    /// The per-identity rate limit: keyed by the identity issued and the
    /// pod that asks (when its token names one), so each sidecar and each
    /// node agent has its own budget per identity, and per kind of SVID.
    fn check_rate(
        &self,
        caller: &Caller,
        identity: &SpiffeId,
        issued: Issued,
    ) -> Result<(), Status> {
        let kind = match issued {
            Issued::Certificate => "",
            Issued::JwtSvid => "jwt ",
        };
        let key = match caller.pod_name.as_deref() {
            Some(pod) => format!("{kind}{identity} {pod}"),
            None => format!("{kind}{identity}"),
        };
        let Err(Throttled { retry_after }) =
            self.rate_limit.check(&key, tokio::time::Instant::now())
        else {
            return Ok(());
        };
        self.metrics.issuance_throttled.inc();
        self.metrics.sign_error("rate_limited");
        let policy = self.rate_limit.policy();
        let retry_ms = retry_after.as_millis().max(1);
        tracing::debug!(caller = %caller.identity, identity = %identity, retry_ms = %retry_ms, "issuance rate limit");
        let mut metadata = MetadataMap::new();
        if let Ok(value) = retry_ms.to_string().parse() {
            metadata.insert(RETRY_PUSHBACK_HEADER, value);
        }
        Err(Status::with_metadata(
            tonic::Code::ResourceExhausted,
            format!(
                "too many {} for {identity}: at most {} at once and one per {:?} after that; retry in {:.1}s",
                issued.plural(),
                policy.burst,
                policy.interval,
                retry_after.as_secs_f64()
            ),
            metadata,
        ))
    }
}

#[tonic::async_trait]
impl IstioCertificateService for CaService {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        self.metrics.csr_count.inc();
        self.handle(request).await
    }
}

/// The first `authorization` value of the form `Bearer <token>`.
pub(crate) fn bearer_token(headers: &http::HeaderMap) -> Option<String> {
    headers.get_all("authorization").iter().find_map(|value| {
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
mod refusal_log_tests;
#[cfg(test)]
mod renewal_pace_tests;
#[cfg(test)]
mod test_ca;

#[cfg(test)]
mod tests {
    use super::*;
    use meshca_certs::TrustDomain;
    use std::time::Duration;

    /// A service with one signing slot and no authenticator (every
    /// credential is refused).
    fn one_slot_service(dir: &std::path::Path) -> CaService {
        let material = crate::store::load_or_create_data_dir(
            dir,
            &TrustDomain::default(),
            time::Duration::days(3650),
            OffsetDateTime::now_utc(),
        )
        .unwrap();
        CaService::new(
            Arc::new(Authority::new(material, Default::default())),
            AuthenticatorChain::new(),
            Authorizer::own_identity_only(),
            Metrics::default(),
            "Kubernetes".into(),
            1,
        )
    }

    fn request(token: &str, cluster: Option<&str>) -> Request<IstioCertificateRequest> {
        let mut request = Request::new(IstioCertificateRequest::default());
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        if let Some(cluster) = cluster {
            request
                .metadata_mut()
                .insert(CLUSTER_ID_HEADER, cluster.parse().unwrap());
        }
        request
    }

    #[tokio::test(start_paused = true)]
    async fn unauthenticated_requests_take_no_slot_and_no_place_in_the_queue() {
        let dir = tempfile::tempdir().unwrap();
        let service = one_slot_service(dir.path());
        // A real renewal holds the only slot.
        let _held = service.admission.admit().await.unwrap();
        let started = tokio::time::Instant::now();
        for _ in 0..1_000 {
            let status = service
                .create_certificate(request("junk", None))
                .await
                .unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
        }
        assert_eq!(started.elapsed(), Duration::ZERO, "refused without waiting");
        assert_eq!(service.metrics.requests_waiting.get(), 0);
        assert_eq!(service.metrics.authentication_failure_count.get(), 1_000);
    }

    #[tokio::test]
    async fn a_wrong_cluster_is_refused_without_naming_ours() {
        let dir = tempfile::tempdir().unwrap();
        let service = one_slot_service(dir.path());
        let status = service
            .create_certificate(request("junk", Some("other")))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        assert!(status.message().contains("\"other\""), "{status:?}");
        assert!(!status.message().contains("Kubernetes"), "{status:?}");
    }

    #[test]
    fn bearer_is_the_first_bearer_value() {
        let mut md = http::HeaderMap::new();
        md.append("authorization", "Basic abc".parse().unwrap());
        md.append("authorization", "Bearer tok1".parse().unwrap());
        md.append("authorization", "Bearer tok2".parse().unwrap());
        assert_eq!(bearer_token(&md).as_deref(), Some("tok1"));
        assert_eq!(bearer_token(&http::HeaderMap::new()), None);
        let mut md = http::HeaderMap::new();
        md.append("authorization", "Bearer ".parse().unwrap());
        assert_eq!(bearer_token(&md), None);
    }
}
