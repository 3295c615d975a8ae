//! The agent's Unix socket: the SPIFFE Workload API and Envoy SDS, the
//! socket SPIRE's agent serves and that Istio's agent uses when it finds
//! one at `/var/run/secrets/workload-spiffe-uds/socket`.
//!
//! - `socket`: binding the socket ([`bind`]), accepting connections with
//!   the caller's peer credentials;
//! - `attest`: node mode's cgroup reading (PID to pod UID);
//! - `node_pods`: node mode's watch of this node's pods ([`NodePods`],
//!   [`watch_node_pods`]);
//! - `callers`: who gets which identity ([`Callers`], [`CallerPolicy`]),
//!   and the stream limits;
//! - `per_pod`: node mode's limits on one pod's connections and streams;
//! - `feeds`: one [`Feed`] of `credentials::Credentials` per identity over
//!   the [`CertManager`](crate::CertManager) ([`Feeds`]);
//! - `spiffe_api` and `sds`: the two gRPC services;
//! - `server`: each connection's HTTP/2 life (first-request and idle
//!   timeouts, the bounded close when the agent stops).
//!
//! The submodules are private: the agent uses only what is re-exported here.
//!
//! Every stream holds a stream slot (at most [`WorkloadApiConfig::max_streams`])
//! and its identity's feed; it sends the current credentials as soon as
//! there are any and again on each change, holding at most one response
//! while the client reads (HTTP/2 flow control bounds the rest). Closing a
//! stream frees its slot, and the last stream of an identity frees its
//! feed. Connections are bounded by the same number, and by the open-files
//! limit ([`connection_cap`]). In node mode one pod (or every caller not
//! attested to a pod of this node, together) holds at most the
//! `max_streams_per_pod` given to [`Callers::new`] connections and as many
//! streams, so that one pod cannot lock the node's other pods out. A
//! connection must send its first request
//! within [`FIRST_REQUEST_TIMEOUT`] and is closed after
//! [`CONNECTION_IDLE_TIMEOUT`] without a stream. When the agent stops,
//! streams end at once and connections are closed within [`CLOSE_GRACE`].

mod attest;
mod authority_fix;
mod callers;
mod credentials;
mod feeds;
mod jwt;
mod node_pods;
mod per_pod;
mod sds;
mod server;
mod socket;
mod spiffe_api;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use time::OffsetDateTime;

use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_server::SecretDiscoveryServiceServer;
use futures::StreamExt;
use meshca_certs::TrustBundle;
use meshca_proto::spiffe_workload::spiffe_workload_api_server::SpiffeWorkloadApiServer;
use tokio::net::UnixListener;
use tokio::sync::watch;

use crate::caclient::CaClient;
#[doc(hidden)]
pub use authority_fix::fuzz_authority_fix;
pub use callers::{CallerPolicy, Callers, DEFAULT_ATTESTATION_WAIT};
pub use credentials::ServedCrl;
pub use feeds::{Feed, Feeds};
pub use jwt::{JwtSvids, ALLOWED_ALGORITHMS, MAX_AUDIENCES, MAX_CACHED_JWT_SVIDS};
pub use node_pods::{watch_node_pods, NodePods};
pub use per_pod::{DEFAULT_MAX_STREAMS_PER_POD, MAX_BUFFERED_BYTES_PER_POD};
pub use sds::MAX_SDS_REQUESTS_PER_SECOND;
use server::ConnectionTimers;
pub use server::{CLOSE_GRACE, CONNECTION_IDLE_TIMEOUT, FIRST_REQUEST_TIMEOUT};
pub use socket::{bind, connection_cap, raise_open_files_limit, SocketError, FD_RESERVE};

/// Default most streams open at once (and most connections).
pub const DEFAULT_MAX_STREAMS: usize = 4096;

/// The largest Workload API request message the socket reads (a larger one
/// is refused with `OUT_OF_RANGE` as soon as its length prefix arrives).
/// The X.509 requests are empty; the JWT ones (not served) carry a token
/// and audiences.
pub const MAX_WORKLOAD_API_REQUEST_BYTES: usize = 16 * 1024;

/// The largest SDS request message the socket reads (a larger one is
/// refused with `OUT_OF_RANGE` as soon as its length prefix arrives).
/// Envoy puts its node description in its requests: its metadata and the
/// list of its extensions, tens of KiB. With the stream limits, this bounds
/// what one pod can make the agent hold: `--max-streams-per-pod` × 256 KiB.
pub const MAX_SDS_REQUEST_BYTES: usize = 256 * 1024;
/// Default interval between checks of the `--root-cert` file for a new
/// bundle, as the agent's `--bundle-refresh` flag reads it.
pub const DEFAULT_BUNDLE_REFRESH: &str = "10s";
/// HTTP/2 streams per connection (a SPIFFE library or Envoy opens a few).
pub(crate) const MAX_STREAMS_PER_CONNECTION: u32 = 128;

