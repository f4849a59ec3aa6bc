//! Hot reload of the policy file, for every way of replacing it: an in-place write, an
//! atomic rename over it, and a symlink swap (as Kubernetes ConfigMaps do). A changed
//! limit takes effect within 2 seconds; a broken file leaves the old policy serving.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{TestServer, ask, eventually};
use limiter_proto::limiter::v1 as pb;

/// The backstop poll far beyond the test's 2 s: only file events can reload in time.
const NO_POLL: &[(&str, &str)] = &[("LIMITER__RELOAD__POLL_INTERVAL_MS", "600000")];

/// `acme` refills one unit an hour: its count cannot start afresh mid-test, as an
/// hour window aligned on the clock does when a run crosses the hour.
fn policy(limit: u64) -> String {
    format!(
        "version: 1\ntenants:\n  acme:\n    limit: {{ algorithm: token_bucket, rate: 1/h, burst: {limit} }}\n  other:\n    limit: {{ algorithm: fixed_window, limit: 5, window: 1h }}\n"
    )
}

/// Waits until a dry run for `acme` reports `remaining`.
async fn takes_effect(s: &TestServer, remaining: u64) -> bool {
    let c = s.native().await;
    eventually(Duration::from_secs(2), || {
        let mut c = c.clone();
        async move {
            let dry = pb::ShouldAllowRequest { dry_run: true, ..ask("acme", "/r") };
            c.should_allow(dry).await.unwrap().into_inner().remaining == remaining
        }
    })
    .await
}

async fn version(s: &TestServer) -> u64 {
    let mut c = s.native().await;
    let dry = pb::ShouldAllowRequest { dry_run: true, ..ask("other", "/r") };
    c.should_allow(dry).await.unwrap().into_inner().policy_version
}

#[tokio::test]
async fn an_in_place_write_takes_effect() {
    let s = TestServer::start_with(&policy(10), NO_POLL).await;
    assert!(takes_effect(&s, 10).await);
    std::fs::write(&s.policy, policy(20)).unwrap();
    assert!(takes_effect(&s, 20).await, "in-place write not seen within 2 s");
    assert_eq!(version(&s).await, 2);
    s.stop().await;
}

#[tokio::test]
async fn an_atomic_rename_over_the_file_takes_effect() {
    let s = TestServer::start_with(&policy(10), NO_POLL).await;
    let tmp = s.dir.path().join(".policies.yaml.tmp");
    std::fs::write(&tmp, policy(30)).unwrap();
    std::fs::rename(&tmp, &s.policy).unwrap();
    assert!(takes_effect(&s, 30).await, "rename not seen within 2 s");
    // And a second one: the watch survives the replaced inode.
    std::fs::write(&tmp, policy(40)).unwrap();
    std::fs::rename(&tmp, &s.policy).unwrap();
    assert!(takes_effect(&s, 40).await, "second rename not seen within 2 s");
    s.stop().await;
}

/// The ConfigMap layout: `policies.yaml -> ..data/policies.yaml`, `..data -> ..v1`.
fn configmap(dir: &Path, version: &str, text: &str) {
    let v = dir.join(version);
    std::fs::create_dir_all(&v).unwrap();
    std::fs::write(v.join("policies.yaml"), text).unwrap();
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(version, &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
}

#[tokio::test]
async fn a_symlink_swap_takes_effect() {
    let dir = tempfile::tempdir().unwrap();
    configmap(dir.path(), "..v1", &policy(10));
    let link = dir.path().join("policies.yaml");
    std::os::unix::fs::symlink("..data/policies.yaml", &link).unwrap();
    let text = std::fs::read_to_string(&link).unwrap();
    let env = [("LIMITER__POLICY_FILE", link.to_str().unwrap()), NO_POLL[0]];
    let s = TestServer::start_with(&text, &env).await;
    assert!(takes_effect(&s, 10).await);
    configmap(dir.path(), "..v2", &policy(50));
    assert!(takes_effect(&s, 50).await, "symlink swap not seen within 2 s");
    s.stop().await;
}

#[tokio::test]
async fn a_broken_file_leaves_the_old_policy_serving_and_is_reported() {
    let s = TestServer::start(&policy(10)).await;
    let mut c = s.native().await;
    assert!(c.should_allow(ask("acme", "/r")).await.unwrap().into_inner().allowed);
    std::fs::write(&s.policy, "version: 1\ntenants:\n  acme:\n    limit: { algorithm: fixed_window, limit: 0, window: 1h }\n").unwrap();
    let failed = eventually(Duration::from_secs(2), || async {
        s.get("/policy").await.1.contains("limit.limit: must be greater than zero")
    })
    .await;
    assert!(failed, "{}", s.get("/policy").await.1);
    let (_, body) = s.get("/policy").await;
    assert!(body.contains("policies.yaml:4:"), "the error names the file and line: {body}");
    assert!(body.contains(r#""version":1"#), "{body}");
    // The old policy keeps serving, with its counters.
    let dry = pb::ShouldAllowRequest { dry_run: true, ..ask("acme", "/r") };
    assert_eq!(c.should_allow(dry).await.unwrap().into_inner().remaining, 9);
    let (_, metrics) = s.get("/metrics").await;
    assert!(metrics.contains(r#"limiter_policy_reloads_total{result="failed"}"#), "{metrics}");
    // A fixed file is picked up again; the unchanged limit keeps its count.
    std::fs::write(&s.policy, policy(10) + "# fixed\n").unwrap();
    assert!(eventually(Duration::from_secs(2), || async { version(&s).await == 2 }).await);
    let dry = pb::ShouldAllowRequest { dry_run: true, ..ask("acme", "/r") };
    assert_eq!(c.should_allow(dry).await.unwrap().into_inner().remaining, 9, "counters survive");
    s.stop().await;
}
