//! Helpers for multi-process tests: `limiter-server` as a real process on loopback
//! ports, killed or stopped by signal like in production.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A free loopback port (bound then released).
///
/// # Panics
///
/// When no port can be bound.
pub fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// A `limiter-server` process; killed when dropped.
#[derive(Debug)]
pub struct ServerProcess {
    /// The process.
    pub child: Child,
    /// Its gRPC address.
    pub grpc: SocketAddr,
    /// Its admin address.
    pub admin: SocketAddr,
}

impl ServerProcess {
    /// Starts the server binary `bin` (the test's
    /// `env!("CARGO_BIN_EXE_limiter-server-under-test")`, `limiter-server`'s command
    /// line built by this package) on `policy` at the given addresses, and waits until
    /// it is ready.
    ///
    /// # Panics
    ///
    /// When it does not become ready within 20 seconds.
    pub async fn start(
        bin: &Path,
        policy: &Path,
        grpc: SocketAddr,
        admin: SocketAddr,
        drain_ms: u64,
    ) -> Self {
        let p = Self::spawn(bin, policy, grpc, admin, drain_ms, &[]);
        p.wait_ready().await;
        p
    }

    /// Starts the server like [`Self::start`] with more `LIMITER__*` settings, without
    /// waiting for it. `LIMITER_TEST_LOG=1` keeps its log on this process's stderr.
    ///
    /// # Panics
    ///
    /// When the binary cannot be started.
    pub fn spawn(
        bin: &Path,
        policy: &Path,
        grpc: SocketAddr,
        admin: SocketAddr,
        drain_ms: u64,
        env: &[(String, String)],
    ) -> Self {
        let log = std::env::var_os("LIMITER_TEST_LOG").is_some();
        let child = Command::new(bin)
            .env("LIMITER__POLICY_FILE", policy)
            .env("LIMITER__LISTEN", grpc.to_string())
            .env("LIMITER__ADMIN_LISTEN", admin.to_string())
            .env("LIMITER__SHUTDOWN__DRAIN_DELAY_MS", drain_ms.to_string())
            .env("RUST_LOG", if log { "info,limiter_server::cluster=debug" } else { "warn" })
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(if log { Stdio::inherit() } else { Stdio::null() })
            .spawn()
            .expect("limiter-server starts");
        Self { child, grpc, admin }
    }

    /// Waits until `/readyz` answers 200.
    ///
    /// # Panics
    ///
    /// When it does not within 20 seconds.
    pub async fn wait_ready(&self) {
        for _ in 0..400 {
            if self.status("/readyz").await == Some(200) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("limiter-server did not become ready");
    }

    /// The body of a GET on the admin port.
    pub async fn get(&self, path: &str) -> Option<String> {
        let text = self.http_get(path).await?;
        Some(text.split_once("\r\n\r\n").map_or(text.clone(), |(_, b)| b.to_owned()))
    }

    /// The sum of a metric's samples whose labels contain every one of `labels`
    /// (`name{...} value` lines of `/metrics`).
    pub async fn metric(&self, name: &str, labels: &[&str]) -> f64 {
        let body = self.get("/metrics").await.unwrap_or_default();
        body.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .filter(|l| labels.iter().all(|x| l.contains(x)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Waits for the process to end (after SIGTERM), at most `within`; true if it did.
    pub async fn wait_exit(&mut self, within: Duration) -> bool {
        let steps = within.as_millis() / 20;
        for _ in 0..steps {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// The gRPC URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// The whole answer to a GET on the admin port, or `None` when it does not answer.
    async fn http_get(&self, path: &str) -> Option<String> {
        let mut s = tokio::net::TcpStream::connect(self.admin).await.ok()?;
        let req = format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        Some(String::from_utf8_lossy(&buf).into_owned())
    }

    /// The HTTP status of a GET on the admin port, or `None` when it does not answer.
    pub async fn status(&self, path: &str) -> Option<u16> {
        self.http_get(path).await?.split(' ').nth(1)?.parse().ok()
    }

    /// Kills the process at once (SIGKILL), like a crash.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM (a planned stop).
    ///
    /// # Panics
    ///
    /// When `kill` cannot be run.
    pub fn terminate(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs")
            .success();
        assert!(ok, "SIGTERM not delivered");
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
