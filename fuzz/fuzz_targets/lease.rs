//! The lease protocol from the wire, on a fresh server per input: acquisitions,
//! renewals and returns of any shape, including ids, epochs and levels no agent
//! would send. Grants within what the policy allows (`common.rs`) or a short gRPC
//! error, never a panic. Two calls per input: the second settles what the first
//! granted.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use limiter_proto::limiter::v1 as pb;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(req) = pb::LeaseRequest::decode(data) else { return };
    let s = common::fresh();
    common::block_on(common::lease(&s, req));
});
