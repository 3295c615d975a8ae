//! The protobuf codec of the CA service: prost, with buffers sized to the
//! messages instead of tonic's 8 KiB per call.
//!
//! tonic gives every response an 8 KiB encode buffer, and the encoded
//! message shares that allocation until HTTP/2 has written it to the
//! socket. A certificate chain is 2–4 KiB, so during a mass restart — when
//! thousands of finished answers wait for their connection's turn to write
//! — most of the CA's memory was empty buffer space (docs/benchmarks-history.md).
//! [`CaCodec`] encodes each
//! message into an allocation of exactly its size and decodes requests with
//! a 2 KiB buffer, which grows if a request is larger.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstDecoder};

/// Initial encode buffer: room for the gRPC frame header, then grown to the
/// message's exact size before encoding.
const ENCODE_BUFFER_BYTES: usize = 64;
/// Initial decode buffer: a P-256 CSR with its metadata is about 1 KiB.
const DECODE_BUFFER_BYTES: usize = 2 * 1024;
/// tonic's default: a streaming encoder yields after this many bytes.
const YIELD_THRESHOLD_BYTES: usize = 32 * 1024;

/// prost encoding and decoding with message-sized buffers (see the module
/// documentation); the generated client and server use it.
#[derive(Debug, Clone)]
pub struct CaCodec<T, U> {
    _messages: PhantomData<(T, U)>,
}

impl<T, U> Default for CaCodec<T, U> {
    fn default() -> Self {
        Self {
            _messages: PhantomData,
        }
    }
}

impl<T, U> Codec for CaCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ExactSizeEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ExactSizeEncoder {
            _message: PhantomData,
        }
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::new(
            DECODE_BUFFER_BYTES,
            YIELD_THRESHOLD_BYTES,
        ))
    }
}

/// Encodes a prost message into a buffer reserved to its encoded length.
#[derive(Debug, Clone)]
pub struct ExactSizeEncoder<T> {
    _message: PhantomData<T>,
}

impl<T: Message> Encoder for ExactSizeEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.reserve(item.encoded_len());
        item.encode(buf)
            .map_err(|e| Status::internal(format!("encoding the response: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::new(ENCODE_BUFFER_BYTES, YIELD_THRESHOLD_BYTES)
    }
}
