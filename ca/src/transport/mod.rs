//! How requests reach the CA and answers leave it: the gRPC port's accept
//! loop, TLS and HTTP/2, on the process's multi-threaded tokio runtime.
//!
//! - [`listener`]: the accept loop, the connection cap (at it, an idle
//!   connection makes room for a new one), the cap per source address (at
//!   it, one of that source's connections without an authenticated request
//!   makes room, or the new one is closed), the TLS handshake (a task per
//!   connection, bounded in time).
//! - [`tls_policy`]: the rustls configuration (versions, ALPN, the order of
//!   cipher suites, client certificates asked for but checked by
//!   authentication).
//! - [`coalesced_writes`]: what h2 writes during one turn of a
//!   connection's task leaves in one TLS write at the start of the next.
//! - [`connection`]: one connection's life: a tonic server of its own,
//!   with the HTTP/2 limits, a GOAWAY when it has been idle too long, and
//!   the limit on requests open across all connections.
//! - [`serve_grpc`]: every established connection, served with the HTTP/2
//!   settings and limits (docs/flags.md, "`meshca serve` flags").
//!
//! The server's own certificate is not here: `server_identity` issues and
//! renews it, and the listener only asks its resolver.
//!
//! An audit line (`meshca::audit`) is written by the handler before it
//! returns the answer, so a client holding a certificate finds its line in
//! the log. (docs/benchmarks-history.md, "Event loops against tonic's own serving", has
//! why there are no event loops or gathered log lines; "Answers written
//! together" why answers leave through [`coalesced_writes`].)

mod coalesced_writes;
mod connection;
mod listener;
mod tls_policy;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use http::Request;
use tokio_stream::wrappers::ReceiverStream;
use tonic::body::Body;
use tonic::server::NamedService;
use tower::Service;

use crate::metrics::IstioCounter;
use coalesced_writes::CoalescedWrites;
use connection::CountStreamsLayer;
pub(crate) use connection::{OpenRequests, RequestConnection};
pub(crate) use listener::{
    bind_with_backlog, tls_incoming, AcceptLimits, Accepted, LISTEN_BACKLOG,
};
pub(crate) use tls_policy::server_config;

/// Largest gRPC request message accepted. The largest request a workload
/// sends, a CSR for an RSA-4096 key whose URI SAN is a SPIFFE ID of the
/// longest allowed (2,048 bytes) plus the same ID as the impersonated
/// identity, is under 7 KiB. An authenticated request holds at most this
/// in tonic's decoder and [`STREAM_WINDOW`] more in h2 (the memory formula
/// in docs/flags.md, "Memory", counts both).
pub(crate) const MAX_REQUEST_BYTES: usize = 8 * 1024;

/// HTTP/2 flow-control window of each request (stream): one largest
/// message with its 5-byte gRPC prefix, so no request waits for a
/// WINDOW_UPDATE and none can make the server buffer more.
pub(crate) const STREAM_WINDOW: u32 = MAX_REQUEST_BYTES as u32 + 5;

/// HTTP/2 flow-control window of each connection: a connection's
/// `--max-concurrent-streams` (128 by default) of small requests in flight
/// without a WINDOW_UPDATE round trip.
pub(crate) const CONNECTION_WINDOW: u32 = 1 << 20;

/// Streams one connection may have reset on the server's own account
/// (malformed requests and the like) before it gets a GOAWAY with
/// ENHANCE_YOUR_CALM. hyper's default; tonic would otherwise leave it
/// unlimited, so a client sending malformed requests and never reading
/// could keep the server busy resetting them for ever.
const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;

/// Streams reset by the client before the server took them up that may
/// wait on one connection before it gets a GOAWAY (the "rapid reset"
/// attack). h2's default, set here so it does not change unnoticed.
const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;

/// How long a connection told to go away (GOAWAY) may stay without an
/// open stream before it is cut off: a client that honours the GOAWAY has
/// closed by then.
const GOAWAY_GRACE: Duration = Duration::from_secs(1);

