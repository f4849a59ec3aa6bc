//! `ShouldAllow` and `ShouldAllowBatch` from the wire, on a fresh server per input:
//! decoding, validation and the decision. Whatever the bytes, an answer consistent
//! with the request (`common.rs`) or a short gRPC error, never a panic.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let s = common::fresh();
    common::block_on(common::should_allow_input(&s, data));
});
