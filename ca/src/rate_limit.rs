//! Per-identity issuance rate limit: no client can loop the CA.
//!
//! Each key (the identity issued, and the pod that asked when its token
//! names one) may get `burst` certificates at once and one more every
//! `interval` after that (GCRA, the token bucket as a single timestamp per
//! key). Beyond it a request is refused with `RESOURCE_EXHAUSTED` and told
//! when to retry. An honest client renews once per half-lifetime, far below
//! the default rate; a client in a loop gets its burst, then one certificate
//! per interval.
//!
//! The map of keys is bounded: a key whose bucket is full again carries no
//! information and is dropped when the map reaches `max_keys`; if every key
//! is still draining, a new key is let through untracked (an authenticated
//! caller is never refused because others filled the map).
//!
//! Why not the `governor` crate: its keyed limiter has no bound on its map
//! and runs on its own clock, not tokio's, so it could be neither capped
//! nor tested with paused time.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Default certificates one key may get at once.
pub(crate) const DEFAULT_BURST: u32 = 100;
/// Default time after which a key may get one more certificate.
pub(crate) const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
/// Default number of keys tracked at once.
pub(crate) const DEFAULT_MAX_KEYS: usize = 50_000;
/// A full map is swept for refilled keys at most this often (a sweep
/// visits every key).
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// The rate limit's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RateLimitPolicy {
    /// Certificates a key may get at once; 0 turns the limit off.
    pub(crate) burst: u32,
    /// After the burst, one more certificate per `interval`.
    pub(crate) interval: Duration,
    /// Keys tracked at once.
    pub(crate) max_keys: usize,
}

impl Default for RateLimitPolicy {
    fn default() -> Self {
        Self {
            burst: DEFAULT_BURST,
            interval: DEFAULT_INTERVAL,
            max_keys: DEFAULT_MAX_KEYS,
        }
    }
}

/// A refused request: when the key may ask again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Throttled {
    /// Time until the next certificate is allowed.
    pub(crate) retry_after: Duration,
}

/// The per-key limiter.
#[derive(Debug)]
pub(crate) struct IssuanceRateLimit {
    policy: RateLimitPolicy,
    state: Mutex<Buckets>,
}

#[derive(Debug, Default)]
struct Buckets {
    /// Key → theoretical arrival time: the bucket is full again then.
    full_at: HashMap<String, Instant>,
    last_sweep: Option<Instant>,
}

impl IssuanceRateLimit {
    /// A limiter with `policy`.
    pub(crate) fn new(policy: RateLimitPolicy) -> Self {
        Self {
            policy,
            state: Mutex::new(Buckets::default()),
        }
    }

    /// The settings.
    pub(crate) fn policy(&self) -> RateLimitPolicy {
        self.policy
    }

    /// Takes one certificate for `key` at `now`, or says when to retry.
    pub(crate) fn check(&self, key: &str, now: Instant) -> Result<(), Throttled> {
        let RateLimitPolicy {
            burst,
            interval,
            max_keys,
        } = self.policy;
        if burst == 0 {
            return Ok(());
        }
        // The bucket may run `tolerance` ahead of now: burst − 1 intervals.
        let tolerance = interval.saturating_mul(burst - 1);
        let mut buckets = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Buckets {
            full_at,
            last_sweep,
        } = &mut *buckets;
        if let Some(at) = full_at.get_mut(key) {
            let start = (*at).max(now);
            let ahead = start - now;
            if ahead > tolerance {
                return Err(Throttled {
                    retry_after: ahead - tolerance,
                });
            }
            *at = start + interval;
            return Ok(());
        }
        if full_at.len() >= max_keys {
            if last_sweep.is_none_or(|t| now.duration_since(t) >= SWEEP_INTERVAL) {
                full_at.retain(|_, at| *at > now);
                *last_sweep = Some(now);
            }
            if full_at.len() >= max_keys {
                return Ok(());
            }
        }
        full_at.insert(key.to_string(), now + interval);
        Ok(())
    }

    /// Keys tracked now.
    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .full_at
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(burst: u32, interval_secs: u64, max_keys: usize) -> IssuanceRateLimit {
        IssuanceRateLimit::new(RateLimitPolicy {
            burst,
            interval: Duration::from_secs(interval_secs),
            max_keys,
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_loop_gets_its_burst_then_one_per_interval() {
        let limit = limiter(3, 5, 10);
        let t0 = Instant::now();
        for _ in 0..3 {
            limit.check("a", t0).unwrap();
        }
        // The fourth at once: wait one interval.
        assert_eq!(
            limit.check("a", t0),
            Err(Throttled {
                retry_after: Duration::from_secs(5)
            })
        );
        // Another key has its own bucket.
        limit.check("b", t0).unwrap();
        // A client looping 10 times a second for a minute gets 12 more.
        let mut allowed = 0;
        for tick in 1..=600 {
            if limit
                .check("a", t0 + Duration::from_millis(100 * tick))
                .is_ok()
            {
                allowed += 1;
            }
        }
        assert_eq!(allowed, 12);
        // The retry hint is exact: refused just before, allowed at it.
        let now = t0 + Duration::from_secs(60);
        let Err(Throttled { retry_after }) = limit.check("a", now) else {
            panic!("a loop is throttled");
        };
        assert!(limit.check("a", now + retry_after).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn an_honest_renewal_is_never_refused() {
        // ztunnel with a 60 s TTL (66 s with backdating) renews every 33 s.
        let limit = IssuanceRateLimit::new(RateLimitPolicy::default());
        let t0 = Instant::now();
        for n in 0..1000 {
            limit.check("z", t0 + Duration::from_secs(33 * n)).unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_map_is_bounded_and_refilled_keys_make_room() {
        let limit = limiter(2, 10, 100);
        let t0 = Instant::now();
        for i in 0..100 {
            limit.check(&format!("k{i}"), t0).unwrap();
        }
        assert_eq!(limit.tracked(), 100);
        // Full, nothing refilled: a new key passes untracked.
        for i in 100..200 {
            limit.check(&format!("k{i}"), t0).unwrap();
        }
        assert_eq!(limit.tracked(), 100);
        // Tracked keys are still limited.
        limit.check("k0", t0).unwrap();
        assert!(limit.check("k0", t0).is_err());
        // After the interval the others' buckets are full again: swept.
        let later = t0 + Duration::from_secs(11);
        limit.check("new", later).unwrap();
        assert_eq!(limit.tracked(), 2, "k0 still draining, and the new key");
    }

    #[test]
    fn burst_zero_turns_the_limit_off() {
        let limit = limiter(0, 10, 1);
        let now = Instant::now();
        for _ in 0..100 {
            limit.check("a", now).unwrap();
        }
        assert_eq!(limit.tracked(), 0);
    }
}
