//! [`RateLimitedLog`]: at most one log line per interval for events that
//! an attacker can repeat at will (refused requests, a failing dependency),
//! each line saying how many it stands for. Counters stay exact: only the
//! lines are thinned out. Shared by the CA and the agent.
//!
//! ```
//! use meshca_serve::rate_limited_log::RateLimitedLog;
//!
//! let refusals = RateLimitedLog::default();
//! if let Some(unlogged) = refusals.record() {
//!     // tracing::info!(unlogged, "refused a request");
//!     assert_eq!(unlogged, 0);
//! }
//! assert_eq!(refusals.record(), None, "quiet until the interval has passed");
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// How often a line about repeated refusals is written by default.
pub const DEFAULT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Decides when the next line of one kind is due.
#[derive(Debug)]
pub struct RateLimitedLog {
    interval: Duration,
    last: Mutex<Option<Instant>>,
    unlogged: AtomicU64,
    total: AtomicU64,
}

impl Default for RateLimitedLog {
    fn default() -> Self {
        Self::new(DEFAULT_LOG_INTERVAL)
    }
}

impl RateLimitedLog {
    /// At most one line per `interval`.
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: Mutex::new(None),
            unlogged: AtomicU64::new(0),
            total: AtomicU64::new(0),
        }
    }

    /// Records one event. `Some(n)`: write a line now, standing for this
    /// event and `n` earlier ones that got no line; `None`: stay quiet.
    pub fn record(&self) -> Option<u64> {
        self.total.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        {
            let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_none_or(|at| now.duration_since(at) >= self.interval) {
                *last = Some(now);
                return Some(self.unlogged.swap(0, Ordering::Relaxed));
            }
        }
        self.unlogged.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Every event recorded so far, logged or not: an exact counter.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_line_per_interval_counting_the_quiet_ones() {
        let log = RateLimitedLog::new(Duration::from_secs(10));
        assert_eq!(log.record(), Some(0), "the first is written");
        for _ in 0..999 {
            assert_eq!(log.record(), None);
        }
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(log.record(), None);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(
            log.record(),
            Some(1_000),
            "the next line counts the quiet ones"
        );
        assert_eq!(log.record(), None);
        assert_eq!(log.total(), 1_003, "every event is counted");
    }
}
