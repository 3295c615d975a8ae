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
use meshca_serve::stream_activity::StreamActivity;
use tokio::sync::watch;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::service::Routes;
use tower::ServiceExt;

use super::callers::Callers;
use super::per_pod::{OverBudget, StreamCharge};
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

/// HTTP/2 flow-control windows the agent gives each stream and each
/// connection: what a client can make it hold of request bodies it has not
/// read yet. HTTP/2's default (hyper's would be 1 MiB each); the largest
/// request message (256 KiB, SDS) still arrives in a few round trips.
const RECEIVE_WINDOW: u32 = 65_535;
/// What one stream may have queued for the client before its answer waits
/// (hyper's default is 400 KiB): an SVID and its bundle are a few KiB.
const MAX_SEND_BUFFER: usize = 64 * 1024;

/// What a caller that went over its buffer budget is told about it.
pub(crate) type OverBudgetReport = Arc<dyn Fn(&OverBudget) + Send + Sync>;

/// A request body that charges the bytes of its message being received
/// (node mode: to the caller's pod's buffer budget): what has arrived of
/// the gRPC message not yet complete, or the largest complete one, which
/// the gRPC decoder's buffer keeps room for while the stream lives. Past
/// the budget the body ends in `RESOURCE_EXHAUSTED`.
pub(crate) struct ChargedBody<B> {
    inner: B,
    charge: Option<StreamCharge>,
    report: OverBudgetReport,
    /// The current message's 5-byte gRPC prefix, as far as it came.
    prefix: [u8; 5],
    prefix_len: usize,
    /// Bytes of the current message still to come once its prefix is in.
    body_left: usize,
    /// Bytes of the current message so far, prefix included.
    partial: usize,
    /// The largest complete message so far, prefix included.
    largest: usize,
}

impl<B> ChargedBody<B> {
    pub(crate) fn new(inner: B, charge: Option<StreamCharge>, report: OverBudgetReport) -> Self {
        Self {
            inner,
            charge,
            report,
            prefix: [0; 5],
            prefix_len: 0,
            body_left: 0,
            partial: 0,
            largest: 0,
        }
    }

    /// Follows the gRPC messages through `data`.
    fn account(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.prefix_len < 5 {
                let n = (5 - self.prefix_len).min(data.len());
                self.prefix[self.prefix_len..self.prefix_len + n].copy_from_slice(&data[..n]);
                self.prefix_len += n;
                self.partial += n;
                data = &data[n..];
                if self.prefix_len == 5 {
                    let [_, a, b, c, d] = self.prefix;
                    self.body_left = u32::from_be_bytes([a, b, c, d]) as usize;
                }
            } else {
                let n = self.body_left.min(data.len());
                self.body_left -= n;
                self.partial += n;
                data = &data[n..];
            }
            if self.prefix_len == 5 && self.body_left == 0 {
                self.largest = self.largest.max(self.partial);
                self.partial = 0;
                self.prefix_len = 0;
            }
        }
    }

    /// What the body holds now, by [`ChargedBody`]'s reckoning.
    pub(crate) fn held(&self) -> usize {
        self.partial.max(self.largest)
    }
}

