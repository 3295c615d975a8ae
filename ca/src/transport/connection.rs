//! Counting a connection's requests: each is an open HTTP/2 stream of its
//! connection ([`StreamActivity`], from which the connection is told to go
//! away when it has had none for `--max-connection-idle`) and a place among
//! the server's open requests ([`OpenRequests`], `--max-open-requests`),
//! from its HEADERS until its answer's body is sent or dropped.
//!
//! gRPC health requests (`/grpc.health.v1.Health/`, which anyone may send
//! without credentials) take a place in a pool of their own
//! ([`crate::config::MAX_HEALTH_REQUESTS`]) instead, so that they can never hold the
//! places of certificate requests, and do not count as activity of their
//! connection: a connection with only health streams open (a `Watch`
//! never ends by itself) is idle, and is told to go away and cut off like
//! any idle connection, its `Watch` streams with it. (A connection that
//! also carries other requests now and then is not idle, and its `Watch`
//! streams stay: they hold only health places.)

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body_util::BodyExt;
use meshca_serve::stream_activity::StreamActivity;
use tonic::codegen::{Body as HttpBody, Bytes, StdError};
use tower::{Layer, Service};

use super::listener::ConnectionState;

/// The path prefix of the gRPC health service's methods.
const HEALTH_PATH_PREFIX: &str = "/grpc.health.v1.Health/";

/// Requests (HTTP/2 streams) open across every connection, and the most
/// the server holds at once (`--max-open-requests`). Each open request
/// holds memory from its HEADERS on (h2's stream state, tonic's decoder,
/// the request's task) whether or not its message ever arrives, so the
/// per-connection stream limit times the connection limit is no bound a
/// memory limit can afford; this is.
#[derive(Debug)]
pub(crate) struct OpenRequests {
    open: AtomicUsize,
    /// The most open at once since [`OpenRequests::take_peak`].
    peak: AtomicUsize,
    max: usize,
    refused: crate::metrics::IstioCounter,
}

impl OpenRequests {
    /// At most `max` (at least 1) open at once; refusals counted on `refused`.
    pub(crate) fn new(max: usize, refused: crate::metrics::IstioCounter) -> Arc<Self> {
        Arc::new(Self {
            open: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            max: max.max(1),
            refused,
        })
    }

    /// Requests open now.
    #[cfg(test)]
    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// The most requests open at once since the last call, and how many
    /// are open now.
    pub(crate) fn take_peak(&self) -> (usize, usize) {
        let open = self.open.load(Ordering::Acquire);
        (self.peak.swap(open, Ordering::AcqRel).max(open), open)
    }

    /// A place for one more request, or `None` when `max` are open.
    fn try_open(self: &Arc<Self>) -> Option<OpenRequest> {
        let mut open = self.open.load(Ordering::Acquire);
        loop {
            if open >= self.max {
                self.refused.inc();
                return None;
            }
            match self.open.compare_exchange_weak(
                open,
                open + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.peak.fetch_max(open + 1, Ordering::AcqRel);
                    return Some(OpenRequest {
                        requests: self.clone(),
                    });
                }
                Err(now) => open = now,
            }
        }
    }
}

/// One request's place in [`OpenRequests`], given back when dropped.
#[derive(Debug)]
struct OpenRequest {
    requests: Arc<OpenRequests>,
}

