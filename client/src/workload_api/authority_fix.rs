//! The `:authority` Python's gRPC sends on a Unix socket, made acceptable.
//!
//! gRPC's C core (Python's `grpcio` 1.57 and later, so py-spiffe) sends the
//! socket's path, percent-encoded, as the HTTP/2 `:authority` of every
//! request on a `unix:` target (`tmp%2Fagent.sock`). That is not an
//! authority (RFC 9113 §8.3.1: `host[:port]`), and `h2`, the HTTP/2 library
//! the agent serves with, resets every such stream with `PROTOCOL_ERROR`.
//! Go, Rust and Envoy send `localhost`, and are not touched.
//!
//! [`AuthorityFix`] sits between the socket and `h2`, on what the client
//! sends. It reads the connection preface and the frames up to the first
//! header block and decodes that block (HPACK):
//! - an `:authority` that parses as one, or none: everything already read
//!   and everything after goes to `h2` unchanged, and this stream only
//!   forwards reads;
//! - one that does not: from then on every header block of the connection
//!   is decoded (with the client's dynamic table) and encoded again for
//!   `h2` as never-indexed literals, `:authority` as `localhost`, in
//!   frames of at most [`MAX_FRAME_PAYLOAD`] bytes. `h2`'s own table stays
//!   empty, so the two stay in step whatever the client indexes.
//!
//! Bounds: a frame's payload at most [`MAX_FRAME_PAYLOAD`] (the size `h2`
//! accepts; a larger one is passed on for `h2` to refuse), a header block
//! at most [`MAX_HEADER_BLOCK`] bytes encoded and decoded and
//! [`MAX_BLOCK_FRAMES`] frames, the client's
//! dynamic table at most HPACK's default 4,096 bytes (the size `h2`
//! advertises). A client that breaks HTTP/2 framing inside a header block
//! gets its connection closed, as `h2` would.

use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::per_pod::{BufferCharge, OverBudget};

/// HTTP/2's client connection preface.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The largest frame payload read or written: HTTP/2's default
/// SETTINGS_MAX_FRAME_SIZE, which the agent's server keeps.
pub(crate) const MAX_FRAME_PAYLOAD: usize = 16 * 1024;
/// The largest header block kept, encoded or decoded.
pub(crate) const MAX_HEADER_BLOCK: usize = 64 * 1024;
/// The most frames one header block may span: a client sending empty
/// CONTINUATION frames for ever (the "CONTINUATION flood") is cut off.
pub(crate) const MAX_BLOCK_FRAMES: usize = 32;
/// HPACK's default dynamic table size, the one the agent's server advertises.
const HPACK_TABLE_SIZE: usize = 4096;
/// What replaces an authority that is not one.
const LOCALHOST: &[u8] = b"localhost";

const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// What the stream does with the client's bytes.
enum Mode {
    /// Before the first header block is complete.
    Inspecting,
    /// Every header block is encoded again.
    Rewriting(Box<loona_hpack::Decoder<'static>>),
    /// Everything is forwarded as it comes.
    Forwarding,
}

/// A header block being put together from its frames. It is held once:
/// while inspecting, as the client's frames (`AuthorityFix::first_block_raw`,
/// its fragments at `ranges` in them); while rewriting, as its fragments.
struct PendingBlock {
    stream_id: u32,
    /// END_STREAM of its HEADERS frame.
    end_stream: bool,
    /// The priority fields of its HEADERS frame, if any.
    priority: Option<[u8; 5]>,
    /// Rewriting: the header block fragments so far.
    fragment: Vec<u8>,
    /// Inspecting: where the fragments lie in the first block's frames.
    ranges: Vec<Range<usize>>,
    /// The fragments' bytes so far.
    fragment_len: usize,
    /// Frames so far, HEADERS included.
    frames: usize,
}

/// What [`AuthorityFix`] calls when its buffers would take its pod past
/// its budget (the connection is then closed).
pub(crate) type OnOverBudget = Box<dyn Fn(&OverBudget) + Send>;

/// The client side of a Workload API connection, as `h2` should read it
/// (see the module's documentation). Writes go to `inner` unchanged.
pub(crate) struct AuthorityFix<S> {
    inner: S,
    mode: Mode,
    /// Read from `inner`, not yet looked at.
    input: Vec<u8>,
    /// Ready for `h2`, from `output_pos` on.
    output: Vec<u8>,
    output_pos: usize,
    /// The frames of the first header block as the client sent them, for
    /// the case that they need no change: the one copy of a block being
    /// inspected.
    first_block_raw: Vec<u8>,
    pending: Option<PendingBlock>,
    preface_seen: bool,
    /// `process` stopped with input left because the output is full.
    backlog: bool,
    /// Node mode: what the buffers above hold, charged to the caller's pod.
    charge: Option<(BufferCharge, OnOverBudget)>,
}

/// How much is read from the client at a time.
const READ_CHUNK: usize = 8192;

impl<S> AuthorityFix<S> {
    /// Wraps the connection's stream.
    pub(crate) fn new(inner: S) -> Self {
        Self {
            inner,
            mode: Mode::Inspecting,
            input: Vec::new(),
            output: Vec::new(),
            output_pos: 0,
            first_block_raw: Vec::new(),
            pending: None,
            preface_seen: false,
            backlog: false,
            charge: None,
        }
    }

