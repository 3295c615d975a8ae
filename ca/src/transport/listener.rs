//! The accept loop: takes TCP connections off the gRPC port (at most
//! `--max-connections` open; at the cap a new one takes the seat of an
//! idle one, waits a moment for a seat, or is closed; at most
//! `--max-connections-per-source` from one source address, beyond which a
//! new one takes the seat of one of that source's connections that has
//! made no authenticated request, or is closed), completes each TLS
//! handshake in a task of its own (bounded in time) and hands the
//! established connection to the gRPC server.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::task::AtomicWaker;
use meshca_serve::rate_limited_log::RateLimitedLog;
use meshca_serve::stream_activity::StreamActivity;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

use crate::metrics::{IstioCounter, Metrics};

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

/// Connections asked to go away to make room that may be closing at once;
/// while this many are, a new connection at the cap is not given a seat by
/// eviction. An idle connection closes as soon as its GOAWAY is written,
/// so the open count exceeds `--max-connections` by at most this, briefly.
pub(crate) const MAX_EVICTIONS_IN_FLIGHT: usize = 16;

/// How long a new connection accepted while `--max-connections` are open
/// (and none can be evicted) waits for a seat before it is closed. While
/// it waits, the accept loop takes no other connection: the next ones
/// wait in the kernel's listen queue, which costs the server nothing, and
/// are taken in the order they came as seats free. Long enough that in a
/// storm of restarting sidecars (each connection a handshake and a
/// request) a seat frees before it runs out, so nobody is sent away to
/// back off (docs/benchmarks-history.md, "A connection per sidecar"); short enough
/// that a client beyond a cap held by others learns it well within a
/// client's connect timeout, and the ones after it at once.
pub(crate) const SEAT_WAIT: Duration = Duration::from_secs(2);

/// While a newcomer waits for a seat, how often it tries again to make
/// room (a handshake may have stalled, a connection gone idle, meanwhile).
const MAKE_ROOM_RETRY: Duration = Duration::from_millis(100);

/// At the cap, a connection whose TLS handshake has waited this long for
/// the client (its last read found nothing, and nothing came since) gives
/// its seat to a newcomer (it is cut off). A client that connected and
/// sends nothing is such a one; without this a few hundred raw TCP
/// connections, each reopened when `--tls-handshake-timeout` closes it,
/// would hold every seat. A handshake waiting for the server (in a storm,
/// its task not run yet) is not cut off: its client did nothing wrong.
pub(crate) const STALLED_HANDSHAKE: Duration = Duration::from_secs(2);

/// At `--max-connections-per-source`, an established connection of that
/// source that has made no authenticated request this long after its
/// handshake gives its seat to the source's newcomer (GOAWAY). A client
/// sends its first request right after its handshake; the wait keeps a
/// storm of honest clients behind one address (a NAT) from evicting each
/// other's fresh connections, and paces an attacker's churn.
pub(crate) const FIRST_REQUEST_GRACE: Duration = Duration::from_secs(2);

/// What a connection holds for as long as it lives: its seat among the
/// open connections, and the sender whose drop tells [`Accepted::closed`]
/// it is gone.
#[derive(Debug)]
pub(crate) struct ConnectionLife {
    _seat: ConnectionSeat,
    _closed: oneshot::Sender<()>,
}

/// Ends a connection from outside its task: once killed, its stream's
/// reads and writes fail, so whoever serves it lets it go at once (a
/// client that ignores a GOAWAY, or never started HTTP/2, is not waited
/// for).
#[derive(Debug, Default)]
pub(crate) struct KillSwitch {
    killed: AtomicBool,
    reader: AtomicWaker,
}

impl KillSwitch {
    /// Fails the stream's next read and write, and wakes a read waiting.
    pub(crate) fn kill(&self) {
        self.killed.store(true, Ordering::Release);
        self.reader.wake();
    }

    fn check(&self) -> io::Result<()> {
        if self.killed.load(Ordering::Acquire) {
            Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the connection was told to go away and did not",
            ))
        } else {
            Ok(())
        }
    }
}

/// A stream that holds `G` until it is dropped, and ends when its
/// [`KillSwitch`] is used; otherwise reads and writes go straight through.
#[derive(Debug)]
pub(crate) struct Guarded<S, G> {
    inner: S,
    state: Arc<ConnectionState>,
    _guard: G,
}

impl<S, G> Guarded<S, G> {
    /// Wraps `inner`, holding `guard` until the stream is dropped; its
    /// reads tell `state` when they wait for the peer, and `state`'s
    /// kill switch ends it.
    pub(crate) fn new(inner: S, guard: G, state: Arc<ConnectionState>) -> Self {
        Self {
            inner,
            state,
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
        let this = self.get_mut();
        let kill = &this.state.kill;
        kill.reader.register(cx.waker());
        kill.check()?;
        let filled = buf.filled().len();
        let read = Pin::new(&mut this.inner).poll_read(cx, buf);
        match &read {
            Poll::Pending => this.state.peer_wait.started(),
            Poll::Ready(Ok(())) if buf.filled().len() > filled => this.state.peer_wait.ended(),
            Poll::Ready(_) => {}
        }
        read
    }
}

impl<S: AsyncWrite + Unpin, G: Unpin> AsyncWrite for Guarded<S, G> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.state.kill.check()?;
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.state.kill.check()?;
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
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
    /// Its open streams, and the request to go away when it is evicted.
    pub(crate) state: Arc<ConnectionState>,
    /// Completes (with an error) once the connection has been dropped.
    pub(crate) closed: oneshot::Receiver<()>,
}

