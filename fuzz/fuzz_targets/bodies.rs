//! Fuzz target: message bodies as held (compressed or not, with any declared size) into their decoder, and published bodies through compression and back.
//! What must hold is in `spillway_fuzz::check_bodies`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    spillway_fuzz::check_bodies(data);
});