    /// Charges the bytes its buffers hold to `charge` (its caller's pod's
    /// budget) as they grow and shrink; past the budget the read fails
    /// (the connection is closed) after `on_over_budget` is told.
    pub(crate) fn with_budget(
        mut self,
        charge: BufferCharge,
        on_over_budget: OnOverBudget,
    ) -> Self {
        self.charge = Some((charge, on_over_budget));
        self
    }

    /// The bytes the buffers hold (their capacity), the HPACK table
    /// counted at its most when rewriting.
    pub(crate) fn held_bytes(&self) -> usize {
        let pending = self.pending.as_ref().map_or(0, |p| {
            p.fragment.capacity() + p.ranges.capacity() * std::mem::size_of::<Range<usize>>()
        });
        let table = match self.mode {
            Mode::Rewriting(_) => HPACK_TABLE_SIZE,
            _ => 0,
        };
        self.input.capacity()
            + self.output.capacity()
            + self.first_block_raw.capacity()
            + pending
            + table
    }

    /// Gives back what the buffers no longer need, and charges what they
    /// hold now.
    fn settle(&mut self) -> io::Result<()> {
        if self.input.is_empty() {
            self.input = Vec::new();
        } else if self.input.capacity() > 2 * (self.input.len() + READ_CHUNK) {
            self.input.shrink_to(self.input.len() + READ_CHUNK);
        }
        if self.output_pos == self.output.len() {
            self.output = Vec::new();
            self.output_pos = 0;
        }
        let held = self.held_bytes();
        if let Some((charge, on_over_budget)) = &mut self.charge {
            if let Err(over) = charge.set(held) {
                on_over_budget(&over);
                return Err(broken(
                    "its pod holds its most bytes in the agent's buffers",
                ));
            }
        }
        Ok(())
    }

    /// Moves everything looked at so far, and everything not yet, to the
    /// output unchanged, and forwards from then on.
    fn forward_everything(&mut self) {
        let raw = std::mem::take(&mut self.first_block_raw);
        let input = std::mem::take(&mut self.input);
        if self.output.is_empty() {
            self.output = raw;
        } else {
            self.output.extend_from_slice(&raw);
        }
        self.output.extend_from_slice(&input);
        self.pending = None;
        self.mode = Mode::Forwarding;
    }

    /// Turns as much of `input` as possible into `output`, stopping once
    /// the output holds [`MAX_HEADER_BLOCK`] bytes (a block re-encoded can
    /// be far larger than the client sent: the decoded size is bounded).
    fn process(&mut self) -> io::Result<()> {
        self.backlog = false;
        if !self.preface_seen {
            let n = self.input.len().min(PREFACE.len());
            if self.input[..n] != PREFACE[..n] {
                // Not HTTP/2 with prior knowledge: h2 will say so.
                self.forward_everything();
                return Ok(());
            }
            if n < PREFACE.len() {
                return Ok(());
            }
            self.output.extend(self.input.drain(..PREFACE.len()));
            self.preface_seen = true;
        }
        loop {
            if matches!(self.mode, Mode::Forwarding) {
                self.output.append(&mut self.input);
                return Ok(());
            }
            if self.output.len() >= MAX_HEADER_BLOCK {
                self.backlog = true;
                return Ok(());
            }
            if self.input.len() < FRAME_HEADER {
                return Ok(());
            }
            let len = usize::from(self.input[0]) << 16
                | usize::from(self.input[1]) << 8
                | usize::from(self.input[2]);
            let (kind, flags) = (self.input[3], self.input[4]);
            let stream_id =
                u32::from_be_bytes([self.input[5], self.input[6], self.input[7], self.input[8]])
                    & 0x7fff_ffff;
            if len > MAX_FRAME_PAYLOAD {
                if self.pending.is_some() {
                    return Err(broken("a frame too large inside a header block"));
                }
                // h2 refuses it (FRAME_SIZE_ERROR).
                self.forward_everything();
                return Ok(());
            }
            let end = FRAME_HEADER + len;
            if self.input.len() < end {
                return Ok(());
            }
            let inspecting = matches!(self.mode, Mode::Inspecting);
            let payload = &self.input[FRAME_HEADER..end];
            // Where the frame's fragment lies in its payload.
            let fragment = match (kind, self.pending.as_mut()) {
                (HEADERS, None) => {
                    let (fragment, priority) = headers_fragment(flags, payload)?;
                    self.pending = Some(PendingBlock {
                        stream_id,
                        end_stream: flags & END_STREAM != 0,
                        priority,
                        fragment: Vec::new(),
                        ranges: Vec::new(),
                        fragment_len: 0,
                        frames: 0,
                    });
                    fragment
                }
                (CONTINUATION, Some(pending)) => {
                    if pending.stream_id != stream_id {
                        return Err(broken("a CONTINUATION of another stream"));
                    }
                    0..payload.len()
                }
                (_, Some(_)) => return Err(broken("a frame inside a header block")),
                (_, None) => {
                    // Any other frame is forwarded as it is.
                    self.output.extend_from_slice(&self.input[..end]);
                    self.input.drain(..end);
                    continue;
                }
            };
            let pending = self.pending.as_mut().ok_or_else(|| broken("no block"))?;
            pending.frames += 1;
            pending.fragment_len += fragment.len();
            if pending.fragment_len > MAX_HEADER_BLOCK || pending.frames > MAX_BLOCK_FRAMES {
                return Err(broken("a header block too large"));
            }
            if inspecting {
                let base = self.first_block_raw.len() + FRAME_HEADER;
                pending
                    .ranges
                    .push(base + fragment.start..base + fragment.end);
                // Exactly: doubling would hold up to twice the block.
                self.first_block_raw.reserve_exact(end);
                self.first_block_raw.extend_from_slice(&self.input[..end]);
            } else {
                pending.fragment.reserve_exact(fragment.len());
                pending.fragment.extend_from_slice(&payload[fragment]);
            }
            self.input.drain(..end);
            if flags & END_HEADERS != 0 {
                let block = self.pending.take().ok_or_else(|| broken("no block"))?;
                self.finish_block(block)?;
            }
        }
    }

