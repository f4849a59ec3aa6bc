//! TLS and authentication over real gRPC on loopback: callers without a token, with a
//! wrong one, with a certificate of another CA, and clients calling what only peers
//! may are refused and counted; certificates and tokens are reloaded without a restart
//! and without dropping open connections.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::pki::{Ca, Leaf};
use common::{TestServer, ask, eventually};
use limiter_proto::connect::{AuthChannel, ClientSecurity};
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

const POLICY: &str = r"
version: 1
routes:
  /search: {}
tenants:
  default:
    limit: { algorithm: token_bucket, rate: 1000/s, burst: 1000 }
";

fn client(s: &ClientSecurity, addr: SocketAddr) -> RateLimiterClient<AuthChannel> {
    let channel = s.connect_lazy(&addr.to_string(), |e| e.timeout(Duration::from_secs(5))).unwrap();
    RateLimiterClient::new(channel)
}

async fn allow(c: &mut RateLimiterClient<AuthChannel>) -> Result<bool, tonic::Status> {
    c.should_allow(ask("acme", "/search")).await.map(|r| r.into_inner().allowed)
}

/// A forwarded call, as a node sends it to a tenant's owner.
async fn forwarded(c: &mut RateLimiterClient<AuthChannel>) -> Result<bool, tonic::Status> {
    let mut r = tonic::Request::new(ask("acme", "/search"));
    r.metadata_mut().insert("x-limiter-forwarded", "1".parse().unwrap());
    c.should_allow(r).await.map(|r| r.into_inner().allowed)
}

/// A GET on the admin port with optional bearer token: (status, body).
async fn admin_get(addr: SocketAddr, path: &str, token: Option<&str>) -> (u16, String) {
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    common::http_get_with(addr, path, &auth).await
}

