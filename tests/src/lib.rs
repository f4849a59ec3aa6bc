//! Helpers for multi-process tests: `limiter-server` as a real process on loopback
//! ports, killed or stopped by signal like in production.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A free loopback port (bound then released), never one this process was given
/// before: the tests of one binary run at once, and two of them handed the same port
/// would start servers that fight over it.
///
/// # Panics
///
/// When no port can be bound.
pub fn free_addr() -> SocketAddr {
    static GIVEN: parking_lot::Mutex<Vec<u16>> = parking_lot::Mutex::new(Vec::new());
    let mut given = GIVEN.lock();
    loop {
        let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        if !given.contains(&addr.port()) {
            given.push(addr.port());
            return addr;
        }
    }
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

/// A real DNS server (`dnsmasq`) on a loopback port, answering for one name with
/// the addresses it is given (TTL 0), until dropped.
#[derive(Debug)]
pub struct DnsServer {
    child: Option<Child>,
    /// Where it listens (UDP and TCP).
    pub addr: SocketAddr,
    hosts: std::path::PathBuf,
    name: String,
    _dir: tempfile::TempDir,
}

impl DnsServer {
    /// Starts `dnsmasq` answering `name` with `ips`.
    ///
    /// # Panics
    ///
    /// When `dnsmasq` is not installed or does not answer within 10 seconds.
    pub fn start(name: &str, ips: &[std::net::IpAddr]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let hosts = dir.path().join("hosts");
        let mut s =
            Self { child: None, addr: free_udp_addr(), hosts, name: name.to_owned(), _dir: dir };
        s.set(ips);
        s.restart();
        s
    }

    /// Answers `name` with `ips` from now on (`dnsmasq` rereads its hosts on SIGHUP).
    ///
    /// # Panics
    ///
    /// When the file cannot be written or the signal not sent.
    pub fn set(&mut self, ips: &[std::net::IpAddr]) {
        let text: String = ips.iter().map(|ip| format!("{ip} {}\n", self.name)).collect();
        std::fs::write(&self.hosts, text).unwrap();
        if let Some(c) = &self.child {
            let ok = Command::new("kill")
                .args(["-HUP", &c.id().to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "SIGHUP not delivered to dnsmasq");
            // It rereads the file at once; give it a moment.
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops it (nothing answers on its port until [`Self::restart`]).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port.
    ///
    /// # Panics
    ///
    /// When it does not start.
    pub fn restart(&mut self) {
        self.stop();
        let domain = self.name.rsplit('.').next().unwrap_or("test").to_owned();
        let bin =
            if Path::new("/usr/sbin/dnsmasq").exists() { "/usr/sbin/dnsmasq" } else { "dnsmasq" };
        let child = Command::new(bin)
            .args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                "--user=root",
                "--pid-file",
                "--local-ttl=0",
            ])
            .arg(format!("--listen-address={}", self.addr.ip()))
            .arg(format!("--port={}", self.addr.port()))
            .arg(format!("--addn-hosts={}", self.hosts.display()))
            .arg(format!("--local=/{domain}/"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("dnsmasq starts (scripts/test installs dnsmasq-base)");
        self.child = Some(child);
        // Up once it holds its TCP port.
        for _ in 0..200 {
            if std::net::TcpStream::connect(self.addr).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("dnsmasq did not start on {}", self.addr);
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A loopback port free for both UDP and TCP.
fn free_udp_addr() -> SocketAddr {
    loop {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = udp.local_addr().unwrap();
        if std::net::TcpListener::bind(addr).is_ok() {
            return addr;
        }
    }
}

/// One port free on each of `ips` (loopback addresses: the whole of 127.0.0.0/8 is
/// this machine), so that several nodes can listen at the same port, as pods do.
///
/// # Panics
///
/// When no such port is found in 100 tries.
pub fn free_port_on(ips: &[std::net::IpAddr]) -> u16 {
    for _ in 0..100 {
        let port = free_addr().port();
        if ips.iter().all(|ip| std::net::TcpListener::bind((*ip, port)).is_ok()) {
            return port;
        }
    }
    panic!("no port free on all of {ips:?}");
}
