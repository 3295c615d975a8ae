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
//! buffer. The first flush of a burst yields once to the runtime (the task
//! wakes itself and returns `Pending`), so the tasks that are ready to run
//! (the stream that is about to send its trailers, other responses ready
//! on the same connection) add their frames first; the next flush writes
//! everything in one call. The wrapper relies on the `AsyncWrite` contract:
//! a flush that returned `Pending` is polled again once the task is woken,
//! and it wakes the task at once. h2 flushes at the end of every poll of
//! its connection, so nothing is ever left in the buffer. Reads do not
//! flush: h2 reads before it writes out the frames that became ready, and
//! a flush there would split the response again.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Above this many buffered bytes a write first drains the buffer, so a
/// large response streams out instead of growing the buffer.
pub const MAX_BUFFERED_BYTES: usize = 64 * 1024;

/// A drained buffer keeps its allocation only up to this size, so ten
/// thousand mostly idle agent connections do not each hold on to the
/// largest burst they ever had.
pub const RETAINED_CAPACITY: usize = 4 * 1024;

/// A stream whose writes are buffered and whose flushes are batched; see
/// the module documentation. `G` is kept for as long as the connection
/// lives and dropped with it (the server keeps the connection's seat on an
/// event loop there: `tls::ConnectionSeat`).
#[derive(Debug)]
pub struct BatchedWriteStream<S, G = ()> {
    inner: S,
    buffer: Vec<u8>,
    written: usize,
    flush_deferred: bool,
    _guard: G,
}

impl<S> BatchedWriteStream<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Self::with_guard(inner, ())
    }
}

impl<S, G> BatchedWriteStream<S, G> {
    /// Wraps `inner`, holding `guard` until the stream is dropped.
    pub fn with_guard(inner: S, guard: G) -> Self {
        Self {
            inner,
            buffer: Vec::new(),
            written: 0,
            flush_deferred: false,
            _guard: guard,
        }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    fn pending(&self) -> &[u8] {
        &self.buffer[self.written..]
    }
}

impl<S: AsyncWrite + Unpin, G> BatchedWriteStream<S, G> {
    /// Writes out everything buffered.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
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
        self.flush_deferred = false;
        Poll::Ready(Ok(()))
    }

    fn make_room(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.buffer.len() >= MAX_BUFFERED_BYTES {
            return self.poll_drain(cx);
        }
        Poll::Ready(Ok(()))
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
            this.flush_deferred = false;
            return Pin::new(&mut this.inner).poll_flush(cx);
        }
        if !this.flush_deferred {
            // Yield once: let the tasks that are ready add their frames.
            this.flush_deferred = true;
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
    async fn a_deferred_flush_writes_everything_on_its_next_poll() {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        let mut batched = BatchedWriteStream::new(client);
        batched.write_all(b"headers+data").await.unwrap();
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        // The first poll defers (and wakes the task to come back).
        assert!(Pin::new(&mut batched).poll_flush(&mut cx).is_pending());
        // What the yield let other tasks add goes out with it.
        batched.write_all(b"+trailers").await.unwrap();
        assert!(Pin::new(&mut batched).poll_flush(&mut cx).is_ready());
        let mut got = vec![0u8; 21];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"headers+data+trailers");
        // Nothing buffered: a flush is the inner flush, at once.
        assert!(Pin::new(&mut batched).poll_flush(&mut cx).is_ready());
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
