//! Fuzz target: a client's protocol header and frames into the server side of the handshake.
//! What must hold is in `spillway_fuzz::check_handshake`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    spillway_fuzz::check_handshake(data);
});