/// The accept loop's limits (docs/flags.md, "`meshca serve` flags").
#[derive(Debug, Clone, Copy)]
pub(crate) struct AcceptLimits {
    /// Connections open at once (in their handshake or established).
    pub(crate) max_connections: usize,
    /// At the cap, a connection idle at least this long may be asked to
    /// go away for a new one (`None`: never).
    pub(crate) evict_idle_after: Option<Duration>,
    /// Time allowed for a TLS handshake.
    pub(crate) handshake_timeout: Duration,
    /// Connections open at once from one source address (`None`: no bound).
    pub(crate) max_connections_per_source: Option<usize>,
}

/// What the accept loop and the gRPC server share about one connection.
#[derive(Debug, Default)]
pub(crate) struct ConnectionState {
    /// Its open streams, and since when it has had none.
    pub(crate) activity: Arc<StreamActivity>,
    /// Its TLS handshake has completed.
    established: AtomicBool,
    /// When its TLS handshake completed.
    established_at: OnceLock<tokio::time::Instant>,
    /// It has made a request that authenticated.
    authenticated: AtomicBool,
    /// It was chosen to make room; its seat counts as leaving.
    evicted: AtomicBool,
    /// Woken once when it is evicted: the server sends it a GOAWAY.
    pub(crate) evict: Notify,
    /// Ends its stream when it does not go away when told.
    pub(crate) kill: Arc<KillSwitch>,
    /// Whether, and since when, its reads wait for the peer.
    peer_wait: PeerWait,
}

/// Since when a connection's reads have been waiting for its peer (the
/// last read found nothing to read, and none has returned bytes since).
/// A handshake that waits so is the client's doing; one whose task has
/// not been run yet, in a storm, is the server's.
#[derive(Debug)]
struct PeerWait {
    /// Milliseconds after `base` when the wait started; [`NOT_WAITING`]
    /// when the last read returned bytes, or none was tried yet.
    since: AtomicU64,
    base: tokio::time::Instant,
}

/// [`PeerWait::since`] when nothing is waited for.
const NOT_WAITING: u64 = u64::MAX;

impl Default for PeerWait {
    fn default() -> Self {
        Self {
            since: AtomicU64::new(NOT_WAITING),
            base: tokio::time::Instant::now(),
        }
    }
}

impl PeerWait {
    /// A read found nothing: the wait starts now, unless it already has.
    fn started(&self) {
        if self.since.load(Ordering::Relaxed) == NOT_WAITING {
            let millis = tokio::time::Instant::now().saturating_duration_since(self.base);
            let millis = u64::try_from(millis.as_millis()).unwrap_or(NOT_WAITING - 1);
            self.since.store(millis, Ordering::Release);
        }
    }

    /// A read returned bytes.
    fn ended(&self) {
        if self.since.load(Ordering::Relaxed) != NOT_WAITING {
            self.since.store(NOT_WAITING, Ordering::Release);
        }
    }

    /// Since when the reads have been waiting, if they are.
    fn since(&self) -> Option<tokio::time::Instant> {
        match self.since.load(Ordering::Acquire) {
            NOT_WAITING => None,
            millis => Some(self.base + Duration::from_millis(millis)),
        }
    }
}

impl ConnectionState {
    /// Its handshake has completed: idle from now until its first stream.
    pub(crate) fn set_established(&self) {
        self.activity.mark_idle_from_now();
        let _ = self.established_at.set(tokio::time::Instant::now());
        self.established.store(true, Ordering::Release);
    }

    /// A request on it has authenticated (the caller gate says so): from
    /// now on it is evicted only after those that have not.
    pub(crate) fn set_authenticated(&self) {
        if !self.authenticated.load(Ordering::Relaxed) {
            self.authenticated.store(true, Ordering::Release);
        }
    }

    /// Whether a request on it has authenticated.
    #[cfg(test)]
    pub(crate) fn is_authenticated(&self) -> bool {
        self.authenticated.load(Ordering::Acquire)
    }

    /// Since when it has been established without an authenticated
    /// request, if it has and is not evicted.
    fn unauthenticated_since(&self) -> Option<tokio::time::Instant> {
        if self.authenticated.load(Ordering::Acquire) || self.evicted.load(Ordering::Acquire) {
            return None;
        }
        self.established_at.get().copied()
    }

