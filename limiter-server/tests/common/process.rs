//! The real `limiter-server` binary in a process of its own (for what must not share
//! the test's process: its metrics, its open-file limit).

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A server process on free loopback ports, killed when dropped.
pub(crate) struct Process {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    child: Child,
}

fn free_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

impl Process {
    /// Starts the server on `policy` with extra `LIMITER__*` settings, and waits for
    /// `/healthz`.
    pub(crate) async fn start(policy: &Path, env: &[(&str, &str)]) -> Self {
        Self::start_limited(policy, env, None).await
    }

    /// Like [`Self::start`], with the open-file limit (soft and hard) set to `files`.
    pub(crate) async fn start_limited(
        policy: &Path,
        env: &[(&str, &str)],
        files: Option<u64>,
    ) -> Self {
        let (grpc, admin) = (free_port(), free_port());
        let bin = env!("CARGO_BIN_EXE_limiter-server");
        let mut cmd = match files {
            None => Command::new(bin),
            Some(n) => {
                let mut c = Command::new("sh");
                c.args(["-c", &format!("ulimit -n {n} && exec \"$0\""), bin]);
                c
            }
        };
        cmd.env("LIMITER__LISTEN", grpc.to_string())
            .env("LIMITER__ADMIN_LISTEN", admin.to_string())
            .env("LIMITER__POLICY_FILE", policy)
            .env("LIMITER__SHUTDOWN__DRAIN_DELAY_MS", "0")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().unwrap();
        let p = Self { grpc, admin, child };
        let up = super::eventually(Duration::from_secs(20), || async {
            // Not listening yet: connect fails, and http_get would panic on it.
            tokio::net::TcpStream::connect(admin).await.is_ok()
                && tokio::time::timeout(
                    Duration::from_millis(500),
                    super::http_get(admin, "/healthz"),
                )
                .await
                .is_ok_and(|(s, _)| s == 200)
        })
        .await;
        assert!(up, "the server did not come up");
        p
    }

    /// The `/metrics` text.
    pub(crate) async fn metrics(&self) -> String {
        super::http_get(self.admin, "/metrics").await.1
    }

    /// Kills the process.
    pub(crate) fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.stop();
    }
}
