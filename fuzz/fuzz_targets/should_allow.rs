//! `ShouldAllow` and `ShouldAllowBatch` from the wire, on a fresh server per input:
//! decoding, validation and the decision. Whatever the bytes, an answer consistent
//! with the request (`common.rs`) or a short gRPC error, never a panic.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use limiter_proto::limiter::v1 as pb;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else { return };
    let s = common::fresh();
    common::block_on(async {
        if which % 2 == 0 {
            if let Ok(req) = pb::ShouldAllowRequest::decode(bytes) {
                let _ = common::should_allow(&s, req).await;
            }
        } else if let Ok(req) = pb::ShouldAllowBatchRequest::decode(bytes) {
            common::should_allow_batch(&s, req).await;
        }
    });
});
