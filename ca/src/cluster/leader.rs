//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's
//! `LeaseLock` algorithm (the one istiod and every Kubernetes controller
//! use), so `kubectl get lease` shows meshca's leader like any other.
//!
//! - The holder renews `spec.renewTime` every `retry_period`; every write
//!   is a compare-and-swap on `resourceVersion`, so two candidates can never
//!   both take the Lease.
//! - A candidate takes the Lease only when the record it observed has not
//!   changed for `lease_duration`, measured on its own clock (client-go's
//!   observedTime rule, so clock skew between nodes does not matter).
//! - A leader that cannot renew within `renew_deadline` steps down at once:
//!   its leader-only work is cancelled before another replica can take over.
//!   Each attempt is bounded by that deadline (client-go's `RenewDeadline`),
//!   so a hung API call cannot keep a leader that others have replaced:
//!   the leader steps down `renew_deadline` after its last successful
//!   renewal began, while the others wait `lease_duration` (longer) after
//!   they saw that renewal.
//! - On shutdown the leader releases the Lease, so another replica takes
//!   over without waiting for it to expire.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use meshca_serve::rate_limited_log::RateLimitedLog;
use tokio::sync::watch;
use tokio::time::Instant;

/// Name of meshca's leader-election Lease.
pub(crate) const LEASE_NAME: &str = "meshca-leader";

/// Timing of the election, derived from the lease duration as client-go's
/// defaults are (15 s / 10 s / 2 s).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeaderTiming {
    /// How long a Lease is valid after its last renewal.
    pub(crate) lease_duration: Duration,
    /// A leader that has not renewed for this long steps down.
    pub(crate) renew_deadline: Duration,
    /// Time between attempts.
    pub(crate) retry_period: Duration,
}

impl LeaderTiming {
    /// Timing for a lease duration (renew deadline 2/3 of it, retry 2/15).
    pub(crate) fn for_lease(lease_duration: Duration) -> Self {
        Self {
            lease_duration,
            renew_deadline: lease_duration * 2 / 3,
            retry_period: (lease_duration * 2 / 15).max(Duration::from_millis(200)),
        }
    }
}

/// One candidate in the election.
pub(crate) struct LeaderElector {
    api: Api<Lease>,
    identity: String,
    timing: LeaderTiming,
    observed: Option<(Option<String>, Option<String>)>,
    observed_at: Instant,
    last_renew: Option<Instant>,
    /// Failed attempts are logged once per interval, with a count.
    failure_log: RateLimitedLog,
}

impl std::fmt::Debug for LeaderElector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderElector")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

/// This replica's identity in the election: the pod name (`POD_NAME`, or the
/// hostname) plus a random suffix, so a restarted process is a new candidate.
pub(crate) fn candidate_identity() -> String {
    let base = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "meshca".to_string());
    let mut suffix = [0u8; 4];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut suffix);
    format!("{base}_{}", meshca_certs::profile::hex(&suffix))
}