/// The value of the metric line starting with `prefix`, 0 when absent.
fn metric(body: &str, prefix: &str) -> f64 {
    body.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

struct Pki {
    dir: tempfile::TempDir,
    ca: Ca,
    other_ca: Ca,
    server: Leaf,
}

impl Pki {
    /// The server's certificate and key files and the CA's, as settings.
    fn files(&self) -> (String, String, String) {
        let path = |p: &std::path::Path| p.display().to_string();
        (path(&self.server.cert), path(&self.server.key), path(&self.ca.cert))
    }
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let other_ca = Ca::new(dir.path(), "other-ca");
    let server = ca.issue("server", &["localhost", "127.0.0.1"]);
    Pki { dir, ca, other_ca, server }
}

#[tokio::test]
async fn tokens_over_tls_let_in_only_their_holders() {
    let p = pki();
    let tokens = p.dir.path().join("tokens");
    std::fs::write(&tokens, "gw client gw-token\nnode peer node-token\nprom admin prom-token\n")
        .unwrap();
    let (cert, key, _) = p.files();
    let tokens_path = tokens.display().to_string();
    let s = TestServer::start_with(
        POLICY,
        &[
            ("LIMITER__SECURITY__TOKENS_FILE", &tokens_path),
            ("LIMITER__SECURITY__GRPC__CERT_FILE", &cert),
            ("LIMITER__SECURITY__GRPC__KEY_FILE", &key),
            ("LIMITER__SECURITY__GRPC__AUTH", "token"),
            ("LIMITER__SECURITY__ADMIN__AUTH", "token"),
        ],
    )
    .await;
    let tls = ClientSecurity::tls(p.ca.pem());

    // Plaintext against the TLS port: no answer at all.
    let mut plain = client(&ClientSecurity::plaintext().with_token("gw-token").unwrap(), s.grpc);
    assert!(allow(&mut plain).await.is_err());
    // A server certificate the client does not trust: refused by the client.
    let mut distrust =
        client(&ClientSecurity::tls(p.other_ca.pem()).with_token("gw-token").unwrap(), s.grpc);
    assert!(allow(&mut distrust).await.is_err());

    let mut none = client(&tls, s.grpc);
    let e = allow(&mut none).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("needs credentials"), "{}", e.message());
    let mut wrong = client(&tls.clone().with_token("gw-tokem").unwrap(), s.grpc);
    let e = allow(&mut wrong).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert_eq!(e.message(), "the token is not known");

    let mut gw = client(&tls.clone().with_token("gw-token").unwrap(), s.grpc);
    assert!(allow(&mut gw).await.unwrap());
    // A gateway must not pass for a node: forwarded calls and handoffs need `peer`.
    let e = forwarded(&mut gw).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(!e.message().contains("not in a cluster"), "refused by the guard: {e:?}");
    let e = gw.handoff(pb::HandoffRequest::default()).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let mut node = client(&tls.clone().with_token("node-token").unwrap(), s.grpc);
    // A peer gets past the guard; a node alone then refuses any peer call itself.
    let e = forwarded(&mut node).await.unwrap_err();
    assert!(e.message().contains("not in a cluster"), "{e:?}");
    assert!(allow(&mut node).await.unwrap());

    // Health checks stay open to probes.
    let channel = tls.endpoint(&s.grpc.to_string()).unwrap().connect().await.unwrap();
    let health = HealthClient::new(channel).check(HealthCheckRequest::default()).await;
    assert!(health.is_ok(), "{health:?}");

    // The admin port: open health, metrics for `admin` tokens only.
    assert_eq!(admin_get(s.admin, "/readyz", None).await.0, 200);
    assert_eq!(admin_get(s.admin, "/metrics", None).await.0, 401);
    assert_eq!(admin_get(s.admin, "/metrics", Some("gw-token")).await.0, 403);
    let (status, body) = admin_get(s.admin, "/metrics", Some("prom-token")).await;
    assert_eq!(status, 200);
    let refused = |reason: &str| {
        metric(
            &body,
            &format!(r#"limiter_auth_refusals_total{{listener="grpc",reason="{reason}"}}"#),
        )
    };
    assert!(refused("no_credentials") >= 1.0, "{body}");
    assert!(refused("unknown_token") >= 1.0, "{body}");
    assert!(refused("not_allowed") >= 2.0, "{body}");
    assert!(
        metric(&body, r#"limiter_auth_refusals_total{listener="admin",reason="no_credentials"}"#)
            >= 1.0
    );
    assert!(
        metric(&body, r#"limiter_tls_handshake_failures_total{listener="grpc",kind="refused"}"#)
            >= 1.0,
        "the plaintext and distrusting clients failed their handshakes: {body}"
    );

    // Rotation: a new tokens file is in force within a poll; open connections stay.
    std::fs::write(&tokens, "gw client gw-token-2\nprom admin prom-token\n").unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            allow(&mut gw.clone()).await.is_err_and(|e| e.code() == Code::Unauthenticated)
        })
        .await
    );
    let mut gw2 = client(&tls.clone().with_token("gw-token-2").unwrap(), s.grpc);
    assert!(allow(&mut gw2).await.unwrap());
    // A broken version changes nothing.
    std::fs::write(&tokens, "gw client\n").unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(allow(&mut gw2).await.unwrap());
    let (_, body) = admin_get(s.admin, "/metrics", Some("prom-token")).await;
    assert!(
        metric(&body, r#"limiter_security_reloads_total{what="tokens",result="failed"}"#) >= 1.0,
        "{body}"
    );
    s.stop().await;
}

#[tokio::test]
async fn mutual_tls_admits_certificates_of_its_ca_and_names_its_peers() {
    let p = pki();
    let gateway = p.ca.issue("gateway", &["gateway.example"]);
    let peer = p.ca.issue("peer", &["node.limiter.internal"]);
    let stranger = p.other_ca.issue("stranger", &["node.limiter.internal"]);
    let (cert, key, ca) = p.files();
    let s = TestServer::start_with(
        POLICY,
        &[
            ("LIMITER__SECURITY__GRPC__CERT_FILE", &cert),
            ("LIMITER__SECURITY__GRPC__KEY_FILE", &key),
            ("LIMITER__SECURITY__GRPC__CLIENT_CA_FILE", &ca),
            ("LIMITER__SECURITY__GRPC__AUTH", "mtls"),
            ("LIMITER__SECURITY__GRPC__PEER_NAMES", "node.limiter.internal"),
        ],
    )
    .await;
    let tls = ClientSecurity::tls(p.ca.pem());
    let with = |l: &Leaf| tls.clone().with_identity(l.cert_pem(), l.key_pem());

    // A certificate of another CA does not get through the handshake.
    let mut c = client(&with(&stranger), s.grpc);
    let e = allow(&mut c).await.unwrap_err();
    assert_ne!(e.code(), Code::Ok);
    // No certificate: the call is refused as unauthenticated.
    let e = allow(&mut client(&tls, s.grpc)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");

    let mut gw = client(&with(&gateway), s.grpc);
    assert!(allow(&mut gw).await.unwrap());
    let e = forwarded(&mut gw).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(!e.message().contains("not in a cluster"), "refused by the guard: {e:?}");
    let mut node = client(&with(&peer), s.grpc);
    // Past the guard as a peer; a node alone then refuses any peer call itself.
    let e = forwarded(&mut node).await.unwrap_err();
    assert!(e.message().contains("not in a cluster"), "{e:?}");
    s.stop().await;
}

#[tokio::test]
async fn a_new_certificate_serves_new_connections_and_open_ones_stay() {
    let p = pki();
    let next_ca = Ca::new(p.dir.path(), "next-ca");
    let next = next_ca.issue("next", &["localhost", "127.0.0.1"]);
    // The server reads its certificate from files that are replaced in place.
    let (cert, key) = (p.dir.path().join("live.pem"), p.dir.path().join("live.key"));
    std::fs::copy(&p.server.cert, &cert).unwrap();
    std::fs::copy(&p.server.key, &key).unwrap();
    let (cert_s, key_s) = (cert.display().to_string(), key.display().to_string());
    let s = TestServer::start_with(
        POLICY,
        &[
            ("LIMITER__SECURITY__GRPC__CERT_FILE", &cert_s),
            ("LIMITER__SECURITY__GRPC__KEY_FILE", &key_s),
        ],
    )
    .await;
    // This client trusts only the first CA: once the server has the new certificate it
    // could not connect again, so its calls succeeding prove its connection stayed.
    let old_trust = ClientSecurity::tls(p.ca.pem());
    let mut open = client(&old_trust, s.grpc);
    assert!(allow(&mut open).await.unwrap());

    // Key first, then certificate: the half-written pair is refused and the old one
    // keeps serving until the pair matches.
    std::fs::copy(&next.key, &key).unwrap();
    std::fs::copy(&next.cert, &cert).unwrap();
    let new_trust = ClientSecurity::tls(next_ca.pem());
    assert!(
        eventually(Duration::from_secs(5), || async {
            allow(&mut client(&new_trust, s.grpc)).await.is_ok()
        })
        .await,
        "new connections get the new certificate"
    );
    assert!(allow(&mut client(&old_trust, s.grpc)).await.is_err(), "the old one is gone");
    for _ in 0..20 {
        assert!(allow(&mut open).await.unwrap(), "the open connection still serves");
    }

    // A broken certificate file is refused; the one in force stays.
    std::fs::write(&cert, b"not a certificate").unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(allow(&mut client(&new_trust, s.grpc)).await.unwrap());
    let (_, body) = common::http_get(s.admin, "/metrics").await;
    assert!(
        metric(&body, r#"limiter_security_reloads_total{what="grpc",result="failed"}"#) >= 1.0,
        "{body}"
    );
    assert!(metric(&body, r#"limiter_security_reloads_total{what="grpc",result="ok"}"#) >= 1.0);
    assert!(allow(&mut open).await.unwrap());
    s.stop().await;
}

#[tokio::test]
async fn unusable_security_files_stop_the_start_with_the_field_named() {
    let p = pki();
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
        .unwrap();
    let env = |pairs: &[(&str, String)]| {
        let mut v = vec![("LIMITER__POLICY_FILE".to_owned(), policy.display().to_string())];
        v.extend(pairs.iter().map(|(k, val)| ((*k).to_owned(), val.clone())));
        v
    };
    let start = |pairs: &[(&str, String)]| {
        let config = limiter_server::config::ServerConfig::load_with_env(None, env(pairs)).unwrap();
        limiter_server::Server::new(config).unwrap_err().to_string()
    };
    let cert = p.server.cert.display().to_string();
    let e = start(&[
        ("LIMITER__SECURITY__GRPC__CERT_FILE", cert.clone()),
        ("LIMITER__SECURITY__GRPC__KEY_FILE", "/nonexistent/key.pem".to_owned()),
    ]);
    assert!(e.contains("security.grpc.key_file: cannot read `/nonexistent/key.pem`"), "{e}");
    let e = start(&[
        ("LIMITER__SECURITY__ADMIN__CERT_FILE", garbage.display().to_string()),
        ("LIMITER__SECURITY__ADMIN__KEY_FILE", p.server.key.display().to_string()),
    ]);
    assert!(e.contains("security.admin.cert_file"), "{e}");
    // A key that is not the certificate's.
    let other = p.ca.issue("other", &["localhost"]);
    let e = start(&[
        ("LIMITER__SECURITY__GRPC__CERT_FILE", cert),
        ("LIMITER__SECURITY__GRPC__KEY_FILE", other.key.display().to_string()),
    ]);
    assert!(e.contains("security.grpc.key_file") && e.contains("does not suit"), "{e}");
}

/// A GET over TLS on `addr`, presenting `identity` if given: the status, or `None`
/// when the connection is refused.
async fn admin_get_tls(
    addr: SocketAddr,
    ca: &Ca,
    identity: Option<&Leaf>,
    path: &str,
) -> Option<u16> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(&ca.pem()).unwrap()).unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match identity {
        Some(l) => builder
            .with_client_auth_cert(
                CertificateDer::pem_slice_iter(&l.cert_pem()).collect::<Result<_, _>>().unwrap(),
                PrivateKeyDer::from_pem_slice(&l.key_pem()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
    let name = ServerName::try_from("localhost").unwrap();
    let mut s = connector.connect(name, tcp).await.ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.ok()?;
    String::from_utf8_lossy(&buf).split(' ').nth(1)?.parse().ok()
}

#[tokio::test]
async fn the_admin_port_serves_tls_to_holders_of_a_client_certificate() {
    let p = pki();
    let ops = p.ca.issue("ops", &["ops.example"]);
    let stranger = p.other_ca.issue("stranger", &["ops.example"]);
    let (cert, key, ca) = p.files();
    let s = TestServer::start_with(
        POLICY,
        &[
            ("LIMITER__SECURITY__ADMIN__CERT_FILE", &cert),
            ("LIMITER__SECURITY__ADMIN__KEY_FILE", &key),
            ("LIMITER__SECURITY__ADMIN__CLIENT_CA_FILE", &ca),
            ("LIMITER__SECURITY__ADMIN__AUTH", "mtls"),
        ],
    )
    .await;
    assert_eq!(admin_get_tls(s.admin, &p.ca, Some(&ops), "/metrics").await, Some(200));
    assert_eq!(admin_get_tls(s.admin, &p.ca, None, "/metrics").await, None);
    assert_eq!(admin_get_tls(s.admin, &p.ca, Some(&stranger), "/metrics").await, None);
    // Plain HTTP gets no answer.
    assert_eq!(admin_get(s.admin, "/metrics", None).await.0, 0);
    // The gRPC port is untouched: plaintext, open.
    let mut c = client(&ClientSecurity::plaintext(), s.grpc);
    assert!(allow(&mut c).await.unwrap());
    s.stop().await;
}
