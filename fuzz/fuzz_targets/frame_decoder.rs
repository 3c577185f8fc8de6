//! Fuzz target: bytes, in reads of any size, into the gateway's FrameDecoder.
//! What must hold is in `spillway_fuzz::check_frame_decoder`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    spillway_fuzz::check_frame_decoder(data);
});
