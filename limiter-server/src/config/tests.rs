use super::*;

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

#[test]
fn defaults_and_environment_overrides() {
    let c = ServerConfig::load_with_env(
        None,
        env(&[
            ("LIMITER__POLICY_FILE", "p.yaml"),
            ("LIMITER__STORE__MAX_KEYS", "42"),
            ("LIMITER__LIMITS__MAX_BATCH", "7"),
            ("OTHER", "x"),
        ]),
    )
    .unwrap();
    assert_eq!(c.max_keys, 42);
    assert_eq!(c.limits.max_batch, 7);
    assert_eq!(c.policy_file, PathBuf::from("p.yaml"));
    assert_eq!(c.listen, "127.0.0.1:50051".parse().unwrap());
}

#[test]
fn every_bad_value_is_reported_at_once() {
    let e = ServerConfig::load_with_env(
        None,
        env(&[
            ("LIMITER__LISTEN", "nowhere"),
            ("LIMITER__STORE__MAX_KEYS", "0"),
            ("LIMITER__ENVOY__TENANT_FROM", "header"),
        ]),
    )
    .unwrap_err();
    let text = e.to_string();
    for needle in ["listen:", "policy_file:", "store.max_keys:", "envoy.tenant_from:"] {
        assert!(text.contains(needle), "{needle} missing from {text}");
    }
}

/// The configuration with a policy file and `pairs`.
fn load(pairs: &[(&str, &str)]) -> Result<ServerConfig, ConfigError> {
    let mut all = vec![("LIMITER__POLICY_FILE", "p.yaml")];
    all.extend_from_slice(pairs);
    ServerConfig::load_with_env(None, env(&all))
}

#[test]
fn an_rlqs_ttl_shorter_than_two_rounds_is_refused() {
    let c = load(&[]).unwrap();
    assert_eq!((c.rlqs.round, c.rlqs.ttl), (Duration::from_millis(250), Duration::from_secs(2)));
    let text = load(&[("LIMITER__RLQS__TTL_S", "1"), ("LIMITER__RLQS__ROUND_MS", "800")])
        .unwrap_err()
        .to_string();
    assert!(text.contains("rlqs.ttl_s: must be at least two rounds"), "{text}");
    let text = load(&[("LIMITER__RLQS__MAX_BUCKETS", "0")]).unwrap_err().to_string();
    assert!(text.contains("rlqs.max_buckets: must be between 1"), "{text}");
}

#[test]
fn envoys_are_taken_to_start_a_changed_bucket_full_unless_told() {
    assert!(!load(&[]).unwrap().rlqs.envoys_carry_tokens);
    let c = load(&[("LIMITER__RLQS__ENVOYS_CARRY_TOKENS", "true")]).unwrap();
    assert!(c.rlqs.envoys_carry_tokens);
    let text =
        load(&[("LIMITER__RLQS__ENVOYS_CARRY_TOKENS", "sometimes")]).unwrap_err().to_string();
    assert!(text.contains("envoys_carry_tokens"), "{text}");
}

