//! Answers that leave a connection together: one TLS write per turn of the
//! connection's task instead of one per HTTP/2 flush.
//!
//! h2 flushes its connection after every frame it cannot keep in its own
//! buffer: a unary gRPC answer (HEADERS, a DATA frame larger than h2 copies,
//! then the trailers) is flushed twice, and tokio-rustls turns every write
//! into a TLS record and a `writev` of its own. On loopback each `writev`
//! also runs the receiver's TCP stack on the server's account
//! (docs/benchmarks-history.md, "Answers written together", has the measurements).
//!
//! [`CoalescedWrites`] sits between h2 and the TLS stream. It keeps what
//! h2 writes in a buffer of its own and, when h2 flushes, wakes its task
//! once more instead of writing. The bytes go out, in one TLS write, at
//! the next read from the connection (h2 reads first thing in every turn
//! of its task, and hyper's server polls h2 again for each request it
//! takes up), so every answer finished by then leaves together.
//!
//! Bounds: at most [`MAX_COALESCED_BYTES`] wait in the buffer; a write that
//! would go beyond writes the buffer out first and waits, as a plain write
//! would, while the peer does not read. The buffer is given back once it
//! has been written, so an idle connection holds none. h2 closes a
//! connection through `poll_shutdown`, which writes what is kept first;
//! only a connection dropped without closing (cut off by the accept loop,
//! or its task aborted) loses what it kept, as it would lose h2's own
//! queues.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The most bytes kept back from the TLS stream at once: about five
/// answers with their certificate chains. While a peer does not read,
/// these are answers h2 would otherwise keep in its own queues.
pub(crate) const MAX_COALESCED_BYTES: usize = 16 * 1024;

/// What the buffer starts with: one answer with a three-certificate chain,
/// so the first answer of a turn is copied without growing it again.
const FIRST_CAPACITY: usize = 4 * 1024;

/// A stream whose writes wait for the next turn of its task and then leave
/// in one write to the stream beneath (module documentation).
#[derive(Debug)]
pub(crate) struct CoalescedWrites<S> {
    inner: S,
    /// Bytes written by h2 and not yet passed to `inner`.
    pending: Vec<u8>,
    /// How much of `pending` `inner` has taken.
    taken: usize,
    /// h2 flushed and the task has been woken to write `pending` out.
    wake_queued: bool,
    /// `inner` did not take all of `pending`: its own wake-up (the peer
    /// reading) comes before the next write, not one of ours.
    blocked: bool,
    /// `inner` took everything but its flush was not finished: the next
    /// read finishes it (h2 may only read until the peer writes).
    unflushed: bool,
}

impl<S> CoalescedWrites<S> {
    /// Wraps `inner`; nothing is kept back until something is written.
    pub(crate) fn new(inner: S) -> Self {
        Self {
            inner,
            pending: Vec::new(),
            taken: 0,
            wake_queued: false,
            blocked: false,
            unflushed: false,
        }
    }

    fn has_pending(&self) -> bool {
        self.taken < self.pending.len()
    }
}

