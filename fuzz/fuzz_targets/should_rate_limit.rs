//! Envoy's `ShouldRateLimit` from the wire: decoding, the descriptor mapping,
//! validation and the decision. An answer or a gRPC error, never a panic.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use limiter_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let s = common::services();
    if let Ok(req) = RateLimitRequest::decode(data) {
        s.runtime.block_on(async {
            let _ = s.envoy.should_rate_limit(tonic::Request::new(req)).await;
        });
    }
});
