//! [`Clock`]: where token validation and the token caches read the time,
//! so tests drive it with tokio's paused time instead of sleeping.
//!
//! Two readings: wall-clock time (a token's `exp` and `nbf` are Unix
//! seconds) and monotonic time (how long a cache entry lives). Both come
//! from the clock, never from `SystemTime::now()` or `Instant::now()` in the
//! code that decides.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// A source of time.
pub(crate) trait Clock: Send + Sync + Debug {
    /// Wall-clock time.
    fn now(&self) -> SystemTime;

    /// Monotonic time (tokio's, so paused time moves it).
    fn instant(&self) -> Instant {
        Instant::now()
    }

    /// Wall-clock time as a duration since the Unix epoch (zero before it).
    fn since_epoch(&self) -> Duration {
        self.now().duration_since(UNIX_EPOCH).unwrap_or_default()
    }

    /// Wall-clock time in whole Unix seconds.
    fn unix_seconds(&self) -> u64 {
        self.since_epoch().as_secs()
    }
}

/// A shared clock.
pub(crate) type SharedClock = Arc<dyn Clock>;

/// The system's clocks: `SystemTime` for the wall, tokio's `Instant` for
/// intervals. What the server runs with.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// The system clock, shared.
pub(crate) fn system_clock() -> SharedClock {
    Arc::new(SystemClock)
}

/// Wall-clock time that moves with tokio's clock: the real time when it was
/// made, plus what tokio's `Instant` has advanced since. Under
/// `#[tokio::test(start_paused = true)]`, `tokio::time::advance` moves both
/// readings together, so a test reaches a token's expiry without waiting.
#[cfg(test)]
#[derive(Debug, Clone)]
pub(crate) struct TokioClock {
    wall_at_start: SystemTime,
    instant_at_start: Instant,
}

#[cfg(test)]
impl TokioClock {
    /// A clock starting at the current wall-clock time.
    pub(crate) fn new() -> Self {
        Self::starting_at(SystemTime::now())
    }

    /// A clock whose wall-clock reading is `wall` now.
    pub(crate) fn starting_at(wall: SystemTime) -> Self {
        Self {
            wall_at_start: wall,
            instant_at_start: Instant::now(),
        }
    }

    /// This clock, shared.
    pub(crate) fn shared(self) -> SharedClock {
        Arc::new(self)
    }
}

#[cfg(test)]
impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
impl Clock for TokioClock {
    fn now(&self) -> SystemTime {
        self.wall_at_start + self.instant_at_start.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_tokio_clock_moves_with_paused_time() {
        let clock = TokioClock::starting_at(UNIX_EPOCH + Duration::from_secs(1_000));
        assert_eq!(clock.unix_seconds(), 1_000);
        let at = clock.instant();
        tokio::time::advance(Duration::from_millis(2_500)).await;
        assert_eq!(clock.unix_seconds(), 1_002);
        assert_eq!(clock.since_epoch(), Duration::from_millis(1_002_500));
        assert_eq!(clock.instant() - at, Duration::from_millis(2_500));
    }
}