/// How often the open connections' peak is looked at, to give the heap's
/// free pages back after a burst (as the CA does).
const HEAP_TRIM_CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// Connections open at once that make a burst worth trimming the heap
/// after (once at most a quarter of them are left).
const HEAP_TRIM_MIN_PEAK_CONNECTIONS: usize = 32;

/// The socket's open connections now, and the most at once since the heap
/// trimmer last looked.
#[derive(Debug, Default)]
struct OpenConnections {
    open: std::sync::atomic::AtomicUsize,
    peak: std::sync::atomic::AtomicUsize,
}

impl OpenConnections {
    fn set(&self, open: usize) {
        use std::sync::atomic::Ordering;
        self.open.store(open, Ordering::Release);
        self.peak.fetch_max(open, Ordering::AcqRel);
    }

    /// The most open at once since the last call, and how many are open now.
    fn take_peak(&self) -> (usize, usize) {
        use std::sync::atomic::Ordering;
        let open = self.open.load(Ordering::Acquire);
        (self.peak.swap(open, Ordering::AcqRel).max(open), open)
    }
}

/// How the socket serves.
#[derive(Debug, Clone)]
pub struct WorkloadApiConfig {
    /// The socket path.
    pub socket: PathBuf,
    /// Most streams open at once; also the most connections.
    pub max_streams: usize,
    /// Node mode: where `<pid>/cgroup` files are (normally `/proc`).
    pub proc_root: Option<PathBuf>,
    /// JWT-SVIDs and the JWT bundle (`None`: the JWT methods answer
    /// `UNIMPLEMENTED`).
    pub jwt: Option<Arc<JwtSvids>>,
}

/// Errors of the socket server.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadApiError {
    /// The socket could not be set up.
    #[error(transparent)]
    Socket(#[from] SocketError),
}

/// Serves both APIs on `listener` (from [`bind`]) until `shutdown`
/// completes; then stops accepting (the listener is closed), ends every
/// open stream with `UNAVAILABLE`, tells every connection to go away and
/// returns once all have closed, at most [`CLOSE_GRACE`] later.
///
/// Raises the soft limit of open files to the hard one, and takes at most
/// [`connection_cap`] connections at once.
pub async fn serve(
    listener: UnixListener,
    config: &WorkloadApiConfig,
    callers: Arc<Callers>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), WorkloadApiError> {
    let open_files = raise_open_files_limit();
    let max_connections = connection_cap(config.max_streams, open_files);
    tracing::info!(
        max_streams = config.max_streams,
        max_connections,
        open_files_limit = ?open_files,
        first_request_timeout = ?FIRST_REQUEST_TIMEOUT,
        idle_timeout = ?CONNECTION_IDLE_TIMEOUT,
        "Workload API socket limits"
    );
    if max_connections < config.max_streams {
        tracing::warn!(
            max_streams = config.max_streams,
            max_connections,
            open_files_limit = ?open_files,
            reserve = FD_RESERVE,
            "the open-files limit allows fewer connections than --max-streams"
        );
    }
    serve_with(
        listener,
        config,
        max_connections,
        ConnectionTimers::default(),
        callers,
        shutdown,
    )
    .await;
    Ok(())
}

