//! [`Admission`]: which requests are served now, which wait briefly,
//! which are refused at once. Bounds the signing slots of the CA service
//! and, separately, the Kubernetes API calls of TokenReview, so neither a
//! burst nor a flood builds an unbounded queue.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

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

/// Which requests are served now, which wait, which are refused.
///
/// At most `slots` requests are handled at once. More wait for a slot, at
/// most [`QUEUE_WAIT`] each, in a queue whose length follows the CA's
/// measured pace: as many as it finishes in half of [`QUEUE_WAIT`], never
/// fewer than [`QUEUE_PER_SLOT`] per slot, never more than
/// [`QUEUE_PER_SLOT_MAX`]. A CA that answers fast thus takes a mass
/// restart's burst at once instead of refusing most of it to come back
/// later, while one whose API answers slowly keeps a short queue and
/// refuses the rest at once, with nothing left to time out (docs/benchmarks-history.md,
/// "All goals, on the machine of 2026-11-30", has the mass restart before
/// and after).
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

    /// Lets up to `max_waiting` requests wait at the fastest measured pace
    /// (instead of [`QUEUE_PER_SLOT_MAX`] per slot; never below the floor
    /// of [`QUEUE_PER_SLOT`] per slot).
    pub(crate) fn with_queue_limit(mut self, max_waiting: usize) -> Self {
        self.max_waiting = max_waiting.max(self.min_waiting);
        self
    }

    /// Lets at least `min_waiting` requests wait whatever the measured
    /// pace (instead of [`QUEUE_PER_SLOT`] per slot; never above the
    /// queue limit).
    pub(crate) fn with_queue_floor(mut self, min_waiting: usize) -> Self {
        self.min_waiting = min_waiting.min(self.max_waiting);
        self
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

    #[tokio::test(start_paused = true)]
    async fn a_queue_floor_lets_a_burst_wait_before_any_pace_is_measured() {
        let waiting = Gauge::default();
        // One slot: 8 may wait by default; with a floor of 20, 20 may.
        let admission = Admission::new(1, waiting.clone()).with_queue_floor(20);
        assert_eq!(admission.queue_length(), 20);
        let held = admission.admit().await.unwrap();
        let mut waiters: Vec<_> = (0..20).map(|_| Box::pin(admission.admit())).collect();
        for w in &mut waiters {
            assert!(futures::poll!(w.as_mut()).is_pending());
        }
        assert_eq!(waiting.get(), 20);
        assert!(admission.admit().await.is_none(), "the 21st is refused");
        drop(waiters);
        drop(held);
        // The floor never exceeds the queue limit.
        let capped = Admission::new(1, Gauge::default())
            .with_queue_limit(10)
            .with_queue_floor(20);
        assert_eq!(capped.queue_length(), 10);
    }
}
