//! AMQP 0-9-1 as Spillway speaks it, apart from any connection, socket or
//! broker state:
//!
//! - [`codec`]: the byte stream split into frames (payloads not copied,
//!   frame-max enforced) and outbound frames written, with hand-written fast
//!   paths for the methods on the message path (`basic.publish`,
//!   `basic.deliver`, `basic.ack`) and `amq-protocol` for the rest;
//! - [`nesting`]: the bound on how deep a client's field tables and arrays
//!   nest, checked before any recursive parser sees them;
//! - the vocabulary every component shares: reply codes and RabbitMQ's names
//!   for them ([`reply_code`], [`reply_text`]), which codes close only the
//!   channel, [`MethodId`], and field tables as they travel between
//!   components ([`encode_table`], [`decode_table`]);
//! - [`properties`]: what the broker reads of a published message's
//!   properties, parsed once where the message comes in.
//!
//! The gateway's connection and channel state machines use it; so do the
//! load generator and the fuzz targets, without the gateway's server.

pub mod codec;
pub mod nesting;
pub mod properties;
mod vocabulary;

pub use vocabulary::{
    closes_only_the_channel, decode_table, encode_table, reply_code, reply_name, reply_text,
    MethodId, TableError,
};
