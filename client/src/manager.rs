//! [`CertManager`]: keeps certificates fresh for one identity or thousands.
//!
//! - Each identity is fetched once at start, then renewed when
//!   [`ManagerConfig::renew_fraction`] of its lifetime has passed, with
//!   jitter so that thousands of identities do not renew in one burst.
//! - A failed fetch is retried with per-identity exponential backoff (capped,
//!   jittered). A still-valid certificate is never dropped because a renewal
//!   failed; subscribers keep it until it expires.
//! - At most [`ManagerConfig::max_in_flight`] requests run at once; first
//!   fetches go before renewals.
//! - Identities can be added and removed at any time; subscribers get every
//!   new certificate through a `tokio::sync::watch` channel.
//!
//! The manager talks to the CA through the [`CertificateIssuer`] trait, so
//! tests drive it with a scripted fake and paused time.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use meshca_certs::SpiffeId;
use time::OffsetDateTime;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

pub use crate::issuer::CertificateIssuer;
use crate::issuer::{ClientError, Svid};

/// The state subscribers see for one identity.
#[derive(Debug, Clone)]
pub enum CertState {
    /// No certificate yet; the first fetch is pending.
    Initializing,
    /// A valid certificate (possibly while a renewal is being retried).
    Available(Arc<Svid>),
    /// No valid certificate: the first fetch failed, or the last
    /// certificate expired while renewals kept failing.
    Unavailable(Arc<ClientError>),
}

impl CertState {
    /// The certificate, if available.
    pub fn svid(&self) -> Option<&Arc<Svid>> {
        match self {
            Self::Available(svid) => Some(svid),
            _ => None,
        }
    }
}

/// Rotation and retry policy.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// Renew when this fraction of the lifetime has passed (0 < f < 1).
    pub renew_fraction: f64,
    /// Jitter on the renewal time, as a fraction of the lifetime (± half of it).
    pub renew_jitter: f64,
    /// Never renew sooner than this after receipt (nor later than half of
    /// the certificate's remaining life, when that is shorter).
    pub min_renew_delay: Duration,
    /// First retry delay after a failure.
    pub initial_backoff: Duration,
    /// Longest retry delay.
    pub max_backoff: Duration,
    /// Most fetches in flight at once.
    pub max_in_flight: usize,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            renew_fraction: 0.5,
            renew_jitter: 0.1,
            min_renew_delay: Duration::from_secs(1),
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            max_in_flight: 8,
        }
    }
}

/// Queue priority: first fetches before renewals.
const CLASS_FIRST_FETCH: u8 = 0;
const CLASS_RENEWAL: u8 = 1;

type QueueKey = (u8, Instant, u64, SpiffeId);

struct Entry {
    tx: watch::Sender<CertState>,
    queued: Option<QueueKey>,
    backoff: Duration,
    generation: u64,
    current: Option<Arc<Svid>>,
}

#[derive(Default)]
struct State {
    entries: HashMap<SpiffeId, Entry>,
    queue: BTreeSet<QueueKey>,
    in_flight: usize,
    seq: u64,
}

impl State {
    fn schedule(&mut self, id: &SpiffeId, class: u8, at: Instant) {
        self.seq += 1;
        let key = (class, at, self.seq, id.clone());
        if let Some(entry) = self.entries.get_mut(id) {
            if let Some(old) = entry.queued.take() {
                self.queue.remove(&old);
            }
            entry.queued = Some(key.clone());
            self.queue.insert(key);
        }
    }
}

struct Inner {
    issuer: Arc<dyn CertificateIssuer>,
    config: ManagerConfig,
    state: Mutex<State>,
    wake: Notify,
    stopped: AtomicBool,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent-enough state
        // for scheduling; keep going rather than poisoning everything.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Keeps certificates fresh for a set of identities.
pub struct CertManager {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CertManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertManager")
            .field("identities", &self.len())
            .field("config", &self.inner.config)
            .finish()
    }
}

