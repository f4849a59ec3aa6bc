//! `loadtest`: the limiter's open-loop load generator.
//!
//! A [`scenario::Scenario`] (YAML) says what to offer: simulated gateways, tenants and
//! their skew, routes and costs, the offered rate over time, and faults at given times.
//! [`run::run`] offers it open-loop (arrivals never wait for answers, requests that
//! cannot be sent on time are counted as late or unsent), against our native API,
//! Envoy's `ShouldRateLimit`, the embedded agent, or the empty RPC (the transport
//! floor), and returns a [`report::Report`]: rates per second, latency percentiles
//! from an HDR histogram, and accuracy per tenant against an exact single-node model
//! of the same policy ([`model`]). [`bench`] runs the standard scenarios and writes
//! `BENCHMARKS.md`'s generated section.

pub mod bench;
pub mod chart;
pub mod cpu;
pub mod gateway;
pub mod judge;
pub mod model;
pub mod peers;
pub mod procs;
pub mod record;
pub mod replication;
pub mod report;
pub mod rlqs;
pub mod run;
pub mod scenario;
pub mod target;
pub mod workload;