impl LeaderElector {
    /// A candidate for the Lease [`LEASE_NAME`] in `namespace`.
    pub(crate) fn new(
        client: kube::Client,
        namespace: &str,
        identity: String,
        timing: LeaderTiming,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            identity,
            timing,
            observed: None,
            observed_at: Instant::now(),
            last_renew: None,
            failure_log: RateLimitedLog::new(meshca_kube::FAILURE_LOG_INTERVAL),
        }
    }

    /// This candidate's identity.
    pub(crate) fn identity(&self) -> &str {
        &self.identity
    }

    /// Runs the election until `stop` fires, publishing leadership on
    /// `leader`. Releases the Lease on the way out if held.
    pub(crate) async fn run(
        mut self,
        leader: watch::Sender<bool>,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            let started = Instant::now();
            // A leader must finish a renewal by `last_renew + renew_deadline`;
            // a candidate's attempt gets the renew deadline too.
            let deadline = match (*leader.borrow(), self.last_renew) {
                (true, Some(last)) => last + self.timing.renew_deadline,
                _ => started + self.timing.renew_deadline,
            };
            let attempt = tokio::select! {
                attempt = tokio::time::timeout_at(deadline, self.try_acquire_or_renew()) => attempt,
                _ = stop.changed() => break,
            };
            match attempt {
                Ok(Ok(true)) => {
                    self.last_renew = Some(started);
                    if !*leader.borrow() {
                        tracing::info!(identity = %self.identity, lease = LEASE_NAME, "became the leader");
                    }
                    leader.send_if_modified(|l| !std::mem::replace(l, true));
                }
                Ok(Ok(false)) => {
                    self.step_down(&leader, "another replica holds the lease");
                }
                Ok(Err(e)) => {
                    if *leader.borrow() && Instant::now() >= deadline {
                        self.step_down(&leader, "the lease could not be renewed in time");
                    }
                    if let Some(not_logged) = self.failure_log.record() {
                        tracing::warn!(
                            error = %meshca_kube::describe(&e),
                            lease = LEASE_NAME,
                            not_logged,
                            "leader election: Kubernetes API call failed; retrying"
                        );
                    }
                }
                Err(_) => {
                    if *leader.borrow() {
                        self.step_down(
                            &leader,
                            "renewing the lease did not finish within the renew deadline",
                        );
                    }
                    if let Some(not_logged) = self.failure_log.record() {
                        tracing::warn!(
                            deadline_ms = self.timing.renew_deadline.as_millis() as u64,
                            lease = LEASE_NAME,
                            not_logged,
                            "leader election: the Kubernetes API did not answer within the renew deadline"
                        );
                    }
                }
            }
            // A leader never sleeps past its deadline: the next attempt
            // then starts with no time left and steps down at once.
            let mut wake = Instant::now() + self.timing.retry_period;
            if let (true, Some(last)) = (*leader.borrow(), self.last_renew) {
                wake = wake.min(last + self.timing.renew_deadline);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = stop.changed() => break,
            }
        }
        if *leader.borrow() {
            leader.send_replace(false);
            match tokio::time::timeout(self.timing.renew_deadline, self.release()).await {
                Ok(Ok(())) => {
                    tracing::info!(identity = %self.identity, "released the leader lease")
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "releasing the leader lease failed; it expires by itself")
                }
                Err(_) => tracing::warn!(
                    "releasing the leader lease did not finish within the renew deadline; it expires by itself"
                ),
            }
        }
    }

    fn step_down(&mut self, leader: &watch::Sender<bool>, why: &str) {
        if leader.send_if_modified(|l| std::mem::replace(l, false)) {
            tracing::warn!(identity = %self.identity, reason = why, "lost leadership; stopped leader-only work");
        }
        self.last_renew = None;
    }

    /// One round of client-go's `tryAcquireOrRenew`: `Ok(true)` when this
    /// candidate holds the Lease afterwards.
    pub(crate) async fn try_acquire_or_renew(&mut self) -> Result<bool, kube::Error> {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let duration_secs = self.timing.lease_duration.as_secs().max(1) as i32;
        let Some(current) = self.api.get_opt(LEASE_NAME).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(LEASE_NAME.into()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(duration_secs),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = current.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let record = (
            holder.clone(),
            spec.renew_time.as_ref().map(|t| t.0.to_string()),
        );
        if self.observed.as_ref() != Some(&record) {
            self.observed = Some(record);
            self.observed_at = Instant::now();
        }
        let held_by_us = holder.as_deref() == Some(self.identity.as_str());
        let lease_secs = spec
            .lease_duration_seconds
            .map(|s| Duration::from_secs(s.max(0) as u64))
            .unwrap_or(self.timing.lease_duration);
        if holder.is_some() && !held_by_us && self.observed_at.elapsed() < lease_secs {
            return Ok(false);
        }
        let mut lease = current;
        lease.metadata.managed_fields = None;
        let transitions = spec.lease_transitions.unwrap_or(0);
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(duration_secs),
            acquire_time: if held_by_us {
                spec.acquire_time.clone()
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if held_by_us || holder.is_none() && transitions == 0 {
                transitions
            } else {
                transitions + 1
            }),
            ..spec
        });
        match self
            .api
            .replace(LEASE_NAME, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Gives the Lease up (empty holder, 1 s duration), as client-go's
    /// `ReleaseOnCancel`.
    async fn release(&mut self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(LEASE_NAME).await? else {
            return Ok(());
        };
        let spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        lease.metadata.managed_fields = None;
        lease.spec = Some(LeaseSpec {
            holder_identity: None,
            lease_duration_seconds: Some(1),
            ..spec
        });
        self.api
            .replace(LEASE_NAME, &PostParams::default(), &lease)
            .await
            .map(|_| ())
    }
}