/// [`serve`] with the connection cap and timers given.
async fn serve_with(
    listener: UnixListener,
    config: &WorkloadApiConfig,
    max_connections: usize,
    timers: ConnectionTimers,
    callers: Arc<Callers>,
    shutdown: impl Future<Output = ()> + Send,
) {
    let routes = tonic::service::Routes::new(
        SpiffeWorkloadApiServer::new(
            spiffe_api::WorkloadApiService::new(callers.clone()).with_jwt(config.jwt.clone()),
        )
        .max_decoding_message_size(MAX_WORKLOAD_API_REQUEST_BYTES),
    )
    .add_service(
        SecretDiscoveryServiceServer::new(sds::SdsService::new(callers.clone()))
            .max_decoding_message_size(MAX_SDS_REQUEST_BYTES),
    )
    .prepare();
    // Boxed, so that dropping it below closes the listener.
    let node = config.proc_root.clone().map(|proc_root| {
        let callers = callers.clone();
        socket::NodeAttestation {
            proc_root,
            admit: Arc::new(move |caller: &socket::CallerInfo| callers.admit_connection(caller)),
        }
    });
    let mut incoming = Box::pin(socket::accept_callers(listener, max_connections, node));
    let open_connections = Arc::new(OpenConnections::default());
    {
        let open_connections = Arc::downgrade(&open_connections);
        let policy = meshca_serve::heap_trim::TrimPolicy {
            check_interval: HEAP_TRIM_CHECK_INTERVAL,
            min_peak: HEAP_TRIM_MIN_PEAK_CONNECTIONS,
        };
        meshca_serve::heap_trim::spawn(policy, "workload connections", move || {
            // The socket server is gone: so is the task.
            open_connections.upgrade().map(|open| open.take_peak())
        });
    }
    tokio::pin!(shutdown);
    let (stopping_tx, stopping) = watch::channel(false);
    // One task per connection; at most `max_connections` (the accept
    // loop's slots), reaped as they end.
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = incoming.next() => match accepted {
                Some(connection) => {
                    connections.spawn(server::serve_connection(
                        connection,
                        routes.clone(),
                        callers.clone(),
                        timers,
                        stopping.clone(),
                    ));
                    open_connections.set(connections.len());
                }
                None => break,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {
                open_connections.set(connections.len());
            }
            () = &mut shutdown => break,
        }
    }
    // Stop accepting: the listener is closed here.
    drop(incoming);
    callers.close();
    stopping_tx.send_replace(true);
    let open = connections.len();
    if open > 0 {
        tracing::info!(connections = open, grace = ?timers.close_grace, "closing the workload connections");
    }
    // Each connection ends within its grace; the outer bound is a
    // safety net (dropping the set aborts what is left).
    let drained = tokio::time::timeout(timers.close_grace + Duration::from_secs(1), async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            connections = connections.len(),
            "workload connections still open after the grace; cut off"
        );
    }
}

/// The `--root-cert` file's bundle, re-read every `interval` (the client
/// re-reads it when its modification time or size changed); the receiver
/// sees each new bundle.
pub fn watch_root_file(client: CaClient, interval: Duration) -> watch::Receiver<TrustBundle> {
    let (tx, rx) = watch::channel(client.bundle());
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                _ = tx.closed() => return,
            }
            let bundle = client.bundle();
            tx.send_if_modified(|current| {
                if *current == bundle {
                    return false;
                }
                tracing::info!(
                    roots = bundle.roots().len(),
                    "the --root-cert bundle changed"
                );
                *current = bundle;
                true
            });
        }
    });
    rx
}

