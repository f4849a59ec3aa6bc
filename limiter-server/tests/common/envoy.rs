//! Envoy rate limit service messages for tests.

use limiter_proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use limiter_proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use limiter_proto::envoy::service::ratelimit::v3::RateLimitResponse;

/// A descriptor of `entries` with an optional per-descriptor `hits_addend`.
pub(crate) fn descriptor(entries: &[(&str, &str)], hits: Option<u64>) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry { key: (*k).into(), value: (*v).into() })
            .collect(),
        limit: None,
        hits_addend: hits,
    }
}

/// The value of the response header `name`, if the answer adds it.
pub(crate) fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add.iter().find(|h| h.key == name).map(|h| h.value.as_str())
}
