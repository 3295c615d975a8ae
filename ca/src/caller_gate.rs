//! The caller gate: who is calling is decided from a request's HEADERS
//! (the `clusterid` and `authorization` headers, the connection's client
//! certificate), before its message is read.
//!
//! A request without valid credentials is answered at once and its
//! message, whatever of it has arrived, is dropped unread: it costs no
//! decoding, holds no place among the open requests
//! (`--max-open-requests`) for longer than its authentication takes, and
//! takes no signing slot. A caller that authenticated has
//! [`MESSAGE_TIMEOUT`] for its message to arrive; a stream that sends
//! HEADERS and then nothing cannot hold its place for the whole
//! `--request-timeout`. SECURITY.md lists what each refusal costs.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use http_body::{Body as HttpBody, Frame};
use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::Status;
use tower::Service;

use crate::service::CaService;

/// How long an authenticated caller's request message may take to arrive
/// once its HEADERS have been taken up. A client sends the message right
/// after its HEADERS; one that has not finished it by then is answered
/// `DEADLINE_EXCEEDED` and its place among the open requests is freed.
pub(crate) const MESSAGE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the rest of a refused request's message is read (and thrown
/// away) after its answer has been sent. A client that sends its message
/// right after its HEADERS then reads the answer on a stream that closes
/// cleanly; were the message dropped at once, HTTP/2 would reset the
/// stream, and the client might see `CANCELLED` or `UNKNOWN` instead of the
/// status it was sent.
pub(crate) const REFUSED_MESSAGE_WAIT: Duration = Duration::from_secs(1);

/// Refused requests whose messages are read at once, at most; beyond it a
/// refused request's message is dropped at once (a flood of HEADERS
/// without messages holds no more than this many streams, each for at
/// most [`REFUSED_MESSAGE_WAIT`]).
pub(crate) const MAX_REFUSED_MESSAGES_READ: usize = 1024;

/// Wraps the CA's gRPC service (`inner`) so that every request passes
/// [`CaService::who_is_calling`] first; the caller then travels in the
/// request's extensions to the handler.
#[derive(Debug, Clone)]
pub(crate) struct CallerGate<S> {
    inner: S,
    /// Shared: cloned per request, so an `Arc`, not the service's fields.
    service: Arc<CaService>,
    refused_reads: Arc<Semaphore>,
}

impl<S> CallerGate<S> {
    /// Gates `inner` with `service`'s authentication.
    pub(crate) fn new(inner: S, service: CaService) -> Self {
        Self {
            inner,
            service: Arc::new(service),
            refused_reads: Arc::new(Semaphore::new(MAX_REFUSED_MESSAGES_READ)),
        }
    }
}

/// Reads what remains of a refused request's message, for at most
/// [`REFUSED_MESSAGE_WAIT`], in a task of its own, if fewer than
/// [`MAX_REFUSED_MESSAGES_READ`] are being read; else drops it now.
fn read_and_drop(body: Body, reads: &Arc<Semaphore>) {
    let Ok(permit) = reads.clone().try_acquire_owned() else {
        return;
    };
    tokio::spawn(async move {
        let mut body = body;
        let read = async { while let Some(Ok(_)) = body.frame().await {} };
        let _ = tokio::time::timeout(REFUSED_MESSAGE_WAIT, read).await;
        drop(permit);
    });
}

impl<S: NamedService> NamedService for CallerGate<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<Request<Body>> for CallerGate<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<Body>) -> Self::Future {
        // The clone is ready as the original was (tonic's generated
        // services always are); the original stays for the next request.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        let service = self.service.clone();
        let refused_reads = self.refused_reads.clone();
        Box::pin(async move {
            let peer_chain = request
                .extensions()
                .get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|info| info.peer_certs());
            match service.who_is_calling(request.headers(), peer_chain).await {
                Ok(caller) => {
                    // Its connection now counts as a real client's.
                    if let Some(connection) = request
                        .extensions()
                        .get::<crate::transport::RequestConnection>()
                    {
                        connection.set_authenticated();
                    }
                    request.extensions_mut().insert(caller);
                    let request =
                        request.map(|body| Body::new(MessageDeadline::new(body, MESSAGE_TIMEOUT)));
                    inner.call(request).await
                }
                // Answered at once: the message is never decoded.
                Err(status) => {
                    service.count_request_refused_at_headers();
                    read_and_drop(request.into_body(), &refused_reads);
                    Ok(status.into_http())
                }
            }
        })
    }
}

/// A request body that fails with `DEADLINE_EXCEEDED` when it has not
/// ended within its time.
struct MessageDeadline {
    inner: Body,
    started: tokio::time::Instant,
    timeout: Duration,
    /// Set the first time the message is not all there (most requests'
    /// messages are, and cost no timer).
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl MessageDeadline {
    fn new(inner: Body, timeout: Duration) -> Self {
        Self {
            inner,
            started: tokio::time::Instant::now(),
            timeout,
            deadline: None,
        }
    }
}

impl HttpBody for MessageDeadline {
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        let at = self.started + self.timeout;
        let deadline = self
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Status::deadline_exceeded(format!(
                "the request message did not arrive within {:?} of its headers",
                self.timeout
            ))))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type FrameSender = tokio::sync::mpsc::Sender<Result<Frame<bytes::Bytes>, Status>>;

    /// A request body fed through the returned sender.
    fn channel_body() -> (FrameSender, Body) {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        (
            tx,
            Body::new(http_body_util::StreamBody::new(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            )),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_message_is_read_for_a_while_then_dropped() {
        let reads = Arc::new(Semaphore::new(1));
        let (sender, body) = channel_body();
        read_and_drop(body, &reads);
        // Another while the first is read, beyond the bound: dropped now.
        let (other, body) = channel_body();
        read_and_drop(body, &reads);
        assert!(other.is_closed());
        // The first is still read: the client can send the rest...
        sender
            .send(Ok(Frame::data(bytes::Bytes::from_static(b"rest"))))
            .await
            .unwrap();
        tokio::task::yield_now().await;
        assert!(!sender.is_closed());
        // ...until the wait is over.
        tokio::time::sleep(REFUSED_MESSAGE_WAIT + Duration::from_millis(1)).await;
        assert!(sender.is_closed());
        assert_eq!(reads.available_permits(), 1, "its place is given back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_that_does_not_arrive_in_time_fails_the_body() {
        let (sender, body) = channel_body();
        let mut body = MessageDeadline::new(body, MESSAGE_TIMEOUT);
        // Part of the message in time: passed on.
        sender
            .send(Ok(Frame::data(bytes::Bytes::from_static(b"part"))))
            .await
            .unwrap();
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), &b"part"[..]);
        // The rest never comes: the body fails at the deadline, not before.
        let started = tokio::time::Instant::now();
        let error = body.frame().await.unwrap().unwrap_err();
        assert_eq!(started.elapsed(), MESSAGE_TIMEOUT);
        assert_eq!(error.code(), tonic::Code::DeadlineExceeded);
        assert!(error.message().contains("did not arrive"), "{error:?}");
        drop(sender);
    }

    #[tokio::test(start_paused = true)]
    async fn a_whole_message_in_time_is_passed_on_untouched() {
        let body = Body::new(http_body_util::Full::new(bytes::Bytes::from_static(
            b"whole message",
        )));
        let body = MessageDeadline::new(body, MESSAGE_TIMEOUT);
        let collected = body.collect().await.unwrap().to_bytes();
        assert_eq!(&collected[..], b"whole message");
    }
}
