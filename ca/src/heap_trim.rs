//! Gives the heap's free pages back to the operating system after a burst
//! of requests.
//!
//! glibc's allocator keeps the memory of freed objects for reuse, and
//! gives back only what lies at the top of each of its heaps: after a
//! burst (a mass restart, a flood of junk) the pages freed in the middle
//! stay resident, and the container's memory figure stays where the burst
//! left it although nothing uses them. `malloc_trim` hands them back. It
//! walks the free lists under each heap's lock, so it runs only when a
//! burst has passed: at most once per [`CHECK_INTERVAL`], when at least
//! [`MIN_PEAK`] requests were open at once since the last check and at
//! most a quarter of that are open now.

use std::sync::Arc;
use std::time::Duration;

use crate::transport::OpenRequests;

/// How often the open requests are looked at.
pub(crate) const CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// Open requests at once that make a burst worth trimming after.
pub(crate) const MIN_PEAK: usize = 64;

/// Whether a burst that peaked at `peak` open requests has passed, with
/// `open` open now.
fn burst_passed(peak: usize, open: usize) -> bool {
    peak >= MIN_PEAK && open <= peak / 4
}

/// Trims the heap after each burst of `requests`, until the runtime stops.
pub(crate) fn spawn(requests: Arc<OpenRequests>) {
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(CHECK_INTERVAL);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let (peak, open) = requests.take_peak();
            if burst_passed(peak, open) {
                // Off the runtime's threads: it may wait for heap locks.
                let _ = tokio::task::spawn_blocking(release_free_heap).await;
                tracing::debug!(peak, open, "burst over: free heap pages given back");
            }
        }
    });
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn release_free_heap() {
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

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn release_free_heap() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_burst_that_has_passed_is_trimmed_after() {
        assert!(!burst_passed(0, 0), "no burst");
        assert!(!burst_passed(MIN_PEAK - 1, 0), "too small to matter");
        assert!(!burst_passed(400, 200), "still going on");
        assert!(burst_passed(400, 100));
        assert!(burst_passed(MIN_PEAK, 0));
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
