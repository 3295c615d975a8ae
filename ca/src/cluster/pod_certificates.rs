//! meshca as the signer of Kubernetes pod certificates
//! (`certificates.k8s.io/v1beta1` `PodCertificateRequest`, `--pod-certificate-signer`).
//!
//! The kubelet makes a key for a pod, creates a `PodCertificateRequest`
//! naming a signer, and mounts what the signer writes into the pod's
//! `podCertificate` volume. The leader watches the requests of its signer
//! name (a field selector on `spec.signerName`); the watch's first listing
//! hands a new leader every request still pending, so none is lost across
//! a leader change. Each pending request is:
//!
//! 1. checked: key and proof of possession (either encoding, see
//!    [`meshca_certs::pod_certificate::read_pod_key`]), key type, no
//!    `unverifiedUserAnnotations` (meshca knows none), and the pod read
//!    from the API: it exists with that UID, on that node, with that
//!    service account;
//! 2. signed: an X509-SVID for `spiffe://<trust-domain>/ns/<ns>/sa/<sa>`
//!    (the profile of `CreateCertificate`), living `min(maxExpirationSeconds,
//!    --max-workload-cert-ttl)` from its backdated notBefore;
//! 3. written through the `status` subresource in one update carrying the
//!    request's resourceVersion: chain (leaf, then intermediates),
//!    notBefore/notAfter equal to the leaf's, `beginRefreshAt` at half the
//!    lifetime with jitter, condition `Issued`. A denial or failure carries
//!    only its condition. A conflict (someone else wrote) is read again,
//!    never overwritten: a request that became Issued, Denied or Failed in
//!    the meantime is left alone, so each is answered at most once.
//!
//! Requests wait in a bounded queue ([`QUEUE_CAPACITY`]); when it is full
//! the watch is not read further, so a mass restart is taken at the pace
//! the CA and the API answer, never dropped. At most [`CONCURRENCY`]
//! requests are in progress at once. A request still unanswered after
//! [`MAX_ATTEMPTS`] attempts (the API failing, the CA unable to sign) is
//! parked and queued again after [`REQUEUE_FIRST`], doubling up to
//! [`REQUEUE_MAX`], until it is answered or deleted; at most
//! [`PARKED_CAPACITY`] are parked (beyond that, one waits for the next
//! listing). The UIDs of the last [`RECENTLY_ANSWERED`] requests answered
//! are remembered, so a stale watch event of one of them (an older
//! version, read after the answer was written) never signs it again.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::certificates::v1beta1::{PodCertificateRequest, PodCertificateRequestStatus};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, PostParams};
use kube::runtime::watcher::{self, Event};
use meshca_certs::pod_certificate::{self, PodKeyError};
use meshca_certs::profile::CLOCK_SKEW_BACKDATE;
use meshca_certs::{SpiffeId, TrustDomain};
use meshca_kube::WatchRetry;
use time::OffsetDateTime;

use crate::authority::{Authority, SignError};
use crate::metrics::Metrics;

/// The API group version of the requests and of the ClusterTrustBundle.
pub(crate) const API_GROUP_VERSION: &str = "certificates.k8s.io/v1beta1";
/// What the signer needs of [`API_GROUP_VERSION`] (checked at start).
pub(crate) const SERVED_RESOURCES: &[&str] = &[
    "podcertificaterequests",
    "podcertificaterequests/status",
    "clustertrustbundles",
];

/// Requests read from the watch and waiting to be signed, at most.
pub(crate) const QUEUE_CAPACITY: usize = 1024;
/// Requests checked, signed and written at the same time, at most.
pub(crate) const CONCURRENCY: usize = 32;
/// Attempts at one request in a round (API errors, the CA unable to
/// sign); then it is parked and queued again later.
pub(crate) const MAX_ATTEMPTS: u32 = 6;
/// The first wait after a failed attempt; doubled each time.
const FIRST_RETRY: Duration = Duration::from_millis(500);
/// How long a request that failed a round waits before the next one;
/// doubled each round up to [`REQUEUE_MAX`].
pub(crate) const REQUEUE_FIRST: Duration = Duration::from_secs(10);
/// The longest wait between two rounds of one request.
pub(crate) const REQUEUE_MAX: Duration = Duration::from_secs(300);
/// Requests waiting for their next round, at most (a request beyond it is
/// left to the next listing or leader).
pub(crate) const PARKED_CAPACITY: usize = QUEUE_CAPACITY;
/// UIDs of answered requests remembered to skip stale watch events.
pub(crate) const RECENTLY_ANSWERED: usize = 4 * QUEUE_CAPACITY;

/// Condition types of a request that is answered.
const TERMINAL: [&str; 3] = ["Issued", "Denied", "Failed"];

/// What the signer is configured with.
#[derive(Debug, Clone)]
pub(crate) struct PodSignerConfig {
    /// The `spec.signerName` served (`--pod-certificate-signer`).
    pub(crate) signer_name: String,
    /// The trust domain of the identities issued.
    pub(crate) trust_domain: TrustDomain,
    /// Longest certificate lifetime (`--max-workload-cert-ttl`).
    pub(crate) max_ttl: Duration,
    /// The revocation list: a revoked identity, service account or node
    /// is `Denied` (reason `Revoked`), and what is issued is recorded.
    pub(crate) revocations: Option<Arc<crate::revocation::Revocations>>,
}