    /// A complete header block: decides the mode on the first, encodes it
    /// again when rewriting. The block's bytes are let go of here.
    fn finish_block(&mut self, block: PendingBlock) -> io::Result<()> {
        if matches!(self.mode, Mode::Inspecting) {
            let mut decoder = loona_hpack::Decoder::new();
            decoder.set_max_allowed_table_size(HPACK_TABLE_SIZE);
            let fields = match block.ranges.as_slice() {
                [one] => decode(&mut decoder, &self.first_block_raw[one.clone()])?,
                ranges => {
                    let mut joined = Vec::with_capacity(block.fragment_len);
                    for range in ranges {
                        joined.extend_from_slice(&self.first_block_raw[range.clone()]);
                    }
                    decode(&mut decoder, &joined)?
                }
            };
            let acceptable = fields
                .iter()
                .find(|(name, _)| name == b":authority")
                .is_none_or(|(_, value)| http::uri::Authority::try_from(value.as_slice()).is_ok());
            if acceptable {
                self.forward_everything();
                return Ok(());
            }
            self.first_block_raw = Vec::new();
            tracing::debug!(
                "a workload client sent a socket path as :authority; its header blocks are re-encoded with localhost"
            );
            self.write_block(&block, &fields);
            self.mode = Mode::Rewriting(Box::new(decoder));
            return Ok(());
        }
        let Mode::Rewriting(decoder) = &mut self.mode else {
            return Ok(());
        };
        let fields = decode(decoder, &block.fragment)?;
        drop(block.fragment);
        self.write_block_fields(block.stream_id, block.end_stream, block.priority, &fields);
        Ok(())
    }

    fn write_block(&mut self, block: &PendingBlock, fields: &[(Vec<u8>, Vec<u8>)]) {
        self.write_block_fields(block.stream_id, block.end_stream, block.priority, fields);
    }

    /// Writes `fields` as never-indexed literals in a HEADERS frame and as
    /// many CONTINUATION frames as needed, `:authority` as `localhost`.
    fn write_block_fields(
        &mut self,
        stream_id: u32,
        end_stream: bool,
        priority: Option<[u8; 5]>,
        fields: &[(Vec<u8>, Vec<u8>)],
    ) {
        let mut encoded = Vec::new();
        for (name, value) in fields {
            let value = if name == b":authority" {
                LOCALHOST
            } else {
                value.as_slice()
            };
            // Literal header field never indexed, new name (RFC 7541 §6.2.3).
            encoded.push(0x10);
            encode_string(&mut encoded, name);
            encode_string(&mut encoded, value);
        }
        let mut first = Vec::new();
        let mut flags = 0;
        if end_stream {
            flags |= END_STREAM;
        }
        if let Some(priority) = priority {
            flags |= PRIORITY;
            first.extend_from_slice(&priority);
        }
        let room = MAX_FRAME_PAYLOAD - first.len();
        let (head, mut rest) = encoded.split_at(encoded.len().min(room));
        first.extend_from_slice(head);
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        write_frame(&mut self.output, HEADERS, flags, stream_id, &first);
        while !rest.is_empty() {
            let (part, after) = rest.split_at(rest.len().min(MAX_FRAME_PAYLOAD));
            let flags = if after.is_empty() { END_HEADERS } else { 0 };
            write_frame(&mut self.output, CONTINUATION, flags, stream_id, part);
            rest = after;
        }
    }
}

/// Where the header block fragment of a HEADERS frame's payload lies,
/// without its padding, and its priority fields.
fn headers_fragment(flags: u8, payload: &[u8]) -> io::Result<(Range<usize>, Option<[u8; 5]>)> {
    let mut start = 0usize;
    let mut pad = 0usize;
    if flags & PADDED != 0 {
        let &n = payload.first().ok_or_else(|| broken("no pad length"))?;
        pad = usize::from(n);
        start = 1;
    }
    let mut priority = None;
    if flags & PRIORITY != 0 {
        let fields = payload
            .get(start..start + 5)
            .ok_or_else(|| broken("short priority fields"))?;
        priority = Some([fields[0], fields[1], fields[2], fields[3], fields[4]]);
        start += 5;
    }
    let rest = payload.len() - start;
    if pad > rest {
        return Err(broken("padding longer than the frame"));
    }
    Ok((start..payload.len() - pad, priority))
}

/// Decodes a header block, within [`MAX_HEADER_BLOCK`] decoded bytes.
fn decode(
    decoder: &mut loona_hpack::Decoder<'static>,
    block: &[u8],
) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut fields = Vec::new();
    let mut size = 0usize;
    let mut too_large = false;
    decoder
        .decode_with_cb(block, |name, value| {
            size += name.len() + value.len() + 32;
            if size > MAX_HEADER_BLOCK {
                too_large = true;
            } else {
                fields.push((name.into_owned(), value.into_owned()));
            }
        })
        .map_err(|_| broken("a header block that does not decode (HPACK)"))?;
    if too_large {
        return Err(broken("a header list too large"));
    }
    Ok(fields)
}

