//! The lease protocol from the wire: acquisitions, renewals and returns of any shape,
//! including ids, epochs and levels no agent would send. A grant or a gRPC error,
//! never a panic. Two calls per input: the second settles what the first granted.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_server::RateLimiter;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let s = common::services();
    let Ok(req) = pb::LeaseRequest::decode(data) else { return };
    s.runtime.block_on(async {
        let _ = s.native.lease(tonic::Request::new(req.clone())).await;
        let _ = s.native.lease(tonic::Request::new(req)).await;
    });
});
