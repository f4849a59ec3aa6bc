//! Permits held by gateway processes: ten `permit-holder` processes (each an agent
//! holding two permits of a concurrency level of 20, renewing them) against a real
//! `limiter-server` process; one is killed with SIGKILL. Its permits come back within
//! their TTL (and a sixteenth), the others' never lapse, and nothing ever holds more
//! than the limit: while all ten hold, and after the killed one's come back, the
//! 21st permit is refused.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use limiter_gateway_agent::{Agent, AgentConfig, AgentRequest, Permit};
use limiter_tests::{ServerProcess, free_addr};
use tokio::time::Instant;

const POLICY: &str = r"
version: 1
tenants:
  t:
    routes:
      /work: { algorithm: concurrency, limit: 20, permit_ttl: 2s }
";
const TTL: Duration = Duration::from_secs(2);

fn server_bin() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_limiter-server-under-test"))
}

/// A holder process, killed when dropped.
struct Holder(Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn holder(url: &str, id: &str) -> Holder {
    let mut child = Command::new(env!("CARGO_BIN_EXE_permit-holder"))
        .args([url, id, "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("permit-holder starts");
    let out = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "held 2", "{id}");
    Holder(child)
}

async fn try_acquire(agent: &Agent) -> Option<Permit> {
    let req = AgentRequest { tenant: "t", route: "/work", key: None, cost: 1 };
    let o = agent.decide(&req).await.unwrap();
    if o.allowed { Some(o.permit.expect("an admission holds a permit")) } else { None }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holders_permits_come_back_within_their_ttl_and_no_more() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let (grpc, admin) = (free_addr(), free_addr());
    let server = ServerProcess::start(server_bin(), &policy, grpc, admin, 0).await;
    let url = server.url();
    // Ten holders of two permits each: the limit of 20 in use.
    let mut holders: Vec<Holder> = Vec::new();
    for i in 0..10 {
        let u = url.clone();
        holders.push(
            tokio::task::spawn_blocking(move || holder(&u, &format!("gw{i}"))).await.unwrap(),
        );
    }
    let me =
        Agent::new(AgentConfig::new(&url, "probe").with_rpc_timeout(Duration::from_millis(500)))
            .unwrap();
    assert!(try_acquire(&me).await.is_none(), "a 21st permit while all 20 are held");

    // One holder crashes: its two permits come back at their expiry, no later than a
    // TTL (and a sixteenth) after its last renewal, which was before the kill.
    let mut killed = holders.remove(3);
    let _ = killed.0.kill();
    let _ = killed.0.wait();
    let at = Instant::now();
    let mut got = Vec::new();
    while got.len() < 2 && at.elapsed() < TTL * 2 {
        match try_acquire(&me).await {
            Some(p) => got.push(p),
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let back_after = at.elapsed();
    assert_eq!(got.len(), 2, "the killed holder's permits came back");
    assert!(back_after <= TTL + TTL / 16 + Duration::from_millis(100), "back after {back_after:?}");
    // Only those two: the nine others renewed theirs, so the limit is reached again,
    // and stays so for longer than a TTL (nothing of theirs lapses; ours are renewed
    // as theirs are).
    let until = Instant::now() + TTL + TTL / 2;
    while Instant::now() < until {
        assert!(try_acquire(&me).await.is_none(), "more than the limit held");
        for p in &got {
            me.renew(p).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("the killed holder's permits came back after {back_after:?}");
    // Released: exactly those two again (a permit of the agent's pool goes back to
    // the owner with a call of its own: asked again until then, at most a second).
    for p in &got {
        assert!(me.release(p).await.unwrap());
    }
    let mut again = Vec::new();
    let at = Instant::now();
    while again.len() < 2 && at.elapsed() < Duration::from_secs(1) {
        match try_acquire(&me).await {
            Some(p) => again.push(p),
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert_eq!(again.len(), 2, "the two released permits");
    assert!(try_acquire(&me).await.is_none());
    drop(holders);
    drop(server);
}