impl Drop for OpenRequest {
    fn drop(&mut self) {
        self.requests.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// In the extensions of each request but health checks: its connection,
/// which the caller gate marks once a request on it has authenticated (at
/// a connection cap, connections that never made one are evicted first).
#[derive(Debug, Clone)]
pub(crate) struct RequestConnection(Arc<ConnectionState>);

impl RequestConnection {
    /// A request on this connection has authenticated.
    pub(crate) fn set_authenticated(&self) {
        self.0.set_authenticated();
    }
}

/// Counts each request on the connection as an open stream until its
/// answer's body has been sent or dropped (a reset stream, a cancelled
/// request), and refuses a request at once, before its message is read,
/// with `RESOURCE_EXHAUSTED` while [`OpenRequests`]' limit is reached.
#[derive(Debug, Clone)]
pub(crate) struct CountStreamsLayer {
    activity: Arc<StreamActivity>,
    all: Arc<OpenRequests>,
    health: Arc<OpenRequests>,
    connection: Option<Arc<ConnectionState>>,
}

impl CountStreamsLayer {
    /// Counts into `activity` (this connection) and `all` (every
    /// connection); health requests into `health` alone.
    pub(crate) fn new(
        activity: Arc<StreamActivity>,
        all: Arc<OpenRequests>,
        health: Arc<OpenRequests>,
    ) -> Self {
        Self {
            activity,
            all,
            health,
            connection: None,
        }
    }

    /// Puts `connection` in each request's extensions
    /// ([`RequestConnection`]), health checks' excepted.
    pub(crate) fn with_connection(mut self, connection: Arc<ConnectionState>) -> Self {
        self.connection = Some(connection);
        self
    }
}

impl<S> Layer<S> for CountStreamsLayer {
    type Service = CountStreams<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CountStreams {
            inner,
            activity: self.activity.clone(),
            all: self.all.clone(),
            health: self.health.clone(),
            connection: self.connection.clone(),
        }
    }
}

/// The service of [`CountStreamsLayer`].
#[derive(Debug, Clone)]
pub(crate) struct CountStreams<S> {
    inner: S,
    activity: Arc<StreamActivity>,
    all: Arc<OpenRequests>,
    health: Arc<OpenRequests>,
    connection: Option<Arc<ConnectionState>>,
}

impl<S, B, R> Service<Request<B>> for CountStreams<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Future: Send + 'static,
    R: HttpBody<Data = Bytes> + Send + 'static,
    R::Error: Into<StdError>,
{
    type Response = Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let is_health = request.uri().path().starts_with(HEALTH_PATH_PREFIX);
        if let (false, Some(connection)) = (is_health, &self.connection) {
            request
                .extensions_mut()
                .insert(RequestConnection(connection.clone()));
        }
        let pool = if is_health { &self.health } else { &self.all };
        let Some(place) = pool.try_open() else {
            // The request (and whatever of its message has arrived) is
            // dropped now; the client is told to come back.
            let status = if is_health {
                tonic::Status::resource_exhausted(format!(
                    "the CA holds {} health requests open, the most it takes; retry with backoff",
                    pool.max
                ))
            } else {
                tonic::Status::resource_exhausted(format!(
                    "the CA holds {} requests open, the most it takes (--max-open-requests); retry with backoff",
                    pool.max
                ))
            };
            return Box::pin(async move { Ok(status.into_http()) });
        };
        // A health stream is no activity of its connection (see the
        // module's documentation).
        let stream = (!is_health).then(|| self.activity.open());
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|body| {
                // The stream counts as open for as long as its body lives.
                tonic::body::Body::new(body.map_frame(move |frame| {
                    let _open = (&stream, &place);
                    frame
                }))
            }))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;

    fn health_pool() -> Arc<OpenRequests> {
        OpenRequests::new(crate::config::MAX_HEALTH_REQUESTS, Default::default())
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_stays_open_until_its_answer_body_is_dropped() {
        use http_body_util::BodyExt;
        let activity = Arc::new(StreamActivity::default());
        let all = OpenRequests::new(100, Default::default());
        let mut service = CountStreamsLayer::new(activity.clone(), all, health_pool()).layer(
            tower::service_fn(|_: Request<()>| async {
                Ok::<_, Infallible>(Response::new(http_body_util::Full::new(
                    Bytes::from_static(b"answer"),
                )))
            }),
        );
        let answer = service.call(Request::new(()));
        assert_eq!(activity.open_streams(), 1, "open from the call on");
        let response = answer.await.unwrap();
        assert_eq!(activity.open_streams(), 1, "open while its body is unsent");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"answer");
        assert_eq!(activity.open_streams(), 0);

        // A request dropped before it is answered (a reset stream) closes too.
        drop(service.call(Request::new(())));
        assert_eq!(activity.open_streams(), 0);
    }

    #[tokio::test]
    async fn requests_beyond_the_open_limit_are_refused_before_their_message() {
        let refused = crate::metrics::IstioCounter::default();
        let all = OpenRequests::new(2, refused.clone());
        let handled = Arc::new(AtomicUsize::new(0));
        let layer = CountStreamsLayer::new(
            Arc::new(StreamActivity::default()),
            all.clone(),
            health_pool(),
        );
        // Answers at once, counting the requests it handles.
        let answering = || {
            let handled = handled.clone();
            tower::service_fn(move |_: Request<()>| {
                handled.fetch_add(1, Ordering::SeqCst);
                async {
                    Ok::<_, Infallible>(Response::new(http_body_util::Full::new(
                        Bytes::from_static(b"answer"),
                    )))
                }
            })
        };
        let mut first_connection = layer.layer(answering());
        let other = CountStreamsLayer::new(
            Arc::new(StreamActivity::default()),
            all.clone(),
            health_pool(),
        );
        let mut second_connection = other.layer(answering());
        // Two answers not yet sent, on two connections: the limit is reached.
        let one = first_connection.call(Request::new(())).await.unwrap();
        let two = second_connection.call(Request::new(())).await.unwrap();
        assert_eq!(all.open(), 2);
        let refused_answer = first_connection.call(Request::new(())).await.unwrap();
        let status = tonic::Status::from_header_map(refused_answer.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(
            status.message().contains("--max-open-requests"),
            "{status:?}"
        );
        assert_eq!(
            handled.load(Ordering::SeqCst),
            2,
            "the refused one is never handled"
        );
        assert_eq!(refused.get(), 1);
        // An answer sent frees a place.
        drop(one);
        assert_eq!(all.open(), 1);
        second_connection.call(Request::new(())).await.unwrap();
        assert_eq!(handled.load(Ordering::SeqCst), 3);
        drop(two);
    }

    #[tokio::test]
    async fn health_requests_have_their_own_places_and_keep_no_connection_busy() {
        let all = OpenRequests::new(1, Default::default());
        let health = OpenRequests::new(2, Default::default());
        let activity = Arc::new(StreamActivity::default());
        let mut service = CountStreamsLayer::new(activity.clone(), all.clone(), health.clone())
            .layer(tower::service_fn(|_: Request<()>| async {
                Ok::<_, Infallible>(Response::new(http_body_util::Full::new(
                    Bytes::from_static(b"answer"),
                )))
            }));
        let health_request = || {
            Request::builder()
                .uri("/grpc.health.v1.Health/Watch")
                .body(())
                .unwrap()
        };
        // Two health streams held open (a Watch never ends by itself).
        let watch_one = service.call(health_request()).await.unwrap();
        let _watch_two = service.call(health_request()).await.unwrap();
        assert_eq!(health.open(), 2);
        assert_eq!(all.open(), 0, "no certificate request's place taken");
        assert_eq!(activity.open_streams(), 0, "the connection counts as idle");
        // A third health request is refused; a certificate request is not.
        let refused = service.call(health_request()).await.unwrap();
        let status = tonic::Status::from_header_map(refused.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().contains("health requests"), "{status:?}");
        let certificate_request = Request::builder()
            .uri("/istio.v1.auth.IstioCertificateService/CreateCertificate")
            .body(())
            .unwrap();
        let answer = service.call(certificate_request).await.unwrap();
        assert!(tonic::Status::from_header_map(answer.headers()).is_none());
        assert_eq!((all.open(), activity.open_streams()), (1, 1));
        // A health stream ended gives its place back.
        drop(watch_one);
        assert_eq!(health.open(), 1);
        service.call(health_request()).await.unwrap();
    }

    #[tokio::test]
    async fn requests_but_health_checks_carry_their_connection_for_the_caller_gate() {
        let connection = Arc::new(ConnectionState::default());
        let mut service = CountStreamsLayer::new(
            connection.activity.clone(),
            OpenRequests::new(10, Default::default()),
            health_pool(),
        )
        .with_connection(connection.clone())
        .layer(tower::service_fn(|request: Request<()>| async move {
            // What the caller gate does once the request authenticated.
            if let Some(connection) = request.extensions().get::<RequestConnection>() {
                connection.set_authenticated();
            }
            Ok::<_, Infallible>(Response::new(http_body_util::Full::new(
                Bytes::from_static(b"answer"),
            )))
        }));
        let health = Request::builder()
            .uri("/grpc.health.v1.Health/Check")
            .body(())
            .unwrap();
        drop(service.call(health).await.unwrap());
        assert!(
            !connection.is_authenticated(),
            "a health check carries no connection"
        );
        let certificate_request = Request::builder()
            .uri("/istio.v1.auth.IstioCertificateService/CreateCertificate")
            .body(())
            .unwrap();
        drop(service.call(certificate_request).await.unwrap());
        assert!(connection.is_authenticated());
    }

    #[test]
    fn the_peak_of_open_requests_is_taken_and_restarted() {
        let all = OpenRequests::new(10, Default::default());
        let places: Vec<_> = (0..3).map(|_| all.try_open().unwrap()).collect();
        let mut places = places.into_iter();
        let kept = places.next();
        drop(places);
        assert_eq!(all.take_peak(), (3, 1));
        assert_eq!(all.take_peak(), (1, 1), "restarts from what is open");
        drop(kept);
        assert_eq!(all.take_peak(), (1, 0));
        assert_eq!(all.take_peak(), (0, 0));
    }
}
