//! One `write` system call per burst of responses instead of one per flush.
//!
//! A gRPC unary response is HEADERS + DATA, then the trailers
//! (`grpc-status`). hyper hands the trailers to h2 only after h2's
//! connection task has run once more to assign send capacity, and that
//! task flushes the connection every time it runs, so every response used
//! to cost two TLS records in two `writev` calls, and the peer two wake-ups
//! (measured with `strace -c`: 2.0 `writev` per certificate). On loopback
//! the kernel's TCP transmit *and* the receiver's processing run inside the
//! sender's `writev`, so each call is expensive.
//!
//! [`BatchedWriteStream`] sits under TLS and holds written bytes in a
//! buffer. A flush with bytes held yields to the runtime (the task wakes
//! itself and returns `Pending`), so the tasks that are ready to run (the
//! streams about to send their trailers, other responses finishing on the
//! same connection) add their frames first: at least once, and up to
//! [`FLUSH_YIELDS_MAX`] times while the oldest byte held is younger than
//! [`FLUSH_HOLD_MAX`]; then one call writes everything. (Yielding once left
//! ~1.3 responses per `sendto` at 16 requests in flight over 4 connections;
//! up to 4 times within 500 µs, ~4: BENCHMARKS.md.) The wrapper relies on
//! the `AsyncWrite` contract: a flush that returned `Pending` is polled
//! again once the task is woken, and it wakes the task at once. h2 flushes
//! at the end of every poll of its connection, so nothing is ever left in
//! the buffer. Reads do not flush: h2 reads before it writes out the frames
//! that became ready, and a flush there would split the response again.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Above this many buffered bytes a write first drains the buffer, so a
/// large response streams out instead of growing the buffer.
pub(crate) const MAX_BUFFERED_BYTES: usize = 64 * 1024;

/// Most times a flush yields before it writes (see the module documentation).
pub(crate) const FLUSH_YIELDS_MAX: u8 = 4;

/// After the first yield, a flush yields again only while the oldest byte
/// held is younger than this, so batching never holds an answer longer.
pub(crate) const FLUSH_HOLD_MAX: Duration = Duration::from_micros(500);

/// A drained buffer keeps its allocation only up to this size, so ten
/// thousand mostly idle agent connections do not each hold on to the
/// largest burst they ever had.
pub(crate) const RETAINED_CAPACITY: usize = 4 * 1024;

/// A stream whose writes are buffered and whose flushes are batched; see
/// the module documentation. `G` is kept for as long as the connection
/// lives and dropped with it (the server keeps the connection's seat on an
/// event loop there: `listener::ConnectionSeat`).
#[derive(Debug)]
pub(crate) struct BatchedWriteStream<S, G = ()> {
    inner: S,
    buffer: Vec<u8>,
    written: usize,
    /// When the oldest byte still held was written.
    held_since: Option<Instant>,
    /// How often the flush of the bytes held has yielded.
    flush_yields: u8,
    max_flush_yields: u8,
    max_hold: Duration,
    _guard: G,
}

impl<S> BatchedWriteStream<S> {
    /// Wraps `inner`.
    #[cfg(test)]
    pub(crate) fn new(inner: S) -> Self {
        Self::with_guard(inner, ())
    }
}

impl<S, G> BatchedWriteStream<S, G> {
    /// Wraps `inner`, holding `guard` until the stream is dropped.
    pub(crate) fn with_guard(inner: S, guard: G) -> Self {
        Self {
            inner,
            buffer: Vec::new(),
            written: 0,
            held_since: None,
            flush_yields: 0,
            max_flush_yields: FLUSH_YIELDS_MAX,
            max_hold: FLUSH_HOLD_MAX,
            _guard: guard,
        }
    }

    fn pending(&self) -> &[u8] {
        &self.buffer[self.written..]
    }
}

impl<S: AsyncWrite + Unpin, G> BatchedWriteStream<S, G> {
    /// Writes out everything buffered.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.written < self.buffer.len() {
            // The audit lines of the answers about to leave go out first:
            // a client that has its certificate finds it in the log.
            super::log_lines::write_gathered();
        }
        while self.written < self.buffer.len() {
            let pending = &self.buffer[self.written..];
            let n = match Pin::new(&mut self.inner).poll_write(cx, pending) {
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        if self.buffer.capacity() > RETAINED_CAPACITY {
            self.buffer = Vec::new();
        } else {
            self.buffer.clear();
        }
        self.written = 0;
        self.held_since = None;
        self.flush_yields = 0;
        Poll::Ready(Ok(()))
    }

    fn make_room(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.buffer.len() >= MAX_BUFFERED_BYTES {
            std::task::ready!(self.poll_drain(cx))?;
        }
        if self.held_since.is_none() {
            self.held_since = Some(Instant::now());
        }
        Poll::Ready(Ok(()))
    }

    /// Whether a flush should yield (again) before it writes.
    fn should_yield(&self) -> bool {
        match self.flush_yields {
            0 => true,
            n if n >= self.max_flush_yields => false,
            _ => self
                .held_since
                .is_some_and(|since| since.elapsed() < self.max_hold),
        }
    }
}