/// How a request was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Issued, with the leaf's serial.
    Issued {
        /// The SPIFFE ID.
        identity: String,
        /// The leaf's serial, hex.
        serial: String,
    },
    /// Denied: the request is not acceptable.
    Denied {
        /// Condition reason.
        reason: &'static str,
        /// Condition message.
        message: String,
    },
    /// Failed: the signer cannot issue it.
    Failed {
        /// Condition reason.
        reason: &'static str,
        /// Condition message.
        message: String,
    },
}

impl Outcome {
    fn condition_type(&self) -> &'static str {
        match self {
            Outcome::Issued { .. } => "Issued",
            Outcome::Denied { .. } => "Denied",
            Outcome::Failed { .. } => "Failed",
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Outcome::Issued { .. } => "Issued",
            Outcome::Denied { reason, .. } | Outcome::Failed { reason, .. } => reason,
        }
    }
}

fn denied(reason: &'static str, message: impl Into<String>) -> Outcome {
    Outcome::Denied {
        reason,
        message: message.into(),
    }
}

/// A request to answer, and how many rounds it failed before.
struct Queued {
    request: PodCertificateRequest,
    round: u32,
}

/// `request` reduced to what names it (namespace, name, UID), for a
/// request that is read again before it is worked on.
fn naming_only(request: &PodCertificateRequest) -> PodCertificateRequest {
    PodCertificateRequest {
        metadata: kube::api::ObjectMeta {
            namespace: request.metadata.namespace.clone(),
            name: request.metadata.name.clone(),
            uid: request.metadata.uid.clone(),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// How [`answer`] ended.
enum Finished {
    /// Answered (by us or another writer), or deleted: done with it.
    Done,
    /// Every attempt of the round failed: to be tried again later.
    GaveUp(Box<PodCertificateRequest>),
}

/// The UIDs of the last `capacity` requests answered, oldest forgotten
/// first.
#[derive(Debug)]
pub(crate) struct RecentlyAnswered {
    order: VecDeque<String>,
    uids: HashSet<String>,
    capacity: usize,
}

impl RecentlyAnswered {
    /// An empty set remembering at most `capacity` UIDs.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            order: VecDeque::with_capacity(capacity.min(1024)),
            uids: HashSet::new(),
            capacity,
        }
    }

    /// Remembers `uid`, forgetting the oldest beyond the capacity.
    pub(crate) fn insert(&mut self, uid: &str) {
        if self.capacity == 0 || !self.uids.insert(uid.to_string()) {
            return;
        }
        self.order.push_back(uid.to_string());
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.uids.remove(&old);
            }
        }
    }

    /// Whether `uid` was answered recently.
    pub(crate) fn contains(&self, uid: &str) -> bool {
        self.uids.contains(uid)
    }

    /// How many UIDs are remembered.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }
}

/// The wait before round `round` (1 for the first requeue).
pub(crate) fn requeue_delay(round: u32) -> Duration {
    let doublings = round.saturating_sub(1).min(16);
    REQUEUE_FIRST
        .saturating_mul(1u32 << doublings)
        .min(REQUEUE_MAX)
}

/// Why one attempt did not end with an answer written; tried again.
#[derive(Debug, thiserror::Error)]
enum Transient {
    #[error("Kubernetes API: {}", meshca_certs::error_chain(.0))]
    Api(kube::Error),
    #[error("{0}")]
    CannotSign(String),
}

impl From<kube::Error> for Transient {
    fn from(e: kube::Error) -> Self {
        Self::Api(e)
    }
}

/// The leader's pod-certificate work, for
/// [`while_leader`](super::leader::while_leader): the signer and the
/// signer's `ClusterTrustBundle`, both until leadership ends.
pub(crate) fn leader_work(
    client: kube::Client,
    authority: Arc<Authority>,
    metrics: Metrics,
    config: PodSignerConfig,
) -> impl FnMut() -> futures::future::BoxFuture<'static, ()> {
    move || {
        let sign = sign_pod_certificates(
            client.clone(),
            authority.clone(),
            metrics.clone(),
            config.clone(),
        );
        let publish = super::cluster_trust_bundle::publish_cluster_trust_bundle(
            client.clone(),
            authority.clone(),
            config.signer_name.clone(),
            config.trust_domain.to_string(),
            metrics.clone(),
        );
        Box::pin(async move {
            futures::join!(sign, publish);
        })
    }
}