impl<B> hyper::body::Body for ChargedBody<B>
where
    B: hyper::body::Body<Data = hyper::body::Bytes> + Unpin,
    B::Error: Into<tonic::codegen::StdError>,
{
    type Data = hyper::body::Bytes;
    type Error = tonic::codegen::StdError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let frame = match std::task::ready!(std::pin::Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            Some(Err(e)) => return std::task::Poll::Ready(Some(Err(e.into()))),
            None => return std::task::Poll::Ready(None),
        };
        if let Some(data) = frame.data_ref() {
            let data = data.clone();
            this.account(&data);
            let held = this.held();
            if let Some(charge) = &this.charge {
                if let Err(over) = charge.set(held) {
                    (this.report)(&over);
                    return std::task::Poll::Ready(Some(Err(Box::new(over.status()))));
                }
            }
        }
        std::task::Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

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
    let report: OverBudgetReport = {
        let (callers, info) = (callers.clone(), info.clone());
        Arc::new(move |over: &OverBudget| callers.refused_for_buffers(&info, over))
    };
    let connection_charge = callers.buffer_charge(&info);
    let service = {
        let activity = activity.clone();
        let callers = callers.clone();
        let info = info.clone();
        let report = report.clone();
        hyper::service::service_fn(move |request: Request<Incoming>| {
            let charge = callers.buffer_charge(&info).map(StreamCharge::new);
            let mut request = request
                .map(|body| Body::new(ChargedBody::new(body, charge.clone(), report.clone())));
            if let Some(charge) = charge {
                request.extensions_mut().insert(charge);
            }
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
        .initial_stream_window_size(RECEIVE_WINDOW)
        .initial_connection_window_size(RECEIVE_WINDOW)
        .max_send_buf_size(MAX_SEND_BUFFER)
        .keep_alive_interval(Some(Duration::from_secs(60)))
        .keep_alive_timeout(Duration::from_secs(20));
    // Python's grpcio sends the socket path as :authority, which h2 refuses
    // (see authority_fix).
    let mut connection = super::authority_fix::AuthorityFix::new(connection);
    if let Some(charge) = connection_charge {
        let report = report.clone();
        connection = connection.with_budget(charge, Box::new(move |over| report(over)));
    }
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
            callers.closed_for_no_request(&info, timers.first_request);
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

#[cfg(test)]
mod tests {
    use super::super::per_pod::{PerPodBytes, PodKey};
    use super::*;
    use hyper::body::Bytes;

    /// A body of `chunks`, as DATA frames.
    fn body_of(
        chunks: Vec<Vec<u8>>,
    ) -> http_body_util::StreamBody<
        impl futures::Stream<Item = Result<hyper::body::Frame<Bytes>, std::convert::Infallible>> + Unpin,
    > {
        http_body_util::StreamBody::new(futures::stream::iter(
            chunks
                .into_iter()
                .map(|c| Ok(hyper::body::Frame::data(Bytes::from(c)))),
        ))
    }

    fn message(len: usize) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(len as u32).to_be_bytes());
        out.resize(5 + len, 7);
        out
    }

    #[tokio::test]
    async fn a_message_split_over_many_frames_is_charged_and_refused_past_the_budget() {
        let budget = PerPodBytes::new(10_000);
        let key = PodKey::Pod("p".into());
        let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let report: OverBudgetReport = {
            let refused = refused.clone();
            Arc::new(move |_| {
                refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
        };
        // Two messages of 3,000 bytes, one byte per frame: charged as they
        // come, the largest kept.
        let bytes: Vec<u8> = [message(3000), message(3000)].concat();
        let mut body = ChargedBody::new(
            body_of(bytes.iter().map(|b| vec![*b]).collect()),
            Some(StreamCharge::new(budget.charge(key.clone()))),
            report.clone(),
        );
        let mut seen = 0;
        while let Some(frame) = body.frame().await {
            seen += frame.unwrap().into_data().unwrap().len();
            assert!(budget.held_by(&key) <= 3005);
        }
        assert_eq!(seen, bytes.len());
        assert_eq!(body.held(), 3005, "the decoder keeps room for the largest");
        // Another stream of the pod that goes past the budget is ended.
        let big = message(20_000);
        let mut other = ChargedBody::new(
            body_of(big.chunks(1000).map(<[u8]>::to_vec).collect()),
            Some(StreamCharge::new(budget.charge(key.clone()))),
            report,
        );
        let error = loop {
            match other.frame().await {
                Some(Ok(_)) => {}
                Some(Err(e)) => break e,
                None => panic!("the whole message was let through"),
            }
        };
        let status = error.downcast_ref::<tonic::Status>().expect("a status");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert_eq!(refused.load(std::sync::atomic::Ordering::Relaxed), 1);
        drop((body, other));
        assert_eq!(
            budget.held_by(&key),
            0,
            "ended streams give their bytes back"
        );
    }
}