impl<S: AsyncRead + Unpin, G: Unpin> AsyncRead for BatchedWriteStream<S, G> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        // No flushing here: h2 reads before it writes out the frames that
        // became ready (the trailers), so a flush on read would split them.
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin, G: Unpin> AsyncWrite for BatchedWriteStream<S, G> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Err(e) = std::task::ready!(this.make_room(cx)) {
            return Poll::Ready(Err(e));
        }
        this.buffer.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Err(e) = std::task::ready!(this.make_room(cx)) {
            return Poll::Ready(Err(e));
        }
        let mut n = 0;
        for buf in bufs {
            this.buffer.extend_from_slice(buf);
            n += buf.len();
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.pending().is_empty() {
            return Pin::new(&mut this.inner).poll_flush(cx);
        }
        if this.should_yield() {
            // Let the tasks that are ready add their frames first.
            this.flush_yields += 1;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if let Err(e) = std::task::ready!(this.poll_drain(cx)) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Err(e) = std::task::ready!(this.poll_drain(cx)) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected, G> tonic::transport::server::Connected
    for BatchedWriteStream<S, G>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn writes_wait_for_the_second_flush_and_go_out_in_one_piece() {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        let mut batched = BatchedWriteStream::new(client);
        batched.write_all(b"headers+data").await.unwrap();
        batched.write_all(b"trailers").await.unwrap();
        // Nothing reached the peer before the flush.
        let mut probe = [0u8; 1];
        assert!(tokio::time::timeout(
            std::time::Duration::from_millis(50),
            server.read(&mut probe)
        )
        .await
        .is_err());
        // flush() completes (the yield is internal) and delivers both.
        batched.flush().await.unwrap();
        let mut got = vec![0u8; 20];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"headers+datatrailers");
        assert!(batched.pending().is_empty());
    }

    #[tokio::test]
    async fn a_flush_yields_at_most_the_limit_then_writes_everything() {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        let mut batched = BatchedWriteStream::new(client);
        // Time is not what stops the yields here.
        batched.max_hold = Duration::from_secs(3600);
        batched.write_all(b"headers+data").await.unwrap();
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        // The first polls defer (and wake the task to come back); what the
        // yields let other tasks add goes out with the rest.
        for n in 0..FLUSH_YIELDS_MAX {
            assert!(Pin::new(&mut batched).poll_flush(&mut cx).is_pending());
            batched.write_all(&[b'0' + n]).await.unwrap();
        }
        assert!(Pin::new(&mut batched).poll_flush(&mut cx).is_ready());
        let mut got = vec![0u8; 16];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"headers+data0123");
        // Nothing buffered: a flush is the inner flush, at once.
        assert!(Pin::new(&mut batched).poll_flush(&mut cx).is_ready());
        // The next burst starts counting again.
        batched.write_all(b"next").await.unwrap();
        assert!(Pin::new(&mut batched).poll_flush(&mut cx).is_pending());
    }

    #[tokio::test]
    async fn bytes_held_past_the_hold_limit_go_out_after_one_yield() {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        let mut batched = BatchedWriteStream::new(client);
        batched.max_hold = Duration::from_millis(5);
        batched.write_all(b"answer").await.unwrap();
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        // Always one yield, however old the bytes.
        std::thread::sleep(Duration::from_millis(10));
        assert!(Pin::new(&mut batched).poll_flush(&mut cx).is_pending());
        // Older than the limit: written now, not held for more yields.
        assert!(Pin::new(&mut batched).poll_flush(&mut cx).is_ready());
        let mut got = vec![0u8; 6];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"answer");
    }

    #[tokio::test]
    async fn large_writes_stream_out_and_shutdown_drains() {
        let (client, mut server) = tokio::io::duplex(16 * 1024);
        let mut batched = BatchedWriteStream::new(client);
        let payload: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let expected = payload.clone();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            server.read_to_end(&mut got).await.unwrap();
            got
        });
        for chunk in payload.chunks(10_000) {
            batched.write_all(chunk).await.unwrap();
            // The buffer never grows far beyond its bound.
            assert!(batched.buffer.len() < MAX_BUFFERED_BYTES + 10_000);
        }
        batched.shutdown().await.unwrap();
        assert_eq!(reader.await.unwrap(), expected);
        // The burst's allocation is not kept.
        assert!(batched.buffer.capacity() <= RETAINED_CAPACITY);
    }
}