    /// Since when it has been idle, if it has made no authenticated request.
    fn unauthenticated_idle_since(&self) -> Option<tokio::time::Instant> {
        self.unauthenticated_since().and(self.idle_since())
    }

    /// Since when its TLS handshake has been waiting for the client, if
    /// it is in its handshake, waiting, and not evicted. A handshake the
    /// server has not got round to (a storm) is not waiting.
    fn handshake_waiting_since(&self) -> Option<tokio::time::Instant> {
        if self.established.load(Ordering::Acquire) || self.evicted.load(Ordering::Acquire) {
            return None;
        }
        self.peer_wait.since()
    }

    /// Since when it has been established and without an open stream.
    fn idle_since(&self) -> Option<tokio::time::Instant> {
        if !self.established.load(Ordering::Acquire) || self.evicted.load(Ordering::Acquire) {
            return None;
        }
        self.activity.idle_since()
    }
}

/// The open connections (in their handshake or established), exported as
/// `meshca_grpc_connections`, and which of them could make room.
#[derive(Debug)]
pub(crate) struct OpenConnections {
    open: AtomicUsize,
    /// Seats of evicted connections that have not closed yet.
    leaving: AtomicUsize,
    exported: Gauge<i64>,
    /// Every open connection, and the count of each source.
    states: Mutex<Seats>,
    next_seat: AtomicU64,
    /// Woken when a seat is given back.
    seat_freed: Notify,
}

impl OpenConnections {
    /// None open yet; `exported` follows the count.
    pub(crate) fn new(exported: Gauge<i64>) -> Arc<Self> {
        Arc::new(Self {
            open: AtomicUsize::new(0),
            leaving: AtomicUsize::new(0),
            exported,
            states: Mutex::new(Seats::default()),
            next_seat: AtomicU64::new(0),
            seat_freed: Notify::new(),
        })
    }

    /// Counts one more connection, from `source`, until the returned seat
    /// is dropped.
    pub(crate) fn seat(self: &Arc<Self>, source: IpAddr) -> ConnectionSeat {
        let number = self.next_seat.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnectionState::default());
        {
            let mut seats = self.lock_states();
            seats.by_number.insert(number, (source, state.clone()));
            seats.by_source.entry(source).or_default().open += 1;
        }
        self.open.fetch_add(1, Ordering::AcqRel);
        self.exported.inc();
        ConnectionSeat {
            connections: self.clone(),
            number,
            state,
        }
    }

    /// Whether `max` seats are taken by connections from `source` that
    /// are not leaving.
    fn source_full(&self, source: IpAddr, max: usize) -> bool {
        self.lock_states()
            .by_source
            .get(&source)
            .is_some_and(|s| s.open.saturating_sub(s.leaving) >= max)
    }

    /// Connections open now (those leaving included).
    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Whether `max` seats are taken by connections that are not leaving.
    fn full(&self, max: usize) -> bool {
        self.open()
            .saturating_sub(self.leaving.load(Ordering::Acquire))
            >= max
    }

    /// Makes room for a newcomer at the cap (of all connections, or with
    /// `source` of that source's): cuts off the connection (of `source`)
    /// in its TLS handshake longest, if for at least [`STALLED_HANDSHAKE`];
    /// failing that, asks one to go away: with `source`, the one of that
    /// source established longest without an authenticated request, if
    /// for at least [`FIRST_REQUEST_GRACE`]; then the one idle longest, if
    /// for at least `min_idle` (`None`: never), of those without an
    /// authenticated request first. Its seat then counts as free. `None`
    /// when none exists, or [`MAX_EVICTIONS_IN_FLIGHT`] are leaving.
    fn make_room(&self, min_idle: Option<Duration>, source: Option<IpAddr>) -> Option<Evicted> {
        if self.leaving.load(Ordering::Acquire) >= MAX_EVICTIONS_IN_FLIGHT {
            return None;
        }
        let now = tokio::time::Instant::now();
        let mut seats = self.lock_states();
        let oldest = |since: fn(&ConnectionState) -> Option<tokio::time::Instant>,
                      min: Duration| {
            // The earliest; between equals, the seat given first.
            seats
                .by_number
                .iter()
                .filter(|(_, (from, _))| source.is_none_or(|source| *from == source))
                .filter_map(|(seat, (from, state))| {
                    since(state).map(|since| (since, *seat, *from, state.clone()))
                })
                .filter(|(since, _, _, _)| now.saturating_duration_since(*since) >= min)
                .min_by_key(|(since, seat, _, _)| (*since, *seat))
                .map(|(_, _, from, state)| (from, state))
        };
        let ((from, state), evicted) = if let Some(found) =
            oldest(ConnectionState::handshake_waiting_since, STALLED_HANDSHAKE)
        {
            (found, Evicted::StalledHandshake)
        } else if let Some(found) = source.and(oldest(
            ConnectionState::unauthenticated_since,
            FIRST_REQUEST_GRACE,
        )) {
            (found, Evicted::Unauthenticated)
        } else if let Some(found) =
            min_idle.and_then(|min| oldest(ConnectionState::unauthenticated_idle_since, min))
        {
            (found, Evicted::Unauthenticated)
        } else if let Some(found) =
            min_idle.and_then(|min| oldest(ConnectionState::idle_since, min))
        {
            (found, Evicted::Idle)
        } else {
            return None;
        };
        state.evicted.store(true, Ordering::Release);
        self.leaving.fetch_add(1, Ordering::AcqRel);
        if let Some(counts) = seats.by_source.get_mut(&from) {
            counts.leaving += 1;
        }
        drop(seats);
        match evicted {
            // No HTTP/2 yet to say GOAWAY with: its handshake fails now.
            Evicted::StalledHandshake => state.kill.kill(),
            Evicted::Idle | Evicted::Unauthenticated => state.evict.notify_one(),
        }
        Some(evicted)
    }

    /// Finds a newcomer a seat at the cap within `wait`: one freed, or
    /// one [`Self::make_room`] makes (tried again every
    /// [`MAKE_ROOM_RETRY`], as handshakes stall and connections idle while
    /// it waits). `None` when the wait ran out.
    async fn find_seat(
        &self,
        max: usize,
        min_idle: Option<Duration>,
        wait: Duration,
    ) -> Option<Seated> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let freed = self.seat_freed.notified();
            if !self.full(max) {
                return Some(Seated::Freed);
            }
            if let Some(evicted) = self.make_room(min_idle, None) {
                return Some(Seated::MadeRoom(evicted));
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return None;
            }
            let _ = tokio::time::timeout_at(deadline.min(now + MAKE_ROOM_RETRY), freed).await;
        }
    }

    /// Source addresses with a connection open.
    #[cfg(test)]
    fn sources(&self) -> usize {
        self.lock_states().by_source.len()
    }

    fn lock_states(&self) -> std::sync::MutexGuard<'_, Seats> {
        // A panic elsewhere while holding the lock leaves the map whole.
        self.states
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Every open connection, by the number its seat was given, with its
/// source address; and how many each source has open, an entry only
/// while it has one (so at most one per open connection).
#[derive(Debug, Default)]
struct Seats {
    by_number: HashMap<u64, (IpAddr, Arc<ConnectionState>)>,
    by_source: HashMap<IpAddr, SourceSeats>,
}

