//! The HTTP server of the monitoring endpoints (`--monitoring-listen`,
//! 15014: `/metrics`, `/ready`, `/healthz`): hyper's HTTP/1.1 server with
//! every connection bounded, since anyone who reaches the port can open
//! connections (SECURITY.md, "Who can reach what").
//!
//! - At most [`MAX_CONNECTIONS`] connections. At the cap, a newcomer takes
//!   the seat of the connection whose last request began longest ago (or
//!   that never sent one), if that was at least [`EVICT_AFTER`] ago: a
//!   kubelet probe or a scrape sends its request at once and is answered in
//!   milliseconds, so seats held by connections that send nothing go to
//!   the probes. Otherwise the newcomer is closed at accept.
//! - A request's header must arrive within [`HEADER_READ_TIMEOUT`] of the
//!   connection's opening or of its previous answer (so this is also the
//!   keep-alive idle timeout), and fit in [`MAX_BUF_SIZE`].
//! - A connection is closed [`MAX_CONNECTION_AGE`] after it opened,
//!   whatever it is doing (a client that stops reading its answer).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::time::Instant;
use tower::ServiceExt;

use meshca_serve::rate_limited_log::RateLimitedLog;

/// Most connections open at once on the monitoring port.
pub(crate) const MAX_CONNECTIONS: usize = 64;
/// Time for a request's header to arrive, from the connection's opening or
/// its previous answer: a header read timeout and a keep-alive idle timeout.
pub(crate) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection's largest read buffer: a request header must fit in it.
pub(crate) const MAX_BUF_SIZE: usize = 16 * 1024;
/// Longest time a connection is served, whatever it does.
pub(crate) const MAX_CONNECTION_AGE: Duration = Duration::from_secs(60);
/// At the cap, how long ago a connection's last request (or its opening)
/// must be for a newcomer to take its seat.
pub(crate) const EVICT_AFTER: Duration = Duration::from_secs(1);
/// At shutdown, how long answers in progress may take to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// The monitoring server's bounds (defaults: the constants of this module).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// See [`MAX_CONNECTIONS`].
    pub(crate) max_connections: usize,
    /// See [`HEADER_READ_TIMEOUT`].
    pub(crate) header_read_timeout: Duration,
    /// See [`MAX_BUF_SIZE`].
    pub(crate) max_buf_size: usize,
    /// See [`MAX_CONNECTION_AGE`].
    pub(crate) max_connection_age: Duration,
    /// See [`EVICT_AFTER`].
    pub(crate) evict_after: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            header_read_timeout: HEADER_READ_TIMEOUT,
            max_buf_size: MAX_BUF_SIZE,
            max_connection_age: MAX_CONNECTION_AGE,
            evict_after: EVICT_AFTER,
        }
    }
}

/// One open connection, as the accept loop sees it.
struct Seat {
    /// When its last request began, or when it opened.
    last_request: Arc<Mutex<Instant>>,
    /// Told when a newcomer takes the seat.
    evicted: Arc<Notify>,
}

/// The open connections, by a number given at accept.
#[derive(Default)]
struct Seats {
    open: Mutex<HashMap<u64, Seat>>,
}

impl Seats {
    /// A seat for connection `id`: a free one, or the seat of the connection
    /// quiet longest if that is at least `evict_after` (it is told to go);
    /// refused when every seat's connection made a request more recently.
    fn take(&self, id: u64, seat: Seat, limits: &Limits) -> Admission {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let mut admission = Admission::Seated;
        if open.len() >= limits.max_connections {
            let now = Instant::now();
            let longest_quiet = open
                .iter()
                .map(|(id, seat)| {
                    let last = *seat.last_request.lock().unwrap_or_else(|e| e.into_inner());
                    (*id, last)
                })
                .min_by_key(|(_, last)| *last)
                .filter(|(_, last)| now.duration_since(*last) >= limits.evict_after);
            let Some((quiet, _)) = longest_quiet else {
                return Admission::Refused;
            };
            if let Some(evicted) = open.remove(&quiet) {
                evicted.evicted.notify_one();
            }
            admission = Admission::Evicted;
        }
        open.insert(id, seat);
        admission
    }

