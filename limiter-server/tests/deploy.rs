//! The Kubernetes manifests in `deploy/kubernetes/` against the Kubernetes schemas
//! (offline, with `kubernetes-validate --strict`) and against this server: every
//! setting, environment variable, flag, port, path and mount they name must be one the
//! server really has, so a renamed setting or a moved port fails here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use limiter_server::config::{Membership, ServerConfig};
use serde_json::Value;

mod common;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

/// Every YAML file of the folder, by name.
fn files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

fn parse_docs(text: &str, file: &Path) -> Vec<Value> {
    text.split("\n---\n")
        .filter(|d| d.lines().any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#')))
        .map(|d| serde_saphyr::from_str(d).unwrap_or_else(|e| panic!("{}: {e}", file.display())))
        .collect()
}

/// Every resource, with the file it is in.
fn resources() -> Vec<(PathBuf, Value)> {
    files()
        .into_iter()
        .filter(|f| !f.ends_with("kustomization.yaml"))
        .flat_map(|f| {
            let docs = parse_docs(&std::fs::read_to_string(&f).unwrap(), &f);
            docs.into_iter().map(move |d| (f.clone(), d))
        })
        .collect()
}

fn find(all: &[(PathBuf, Value)], kind: &str, name: &str) -> Value {
    all.iter()
        .map(|(_, v)| v)
        .find(|v| v["kind"] == kind && v["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} named {name}"))
        .clone()
}

fn text(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("expected a string, found {v}"))
}

/// The container of the StatefulSet and the pod spec around it.
fn pod(all: &[(PathBuf, Value)]) -> (Value, Value) {
    let set = find(all, "StatefulSet", "limiter");
    let pod = set["spec"]["template"]["spec"].clone();
    let container = pod["containers"][0].clone();
    (pod, container)
}

/// The container's `LIMITER__*` environment, with `$(POD_IP)` as a pod address.
fn container_env(container: &Value) -> Vec<(String, String)> {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| {
            let value = e["value"].as_str()?;
            Some((text(&e["name"]).to_owned(), value.replace("$(POD_IP)", "10.1.2.3")))
        })
        .collect()
}

fn port_named(container: &Value, name: &str) -> u16 {
    let port = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("the container has no port named {name}"));
    u16::try_from(port["containerPort"].as_u64().unwrap()).unwrap()
}

/// Where the volume `volume` is mounted in the container, and the ConfigMap or
/// Secret it shows.
fn mount_of(pod: &Value, container: &Value, volume: &str) -> (PathBuf, Value) {
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == volume)
        .unwrap_or_else(|| panic!("volume {volume} is not mounted"));
    assert_eq!(mount["readOnly"], true, "{volume} is mounted read-only");
    let source = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == volume)
        .unwrap_or_else(|| panic!("no volume {volume}"))
        .clone();
    (PathBuf::from(text(&mount["mountPath"])), source)
}

