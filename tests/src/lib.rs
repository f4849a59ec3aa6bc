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
        let child = Command::new(bin)
            .env("LIMITER__POLICY_FILE", policy)
            .env("LIMITER__LISTEN", grpc.to_string())
            .env("LIMITER__ADMIN_LISTEN", admin.to_string())
            .env("LIMITER__SHUTDOWN__DRAIN_DELAY_MS", drain_ms.to_string())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("limiter-server starts");
        let p = Self { child, grpc, admin };
        for _ in 0..400 {
            if p.status("/readyz").await == Some(200) {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("limiter-server did not become ready");
    }

    /// The gRPC URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// The HTTP status of a GET on the admin port, or `None` when it does not answer.
    pub async fn status(&self, path: &str) -> Option<u16> {
        let mut s = tokio::net::TcpStream::connect(self.admin).await.ok()?;
        let req = format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        String::from_utf8_lossy(&buf).split(' ').nth(1)?.parse().ok()
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
