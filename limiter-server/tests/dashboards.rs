//! The status page and the shipped dashboards against real tools: headless Chromium
//! renders `/dashboard` under traffic, and a real Prometheus scrapes the server and
//! answers every query of `dashboards/limiter.json` and every alert expression of
//! `dashboards/alerts.yaml`. Both tools come from Debian's packages (`.ci/run`
//! installs them); a missing one fails the test with how to install it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{TestServer, allowed_of, ask, ask_key, eventually};
use limiter_proto::limiter::v1 as pb;

const POLICY: &str = r"
version: 1
routes:
  /search: {}
  /export: { shadow: true }
  /shared:
    limit: { algorithm: fixed_window, limit: 2, window: 1h }
    shares:
      gold: { tenants: [acme], reserved: 50% }
tenants:
  acme:
    limit: { algorithm: fixed_window, limit: 5, window: 1h }
    per_key: { algorithm: fixed_window, limit: 2, window: 1h }
  globex:
    limit: { algorithm: token_bucket, rate: 1/h, burst: 3 }
";

fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn tool(name: &str) -> PathBuf {
    for dir in ["/usr/bin", "/usr/local/bin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return p;
        }
    }
    panic!("`{name}` is not installed: apt-get install -y {name} (see .ci/run)");
}

/// Traffic with rejections of several reasons on several routes.
async fn traffic(s: &TestServer) {
    let mut c = s.native().await;
    allowed_of(&mut c, &ask_key("acme", "/search", "k1"), 4).await;
    allowed_of(&mut c, &ask("acme", "/search"), 4).await;
    allowed_of(&mut c, &ask("globex", "/checkout"), 5).await;
    allowed_of(&mut c, &ask("acme", "/export"), 3).await;
    allowed_of(&mut c, &ask("nobody", "/search"), 2).await;
    // acme's demand keeps half of /shared for it: past the other half, globex's
    // requests are refused by its class's share (SHARE_LIMIT).
    allowed_of(&mut c, &ask("acme", "/shared"), 1).await;
    allowed_of(&mut c, &ask("globex", "/shared"), 3).await;
    let _ =
        c.should_allow(pb::ShouldAllowRequest { cost: Some(0), ..ask("acme", "/search") }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_reasons_routes_and_top_tenants_in_a_browser() {
    let chromium = tool("chromium");
    let s = TestServer::start(POLICY).await;
    traffic(&s).await;
    // The data endpoint first: what the page draws.
    let (status, data) = s.get("/dashboard/data").await;
    assert_eq!(status, 200);
    for needle in [
        r#""TENANT_LIMIT":"#,
        r#""KEY_LIMIT":"#,
        r#""UNKNOWN_TENANT":"#,
        r#""/search":"#,
        r#""item":"acme""#,
    ] {
        assert!(data.contains(needle), "{needle} missing from {data}");
    }
    // Wait for two history samples so the charts have a line.
    tokio::time::sleep(Duration::from_millis(2_100)).await;

    let out = PathBuf::from(concat!(env!("CARGO_TARGET_TMPDIR"), "/dashboard"));
    std::fs::create_dir_all(&out).unwrap();
    let profile = tempfile::tempdir().unwrap();
    let url = format!("http://{}/dashboard", s.admin);
    let run = |extra: &[&str]| {
        let mut cmd = Command::new(&chromium);
        cmd.args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--window-size=1400,1600",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(&url);
        cmd.stderr(Stdio::null());
        cmd
    };
    let dom = tokio::task::spawn_blocking({
        let mut cmd = run(&["--dump-dom"]);
        move || cmd.output().unwrap()
    })
    .await
    .unwrap();
    assert!(dom.status.success(), "chromium failed");
    let dom = String::from_utf8_lossy(&dom.stdout).into_owned();
    // Rendered by the page's script from /dashboard/data: reasons and routes with counts.
    let table = |id: &str| {
        let start =
            dom.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no #{id} in {dom}"));
        dom[start..start + dom[start..].find("</table>").unwrap()].to_owned()
    };
    let reasons = table("by-reason");
    assert!(reasons.contains("<td>TENANT_LIMIT</td><td class=\"n\">"), "{reasons}");
    assert!(
        reasons.contains("<td>KEY_LIMIT</td>") && reasons.contains("<td>UNKNOWN_TENANT</td>"),
        "{reasons}"
    );
    let routes = table("by-route");
    assert!(routes.contains("<td>/search</td><td class=\"n\">"), "{routes}");
    assert!(routes.contains("<td>other</td>"), "{routes}");
    // The two top lists are two tables, each row one tenant.
    assert!(table("top-tenants-rejected").contains("<td>acme</td><td class=\"n\">"));
    assert!(table("top-tenants-admitted").contains("<td>acme</td><td class=\"n\">"));
    assert!(table("top-keys-rejected").contains("<th>key</th>"));
    // Server: build version, uptime, store keys against their cap, evictions, invalid.
    let cell = |id: &str| {
        let start = dom.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no #{id}"));
        let rest = &dom[start..];
        let open = rest.find('>').unwrap() + 1;
        rest[open..open + rest[open..].find("</td>").unwrap()].to_owned()
    };
    assert_eq!(cell("version"), env!("CARGO_PKG_VERSION"));
    let uptime = cell("uptime");
    assert!(uptime.contains(" s (since ") && uptime.contains(" UTC)"), "{uptime}");
    let keys = cell("store-keys");
    assert!(keys.contains(" of 1000000 ("), "{keys}");
    assert!(!keys.starts_with("0 "), "the traffic's counters are counted: {keys}");
    assert_eq!(cell("evictions"), "0 / 0");
    let invalid: u64 = cell("invalid-total").parse().unwrap();
    assert!(invalid >= 1, "the zero-cost request is an invalid request");
    assert!(table("invalid-by-field").contains("<td>cost</td>"), "{}", table("invalid-by-field"));
    // Latency percentiles of the last minute, with units.
    let latency = table("latency");
    for p in ["p50", "p90", "p99", "p99.9"] {
        assert!(latency.contains(&format!("<td>{p}</td><td>")), "{p} missing: {latency}");
    }
    assert!(latency.contains(" µs</td>") || latency.contains(" ms</td>"), "{latency}");
    // Charts: a value axis with units, a time axis, a legend with current values.
    let canvas = |id: &str, attr: &str| {
        let start = dom.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no canvas #{id}"));
        let tag = &dom[start..start + dom[start..].find('>').unwrap()];
        let at =
            tag.find(&format!("{attr}=\"")).unwrap_or_else(|| panic!("#{id} has no {attr}: {tag}"));
        let v = &tag[at + attr.len() + 2..];
        v[..v.find('"').unwrap()].to_owned()
    };
    for (id, unit) in [("rate", "/s"), ("reasons", "/s"), ("invalid", "/s"), ("latency-chart", "s")]
    {
        let y = canvas(id, "data-yticks");
        assert!(
            y.split(" | ").count() >= 2 && y.split(" | ").all(|t| t.ends_with(unit)),
            "#{id}: {y}"
        );
        let x = canvas(id, "data-xticks");
        assert!(x.split(" | ").all(|t| t.len() == 8 && t.as_bytes()[2] == b':'), "#{id}: {x}");
        assert!(canvas(id, "data-points").parse::<u32>().unwrap() >= 1, "#{id} drew no samples");
    }
    let legend = |id: &str| {
        let start = dom.find(&format!("id=\"{id}-legend\"")).unwrap();
        dom[start..start + dom[start..].find("</div>").unwrap()].to_owned()
    };
    let rate = legend("rate");
    for series in ["allowed", "rejected", "shadow rejected"] {
        assert!(rate.contains(&format!("data-series=\"{series}\"")), "{rate}");
    }
    assert!(rate.contains("/s</b>"), "current values with units: {rate}");
    assert!(legend("reasons").contains("TENANT_LIMIT <b>"), "{}", legend("reasons"));
    assert!(legend("latency-chart").contains("p99 <b>"), "{}", legend("latency-chart"));
    // Replication and counters begun afresh (none on a node alone).
    let leases = table("leases");
    assert!(leases.contains("<td>replication</td><td>off</td>"), "{leases}");
    assert!(leases.contains("evicted 0"), "{leases}");
    assert!(dom.contains("policy version 1"), "status line missing");

    let shot = out.join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let arg = format!("--screenshot={}", shot.display());
    let status = tokio::task::spawn_blocking({
        let mut cmd = run(&[arg.as_str()]);
        move || cmd.status().unwrap()
    })
    .await
    .unwrap();
    assert!(status.success() && shot.exists(), "no screenshot at {}", shot.display());
    println!("screenshot: {}", shot.display());
    s.stop().await;
}

/// A Prometheus that is killed when dropped.
struct Prometheus(Child, u16);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(
            |b| {
                if b.is_ascii_alphanumeric() {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            },
        )
        .collect()
}

/// An HTTP/1.0 GET (no chunked bodies) to Prometheus: the body.
async fn prom_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()
}

/// Every `"expr"` of the Grafana dashboard, with Grafana's variables substituted.
fn dashboard_queries() -> Vec<String> {
    let text = std::fs::read_to_string(repo().join("dashboards/limiter.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    for panel in json["panels"].as_array().unwrap() {
        assert!(panel["title"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(
            panel["fieldConfig"]["defaults"]["unit"].as_str().is_some(),
            "{} has no unit",
            panel["title"]
        );
        for t in panel["targets"].as_array().unwrap() {
            out.push(t["expr"].as_str().unwrap().replace("$__rate_interval", "1m"));
        }
    }
    assert_eq!(json["uid"], "limiter-overview");
    out
}

/// Every alert's `expr`, and the same without its final comparison (the data it tests).
fn alert_exprs() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo().join("dashboards/alerts.yaml")).unwrap();
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("expr: "))
        .map(|e| {
            let base = [" > ", " == ", " < ", " >= ", " != "]
                .iter()
                .filter_map(|op| e.rfind(op))
                .max()
                .map_or(e, |i| &e[..i]);
            (e.to_owned(), base.trim().to_owned())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_and_alert_works_in_a_real_prometheus() {
    let promtool = tool("promtool");
    let alerts = repo().join("dashboards/alerts.yaml");
    let check = Command::new(promtool).args(["check", "rules"]).arg(&alerts).output().unwrap();
    assert!(check.status.success(), "promtool: {}", String::from_utf8_lossy(&check.stdout));

    let s = TestServer::start(POLICY).await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{ scrape_interval: 1s, evaluation_interval: 1s }}\nrule_files: [\"{}\"]\nscrape_configs:\n  - job_name: limiter\n    static_configs: [{{ targets: [\"{}\"] }}]\n",
            alerts.display(),
            s.admin
        ),
    )
    .unwrap();
    let port = free_port();
    let child = Command::new(tool("prometheus"))
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let prom = Prometheus(child, port);
    let ready = eventually(Duration::from_secs(20), || async {
        tokio::net::TcpStream::connect(("127.0.0.1", prom.1)).await.is_ok()
            && prom_get(prom.1, "/-/ready").await.contains("Ready")
    })
    .await;
    assert!(ready, "prometheus did not start");
    // Traffic spread over a few scrapes, so that rates have two samples.
    for _ in 0..4 {
        traffic(&s).await;
        tokio::time::sleep(Duration::from_millis(1_100)).await;
    }
    let query = |q: String| async move {
        let body = prom_get(prom.1, &format!("/api/v1/query?query={}", encode(&q))).await;
        assert!(body.contains(r#""status":"success""#), "refused: {q}\n{body}");
        body
    };
    for q in dashboard_queries() {
        let has_data = eventually(Duration::from_secs(5), || {
            let q = q.clone();
            async move { !query(q).await.contains(r#""result":[]"#) }
        })
        .await;
        assert!(has_data, "no data for dashboard query: {q}");
    }
    for (expr, base) in alert_exprs() {
        query(expr.clone()).await;
        let body = query(base.clone()).await;
        assert!(!body.contains(r#""result":[]"#), "no data behind alert `{expr}`: {base}");
    }
    drop(prom);
    s.stop().await;
}