impl<S: AsyncWrite + Unpin> CoalescedWrites<S> {
    /// Passes what is pending to `inner` and flushes it. `Pending` when
    /// `inner` cannot take it all now; `inner` then wakes the task.
    fn write_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.wake_queued = false;
        while self.has_pending() {
            match Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.taken..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => self.taken += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    self.blocked = true;
                    return Poll::Pending;
                }
            }
        }
        // Given back, not kept: an idle connection holds no buffer.
        self.pending = Vec::new();
        self.taken = 0;
        self.blocked = false;
        let flushed = Pin::new(&mut self.inner).poll_flush(cx);
        self.unflushed = flushed.is_pending();
        flushed
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for CoalescedWrites<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for CoalescedWrites<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // A new turn of the task: what the last one wrote goes out now. If
        // `inner` cannot take it all, it wakes the task when it can, and
        // the rest goes out then.
        if this.has_pending() || this.unflushed {
            if let Poll::Ready(Err(e)) = this.write_out(cx) {
                return Poll::Ready(Err(e));
            }
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for CoalescedWrites<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        if len == 0 {
            return Poll::Ready(Ok(0));
        }
        if this.has_pending() && this.pending.len() - this.taken + len > MAX_COALESCED_BYTES {
            ready!(this.write_out(cx))?;
        }
        // What `inner` took of a buffer it could not take whole goes, so
        // the buffer never holds more than the bound while it drains.
        if this.taken > 0 {
            this.pending.drain(..this.taken);
            this.taken = 0;
        }
        // A write larger than the whole buffer is taken in part; h2 writes
        // the rest after.
        let room = MAX_COALESCED_BYTES.saturating_sub(this.pending.len() - this.taken);
        if this.pending.capacity() == 0 {
            this.pending
                .reserve(len.clamp(FIRST_CAPACITY, MAX_COALESCED_BYTES));
        }
        let mut kept = 0;
        for b in bufs {
            let n = b.len().min(room - kept);
            this.pending.extend_from_slice(&b[..n]);
            kept += n;
            if kept == room {
                break;
            }
        }
        Poll::Ready(Ok(kept))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.has_pending() {
            return Pin::new(&mut this.inner).poll_flush(cx);
        }
        if this.blocked {
            // The peer is not reading: h2 waits as it would on the socket.
            return this.write_out(cx);
        }
        if !this.wake_queued {
            this.wake_queued = true;
            cx.waker().wake_by_ref();
        }
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.write_out(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    /// A stream beneath that records each write it takes and can refuse
    /// writes as a full socket would.
    #[derive(Default)]
    struct RecordingStream {
        writes: Vec<Vec<u8>>,
        flushes: usize,
        shut: bool,
        full: bool,
        /// Bytes the socket has room for (`None`: unlimited).
        room: Option<usize>,
        flush_pending: bool,
        to_read: Vec<u8>,
    }

    impl AsyncRead for RecordingStream {
        fn poll_read(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let this = self.get_mut();
            if this.to_read.is_empty() {
                return Poll::Pending;
            }
            buf.put_slice(&std::mem::take(&mut this.to_read));
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for RecordingStream {
        fn poll_write(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            if this.full {
                return Poll::Pending;
            }
            let n = buf.len().min(this.room.unwrap_or(usize::MAX));
            if n == 0 {
                return Poll::Pending;
            }
            if let Some(room) = &mut this.room {
                *room -= n;
            }
            this.writes.push(buf[..n].to_vec());
            Poll::Ready(Ok(n))
        }

        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            let this = self.get_mut();
            this.flushes += 1;
            if this.flush_pending {
                return Poll::Pending;
            }
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.get_mut().shut = true;
            Poll::Ready(Ok(()))
        }
    }

    #[derive(Default)]
    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn waker() -> (Arc<CountingWaker>, std::task::Waker) {
        let counter = Arc::new(CountingWaker::default());
        (counter.clone(), counter.into())
    }

    fn write(
        stream: &mut CoalescedWrites<RecordingStream>,
        cx: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(stream).poll_write(cx, bytes)
    }

    fn flush(
        stream: &mut CoalescedWrites<RecordingStream>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(stream).poll_flush(cx)
    }

    fn read(stream: &mut CoalescedWrites<RecordingStream>, cx: &mut Context<'_>) -> Vec<u8> {
        let mut space = [0u8; 64];
        let mut buf = ReadBuf::new(&mut space);
        let _ = Pin::new(stream).poll_read(cx, &mut buf);
        buf.filled().to_vec()
    }

    #[test]
    fn flushes_of_one_turn_leave_in_one_write_when_the_next_turn_reads() {
        let (wakes, waker) = waker();
        let mut cx = Context::from_waker(&waker);
        let mut stream = CoalescedWrites::new(RecordingStream::default());

        // One turn: two answers, each flushed twice as h2 does.
        for part in [
            &b"headers+data 1"[..],
            b"trailers 1",
            b"headers+data 2",
            b"trailers 2",
        ] {
            assert!(
                matches!(write(&mut stream, &mut cx, part), Poll::Ready(Ok(n)) if n == part.len())
            );
            assert!(matches!(flush(&mut stream, &mut cx), Poll::Ready(Ok(()))));
        }
        assert!(
            stream.inner.writes.is_empty(),
            "nothing written during the turn"
        );
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1, "the task is woken once");

        // The next turn begins with a read: everything goes out at once.
        stream.inner.to_read = b"request".to_vec();
        assert_eq!(read(&mut stream, &mut cx), b"request");
        assert_eq!(
            stream.inner.writes,
            vec![b"headers+data 1trailers 1headers+data 2trailers 2".to_vec()]
        );
        assert_eq!(stream.inner.flushes, 1);
        assert_eq!(
            stream.pending.capacity(),
            0,
            "an idle stream keeps no buffer"
        );

        // With nothing pending a flush goes straight through and wakes no one.
        assert!(matches!(flush(&mut stream, &mut cx), Poll::Ready(Ok(()))));
        assert_eq!(stream.inner.flushes, 2);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_shutdown_writes_what_is_pending_first() {
        let (_wakes, waker) = waker();
        let mut cx = Context::from_waker(&waker);
        let mut stream = CoalescedWrites::new(RecordingStream::default());
        assert!(write(&mut stream, &mut cx, b"GOAWAY").is_ready());
        assert!(flush(&mut stream, &mut cx).is_ready());
        assert!(Pin::new(&mut stream).poll_shutdown(&mut cx).is_ready());
        assert_eq!(stream.inner.writes, vec![b"GOAWAY".to_vec()]);
        assert!(stream.inner.shut);
    }

    #[test]
    fn a_peer_that_does_not_read_holds_back_at_most_the_bound() {
        let (wakes, waker) = waker();
        let mut cx = Context::from_waker(&waker);
        let mut stream = CoalescedWrites::new(RecordingStream {
            full: true,
            ..RecordingStream::default()
        });
        let chunk = vec![7u8; 1000];
        let mut kept = 0;
        while let Poll::Ready(Ok(n)) = write(&mut stream, &mut cx, &chunk) {
            kept += n;
            assert!(kept <= MAX_COALESCED_BYTES + chunk.len());
        }
        assert!(stream.pending.len() <= MAX_COALESCED_BYTES);
        // A flush now waits for the socket instead of waking its own task
        // again and again.
        let before = wakes.0.load(Ordering::SeqCst);
        assert!(flush(&mut stream, &mut cx).is_pending());
        assert!(flush(&mut stream, &mut cx).is_pending());
        assert_eq!(wakes.0.load(Ordering::SeqCst), before);

        // The peer reads again: everything kept goes out, in order.
        stream.inner.full = false;
        assert!(matches!(flush(&mut stream, &mut cx), Poll::Ready(Ok(()))));
        let written: usize = stream.inner.writes.iter().map(Vec::len).sum();
        assert_eq!(written, kept);
        assert!(!stream.has_pending());
    }

    #[test]
    fn a_slow_reader_never_makes_the_buffer_outgrow_the_bound() {
        let (_wakes, waker) = waker();
        let mut cx = Context::from_waker(&waker);
        let mut stream = CoalescedWrites::new(RecordingStream {
            room: Some(0),
            ..RecordingStream::default()
        });
        let chunk = vec![3u8; 4000];
        let mut kept = 0;
        for _ in 0..200 {
            // The peer reads a little between writes; h2 always has more.
            stream.inner.room = Some(1000);
            if let Poll::Ready(Ok(n)) = write(&mut stream, &mut cx, &chunk) {
                kept += n;
            }
            assert!(
                stream.pending.len() <= MAX_COALESCED_BYTES,
                "{} bytes kept",
                stream.pending.len()
            );
        }
        stream.inner.room = None;
        assert!(matches!(flush(&mut stream, &mut cx), Poll::Ready(Ok(()))));
        let _ = read(&mut stream, &mut cx);
        let written: usize = stream.inner.writes.iter().map(Vec::len).sum();
        assert_eq!(written, kept, "every byte taken is written, once");
    }

    #[test]
    fn a_flush_left_unfinished_is_finished_by_the_next_read() {
        let (_wakes, waker) = waker();
        let mut cx = Context::from_waker(&waker);
        let mut stream = CoalescedWrites::new(RecordingStream {
            flush_pending: true,
            ..RecordingStream::default()
        });
        assert!(write(&mut stream, &mut cx, b"SETTINGS").is_ready());
        assert!(flush(&mut stream, &mut cx).is_ready());
        let _ = read(&mut stream, &mut cx);
        assert_eq!(stream.inner.writes, vec![b"SETTINGS".to_vec()]);
        assert_eq!(stream.inner.flushes, 1, "the flush was started");
        // The stream beneath can flush now; h2 only reads (waiting for the
        // client's preface), and that read finishes the flush.
        stream.inner.flush_pending = false;
        let _ = read(&mut stream, &mut cx);
        assert_eq!(stream.inner.flushes, 2);
        let _ = read(&mut stream, &mut cx);
        assert_eq!(stream.inner.flushes, 2, "nothing left to flush");
    }

    #[test]
    fn a_write_larger_than_the_bound_is_taken_in_part() {
        let (_wakes, waker) = waker();
        let mut cx = Context::from_waker(&waker);
        let mut stream = CoalescedWrites::new(RecordingStream::default());
        let big = vec![1u8; MAX_COALESCED_BYTES + 100];
        assert!(
            matches!(write(&mut stream, &mut cx, &big), Poll::Ready(Ok(n)) if n == MAX_COALESCED_BYTES)
        );
        // The next write pushes the full buffer out first.
        assert!(matches!(
            write(&mut stream, &mut cx, &big[..100]),
            Poll::Ready(Ok(100))
        ));
        assert_eq!(stream.inner.writes.len(), 1);
        assert_eq!(stream.inner.writes[0].len(), MAX_COALESCED_BYTES);
    }
}
