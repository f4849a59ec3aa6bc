//! What replicas cost: three server nodes (static membership, memory store) take the
//! same saturating Envoy `ShouldRateLimit` load, spread over the three, with
//! replication off and on, alternating round by round so that a noisy machine moves
//! both. Every request is admitted and changes a counter, so every decision is a
//! change to replicate. With replication on, the delay from a change to its
//! replica's acknowledgement is read from the nodes' histograms.
//!
//! Run: `cargo run --release -p loadtest -- replication` (see `loadtest --help`).

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;

use crate::cpu;
use crate::procs::{Node, http_get};

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Seconds measured per setting per round.
    pub secs: u64,
    /// Rounds (each measures both settings, in alternating order).
    pub rounds: usize,
    /// Calls in flight.
    pub in_flight: usize,
    /// Tenants the requests cycle over (one roomy token bucket each).
    pub tenants: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self { secs: 5, rounds: 3, in_flight: 64, tenants: 1_000 }
    }
}

/// Waits until every node sees all of them in its ring.
async fn wait_ring(nodes: &[Node]) -> anyhow::Result<()> {
    for n in nodes {
        let mut c = RateLimiterClient::connect(n.url()).await?;
        let mut seen = 0;
        for _ in 0..200 {
            let t = c.topology(pb::TopologyRequest::default()).await?.into_inner();
            seen = t.members.len();
            if seen == nodes.len() && t.ready {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::ensure!(seen == nodes.len(), "{} sees {seen} members", n.id);
    }
    Ok(())
}

/// The cumulative buckets of a histogram summed over several `/metrics` bodies.
fn buckets(bodies: &[String], name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    let mut out: Vec<(f64, f64)> = Vec::new();
    for body in bodies {
        for line in body.lines() {
            let Some(rest) = line.strip_prefix(&prefix) else { continue };
            let Some((le, count)) = rest.split_once("\"} ") else { continue };
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::NAN) };
            let count: f64 = count.trim().parse().unwrap_or(0.0);
            match out.iter_mut().find(|(l, _)| *l == le) {
                Some(b) => b.1 += count,
                None => out.push((le, count)),
            }
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// The bucket bound at or under which quantile `q` of the samples fall.
fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets.iter().find(|(_, c)| *c >= q * total).map(|(le, _)| *le)
}

/// Lease calls one at a time, each to its tenant's owner (renewing its last lease),
/// on an idle cluster: their latencies' p50 and p99 in microseconds.
async fn lease_latency(nodes: &[Node], tenants: usize) -> anyhow::Result<(u64, u64)> {
    let mut clients = Vec::new();
    for n in nodes {
        clients.push(RateLimiterClient::connect(n.url()).await?);
    }
    let names: Vec<String> = (0..tenants.min(300)).map(|t| format!("tenant-{t}")).collect();
    let owners = clients[0]
        .topology(pb::TopologyRequest { tenants: names.clone() })
        .await?
        .into_inner()
        .owners;
    let mut held = vec![0u64; names.len()];
    let mut took = Vec::new();
    for round in 0..3 {
        for (i, t) in names.iter().enumerate() {
            let at = nodes.iter().position(|n| n.id == owners[i]).unwrap_or(0);
            let req = pb::LeaseRequest {
                agent_id: "replication-bench".into(),
                items: vec![pb::LeaseItem {
                    tenant: t.clone(),
                    route: "/api".into(),
                    lease_id: held[i],
                    unspent: 5,
                    want: 5,
                    cost: 0,
                    ..Default::default()
                }],
                epoch: 0,
            };
            let start = tokio::time::Instant::now();
            let r = clients[at].lease(req).await?.into_inner();
            if round > 0 {
                took.push(u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX));
            }
            held[i] = r.grants.first().map_or(0, |g| g.lease_id);
        }
    }
    took.sort_unstable();
    let q = |f: f64| {
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let i = ((took.len() as f64 * f) as usize).min(took.len().saturating_sub(1));
        took.get(i).copied().unwrap_or(0)
    };
    Ok((q(0.5), q(0.99)))
}

/// One measurement.
struct Measured {
    /// Decisions answered per second.
    rate: u64,
    /// With replication: the delay quantiles (p50, p99), seconds.
    delay: Option<(f64, f64)>,
    /// Replication messages acknowledged.
    messages: f64,
    /// Lease call p50 and p99 on the idle cluster, microseconds.
    lease: (u64, u64),
}

/// One measurement of one setting.
async fn measure(policy: &Path, on: bool, o: &Options) -> anyhow::Result<Measured> {
    let env = [("LIMITER__CLUSTER__REPLICATION".to_owned(), on.to_string())];
    let nodes = Node::start_all(3, policy, &env).await?;
    wait_ring(&nodes).await?;
    let mut clients = Vec::new();
    for n in &nodes {
        clients.push(cpu::connect(n.grpc).await?);
    }
    let load =
        cpu::Options { in_flight: o.in_flight, tenants: o.tenants, ..cpu::Options::default() };
    // Warm-up: connections, every tenant's counters, the first full copies.
    cpu::saturate(&clients, &load, Duration::from_secs(1)).await;
    let mut before = Vec::new();
    for n in &nodes {
        before.push(http_get(n.admin, "/metrics").await.map(|(_, b)| b).unwrap_or_default());
    }
    let rate = cpu::saturate(&clients, &load, Duration::from_secs(o.secs)).await;
    let mut after = Vec::new();
    for n in &nodes {
        after.push(http_get(n.admin, "/metrics").await.map(|(_, b)| b).unwrap_or_default());
    }
    let name = "limiter_replication_delay_seconds";
    let (b0, b1) = (buckets(&before, name), buckets(&after, name));
    // The measured span only: the warm-up's samples taken off, bucket by bucket.
    let span: Vec<(f64, f64)> = b1
        .iter()
        .map(|(le, c)| (*le, c - b0.iter().find(|(l, _)| l == le).map_or(0.0, |b| b.1)))
        .collect();
    let delay = quantile(&span, 0.5).zip(quantile(&span, 0.99));
    let messages: f64 = after
        .iter()
        .map(|b| crate::procs::metric(b, "limiter_replication_messages_total", &["ok"]))
        .sum::<f64>()
        - before
            .iter()
            .map(|b| crate::procs::metric(b, "limiter_replication_messages_total", &["ok"]))
            .sum::<f64>();
    let lease = lease_latency(&nodes, o.tenants).await?;
    drop(nodes);
    Ok(Measured { rate, delay, messages, lease })
}

fn ms(s: f64) -> String {
    if s.is_finite() { format!("{:.0} ms", s * 1e3) } else { "over 5 s".to_owned() }
}

/// Runs the comparison; the report as Markdown.
///
/// # Errors
///
/// When a node cannot be started or does not answer.
pub async fn run(o: &Options, dir: &Path) -> anyhow::Result<String> {
    let policy = dir.join("replication-policy.yaml");
    std::fs::write(&policy, cpu::policy(o.tenants))?;
    let mut md = format!(
        "Three nodes, {} tenants, {} calls in flight spread over the nodes, {} s per setting \
         per round, every request admitted (each one a counter change to replicate); then, \
         idle, 600 lease calls one at a time, each to its tenant's owner:\n\n\
         | round | decisions/s, off | on | on / off | change to replica ack p50 / p99 | \
         messages/s | lease call p50 / p99, off | on |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        o.tenants, o.in_flight, o.secs
    );
    for round in 0..o.rounds {
        let order = if round % 2 == 0 { [false, true] } else { [true, false] };
        let mut off = None;
        let mut on = None;
        for setting in order {
            let m = measure(&policy, setting, o).await?;
            if setting {
                on = Some(m);
            } else {
                off = Some(m);
            }
        }
        let (Some(off), Some(on)) = (off, on) else { continue };
        #[allow(clippy::cast_precision_loss)] // a ratio of counts
        let ratio = on.rate as f64 / off.rate.max(1) as f64;
        let delay = on
            .delay
            .map_or_else(|| "none".to_owned(), |(p50, p99)| format!("{} / {}", ms(p50), ms(p99)));
        #[allow(clippy::cast_precision_loss)] // a rate
        let per_sec = on.messages / o.secs as f64;
        writeln!(
            md,
            "| {} | {} | {} | **{ratio:.2}x** | {delay} | {per_sec:.0} | {} / {} µs | {} / {} µs |",
            round + 1,
            off.rate,
            on.rate,
            off.lease.0,
            off.lease.1,
            on.lease.0,
            on.lease.1
        )?;
    }
    Ok(md)
}