#[test]
fn security_settings_are_checked_together() {
    let c = load(&[
        ("LIMITER__SECURITY__TOKENS_FILE", "/etc/limiter/tokens"),
        ("LIMITER__SECURITY__GRPC__CERT_FILE", "/tls/a.pem"),
        ("LIMITER__SECURITY__GRPC__KEY_FILE", "/tls/a.key"),
        ("LIMITER__SECURITY__GRPC__AUTH", "token"),
    ])
    .unwrap();
    assert_eq!(c.security.grpc.auth, security::AuthMode::Token);
    assert!(c.security.grpc.tls.as_ref().is_some_and(|t| t.client_ca.is_none()));
    assert_eq!(c.security.admin.auth, security::AuthMode::None);

    let text = load(&[
        ("LIMITER__SECURITY__GRPC__CERT_FILE", "/tls/a.pem"),
        ("LIMITER__SECURITY__GRPC__AUTH", "token"),
        ("LIMITER__SECURITY__ADMIN__AUTH", "mtls"),
        ("LIMITER__SECURITY__ADMIN__CLIENT_CA_FILE", "/tls/ca.pem"),
        ("LIMITER__SECURITY__PEERS__CERT_FILE", "/tls/p.pem"),
        ("LIMITER__SECURITY__GRPC__PEER_NAMES", "node-a"),
    ])
    .unwrap_err()
    .to_string();
    for needle in [
        "security.grpc: cert_file and key_file go together",
        "security.grpc.auth: `token` needs security.tokens_file",
        "security.admin.client_ca_file: needs cert_file and key_file (TLS)",
        "security.admin.auth: `mtls` needs TLS with a client_ca_file",
        "security.peers: cert_file and key_file go together",
        "security.grpc.peer_names: only used with `auth: mtls`",
    ] {
        assert!(text.contains(needle), "{needle} missing from {text}");
    }

    // Nodes of a cluster must be able to call each other through the listener.
    let text = load(&[
        ("LIMITER__CLUSTER__MEMBERSHIP", "static"),
        ("LIMITER__CLUSTER__PEERS", "b=127.0.0.1:50052"),
        ("LIMITER__SECURITY__GRPC__CERT_FILE", "/tls/a.pem"),
        ("LIMITER__SECURITY__GRPC__KEY_FILE", "/tls/a.key"),
        ("LIMITER__SECURITY__GRPC__CLIENT_CA_FILE", "/tls/ca.pem"),
        ("LIMITER__SECURITY__GRPC__AUTH", "mtls"),
    ])
    .unwrap_err()
    .to_string();
    for needle in [
        "security.peers.ca_file: peers serve TLS",
        "security.peers.cert_file: peers ask for a client certificate",
        "security.grpc.peer_names: name the certificates nodes present",
    ] {
        assert!(text.contains(needle), "{needle} missing from {text}");
    }
}

#[test]
fn the_redis_store_is_configured_and_checked() {
    let c = ServerConfig::load_with_env(
        None,
        env(&[
            ("LIMITER__POLICY_FILE", "p.yaml"),
            ("LIMITER__STORE__KIND", "redis"),
            ("LIMITER__STORE__REDIS__CLUSTER_NODES", "redis://a:7000, redis://b:7001"),
            ("LIMITER__STORE__REDIS__BATCHES", "false"),
        ]),
    )
    .unwrap();
    let StoreKind::Redis(r) = c.store else { panic!("redis expected") };
    assert_eq!(r.cluster_nodes, ["redis://a:7000", "redis://b:7001"]);
    assert!(!r.batches);
    assert_eq!(r.command_timeout, Duration::from_millis(100));
    let e = ServerConfig::load_with_env(
        None,
        env(&[
            ("LIMITER__POLICY_FILE", "p.yaml"),
            ("LIMITER__STORE__KIND", "redis"),
            ("LIMITER__STORE__REDIS__URL", "http://x"),
            ("LIMITER__STORE__REDIS__POOL", "deadpool"),
            ("LIMITER__STORE__REDIS__CLOCK", "gateway"),
            ("LIMITER__STORE__REDIS__COMMAND_TIMEOUT_MS", "0"),
            ("LIMITER__STORE__REDIS__TLS_CA_FILE", "/nonexistent/ca.pem"),
        ]),
    )
    .unwrap_err()
    .to_string();
    for needle in [
        "store.redis.url:",
        "store.redis.pool:",
        "store.redis.clock:",
        "store.redis.command_timeout_ms:",
        "store.redis.tls_ca_file:",
    ] {
        assert!(e.contains(needle), "{needle} missing from {e}");
    }
    let e = ServerConfig::load_with_env(
        None,
        env(&[("LIMITER__POLICY_FILE", "p.yaml"), ("LIMITER__STORE__KIND", "etcd")]),
    )
    .unwrap_err();
    assert!(e.to_string().contains("store.kind: expected `memory` or `redis`"), "{e}");
}

#[test]
fn unknown_fields_in_the_file_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("server.yaml");
    std::fs::write(&f, "policy_file: p.yaml\nlisten_addr: 1\n").unwrap();
    let e = ServerConfig::load_with_env(Some(&f), Vec::new()).unwrap_err();
    assert!(e.to_string().contains("listen_addr"), "{e}");
}
