//! Serving the socket's connections: one HTTP/2 connection per accepted
//! caller, each in a task of its own whose life the agent controls.
//!
//! - A connection that has not sent a request [`FIRST_REQUEST_TIMEOUT`]
//!   after it was accepted (no HTTP/2 preface, or no HEADERS) is closed:
//!   it holds a connection slot and a file descriptor.
//! - A connection with no open stream for [`CONNECTION_IDLE_TIMEOUT`] is
//!   told to go away (GOAWAY) and closed [`CLOSE_GRACE`] later if it stays
//!   without a stream.
//! - When the agent stops, open streams end (`UNAVAILABLE`, see
//!   `Callers::close`), every connection is told to go away, and one still
//!   open [`CLOSE_GRACE`] later is cut off: stopping takes at most that long
//!   whatever the clients do.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use meshca_certs::stream_activity::StreamActivity;
use tokio::sync::watch;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::service::Routes;
use tower::ServiceExt;

use super::callers::Callers;
use super::socket::CallerConnection;
use super::MAX_STREAMS_PER_CONNECTION;

/// How long a new connection may take to send its first request (the
/// HTTP/2 preface, SETTINGS and a request's HEADERS) before it is closed.
pub const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may stay without an open stream before it is
/// told to go away. Workload API and SDS clients keep a stream open, so
/// only a client that has finished (or never started) is idle this long.
pub const CONNECTION_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a connection told to go away (idle, or the agent stopping)
/// may stay before it is cut off.
pub const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Streams one connection may have reset on the agent's own account
/// (malformed requests) before it gets a GOAWAY; hyper's default, set so
/// that it does not change unnoticed.
const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;

/// The timers of one connection (tests shorten them).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnectionTimers {
    /// See [`FIRST_REQUEST_TIMEOUT`].
    pub(crate) first_request: Duration,
    /// See [`CONNECTION_IDLE_TIMEOUT`].
    pub(crate) idle: Duration,
    /// See [`CLOSE_GRACE`].
    pub(crate) close_grace: Duration,
}

impl Default for ConnectionTimers {
    fn default() -> Self {
        Self {
            first_request: FIRST_REQUEST_TIMEOUT,
            idle: CONNECTION_IDLE_TIMEOUT,
            close_grace: CLOSE_GRACE,
        }
    }
}

/// Why a connection was asked to go away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GoAway {
    Idle,
    Stopping,
}

/// Serves `routes` on one caller's connection until it closes, it is
/// closed for sending no request, it is idle, or `stopping` turns true
/// (see the module's documentation).
pub(crate) async fn serve_connection(
    connection: CallerConnection,
    routes: Routes,
    callers: Arc<Callers>,
    timers: ConnectionTimers,
    mut stopping: watch::Receiver<bool>,
) {
    let info = connection.info().clone();
    let pid = info.pid;
    let activity = Arc::new(StreamActivity::default());
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |mut request: Request<Incoming>| {
            // The stream's place, before its message is read: a request
            // beyond the limits is answered at its HEADERS.
            let slot = callers.admit_stream(&info);
            request.extensions_mut().insert(info.clone());
            if let Ok(slot) = &slot {
                request.extensions_mut().insert(slot.pod_place());
            }
            let stream = activity.open();
            let routes = routes.clone();
            async move {
                let slot = match slot {
                    Ok(slot) => slot,
                    Err(status) => return Ok(status.into_http()),
                };
                let response = routes.oneshot(request).await?;
                // The stream counts as open, and holds its place, for as
                // long as its body lives.
                Ok::<Response<Body>, Infallible>(response.map(move |body| {
                    Body::new(body.map_frame(move |frame| {
                        let _open = (&stream, &slot);
                        frame
                    }))
                }))
            }
        })
    };
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
        .keep_alive_interval(Some(Duration::from_secs(60)))
        .keep_alive_timeout(Duration::from_secs(20));
    // Python's grpcio sends the socket path as :authority, which h2 refuses
    // (see authority_fix).
    let connection = super::authority_fix::AuthorityFix::new(connection);
    let serving = builder.serve_connection(TokioIo::new(connection), service);
    tokio::pin!(serving);
    let go_away = tokio::select! {
        served = serving.as_mut() => {
            if let Err(e) = served {
                tracing::debug!(error = %e, pid = ?pid, "workload connection ended");
            }
            return;
        }
        () = activity.no_request_within(timers.first_request) => {
            tracing::info!(
                pid = ?pid,
                timeout = ?timers.first_request,
                "closed a workload connection that sent no request in time"
            );
            return;
        }
        () = activity.idle_for(timers.idle) => GoAway::Idle,
        _ = stopping.wait_for(|stop| *stop) => GoAway::Stopping,
    };
    tracing::debug!(pid = ?pid, reason = ?go_away, "workload connection told to go away");
    serving.as_mut().graceful_shutdown();
    let cut_off = async {
        match go_away {
            // Streams opened before the GOAWAY are served; the connection
            // is cut off only once it has had none for the grace.
            GoAway::Idle => activity.idle_for(timers.close_grace).await,
            GoAway::Stopping => tokio::time::sleep(timers.close_grace).await,
        }
    };
    tokio::select! {
        served = serving.as_mut() => {
            if let Err(e) = served {
                tracing::debug!(error = %e, pid = ?pid, "workload connection ended");
            }
        }
        () = cut_off => {
            tracing::debug!(pid = ?pid, grace = ?timers.close_grace, "workload connection cut off after its GOAWAY");
        }
    }
}
