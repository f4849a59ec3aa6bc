//! Server CPU per decision against the floor: this server and an empty Envoy RLS
//! server (one that answers `OK` to everything, on the same tonic transport) take the
//! same open-loop Envoy `ShouldRateLimit` load in turn, and the CPU time each process
//! spends (all its threads, from `/proc/<pid>/task/*/schedstat`) is divided by the
//! requests it answered. The two alternate round by round, so a noisy machine moves
//! both. Then each is driven at saturation (a fixed number in flight) for throughput.
//!
//! Run: `cargo run --release -p loadtest -- cpu` (see `loadtest cpu --help`).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use limiter_proto::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor::Entry,
};
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use limiter_proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio::time::Instant;
use tonic::transport::Channel;

use crate::procs::{Node, free_addr, own_binary};

/// The role of the empty server's process, and where it listens.
pub const EMPTY_ROLE: &str = "empty-rls";
const LISTEN: &str = "LOADTEST_LISTEN";

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Requests per second offered, open loop.
    pub rate: u64,
    /// Tenants the requests cycle over (one token bucket each, roomy).
    pub tenants: usize,
    /// Seconds measured per target per round.
    pub secs: u64,
    /// Rounds (each measures both targets, in alternating order).
    pub rounds: usize,
    /// Calls in flight at saturation.
    pub in_flight: usize,
    /// Connections the load is spread over (gateways).
    pub connections: usize,
    /// Extra `LIMITER__*` settings for the server.
    pub server_env: Vec<(String, String)>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            rate: 8_000,
            tenants: 1_000,
            secs: 5,
            rounds: 3,
            in_flight: 64,
            connections: 4,
            server_env: Vec::new(),
        }
    }
}

/// The empty RLS server: `OK` for every descriptor, nothing else.
#[derive(Debug, Clone, Copy)]
struct Empty;

#[tonic::async_trait]
impl RateLimitService for Empty {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let statuses = request
            .get_ref()
            .descriptors
            .iter()
            .map(|_| DescriptorStatus { code: Code::Ok.into(), ..Default::default() })
            .collect();
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: Code::Ok.into(),
            statuses,
            ..Default::default()
        }))
    }
}

/// The empty server's process: serves on `LOADTEST_LISTEN` until killed.
///
/// # Errors
///
/// A missing or unusable address.
pub fn empty_main() -> anyhow::Result<()> {
    let addr: SocketAddr = std::env::var(LISTEN).context(LISTEN)?.parse()?;
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async move {
        tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .add_service(RateLimitServiceServer::new(Empty))
            .serve(addr)
            .await
    })?;
    Ok(())
}

/// A child process, killed when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Nanoseconds of CPU that process `pid` has used, over all its threads.
pub(crate) fn cpu_ns(pid: u32) -> anyhow::Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let stat = std::fs::read_to_string(task?.path().join("schedstat")).unwrap_or_default();
        total += stat.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    }
    Ok(total)
}

pub(crate) async fn connect(addr: SocketAddr) -> anyhow::Result<RateLimitServiceClient<Channel>> {
    for _ in 0..200 {
        if let Ok(c) = RateLimitServiceClient::connect(format!("http://{addr}")).await {
            return Ok(c);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("{addr} does not answer")
}

fn request(tenant: usize) -> RateLimitRequest {
    RateLimitRequest {
        domain: format!("tenant-{tenant}"),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry { key: "route".into(), value: "/api".into() }],
            limit: None,
            hits_addend: None,
        }],
        hits_addend: 0,
    }
}

/// What one target did in one measurement.
#[derive(Debug, Clone, Copy, Default)]
struct Measured {
    answered: u64,
    refused: u64,
    errors: u64,
    cpu_ns: u64,
}

impl Measured {
    #[allow(clippy::cast_precision_loss)] // figures for a report
    fn us_per_request(&self) -> f64 {
        self.cpu_ns as f64 / 1_000.0 / self.answered.max(1) as f64
    }
}

