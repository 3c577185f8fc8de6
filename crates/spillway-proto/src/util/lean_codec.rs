//! The codec of Spillway's internal gRPC services: prost's, with smaller
//! starting buffers.
//!
//! tonic gives every stream an encode buffer and a decode buffer of 8 KiB
//! (its default), allocated when the stream opens and kept while it lives.
//! A gateway session is one stream each way, so in the separate wiring every
//! idle client connection held four of them (gateway and engine, encode and
//! decode): 32 KiB of the connection's memory (case h, docs/performance-history.md).
//! Here they start at 1 KiB and grow with what passes through them, as they
//! did past 8 KiB before.
//!
//! Not hand-written encoding: prost's encoder and decoder, only with
//! [`BufferSettings`] other than the default, which is what tonic offers
//! the setting for.

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Starting size of a stream's encode and decode buffers.
pub const STREAM_BUFFER_BYTES: usize = 1024;
/// Encoded bytes after which a stream's encoder hands them on (tonic's
/// default).
const YIELD_THRESHOLD: usize = 32 * 1024;

/// prost's codec with [`STREAM_BUFFER_BYTES`] starting buffers; the
/// generated clients and servers use it (`codec_path`).
#[derive(Debug, Clone)]
pub struct LeanCodec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for LeanCodec<T, U> {
    fn default() -> Self {
        Self {
            _types: PhantomData,
        }
    }
}

fn settings() -> BufferSettings {
    BufferSettings::new(STREAM_BUFFER_BYTES, YIELD_THRESHOLD)
}

impl<T, U> Codec for LeanCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(settings())
    }
}
