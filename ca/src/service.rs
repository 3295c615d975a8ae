//! The gRPC service `istio.v1.auth.IstioCertificateService`:
//! authenticate, authorize, verify the CSR, sign, answer with the chain.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use meshca_certs::VerifiedCsr;
use meshca_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateService;
use meshca_proto::{IstioCertificateRequest, IstioCertificateResponse, IMPERSONATED_IDENTITY_KEY};
use prometheus_client::metrics::gauge::Gauge;
use time::OffsetDateTime;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use crate::authn::{AuthenticatorChain, AuthnError, CallerKind, Credentials};
use crate::authority::{Authority, SignError};
use crate::authz::Authorizer;
use crate::metrics::Metrics;
use crate::transport::SpareLoops;

/// Header naming the cluster a request is for (empty: this one).
pub(crate) const CLUSTER_ID_HEADER: &str = "clusterid";
/// How long a request waits for a signing slot before `RESOURCE_EXHAUSTED`.
pub(crate) const QUEUE_WAIT: Duration = Duration::from_secs(2);
/// Requests that may wait for a slot, per slot, whatever the CA's pace;
/// beyond the queue ([`Admission`]) a request is refused at once with
/// `RESOURCE_EXHAUSTED`, so a burst (a mass restart) gets fast answers to
/// back off on instead of a pile of timeouts.
pub(crate) const QUEUE_PER_SLOT: usize = 8;
/// The queue never holds more than this many requests per slot, however
/// fast the CA is (each waiting request holds its CSR and token).
pub(crate) const QUEUE_PER_SLOT_MAX: usize = 64;
/// Shortest time over which the pace of finished requests is measured.
const PACE_WINDOW: Duration = Duration::from_millis(20);

/// The CA service.
#[derive(Clone)]
pub(crate) struct CaService {
    authority: Arc<Authority>,
    authn: AuthenticatorChain,
    authz: Authorizer,
    metrics: Metrics,
    cluster_id: String,
    admission: Arc<Admission>,
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
            spare_loops: None,
        }
    }

    /// Served from [`crate::event_loops`]: a request whose loop is backed
    /// up runs on an idle loop instead.
    pub(crate) fn with_spare_loops(mut self, spare_loops: SpareLoops) -> Self {
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
        let Some(_slot) = self.admission.admit().await else {
            return Err(overloaded());
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

/// Which requests are served now, which wait, which are refused.
///
/// At most `slots` requests are handled at once. More wait for a slot, at
/// most [`QUEUE_WAIT`] each, in a queue whose length follows the CA's
/// measured pace: as many as it finishes in half of [`QUEUE_WAIT`], never
/// fewer than [`QUEUE_PER_SLOT`] per slot, never more than
/// [`QUEUE_PER_SLOT_MAX`]. A CA that answers 12,000 requests a second
/// (TokenReview with 64 API calls of 5 ms in flight) thus takes a burst of
/// 10,000 at once instead of refusing three quarters of it, while one whose
/// API answers slowly keeps a short queue and refuses the rest at once,
/// with nothing left to time out.
#[derive(Debug)]
pub(crate) struct Admission {
    limiter: Arc<Semaphore>,
    /// Requests waiting for a slot (exported as `meshca_requests_waiting`).
    waiting: Gauge<i64>,
    min_waiting: usize,
    max_waiting: usize,
    finished: AtomicU64,
    pace: Mutex<PaceWindow>,
    epoch: tokio::time::Instant,
}

/// The pace measured last: finished requests per second since `at`.
#[derive(Debug, Default)]
struct PaceWindow {
    at: Duration,
    finished: u64,
    per_second: f64,
}

/// A request's slot: given back, and counted as finished, when dropped.
#[derive(Debug)]
pub(crate) struct Slot<'a> {
    _permit: OwnedSemaphorePermit,
    admission: &'a Admission,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.admission.finished.fetch_add(1, Ordering::Relaxed);
    }
}

/// A request's place in the queue, given up when dropped.
struct InQueue<'a> {
    waiting: &'a Gauge<i64>,
    /// Requests that were waiting when this one came.
    ahead: usize,
}

impl<'a> InQueue<'a> {
    fn enter(waiting: &'a Gauge<i64>) -> Self {
        let ahead = usize::try_from(waiting.inc()).unwrap_or(0);
        Self { waiting, ahead }
    }
}

impl Drop for InQueue<'_> {
    fn drop(&mut self) {
        self.waiting.dec();
    }
}

impl Admission {
    /// `slots` requests at once (at least one); `waiting` follows the
    /// number of requests in the queue.
    pub(crate) fn new(slots: usize, waiting: Gauge<i64>) -> Self {
        let slots = slots.max(1);
        Self {
            limiter: Arc::new(Semaphore::new(slots)),
            waiting,
            min_waiting: slots * QUEUE_PER_SLOT,
            max_waiting: slots * QUEUE_PER_SLOT_MAX,
            finished: AtomicU64::new(0),
            pace: Mutex::new(PaceWindow::default()),
            epoch: tokio::time::Instant::now(),
        }
    }