/// Runs `work` whenever `leader` is true, and drops it (cancelling every
/// await point inside) the moment leadership is lost.
pub(crate) async fn while_leader<F, Fut>(mut leader: watch::Receiver<bool>, mut work: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    loop {
        if leader.wait_for(|l| *l).await.is_err() {
            return;
        }
        tokio::select! {
            _ = work() => {}
            lost = leader.wait_for(|l| !*l) => {
                if lost.is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The election against a fake Lease API: an in-process
    //! `coordination.k8s.io/v1` endpoint that speaks the real JSON to the
    //! real kube client (compare-and-swap on `resourceVersion`, 404 and 409
    //! as `Status` objects), where each candidate's calls can be held, as
    //! by a hung API server or a broken connection. Time is tokio's paused
    //! clock, so the timeline is exact.

    use std::sync::{Arc, Mutex};

    use http_body_util::BodyExt;
    use kube::client::Body;
    use serde_json::{json, Value};

    use super::*;

    const NAMESPACE: &str = "meshca";

    /// How a candidate's API calls are treated now.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Hang {
        /// Answered at once.
        No,
        /// Held before the server looks at them (applied when released).
        BeforeApply,
        /// Applied, but the answer is held.
        AfterApply,
    }

    #[derive(Debug, Default)]
    struct LeaseStore {
        lease: Option<Value>,
        version: u64,
    }

    fn status(code: u16, reason: &str) -> http::Response<Body> {
        let body = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": reason, "reason": reason, "code": code,
        });
        http::Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string().into_bytes()))
            .expect("a valid response")
    }

    fn ok(object: &Value) -> http::Response<Body> {
        http::Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(Body::from(object.to_string().into_bytes()))
            .expect("a valid response")
    }

    impl LeaseStore {
        fn answer(
            &mut self,
            method: &http::Method,
            path: &str,
            body: &[u8],
        ) -> http::Response<Body> {
            let base = format!("/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases");
            let named = format!("{base}/{LEASE_NAME}");
            let sent = || serde_json::from_slice::<Value>(body).expect("the client sends JSON");
            match (method.as_str(), path) {
                ("GET", p) if p == named => match &self.lease {
                    Some(lease) => ok(lease),
                    None => status(404, "NotFound"),
                },
                ("POST", p) if p == base => {
                    if self.lease.is_some() {
                        return status(409, "AlreadyExists");
                    }
                    self.store(sent())
                }
                ("PUT", p) if p == named => {
                    let mut lease = sent();
                    let current = self
                        .lease
                        .as_ref()
                        .map(|l| l["metadata"]["resourceVersion"].clone());
                    if current.as_ref() != Some(&lease["metadata"]["resourceVersion"]) {
                        return status(409, "Conflict");
                    }
                    lease["metadata"]["resourceVersion"] = Value::Null;
                    self.store(lease)
                }
                _ => status(404, "NotFound"),
            }
        }

        fn store(&mut self, mut lease: Value) -> http::Response<Body> {
            self.version += 1;
            lease["apiVersion"] = json!("coordination.k8s.io/v1");
            lease["kind"] = json!("Lease");
            lease["metadata"]["namespace"] = json!(NAMESPACE);
            lease["metadata"]["resourceVersion"] = json!(self.version.to_string());
            let answer = ok(&lease);
            self.lease = Some(lease);
            answer
        }

        fn holder(&self) -> Option<String> {
            self.lease.as_ref()?["spec"]["holderIdentity"]
                .as_str()
                .map(String::from)
        }
    }

    /// A kube client whose calls reach `store`, held as `hang` says.
    fn client(store: Arc<Mutex<LeaseStore>>, hang: watch::Receiver<Hang>) -> kube::Client {
        let service = tower::service_fn(move |request: http::Request<Body>| {
            let store = store.clone();
            let mut hang = hang.clone();
            async move {
                let (parts, body) = request.into_parts();
                let body = body.collect().await?.to_bytes();
                let _ = hang.wait_for(|h| *h != Hang::BeforeApply).await;
                let answer = store.lock().unwrap_or_else(|e| e.into_inner()).answer(
                    &parts.method,
                    parts.uri.path(),
                    &body,
                );
                let _ = hang.wait_for(|h| *h != Hang::AfterApply).await;
                Ok::<_, kube::Error>(answer)
            }
        });
        kube::Client::new(service, NAMESPACE)
    }

    /// One candidate: its hang switch and the times its leadership changed.
    struct Candidate {
        hang: watch::Sender<Hang>,
        leader: watch::Receiver<bool>,
        changes: Arc<Mutex<Vec<(Instant, bool)>>>,
    }

    fn start(
        name: &str,
        store: &Arc<Mutex<LeaseStore>>,
        stop: &watch::Receiver<bool>,
    ) -> Candidate {
        let (hang, hang_rx) = watch::channel(Hang::No);
        let (leader_tx, leader) = watch::channel(false);
        let elector = LeaderElector::new(
            client(store.clone(), hang_rx),
            NAMESPACE,
            name.to_string(),
            LeaderTiming::for_lease(Duration::from_secs(15)),
        );
        tokio::spawn(elector.run(leader_tx, stop.clone()));
        // Paused time stands still while tasks can run, so each change is
        // logged at the virtual instant it happened.
        let changes = Arc::new(Mutex::new(Vec::new()));
        let log = changes.clone();
        let mut watching = leader.clone();
        tokio::spawn(async move {
            while watching.changed().await.is_ok() {
                let now = *watching.borrow_and_update();
                log.lock().unwrap().push((Instant::now(), now));
            }
        });
        Candidate {
            hang,
            leader,
            changes,
        }
    }

    /// `wait` within `limit` of paused time, or the test fails (instead of
    /// waiting for ever on code that never steps down).
    async fn within<T>(
        limit: Duration,
        what: &str,
        wait: impl std::future::Future<Output = T>,
    ) -> T {
        match tokio::time::timeout(limit, wait).await {
            Ok(value) => value,
            Err(_) => panic!("{what}: not within {limit:?}"),
        }
    }

    /// Leadership intervals of each candidate, `[start, end)`.
    fn intervals(c: &Candidate, until: Instant) -> Vec<(Instant, Instant)> {
        let mut out = Vec::new();
        let mut since = None;
        for &(at, leader) in c.changes.lock().unwrap().iter() {
            match (leader, since) {
                (true, None) => since = Some(at),
                (false, Some(s)) => {
                    out.push((s, at));
                    since = None;
                }
                _ => {}
            }
        }
        if let Some(s) = since {
            out.push((s, until));
        }
        out
    }

    /// No two candidates lead at once; a hand-over leaves at least `gap`.
    fn assert_never_two_leaders(candidates: &[&Candidate], gap: Duration) -> usize {
        let until = Instant::now();
        let mut all: Vec<(Instant, Instant, usize)> = Vec::new();
        for (i, c) in candidates.iter().enumerate() {
            all.extend(intervals(c, until).into_iter().map(|(s, e)| (s, e, i)));
        }
        all.sort();
        for pair in all.windows(2) {
            let ((_, end, a), (start, _, b)) = (pair[0], pair[1]);
            assert!(
                start >= end + gap,
                "candidate {b} became leader {:?} after candidate {a} started leading, while {a} still led (or within {gap:?} of it stepping down)",
                start.duration_since(pair[0].0)
            );
        }
        all.len()
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_renewal_hangs_steps_down_before_another_takes_over() {
        for mode in [Hang::BeforeApply, Hang::AfterApply] {
            let store = Arc::new(Mutex::new(LeaseStore::default()));
            let (stop_tx, stop) = watch::channel(false);
            let mut a = start("a", &store, &stop);
            within(Duration::from_secs(5), "a leads", a.leader.wait_for(|l| *l))
                .await
                .unwrap();
            let b = start("b", &store, &stop);
            tokio::time::sleep(Duration::from_secs(30)).await;
            assert!(*a.leader.borrow() && !*b.leader.borrow());

            // A's API calls hang from now on.
            let hung_at = Instant::now();
            a.hang.send_replace(mode);
            within(
                Duration::from_secs(60),
                "the hung leader steps down",
                a.leader.wait_for(|l| !*l),
            )
            .await
            .unwrap();
            let stepped_down = Instant::now();
            // Its last renewal began at most one retry period before the
            // hang: it steps down within the renew deadline of that.
            assert!(
                stepped_down.duration_since(hung_at) <= Duration::from_secs(10),
                "{mode:?}: stepped down {:?} after the hang",
                stepped_down.duration_since(hung_at)
            );
            let mut b_leader = b.leader.clone();
            within(
                Duration::from_secs(60),
                "b takes over",
                b_leader.wait_for(|l| *l),
            )
            .await
            .unwrap();
            assert_eq!(store.lock().unwrap().holder().as_deref(), Some("b"));

            // The held call is let go: a late PUT must not make A leader again.
            a.hang.send_replace(Hang::No);
            tokio::time::sleep(Duration::from_secs(60)).await;
            assert!(!*a.leader.borrow() && *b.leader.borrow(), "{mode:?}");
            // The lease's 15 s minus the renew deadline's 10 s: 5 s between
            // A stepping down and B taking over, at the least.
            assert_never_two_leaders(&[&a, &b], Duration::from_secs(5));
            stop_tx.send_replace(true);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn never_two_leaders_while_calls_hang_and_recover_in_turn() {
        let store = Arc::new(Mutex::new(LeaseStore::default()));
        let (stop_tx, stop) = watch::channel(false);
        let candidates = [
            start("a", &store, &stop),
            start("b", &store, &stop),
            start("c", &store, &stop),
        ];
        // A fixed pseudo-random schedule (an LCG): every 1-8 s one candidate
        // hangs before or after the server applies its call, or recovers.
        let mut seed: u64 = 0x5eed;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..400 {
            let who = &candidates[next(3) as usize];
            let mode = [Hang::No, Hang::No, Hang::BeforeApply, Hang::AfterApply][next(4) as usize];
            who.hang.send_replace(mode);
            tokio::time::sleep(Duration::from_secs(1 + next(8))).await;
        }
        for c in &candidates {
            c.hang.send_replace(Hang::No);
        }
        tokio::time::sleep(Duration::from_secs(60)).await;
        let refs: Vec<&Candidate> = candidates.iter().collect();
        let terms = assert_never_two_leaders(&refs, Duration::ZERO);
        assert!(
            terms >= 10,
            "the schedule moved leadership only {terms} times"
        );
        assert_eq!(
            candidates.iter().filter(|c| *c.leader.borrow()).count(),
            1,
            "once every call answers, one leader"
        );
        stop_tx.send_replace(true);
    }
}