/// The HTTP/2 settings of every gRPC connection (docs/flags.md, "`meshca serve`
/// flags").
#[derive(Debug, Clone, Copy)]
pub(crate) struct Http2Settings {
    /// Streams one connection may have open at once.
    pub(crate) max_concurrent_streams: u32,
    /// Per-request deadline.
    pub(crate) request_timeout: Duration,
    /// GOAWAY after a connection has been open this long.
    pub(crate) max_connection_age: Option<Duration>,
    /// GOAWAY after a connection has had no open stream this long.
    pub(crate) max_connection_idle: Option<Duration>,
}

/// What every connection shares.
#[derive(Debug, Clone)]
pub(crate) struct SharedByConnections {
    /// Counts the GOAWAYs sent for `--max-connection-idle`.
    pub(crate) idle_closes: IstioCounter,
    /// Counts the GOAWAYs sent to make room at `--max-connections`.
    pub(crate) evictions: IstioCounter,
    /// The requests open across all connections (`--max-open-requests`).
    pub(crate) open_requests: Arc<OpenRequests>,
    /// The health requests open across all connections
    /// ([`crate::config::MAX_HEALTH_REQUESTS`]).
    pub(crate) health_requests: Arc<OpenRequests>,
}

/// Rewrites tonic's `OUT_OF_RANGE` for an oversized request message into
/// `INVALID_ARGUMENT` (the status codes in docs/authentication.md, "Authentication
/// limits"); the service itself never answers `OUT_OF_RANGE`.
fn oversized_is_invalid_argument<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    if headers.get("grpc-status").is_some_and(|v| v == "11") {
        headers.insert("grpc-status", http::HeaderValue::from_static("3"));
    }
    response
}

/// A gRPC service tonic can route to.
pub(crate) trait GrpcService:
    Service<
        Request<Body>,
        Error = Infallible,
        Response: axum::response::IntoResponse,
        Future: Send + 'static,
    > + NamedService
    + Clone
    + Send
    + Sync
    + 'static
{
}

impl<S> GrpcService for S where
    S: Service<
            Request<Body>,
            Error = Infallible,
            Response: axum::response::IntoResponse,
            Future: Send + 'static,
        > + NamedService
        + Clone
        + Send
        + Sync
        + 'static
{
}

/// Serves `grpc`, `jwt` (meshca's JWT-SVID service) and `health` on every connection of `incoming` until
/// `drain` turns true; then no connection is taken up any more and each is
/// asked to go away once its requests in flight are answered. Completes
/// when every connection has closed.
pub(crate) async fn serve_grpc<S: GrpcService, J: GrpcService, H: GrpcService>(
    mut incoming: ReceiverStream<Accepted>,
    settings: Http2Settings,
    grpc: S,
    jwt: J,
    health: H,
    mut drain: tokio::sync::watch::Receiver<bool>,
    shared: SharedByConnections,
) {
    let mut connections = tokio::task::JoinSet::new();
    let for_connections = drain.clone();
    loop {
        tokio::select! {
            accepted = incoming.next() => match accepted {
                Some(accepted) => {
                    connections.spawn(serve_connection(
                        accepted,
                        settings,
                        grpc.clone(),
                        jwt.clone(),
                        health.clone(),
                        for_connections.clone(),
                        shared.clone(),
                    ));
                }
                None => break,
            },
            // Reaps the connections that have closed.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            _ = drain.wait_for(|d| *d) => break,
        }
    }
    drop(incoming);
    while connections.join_next().await.is_some() {}
}

