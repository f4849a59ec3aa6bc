//! An owner server in-process on loopback, and agents pointed at it.

#![allow(dead_code)] // each test binary uses a different part

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use limiter_core::clock::Clock;
use limiter_gateway_agent::{Agent, AgentConfig, AgentRequest};
use limiter_reference::Spec;
use limiter_reference::judge::Spend;
use limiter_server::Server;
use limiter_server::config::ServerConfig;
use tokio::net::TcpListener;

pub(crate) struct Owner {
    pub addr: SocketAddr,
    pub server: Arc<limiter_server::owner::Owner>,
    _dir: tempfile::TempDir,
    _running: limiter_server::Running,
}

impl Owner {
    pub(crate) async fn start(policy: &str, clock: Arc<dyn Clock>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policies.yaml");
        std::fs::write(&path, policy).unwrap();
        let config = ServerConfig::load_with_env(
            None,
            [
                ("LIMITER__POLICY_FILE".to_owned(), path.display().to_string()),
                ("LIMITER__SHUTDOWN__DRAIN_DELAY_MS".to_owned(), "0".to_owned()),
            ],
        )
        .unwrap();
        let running = Server::with_clock(config, clock).unwrap().spawn_local().await.unwrap();
        Self { addr: running.grpc, server: running.owner.clone(), _dir: dir, _running: running }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

pub(crate) fn agent(url: &str, id: &str, clock: Arc<dyn Clock>) -> Agent {
    let config = AgentConfig::new(url, id).with_rpc_timeout(Duration::from_millis(500));
    Agent::with_clock(config, clock).unwrap()
}

pub(crate) fn req<'a>(tenant: &'a str, route: &'a str) -> AgentRequest<'a> {
    AgentRequest { tenant, route, key: None, cost: 1 }
}

/// A TCP proxy on loopback that can black-hole traffic: while cut, bytes in both
/// directions are dropped and connections stay open (as behind a failed link).
pub(crate) struct Proxy {
    pub addr: SocketAddr,
    cut: Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    pub(crate) async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let c = cut.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(target).await else { continue };
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                tokio::spawn(pipe(ri, wo, c.clone()));
                tokio::spawn(pipe(ro, wi, c.clone()));
            }
        });
        Self { addr, cut }
    }

    pub(crate) fn cut(&self, on: bool) {
        self.cut.store(on, std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if cut.load(std::sync::atomic::Ordering::SeqCst) {
            continue; // black hole
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// When a request admitted on a level with `spec`, decided between the test's clock
/// readings `before` and `after`, may have been charged: by the owner, between the
/// two; from a lease of `ttl`, as `Spec::leased_span` says (a local spend's grant may
/// come as late as `after`: a renewal can install it between the test's reading and
/// the agent's spend, and a request that found the balance empty and then the new
/// grant is local too).
pub(crate) fn placement(spec: Spec, local: bool, before: u64, after: u64, ttl: u64) -> Spend {
    let (from, to) = if local { spec.leased_span(before, after, ttl) } else { (before, after) };
    Spend { from, to, cost: 1 }
}