/// One source's open connections, and of those the evicted ones.
#[derive(Debug, Default, Clone, Copy)]
struct SourceSeats {
    open: usize,
    leaving: usize,
}

/// How a newcomer at the cap found its seat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seated {
    /// A connection closed.
    Freed,
    /// A connection was made to leave.
    MadeRoom(Evicted),
}

/// Which connection [`OpenConnections::make_room`] took the seat of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Evicted {
    /// One in its TLS handshake for [`STALLED_HANDSHAKE`] or longer: cut off.
    StalledHandshake,
    /// One idle long enough: told to go away (GOAWAY).
    Idle,
    /// One that has made no authenticated request, idle long enough or
    /// (at its source's cap) established [`FIRST_REQUEST_GRACE`] ago:
    /// told to go away (GOAWAY).
    Unauthenticated,
}

/// One open connection's place in [`OpenConnections`]; counted until dropped.
#[derive(Debug)]
pub(crate) struct ConnectionSeat {
    connections: Arc<OpenConnections>,
    number: u64,
    state: Arc<ConnectionState>,
}

impl ConnectionSeat {
    /// The connection's state, shared with the gRPC server.
    pub(crate) fn state(&self) -> &Arc<ConnectionState> {
        &self.state
    }
}

impl Drop for ConnectionSeat {
    fn drop(&mut self) {
        let connections = &self.connections;
        let evicted = self.state.evicted.load(Ordering::Acquire);
        {
            let mut seats = connections.lock_states();
            if let Some((source, _)) = seats.by_number.remove(&self.number) {
                if let std::collections::hash_map::Entry::Occupied(mut counts) =
                    seats.by_source.entry(source)
                {
                    let counts_now = counts.get_mut();
                    counts_now.open = counts_now.open.saturating_sub(1);
                    if evicted {
                        counts_now.leaving = counts_now.leaving.saturating_sub(1);
                    }
                    if counts_now.open == 0 {
                        counts.remove();
                    }
                }
            }
        }
        if evicted {
            connections.leaving.fetch_sub(1, Ordering::AcqRel);
        }
        connections.open.fetch_sub(1, Ordering::AcqRel);
        connections.exported.dec();
        connections.seat_freed.notify_one();
    }
}

/// What the accept loop counts.
#[derive(Debug, Clone)]
struct AcceptCounters {
    handshake_failures: IstioCounter,
    handshake_timeouts: IstioCounter,
    refused: IstioCounter,
    refused_per_source: IstioCounter,
    stalled_handshakes: IstioCounter,
}

