//! The gRPC services, the top of the server: our `limiter.v1.RateLimiter`
//! ([`native`]), Envoy's `ShouldRateLimit` ([`envoy`]) and Envoy's quota streams
//! ([`rlqs`]), each resolving a call to
//! this node's owner or a forward to another node ([`routing`]), and turning the
//! owner's answers into wire messages.

pub mod envoy;
pub mod native;
pub mod rlqs;
pub mod routing;
