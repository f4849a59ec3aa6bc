//! The processes a scenario starts: server nodes (this binary in its server role),
//! `redis-server`, gateway processes, and one relay per faulted gateway that can cut
//! it off from the servers. Everything is on loopback and stopped when dropped.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// The environment variable that makes this binary a server or a gateway.
pub const ROLE: &str = "LOADTEST_ROLE";

static BINARY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Makes `path` the binary started as server nodes and gateways (tests name the
/// built `loadtest`; by default it is the running executable). The first call wins.
pub fn use_binary(path: PathBuf) {
    let _ = BINARY.set(path);
}

/// The binary started as server nodes and gateways.
///
/// # Errors
///
/// When the running executable is unknown.
pub fn own_binary() -> anyhow::Result<PathBuf> {
    match BINARY.get() {
        Some(p) => Ok(p.clone()),
        None => Ok(std::env::current_exe()?),
    }
}

/// The binary started as server nodes: the one `LOADTEST_SERVER_BIN` names (a real
/// `limiter-server`, to measure exactly what is deployed), else this binary in its
/// server role (the same `limiter_server::cli::main`, linked in, so never stale).
///
/// # Errors
///
/// When the running executable is unknown.
pub fn server_binary() -> anyhow::Result<PathBuf> {
    match std::env::var_os("LOADTEST_SERVER_BIN") {
        Some(p) => Ok(PathBuf::from(p)),
        None => own_binary(),
    }
}

/// A free loopback address (bound, then released), never one this process was given
/// before: the tests of one binary run at once, and a port released by one and
/// handed to another would start two servers that fight over it (a chaos test's node
/// once never became ready so).
///
/// # Errors
///
/// When no port can be bound.
pub fn free_addr() -> anyhow::Result<SocketAddr> {
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut given = GIVEN.lock();
    loop {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        if !given.contains(&addr.port()) {
            given.push(addr.port());
            return Ok(addr);
        }
    }
}

/// A server node the run started.
#[derive(Debug)]
pub struct Node {
    /// `node{i}`.
    pub id: String,
    /// gRPC address.
    pub grpc: SocketAddr,
    /// Admin address (`/metrics`, `/readyz`).
    pub admin: SocketAddr,
    env: Vec<(String, String)>,
    child: Option<Child>,
    /// Its standard error (searched for panics at the end).
    log: PathBuf,
}

impl Node {
    /// Starts nodes `0..n` on `policy` (static membership when `n > 1`), with the
    /// extra `LIMITER__*` settings in `env`, and waits until all are ready.
    ///
    /// # Errors
    ///
    /// When one cannot start or is not ready within 20 s.
    pub async fn start_all(
        n: usize,
        policy: &Path,
        env: &[(String, String)],
    ) -> anyhow::Result<Vec<Node>> {
        let mut nodes = Vec::new();
        for i in 0..n {
            let grpc = free_addr()?;
            let log = std::env::temp_dir().join(format!(
                "loadtest-{}-node{i}-{}.log",
                std::process::id(),
                grpc.port()
            ));
            nodes.push(Node {
                id: format!("node{i}"),
                grpc,
                admin: free_addr()?,
                env: Vec::new(),
                child: None,
                log,
            });
        }
        let peers = nodes.iter().map(|n| format!("{}={}", n.id, n.grpc)).collect::<Vec<_>>();
        let policy = std::fs::canonicalize(policy)
            .with_context(|| format!("policy file {}", policy.display()))?;
        for node in &mut nodes {
            let mut e = vec![
                ("LIMITER__POLICY_FILE".to_owned(), policy.display().to_string()),
                ("LIMITER__LISTEN".to_owned(), node.grpc.to_string()),
                ("LIMITER__ADMIN_LISTEN".to_owned(), node.admin.to_string()),
                ("LIMITER__SHUTDOWN__DRAIN_DELAY_MS".to_owned(), "200".to_owned()),
                ("LIMITER__LIMITS__MAX_BATCH".to_owned(), "10000".to_owned()),
            ];
            if n > 1 {
                e.extend([
                    ("LIMITER__CLUSTER__MEMBERSHIP".to_owned(), "static".to_owned()),
                    ("LIMITER__CLUSTER__PEERS".to_owned(), peers.join(",")),
                    ("LIMITER__CLUSTER__NODE_ID".to_owned(), node.id.clone()),
                    ("LIMITER__CLUSTER__HEALTH_INTERVAL_MS".to_owned(), "100".to_owned()),
                    // Loopback load-test clusters run without TLS, and say so.
                    ("LIMITER__CLUSTER__INSECURE_PEERS".to_owned(), "true".to_owned()),
                ]);
            }
            for (k, v) in env {
                e.retain(|(x, _)| x != k);
                e.push((k.clone(), v.clone()));
            }
            node.env = e;
            node.spawn()?;
        }
        for node in &mut nodes {
            node.wait_ready().await?;
        }
        Ok(nodes)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let verbose = std::env::var_os("LOADTEST_SERVER_LOG").is_some();
        if verbose {
            eprintln!("{} logs to {}", self.id, self.log.display());
        }
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let child = Command::new(server_binary()?)
            .env(ROLE, "server")
            .env("RUST_LOG", if verbose { "info" } else { "warn" })
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting a server node")?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits until `/readyz` says 200.
    ///
    /// # Errors
    ///
    /// When it does not within 20 s, or exits first (the error then carries its exit
    /// status and the end of its log).
    pub async fn wait_ready(&mut self) -> anyhow::Result<()> {
        for _ in 0..400 {
            if http_get(self.admin, "/readyz").await.is_some_and(|(s, _)| s == 200) {
                return Ok(());
            }
            if let Some(status) = self.exited() {
                bail!(
                    "{} ({}) exited before it was ready ({status}): {}",
                    self.id,
                    self.grpc,
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("{} ({}) did not become ready: {}", self.id, self.grpc, self.log_tail())
    }

    /// The last lines of its log, for an error.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(5)..].join(" | ");
        // Its own log, but bounded all the same.
        tail.chars().take(1_000).collect()
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    /// Its gRPC URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// SIGKILL, like a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, a planned stop: it drains (its counters to their next owners) and
    /// exits; [`Node::exited`] says when.
    ///
    /// # Errors
    ///
    /// When it is not running or `kill` cannot be run.
    pub fn terminate(&self) -> anyhow::Result<()> {
        let pid = self.pid().ok_or_else(|| anyhow::anyhow!("{} is not running", self.id))?;
        let ok = Command::new("kill").args(["-TERM", &pid.to_string()]).status()?.success();
        anyhow::ensure!(ok, "SIGTERM not delivered to {}", self.id);
        Ok(())
    }

    /// Starts it again on the same addresses (after a kill).
    ///
    /// # Errors
    ///
    /// When it cannot be started.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn()
    }

    /// Whether it is running.
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Whether it died on its own (a crash or a panic): its exit status.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// The first panic its log shows, in any of its lives (a panicking task does not
    /// end the process).
    pub fn panic(&self) -> Option<String> {
        let text = std::fs::read_to_string(&self.log).ok()?;
        text.lines().find(|l| l.contains("panicked at")).map(str::to_owned)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
        if std::env::var_os("LOADTEST_SERVER_LOG").is_none() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// A `redis-server` on a free port.
#[derive(Debug)]
pub struct Redis {
    /// Its address.
    pub addr: SocketAddr,
    child: Child,
}

impl Redis {
    /// Starts one and waits until it answers.
    ///
    /// # Errors
    ///
    /// When `redis-server` is missing or does not answer within 10 s.
    pub async fn start() -> anyhow::Result<Self> {
        let addr = free_addr()?;
        let child = Command::new("redis-server")
            .args(["--port", &addr.port().to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server (is it installed?)")?;
        let me = Self { addr, child };
        for _ in 0..200 {
            if let Ok(mut s) = TcpStream::connect(addr).await {
                let mut buf = [0u8; 7];
                if s.write_all(b"PING\r\n").await.is_ok()
                    && s.read_exact(&mut buf).await.is_ok()
                    && &buf == b"+PONG\r\n"
                {
                    return Ok(me);
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("redis-server on {addr} did not answer")
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// SIGSTOP (`stop: true`) or SIGCONT.
    pub fn pause(&self, stop: bool) {
        let sig = if stop { "-STOP" } else { "-CONT" };
        let _ = Command::new("kill").args([sig, &self.child.id().to_string()]).status();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.pause(false);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP relay in front of a server: a gateway that talks through it can be cut off
/// (its connections dropped, new ones refused) and let back in.
#[derive(Debug, Clone)]
pub struct Relay {
    /// Where the gateway connects.
    pub addr: SocketAddr,
    inner: Arc<RelayInner>,
}

#[derive(Debug)]
struct RelayInner {
    /// Cut off until this many nanoseconds of the relay's clock (0: open).
    cut_until: AtomicU64,
    conns: Mutex<Vec<AbortHandle>>,
    epoch: tokio::time::Instant,
}

impl Relay {
    /// A relay to `upstream` on a free loopback port.
    ///
    /// # Errors
    ///
    /// When it cannot bind.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(RelayInner {
            cut_until: AtomicU64::new(0),
            conns: Mutex::new(Vec::new()),
            epoch: tokio::time::Instant::now(),
        });
        let me = Self { addr, inner: inner.clone() };
        tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                if inner.is_cut() {
                    drop(down);
                    continue;
                }
                let task = tokio::spawn(async move {
                    let _ = down.set_nodelay(true);
                    if let Ok(mut up) = TcpStream::connect(upstream).await {
                        let _ = up.set_nodelay(true);
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
                let mut conns = inner.conns.lock();
                conns.retain(|h| !h.is_finished());
                conns.push(task.abort_handle());
            }
        });
        Ok(me)
    }

    /// Drops every connection and refuses new ones for `d`.
    pub fn cut(&self, d: Duration) {
        let until = self.inner.epoch.elapsed() + d;
        self.inner
            .cut_until
            .store(u64::try_from(until.as_nanos()).unwrap_or(u64::MAX), Ordering::Release);
        for h in self.inner.conns.lock().drain(..) {
            h.abort();
        }
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl RelayInner {
    fn is_cut(&self) -> bool {
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        now < self.cut_until.load(Ordering::Acquire)
    }
}

/// Status and body of a GET on an admin port, or `None` when nothing answers.
pub async fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let fetch = async {
        let mut s = TcpStream::connect(addr).await.ok()?;
        let req = format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let status = text.split(' ').nth(1)?.parse().ok()?;
        let body = text.split_once("\r\n\r\n").map_or(String::new(), |(_, b)| b.to_owned());
        Some((status, body))
    };
    tokio::time::timeout(Duration::from_secs(2), fetch).await.ok().flatten()
}

/// The sum of a metric's samples whose labels contain every one of `labels`, in a
/// Prometheus text body.
pub fn metric(body: &str, name: &str, labels: &[&str]) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
