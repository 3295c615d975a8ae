//! The accept loop: takes TCP connections off the gRPC port, places each
//! on the event loop with the fewest open connections, completes its TLS
//! handshake there (bounded in time) and hands the established connection
//! to that loop's gRPC server.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

use super::batched_io::BatchedWriteStream;
use crate::metrics::Metrics;

/// Time allowed for a TLS handshake.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
pub(crate) type TlsConnection = TlsStream<BatchedWriteStream<TcpStream, ConnectionSeat>>;

/// How many connections each event loop holds, to place a new one on the
/// loop with the fewest. Dealing in turn would drift after churn: agents
/// that reconnect after a restart can leave one loop with most of the
/// long-lived connections.
#[derive(Debug)]
pub(crate) struct LoopOccupancy {
    open: Box<[AtomicUsize]>,
    /// All loops together, as exported (`meshca_grpc_connections`).
    total: Gauge<i64>,
}

impl LoopOccupancy {
    /// No connections yet on any of `loops` loops (at least one); `total`
    /// follows the sum over the loops.
    pub(crate) fn new(loops: usize, total: Gauge<i64>) -> Arc<Self> {
        Arc::new(Self {
            open: (0..loops.max(1)).map(|_| AtomicUsize::new(0)).collect(),
            total,
        })
    }

    /// Takes a seat on the loop with the fewest open connections; among
    /// equals the first at or after `start` (the caller rotates it, so
    /// loops with equal counts take turns). The seat is given back when
    /// the returned value is dropped.
    pub(crate) fn seat(self: &Arc<Self>, start: usize) -> ConnectionSeat {
        let n = self.open.len();
        let index = (0..n)
            .map(|k| (start.wrapping_add(k)) % n)
            .min_by_key(|&i| self.open[i].load(Ordering::Relaxed))
            .unwrap_or(0);
        self.open[index].fetch_add(1, Ordering::Relaxed);
        self.total.inc();
        ConnectionSeat {
            occupancy: self.clone(),
            index,
        }
    }

    /// Open connections on loop `index` (0 for a loop that does not exist).
    #[cfg(test)]
    pub(crate) fn open_on(&self, index: usize) -> usize {
        self.open
            .get(index)
            .map_or(0, |open| open.load(Ordering::Relaxed))
    }
}

/// One connection's place on a loop; counted until dropped.
#[derive(Debug)]
pub(crate) struct ConnectionSeat {
    occupancy: Arc<LoopOccupancy>,
    index: usize,
}

impl ConnectionSeat {
    /// The loop this connection runs on.
    pub(crate) fn loop_index(&self) -> usize {
        self.index
    }
}

impl Drop for ConnectionSeat {
    fn drop(&mut self) {
        self.occupancy.open[self.index].fetch_sub(1, Ordering::Relaxed);
        self.occupancy.total.dec();
    }
}

/// Accepts TCP connections on `listener` and places each on the loop of
/// `loops` that holds the fewest open connections ([`LoopOccupancy`]):
/// its TLS handshake (bounded by [`HANDSHAKE_TIMEOUT`]) and then its whole
/// life run there. Returns one stream of established connections per loop.
/// Stops when every stream is dropped.
pub(crate) fn tls_incoming(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    loops: &[tokio::runtime::Handle],
    metrics: &Metrics,
) -> Vec<ReceiverStream<Result<TlsConnection, io::Error>>> {
    let (senders, receivers): (Vec<_>, Vec<_>) = loops.iter().map(|_| mpsc::channel(128)).unzip();
    let loops = loops.to_vec();
    let occupancy = LoopOccupancy::new(loops.len(), metrics.grpc_connections.clone());
    let handshake_failures = metrics.tls_handshake_failures.clone();
    tokio::spawn(async move {
        let all_closed = futures::future::join_all(senders.iter().map(|tx| tx.closed()));
        tokio::pin!(all_closed);
        let mut next = 0usize;
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = &mut all_closed => return,
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
            let _ = tcp.set_nodelay(true);
            let seat = occupancy.seat(next);
            next = next.wrapping_add(1);
            let index = seat.loop_index();
            let acceptor = acceptor.clone();
            let handshake_failures = handshake_failures.clone();
            let tx = senders[index].clone();
            // The socket is registered with the reactor of the loop that
            // polls it first: move it there as a std socket.
            let tcp = match tcp.into_std() {
                Ok(tcp) => tcp,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "handing the connection to an event loop failed");
                    continue;
                }
            };
            loops[index].spawn(async move {
                let tcp = match TcpStream::from_std(tcp) {
                    Ok(tcp) => tcp,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "registering the connection failed");
                        return;
                    }
                };
                match tokio::time::timeout(
                    HANDSHAKE_TIMEOUT,
                    acceptor.accept(BatchedWriteStream::with_guard(tcp, seat)),
                )
                .await
                {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => {
                        handshake_failures.inc();
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    }
                    Err(_) => {
                        handshake_failures.inc();
                        tracing::debug!(%peer, "TLS handshake timed out");
                    }
                }
            });
        }
    });
    receivers.into_iter().map(ReceiverStream::new).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_goes_to_the_loop_with_the_fewest() {
        let total = Gauge::<i64>::default();
        let occupancy = LoopOccupancy::new(2, total.clone());
        let first: Vec<_> = (0..4).map(|k| occupancy.seat(k)).collect();
        // Equal counts: the loops take turns.
        let placed: Vec<_> = first.iter().map(ConnectionSeat::loop_index).collect();
        assert_eq!(placed, [0, 1, 0, 1]);
        assert_eq!((occupancy.open_on(0), occupancy.open_on(1)), (2, 2));
        assert_eq!(total.get(), 4, "the exported gauge is the sum");

        // Both connections of loop 0 close: the next two go there, whatever
        // the rotation says.
        let mut first = first.into_iter();
        let (a, b, c, d) = (first.next(), first.next(), first.next(), first.next());
        drop((a, c));
        assert_eq!((occupancy.open_on(0), occupancy.open_on(1)), (0, 2));
        let e = occupancy.seat(5);
        let f = occupancy.seat(7);
        assert_eq!((e.loop_index(), f.loop_index()), (0, 0));
        assert_eq!((occupancy.open_on(0), occupancy.open_on(1)), (2, 2));
        assert_eq!(total.get(), 4);
        drop((b, d, e, f));
        assert_eq!((occupancy.open_on(0), occupancy.open_on(1)), (0, 0));
        assert_eq!(total.get(), 0);
        assert_eq!(occupancy.open_on(2), 0);
    }

    #[tokio::test]
    async fn a_connection_frees_its_seat_when_dropped() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let occupancy = LoopOccupancy::new(3, Gauge::default());
        let (near, mut far) = tokio::io::duplex(64);
        let seat = occupancy.seat(1);
        assert_eq!(seat.loop_index(), 1);
        let mut stream = BatchedWriteStream::with_guard(near, seat);
        stream.write_all(b"ping").await.unwrap();
        stream.flush().await.unwrap();
        let mut got = [0u8; 4];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        far.write_all(b"pong").await.unwrap();
        stream.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
        assert_eq!(occupancy.open_on(1), 1);
        drop(stream);
        assert_eq!(occupancy.open_on(1), 0);
    }
}
