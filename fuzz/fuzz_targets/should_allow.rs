//! `ShouldAllow` and `ShouldAllowBatch` from the wire: decoding, validation and the
//! decision. Whatever the bytes, an answer or a gRPC error, never a panic.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_server::RateLimiter;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else { return };
    let s = common::services();
    s.runtime.block_on(async {
        if which % 2 == 0 {
            if let Ok(req) = pb::ShouldAllowRequest::decode(bytes) {
                let _ = s.native.should_allow(tonic::Request::new(req)).await;
            }
        } else if let Ok(req) = pb::ShouldAllowBatchRequest::decode(bytes) {
            let _ = s.native.should_allow_batch(tonic::Request::new(req)).await;
        }
    });
});
