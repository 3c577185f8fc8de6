//! AMQP 0-9-1: the connection and channel state machine ([`connection`],
//! no I/O: bytes in, commands and bytes out) and the I/O loop that drives
//! it over a client's socket (`io.rs`). The listener (`server.rs`) hands a
//! client here once its protocol header names 0-9-1 (or names nothing this
//! gateway speaks: the 0-9-1 handshake answers with its own header).

pub mod connection;
mod io;

pub(crate) use io::serve;
