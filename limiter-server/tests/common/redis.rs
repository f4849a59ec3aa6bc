//! Real `redis-server` processes for tests: a single server or a three-master Cluster,
//! each on free loopback ports in a directory of its own, stopped when dropped. Tests
//! never touch a Redis they did not start.

#![allow(dead_code)] // each test binary uses a different part

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A free loopback port (bound and released; the OS does not hand it out again soon).
pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Sends one inline command and returns the reply's first line (`None`: no answer).
pub(crate) fn command(port: u16, cmd: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    s.write_all(format!("{cmd}\r\n").as_bytes()).ok()?;
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Script calls a Redis has answered so far (`EVALSHA`, and `EVAL` after a
/// `NOSCRIPT`), from its own `INFO commandstats`.
pub(crate) fn script_calls(port: u16) -> u64 {
    let info = command(port, "INFO commandstats").unwrap_or_default();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| l.split("calls=").nth(1)?.split(',').next()?.parse::<u64>().ok())
        .sum()
}

/// One `redis-server`.
pub(crate) struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts a server (snapshots only when asked with `SAVE`, kept in its directory).
    pub(crate) fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra `--option value` arguments. A free port can be taken
    /// by another test between the pick and the bind: a server that exits at once is
    /// started again on another port.
    pub(crate) fn start_with(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Self {
            port: free_port(),
            child: None,
            dir,
            extra: extra.iter().map(|e| (*e).to_owned()).collect(),
        };
        for _ in 0..5 {
            if s.spawn_and_wait() {
                return s;
            }
            s.port = free_port();
        }
        panic!("redis-server did not start on five free ports");
    }

    /// The server's URL.
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Its directory (snapshot, cluster state).
    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Starts (again) on the same port and directory: data saved before is loaded.
    pub(crate) fn restart(&mut self) {
        assert!(self.spawn_and_wait(), "redis-server on port {} did not start", self.port);
    }

    /// Whether the server on the port is this one's process (another test's server may
    /// have the port; a password-protected one cannot say, and is taken as ours).
    fn answers_as_ours(&mut self) -> bool {
        let Some(pid) = self.child.as_ref().map(Child::id) else { return false };
        match command(self.port, "INFO server") {
            Some(info) if info.contains("process_id:") => {
                info.contains(&format!("process_id:{pid}\r"))
            }
            _ => true,
        }
    }

    /// Starts the process and waits up to 10 s for it to answer; false if it exited
    /// (its port was taken) or never answered.
    fn spawn_and_wait(&mut self) -> bool {
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--save")
            .arg("")
            .arg("--appendonly")
            .arg("no")
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().expect("redis-server is installed (.ci/run installs it)"));
        // Up to 10 s.
        for _ in 0..500 {
            // A password-protected server answers NOAUTH: up all the same.
            let up = |r: String| r.starts_with("+PONG") || r.starts_with("-NOAUTH");
            if command(self.port, "PING").is_some_and(up) && self.answers_as_ours() {
                return true;
            }
            if self.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_some()) {
                self.child = None;
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        false
    }

    /// Saves a snapshot and stops (the data survives a restart).
    pub(crate) fn stop_saving(&mut self) {
        let _ = command(self.port, "SHUTDOWN SAVE");
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }

    /// Pauses the process (SIGSTOP): connections stay open, nothing answers.
    pub(crate) fn pause(&self) {
        self.signal("-STOP");
    }

    /// Resumes a paused process.
    pub(crate) fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill").arg(sig).arg(c.id().to_string()).status();
        }
    }

    /// Kills the process at once.
    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            self.resume();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill").arg("-CONT").arg(c.id().to_string()).status();
        }
        self.kill();
    }
}

/// A three-master Redis Cluster (no replicas).
pub(crate) struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three nodes and creates the cluster; waits until every slot is served.
    pub(crate) fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ])
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = create
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli is installed");
        assert!(out.status.success(), "cluster create: {}", String::from_utf8_lossy(&out.stdout));
        // Up to 20 s.
        for _ in 0..200 {
            let ok = nodes.iter().all(|n| {
                command(n.port, "CLUSTER INFO").is_some_and(|r| r.contains("cluster_state:ok"))
            });
            if ok {
                return Self { nodes };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the cluster did not reach cluster_state:ok");
    }

    /// The seed URLs, comma-separated (`store.redis.cluster_nodes`).
    pub(crate) fn urls(&self) -> String {
        self.nodes.iter().map(RedisServer::url).collect::<Vec<_>>().join(",")
    }
}