/// Accepts TCP connections on `listener` and runs each one's TLS handshake
/// (bounded by `limits.handshake_timeout`) in a task of its own. With
/// `limits.max_connections` open, a new connection evicts the connection
/// idle longest (if idle at least `limits.evict_idle_after`), or waits up
/// to [`SEAT_WAIT`] for a seat (freed, or made by a handshake stalling or
/// a connection going idle meanwhile), or else is closed as soon as it is
/// accepted; once one has been closed so, the next ones are too, without
/// waiting, until a seat frees. With `limits.max_connections_per_source`
/// open from its source address, a new connection first takes the seat of
/// one of that source's (a stalled handshake, one without an authenticated
/// request, one idle), or else is closed at once (no wait: one source's
/// cap never holds up the others). Returns the stream of established
/// connections. Stops when that stream is dropped.
pub(crate) fn tls_incoming(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    limits: AcceptLimits,
    metrics: &Metrics,
) -> ReceiverStream<Accepted> {
    let (tx, rx) = mpsc::channel(128);
    let connections = OpenConnections::new(metrics.grpc_connections.clone());
    let counters = AcceptCounters {
        handshake_failures: metrics.tls_handshake_failures.clone(),
        handshake_timeouts: metrics.tls_handshake_timeouts.clone(),
        refused: metrics.grpc_connections_refused.clone(),
        refused_per_source: metrics.grpc_connections_refused_per_source.clone(),
        stalled_handshakes: metrics.grpc_stalled_handshakes_cut.clone(),
    };
    let refusals_per_source = RateLimitedLog::default();
    tokio::spawn(async move {
        // Set once a connection was closed for want of a seat; cleared
        // when a seat is given. While set, nobody waits for a seat.
        let mut refusing = false;
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
            // An IPv4 client of an IPv6 socket is its IPv4 address.
            let source = peer.ip().to_canonical();
            // Seats are taken only here, so the counts cannot grow between
            // the checks and the seat.
            if let Some(max) = limits.max_connections_per_source {
                if connections.source_full(source, max) {
                    match connections.make_room(limits.evict_idle_after, Some(source)) {
                        Some(Evicted::StalledHandshake) => counters.stalled_handshakes.inc(),
                        // Counted by the gRPC server when it sends the GOAWAY.
                        Some(Evicted::Idle | Evicted::Unauthenticated) => {}
                        None => {
                            counters.refused_per_source.inc();
                            if let Some(unlogged) = refusals_per_source.record() {
                                tracing::info!(%source, max_connections_per_source = max, unlogged, "connection refused: too many open from its source address");
                            }
                            drop(tcp);
                            continue;
                        }
                    }
                }
            }
            if connections.full(limits.max_connections) {
                // While refusing, only room made at once counts: a cap
                // held by others is answered without a wait.
                let wait = if refusing { Duration::ZERO } else { SEAT_WAIT };
                let seated = connections
                    .find_seat(limits.max_connections, limits.evict_idle_after, wait)
                    .await;
                match seated {
                    Some(Seated::MadeRoom(Evicted::StalledHandshake)) => {
                        counters.stalled_handshakes.inc()
                    }
                    // Counted by the gRPC server when it sends the GOAWAY.
                    Some(
                        Seated::MadeRoom(Evicted::Idle | Evicted::Unauthenticated) | Seated::Freed,
                    ) => {}
                    None => {
                        refusing = true;
                        counters.refused.inc();
                        tracing::debug!(%peer, max_connections = limits.max_connections, "connection refused: too many open");
                        drop(tcp);
                        continue;
                    }
                }
            }
            refusing = false;
            let _ = tcp.set_nodelay(true);
            let (closed_tx, closed) = oneshot::channel();
            let seat = connections.seat(source);
            let state = seat.state().clone();
            let life = ConnectionLife {
                _seat: seat,
                _closed: closed_tx,
            };
            tokio::spawn(handshake(
                tcp,
                peer,
                life,
                state,
                closed,
                acceptor.clone(),
                limits.handshake_timeout,
                counters.clone(),
                tx.clone(),
            ));
        }
    });
    ReceiverStream::new(rx)
}