    /// A slot now, or after waiting in the queue; `None`: refused (the
    /// queue is full, or no slot came within [`QUEUE_WAIT`]).
    pub(crate) async fn admit(&self) -> Option<Slot<'_>> {
        let permit = match self.limiter.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                // Counted out when this future ends, however it ends: a
                // request cancelled while it waits (its client gone, its
                // timeout) must not keep a place in the queue.
                let in_queue = InQueue::enter(&self.waiting);
                if in_queue.ahead >= self.min_waiting && in_queue.ahead >= self.queue_length() {
                    return None;
                }
                let acquired =
                    tokio::time::timeout(QUEUE_WAIT, self.limiter.clone().acquire_owned()).await;
                drop(in_queue);
                acquired.ok()?.ok()?
            }
        };
        Some(Slot {
            _permit: permit,
            admission: self,
        })
    }

    /// How many may wait now: what the CA finishes in half of
    /// [`QUEUE_WAIT`] at its last measured pace, within the bounds.
    /// Only called when the floor is reached, i.e. in a burst.
    pub(crate) fn queue_length(&self) -> usize {
        let pace = self.pace_per_second();
        let answerable = (pace * QUEUE_WAIT.as_secs_f64() / 2.0) as usize;
        answerable.clamp(self.min_waiting, self.max_waiting)
    }

    /// Finished requests per second, over the time since the previous
    /// measurement (at least [`PACE_WINDOW`]); after a quiet spell the
    /// window is long and the pace low, so the queue starts at its floor.
    fn pace_per_second(&self) -> f64 {
        let now = self.epoch.elapsed();
        let finished = self.finished.load(Ordering::Relaxed);
        let mut window = self.pace.lock().unwrap_or_else(|e| e.into_inner());
        let span = now.saturating_sub(window.at);
        if span >= PACE_WINDOW {
            window.per_second =
                finished.saturating_sub(window.finished) as f64 / span.as_secs_f64();
            window.at = now;
            window.finished = finished;
        }
        window.per_second
    }
}

/// The first `authorization` value of the form `Bearer <token>`.
pub(crate) fn bearer_token(metadata: &MetadataMap) -> Option<String> {
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

    #[tokio::test(start_paused = true)]
    async fn the_queue_follows_the_pace_of_finished_requests() {
        let waiting = Gauge::default();
        let admission = Admission::new(4, waiting.clone());
        // Idle: the floor, 8 per slot.
        assert_eq!(admission.queue_length(), 32);

        // 4 slots held, 32 waiting: the next is refused at once.
        let held: Vec<_> = futures::future::join_all((0..4).map(|_| admission.admit()))
            .await
            .into_iter()
            .map(Option::unwrap)
            .collect();
        let mut waiters: Vec<_> = (0..32).map(|_| Box::pin(admission.admit())).collect();
        for w in &mut waiters {
            assert!(futures::poll!(w.as_mut()).is_pending());
        }
        assert_eq!(waiting.get(), 32);
        assert!(admission.admit().await.is_none(), "a full queue refuses");
        assert_eq!(waiting.get(), 32);
        // Waiters cancelled (their clients gone) leave the queue.
        drop(waiters);
        assert_eq!(waiting.get(), 0);
        drop(held);

        // 1,000 finished in 100 ms: 10,000/s, so 10,000 may wait (1 s of
        // work), capped at 64 per slot = 256.
        tokio::time::advance(Duration::from_millis(100)).await;
        admission.pace_per_second();
        for _ in 0..1000 {
            drop(admission.admit().await.unwrap());
        }
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(admission.queue_length(), 256);

        // A quiet second: the pace falls back, and so does the queue.
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(admission.queue_length(), 32);

        // Between the bounds the queue is the pace times 1 s: 500 finished
        // in 100 ms with 100 slots (floor 800, cap 6,400) let 5,000 wait.
        let wide = Admission::new(100, Gauge::default());
        assert_eq!(wide.queue_length(), 800);
        for _ in 0..500 {
            drop(wide.admit().await.unwrap());
        }
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(wide.queue_length(), 5000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_request_gets_the_next_free_slot_or_is_refused_after_the_wait() {
        let admission = Admission::new(1, Gauge::default());
        let first = admission.admit().await.unwrap();
        let mut second = Box::pin(admission.admit());
        assert!(futures::poll!(second.as_mut()).is_pending());
        drop(first);
        let second = second.await.expect("the freed slot");
        let started = tokio::time::Instant::now();
        assert!(admission.admit().await.is_none(), "no slot within the wait");
        assert_eq!(started.elapsed(), QUEUE_WAIT);
        drop(second);
        assert!(admission.admit().await.is_some());
    }

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
