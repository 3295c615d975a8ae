//! How requests reach the CA and answers leave it: the gRPC port's accept
//! loop, TLS, HTTP/2 and the event loops that run the connections.
//!
//! - [`listener`]: the accept loop. Each TCP connection is placed on the
//!   event loop with the fewest open connections; its TLS handshake and its
//!   whole life run there.
//! - [`tls_policy`]: the rustls configuration (versions, ALPN, the order of
//!   cipher suites, client certificates asked for but checked by
//!   authentication).
//! - [`event_loops`]: one single-threaded runtime per thread, and the
//!   hand-off of a request from a backed-up loop to an idle one.
//! - [`batched_io`]: one `write` per burst of answers on a connection.
//! - [`log_lines`]: log lines gathered per turn of work on an event loop.
//! - [`serve_grpc`]: one tonic server per event loop, with the HTTP/2
//!   settings (README, "Flags").
//!
//! The server's own certificate is not here: `server_identity` issues and
//! renews it, and the listener only asks its resolver.
//!
//! # An audit line is written before its answer
//!
//! Every certificate issued writes an audit line (`meshca::audit`). On an
//! event loop, log lines are gathered in a buffer of the thread instead of
//! costing a `write` each; the guarantee that a client holding a
//! certificate finds its line in the log rests on four places, all in this
//! module:
//!
//! 1. [`batched_io`] writes the thread's gathered lines before it writes
//!    any answer bytes to a client connection;
//! 2. a request run for another loop ([`event_loops`]' hand-off) writes its
//!    lines on the loop that ran it before its answer goes back to the loop
//!    that owns the connection;
//! 3. a loop writes its lines when it runs out of work and parks, and when
//!    it stops;
//! 4. [`log_lines`] writes when the buffer would pass a pipe's atomic write
//!    size.
//!
//! Off the event loops (the monitoring thread, start-up) lines go out one
//! `write` each. A process killed outright can lose lines not yet written,
//! never the line of a certificate that has left the CA.

pub(crate) mod batched_io;
pub(crate) mod event_loops;
pub(crate) mod listener;
pub(crate) mod log_lines;
pub(crate) mod tls_policy;

use std::convert::Infallible;
use std::time::Duration;

use http::Request;
use tonic::body::Body;
use tonic::server::NamedService;
use tower::Service;

pub(crate) use event_loops::{EventLoops, SpareLoops};
pub(crate) use listener::{bind_with_backlog, tls_incoming, TlsConnection, LISTEN_BACKLOG};
pub use log_lines::{stderr as log_writer, LogLineWriter};
pub(crate) use tls_policy::server_config;

/// Largest gRPC request message accepted (a CSR is at most 32 KiB of PEM).
pub(crate) const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// The HTTP/2 settings of every gRPC server (README, "Flags").
#[derive(Debug, Clone, Copy)]
pub(crate) struct Http2Settings {
    /// Streams one connection may have open at once.
    pub(crate) max_concurrent_streams: u32,
    /// Per-request deadline.
    pub(crate) request_timeout: Duration,
    /// GOAWAY after a connection has been open this long.
    pub(crate) max_connection_age: Option<Duration>,
}

/// Rewrites tonic's `OUT_OF_RANGE` for an oversized request message into
/// `INVALID_ARGUMENT` (README, "Errors"); the service itself never answers
/// `OUT_OF_RANGE`.
fn oversized_is_invalid_argument<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    if headers.get("grpc-status").is_some_and(|v| v == "11") {
        headers.insert("grpc-status", http::HeaderValue::from_static("3"));
    }
    response
}

/// Serves `grpc` and `health` on every event loop of `loops`, each loop
/// serving the connections the accept loop placed on it, until `drain`
/// turns true; then each server stops accepting and finishes the requests
/// in flight. The future completes when every server has stopped.
pub(crate) fn serve_grpc<S, H>(
    loops: &EventLoops,
    incoming: Vec<
        tokio_stream::wrappers::ReceiverStream<Result<listener::TlsConnection, std::io::Error>>,
    >,
    settings: Http2Settings,
    grpc: S,
    health: H,
    drain: tokio::sync::watch::Receiver<bool>,
) -> impl std::future::Future<
    Output = Result<Vec<Result<(), tonic::transport::Error>>, tokio::task::JoinError>,
>
where
    S: Service<Request<Body>, Error = Infallible> + NamedService + Clone + Send + Sync + 'static,
    S::Response: axum::response::IntoResponse,
    S::Future: Send + 'static,
    H: Service<Request<Body>, Error = Infallible> + NamedService + Clone + Send + Sync + 'static,
    H::Response: axum::response::IntoResponse,
    H::Future: Send + 'static,
{
    let servers = incoming
        .into_iter()
        .zip(loops.handles())
        .map(|(incoming, handle)| {
            let mut drain = drain.clone();
            let builder = tonic::transport::Server::builder()
                .max_concurrent_streams(Some(settings.max_concurrent_streams))
                .timeout(settings.request_timeout);
            // No `max_connection_age_grace`: tonic 0.14 then closes at
            // age + grace without a GOAWAY first. Without it the connection
            // gets a GOAWAY at its age and closes once its requests in flight
            // are answered, which `--request-timeout` bounds.
            let builder = match settings.max_connection_age {
                Some(age) => builder.max_connection_age(age),
                None => builder,
            };
            let server = builder
                // Large flow-control windows: no WINDOW_UPDATE round trip every
                // few dozen small requests.
                .initial_connection_window_size(Some(4 << 20))
                .initial_stream_window_size(Some(1 << 20))
                .http2_keepalive_interval(Some(Duration::from_secs(30)))
                .http2_keepalive_timeout(Some(Duration::from_secs(10)))
                .layer(tower::util::MapResponseLayer::new(
                    oversized_is_invalid_argument,
                ))
                .add_service(health.clone())
                .add_service(grpc.clone())
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = drain.wait_for(|d| *d).await;
                });
            handle.spawn(server)
        });
    futures::future::try_join_all(servers)
}
