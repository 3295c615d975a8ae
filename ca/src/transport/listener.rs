//! The accept loop: takes TCP connections off the gRPC port (at most
//! `--max-connections` open), completes each TLS handshake in a task of its
//! own (bounded in time) and hands the established connection to the gRPC
//! server.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

use crate::metrics::Metrics;

/// Connections the kernel may hold completed but not yet accepted on the
/// gRPC port. When thousands of sidecars restart at once their connects
/// arrive faster than one accept loop takes them off the queue; tokio's
/// default of 1,024 then drops SYNs, and every dropped client waits a
/// second before its TCP retry. The kernel caps the value at
/// `net.core.somaxconn` (4,096 by default since Linux 5.4; Go, and so
/// istiod, listens with that value too).
pub(crate) const LISTEN_BACKLOG: u32 = 4096;

/// Binds a listening TCP socket with `backlog` (and `SO_REUSEADDR`, as
/// tokio's `TcpListener::bind` sets it, so a restarted server binds at once).
pub(crate) fn bind_with_backlog(addr: SocketAddr, backlog: u32) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// An established connection, as the gRPC server gets it.
pub(crate) type TlsConnection = TlsStream<Guarded<TcpStream, ConnectionLife>>;

/// What a connection holds for as long as it lives: its seat among the
/// open connections, and the sender whose drop tells [`Accepted::closed`]
/// it is gone.
#[derive(Debug)]
pub(crate) struct ConnectionLife {
    _seat: ConnectionSeat,
    _closed: oneshot::Sender<()>,
}

/// A stream that holds `G` until it is dropped; reads and writes go
/// straight through.
#[derive(Debug)]
pub(crate) struct Guarded<S, G> {
    inner: S,
    _guard: G,
}

impl<S, G> Guarded<S, G> {
    /// Wraps `inner`, holding `guard` until the stream is dropped.
    pub(crate) fn new(inner: S, guard: G) -> Self {
        Self {
            inner,
            _guard: guard,
        }
    }
}

impl<S: tonic::transport::server::Connected, G> tonic::transport::server::Connected
    for Guarded<S, G>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncRead + Unpin, G: Unpin> AsyncRead for Guarded<S, G> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin, G: Unpin> AsyncWrite for Guarded<S, G> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A connection whose TLS handshake has completed.
#[derive(Debug)]
pub(crate) struct Accepted {
    /// The connection.
    pub(crate) stream: TlsConnection,
    /// Completes (with an error) once the connection has been dropped.
    pub(crate) closed: oneshot::Receiver<()>,
}

/// The accept loop's limits (README, "Flags").
#[derive(Debug, Clone, Copy)]
pub(crate) struct AcceptLimits {
    /// Connections open at once (in their handshake or established);
    /// beyond it a new one is closed at once.
    pub(crate) max_connections: usize,
    /// Time allowed for a TLS handshake.
    pub(crate) handshake_timeout: Duration,
}

/// How many connections are open (in their handshake or established),
/// exported as `meshca_grpc_connections`.
#[derive(Debug)]
pub(crate) struct OpenConnections {
    open: AtomicUsize,
    exported: Gauge<i64>,
}

impl OpenConnections {
    /// None open yet; `exported` follows the count.
    pub(crate) fn new(exported: Gauge<i64>) -> Arc<Self> {
        Arc::new(Self {
            open: AtomicUsize::new(0),
            exported,
        })
    }

    /// Counts one more connection until the returned seat is dropped.
    pub(crate) fn seat(self: &Arc<Self>) -> ConnectionSeat {
        self.open.fetch_add(1, Ordering::Relaxed);
        self.exported.inc();
        ConnectionSeat {
            connections: self.clone(),
        }
    }

    /// Connections open now.
    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }
}

/// One open connection's place in [`OpenConnections`]; counted until dropped.
#[derive(Debug)]
pub(crate) struct ConnectionSeat {
    connections: Arc<OpenConnections>,
}

impl Drop for ConnectionSeat {
    fn drop(&mut self) {
        self.connections.open.fetch_sub(1, Ordering::Relaxed);
        self.connections.exported.dec();
    }
}

/// Accepts TCP connections on `listener` and runs each one's TLS handshake
/// (bounded by `limits.handshake_timeout`) in a task of its own. With
/// `limits.max_connections` open, a new connection is closed as soon as it
/// is accepted. Returns the stream of established connections. Stops when
/// that stream is dropped.
pub(crate) fn tls_incoming(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    limits: AcceptLimits,
    metrics: &Metrics,
) -> ReceiverStream<Accepted> {
    let (tx, rx) = mpsc::channel(128);
    let connections = OpenConnections::new(metrics.grpc_connections.clone());
    let handshake_failures = metrics.tls_handshake_failures.clone();
    let handshake_timeouts = metrics.tls_handshake_timeouts.clone();
    let refused = metrics.grpc_connections_refused.clone();
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: back off briefly.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            // Seats are taken only here, so the count cannot grow between
            // the check and the seat.
            if connections.open() >= limits.max_connections {
                refused.inc();
                tracing::debug!(%peer, max_connections = limits.max_connections, "connection refused: too many open");
                drop(tcp);
                continue;
            }
            let _ = tcp.set_nodelay(true);
            let (closed_tx, closed) = oneshot::channel();
            let life = ConnectionLife {
                _seat: connections.seat(),
                _closed: closed_tx,
            };
            let acceptor = acceptor.clone();
            let handshake_failures = handshake_failures.clone();
            let handshake_timeouts = handshake_timeouts.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(
                    limits.handshake_timeout,
                    acceptor.accept(Guarded::new(tcp, life)),
                )
                .await
                {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Accepted { stream, closed }).await;
                    }
                    Ok(Err(e)) => {
                        handshake_failures.inc();
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    }
                    Err(_) => {
                        handshake_failures.inc();
                        handshake_timeouts.inc();
                        tracing::debug!(%peer, "TLS handshake timed out");
                    }
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connection_is_counted_until_it_is_dropped() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let exported = Gauge::<i64>::default();
        let connections = OpenConnections::new(exported.clone());
        let (near, mut far) = tokio::io::duplex(64);
        let mut stream = Guarded::new(near, connections.seat());
        let other = connections.seat();
        assert_eq!((connections.open(), exported.get()), (2, 2));
        stream.write_all(b"ping").await.unwrap();
        stream.flush().await.unwrap();
        let mut got = [0u8; 4];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        far.write_all(b"pong").await.unwrap();
        stream.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
        drop(stream);
        assert_eq!((connections.open(), exported.get()), (1, 1));
        drop(other);
        assert_eq!((connections.open(), exported.get()), (0, 0));
    }
}
