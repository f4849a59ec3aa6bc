//! The binary: `check-config`, and exit status 64 on bad configuration before any
//! socket is bound.

use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_limiter-server"))
}

#[test]
fn check_config_accepts_the_examples() {
    for name in ["policies.yaml", "llm-gateway.yaml"] {
        let example = format!("{}/../examples/{name}", env!("CARGO_MANIFEST_DIR"));
        let out = bin().args(["check-config", &example]).output().unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains(": ok ("));
    }
}

#[test]
fn check_config_prints_every_mistake_and_exits_64() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bad.yaml");
    std::fs::write(&f, "version: 1\ntenants:\n  a:\n    limit: { algorithm: nope }\n    limt: 3\n")
        .unwrap();
    let out = bin().args(["check-config", f.to_str().unwrap()]).output().unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.yaml:4:") && err.contains("unknown algorithm"), "{err}");
    assert!(err.contains("bad.yaml:5:") && err.contains("tenants.a.limt"), "{err}");
}

#[test]
fn bad_server_config_exits_64_before_binding() {
    let out = bin()
        .env("LIMITER__POLICY_FILE", "/nonexistent/policies.yaml")
        .env("LIMITER__STORE__MAX_KEYS", "-1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("store.max_keys"));
    let out = bin().env("LIMITER__POLICY_FILE", "/nonexistent/policies.yaml").output().unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read the policy file"));
}
