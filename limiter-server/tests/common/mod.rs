//! A real server on loopback ports, started in-process for a test.

#![allow(dead_code)] // each test binary uses a different part

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use limiter_proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use limiter_server::config::ServerConfig;
use limiter_server::{Running, Server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub(crate) mod envoy;
pub(crate) mod pki;
pub(crate) mod process;
pub(crate) mod redis;
use tonic::transport::Channel;

pub(crate) struct TestServer {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    pub dir: tempfile::TempDir,
    pub policy: PathBuf,
    running: Running,
    /// The Redis the server's store is in, if any (stopped with the server).
    pub redis: Option<redis::RedisServer>,
}

/// Runs a test file's tests once per store: `$tests!()` expands them, in a module
/// `memory` and a module `redis` where `BACKEND` names the store.
#[macro_export]
macro_rules! on_each_store {
    ($tests:ident) => {
        mod memory {
            use super::*;
            const BACKEND: Backend = Backend::Memory;
            $tests!();
        }

        mod redis {
            use super::*;
            const BACKEND: Backend = Backend::Redis;
            $tests!();
        }
    };
}

/// The store a test server runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    /// In memory (the default).
    Memory,
    /// A `redis-server` of its own, with this server's batches.
    Redis,
}

impl TestServer {
    /// Starts a server on `policy` with extra `LIMITER__*` settings.
    pub(crate) async fn start_with(policy: &str, env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policies.yaml");
        std::fs::write(&path, policy).unwrap();
        let mut vars = vec![
            ("LIMITER__POLICY_FILE".to_owned(), path.display().to_string()),
            ("LIMITER__SHUTDOWN__DRAIN_DELAY_MS".to_owned(), "0".to_owned()),
            ("LIMITER__SHUTDOWN__GRACE_MS".to_owned(), "2000".to_owned()),
            ("LIMITER__RELOAD__POLL_INTERVAL_MS".to_owned(), "500".to_owned()),
        ];
        vars.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        let config = ServerConfig::load_with_env(None, vars).unwrap();
        let running = Server::new(config).unwrap().spawn_local().await.unwrap();
        Self { grpc: running.grpc, admin: running.admin, dir, policy: path, running, redis: None }
    }

    /// Starts a server on `policy` with its store on `backend`.
    pub(crate) async fn start_on(backend: Backend, policy: &str) -> Self {
        Self::start_on_with(backend, policy, &[]).await
    }

    /// Like [`Self::start_on`] with extra `LIMITER__*` settings.
    pub(crate) async fn start_on_with(
        backend: Backend,
        policy: &str,
        env: &[(&str, &str)],
    ) -> Self {
        match backend {
            Backend::Memory => Self::start_with(policy, env).await,
            Backend::Redis => {
                let redis = redis::RedisServer::start();
                let url = redis.url();
                let mut vars =
                    vec![("LIMITER__STORE__KIND", "redis"), ("LIMITER__STORE__REDIS__URL", &url)];
                vars.extend_from_slice(env);
                let mut s = Self::start_with(policy, &vars).await;
                s.redis = Some(redis);
                s
            }
        }
    }

    pub(crate) async fn start(policy: &str) -> Self {
        Self::start_with(policy, &[]).await
    }

    /// This server's decision logic (its store, leases and policies), for what the
    /// process-wide metrics cannot tell apart between the servers of one test binary.
    pub(crate) fn owner(&self) -> &std::sync::Arc<limiter_server::owner::Owner> {
        &self.running.owner
    }

    pub(crate) async fn native(&self) -> RateLimiterClient<Channel> {
        RateLimiterClient::connect(format!("http://{}", self.grpc)).await.unwrap()
    }

    pub(crate) async fn envoy(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc)).await.unwrap()
    }

    /// GET on the admin port: (status, body).
    pub(crate) async fn get(&self, path: &str) -> (u16, String) {
        http_get(self.admin, path).await
    }

    /// Stops the server and waits for it.
    pub(crate) async fn stop(self) {
        tokio::time::timeout(Duration::from_secs(10), self.running.stop()).await.unwrap().unwrap();
    }
}