/// Offers `rate` requests a second for `dur`, open loop (each sent at its planned
/// time whatever the answers do), and waits for every answer.
async fn open_loop(
    clients: &[RateLimitServiceClient<Channel>],
    o: &Options,
    dur: Duration,
    first: &AtomicU64,
) -> Measured {
    let total = o.rate * dur.as_secs();
    let counts = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let mut tasks = tokio::task::JoinSet::new();
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let mut sent = 0u64;
    while sent < total {
        tick.tick().await;
        let due = u64::try_from(start.elapsed().as_nanos() * u128::from(o.rate) / 1_000_000_000)
            .unwrap_or(u64::MAX)
            .min(total);
        while sent < due {
            let n = first.fetch_add(1, Ordering::Relaxed);
            let n = usize::try_from(n).unwrap_or(0);
            let mut c = clients[n % clients.len()].clone();
            let counts = counts.clone();
            let tenant = n % o.tenants;
            tasks.spawn(async move {
                let i = match c.should_rate_limit(request(tenant)).await {
                    Ok(r) if r.get_ref().overall_code == Code::Ok as i32 => 0,
                    Ok(_) => 1,
                    Err(_) => 2,
                };
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            sent += 1;
        }
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let get = |i: usize| counts[i].load(Ordering::Relaxed);
    Measured { answered: get(0) + get(1), refused: get(1), errors: get(2), cpu_ns: 0 }
}

/// Answers a second with `in_flight` calls always outstanding, for `dur`.
pub(crate) async fn saturate(
    clients: &[RateLimitServiceClient<Channel>],
    o: &Options,
    dur: Duration,
) -> u64 {
    let answered = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + dur;
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..o.in_flight {
        let mut c = clients[w % clients.len()].clone();
        let (answered, tenants) = (answered.clone(), o.tenants);
        tasks.spawn(async move {
            let mut n = w;
            while Instant::now() < end {
                if c.should_rate_limit(request(n % tenants)).await.is_ok() {
                    answered.fetch_add(1, Ordering::Relaxed);
                }
                n += 64;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    answered.load(Ordering::Relaxed) / dur.as_secs().max(1)
}

pub(crate) fn policy(tenants: usize) -> String {
    let mut p = String::from("version: 1\nunknown_tenants: reject\ntenants:\n");
    for t in 0..tenants {
        p.push_str(&format!(
            "  tenant-{t}:\n    limit: {{ algorithm: token_bucket, rate: 1000000/s, burst: 1000000 }}\n"
        ));
    }
    p
}

/// One target: its name, where it listens, its process.
struct Target {
    name: &'static str,
    clients: Vec<RateLimitServiceClient<Channel>>,
    pid: u32,
}

/// Runs the comparison; the report as Markdown.
///
/// # Errors
///
/// When a process cannot be started or does not answer.
pub async fn run(o: &Options, dir: &Path) -> anyhow::Result<String> {
    let policy_file = dir.join("cpu-policy.yaml");
    std::fs::write(&policy_file, policy(o.tenants))?;
    let mut nodes = Node::start_all(1, &policy_file, &o.server_env).await?;
    let ours = nodes.remove(0);
    let empty_addr = free_addr()?;
    let empty = Child(
        std::process::Command::new(own_binary()?)
            .env(crate::procs::ROLE, EMPTY_ROLE)
            .env(LISTEN, empty_addr.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .context("starting the empty RLS server")?,
    );
    let mut targets = Vec::new();
    for (name, addr, pid) in [
        ("empty RLS server", empty_addr, empty.0.id()),
        ("limiter-server", ours.grpc, ours.pid().context("server pid")?),
    ] {
        let mut clients = Vec::new();
        for _ in 0..o.connections {
            clients.push(connect(addr).await?);
        }
        targets.push(Target { name, clients, pid });
    }
    let first = AtomicU64::new(0);
    let measure = Duration::from_secs(o.secs);
    // Connections, caches and counters warm on both before anything is measured.
    for t in &targets {
        open_loop(&t.clients, o, Duration::from_secs(1), &first).await;
    }
    let mut rows: Vec<[(Measured, u64); 2]> = Vec::new();
    for round in 0..o.rounds {
        let mut row = [(Measured::default(), 0); 2];
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let t = &targets[i];
            let before = cpu_ns(t.pid)?;
            let mut m = open_loop(&t.clients, o, measure, &first).await;
            m.cpu_ns = cpu_ns(t.pid)?.saturating_sub(before);
            let throughput = saturate(&t.clients, o, measure).await;
            eprintln!(
                "round {}: {}: {:.1} us CPU per request ({} answered, {} refused, {} errors), {} answered/s at {} in flight",
                round + 1,
                t.name,
                m.us_per_request(),
                m.answered,
                m.refused,
                m.errors,
                throughput,
                o.in_flight
            );
            row[i] = (m, throughput);
        }
        rows.push(row);
    }
    drop(empty);
    drop(ours);
    Ok(markdown(o, &targets, &rows))
}

#[allow(clippy::cast_precision_loss)] // figures for a report
fn markdown(o: &Options, targets: &[Target], rows: &[[(Measured, u64); 2]]) -> String {
    let mut md = format!(
        "CPU per request: {} requests/s offered open loop for {} s per target and round, Envoy \
         `ShouldRateLimit` over {} tenants (one token bucket each, every request admitted), \
         {} connections; then {} calls in flight for {} s. The targets alternate order every \
         round.\n\n| round | {} CPU/request | {} CPU/request | ratio | {} answered/s | {} answered/s | ratio |\n|---|---|---|---|---|---|---|\n",
        o.rate,
        o.secs,
        o.tenants,
        o.connections,
        o.in_flight,
        o.secs,
        targets[0].name,
        targets[1].name,
        targets[0].name,
        targets[1].name
    );
    let (mut cpu, mut thr) = (Vec::new(), Vec::new());
    for (r, [(e, et), (s, st)]) in rows.iter().enumerate() {
        let c = s.us_per_request() / e.us_per_request();
        let t = *st as f64 / (*et).max(1) as f64;
        cpu.push(c);
        thr.push(t);
        md.push_str(&format!(
            "| {} | {:.1} us | {:.1} us | **{c:.2}x** | {et} | {st} | {t:.2}x |\n",
            r + 1,
            e.us_per_request(),
            s.us_per_request()
        ));
    }
    let spread = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(0.0, f64::max);
        format!("{lo:.2}x to {hi:.2}x")
    };
    md.push_str(&format!(
        "\nCPU per request against the empty server: {}; throughput at saturation: {}.\n",
        spread(&cpu),
        spread(&thr)
    ));
    md
}