/// Signs the pending requests of `config.signer_name` until dropped
/// (leader only).
pub(crate) async fn sign_pod_certificates(
    client: kube::Client,
    authority: Arc<Authority>,
    metrics: Metrics,
    config: PodSignerConfig,
) {
    let requests: Api<PodCertificateRequest> = Api::all(client.clone());
    let events = watcher::watcher(
        requests,
        watcher::Config::default().fields(&format!("spec.signerName={}", config.signer_name)),
    );
    let (queue_tx, queue_rx) = tokio::sync::mpsc::channel::<Queued>(QUEUE_CAPACITY);
    let (park_tx, park_rx) = tokio::sync::mpsc::channel::<Queued>(PARKED_CAPACITY);
    let queued: Arc<Mutex<HashSet<(String, String)>>> = Arc::default();
    let recent = Arc::new(Mutex::new(RecentlyAnswered::new(RECENTLY_ANSWERED)));
    tracing::info!(signer = %config.signer_name, "signing PodCertificateRequests");

    let read_watch = {
        let (queued, recent, metrics, queue_tx) = (
            queued.clone(),
            recent.clone(),
            metrics.clone(),
            queue_tx.clone(),
        );
        let signer_name = config.signer_name.clone();
        async move {
            futures::pin_mut!(events);
            let mut retry = WatchRetry::new("podcertificaterequests");
            while let Some(event) = events.next().await {
                retry.saw(&event);
                let request = match event {
                    Ok(Event::Apply(r)) | Ok(Event::InitApply(r)) => r,
                    Ok(_) => continue,
                    Err(e) => {
                        retry.failed(&e).await;
                        continue;
                    }
                };
                if is_answered(&request) || request.spec.signer_name != signer_name {
                    // Another signer's request (the field selector keeps
                    // them out; an API server that ignores it does not) is
                    // left untouched.
                    continue;
                }
                let uid = request.metadata.uid.as_deref().unwrap_or_default();
                if !uid.is_empty() && recent.lock().is_ok_and(|r| r.contains(uid)) {
                    // An older version of a request answered since (a
                    // stale event): never signed twice.
                    let (namespace, name) = object_key(&request);
                    tracing::debug!(namespace = %namespace, request = %name, "stale event of an answered PodCertificateRequest; skipped");
                    metrics.pod_certificate_answered("Skipped", "AlreadyAnswered");
                    continue;
                }
                let key = object_key(&request);
                let fresh = queued.lock().map(|mut q| q.insert(key)).unwrap_or(false);
                if !fresh {
                    continue;
                }
                metrics.pod_certificate_requests_waiting.inc();
                // What the API server keeps for its own bookkeeping is not
                // kept while the request waits (it is never written back).
                let mut request = request;
                request.metadata.managed_fields = None;
                // Waits while the queue is full: the watch is read no
                // further until the signer catches up.
                if queue_tx.send(Queued { request, round: 0 }).await.is_err() {
                    return;
                }
            }
        }
    };

    let requeue = requeue_parked(park_rx, queue_tx);

    let work = tokio_stream::wrappers::ReceiverStream::new(queue_rx).for_each_concurrent(
        CONCURRENCY,
        |Queued { request, round }| {
            let (client, authority, metrics, config, queued, recent, park_tx) = (
                client.clone(),
                authority.clone(),
                metrics.clone(),
                config.clone(),
                queued.clone(),
                recent.clone(),
                park_tx.clone(),
            );
            async move {
                let key = object_key(&request);
                let uid = request.metadata.uid.clone().unwrap_or_default();
                match answer(&client, &authority, &metrics, &config, request, round).await {
                    Finished::Done => {
                        // Remembered before it leaves the queued set, so
                        // no stale event slips in between.
                        if let (false, Ok(mut r)) = (uid.is_empty(), recent.lock()) {
                            r.insert(&uid);
                        }
                    }
                    Finished::GaveUp(request) => {
                        let round = round.saturating_add(1);
                        let delay = requeue_delay(round);
                        let (namespace, name) = key.clone();
                        // A parked request is read again before its next
                        // round: only what names it is kept meanwhile
                        // (a request may carry 256 KiB of annotations).
                        match park_tx.try_send(Queued {
                            request: naming_only(&request),
                            round,
                        }) {
                            Ok(()) => {
                                tracing::warn!(namespace = %namespace, request = %name, attempts = MAX_ATTEMPTS, retry_in = ?delay, "PodCertificateRequest still unanswered; trying again later");
                                // Still queued and waiting: the watch does
                                // not queue it a second time.
                                return;
                            }
                            Err(_) => {
                                tracing::warn!(namespace = %namespace, request = %name, attempts = MAX_ATTEMPTS, parked = PARKED_CAPACITY, "PodCertificateRequest still unanswered and too many are waiting to be tried again; the next listing or leader picks it up");
                            }
                        }
                    }
                }
                if let Ok(mut q) = queued.lock() {
                    q.remove(&key);
                }
                metrics.pod_certificate_requests_waiting.dec();
            }
        },
    );
    futures::join!(read_watch, requeue, work);
}