/// The CA's CRL in `path` (e.g. a mounted `istio-ca-crl` ConfigMap, or
/// the CA's `ca-crl.pem`), re-read every `interval`; the receiver sees
/// each new one. A missing or unreadable file keeps the last good CRL
/// (logged); the feeds serve it only while it verifies.
pub fn watch_crl_file(
    path: std::path::PathBuf,
    interval: Duration,
) -> watch::Receiver<Option<Arc<ServedCrl>>> {
    let read = |path: &std::path::Path| -> Result<ServedCrl, String> {
        let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
        ServedCrl::from_pem(&text).map_err(|e| e.to_string())
    };
    let first = match read(&path) {
        Ok(crl) if crl.is_stale(OffsetDateTime::now_utc()) => {
            tracing::warn!(file = %path.display(), "the CRL is past its nextUpdate; none is served until the CA signs a new one");
            None
        }
        Ok(crl) => Some(Arc::new(crl)),
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "no CRL to serve yet");
            None
        }
    };
    let (tx, rx) = watch::channel(first);
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_error: Option<String> = None;
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                _ = tx.closed() => return,
            }
            let now = OffsetDateTime::now_utc();
            match read(&path) {
                Ok(crl) if crl.is_stale(now) => last_error = None,
                Ok(crl) => {
                    last_error = None;
                    tx.send_if_modified(|current| {
                        if current.as_deref() == Some(&crl) {
                            return false;
                        }
                        tracing::info!(file = %path.display(), "the CRL changed");
                        *current = Some(Arc::new(crl));
                        true
                    });
                }
                Err(e) => {
                    if last_error.as_ref() != Some(&e) {
                        tracing::warn!(file = %path.display(), error = %e, "reading the CRL failed; the last one stays served while it is current");
                    }
                    last_error = Some(e);
                }
            }
            // A CRL past its nextUpdate is withdrawn, never served on (a
            // client would refuse every peer with it).
            tx.send_if_modified(|current| {
                if !current.as_ref().is_some_and(|crl| crl.is_stale(now)) {
                    return false;
                }
                tracing::warn!(file = %path.display(), "the CRL is past its nextUpdate; withdrawn until the CA signs a new one");
                *current = None;
                true
            });
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::feeds::tests::{id, setup, TestIssuer};
    use super::*;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse;
    use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
    use hyper_util::rt::TokioIo;
    use meshca_proto::spiffe_workload::spiffe_workload_api_client::SpiffeWorkloadApiClient;
    use meshca_proto::spiffe_workload::{
        X509BundlesRequest, X509BundlesResponse, X509svidRequest, X509svidResponse,
    };
    use prost::Message;
    use std::path::Path;
    use std::sync::atomic::Ordering;
    use tokio::io::AsyncReadExt;
    use tokio::net::UnixStream;
    use tokio::task::JoinHandle;
    use tonic::transport::{Channel, Endpoint};
    use tonic::Code;
    use tonic::Streaming;

    /// A socket server over a test issuer, stopped by `stop`.
    struct Harness {
        _dir: tempfile::TempDir,
        socket: PathBuf,
        issuer: Arc<TestIssuer>,
        _bundle: watch::Sender<TrustBundle>,
        _pinned: Arc<Feed>,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        server: JoinHandle<()>,
    }

    async fn start(
        lifetime: Duration,
        max_connections: usize,
        timers: ConnectionTimers,
        before: impl FnOnce(&TestIssuer),
    ) -> Harness {
        let (issuer, feeds, bundle) = setup(lifetime);
        before(&issuer);
        // Pinned, as pod mode's identity is: managed with no stream open.
        let pinned = feeds.get(&id("web"));
        let callers = Callers::new(CallerPolicy::Pod(id("web")), feeds, 16, 16);
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let listener = bind(&socket).await.unwrap();
        let config = WorkloadApiConfig {
            socket: socket.clone(),
            max_streams: 16,
            proc_root: None,
            jwt: None,
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let shutdown = async {
                let _ = stopped.await;
            };
            serve_with(
                listener,
                &config,
                max_connections,
                timers,
                callers,
                shutdown,
            )
            .await;
        });
        Harness {
            _dir: dir,
            socket,
            issuer,
            _bundle: bundle,
            _pinned: pinned,
            stop: Some(stop),
            server,
        }
    }

    async fn channel(socket: &Path) -> Channel {
        let socket = socket.to_path_buf();
        Endpoint::from_static("http://localhost")
            .connect_with_connector(tower::service_fn(move |_| {
                let socket = socket.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
            }))
            .await
            .unwrap()
    }

    fn with_header<T>(message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request
            .metadata_mut()
            .insert(meshca_proto::WORKLOAD_API_HEADER, "true".parse().unwrap());
        request
    }

    fn sds_request(names: &[&str]) -> DiscoveryRequest {
        DiscoveryRequest {
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            type_url: sds::SECRET_TYPE_URL.to_string(),
            ..Default::default()
        }
    }

    /// A FetchX509SVID stream on `channel`.
    async fn svid_stream(channel: &Channel) -> Streaming<X509svidResponse> {
        SpiffeWorkloadApiClient::new(channel.clone())
            .fetch_x509svid(with_header(X509svidRequest {}))
            .await
            .unwrap()
            .into_inner()
    }

    /// A FetchX509Bundles stream on `channel`.
    async fn bundle_stream(channel: &Channel) -> Streaming<X509BundlesResponse> {
        SpiffeWorkloadApiClient::new(channel.clone())
            .fetch_x509_bundles(with_header(X509BundlesRequest {}))
            .await
            .unwrap()
            .into_inner()
    }

    /// An SDS StreamSecrets stream on `channel` that has asked for
    /// `names`, and the sender of its further requests (the stream ends
    /// when it is dropped).
    async fn secret_stream(
        channel: &Channel,
        names: &[&str],
    ) -> (
        tokio::sync::mpsc::Sender<DiscoveryRequest>,
        Streaming<DiscoveryResponse>,
    ) {
        let (requests, mut outbound) = tokio::sync::mpsc::channel(4);
        requests.send(sds_request(names)).await.unwrap();
        let stream = SecretDiscoveryServiceClient::new(channel.clone())
            .stream_secrets(futures::stream::poll_fn(move |cx| outbound.poll_recv(cx)))
            .await
            .unwrap()
            .into_inner();
        (requests, stream)
    }

    const LONG: Duration = Duration::from_secs(3600);
    const WAIT: Duration = Duration::from_secs(20);

    fn timers(first_request: Duration, idle: Duration, close_grace: Duration) -> ConnectionTimers {
        ConnectionTimers {
            first_request,
            idle,
            close_grace,
        }
    }

    #[tokio::test]
    async fn stopping_ends_open_streams_and_returns_within_the_grace() {
        let grace = Duration::from_millis(500);
        let mut h = start(LONG, 16, timers(LONG, LONG, grace), |_| {}).await;
        let channel = channel(&h.socket).await;
        let mut svids = svid_stream(&channel).await;
        assert!(svids.message().await.unwrap().is_some());
        let (requests, mut sds) = secret_stream(&channel, &["default"]).await;
        assert_eq!(sds.message().await.unwrap().unwrap().resources.len(), 1);
        // A connection that never speaks, and one that never reads.
        let _silent = UnixStream::connect(&h.socket).await.unwrap();
        let started = tokio::time::Instant::now();
        h.stop.take().unwrap().send(()).unwrap();
        for status in [
            svids.message().await.unwrap_err(),
            sds.message().await.unwrap_err(),
        ] {
            assert_eq!(status.code(), Code::Unavailable, "{status:?}");
            assert!(status.message().contains("shutting down"), "{status:?}");
        }
        tokio::time::timeout(grace + Duration::from_secs(5), &mut h.server)
            .await
            .expect("serve returns within the grace")
            .unwrap();
        assert!(started.elapsed() < grace + Duration::from_secs(5));
        assert!(
            UnixStream::connect(&h.socket).await.is_err(),
            "no longer accepting"
        );
        drop(requests);
    }

    #[tokio::test]
    async fn a_connection_that_sends_no_request_is_closed_and_frees_its_slot() {
        let first_request = Duration::from_millis(300);
        // One connection slot, taken by a connection that sends nothing.
        let h = start(LONG, 1, timers(first_request, LONG, LONG), |_| {}).await;
        let mut silent = UnixStream::connect(&h.socket).await.unwrap();
        // A real client behind it gets in once the silent one is closed.
        let socket = h.socket.clone();
        let client = tokio::spawn(async move {
            let mut bundles = bundle_stream(&channel(&socket).await).await;
            bundles.message().await.unwrap().unwrap()
        });
        // The agent's HTTP/2 SETTINGS, then the end.
        let mut buf = Vec::new();
        let read = tokio::time::timeout(WAIT, silent.read_to_end(&mut buf))
            .await
            .expect("the silent connection is closed");
        assert!(read.is_ok() || buf.len() < 1024, "{read:?}");
        let answer = tokio::time::timeout(WAIT, client).await.unwrap().unwrap();
        assert_eq!(answer.bundles.len(), 1);
    }

    /// Python's grpcio sends the socket's path, percent-encoded, as
    /// `:authority`; h2 alone resets such a stream with PROTOCOL_ERROR. The
    /// agent answers it, and a second request on the connection whose
    /// block refers to the first's HPACK entries too.
    #[tokio::test]
    async fn a_request_with_grpcio_s_socket_path_authority_is_answered() {
        let h = start(LONG, 16, ConnectionTimers::default(), |_| {}).await;
        let mut raw = UnixStream::connect(&h.socket).await.unwrap();
        let mut encoder = loona_hpack::Encoder::new();
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        bytes.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        for stream in [1u8, 3] {
            let fields: [(&[u8], &[u8]); 6] = [
                (b":method", b"POST"),
                (b":scheme", b"http"),
                (b":path", b"/SpiffeWorkloadAPI/FetchX509Bundles"),
                (b":authority", b"tmp%2Fpytest-0%2Fagent.sock"),
                (b"content-type", b"application/grpc"),
                (b"workload.spiffe.io", b"true"),
            ];
            let block = encoder.encode(fields);
            let len = block.len();
            // HEADERS, END_HEADERS.
            bytes.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, 1, 4]);
            bytes.extend_from_slice(&[0, 0, 0, stream]);
            bytes.extend_from_slice(&block);
            // DATA, END_STREAM: an empty gRPC message.
            bytes.extend_from_slice(&[0, 0, 5, 0, 1, 0, 0, 0, stream, 0, 0, 0, 0, 0]);
        }
        tokio::io::AsyncWriteExt::write_all(&mut raw, &bytes)
            .await
            .unwrap();
        // Read the agent's frames until both streams have their response
        // headers and a first message (FetchX509Bundles streams), or a
        // reset comes.
        let mut decoder = loona_hpack::Decoder::new();
        let mut received = Vec::new();
        let mut statuses = std::collections::BTreeMap::new();
        let mut messages = std::collections::BTreeSet::new();
        tokio::time::timeout(WAIT, async {
            let mut chunk = [0u8; 4096];
            let mut at = 0;
            while messages.len() < 2 {
                let n = raw.read(&mut chunk).await.unwrap();
                assert!(n > 0, "the agent closed the connection");
                received.extend_from_slice(&chunk[..n]);
                while received.len() >= at + 9 {
                    let len = usize::from(received[at]) << 16
                        | usize::from(received[at + 1]) << 8
                        | usize::from(received[at + 2]);
                    if received.len() < at + 9 + len {
                        break;
                    }
                    let (kind, stream) = (received[at + 3], received[at + 8]);
                    let payload = &received[at + 9..at + 9 + len];
                    assert_ne!(kind, 3, "stream {stream} was reset: {payload:?}");
                    if kind == 1 {
                        let fields = decoder.decode(payload).unwrap();
                        for (name, value) in fields {
                            if name == b"grpc-status" || name == b":status" {
                                statuses
                                    .entry(stream)
                                    .or_insert_with(Vec::new)
                                    .push(String::from_utf8(value).unwrap());
                            }
                        }
                    }
                    if kind == 0 && len > 5 {
                        messages.insert(stream);
                    }
                    at += 9 + len;
                }
            }
        })
        .await
        .expect("both requests answered");
        for stream in [1, 3] {
            assert_eq!(
                statuses.get(&stream).map(Vec::as_slice),
                Some(&["200".to_string()][..]),
                "stream {stream}"
            );
        }
    }

    #[tokio::test]
    async fn a_client_that_ignores_its_goaway_is_cut_off_after_the_grace() {
        let (idle, grace) = (Duration::from_millis(200), Duration::from_millis(600));
        let h = start(LONG, 16, timers(LONG, idle, grace), |_| {}).await;
        let mut raw = UnixStream::connect(&h.socket).await.unwrap();
        // The HTTP/2 preface and an empty SETTINGS frame, then nothing:
        // no request, no SETTINGS ACK, and no close after the GOAWAY.
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        tokio::io::AsyncWriteExt::write_all(&mut raw, &hello)
            .await
            .unwrap();
        // Read the agent's frames as they come, noting when its GOAWAY
        // (frame type 7) arrives and when the connection ends.
        let mut bytes = Vec::new();
        let mut goaway_at = None;
        let ended_at = tokio::time::timeout(WAIT, async {
            let mut chunk = [0u8; 1024];
            loop {
                let n = raw.read(&mut chunk).await.unwrap();
                if n == 0 {
                    return std::time::Instant::now();
                }
                bytes.extend_from_slice(&chunk[..n]);
                let mut at = 0;
                while bytes.len() >= at + 9 {
                    let length = usize::from(bytes[at]) << 16
                        | usize::from(bytes[at + 1]) << 8
                        | usize::from(bytes[at + 2]);
                    if bytes[at + 3] == 7 && goaway_at.is_none() {
                        goaway_at = Some(std::time::Instant::now());
                    }
                    at += 9 + length;
                }
            }
        })
        .await
        .expect("the connection is cut off");
        let goaway_at = goaway_at.expect("a GOAWAY before the end");
        let after = ended_at.duration_since(goaway_at);
        // Half the grace: this client may read the GOAWAY late on a busy
        // machine, which shortens what it measures, never lengthens it.
        assert!(
            after >= grace / 2,
            "cut off {after:?} after the GOAWAY, well before the grace of {grace:?}"
        );
    }

    #[tokio::test]
    async fn a_connection_without_streams_is_told_to_go_away() {
        let idle = Duration::from_millis(300);
        let h = start(
            LONG,
            16,
            timers(LONG, idle, Duration::from_millis(300)),
            |_| {},
        )
        .await;
        let io = TokioIo::new(UnixStream::connect(&h.socket).await.unwrap());
        let (mut send, connection) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                .await
                .unwrap();
        let connection = tokio::spawn(connection);
        // One request (an unknown method: answered at once), then nothing.
        let request = tonic::codegen::http::Request::post("/no.such.Service/Method")
            .header("content-type", "application/grpc")
            .body(http_body_util::Empty::<tonic::codegen::Bytes>::new())
            .unwrap();
        let answer = send.send_request(request).await.unwrap();
        assert_eq!(answer.headers()["grpc-status"], "12", "UNIMPLEMENTED");
        drop(answer);
        tokio::time::timeout(WAIT, connection)
            .await
            .expect("the idle connection is closed")
            .unwrap()
            .ok();
    }

    #[tokio::test]
    async fn the_bundle_is_answered_before_any_certificate() {
        let h = start(LONG, 16, ConnectionTimers::default(), |issuer| {
            issuer.hang.store(true, Ordering::SeqCst)
        })
        .await;
        let channel = channel(&h.socket).await;
        let mut bundles = bundle_stream(&channel).await;
        let answer = tokio::time::timeout(WAIT, bundles.message())
            .await
            .expect("the bundle at once")
            .unwrap()
            .unwrap();
        assert_eq!(
            answer.bundles["spiffe://cluster.local"],
            h.issuer.ca.cert_der().to_vec()
        );
        let mut sds = SecretDiscoveryServiceClient::new(channel.clone());
        let fetched = tokio::time::timeout(WAIT, sds.fetch_secrets(sds_request(&["ROOTCA"])))
            .await
            .expect("ROOTCA at once")
            .unwrap()
            .into_inner();
        assert_eq!(fetched.resources.len(), 1);
        let (_requests, mut stream) = secret_stream(&channel, &["ROOTCA"]).await;
        let pushed = tokio::time::timeout(WAIT, stream.message())
            .await
            .expect("ROOTCA at once on a stream")
            .unwrap()
            .unwrap();
        assert_eq!(pushed.resources.len(), 1);
        assert_eq!(h.issuer.calls.load(Ordering::SeqCst), 1, "the fetch hangs");
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_certificate_the_svid_is_unavailable_after_a_short_wait() {
        let h = start(LONG, 16, ConnectionTimers::default(), |issuer| {
            issuer.hang.store(true, Ordering::SeqCst)
        })
        .await;
        let channel = channel(&h.socket).await;
        let started = tokio::time::Instant::now();
        let mut svids = svid_stream(&channel).await;
        let status = svids.message().await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(status.message().contains("no certificate"), "{status:?}");
        assert!(started.elapsed() >= spiffe_api::FIRST_SVID_WAIT);
        let status = SecretDiscoveryServiceClient::new(channel)
            .fetch_secrets(sds_request(&["default"]))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_svid_is_never_served() {
        let lifetime = Duration::from_secs(100);
        let h = start(lifetime, 16, ConnectionTimers::default(), |_| {}).await;
        let channel = channel(&h.socket).await;
        let mut svids = svid_stream(&channel).await;
        assert!(svids.message().await.unwrap().is_some());
        // The CA becomes unreachable; the SVID expires.
        *h.issuer.fail.lock().unwrap() = Some(Code::Unavailable);
        let status = svids.message().await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(status.message().contains("expired"), "{status:?}");
        // New callers are refused at once, not served the expired SVID.
        let mut again = svid_stream(&channel).await;
        let status = again.message().await.unwrap_err();
        assert!(status.message().contains("expired"), "{status:?}");
        let mut sds = SecretDiscoveryServiceClient::new(channel);
        let status = sds
            .fetch_secrets(sds_request(&["default"]))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        // The bundle still is.
        let roots = sds.fetch_secrets(sds_request(&["ROOTCA"])).await.unwrap();
        assert_eq!(roots.into_inner().resources.len(), 1);
    }

    #[tokio::test]
    async fn a_refusal_by_the_ca_reaches_the_caller() {
        let h = start(LONG, 16, ConnectionTimers::default(), |issuer| {
            *issuer.fail.lock().unwrap() = Some(Code::PermissionDenied)
        })
        .await;
        let channel = channel(&h.socket).await;
        let mut svids = svid_stream(&channel).await;
        let status = tokio::time::timeout(WAIT, svids.message())
            .await
            .expect("an answer")
            .unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        assert!(status.message().contains(id("web").as_str()), "{status:?}");
        let (_requests, mut stream) = secret_stream(&channel, &["default"]).await;
        let status = tokio::time::timeout(WAIT, stream.message())
            .await
            .expect("an answer")
            .unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    }

    #[tokio::test]
    async fn unknown_secret_names_are_answered_empty_and_repeated_ones_once() {
        let h = start(LONG, 16, ConnectionTimers::default(), |_| {}).await;
        let channel = channel(&h.socket).await;
        let mut sds = SecretDiscoveryServiceClient::new(channel.clone());
        let fetched = sds
            .fetch_secrets(sds_request(&["default", "bogus", "default"]))
            .await
            .expect("answered without the unknown name")
            .into_inner();
        let names: Vec<String> = fetched
            .resources
            .iter()
            .map(|any| Secret::decode(any.value.as_slice()).unwrap().name)
            .collect();
        assert_eq!(names, ["default"]);
        // On a stream: an empty answer, and the stream goes on.
        let (requests, mut stream) = secret_stream(&channel, &["bogus"]).await;
        let empty = tokio::time::timeout(WAIT, stream.message())
            .await
            .expect("an answer")
            .unwrap()
            .unwrap();
        assert!(empty.resources.is_empty(), "{empty:?}");
        let mut next = sds_request(&["bogus", "ROOTCA"]);
        next.response_nonce = empty.nonce.clone();
        next.version_info = empty.version_info.clone();
        requests.send(next).await.unwrap();
        let roots = tokio::time::timeout(WAIT, stream.message())
            .await
            .expect("an answer")
            .unwrap()
            .unwrap();
        assert_eq!(roots.resources.len(), 1);
        assert_ne!(roots.nonce, empty.nonce);
        // No names at all is every secret (Envoy's wildcard), as before.
        let all = sds
            .fetch_secrets(sds_request(&[]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(all.resources.len(), 2);
    }

    #[tokio::test]
    async fn request_messages_larger_than_the_bound_are_refused() {
        let h = start(LONG, 16, ConnectionTimers::default(), |_| {}).await;
        let channel = channel(&h.socket).await;
        let name = "x".repeat(MAX_SDS_REQUEST_BYTES);
        let status = SecretDiscoveryServiceClient::new(channel.clone())
            .fetch_secrets(sds_request(&[&name]))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
        // A request within the bound is served on the same connection.
        let fetched = SecretDiscoveryServiceClient::new(channel)
            .fetch_secrets(sds_request(&["ROOTCA"]))
            .await
            .unwrap();
        assert_eq!(fetched.into_inner().resources.len(), 1);
    }

    #[tokio::test]
    async fn a_request_holds_its_stream_place_from_its_headers() {
        use http_body_util::StreamBody;
        use hyper::body::Frame;
        use tonic::codegen::Bytes;

        // The harness serves at most 16 streams.
        let h = start(LONG, 64, ConnectionTimers::default(), |_| {}).await;
        let io = TokioIo::new(UnixStream::connect(&h.socket).await.unwrap());
        let (send, connection) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                .await
                .unwrap();
        tokio::spawn(connection);
        // Sixteen requests whose messages never come.
        let unfinished: Vec<_> = (0..16)
            .map(|_| {
                let body = StreamBody::new(futures::stream::pending::<
                    Result<Frame<Bytes>, std::convert::Infallible>,
                >());
                let request =
                    tonic::codegen::http::Request::post("/SpiffeWorkloadAPI/FetchX509SVID")
                        .header("content-type", "application/grpc")
                        .header(meshca_proto::WORKLOAD_API_HEADER, "true")
                        .body(body)
                        .unwrap();
                let mut send = send.clone();
                tokio::spawn(async move { send.send_request(request).await })
            })
            .collect();
        let channel = channel(&h.socket).await;
        let refused = tokio::time::timeout(WAIT, async {
            loop {
                let answer = SpiffeWorkloadApiClient::new(channel.clone())
                    .fetch_x509svid(with_header(X509svidRequest {}))
                    .await;
                match answer {
                    Err(status) => return status,
                    // Not all sixteen have arrived yet.
                    Ok(stream) => drop(stream),
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the unfinished requests hold every place");
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        assert!(refused.message().contains("--max-streams"), "{refused:?}");
        // Their streams reset: the places are free again.
        for request in &unfinished {
            request.abort();
        }
        let served = tokio::time::timeout(WAIT, async {
            loop {
                if let Ok(answer) = SpiffeWorkloadApiClient::new(channel.clone())
                    .fetch_x509svid(with_header(X509svidRequest {}))
                    .await
                {
                    return answer.into_inner().message().await;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("served once the places are free");
        assert!(served.unwrap().is_some());
    }

    #[test]
    fn the_connection_cap_leaves_room_for_the_agents_own_files() {
        assert_eq!(connection_cap(4096, Some(1024)), 1024 - FD_RESERVE as usize);
        assert_eq!(connection_cap(4096, Some(1 << 20)), 4096);
        assert_eq!(connection_cap(4096, None), 4096);
        assert_eq!(connection_cap(4096, Some(10)), 1, "at least one");
        assert_eq!(connection_cap(0, Some(1024)), 1);
    }

    /// A CRL whose nextUpdate passes while its file stays the same is
    /// withdrawn (and one already stale is never served).
    #[tokio::test]
    async fn a_crl_past_its_next_update_is_withdrawn() {
        use meshca_certs::crl::{encode_crl_pem, sign_crl, CrlTimes};
        use meshca_certs::keys::{KeyAlgorithm, PrivateKey};
        use meshca_certs::profile::{self_signed_root, SubjectName, Validity};
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let name = SubjectName {
            common_name: Some("Root CA".into()),
            ..Default::default()
        };
        let now = OffsetDateTime::now_utc().replace_nanosecond(0).unwrap();
        let root = self_signed_root(
            &key,
            &name,
            Validity::backdated(now, time::Duration::days(1)),
        )
        .unwrap();
        let crl = |next_update| {
            let times = CrlTimes {
                number: 1,
                this_update: now - time::Duration::minutes(1),
                next_update,
            };
            encode_crl_pem(&sign_crl(&root.der, key.key_pair(), &[], times).unwrap())
        };
        let dir = tempfile::tempdir().unwrap();
        let stale = dir.path().join("stale.pem");
        std::fs::write(&stale, crl(now - time::Duration::seconds(1))).unwrap();
        let watched = watch_crl_file(stale, Duration::from_millis(50));
        assert!(watched.borrow().is_none(), "a stale CRL is not served");

        let soon = dir.path().join("soon.pem");
        std::fs::write(&soon, crl(now + time::Duration::seconds(2))).unwrap();
        let mut watched = watch_crl_file(soon, Duration::from_millis(50));
        assert!(watched.borrow().is_some());
        tokio::time::timeout(Duration::from_secs(10), watched.wait_for(Option::is_none))
            .await
            .expect("withdrawn within 10 s")
            .unwrap();
    }
}