impl CertManager {
    /// Starts a manager (its scheduler runs on the current Tokio runtime).
    pub fn new(issuer: Arc<dyn CertificateIssuer>, config: ManagerConfig) -> Self {
        let inner = Arc::new(Inner {
            issuer,
            config,
            state: Mutex::new(State::default()),
            wake: Notify::new(),
            stopped: AtomicBool::new(false),
        });
        tokio::spawn(drive(inner.clone()));
        Self { inner }
    }

    /// Starts managing `identity` (if not already) and subscribes to it.
    pub fn add(&self, identity: SpiffeId) -> watch::Receiver<CertState> {
        let mut state = self.inner.lock();
        if let Some(entry) = state.entries.get(&identity) {
            return entry.tx.subscribe();
        }
        let (tx, rx) = watch::channel(CertState::Initializing);
        state.entries.insert(
            identity.clone(),
            Entry {
                tx,
                queued: None,
                backoff: self.inner.config.initial_backoff,
                generation: 0,
                current: None,
            },
        );
        state.schedule(&identity, CLASS_FIRST_FETCH, Instant::now());
        drop(state);
        self.inner.wake.notify_one();
        rx
    }

    /// Renews `identity`'s certificate now, ahead of its time (e.g. the
    /// CRL lists its serial). False if it is not managed or a fetch for it
    /// is already in flight.
    pub fn renew_now(&self, identity: &SpiffeId) -> bool {
        let mut state = self.inner.lock();
        // Queued: moved to now. In flight: a new certificate is coming.
        let queued = state
            .entries
            .get(identity)
            .is_some_and(|entry| entry.queued.is_some());
        if queued {
            state.schedule(identity, CLASS_RENEWAL, Instant::now());
        }
        drop(state);
        if queued {
            self.inner.wake.notify_one();
        }
        queued
    }

    /// Subscribes to an identity already managed.
    pub fn subscribe(&self, identity: &SpiffeId) -> Option<watch::Receiver<CertState>> {
        self.inner
            .lock()
            .entries
            .get(identity)
            .map(|e| e.tx.subscribe())
    }

    /// Stops managing `identity`; its subscribers see the channel close.
    pub fn remove(&self, identity: &SpiffeId) -> bool {
        let mut state = self.inner.lock();
        match state.entries.remove(identity) {
            Some(mut entry) => {
                if let Some(key) = entry.queued.take() {
                    state.queue.remove(&key);
                }
                true
            }
            None => false,
        }
    }

    /// How many identities are managed.
    pub fn len(&self) -> usize {
        self.inner.lock().entries.len()
    }

    /// Whether no identity is managed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many fetches are in flight now.
    pub fn in_flight(&self) -> usize {
        self.inner.lock().in_flight
    }
}

impl Drop for CertManager {
    fn drop(&mut self) {
        self.inner.stopped.store(true, Ordering::Relaxed);
        self.inner.wake.notify_one();
    }
}

/// The scheduler: starts due fetches up to the in-flight limit, sleeps
/// until the next due time or a wake-up.
async fn drive(inner: Arc<Inner>) {
    loop {
        if inner.stopped.load(Ordering::Relaxed) {
            return;
        }
        let next_due = {
            let mut state = inner.lock();
            let now = Instant::now();
            while state.in_flight < inner.config.max_in_flight.max(1) {
                let Some(first) = state.queue.first().cloned() else {
                    break;
                };
                if first.1 > now {
                    break;
                }
                state.queue.remove(&first);
                let id = first.3;
                let Some(entry) = state.entries.get_mut(&id) else {
                    continue;
                };
                entry.queued = None;
                entry.generation += 1;
                let generation = entry.generation;
                state.in_flight += 1;
                tokio::spawn(fetch_one(inner.clone(), id, generation));
            }
            if state.in_flight < inner.config.max_in_flight.max(1) {
                state.queue.first().map(|k| k.1)
            } else {
                None
            }
        };
        match next_due {
            Some(at) => {
                tokio::select! {
                    _ = inner.wake.notified() => {}
                    _ = tokio::time::sleep_until(at) => {}
                }
            }
            None => inner.wake.notified().await,
        }
    }
}