/// Queues parked requests again once their wait is over; at most
/// [`PARKED_CAPACITY`] wait here (the rest wait in the channel, itself
/// bounded).
async fn requeue_parked(
    mut parked: tokio::sync::mpsc::Receiver<Queued>,
    queue: tokio::sync::mpsc::Sender<Queued>,
) {
    let mut sleeping = futures::stream::FuturesUnordered::new();
    loop {
        tokio::select! {
            next = parked.recv(), if sleeping.len() < PARKED_CAPACITY => {
                let Some(item) = next else { return };
                let delay = requeue_delay(item.round);
                sleeping.push(async move {
                    tokio::time::sleep(delay).await;
                    item
                });
            }
            Some(item) = sleeping.next(), if !sleeping.is_empty() => {
                if queue.send(item).await.is_err() {
                    return;
                }
            }
        }
    }
}

fn object_key(request: &PodCertificateRequest) -> (String, String) {
    (
        request.metadata.namespace.clone().unwrap_or_default(),
        request.metadata.name.clone().unwrap_or_default(),
    )
}

/// Whether the request carries an Issued, Denied or Failed condition.
pub(crate) fn is_answered(request: &PodCertificateRequest) -> bool {
    request
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| TERMINAL.contains(&c.type_.as_str()))
        })
}