/// An HPACK string literal, not Huffman-coded (RFC 7541 §5.2).
fn encode_string(out: &mut Vec<u8>, text: &[u8]) {
    encode_integer(out, text.len(), 7, 0);
    out.extend_from_slice(text);
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541 §5.1); `first` holds
/// the bits above the prefix.
fn encode_integer(out: &mut Vec<u8>, value: usize, n: u8, first: u8) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

fn write_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream_id: u32, payload: &[u8]) {
    let len = payload.len();
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream_id.to_be_bytes());
    out.extend_from_slice(payload);
}

fn broken(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("HTTP/2 from a workload client: {what}"),
    )
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.output_pos < this.output.len() {
                let n = buf.remaining().min(this.output.len() - this.output_pos);
                buf.put_slice(&this.output[this.output_pos..this.output_pos + n]);
                this.output_pos += n;
                if this.output_pos == this.output.len() {
                    this.settle()?;
                }
                return Poll::Ready(Ok(()));
            }
            if matches!(this.mode, Mode::Forwarding) && this.input.is_empty() {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            if this.backlog {
                this.process()?;
                this.settle()?;
                continue;
            }
            let mut chunk = [0u8; READ_CHUNK];
            let mut chunk_buf = ReadBuf::new(&mut chunk);
            std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, &mut chunk_buf))?;
            let read = chunk_buf.filled();
            if read.is_empty() {
                // End of the stream: what is left is passed on for h2 to judge.
                this.forward_everything();
                if this.output.is_empty() {
                    this.settle()?;
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            this.input.extend_from_slice(read);
            this.process()?;
            this.settle()?;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Runs `input` (a client's bytes, preface included) through
/// [`AuthorityFix`] to its end, as `h2` would read it.
fn rewrite_all(input: &[u8]) -> io::Result<Vec<u8>> {
    let mut fixed = AuthorityFix::new(input);
    let mut out = Vec::new();
    let mut chunk = [0u8; 4096];
    let mut cx = Context::from_waker(std::task::Waker::noop());
    loop {
        let mut buf = ReadBuf::new(&mut chunk);
        match Pin::new(&mut fixed).poll_read(&mut cx, &mut buf) {
            // A byte slice is always ready.
            Poll::Pending => return Err(broken("a byte slice that is not ready")),
            Poll::Ready(Err(e)) => return Err(e),
            Poll::Ready(Ok(())) if buf.filled().is_empty() => return Ok(out),
            Poll::Ready(Ok(())) => out.extend_from_slice(buf.filled()),
        }
        let bound = MAX_HEADER_BLOCK + MAX_HEADER_BLOCK + 2 * MAX_FRAME_PAYLOAD;
        assert!(
            fixed.output.len() <= bound.max(input.len() + READ_CHUNK),
            "waiting output stays bounded"
        );
        assert!(
            fixed.first_block_raw.len() <= MAX_HEADER_BLOCK + MAX_FRAME_PAYLOAD + 1024,
            "a parked first block stays bounded"
        );
    }
}

/// Decoded header fields, (name, value).
pub(crate) type HeaderList = Vec<(Vec<u8>, Vec<u8>)>;

/// The property of the rewrite: `requests` encoded by one HPACK encoder
/// (its dynamic table used), each block split into frames of at most
/// `frame_size` bytes, read through [`AuthorityFix`], decode (with a
/// decoder of their own, as `h2`'s) to the same header lists, with
/// `:authority` as `localhost` if the first request's is not an authority;
/// and if it is one, the bytes pass unchanged. Panics if not.
pub(crate) fn check_rewrite(requests: &[HeaderList], frame_size: usize) {
    let mut encoder = loona_hpack::Encoder::new();
    let mut input = PREFACE.to_vec();
    write_frame(&mut input, 0x4, 0, 0, &[]);
    for (i, fields) in requests.iter().enumerate() {
        let stream_id = 1 + 2 * u32::try_from(i).unwrap_or(0);
        let block = encoder.encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let size = frame_size
            .clamp(1, MAX_FRAME_PAYLOAD)
            .max(block.len() / (MAX_BLOCK_FRAMES - 1) + 1);
        let mut parts: Vec<&[u8]> = block.chunks(size).collect();
        if parts.is_empty() {
            parts.push(&[]);
        }
        for (n, part) in parts.iter().enumerate() {
            let kind = if n == 0 { HEADERS } else { CONTINUATION };
            let flags = if n + 1 == parts.len() { END_HEADERS } else { 0 };
            write_frame(&mut input, kind, flags, stream_id, part);
        }
    }
    let output = rewrite_all(&input).expect("a well-formed stream within the bounds is rewritten");
    let rewritten = requests.first().is_some_and(|first| {
        first
            .iter()
            .find(|(n, _)| n == b":authority")
            .is_some_and(|(_, v)| http::uri::Authority::try_from(v.as_slice()).is_err())
    });
    if !rewritten {
        assert_eq!(
            output, input,
            "an acceptable authority: every byte unchanged"
        );
        return;
    }
    let decoded = decode_blocks(&output[PREFACE.len()..]);
    assert_eq!(decoded.len(), requests.len(), "every block is passed on");
    for ((stream_id, fields), (i, sent)) in decoded.iter().zip(requests.iter().enumerate()) {
        assert_eq!(*stream_id, 1 + 2 * u32::try_from(i).unwrap_or(0));
        let expected: HeaderList = sent
            .iter()
            .map(|(n, v)| {
                let v = if n == b":authority" {
                    LOCALHOST.to_vec()
                } else {
                    v.clone()
                };
                (n.clone(), v)
            })
            .collect();
        assert_eq!(fields, &expected, "the same headers but :authority");
    }
}

/// The header blocks of frames as `h2` decodes them: (stream, fields).
/// Panics on frames the rewrite must not write.
fn decode_blocks(mut rest: &[u8]) -> Vec<(u32, HeaderList)> {
    let mut decoder = loona_hpack::Decoder::new();
    let mut out = Vec::new();
    let mut pending: Option<(u32, Vec<u8>)> = None;
    while !rest.is_empty() {
        assert!(rest.len() >= FRAME_HEADER, "a whole frame header");
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        assert!(len <= MAX_FRAME_PAYLOAD, "a frame h2 accepts");
        let (kind, flags) = (rest[3], rest[4]);
        let id = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
        let payload = &rest[FRAME_HEADER..FRAME_HEADER + len];
        match (kind, pending.as_mut()) {
            (HEADERS, None) => {
                let (fragment, _) = headers_fragment(flags, payload).expect("a HEADERS frame");
                pending = Some((id, payload[fragment].to_vec()));
            }
            (CONTINUATION, Some((pending_id, block))) => {
                assert_eq!(*pending_id, id, "a CONTINUATION of its block's stream");
                block.extend_from_slice(payload);
            }
            (HEADERS | CONTINUATION, _) => panic!("a header block's frames out of order"),
            _ => {}
        }
        if matches!(kind, HEADERS | CONTINUATION) && flags & END_HEADERS != 0 {
            if let Some((id, block)) = pending.take() {
                out.push((
                    id,
                    decode(&mut decoder, &block).expect("the rewrite's HPACK"),
                ));
            }
        }
        rest = &rest[FRAME_HEADER + len..];
    }
    assert!(pending.is_none(), "no block left unfinished");
    out
}

/// The body of the `authority_fix` fuzz target: `data` as a client's bytes
/// after the preface (an answer or an error, never a panic, buffers
/// bounded), and `data` read as requests to encode, through
/// [`check_rewrite`].
pub fn fuzz_authority_fix(data: &[u8]) {
    let mut input = PREFACE.to_vec();
    input.extend_from_slice(data);
    let _ = rewrite_all(&input);
    let (frame_size, requests) = requests_from(data);
    check_rewrite(&requests, frame_size);
}

/// Requests made of `data`: its first two bytes a frame size, then
/// records of `[name length, value length, name, value]`; a record with an
/// empty name starts a new request, and a name byte of 0 reads as
/// `:authority`. The first request's `:authority` is what `data` says.
fn requests_from(data: &[u8]) -> (usize, Vec<HeaderList>) {
    let frame_size = match data {
        [a, b, ..] => usize::from(u16::from_be_bytes([*a, *b])),
        _ => MAX_FRAME_PAYLOAD,
    };
    let mut rest = data.get(2..).unwrap_or(&[]);
    let mut requests: Vec<HeaderList> = vec![Vec::new()];
    let mut size = 0usize;
    while let [name_len, value_len, after @ ..] = rest {
        let (name_len, value_len) = (usize::from(*name_len % 32), usize::from(*value_len));
        if after.len() < name_len + value_len {
            break;
        }
        let (name, after) = after.split_at(name_len);
        let (value, after) = after.split_at(value_len);
        rest = after;
        size += name.len() + value.len() + 32 + 16;
        if size > MAX_HEADER_BLOCK / 2 || requests.len() > 64 {
            break;
        }
        let name = if name.first() == Some(&0) {
            b":authority".as_slice()
        } else {
            name
        };
        match requests.last_mut() {
            Some(last) if !name.is_empty() => last.push((name.to_vec(), value.to_vec())),
            _ => requests.push(Vec::new()),
        }
    }
    (frame_size, requests)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::io::AsyncReadExt;

    /// Decoded header fields, (name, value).
    type Fields = Vec<(Vec<u8>, Vec<u8>)>;

    fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        write_frame(&mut out, kind, flags, stream_id, payload);
        out
    }

    fn request(authority: &str, path: &str) -> Fields {
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("workload.spiffe.io", "true"),
        ]
        .iter()
        .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
    }

    /// What a client sends: preface, SETTINGS, then two requests whose
    /// blocks come from one encoder (the second refers to the first's
    /// entries in the dynamic table), the first split over a CONTINUATION,
    /// with a DATA frame between.
    fn client_bytes(authority: &str) -> Vec<u8> {
        let mut encoder = loona_hpack::Encoder::new();
        let first = request(authority, "/SpiffeWorkloadAPI/FetchX509SVID");
        let second = request(authority, "/SpiffeWorkloadAPI/FetchX509Bundles");
        let block1 = encoder.encode(first.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let block2 = encoder.encode(second.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(0x4, 0, 0, &[]));
        let (a, b) = block1.split_at(block1.len() / 2);
        // PADDED with 3 bytes of padding.
        let mut padded = vec![3];
        padded.extend_from_slice(a);
        padded.extend_from_slice(&[0, 0, 0]);
        bytes.extend(frame(HEADERS, PADDED, 1, &padded));
        bytes.extend(frame(CONTINUATION, END_HEADERS, 1, b));
        bytes.extend(frame(0x0, END_STREAM, 1, &[0, 0, 0, 0, 0]));
        bytes.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &block2));
        bytes
    }

    async fn read_all(input: Vec<u8>) -> io::Result<Vec<u8>> {
        let mut fixed = AuthorityFix::new(input.as_slice());
        let mut out = Vec::new();
        // Small reads: the output must not depend on how h2 reads.
        let mut chunk = [0u8; 7];
        loop {
            let n = fixed.read(&mut chunk).await?;
            if n == 0 {
                return Ok(out);
            }
            out.extend_from_slice(&chunk[..n]);
        }
    }

    /// The header blocks of `bytes` (after the preface), decoded as h2
    /// would: (stream, END_STREAM, fields).
    fn blocks(bytes: &[u8]) -> Vec<(u32, bool, Fields)> {
        let mut decoder = loona_hpack::Decoder::new();
        let mut rest = &bytes[PREFACE.len()..];
        let mut out = Vec::new();
        let mut pending: Option<(u32, bool, Vec<u8>)> = None;
        while !rest.is_empty() {
            let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            let (kind, flags) = (rest[3], rest[4]);
            let id = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
            let payload = &rest[9..9 + len];
            match kind {
                HEADERS => {
                    let (fragment, _) = headers_fragment(flags, payload).unwrap();
                    pending = Some((id, flags & END_STREAM != 0, payload[fragment].to_vec()));
                }
                CONTINUATION => pending.as_mut().unwrap().2.extend_from_slice(payload),
                _ => {}
            }
            if matches!(kind, HEADERS | CONTINUATION) && flags & END_HEADERS != 0 {
                let (id, end, block) = pending.take().unwrap();
                out.push((id, end, decode(&mut decoder, &block).unwrap()));
            }
            rest = &rest[9 + len..];
        }
        out
    }

    #[tokio::test]
    async fn a_socket_path_as_authority_becomes_localhost_in_every_block() {
        let input = client_bytes("tmp%2Ftrial%2Fagent.sock");
        assert!(http::uri::Authority::try_from("tmp%2Ftrial%2Fagent.sock").is_err());
        let output = read_all(input.clone()).await.unwrap();
        let sent = blocks(&input);
        let seen = blocks(&output);
        assert_eq!(seen.len(), 2);
        for ((id, end, fields), (sent_id, sent_end, sent_fields)) in seen.iter().zip(&sent) {
            assert_eq!((id, end), (sent_id, sent_end));
            assert_eq!(fields.len(), sent_fields.len());
            for ((name, value), (sent_name, sent_value)) in fields.iter().zip(sent_fields) {
                assert_eq!(name, sent_name);
                if name == b":authority" {
                    assert_eq!(value, b"localhost");
                } else {
                    assert_eq!(value, sent_value);
                }
            }
        }
        // The DATA frame between the blocks is there, unchanged.
        let data = frame(0x0, END_STREAM, 1, &[0, 0, 0, 0, 0]);
        assert!(output.windows(data.len()).any(|w| w == data));
    }

    #[tokio::test]
    async fn a_proper_authority_leaves_every_byte_as_it_was() {
        let input = client_bytes("localhost");
        assert_eq!(read_all(input.clone()).await.unwrap(), input);
        // Not HTTP/2 at all: passed on for h2 to refuse.
        let junk = b"GET / HTTP/1.1\r\n\r\n".to_vec();
        assert_eq!(read_all(junk.clone()).await.unwrap(), junk);
    }

    #[tokio::test]
    async fn a_large_block_is_split_into_frames_h2_accepts() {
        let mut encoder = loona_hpack::Encoder::new();
        let mut fields = request("a%2Fb", "/x");
        let big = vec![b'x'; 20_000];
        fields.push((b"x-big".to_vec(), big.clone()));
        let block = encoder.encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let mut input = PREFACE.to_vec();
        let (a, b) = block.split_at(MAX_FRAME_PAYLOAD);
        input.extend(frame(HEADERS, 0, 1, a));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, b));
        let output = read_all(input).await.unwrap();
        let mut rest = &output[PREFACE.len()..];
        while !rest.is_empty() {
            let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            assert!(len <= MAX_FRAME_PAYLOAD, "{len}");
            rest = &rest[9 + len..];
        }
        let seen = blocks(&output);
        assert!(seen[0].2.contains(&(b"x-big".to_vec(), big)));
    }

    #[tokio::test]
    async fn broken_framing_inside_a_block_closes_the_connection() {
        let mut encoder = loona_hpack::Encoder::new();
        let fields = request("a%2Fb", "/x");
        let block = encoder.encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, 0, 1, &block));
        // A DATA frame where a CONTINUATION must come.
        input.extend(frame(0x0, 0, 1, b"x"));
        let err = read_all(input).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        // Empty CONTINUATION frames for ever: cut off, nothing piles up.
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, 0, 1, &block));
        for _ in 0..10_000 {
            input.extend(frame(CONTINUATION, 0, 1, &[]));
        }
        let mut fixed = AuthorityFix::new(input.as_slice());
        let mut chunk = [0u8; 4096];
        let err = loop {
            match fixed.read(&mut chunk).await {
                Ok(0) => panic!("the flood was passed on to its end"),
                Ok(_) => {}
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(
            fixed.first_block_raw.len()
                < MAX_BLOCK_FRAMES * (FRAME_HEADER + MAX_FRAME_PAYLOAD) + 8192
        );
        // Garbage that is not HPACK.
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            HEADERS,
            END_HEADERS,
            1,
            &[0xff, 0xff, 0xff, 0xff, 0xff],
        ));
        assert!(read_all(input).await.is_err());
    }

    /// Arbitrary bytes after the preface, and arbitrary cuts of a real
    /// exchange: an answer or an error, never a panic.
    #[tokio::test]
    async fn arbitrary_input_is_an_answer_or_an_error_never_a_panic() {
        let real = client_bytes("a%2Fb.sock");
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..2000 {
            let mut input = PREFACE.to_vec();
            if round % 2 == 0 {
                let len = (next() % 200) as usize;
                input.extend((0..len).map(|_| next() as u8));
            } else {
                // The real bytes with a few of them changed and cut short.
                input = real.clone();
                for _ in 0..(next() % 4) {
                    let at = PREFACE.len() + (next() as usize % (input.len() - PREFACE.len()));
                    input[at] = next() as u8;
                }
                input
                    .truncate(PREFACE.len() + (next() as usize % (real.len() - PREFACE.len() + 1)));
            }
            let _ = read_all(input).await;
        }
    }

    /// Whether `bytes` (after the preface) are whole frames, the last
    /// with END_HEADERS.
    fn ends_with_end_headers(bytes: &[u8]) -> bool {
        let mut rest = &bytes[PREFACE.len()..];
        let mut last_flags = 0;
        while rest.len() >= 9 {
            let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            if rest.len() < 9 + len {
                return false;
            }
            last_flags = rest[4];
            rest = &rest[9 + len..];
        }
        rest.is_empty() && last_flags & END_HEADERS != 0
    }

    /// A first block parked without END_HEADERS is held once, and
    /// nothing is kept once it completes.
    #[tokio::test]
    async fn a_parked_block_is_held_once_and_let_go_of_when_complete() {
        use tokio::io::AsyncWriteExt;
        for authority in ["a%2Fb.sock", "localhost"] {
            let mut encoder = loona_hpack::Encoder::new();
            let mut fields = request(authority, "/x");
            fields.push((b"x-big".to_vec(), vec![b'y'; 60_000]));
            let block = encoder.encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
            let parts: Vec<&[u8]> = block.chunks(MAX_FRAME_PAYLOAD).collect();
            let (client, server) = tokio::io::duplex(1 << 20);
            let mut fixed = AuthorityFix::new(server);
            let (mut client_read, mut client_write) = tokio::io::split(client);
            let mut sent = PREFACE.to_vec();
            sent.extend(frame(HEADERS, 0, 1, parts[0]));
            for part in &parts[1..parts.len() - 1] {
                sent.extend(frame(CONTINUATION, 0, 1, part));
            }
            client_write.write_all(&sent).await.unwrap();
            let mut chunk = [0u8; 4096];
            // The preface comes through; then the read waits for END_HEADERS.
            let n = fixed.read(&mut chunk).await.unwrap();
            assert_eq!(&chunk[..n], PREFACE);
            assert!(
                tokio::time::timeout(Duration::from_millis(1), fixed.read(&mut chunk))
                    .await
                    .is_err()
            );
            let parked = sent.len() - PREFACE.len();
            assert!(
                fixed.held_bytes() < parked + 2 * READ_CHUNK,
                "{authority}: {} held for {parked} parked",
                fixed.held_bytes()
            );
            client_write
                .write_all(&frame(CONTINUATION, END_HEADERS, 1, parts[parts.len() - 1]))
                .await
                .unwrap();
            let mut out = PREFACE.to_vec();
            while !ends_with_end_headers(&out) {
                let n = fixed.read(&mut chunk).await.unwrap();
                assert!(n > 0);
                out.extend_from_slice(&chunk[..n]);
            }
            assert!(blocks(&out)[0]
                .2
                .contains(&(b"x-big".to_vec(), vec![b'y'; 60_000])));
            let rewriting_table = if authority == "localhost" {
                0
            } else {
                HPACK_TABLE_SIZE
            };
            assert_eq!(
                fixed.held_bytes(),
                rewriting_table,
                "{authority}: nothing kept once the block is through"
            );
            drop(client_read.read(&mut chunk));
        }
    }

    /// A parked block past the pod's budget closes the connection, and
    /// the connection's charge is given back when it goes.
    #[tokio::test]
    async fn a_block_past_the_pods_budget_closes_the_connection() {
        use super::super::per_pod::{PerPodBytes, PodKey};
        use std::sync::atomic::{AtomicUsize, Ordering};
        let budget = PerPodBytes::new(40 * 1024);
        let key = PodKey::Pod("hostile".into());
        let refused = Arc::new(AtomicUsize::new(0));
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, 0, 1, &[0x82]));
        for _ in 0..4 {
            input.extend(frame(CONTINUATION, 0, 1, &[0x40; MAX_FRAME_PAYLOAD]));
        }
        let counted = refused.clone();
        let mut fixed = AuthorityFix::new(input.as_slice()).with_budget(
            budget.charge(key.clone()),
            Box::new(move |over| {
                assert_eq!(over.max, 40 * 1024);
                counted.fetch_add(1, Ordering::Relaxed);
            }),
        );
        let mut chunk = [0u8; 4096];
        let err = loop {
            match fixed.read(&mut chunk).await {
                Ok(0) => panic!("the parked block went through"),
                Ok(_) => assert!(budget.held_by(&key) <= 40 * 1024),
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert_eq!(refused.load(Ordering::Relaxed), 1);
        drop(fixed);
        assert_eq!(budget.held_by(&key), 0);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Whatever the headers, their order, the authority and the frame
        /// size, the rewritten stream decodes to the same headers but
        /// `:authority`.
        #[test]
        fn the_rewritten_stream_decodes_to_the_same_headers_but_authority(
            authority in proptest::prop_oneof![
                proptest::string::string_regex("[a-z0-9%./-]{0,40}").expect("a regex"),
                proptest::string::string_regex("[a-z0-9]{1,20}(:[0-9]{1,5})?").expect("a regex"),
            ],
            requests in proptest::collection::vec(
                proptest::collection::vec(
                    (
                        proptest::string::string_regex("[a-z0-9-]{1,24}").expect("a regex"),
                        proptest::collection::vec(proptest::num::u8::ANY, 0..300),
                    ),
                    0..12,
                ),
                1..6,
            ),
            frame_size in 1usize..20_000,
        ) {
            let requests: Vec<HeaderList> = requests
                .into_iter()
                .map(|fields| {
                    let mut list: HeaderList = vec![
                        (b":method".to_vec(), b"POST".to_vec()),
                        (b":authority".to_vec(), authority.as_bytes().to_vec()),
                    ];
                    list.extend(fields.into_iter().map(|(n, v)| (n.into_bytes(), v)));
                    list
                })
                .collect();
            check_rewrite(&requests, frame_size);
        }
    }

    /// Many one-byte blocks each naming a large table entry: what waits for
    /// h2 stays bounded however much they expand.
    #[tokio::test]
    async fn expanding_blocks_wait_for_h2_in_bounded_output() {
        let mut encoder = loona_hpack::Encoder::new();
        let mut fields = request("a%2Fb", "/x");
        fields.push((b"x-big".to_vec(), vec![b'x'; 3000]));
        let block = encoder.encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &block));
        let again = encoder.encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        assert!(
            again.len() < 64,
            "the encoder refers to its table: {}",
            again.len()
        );
        for stream in 0..500u32 {
            input.extend(frame(HEADERS, END_HEADERS, 3 + 2 * stream, &again));
        }
        let mut fixed = AuthorityFix::new(input.as_slice());
        let mut total = 0;
        let mut chunk = [0u8; 4096];
        loop {
            let n = fixed.read(&mut chunk).await.unwrap();
            assert!(
                fixed.output.len() <= MAX_HEADER_BLOCK + MAX_HEADER_BLOCK + 2 * MAX_FRAME_PAYLOAD
            );
            if n == 0 {
                break;
            }
            total += n;
        }
        assert!(total > 500 * 3000, "every block is passed on: {total}");
    }
}
