//! What the agent's benches share: an owner in-process on loopback with an agent of
//! it, and the wall time of threads run side by side.

use std::sync::Arc;
use std::time::Duration;

use limiter_core::clock::{Clock, MonotonicClock};
use limiter_gateway_agent::{Agent, AgentConfig};
use limiter_server::Server;
use limiter_server::config::ServerConfig;

/// An owner serving a policy, an agent of it (the production clock), and the runtime
/// both run on (one worker). Dropped in this order.
pub(crate) struct Setup {
    pub(crate) agent: Agent,
    _running: limiter_server::Running,
    _dir: tempfile::TempDir,
    pub(crate) rt: tokio::runtime::Runtime,
}

pub(crate) fn setup(policy: &str) -> Setup {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policies.yaml");
    std::fs::write(&path, policy).unwrap();
    let config = ServerConfig::for_policy(&path).unwrap();
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let server = Server::with_clock(config, clock).unwrap();
    let running = rt.block_on(server.spawn_local()).unwrap();
    let url = running.url();
    let agent = rt.block_on(async { Agent::new(AgentConfig::new(url, "bench")).unwrap() });
    Setup { agent, _running: running, _dir: dir, rt }
}

/// Runs `body(t)` on `threads` threads at once: the slowest one's time (what it
/// returns: each times its own part). One thread is the calling one (a thread made
/// per sample starts on cold caches, perhaps on the other core).
pub(crate) fn slowest(threads: usize, body: impl Fn(usize) -> Duration + Sync) -> Duration {
    if threads == 1 {
        return body(0);
    }
    std::thread::scope(|s| {
        let body = &body;
        let handles: Vec<_> = (0..threads).map(|t| s.spawn(move || body(t))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).max().unwrap_or_default()
    })
}