/// The server's settings file written out, as the pod sees it, and the config the
/// server makes of it with the pod's environment.
fn load_server_config(
    all: &[(PathBuf, Value)],
    dir: &Path,
    extra_env: &[(&str, &str)],
) -> Result<ServerConfig, String> {
    let (_, container) = pod(all);
    let config_map = find(all, "ConfigMap", "limiter-config");
    let file = dir.join("server.yaml");
    std::fs::write(&file, text(&config_map["data"]["server.yaml"])).unwrap();
    let mut env = container_env(&container);
    env.extend(extra_env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    ServerConfig::load_with_env(Some(&file), env).map_err(|e| e.to_string())
}

#[test]
fn manifests_pass_the_kubernetes_schemas() {
    let mut builtin = Vec::new();
    for (file, doc) in resources() {
        let api = text(&doc["apiVersion"]);
        if api.starts_with("monitoring.coreos.com/") {
            continue; // custom resources: checked by hand below
        }
        builtin.push(file);
    }
    builtin.dedup();
    let run = |files: &[PathBuf]| {
        Command::new("kubernetes-validate")
            .args(["--strict", "--quiet", "--kubernetes-version", "1.30.0"])
            .args(files)
            .output()
            .expect("kubernetes-validate runs (scripts/test installs it from PyPI)")
    };
    let out = run(&builtin);
    assert!(
        out.status.success(),
        "kubernetes-validate refused the manifests:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The check can fail: a field the schema does not have is refused.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("statefulset.yaml");
    let text = std::fs::read_to_string(deploy_dir().join("statefulset.yaml")).unwrap();
    std::fs::write(&bad, text.replace("  replicas: 3\n", "  replicas: 3\n  replica: 3\n")).unwrap();
    assert!(!run(&[bad]).status.success(), "a misspelt field passes the schema check");
}

#[test]
fn the_kustomization_lists_every_manifest() {
    let k = &parse_docs(
        &std::fs::read_to_string(deploy_dir().join("kustomization.yaml")).unwrap(),
        Path::new("kustomization.yaml"),
    )[0];
    let listed: BTreeSet<&str> = k["resources"].as_array().unwrap().iter().map(text).collect();
    let present: BTreeSet<String> = files()
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .filter(|f| f != "kustomization.yaml")
        .collect();
    assert_eq!(listed, present.iter().map(String::as_str).collect());
}

#[test]
fn the_server_accepts_every_setting_port_path_and_mount_the_manifests_name() {
    let all = resources();
    let dir = tempfile::tempdir().unwrap();
    let config = load_server_config(&all, dir.path(), &[]).unwrap();
    let (pod, container) = pod(&all);

    // The command line: `--config` names the settings file where its ConfigMap is mounted.
    let args: Vec<&str> = container["args"].as_array().unwrap().iter().map(text).collect();
    let (config_mount, config_source) = mount_of(&pod, &container, "config");
    assert_eq!(config_source["configMap"]["name"], "limiter-config");
    assert_eq!(args, ["--config", config_mount.join("server.yaml").to_str().unwrap()]);

    // Ports: the container's named ports are the ones the server listens on.
    let (grpc, admin) = (port_named(&container, "grpc"), port_named(&container, "admin"));
    assert_eq!(config.listen.port(), grpc);
    assert_eq!(config.admin_listen.port(), admin);
    assert!(config.listen.ip().is_unspecified() && config.admin_listen.ip().is_unspecified());

    // The policy: mounted as a directory (the symlink swap), its file a key of the
    // ConfigMap, and a valid policy.
    let (policy_mount, policy_source) = mount_of(&pod, &container, "policy");
    let policy_map = find(&all, "ConfigMap", text(&policy_source["configMap"]["name"]));
    assert_eq!(config.policy_file.parent().unwrap(), policy_mount);
    let key = config.policy_file.file_name().unwrap().to_str().unwrap();
    let policy_text = text(&policy_map["data"][key]);
    let policy_file = dir.path().join("policies.yaml");
    std::fs::write(&policy_file, policy_text).unwrap();
    limiter_server::owner::reload::read_policy(&policy_file, 1 << 20).unwrap();

    // Secrets: the token files are under the Secret's mount.
    let (secret_mount, _) = mount_of(&pod, &container, "secrets");
    let tokens = config.security.tokens_file.clone().unwrap();
    assert!(tokens.starts_with(&secret_mount), "{}", tokens.display());
    let peer_token = config.security.peers.token_file.clone().unwrap();
    assert!(peer_token.starts_with(&secret_mount), "{}", peer_token.display());

    // Membership: the headless Service's name, at the gRPC port, with the pod's address.
    let headless = find(&all, "Service", "limiter-headless");
    assert_eq!(headless["spec"]["clusterIP"], "None");
    assert_eq!(headless["spec"]["publishNotReadyAddresses"], true);
    let set = find(&all, "StatefulSet", "limiter");
    assert_eq!(set["spec"]["serviceName"], "limiter-headless");
    let Membership::Dns { name, port, .. } = &config.cluster.membership else {
        panic!("the manifests' membership is DNS: {:?}", config.cluster.membership);
    };
    let namespace = text(&headless["metadata"]["namespace"]);
    assert_eq!(*name, format!("limiter-headless.{namespace}.svc.cluster.local."));
    assert_eq!(*port, grpc);
    assert_eq!(config.cluster.advertise, format!("10.1.2.3:{grpc}"));
    assert_eq!(config.cluster.node_id, config.cluster.advertise);

    // Probes on the admin port, at paths the probe test below calls.
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["port"], "admin", "{probe}");
        assert!(["/healthz", "/readyz"].contains(&text(&get["path"])), "{probe}: {}", get["path"]);
    }
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");

    // Stopping: the grace period covers the preStop sleep, the drain delay, the
    // handoff and the in-flight grace.
    let pre_stop = Duration::from_secs(
        container["lifecycle"]["preStop"]["sleep"]["seconds"].as_u64().unwrap(),
    );
    let period = Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().unwrap());
    let needed = pre_stop + config.drain_delay + config.cluster.handoff_timeout + config.grace;
    assert!(
        period > needed,
        "terminationGracePeriodSeconds {period:?} < {needed:?} needed to drain"
    );

    // A non-root, read-only container.
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(container["securityContext"]["allowPrivilegeEscalation"], false);
    assert!(container["resources"]["requests"]["cpu"].is_string());
    assert!(container["resources"]["requests"]["memory"].is_string());

    // Services and policies name the container's ports.
    let container_ports: BTreeSet<&str> =
        container["ports"].as_array().unwrap().iter().map(|p| text(&p["name"])).collect();
    let client = find(&all, "Service", "limiter");
    for svc in [&headless, &client] {
        for p in svc["spec"]["ports"].as_array().unwrap() {
            assert!(container_ports.contains(text(&p["targetPort"])), "{}", p["targetPort"]);
        }
    }
    let net = find(&all, "NetworkPolicy", "limiter");
    let admitted: BTreeSet<&str> = net["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["ports"].as_array().unwrap().iter().map(|p| text(&p["port"])))
        .collect();
    assert_eq!(admitted, container_ports, "the network policy admits exactly the server's ports");
    let pdb = find(&all, "PodDisruptionBudget", "limiter");
    assert_eq!(pdb["spec"]["selector"], set["spec"]["selector"]);

    // Prometheus: the monitor scrapes /metrics on the client Service's admin port.
    let monitor = find(&all, "ServiceMonitor", "limiter");
    let endpoint = &monitor["spec"]["endpoints"][0];
    let svc_port = client["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == endpoint["port"])
        .expect("the monitor's port is a port of the client Service");
    assert_eq!(svc_port["targetPort"], "admin");
    assert_eq!(endpoint["path"], "/metrics");
    assert_eq!(monitor["spec"]["selector"]["matchLabels"], client["metadata"]["labels"]);
    // The alert rules are the repository's, word for word.
    let rule = find(&all, "PrometheusRule", "limiter");
    let alerts = parse_docs(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../dashboards/alerts.yaml"),
        )
        .unwrap(),
        Path::new("alerts.yaml"),
    );
    assert_eq!(
        rule["spec"], alerts[0],
        "deploy/kubernetes/prometheusrule.yaml differs from dashboards/alerts.yaml"
    );
}

