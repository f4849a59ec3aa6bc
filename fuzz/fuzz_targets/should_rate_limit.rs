//! Envoy's `ShouldRateLimit` from the wire, on a fresh server per input: decoding,
//! the descriptor mapping, validation and the decision. An answer consistent with the
//! request (`common.rs`) or a short gRPC error, never a panic.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use limiter_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(req) = RateLimitRequest::decode(data) else { return };
    let s = common::fresh();
    common::block_on(common::should_rate_limit(&s, req));
});