/// Answers one request: retries API errors with a doubling wait, re-reads
/// on a conflict, and stops once the request is answered (by us or anyone).
/// A request in a later round (`round` > 0) is read again first: it may
/// have changed while it was parked.
async fn answer(
    client: &kube::Client,
    authority: &Authority,
    metrics: &Metrics,
    config: &PodSignerConfig,
    mut request: PodCertificateRequest,
    round: u32,
) -> Finished {
    let (namespace, name) = object_key(&request);
    let api: Api<PodCertificateRequest> = Api::namespaced(client.clone(), &namespace);
    let trust_domain = &config.trust_domain;
    let mut wait = FIRST_RETRY;
    let mut prepared: Option<(Outcome, PodCertificateRequestStatus)> = None;
    let mut reread = round > 0;
    // Whether a status the API refused (422) has been signed again.
    let mut signed_again = false;
    for attempt in 1..=MAX_ATTEMPTS {
        if reread {
            match api.get_opt(&name).await {
                Ok(Some(fresh)) => {
                    request = fresh;
                    reread = false;
                }
                Ok(None) => return Finished::Done,
                Err(e) => {
                    tracing::warn!(namespace = %namespace, request = %name, attempt, error = %e, "reading a PodCertificateRequest failed; retrying");
                    pause(&mut wait, attempt).await;
                    continue;
                }
            }
        }
        if is_answered(&request) {
            tracing::debug!(namespace = %namespace, request = %name, "already answered; left alone");
            if let Some((outcome, _)) = &prepared {
                discarded(
                    &request,
                    outcome,
                    trust_domain,
                    "the request was answered by another writer",
                );
            }
            return Finished::Done;
        }
        let now = OffsetDateTime::now_utc();
        // A status signed in an earlier attempt is written again if it is
        // still fresh: kube-apiserver wants notBefore within 5 minutes of
        // its own clock, and notBefore is backdated 2 minutes, so a status
        // is reused for at most a minute after it was signed.
        let reuse = prepared.take().filter(|(_, status)| {
            status
                .not_before
                .as_ref()
                .is_none_or(|nb| timestamp(nb) + time::Duration::minutes(3) > now)
        });
        let (outcome, status) = match reuse {
            Some(p) => p,
            None => match decide(client, authority, config, &request, now).await {
                Ok((outcome, status)) => {
                    // Audited when decided, before the write: a write that
                    // lands while this task is cancelled still has its line.
                    audit(&request, &outcome, trust_domain);
                    (outcome, status)
                }
                Err(e) => {
                    tracing::warn!(namespace = %namespace, request = %name, attempt, error = %e, "PodCertificateRequest not answered yet; retrying");
                    pause(&mut wait, attempt).await;
                    continue;
                }
            },
        };
        let mut updated = request.clone();
        updated.metadata.managed_fields = None;
        updated.status = Some(status.clone());
        match api
            .replace_status(&name, &PostParams::default(), &updated)
            .await
        {
            Ok(_) => {
                metrics.pod_certificate_answered(outcome.condition_type(), outcome.reason());
                return Finished::Done;
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {
                // Someone else wrote: read again; never overwrite.
                prepared = Some((outcome, status));
                match api.get_opt(&name).await {
                    Ok(Some(fresh)) => request = fresh,
                    Ok(None) => {
                        if let Some((outcome, _)) = &prepared {
                            discarded(&request, outcome, trust_domain, "the request was deleted");
                        }
                        return Finished::Done;
                    }
                    Err(e) => {
                        tracing::warn!(namespace = %namespace, request = %name, error = %e, "re-reading a PodCertificateRequest after a conflict failed; retrying");
                        pause(&mut wait, attempt).await;
                    }
                }
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {
                discarded(&request, &outcome, trust_domain, "the request was deleted");
                return Finished::Done;
            }
            Err(kube::Error::Api(e))
                if e.code == 422 && matches!(outcome, Outcome::Issued { .. }) && !signed_again =>
            {
                // Most likely the API server's clock is ahead of ours and
                // found notBefore too old: sign once more, afresh, before
                // telling the kubelet (which takes Failed as final). Any
                // other 422 costs one more certificate (audited) and then
                // fails as before; so does a clock more than about three
                // minutes ahead.
                tracing::warn!(namespace = %namespace, request = %name, error = %e.message, "kube-apiserver refused the issued status; signing again");
                discarded(
                    &request,
                    &outcome,
                    trust_domain,
                    "kube-apiserver refused the status; signed again",
                );
                signed_again = true;
            }
            Err(kube::Error::Api(e))
                if e.code == 422 && matches!(outcome, Outcome::Issued { .. }) =>
            {
                // The API refused our status: a defect here. Tell the
                // kubelet with a Failed condition rather than leave it waiting.
                tracing::error!(namespace = %namespace, request = %name, error = %e.message, "kube-apiserver refused the issued status");
                discarded(
                    &request,
                    &outcome,
                    trust_domain,
                    "kube-apiserver refused the status",
                );
                let failed = Outcome::Failed {
                    reason: "InternalError",
                    message: "the signer produced a status the API refused; see meshca's log"
                        .into(),
                };
                audit(&request, &failed, trust_domain);
                prepared = Some((failed.clone(), answer_status(&failed, &request, now)));
            }
            Err(e) => {
                prepared = Some((outcome, status));
                tracing::warn!(namespace = %namespace, request = %name, attempt, error = %e, "writing a PodCertificateRequest status failed; retrying");
                pause(&mut wait, attempt).await;
            }
        }
    }
    if let Some((outcome, _)) = &prepared {
        discarded(
            &request,
            outcome,
            trust_domain,
            "gave up after repeated errors",
        );
    }
    metrics.pod_certificate_error("RetriesExhausted");
    Finished::GaveUp(Box::new(request))
}

/// Waits `wait` before the next attempt and doubles it (up to 30 s); no
/// wait after the last attempt of a round.
async fn pause(wait: &mut Duration, attempt: u32) {
    if attempt < MAX_ATTEMPTS {
        tokio::time::sleep(*wait).await;
        *wait = (*wait * 2).min(Duration::from_secs(30));
    }
}

/// The identity a request asks for: `spiffe://<td>/ns/<ns>/sa/<sa>` of its
/// namespace and `spec.serviceAccountName` (what an audit line names even
/// when nothing was issued).
fn claimed_identity(request: &PodCertificateRequest, trust_domain: &TrustDomain) -> String {
    let namespace = request.metadata.namespace.as_deref().unwrap_or_default();
    let service_account = &request.spec.service_account_name;
    SpiffeId::for_workload(trust_domain, namespace, service_account)
        .map(|id| id.to_string())
        .unwrap_or_else(|_| format!("spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}"))
}

/// The audit line of an answer, written when it is decided (before the
/// status is written). A denial or failure names the identity claimed.
fn audit(request: &PodCertificateRequest, outcome: &Outcome, trust_domain: &TrustDomain) {
    let (namespace, name) = object_key(request);
    let spec = &request.spec;
    let pod = format!("{namespace}/{}", spec.pod_name);
    let claimed = claimed_identity(request, trust_domain);
    match outcome {
        Outcome::Issued { identity, serial } => tracing::info!(
            target: "meshca::audit",
            request = %name,
            pod = %pod,
            node = %spec.node_name,
            identity = %identity,
            serial = %serial,
            reason = "Issued",
            "issued pod certificate"
        ),
        Outcome::Denied { reason, message } => tracing::info!(
            target: "meshca::audit",
            request = %name,
            pod = %pod,
            node = %spec.node_name,
            identity = %claimed,
            serial = "",
            reason = %reason,
            detail = %message,
            "denied pod certificate"
        ),
        Outcome::Failed { reason, message } => tracing::warn!(
            target: "meshca::audit",
            request = %name,
            pod = %pod,
            node = %spec.node_name,
            identity = %claimed,
            serial = "",
            reason = %reason,
            detail = %message,
            "failed pod certificate"
        ),
    }
}

/// The audit line of an answer that was decided but never written: the
/// certificate in it (if any) reached nobody.
fn discarded(
    request: &PodCertificateRequest,
    outcome: &Outcome,
    trust_domain: &TrustDomain,
    why: &str,
) {
    let (namespace, name) = object_key(request);
    let (identity, serial) = match outcome {
        Outcome::Issued { identity, serial } => (identity.clone(), serial.as_str()),
        _ => (claimed_identity(request, trust_domain), ""),
    };
    tracing::info!(
        target: "meshca::audit",
        request = %name,
        pod = %format!("{namespace}/{}", request.spec.pod_name),
        node = %request.spec.node_name,
        identity = %identity,
        serial = %serial,
        reason = outcome.reason(),
        why,
        "pod certificate answer discarded, not written"
    );
}

/// Checks a request and, if it passes, signs it: the answer and the status
/// that carries it. `Err` when the answer cannot be known now.
async fn decide(
    client: &kube::Client,
    authority: &Authority,
    config: &PodSignerConfig,
    request: &PodCertificateRequest,
    now: OffsetDateTime,
) -> Result<(Outcome, PodCertificateRequestStatus), Transient> {
    let outcome = match check(client, config, request).await? {
        Err(outcome) => outcome,
        Ok((key, identity)) => match issue(authority, config, request, &key, &identity, now) {
            Ok(issued) => return Ok(issued),
            Err(IssueError::Outcome(outcome)) => outcome,
            Err(IssueError::Transient(e)) => return Err(e),
        },
    };
    let status = answer_status(&outcome, request, now);
    Ok((outcome, status))
}

/// The most names [`listed_briefly`] lists, and the most bytes of each.
const LISTED_NAMES: usize = 5;
const LISTED_NAME_BYTES: usize = 64;

/// `names` for a condition's message, which the API caps at 32 KiB where
/// a request's annotations may hold 256 KiB: the first few, each cut
/// short, and how many more.
fn listed_briefly<'a>(names: impl ExactSizeIterator<Item = &'a String>) -> String {
    let total = names.len();
    let mut listed: Vec<String> = names
        .take(LISTED_NAMES)
        .map(|name| meshca_certs::untrusted_text::shortened(name, LISTED_NAME_BYTES))
        .collect();
    if total > LISTED_NAMES {
        listed.push(format!("and {} more", total - LISTED_NAMES));
    }
    listed.join(", ")
}

/// The checks before signing: `Ok(Err(outcome))` is a denial.
async fn check(
    client: &kube::Client,
    config: &PodSignerConfig,
    request: &PodCertificateRequest,
) -> Result<Result<(meshca_certs::SubjectKey, SpiffeId), Outcome>, Transient> {
    let spec = &request.spec;
    let namespace = request.metadata.namespace.clone().unwrap_or_default();
    if spec.signer_name != config.signer_name {
        // Never queued (see the watch): another signer's to answer.
        return Err(Transient::CannotSign(format!(
            "the request is for signer {}, not this one",
            meshca_certs::untrusted_text::shortened(&spec.signer_name, 256)
        )));
    }
    if let Some(annotations) = spec
        .unverified_user_annotations
        .as_ref()
        .filter(|a| !a.is_empty())
    {
        return Ok(Err(denied(
            "UnknownUserAnnotation",
            format!(
                "this signer knows no unverifiedUserAnnotations; remove {}",
                listed_briefly(annotations.keys())
            ),
        )));
    }
    let key = match pod_certificate::read_pod_key(
        &spec.stub_pkc_s10_request.0,
        spec.pkix_public_key.as_ref().map_or(&[][..], |b| &b.0),
        spec.proof_of_possession.as_ref().map_or(&[][..], |b| &b.0),
        &spec.pod_uid,
    ) {
        Ok(key) => key,
        Err(PodKeyError::UnsupportedKeyType { kind, violates, .. }) => {
            return Ok(Err(denied(
                "UnsupportedKeyType",
                format!(
                    "{kind} keys are not signed by {}: {}",
                    config.signer_name,
                    pod_certificate::what_to_use(violates.as_ref())
                ),
            )))
        }
        Err(e @ PodKeyError::BadProof { .. }) => {
            return Ok(Err(denied("InvalidProofOfPossession", e.to_string())))
        }
        Err(e @ PodKeyError::Malformed { .. }) => {
            return Ok(Err(denied("InvalidRequest", e.to_string())))
        }
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let Some(pod) = pods.get_opt(&spec.pod_name).await? else {
        return Ok(Err(denied(
            "PodNotFound",
            format!("pod {namespace}/{} does not exist", spec.pod_name),
        )));
    };
    let pod_uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let pod_spec = pod.spec.as_ref();
    let node = pod_spec
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or_default();
    let service_account = pod_spec
        .and_then(|s| s.service_account_name.as_deref())
        .unwrap_or("default");
    if pod_uid != spec.pod_uid {
        return Ok(Err(denied(
            "PodNotFound",
            format!(
                "pod {namespace}/{} has UID {pod_uid}, not {}: the requesting pod is gone",
                spec.pod_name, spec.pod_uid
            ),
        )));
    }
    if node != spec.node_name {
        return Ok(Err(denied(
            "PodMismatch",
            format!(
                "pod {namespace}/{} runs on node {node:?}, not {:?}",
                spec.pod_name, spec.node_name
            ),
        )));
    }
    if service_account != spec.service_account_name {
        return Ok(Err(denied(
            "PodMismatch",
            format!(
                "pod {namespace}/{} runs as service account {service_account:?}, not {:?}",
                spec.pod_name, spec.service_account_name
            ),
        )));
    }
    match SpiffeId::for_workload(&config.trust_domain, &namespace, service_account) {
        Ok(identity) => {
            if let Some(revocations) = &config.revocations {
                if let Err(revoked) =
                    revocations.check(&identity, None, Some(node), None, OffsetDateTime::now_utc())
                {
                    return Ok(Err(denied(
                        "Revoked",
                        format!(
                            "{identity} may not get a certificate: revoked by the entry {}",
                            revoked.entry
                        ),
                    )));
                }
            }
            Ok(Ok((key, identity)))
        }
        Err(e) => Ok(Err(denied(
            "InvalidIdentity",
            format!("no SPIFFE ID for {namespace}/{service_account}: {e}"),
        ))),
    }
}

enum IssueError {
    Outcome(Outcome),
    Transient(Transient),
}

/// The lifetime of a pod certificate, backdating included:
/// `min(maxExpirationSeconds, max_ttl)`.
pub(crate) fn lifetime(max_expiration_seconds: Option<i32>, max_ttl: Duration) -> Duration {
    let asked = max_expiration_seconds
        .map(i64::from)
        .unwrap_or(pod_certificate::DEFAULT_MAX_EXPIRATION_SECONDS)
        .max(0) as u64;
    Duration::from_secs(asked).min(max_ttl)
}

fn issue(
    authority: &Authority,
    config: &PodSignerConfig,
    request: &PodCertificateRequest,
    key: &meshca_certs::SubjectKey,
    identity: &SpiffeId,
    now: OffsetDateTime,
) -> Result<(Outcome, PodCertificateRequestStatus), IssueError> {
    let total = lifetime(request.spec.max_expiration_seconds, config.max_ttl);
    let backdate = CLOCK_SKEW_BACKDATE.unsigned_abs();
    let ttl_secs = total.saturating_sub(backdate).as_secs() as i64;
    let issued = authority
        .sign_workload(key, identity, ttl_secs, now)
        .map_err(|e| match e {
            SignError::CaOutsideValidity { .. } => {
                IssueError::Transient(Transient::CannotSign(e.to_string()))
            }
            other => IssueError::Outcome(Outcome::Failed {
                reason: "SigningFailed",
                message: other.to_string(),
            }),
        })?;
    let failed = |message: String| {
        IssueError::Outcome(Outcome::Failed {
            reason: "SigningFailed",
            message,
        })
    };
    let leaf_pem = issued
        .chain_pem
        .first()
        .ok_or_else(|| failed("no certificate was signed".into()))?;
    let leaf_der = meshca_certs::bundle::parse_certs_pem(leaf_pem)
        .ok()
        .and_then(|mut c| c.pop())
        .ok_or_else(|| failed("the signed certificate does not parse".into()))?;
    let summary = meshca_certs::inspect::CertSummary::from_der(&leaf_der)
        .map_err(|e| failed(format!("the signed certificate does not parse: {e}")))?;
    let (not_before, not_after) = (summary.not_before, summary.not_after);
    if let Some(revocations) = &config.revocations {
        revocations.record(&issued, identity, Some(&request.spec.node_name));
    }
    if not_after - not_before < time::Duration::seconds(pod_certificate::MIN_MAX_EXPIRATION_SECONDS)
    {
        // Not Failed: the kubelet takes Failed as final (and drops the
        // pod's current certificate on a renewal), where this passes once
        // the operator rotates the CA. The request waits, as for a CA
        // outside its validity.
        return Err(IssueError::Transient(Transient::CannotSign(format!(
            "the CA's certificate expires at {}, too soon for a certificate of at least one hour; the operator must rotate the CA",
            meshca_certs::Rfc3339(not_after)
        ))));
    }
    // [leaf, intermediates..., roots]: the last element (every root of the
    // bundle) is left out; the pod trusts the ClusterTrustBundle.
    let without_root = issued.chain_pem.len().saturating_sub(1).max(1);
    let chain: String = issued.chain_pem[..without_root].concat();
    let outcome = Outcome::Issued {
        identity: identity.to_string(),
        serial: issued.serial_hex.clone(),
    };
    let status = PodCertificateRequestStatus {
        begin_refresh_at: Some(to_time(begin_refresh_at(not_before, not_after))),
        certificate_chain: Some(chain),
        conditions: Some(vec![condition(&outcome, request, now)]),
        not_after: Some(to_time(not_after)),
        not_before: Some(to_time(not_before)),
    };
    Ok((outcome, status))
}

/// Half the lifetime, plus or minus up to a twentieth of it (so a mass
/// restart does not come back all at once), inside the API's bounds
/// `[notBefore + 10 min, notAfter - 10 min]`.
pub(crate) fn begin_refresh_at(
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
) -> OffsetDateTime {
    let lifetime = not_after - not_before;
    let jitter_span = lifetime.whole_seconds() / 10;
    let mut random = [0u8; 8];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut random);
    let jitter = if jitter_span > 0 {
        (u64::from_le_bytes(random) % jitter_span as u64) as i64 - jitter_span / 2
    } else {
        0
    };
    let at: OffsetDateTime = not_before + lifetime / 2 + time::Duration::seconds(jitter);
    let earliest = not_before + time::Duration::minutes(10);
    let latest = not_after - time::Duration::minutes(10);
    at.clamp(earliest, latest.max(earliest))
}

/// The status of a denial or failure: the condition only.
fn answer_status(
    outcome: &Outcome,
    request: &PodCertificateRequest,
    now: OffsetDateTime,
) -> PodCertificateRequestStatus {
    PodCertificateRequestStatus {
        conditions: Some(vec![condition(outcome, request, now)]),
        ..Default::default()
    }
}

fn condition(outcome: &Outcome, request: &PodCertificateRequest, now: OffsetDateTime) -> Condition {
    let message = match outcome {
        Outcome::Issued { identity, serial } => {
            format!("issued {identity} (serial {serial})")
        }
        Outcome::Denied { message, .. } | Outcome::Failed { message, .. } => message.clone(),
    };
    Condition {
        type_: outcome.condition_type().to_string(),
        status: "True".into(),
        reason: outcome.reason().to_string(),
        message,
        last_transition_time: to_time(now),
        observed_generation: request.metadata.generation,
    }
}

fn to_time(t: OffsetDateTime) -> Time {
    let seconds = t.unix_timestamp();
    Time(k8s_openapi::jiff::Timestamp::from_second(seconds).unwrap_or_default())
}

fn timestamp(t: &Time) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp(t.0.as_second()).unwrap_or(OffsetDateTime::UNIX_EPOCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parked_request_keeps_only_its_name() {
        let mut request = PodCertificateRequest::default();
        request.metadata.namespace = Some("default".into());
        request.metadata.name = Some("req".into());
        request.metadata.uid = Some("uid-1".into());
        request.spec.signer_name = "meshca.io/spiffe".into();
        request.spec.unverified_user_annotations = Some(std::collections::BTreeMap::from([(
            "example.com/k".repeat(1000),
            "v".into(),
        )]));
        let parked = naming_only(&request);
        assert_eq!(object_key(&parked), object_key(&request));
        assert_eq!(parked.metadata.uid.as_deref(), Some("uid-1"));
        assert!(parked.spec.unverified_user_annotations.is_none());
        assert!(parked.spec.signer_name.is_empty());
    }

    #[test]
    fn names_in_a_message_are_few_and_short() {
        let names: Vec<String> = (0..150)
            .map(|i| format!("example.com/{i:03}{}", "k".repeat(300)))
            .collect();
        let listed = listed_briefly(names.iter());
        assert!(listed.len() < 1024, "{} bytes", listed.len());
        assert!(listed.starts_with("example.com/000"), "{listed}");
        assert!(listed.ends_with("and 145 more"), "{listed}");
        let few = ["a".to_string(), "b".to_string()];
        assert_eq!(listed_briefly(few.iter()), "a, b");
    }

    #[test]
    fn lifetime_is_the_smaller_of_the_request_and_the_flag() {
        let day = Duration::from_secs(86400);
        assert_eq!(lifetime(None, Duration::from_secs(90 * 86400)), day);
        assert_eq!(
            lifetime(Some(3600), Duration::from_secs(90 * 86400)),
            Duration::from_secs(3600)
        );
        assert_eq!(lifetime(Some(7 * 86400), day), day);
    }

    #[test]
    fn requeue_waits_double_up_to_the_cap() {
        assert_eq!(requeue_delay(1), REQUEUE_FIRST);
        assert_eq!(requeue_delay(2), REQUEUE_FIRST * 2);
        assert_eq!(requeue_delay(3), REQUEUE_FIRST * 4);
        for round in [6, 30, u32::MAX] {
            assert_eq!(requeue_delay(round), REQUEUE_MAX, "round {round}");
        }
    }

    #[test]
    fn recently_answered_is_bounded_and_forgets_the_oldest() {
        let mut recent = RecentlyAnswered::new(3);
        for uid in ["a", "b", "c", "a"] {
            recent.insert(uid);
        }
        assert_eq!(recent.len(), 3, "a second insert of a UID is one entry");
        recent.insert("d");
        assert_eq!(recent.len(), 3);
        assert!(!recent.contains("a"), "the oldest is forgotten");
        assert!(recent.contains("b") && recent.contains("c") && recent.contains("d"));
        for i in 0..100 {
            recent.insert(&format!("uid-{i}"));
        }
        assert_eq!(recent.len(), 3);
    }

    #[test]
    fn a_denial_names_the_identity_claimed() {
        let request = PodCertificateRequest {
            metadata: kube::api::ObjectMeta {
                namespace: Some("shop".into()),
                name: Some("req".into()),
                ..Default::default()
            },
            spec: k8s_openapi::api::certificates::v1beta1::PodCertificateRequestSpec {
                service_account_name: "cart".into(),
                ..Default::default()
            },
            status: None,
        };
        let td = TrustDomain::new("cluster.local").unwrap();
        assert_eq!(
            claimed_identity(&request, &td),
            "spiffe://cluster.local/ns/shop/sa/cart"
        );
    }

    #[test]
    fn refresh_is_near_half_the_lifetime_and_inside_the_api_bounds() {
        let nb = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        for hours in [1, 24, 24 * 90] {
            let na = nb + time::Duration::hours(hours);
            for _ in 0..50 {
                let at = begin_refresh_at(nb, na);
                assert!(at >= nb + time::Duration::minutes(10));
                assert!(at <= na - time::Duration::minutes(10));
                let half: OffsetDateTime = nb + (na - nb) / 2;
                assert!(
                    (at - half).abs() <= (na - nb) / 20,
                    "{hours}h: {at} vs {half}"
                );
            }
        }
    }
}