/// Serves one connection with a tonic server of its own, until the
/// connection closes; asks it to go away (GOAWAY, then it closes once its
/// requests in flight are answered) after `settings.max_connection_idle`
/// without an open stream, at `settings.max_connection_age`, when the
/// accept loop evicts it to make room, and when `drain` turns true.
async fn serve_connection<S: GrpcService, J: GrpcService, H: GrpcService>(
    accepted: Accepted,
    settings: Http2Settings,
    grpc: S,
    jwt: J,
    health: H,
    mut drain: tokio::sync::watch::Receiver<bool>,
    shared: SharedByConnections,
) {
    let SharedByConnections {
        idle_closes,
        evictions,
        open_requests,
        health_requests,
    } = shared;
    let Accepted {
        stream,
        state,
        closed,
    } = accepted;
    let activity = state.activity.clone();
    let builder = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(settings.max_concurrent_streams))
        .timeout(settings.request_timeout)
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESET_STREAMS));
    // No `max_connection_age_grace`: tonic 0.14 then closes at
    // age + grace without a GOAWAY first. Without it the connection
    // gets a GOAWAY at its age and closes once its requests in flight
    // are answered, which `--request-timeout` bounds.
    let builder = match settings.max_connection_age {
        Some(age) => builder.max_connection_age(age),
        None => builder,
    };
    let server = builder
        .initial_connection_window_size(Some(CONNECTION_WINDOW))
        .initial_stream_window_size(Some(STREAM_WINDOW))
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .layer(tower::util::MapResponseLayer::new(
            oversized_is_invalid_argument,
        ))
        .layer(
            CountStreamsLayer::new(activity.clone(), open_requests, health_requests)
                .with_connection(state.clone()),
        )
        .add_service(health)
        .add_service(grpc)
        .add_service(jwt);
    let idle = async {
        match settings.max_connection_idle {
            Some(limit) => {
                activity.idle_for(limit).await;
                idle_closes.inc();
                tracing::debug!(idle = ?limit, "connection idle: GOAWAY");
            }
            None => std::future::pending().await,
        }
    };
    // tonic's server ends its connections when this completes, and then
    // returns once they have closed.
    let (asked_tx, asked) = tokio::sync::oneshot::channel::<()>();
    let kill = state.kill.clone();
    let go_away = async move {
        tokio::select! {
            () = idle => {}
            () = state.evict.notified() => {
                evictions.inc();
                tracing::debug!("connection evicted for a new one: GOAWAY");
            }
            _ = drain.wait_for(|d| *d) => {}
            _ = closed => {}
        }
        let _ = asked_tx.send(());
    };
    let stream = CoalescedWrites::new(stream);
    // One connection, and then none: the server takes no other.
    let incoming = futures::stream::once(async move { Ok::<_, std::io::Error>(stream) })
        .chain(futures::stream::pending());
    let serving = server.serve_with_incoming_shutdown(incoming, go_away);
    tokio::pin!(serving);
    let served = tokio::select! {
        served = &mut serving => served,
        Ok(()) = asked => {
            // Told to go away: requests in flight are answered (the request
            // timeout bounds them); a client that has no stream open for
            // GOAWAY_GRACE and is still there ignores the GOAWAY (or never
            // started HTTP/2) and is cut off.
            tokio::select! {
                served = &mut serving => served,
                () = activity.idle_for(GOAWAY_GRACE) => {
                    kill.kill();
                    serving.await
                }
                () = tokio::time::sleep(settings.request_timeout + GOAWAY_GRACE) => {
                    kill.kill();
                    serving.await
                }
            }
        }
    };
    if let Err(e) = served {
        tracing::debug!(error = %e, "serving a connection failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_formula_counts_a_largest_request_twice() {
        // h2 may hold a stream window unread while tonic decodes a largest
        // message: both are in the worst cost of an open request, on top
        // of the 8 KiB measured for the stream, its task and its place.
        let buffered = MAX_REQUEST_BYTES as u64 + u64::from(STREAM_WINDOW);
        assert!(
            crate::config::MEMORY_PER_OPEN_REQUEST >= (8 << 10) + buffered,
            "MEMORY_PER_OPEN_REQUEST no longer covers {buffered} bytes of buffers"
        );
        // No request waits for a WINDOW_UPDATE, and no stream's window
        // holds more than one largest message.
        assert_eq!(STREAM_WINDOW as usize, MAX_REQUEST_BYTES + 5);
        let streams = crate::config::DEFAULT_MAX_STREAMS_PER_CONNECTION;
        assert!(
            CONNECTION_WINDOW >= streams * 4096,
            "128 small requests in flight"
        );
    }
}
