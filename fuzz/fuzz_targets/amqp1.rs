//! Fuzz target: AMQP 1.0 input the gateway parses itself (SASL init, open,
//! addresses) and the mapping of 1.0 messages to 0-9-1 and back. What must
//! hold is in `spillway_fuzz::check_amqp1`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    spillway_fuzz::check_amqp1(data);
});