/// Runs one connection's TLS handshake, bounded by `timeout`, and hands
/// the established connection to the gRPC server.
#[allow(clippy::too_many_arguments)]
async fn handshake(
    tcp: TcpStream,
    peer: SocketAddr,
    life: ConnectionLife,
    state: Arc<ConnectionState>,
    closed: oneshot::Receiver<()>,
    acceptor: TlsAcceptor,
    timeout: Duration,
    counters: AcceptCounters,
    established: mpsc::Sender<Accepted>,
) {
    match tokio::time::timeout(
        timeout,
        acceptor.accept(Guarded::new(tcp, life, state.clone())),
    )
    .await
    {
        Ok(Ok(stream)) => {
            state.set_established();
            let _ = established
                .send(Accepted {
                    stream,
                    state,
                    closed,
                })
                .await;
        }
        Ok(Err(e)) => {
            counters.handshake_failures.inc();
            tracing::debug!(%peer, error = %e, "TLS handshake failed");
        }
        Err(_) => {
            counters.handshake_failures.inc();
            counters.handshake_timeouts.inc();
            tracing::debug!(%peer, "TLS handshake timed out");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The source of the tests' connections, unless they say otherwise.
    const HERE: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[tokio::test]
    async fn a_connection_is_counted_until_it_is_dropped() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let exported = Gauge::<i64>::default();
        let connections = OpenConnections::new(exported.clone());
        let (near, mut far) = tokio::io::duplex(64);
        let state = Arc::new(ConnectionState::default());
        let mut stream = Guarded::new(near, connections.seat(HERE), state.clone());
        let other = connections.seat(HERE);
        assert_eq!((connections.open(), exported.get()), (2, 2));
        stream.write_all(b"ping").await.unwrap();
        stream.flush().await.unwrap();
        let mut got = [0u8; 4];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        far.write_all(b"pong").await.unwrap();
        stream.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
        assert_eq!(state.peer_wait.since(), None, "nothing waited for yet");
        // Killed while a read waits: the read fails at once.
        let waiting = tokio::spawn(async move {
            let result = stream.read_exact(&mut got).await;
            (stream, result)
        });
        tokio::task::yield_now().await;
        assert!(
            state.peer_wait.since().is_some(),
            "the read waits for the peer"
        );
        state.kill.kill();
        let (mut stream, result) = waiting.await.unwrap();
        assert_eq!(result.unwrap_err().kind(), io::ErrorKind::ConnectionAborted);
        assert!(stream.write_all(b"more").await.is_err());
        drop(stream);
        assert_eq!((connections.open(), exported.get()), (1, 1));
        drop(other);
        assert_eq!((connections.open(), exported.get()), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_the_connection_idle_longest_makes_room() {
        let connections = OpenConnections::new(Gauge::default());
        let min_idle = Duration::from_secs(10);
        let (first, second, third) = (
            connections.seat(HERE),
            connections.seat(HERE),
            connections.seat(HERE),
        );
        // Real clients' connections: each has made an authenticated request.
        for seat in [&first, &second, &third] {
            seat.state().set_authenticated();
        }
        first.state().set_established();
        third.state().set_established();
        let third_busy = third.state().activity.open();
        tokio::time::advance(Duration::from_secs(5)).await;
        second.state().set_established();
        assert!(connections.full(3));
        // Nobody idle long enough yet.
        assert_eq!(connections.make_room(Some(min_idle), None), None);
        tokio::time::advance(Duration::from_secs(20)).await;
        // Both idle long enough: a stream on the first makes it busy, so
        // the second goes, although it has been idle for less time.
        let busy = first.state().activity.open();
        assert_eq!(
            connections.make_room(Some(min_idle), None),
            Some(Evicted::Idle)
        );
        assert!(!connections.full(3), "the evicted seat counts as leaving");
        assert_eq!(connections.open(), 3, "until its connection closes");
        let second_state = second.state().clone();
        let mut evicted = std::pin::pin!(second_state.evict.notified());
        assert!(futures::poll!(evicted.as_mut()).is_ready());
        assert!(
            !second_state.kill.killed.load(Ordering::Acquire),
            "told, not cut off"
        );
        // Nobody else may go: the others are busy, the second already leaving.
        assert_eq!(connections.make_room(Some(min_idle), None), None);
        // Without idle eviction, an idle connection is never chosen.
        drop(busy);
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(connections.make_room(None, None), None);
        drop(second);
        assert_eq!(connections.open(), 2);
        assert!(!connections.full(3));
        // The first's stream closed 60 s ago: idle long enough now.
        assert_eq!(
            connections.make_room(Some(min_idle), None),
            Some(Evicted::Idle)
        );
        drop(third_busy);
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_a_stalled_handshake_is_cut_off_first() {
        let connections = OpenConnections::new(Gauge::default());
        let idle = connections.seat(HERE);
        idle.state().set_established();
        idle.state().set_authenticated();
        tokio::time::advance(Duration::from_secs(60)).await;
        let (older, younger) = (connections.seat(HERE), connections.seat(HERE));
        // Both handshakes wait for their clients from the start.
        older.state().peer_wait.started();
        younger.state().peer_wait.started();
        tokio::time::advance(STALLED_HANDSHAKE - Duration::from_millis(1)).await;
        // Handshakes younger than the limit are left alone; with idle
        // eviction off, nobody makes room.
        assert_eq!(connections.make_room(None, None), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        // Both handshakes are stalled now: the older is cut off first,
        // even though an idle connection could also make room.
        assert_eq!(
            connections.make_room(Some(Duration::from_secs(10)), None),
            Some(Evicted::StalledHandshake)
        );
        assert!(older.state().kill.killed.load(Ordering::Acquire));
        assert!(!younger.state().kill.killed.load(Ordering::Acquire));
        assert!(!idle.state().kill.killed.load(Ordering::Acquire));
        assert_eq!(
            connections.make_room(None, None),
            Some(Evicted::StalledHandshake)
        );
        assert!(younger.state().kill.killed.load(Ordering::Acquire));
        // Then the idle one, by GOAWAY.
        assert_eq!(
            connections.make_room(Some(Duration::from_secs(10)), None),
            Some(Evicted::Idle)
        );
        assert_eq!(connections.leaving.load(Ordering::Acquire), 3);
        drop((idle, older, younger));
        assert_eq!(connections.leaving.load(Ordering::Acquire), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_handshake_waiting_for_the_server_is_not_stalled() {
        let connections = OpenConnections::new(Gauge::default());
        // In a storm: accepted long ago, its task not run yet.
        let starved = connections.seat(HERE);
        tokio::time::advance(STALLED_HANDSHAKE * 5).await;
        assert_eq!(connections.make_room(None, None), None);
        // Run at last, its read finds the ClientHello: still not stalled.
        starved.state().peer_wait.ended();
        assert_eq!(connections.make_room(None, None), None);
        // Then it waits for the client's next flight, in vain.
        starved.state().peer_wait.started();
        tokio::time::advance(STALLED_HANDSHAKE - Duration::from_millis(1)).await;
        assert_eq!(connections.make_room(None, None), None);
        // Bytes came: the clock starts again at the next wait.
        starved.state().peer_wait.ended();
        starved.state().peer_wait.started();
        tokio::time::advance(STALLED_HANDSHAKE - Duration::from_millis(1)).await;
        assert_eq!(connections.make_room(None, None), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            connections.make_room(None, None),
            Some(Evicted::StalledHandshake)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn evictions_in_flight_are_bounded() {
        let connections = OpenConnections::new(Gauge::default());
        let seats: Vec<_> = (0..MAX_EVICTIONS_IN_FLIGHT + 1)
            .map(|_| {
                let seat = connections.seat(HERE);
                seat.state().set_established();
                seat
            })
            .collect();
        tokio::time::advance(Duration::from_secs(60)).await;
        for _ in 0..MAX_EVICTIONS_IN_FLIGHT {
            assert!(connections.make_room(Some(Duration::ZERO), None).is_some());
        }
        assert!(
            connections.make_room(Some(Duration::ZERO), None).is_none(),
            "the bound"
        );
        drop(seats);
        assert_eq!(connections.open(), 0);
        assert_eq!(connections.leaving.load(Ordering::Acquire), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_newcomer_waits_a_moment_for_a_seat() {
        let connections = OpenConnections::new(Gauge::default());
        let held = connections.seat(HERE);
        held.state().set_established();
        // Nobody leaves: it gives up after the wait.
        let started = tokio::time::Instant::now();
        assert_eq!(connections.find_seat(1, None, SEAT_WAIT).await, None);
        assert_eq!(started.elapsed(), SEAT_WAIT);
        // A seat freed during the wait is taken.
        let waiting = connections.find_seat(1, None, SEAT_WAIT);
        let mut waiting = std::pin::pin!(waiting);
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        tokio::time::advance(SEAT_WAIT / 2).await;
        drop(held);
        assert_eq!(waiting.await, Some(Seated::Freed));
    }

    #[tokio::test(start_paused = true)]
    async fn a_handshake_that_stalls_while_a_newcomer_waits_gives_up_its_seat() {
        let connections = OpenConnections::new(Gauge::default());
        let handshaking = connections.seat(HERE);
        handshaking.state().peer_wait.started();
        tokio::time::advance(STALLED_HANDSHAKE - Duration::from_millis(50)).await;
        // Not stalled yet when the newcomer arrives; stalled during its wait.
        let seated = connections.find_seat(1, None, Duration::from_secs(1)).await;
        assert_eq!(seated, Some(Seated::MadeRoom(Evicted::StalledHandshake)));
        assert!(handshaking.state().kill.killed.load(Ordering::Acquire));
    }

    fn source(last: u8) -> IpAddr {
        IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, last))
    }

    /// Whether `state` was told to go away (its GOAWAY is due).
    fn told_to_go(state: &ConnectionState) -> bool {
        let mut told = std::pin::pin!(state.evict.notified());
        futures::FutureExt::now_or_never(told.as_mut()).is_some()
    }

    #[tokio::test(start_paused = true)]
    async fn connections_are_counted_per_source_and_a_source_leaves_with_its_last() {
        let connections = OpenConnections::new(Gauge::default());
        let (a, b) = (source(2), source(3));
        let a_seats: Vec<_> = (0..3).map(|_| connections.seat(a)).collect();
        let b_seat = connections.seat(b);
        assert!(connections.source_full(a, 3));
        assert!(!connections.source_full(a, 4));
        assert!(!connections.source_full(b, 2));
        assert!(connections.source_full(b, 1));
        assert!(
            !connections.source_full(source(4), 1),
            "a source never seen"
        );
        assert_eq!((connections.open(), connections.sources()), (4, 2));
        // An evicted connection of `a` counts as leaving for `a` alone.
        for seat in &a_seats {
            seat.state().set_established();
        }
        tokio::time::advance(FIRST_REQUEST_GRACE).await;
        assert_eq!(
            connections.make_room(None, Some(a)),
            Some(Evicted::Unauthenticated)
        );
        assert!(!connections.source_full(a, 3), "its seat counts as free");
        assert!(connections.source_full(b, 1));
        // A source's entry goes with its last connection: the map holds
        // no more entries than there are connections open.
        drop(b_seat);
        assert_eq!(connections.sources(), 1);
        assert!(!connections.source_full(b, 1));
        drop(a_seats);
        assert_eq!((connections.open(), connections.sources()), (0, 0));
        assert_eq!(connections.leaving.load(Ordering::Acquire), 0);
        // Many sources, one connection each, come and go: nothing stays.
        let many: Vec<_> = (0..=255u8).map(|i| connections.seat(source(i))).collect();
        assert_eq!(connections.sources(), 256);
        drop(many);
        assert_eq!(connections.sources(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn at_a_sources_cap_its_connection_without_an_authenticated_request_makes_room() {
        let connections = OpenConnections::new(Gauge::default());
        let (a, b) = (source(2), source(3));
        // Another source's connection, older and never authenticated.
        let other = connections.seat(b);
        other.state().set_established();
        tokio::time::advance(Duration::from_secs(5)).await;
        let real = connections.seat(a);
        real.state().set_established();
        real.state().set_authenticated();
        let flood = connections.seat(a);
        flood.state().set_established();
        // Just established: its first request may be on its way.
        tokio::time::advance(FIRST_REQUEST_GRACE - Duration::from_millis(1)).await;
        assert_eq!(connections.make_room(None, Some(a)), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        // Busy or not, it never authenticated: it goes, not the real
        // client's, nor the other source's.
        let busy = flood.state().activity.open();
        assert_eq!(
            connections.make_room(None, Some(a)),
            Some(Evicted::Unauthenticated)
        );
        assert!(told_to_go(flood.state()));
        assert!(!told_to_go(real.state()) && !told_to_go(other.state()));
        // The real client's is left alone while idle eviction is off, or
        // until it has been idle long enough.
        assert_eq!(connections.make_room(None, Some(a)), None);
        let min_idle = Some(Duration::from_secs(10));
        assert_eq!(connections.make_room(min_idle, Some(a)), None);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(
            connections.make_room(min_idle, Some(a)),
            Some(Evicted::Idle)
        );
        assert!(told_to_go(real.state()));
        assert!(!told_to_go(other.state()), "never another source's");
        drop(busy);
    }

    #[tokio::test(start_paused = true)]
    async fn at_a_sources_cap_its_stalled_handshake_is_cut_off_first() {
        let connections = OpenConnections::new(Gauge::default());
        let (a, b) = (source(2), source(3));
        let other = connections.seat(b);
        other.state().peer_wait.started();
        let unauthenticated = connections.seat(a);
        unauthenticated.state().set_established();
        let stalled = connections.seat(a);
        stalled.state().peer_wait.started();
        tokio::time::advance(STALLED_HANDSHAKE.max(FIRST_REQUEST_GRACE)).await;
        assert_eq!(
            connections.make_room(None, Some(a)),
            Some(Evicted::StalledHandshake)
        );
        assert!(stalled.state().kill.killed.load(Ordering::Acquire));
        assert!(!other.state().kill.killed.load(Ordering::Acquire));
        assert_eq!(
            connections.make_room(None, Some(a)),
            Some(Evicted::Unauthenticated)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_an_idle_connection_without_an_authenticated_request_goes_first() {
        let connections = OpenConnections::new(Gauge::default());
        let min_idle = Some(Duration::from_secs(10));
        // Idle longest, but a real client's.
        let real = connections.seat(HERE);
        real.state().set_established();
        real.state().set_authenticated();
        tokio::time::advance(Duration::from_secs(30)).await;
        let unauthenticated = connections.seat(source(2));
        unauthenticated.state().set_established();
        tokio::time::advance(Duration::from_secs(5)).await;
        let young = connections.seat(source(3));
        young.state().set_established();
        tokio::time::advance(Duration::from_secs(5)).await;
        // Idle 40 s, 10 s and 5 s: the one that never authenticated goes,
        // though the real client's has been idle longer.
        assert_eq!(
            connections.make_room(min_idle, None),
            Some(Evicted::Unauthenticated)
        );
        assert!(told_to_go(unauthenticated.state()));
        assert!(!told_to_go(real.state()));
        // The other unauthenticated one is idle 5 s only: the real one goes.
        assert_eq!(connections.make_room(min_idle, None), Some(Evicted::Idle));
        assert!(told_to_go(real.state()));
        assert!(!told_to_go(young.state()));
        // At the global cap there is no grace-based eviction: with idle
        // eviction off, nobody makes room.
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(connections.make_room(None, None), None);
    }
}
