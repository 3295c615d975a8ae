//! Gives the heap's free pages back to the operating system after a burst
//! (shared by the CA and the agent).
//!
//! glibc's allocator keeps the memory of freed objects for reuse, and
//! gives back only what lies at the top of each of its heaps: after a
//! burst (a mass restart, a flood of junk, hostile connections that
//! closed) the pages freed in the middle stay resident, and the
//! container's memory figure stays where the burst left it although
//! nothing uses them. `malloc_trim` hands them back. It walks the free
//! lists under each heap's lock, so it runs only when a burst has passed:
//! at most once per check interval, when at least `min_peak` things
//! (requests, connections) were open at once since the last check and at
//! most a quarter of that are open now.

use std::time::Duration;

/// How often the CA looks at its open requests.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// When a burst is worth trimming after.
#[derive(Debug, Clone, Copy)]
pub struct TrimPolicy {
    /// How often the peak is looked at.
    pub check_interval: Duration,
    /// Open at once that makes a burst worth trimming after.
    pub min_peak: usize,
}

impl TrimPolicy {
    /// Whether a burst that peaked at `peak` open, with `open` open now,
    /// has passed.
    pub fn burst_passed(&self, peak: usize, open: usize) -> bool {
        peak >= self.min_peak && open <= peak / 4
    }
}

/// Trims the heap after each burst, until the runtime stops or
/// `take_peak` returns `None` (what it counts is gone). `take_peak`
/// returns the most open at once since its last call and how many are
/// open now; `what` names them in the debug line.
pub fn spawn<F>(policy: TrimPolicy, what: &'static str, mut take_peak: F)
where
    F: FnMut() -> Option<(usize, usize)> + Send + 'static,
{
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(policy.check_interval);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let Some((peak, open)) = take_peak() else {
                return;
            };
            if policy.burst_passed(peak, open) {
                // Off the runtime's threads: it may wait for heap locks.
                let _ = tokio::task::spawn_blocking(release_free_heap).await;
                tracing::debug!(what, peak, open, "burst over: free heap pages given back");
            }
        }
    });
}

/// Gives the free pages of every heap back to the OS now (glibc's
/// `malloc_trim(0)`; nothing elsewhere). Blocks while it walks the heaps.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn release_free_heap() {
    extern "C" {
        fn malloc_trim(pad: usize) -> std::os::raw::c_int;
    }
    // SAFETY: malloc_trim takes no pointer and touches only the
    // allocator's own free memory, under the allocator's locks; glibc
    // documents it as thread-safe (MT-Safe).
    unsafe {
        malloc_trim(0);
    }
}

/// Gives the free pages of every heap back to the OS now: nothing to do
/// with an allocator other than glibc's.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_heap() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_burst_that_has_passed_is_trimmed_after() {
        let policy = TrimPolicy {
            check_interval: CHECK_INTERVAL,
            min_peak: 64,
        };
        assert!(!policy.burst_passed(0, 0), "no burst");
        assert!(!policy.burst_passed(63, 0), "too small to matter");
        assert!(!policy.burst_passed(400, 200), "still going on");
        assert!(policy.burst_passed(400, 100));
        assert!(policy.burst_passed(64, 0));
    }

    #[test]
    fn trimming_keeps_what_is_in_use() {
        let kept: Vec<Vec<u8>> = (0..1000).map(|i| vec![i as u8; 1000]).collect();
        let freed: Vec<Vec<u8>> = (0..1000).map(|_| vec![0u8; 4000]).collect();
        drop(freed);
        release_free_heap();
        assert!(kept
            .iter()
            .enumerate()
            .all(|(i, v)| v.iter().all(|b| *b == i as u8)));
    }
}
