//! How busy one HTTP/2 connection is: its open streams, since when it has
//! had none, and whether it has ever had one. Shared by the CA's gRPC
//! server and the agent's Workload API socket, which both tell a
//! connection to go away (GOAWAY) when it has had no open stream for a
//! while, and cut off one that goes on idling after it.
//!
//! A server counts each request as an open stream with
//! [`StreamActivity::open`] and keeps the returned [`OpenStream`] for as
//! long as the answer's body lives (tokio's clock and `Notify`).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use meshca_serve::stream_activity::StreamActivity;
//!
//! let activity = Arc::new(StreamActivity::default());
//! let stream = activity.open();
//! assert_eq!(activity.open_streams(), 1);
//! assert!(activity.idle_since().is_none());
//! drop(stream);
//! // Completes after 10 ms without a stream.
//! activity.idle_for(Duration::from_millis(10)).await;
//! # }
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// How many HTTP/2 streams (requests) of one connection are open, since
/// when none has been, whether any ever was, and a wake-up for each time
/// the number leaves or reaches zero.
#[derive(Debug)]
pub struct StreamActivity {
    open: AtomicUsize,
    /// Whether a stream has ever been opened.
    seen: AtomicBool,
    changed: Notify,
    /// When this was made; `idle_since` counts from it.
    made: Instant,
    /// Milliseconds after `made` when the last stream closed (or, with
    /// none yet, when the connection was set up).
    idle_since: AtomicU64,
}

impl Default for StreamActivity {
    fn default() -> Self {
        Self {
            open: AtomicUsize::new(0),
            seen: AtomicBool::new(false),
            changed: Notify::new(),
            made: Instant::now(),
            idle_since: AtomicU64::new(0),
        }
    }
}

impl StreamActivity {
    /// A stream opened: counted until the returned guard is dropped.
    pub fn open(self: &Arc<Self>) -> OpenStream {
        self.seen.store(true, Ordering::Release);
        if self.open.fetch_add(1, Ordering::AcqRel) == 0 {
            self.changed.notify_one();
        }
        OpenStream {
            activity: self.clone(),
        }
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Counts the idle time from now (the connection is set up, or its
    /// last stream closed).
    pub fn mark_idle_from_now(&self) {
        let since = Instant::now().saturating_duration_since(self.made);
        let millis = u64::try_from(since.as_millis()).unwrap_or(u64::MAX);
        self.idle_since.store(millis, Ordering::Release);
    }

    /// Since when no stream has been open, if none is open now.
    pub fn idle_since(&self) -> Option<Instant> {
        if self.open_streams() > 0 {
            return None;
        }
        let millis = self.idle_since.load(Ordering::Acquire);
        Some(self.made + Duration::from_millis(millis))
    }

    /// Completes once no stream has been open for `limit` in a row.
    pub async fn idle_for(&self, limit: Duration) {
        loop {
            if self.open_streams() > 0 {
                self.changed.notified().await;
                continue;
            }
            tokio::select! {
                () = tokio::time::sleep(limit) => {
                    if self.open_streams() == 0 {
                        return;
                    }
                }
                () = self.changed.notified() => {}
            }
        }
    }

    /// Completes `limit` after this call if no stream has been opened by
    /// then; otherwise never.
    pub async fn no_request_within(&self, limit: Duration) {
        tokio::time::sleep(limit).await;
        if self.seen.load(Ordering::Acquire) {
            std::future::pending::<()>().await;
        }
    }
}

/// One open stream; see [`StreamActivity::open`].
#[derive(Debug)]
pub struct OpenStream {
    activity: Arc<StreamActivity>,
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        if self.activity.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.activity.mark_idle_from_now();
            self.activity.changed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::Pin;

    use super::*;

    /// Whether `idle` has completed after the time advanced by `by`.
    /// (Polled first, as the server's task is when woken: it takes in
    /// what changed before the time moves.)
    async fn done_after<F: Future<Output = ()>>(idle: &mut Pin<&mut F>, by: Duration) -> bool {
        let _ = futures::poll!(idle.as_mut());
        tokio::time::advance(by).await;
        futures::poll!(idle.as_mut()).is_ready()
    }

    #[tokio::test(start_paused = true)]
    async fn idle_counts_from_the_last_stream_closed() {
        let activity = Arc::new(StreamActivity::default());
        let limit = Duration::from_secs(60);
        let idle = activity.idle_for(limit);
        tokio::pin!(idle);
        assert!(!done_after(&mut idle, Duration::from_secs(30)).await);
        // A stream opens: however long it stays open, the connection is busy.
        let first = activity.open();
        let second = activity.open();
        assert_eq!(activity.open_streams(), 2);
        assert_eq!(activity.idle_since(), None);
        assert!(!done_after(&mut idle, Duration::from_secs(300)).await);
        drop(first);
        assert!(!done_after(&mut idle, Duration::from_secs(300)).await);
        // The last one closes: idle from now, not from the first poll.
        drop(second);
        assert_eq!(activity.open_streams(), 0);
        assert_eq!(activity.idle_since(), Some(Instant::now()));
        assert!(!done_after(&mut idle, Duration::from_secs(59)).await);
        assert!(done_after(&mut idle, Duration::from_secs(2)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_that_opens_and_closes_restarts_the_idle_clock() {
        let activity = Arc::new(StreamActivity::default());
        let idle = activity.idle_for(Duration::from_secs(60));
        tokio::pin!(idle);
        assert!(!done_after(&mut idle, Duration::from_secs(50)).await);
        drop(activity.open());
        assert!(!done_after(&mut idle, Duration::from_secs(50)).await);
        assert!(done_after(&mut idle, Duration::from_secs(11)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn only_a_connection_that_never_opened_a_stream_has_sent_no_request() {
        let silent = Arc::new(StreamActivity::default());
        let waiting = silent.no_request_within(Duration::from_secs(10));
        tokio::pin!(waiting);
        assert!(!done_after(&mut waiting, Duration::from_secs(9)).await);
        assert!(done_after(&mut waiting, Duration::from_secs(2)).await);

        // One stream, even one already closed, is a request.
        let asked = Arc::new(StreamActivity::default());
        let waiting = asked.no_request_within(Duration::from_secs(10));
        tokio::pin!(waiting);
        drop(asked.open());
        assert!(!done_after(&mut waiting, Duration::from_secs(3600)).await);
    }
}
