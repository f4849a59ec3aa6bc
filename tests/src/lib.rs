//! Helpers for multi-process tests: `limiter-server` as a real process on loopback
//! ports, killed or stopped by signal like in production.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The `limiter-server` binary of this workspace, built if it is not there yet.
///
/// # Panics
///
/// When it cannot be built.
pub fn server_binary() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"), PathBuf::from);
    let bin = target.join("debug/limiter-server");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    // Cheap when up to date; makes `cargo test -p limiter-tests` work on its own.
    let status = Command::new(cargo)
        .args(["build", "-q", "-p", "limiter-server", "--bin", "limiter-server"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("cargo runs");
    assert!(status.success(), "building limiter-server failed");
    bin
}

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
    /// Starts the server on `policy` at the given addresses and waits until ready.
    ///
    /// # Panics
    ///
    /// When it does not become ready within 20 seconds.
    pub async fn start(policy: &Path, grpc: SocketAddr, admin: SocketAddr, drain_ms: u64) -> Self {
        let child = Command::new(server_binary())
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