/// A minimal HTTP/1.1 GET (no client library needed for a loopback admin port).
pub(crate) async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    http_get_with(addr, path, "").await
}

/// Like [`http_get`] with extra header lines (each ending in `\r\n`).
pub(crate) async fn http_get_with(addr: SocketAddr, path: &str, headers: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    // Chunked bodies: good enough to search in; strip nothing.
    (status, body)
}

/// `LIMITER__*` settings as `ServerConfig::load_with_env` takes them.
pub(crate) fn settings(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

/// The settings of node `a` of a static cluster of `a` and `b` on ports nothing
/// listens on, with `extra` ones after them.
pub(crate) fn node_a(extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v = settings(&[
        ("LIMITER__POLICY_FILE", "p.yaml"),
        ("LIMITER__CLUSTER__MEMBERSHIP", "static"),
        ("LIMITER__CLUSTER__PEERS", "a=127.0.0.1:1,b=127.0.0.1:2"),
        ("LIMITER__CLUSTER__NODE_ID", "a"),
    ]);
    v.extend(settings(extra));
    v
}

pub(crate) fn ask(tenant: &str, route: &str) -> pb::ShouldAllowRequest {
    pb::ShouldAllowRequest { tenant: tenant.into(), route: route.into(), ..Default::default() }
}

pub(crate) fn ask_key(tenant: &str, route: &str, key: &str) -> pb::ShouldAllowRequest {
    pb::ShouldAllowRequest { key: key.into(), ..ask(tenant, route) }
}

pub(crate) fn ask_cost(tenant: &str, route: &str, cost: u64) -> pb::ShouldAllowRequest {
    pb::ShouldAllowRequest { cost: Some(cost), ..ask(tenant, route) }
}

/// Sends `req` `n` times; returns how many were allowed.
pub(crate) async fn allowed_of(
    c: &mut RateLimiterClient<Channel>,
    req: &pb::ShouldAllowRequest,
    n: usize,
) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        if c.should_allow(req.clone()).await.unwrap().into_inner().allowed {
            ok += 1;
        }
    }
    ok
}

/// Polls `f` every 20 ms until it is true or `within` passes; returns whether it was.
pub(crate) async fn eventually<F, Fut>(within: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if f().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// 100 a second, leased in batches of up to 1,000.
pub(crate) const BATCHED: &str = r"
version: 1
lease: { mode: leased, ttl: 2s, max_batch: 1000 }
tenants:
  acme:
    routes:
      /api: { algorithm: token_bucket, rate: 100/s, burst: 100 }
";

/// On a server of [`BATCHED`], every 100 ms for 3 s an agent claiming any demand asks
/// first (1,000 units) and an honest agent of 80 a second next (two rounds of its
/// demand): the units the honest agent is granted in the last 2 s.
pub(crate) async fn claim_beside_an_honest_agent(s: &TestServer) -> u64 {
    let c = s.native().await;
    let lease = |agent: &'static str, lease_id: u64, want: u64, demand_per_sec: u64| {
        let mut c = c.clone();
        async move {
            let item = pb::LeaseItem {
                tenant: "acme".into(),
                route: "/api".into(),
                lease_id,
                want,
                demand_per_sec,
                ..Default::default()
            };
            let req = pb::LeaseRequest { agent_id: agent.into(), items: vec![item], epoch: 0 };
            let g = c.lease(req).await.unwrap().into_inner().grants.remove(0);
            assert_eq!(g.mode(), pb::LeaseMode::Leased, "{g:?}");
            (g.lease_id, g.units)
        }
    };
    const ROUNDS: u64 = 30;
    let (mut claimer, mut honest, mut got) = (0, 0, 0);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    for round in 0..ROUNDS {
        tick.tick().await;
        (claimer, _) = lease("claimer", claimer, 1_000, u64::MAX / 1_000_000).await;
        let units;
        (honest, units) = lease("honest", honest, 16, 80).await;
        if round >= ROUNDS - 20 {
            got += units;
        }
    }
    got
}
