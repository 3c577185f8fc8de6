//! Fuzz target: frames into a Connection after connection.open, with a simulated engine answering.
//! What must hold is in `spillway_fuzz::check_connection`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    spillway_fuzz::check_connection(data);
});