async fn fetch_one(inner: Arc<Inner>, id: SpiffeId, generation: u64) {
    let result = inner.issuer.fetch(&id).await;
    let now = Instant::now();
    let wall_now = OffsetDateTime::now_utc();
    {
        let mut state = inner.lock();
        state.in_flight = state.in_flight.saturating_sub(1);
        let config = &inner.config;
        let Some(entry) = state.entries.get_mut(&id) else {
            drop(state);
            inner.wake.notify_one();
            return;
        };
        if entry.generation != generation {
            drop(state);
            inner.wake.notify_one();
            return;
        }
        let (class, at) = match result {
            Ok(svid) => {
                let svid = Arc::new(svid);
                let delay = renewal_delay(&svid, wall_now, config);
                let lifetime = svid.leaf.not_after - svid.leaf.not_before;
                let remaining = svid.leaf.not_after - wall_now;
                let delay = if remaining * 4 >= lifetime {
                    entry.backoff = config.initial_backoff;
                    delay
                } else {
                    // An answer with less than a quarter of its life left
                    // (a clock ahead of the CA's, a CA near its own end):
                    // used, but the next fetch backs off as after a
                    // failure, so that such answers cannot make a tight
                    // loop against the CA.
                    let backed_off = delay.max(jittered(entry.backoff, 0.2));
                    entry.backoff = (entry.backoff * 2).min(config.max_backoff);
                    backed_off
                };
                entry.current = Some(svid.clone());
                entry.tx.send_replace(CertState::Available(svid.clone()));
                tracing::debug!(identity = %id, serial = %svid.leaf.serial_hex, renew_in = ?delay, "certificate issued");
                (CLASS_RENEWAL, now + delay)
            }
            Err(error) => {
                let delay = jittered(entry.backoff, 0.2);
                entry.backoff = (entry.backoff * 2).min(config.max_backoff);
                let still_valid = entry
                    .current
                    .as_ref()
                    .is_some_and(|svid| svid.leaf.not_after > wall_now);
                tracing::warn!(identity = %id, error = %error, retry_in = ?delay, kept_valid_cert = still_valid, "fetching a certificate failed");
                if !still_valid {
                    entry.current = None;
                    entry
                        .tx
                        .send_replace(CertState::Unavailable(Arc::new(error)));
                }
                let class = if still_valid {
                    CLASS_RENEWAL
                } else {
                    CLASS_FIRST_FETCH
                };
                (class, now + delay)
            }
        };
        state.schedule(&id, class, at);
    }
    inner.wake.notify_one();
}

/// However little life an answer has left, its renewal waits at least this
/// long (or `min_renew_delay`, if shorter).
const ABSOLUTE_MIN_RENEW_DELAY: Duration = Duration::from_millis(250);

/// When to renew `svid`: at `renew_fraction` of its lifetime, ± jitter,
/// no sooner than `min_renew_delay` (or half its remaining life if shorter).
fn renewal_delay(svid: &Svid, wall_now: OffsetDateTime, config: &ManagerConfig) -> Duration {
    let not_before = svid.leaf.not_before;
    let not_after = svid.leaf.not_after;
    let lifetime = (not_after - not_before).as_seconds_f64().max(0.0);
    let jitter = (random_unit() - 0.5) * config.renew_jitter * lifetime;
    // Seconds as f64 with the sub-second part: `unix_timestamp()` would drop
    // up to a second of `wall_now`, pushing a short-lived certificate's
    // renewal up to a second late (past its expiry for a 2 s lifetime).
    let renew_at = unix_seconds(not_before) + lifetime * config.renew_fraction + jitter;
    let delay = renew_at - unix_seconds(wall_now);
    // The floor keeps a certificate already past its renewal point from
    // being fetched in a tight loop, but never pushes the renewal beyond
    // half of what is left of the certificate's life.
    let remaining = (unix_seconds(not_after) - unix_seconds(wall_now)).max(0.0);
    let floor = config
        .min_renew_delay
        .min(Duration::from_secs_f64(remaining / 2.0))
        .max(config.min_renew_delay.min(ABSOLUTE_MIN_RENEW_DELAY));
    Duration::from_secs_f64(delay.max(0.0)).max(floor)
}

/// `at` as seconds since the Unix epoch, sub-second part included.
fn unix_seconds(at: OffsetDateTime) -> f64 {
    (at - OffsetDateTime::UNIX_EPOCH).as_seconds_f64()
}

