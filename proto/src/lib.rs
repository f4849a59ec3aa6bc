//! limiter-proto: the gRPC definitions the server, the agent and load tests share.
//!
//! - [`limiter::v1`]: our native API (`ShouldAllow`, batches, cost reports).
//! - [`envoy`]: a wire-compatible declaration of Envoy's rate limit service v3
//!   (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`), so that real
//!   Envoy proxies can call us, and of its Rate Limit Quota Service (RLQS,
//!   `envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas`),
//!   which Envoy's `rate_limit_quota` filter streams usage reports to. Only the
//!   messages those services use are declared.
//! - [`connect`]: how clients reach a server: TLS, client certificates, bearer tokens.
//!
//! Generated at build time by `build.rs` with protox (no system `protoc`).

#![allow(missing_docs, clippy::all, clippy::pedantic)] // generated code

pub mod connect;

/// Every message and service declared here, as an encoded `FileDescriptorSet` (what
/// gRPC server reflection answers with).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));

/// Our native API.
pub mod limiter {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("limiter.v1");
    }
}

/// Envoy's rate limit service, wire-compatible.
pub mod envoy {
    /// `envoy.config.*`
    pub mod config {
        /// `envoy.config.core`
        pub mod core {
            /// `envoy.config.core.v3`
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
    /// `envoy.extensions.*`
    pub mod extensions {
        /// `envoy.extensions.common`
        pub mod common {
            /// `envoy.extensions.common.ratelimit`
            pub mod ratelimit {
                /// `envoy.extensions.common.ratelimit.v3`
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }
    /// `envoy.service.*`
    pub mod service {
        /// `envoy.service.ratelimit`
        pub mod ratelimit {
            /// `envoy.service.ratelimit.v3`
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
            }
        }
        /// `envoy.service.rate_limit_quota`
        pub mod rate_limit_quota {
            /// `envoy.service.rate_limit_quota.v3`
            pub mod v3 {
                tonic::include_proto!("envoy.service.rate_limit_quota.v3");
            }
        }
    }
    /// `envoy.type.*`
    pub mod r#type {
        /// `envoy.type.v3`
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }
}
