//! Fuzz target: the management HTTP API's handling of query strings and
//! JSON bodies. What must hold is in `fuzz/src/http_api.rs`.
#![no_main]

#[path = "../src/http_api.rs"]
mod http_api;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    http_api::check_http_api(data);
});