/// `base` ± `fraction`/2 of itself.
fn jittered(base: Duration, fraction: f64) -> Duration {
    let factor = 1.0 + (random_unit() - 0.5) * fraction;
    base.mul_f64(factor.max(0.0))
}

/// A uniform number in [0, 1).
fn random_unit() -> f64 {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 4];
    if ring::rand::SystemRandom::new().fill(&mut bytes).is_err() {
        return 0.5;
    }
    f64::from(u32::from_le_bytes(bytes)) / (f64::from(u32::MAX) + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use meshca_certs::profile::{self_signed_root, SigningCa, SubjectKey, SubjectName, Validity};
    use meshca_certs::{KeyAlgorithm, PrivateKey, TrustBundle};
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicU64, AtomicUsize};

    /// A scripted issuer: answers from a script (Ok with a lifetime, or an
    /// error), records calls, can be slowed down.
    struct ScriptedIssuer {
        ca: SigningCa,
        script: Mutex<VecDeque<Result<Duration, tonic::Code>>>,
        default_lifetime: Duration,
        calls: Mutex<Vec<(SpiffeId, Instant)>>,
        /// Milliseconds each fetch takes (changed while a test runs).
        latency_ms: AtomicU64,
        concurrent: AtomicUsize,
        max_concurrent: AtomicUsize,
    }

    impl ScriptedIssuer {
        fn new(default_lifetime: Duration) -> Self {
            let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
            let root = self_signed_root(
                &key,
                &SubjectName {
                    common_name: Some("test".into()),
                    ..Default::default()
                },
                Validity::backdated(OffsetDateTime::now_utc(), time::Duration::days(3650)),
            )
            .unwrap();
            Self {
                ca: SigningCa::new(root.der, key).unwrap(),
                script: Mutex::new(VecDeque::new()),
                default_lifetime,
                calls: Mutex::new(Vec::new()),
                latency_ms: AtomicU64::new(0),
                concurrent: AtomicUsize::new(0),
                max_concurrent: AtomicUsize::new(0),
            }
        }

        fn push(&self, step: Result<Duration, tonic::Code>) {
            self.script.lock().unwrap().push_back(step);
        }

        fn calls(&self) -> Vec<(SpiffeId, Instant)> {
            self.calls.lock().unwrap().clone()
        }
    }

    #[async_trait]
    impl CertificateIssuer for ScriptedIssuer {
        async fn fetch(&self, identity: &SpiffeId) -> Result<Svid, ClientError> {
            let now_running = self.concurrent.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_concurrent.fetch_max(now_running, Ordering::SeqCst);
            let latency = self.latency_ms.load(Ordering::SeqCst);
            if latency > 0 {
                tokio::time::sleep(Duration::from_millis(latency)).await;
            }
            self.concurrent.fetch_sub(1, Ordering::SeqCst);
            self.calls
                .lock()
                .unwrap()
                .push((identity.clone(), Instant::now()));
            let step = self
                .script
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or(Ok(self.default_lifetime));
            let lifetime = step.map_err(|code| ClientError::Rpc {
                code,
                message: "scripted".into(),
            })?;
            let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
            // Validity starts now (no backdating) so the schedule is exact.
            let now = OffsetDateTime::now_utc().replace_nanosecond(0).unwrap();
            let validity = Validity {
                not_before: now,
                not_after: now + time::Duration::try_from(lifetime).unwrap(),
            };
            let cert = self
                .ca
                .issue_workload(&SubjectKey::of(&key).unwrap(), identity, validity)
                .unwrap();
            let bundle = TrustBundle::new(vec![self.ca.cert_der().to_vec()]);
            let leaf = meshca_certs::verify::check_svid_leaf(&cert.der).unwrap();
            Ok(Svid {
                key,
                chain_pem: vec![cert.to_pem()],
                bundle,
                leaf,
            })
        }
    }

    fn id(n: usize) -> SpiffeId {
        SpiffeId::parse(&format!("spiffe://cluster.local/ns/test/sa/sa-{n}")).unwrap()
    }

    fn exact_config() -> ManagerConfig {
        ManagerConfig {
            renew_jitter: 0.0,
            ..ManagerConfig::default()
        }
    }

    async fn wait_for_serial_change(
        rx: &mut watch::Receiver<CertState>,
        old: Option<String>,
    ) -> Arc<Svid> {
        loop {
            rx.changed().await.unwrap();
            if let CertState::Available(svid) = &*rx.borrow() {
                if Some(&svid.leaf.serial_hex) != old.as_ref() {
                    return svid.clone();
                }
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn renews_at_half_of_the_lifetime() {
        let issuer = Arc::new(ScriptedIssuer::new(Duration::from_secs(100)));
        let manager = CertManager::new(issuer.clone(), exact_config());
        let mut rx = manager.add(id(1));
        let first = wait_for_serial_change(&mut rx, None).await;
        let t0 = Instant::now();
        let second = wait_for_serial_change(&mut rx, Some(first.leaf.serial_hex.clone())).await;
        let waited = Instant::now() - t0;
        // 50 s after not_before; wall-clock rounding may take up to 1 s off.
        assert!(
            waited >= Duration::from_secs(49) && waited <= Duration::from_secs(51),
            "{waited:?}"
        );
        assert_ne!(first.leaf.serial_hex, second.leaf.serial_hex);
        assert_eq!(issuer.calls().len(), 2);
    }

    #[tokio::test]
    async fn a_short_lifetime_is_renewed_at_its_half_life_to_the_millisecond() {
        // A 2 s certificate fetched 0.9 s into its first second (notBefore
        // is whole seconds): renewal is due 0.1 s later, not 1.1 s later
        // (whole-second arithmetic took a 2 s SVID past its expiry).
        let issuer = ScriptedIssuer::new(Duration::from_secs(2));
        let svid = issuer.fetch(&id(1)).await.unwrap();
        let wall_now = svid.leaf.not_before + time::Duration::milliseconds(900);
        let config = ManagerConfig {
            min_renew_delay: Duration::ZERO,
            ..exact_config()
        };
        let delay = renewal_delay(&svid, wall_now, &config);
        assert!(
            (delay.as_secs_f64() - 0.1).abs() < 0.001,
            "renewal in {delay:?}"
        );
        // The 1 s floor against tight loops yields to half of the 1.1 s left.
        let floored = renewal_delay(&svid, wall_now, &exact_config());
        assert!(
            (floored.as_secs_f64() - 0.55).abs() < 0.001,
            "renewal in {floored:?}"
        );
    }

    #[tokio::test]
    async fn an_answer_with_little_life_left_is_renewed_no_sooner_than_the_floor() {
        let issuer = ScriptedIssuer::new(Duration::from_secs(2));
        let svid = issuer.fetch(&id(1)).await.unwrap();
        // 1.99 s into a 2 s certificate (a clock ahead of the CA's).
        let wall_now = svid.leaf.not_before + time::Duration::milliseconds(1990);
        let delay = renewal_delay(&svid, wall_now, &exact_config());
        assert_eq!(delay, ABSOLUTE_MIN_RENEW_DELAY);
    }

    #[tokio::test(start_paused = true)]
    async fn keeps_the_old_certificate_and_backs_off_on_failure() {
        let issuer = Arc::new(ScriptedIssuer::new(Duration::from_secs(1000)));
        issuer.push(Ok(Duration::from_secs(1000)));
        for _ in 0..6 {
            issuer.push(Err(tonic::Code::Unavailable));
        }
        let manager = CertManager::new(issuer.clone(), exact_config());
        let mut rx = manager.add(id(1));
        let first = wait_for_serial_change(&mut rx, None).await;
        // Renewal at ~500 s fails six times, then succeeds.
        let second = wait_for_serial_change(&mut rx, Some(first.leaf.serial_hex.clone())).await;
        assert_ne!(first.leaf.serial_hex, second.leaf.serial_hex);
        let calls = issuer.calls();
        assert_eq!(calls.len(), 8);
        let gaps: Vec<f64> = calls
            .windows(2)
            .skip(1)
            .map(|w| (w[1].1 - w[0].1).as_secs_f64())
            .collect();
        // 1, 2, 4, 8, 16, 30 (capped), each ±10 %.
        let expected = [1.0, 2.0, 4.0, 8.0, 16.0, 30.0];
        for (gap, want) in gaps.iter().zip(expected) {
            assert!((gap - want).abs() <= want * 0.11, "gaps {gaps:?}");
        }
        // During the failures subscribers never lost the certificate: the
        // channel only ever held Available values after the first.
        assert!(matches!(&*rx.borrow(), CertState::Available(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn first_fetch_failure_is_reported_then_recovers() {
        let issuer = Arc::new(ScriptedIssuer::new(Duration::from_secs(1000)));
        issuer.push(Err(tonic::Code::Unauthenticated));
        let manager = CertManager::new(issuer.clone(), exact_config());
        let mut rx = manager.add(id(1));
        rx.changed().await.unwrap();
        assert!(matches!(&*rx.borrow(), CertState::Unavailable(_)));
        let svid = wait_for_serial_change(&mut rx, None).await;
        assert_eq!(svid.leaf.spiffe_id, id(1));
    }

    #[tokio::test(start_paused = true)]
    async fn bounded_in_flight_and_first_fetches_before_renewals() {
        let issuer = ScriptedIssuer::new(Duration::from_secs(10));
        issuer.latency_ms.store(100, Ordering::SeqCst);
        let issuer = Arc::new(issuer);
        let config = ManagerConfig {
            max_in_flight: 3,
            ..exact_config()
        };
        let manager = CertManager::new(issuer.clone(), config);
        let mut receivers = Vec::new();
        for n in 0..30 {
            receivers.push(manager.add(id(n)));
        }
        for rx in &mut receivers {
            wait_for_serial_change(rx, None).await;
        }
        assert!(issuer.max_concurrent.load(Ordering::SeqCst) <= 3);
        assert_eq!(issuer.max_concurrent.load(Ordering::SeqCst), 3);
        // Renewals (due 4-5 s after each first fetch, by the wall clock's
        // sub-second part) now take 1 s each, so at 6.5 s most of them are
        // still queued with three in flight; 10 identities added then must
        // be served before every queued renewal.
        issuer.latency_ms.store(1000, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(5500)).await;
        let before = issuer.calls().len();
        assert!(before < 30 + 12, "renewals not queued: {before} calls");
        for n in 100..110 {
            receivers.push(manager.add(id(n)));
        }
        tokio::time::sleep(Duration::from_secs(6)).await;
        let calls = issuer.calls();
        // The three renewals already in flight finish first; every fetch
        // started after the additions is a first fetch of a new identity.
        let next: Vec<&SpiffeId> = calls[before..]
            .iter()
            .map(|(i, _)| i)
            .skip(3)
            .take(10)
            .collect();
        let new_ids: Vec<SpiffeId> = (100..110).map(id).collect();
        let served_new = next.iter().filter(|i| new_ids.contains(i)).count();
        assert_eq!(served_new, 10, "new identities first: {next:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn identities_can_be_removed() {
        let issuer = Arc::new(ScriptedIssuer::new(Duration::from_secs(10)));
        let manager = CertManager::new(issuer.clone(), exact_config());
        let mut rx = manager.add(id(1));
        wait_for_serial_change(&mut rx, None).await;
        assert!(manager.remove(&id(1)));
        assert!(manager.is_empty());
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(issuer.calls().len(), 1, "no renewal after removal");
        assert!(
            rx.changed().await.is_err(),
            "subscribers see the channel close"
        );
    }

    #[test]
    fn renewal_delay_has_bounds() {
        let config = ManagerConfig::default();
        let issuer = ScriptedIssuer::new(Duration::from_secs(100));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let svid = rt.block_on(issuer.fetch(&id(1))).unwrap();
        let now = svid.leaf.not_before;
        for _ in 0..100 {
            let d = renewal_delay(&svid, now, &config).as_secs_f64();
            assert!((45.0..=55.0).contains(&d), "{d}");
        }
        // Past the renewal point: renew soon, but not in a tight loop.
        let late = svid.leaf.not_before + time::Duration::seconds(90);
        assert_eq!(renewal_delay(&svid, late, &config), config.min_renew_delay);
    }
}