    fn leave(&self, id: u64) {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }
}

/// What [`Seats::take`] did with a newcomer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admission {
    /// A free seat.
    Seated,
    /// The seat of a connection told to go.
    Evicted,
    /// No seat: close the newcomer.
    Refused,
}

/// Serves `app` on `listener` within `limits` until `stop` completes, then
/// lets answers in progress finish for up to a second.
pub(crate) async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
) {
    let seats = Arc::new(Seats::default());
    let refusals = RateLimitedLog::default();
    let evictions = RateLimitedLog::default();
    let (stopping_tx, stopping) = tokio::sync::watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    let mut next_id = 0u64;
    tokio::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut stop => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, say: wait instead of spinning.
                    tracing::warn!(error = %e, "accepting a monitoring connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        next_id += 1;
        let id = next_id;
        let last_request = Arc::new(Mutex::new(Instant::now()));
        let evicted = Arc::new(Notify::new());
        let seat = Seat {
            last_request: last_request.clone(),
            evicted: evicted.clone(),
        };
        match seats.take(id, seat, &limits) {
            Admission::Refused => {
                if let Some(unlogged) = refusals.record() {
                    tracing::info!(%peer, max_connections = limits.max_connections, unlogged, "monitoring connection closed at accept: every seat is in use");
                }
                drop(stream);
                continue;
            }
            Admission::Evicted => {
                if let Some(unlogged) = evictions.record() {
                    tracing::info!(%peer, max_connections = limits.max_connections, unlogged, "monitoring connection took the seat of the one quiet longest");
                }
            }
            Admission::Seated => {}
        }
        let app = app.clone();
        let seats = seats.clone();
        let mut stopping = stopping.clone();
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                *last_request.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
                app.clone().oneshot(request)
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .max_buf_size(limits.max_buf_size)
                .keep_alive(true);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            let age = tokio::time::sleep(limits.max_connection_age);
            tokio::pin!(age);
            tokio::select! {
                _ = connection.as_mut() => {}
                () = evicted.notified() => {}
                () = &mut age => {}
                () = async { let _ = stopping.wait_for(|stopping| *stopping).await; } => {
                    connection.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(SHUTDOWN_GRACE, connection.as_mut()).await;
                }
            }
            seats.leave(id);
        });
    }
    let _ = stopping_tx.send(true);
    let _ = tokio::time::timeout(SHUTDOWN_GRACE * 2, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_connections: usize) -> Limits {
        Limits {
            max_connections,
            ..Limits::default()
        }
    }

    fn seat() -> (Seat, Arc<Notify>) {
        let evicted = Arc::new(Notify::new());
        (
            Seat {
                last_request: Arc::new(Mutex::new(Instant::now())),
                evicted: evicted.clone(),
            },
            evicted,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_a_newcomer_takes_the_seat_quiet_longest_or_is_refused() {
        let seats = Seats::default();
        let (first, first_evicted) = seat();
        assert_eq!(seats.take(1, first, &limits(2)), Admission::Seated);
        tokio::time::advance(Duration::from_millis(500)).await;
        let (second, _) = seat();
        assert_eq!(seats.take(2, second, &limits(2)), Admission::Seated);
        // Both made their request less than EVICT_AFTER ago: refused.
        tokio::time::advance(Duration::from_millis(400)).await;
        assert_eq!(seats.take(3, seat().0, &limits(2)), Admission::Refused);
        // The first has been quiet for 1.1 s: its seat goes to the newcomer.
        tokio::time::advance(Duration::from_millis(200)).await;
        assert_eq!(seats.take(4, seat().0, &limits(2)), Admission::Evicted);
        tokio::time::timeout(Duration::ZERO, first_evicted.notified())
            .await
            .expect("the first is told to go");
        let open: Vec<u64> = {
            let mut ids: Vec<u64> = seats.open.lock().unwrap().keys().copied().collect();
            ids.sort_unstable();
            ids
        };
        assert_eq!(open, vec![2, 4]);
        seats.leave(2);
        assert_eq!(seats.take(5, seat().0, &limits(2)), Admission::Seated);
    }
}
