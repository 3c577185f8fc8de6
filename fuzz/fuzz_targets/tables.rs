//! Fuzz target: field tables, method payloads, content headers and AMQPLAIN responses into their parsers.
//! What must hold is in `spillway_fuzz::check_tables`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    spillway_fuzz::check_tables(data);
});