#[test]
fn a_renamed_setting_or_variable_fails_the_check() {
    let all = resources();
    let dir = tempfile::tempdir().unwrap();
    // The settings file with one key renamed.
    let mut renamed = all.clone();
    for (_, doc) in &mut renamed {
        if doc["kind"] == "ConfigMap" && doc["metadata"]["name"] == "limiter-config" {
            let text = doc["data"]["server.yaml"]
                .as_str()
                .unwrap()
                .replace("dns_interval_ms", "dns_poll_ms");
            doc["data"]["server.yaml"] = Value::String(text);
        }
    }
    let e = load_server_config(&renamed, dir.path(), &[]).unwrap_err();
    assert!(e.contains("dns_poll_ms"), "{e}");
    // An environment variable the server does not have.
    let e =
        load_server_config(&all, dir.path(), &[("LIMITER__CLUSTER__ADVERTIZE", "x")]).unwrap_err();
    assert!(e.contains("advertize"), "{e}");
}

/// The probes' paths answer on the admin port without credentials (kubelet sends
/// none) while everything else there wants the admin token the monitor sends.
#[tokio::test]
async fn the_probes_answer_without_credentials_and_metrics_take_the_monitors_token() {
    let all = resources();
    let dir = tempfile::tempdir().unwrap();
    let (_, container) = pod(&all);
    let tokens = dir.path().join("tokens");
    std::fs::write(
        &tokens,
        "gateway client gw-secret\nprometheus admin prom-secret\nnode peer peer-secret\n",
    )
    .unwrap();
    let peer_token = dir.path().join("peer-token");
    std::fs::write(&peer_token, "peer-secret\n").unwrap();
    let policy_map = find(&all, "ConfigMap", "limiter-policy");
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, text(&policy_map["data"]["policies.yaml"])).unwrap();
    let (tokens, peer_token, policy) = (
        tokens.display().to_string(),
        peer_token.display().to_string(),
        policy.display().to_string(),
    );
    // One node: the manifests' DNS name does not resolve here.
    let config = load_server_config(
        &all,
        dir.path(),
        &[
            ("LIMITER__CLUSTER__MEMBERSHIP", "none"),
            ("LIMITER__SECURITY__TOKENS_FILE", &tokens),
            ("LIMITER__SECURITY__PEERS__TOKEN_FILE", &peer_token),
            ("LIMITER__POLICY_FILE", &policy),
            ("LIMITER__SHUTDOWN__DRAIN_DELAY_MS", "0"),
        ],
    )
    .unwrap();
    let running = limiter_server::Server::new(config).unwrap().spawn_local().await.unwrap();
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let path = text(&container[probe]["httpGet"]["path"]);
        let (status, _) = common::http_get(running.admin, path).await;
        assert_eq!(status, 200, "{probe} {path}");
    }
    let (status, _) = common::http_get(running.admin, "/metrics").await;
    assert_eq!(status, 401, "/metrics without a token");
    let (status, body) =
        common::http_get_with(running.admin, "/metrics", "Authorization: Bearer prom-secret\r\n")
            .await;
    assert_eq!(status, 200, "/metrics with the monitor's token");
    assert!(body.contains("limiter_ready"));
    running.stop().await.unwrap();
}
