//! Transport security, configured per listener (`security.grpc`, `security.admin`):
//!
//! - TLS from PEM files, reloaded when they change without dropping open connections
//!   ([`tls`]);
//! - who may call ([`guard`]): `none`, `token` (a bearer token from
//!   `security.tokens_file`, reloaded too) or `mtls` (a client certificate from the
//!   listener's `client_ca_file`). Roles: `client` (decisions, leases, topology,
//!   Envoy), `peer` (handoffs and forwarded calls between nodes), `admin` (the admin
//!   port). gRPC health checks, `/healthz` and `/readyz` stay open to probes;
//! - how this node calls its peers (`security.peers`): the CA it trusts, the
//!   certificate it presents, the token it sends.

pub mod guard;
pub mod tls;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use limiter_proto::connect::ClientSecurity;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use self::guard::{AuthMode, Guard, Protocol, TokenFile};
use self::tls::{ClientCerts, TlsFiles, TlsState};
use crate::metrics as m;

/// gRPC paths open without credentials.
const GRPC_OPEN: &[&str] = &["/grpc.health.v1.Health/"];
/// Admin paths open without credentials.
const ADMIN_OPEN: &[&str] = &["/healthz", "/readyz"];

/// The `security` section as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawSecurity {
    tokens_file: String,
    grpc: RawListener,
    admin: RawListener,
    peers: RawPeers,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawListener {
    cert_file: String,
    key_file: String,
    client_ca_file: String,
    auth: String,
    peer_names: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPeers {
    ca_file: String,
    cert_file: String,
    key_file: String,
    server_name: String,
    token_file: String,
}

/// Defaults of the `security` section (YAML, under `security:`).
pub(crate) const DEFAULTS: &str = r#"
security:
  tokens_file: ""
  grpc: { cert_file: "", key_file: "", client_ca_file: "", auth: none, peer_names: "" }
  admin: { cert_file: "", key_file: "", client_ca_file: "", auth: none, peer_names: "" }
  peers: { ca_file: "", cert_file: "", key_file: "", server_name: "", token_file: "" }
"#;

/// One listener's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerSecurity {
    /// TLS, or plaintext.
    pub tls: Option<TlsFiles>,
    /// Who may call.
    pub auth: AuthMode,
}

/// How this node calls its peers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PeerClient {
    /// The CA of peers' server certificates (set: TLS).
    pub ca_file: Option<PathBuf>,
    /// The certificate and key this node presents (mTLS).
    pub identity: Option<(PathBuf, PathBuf)>,
    /// The name peers' certificates are checked against (default: the host dialled).
    pub server_name: Option<String>,
    /// The file holding the token sent to peers (its first line).
    pub token_file: Option<PathBuf>,
}

/// The validated `security` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecurityConfig {
    /// Tokens of the `token` mode.
    pub tokens_file: Option<PathBuf>,
    /// The gRPC listener.
    pub grpc: ListenerSecurity,
    /// The admin listener.
    pub admin: ListenerSecurity,
    /// Calls to peers.
    pub peers: PeerClient,
}

fn path(s: &str) -> Option<PathBuf> {
    (!s.trim().is_empty()).then(|| PathBuf::from(s.trim()))
}

fn listener(
    errors: &mut Vec<String>,
    name: &str,
    r: &RawListener,
    tokens: bool,
) -> ListenerSecurity {
    let section = format!("security.{name}");
    let tls = match (path(&r.cert_file), path(&r.key_file)) {
        (Some(cert), Some(key)) => Some(TlsFiles { cert, key, client_ca: path(&r.client_ca_file) }),
        (None, None) => {
            if path(&r.client_ca_file).is_some() {
                errors
                    .push(format!("{section}.client_ca_file: needs cert_file and key_file (TLS)"));
            }
            None
        }
        _ => {
            errors.push(format!("{section}: cert_file and key_file go together"));
            None
        }
    };
    let peer_names = crate::config::comma_list(&r.peer_names);
    let auth = match r.auth.as_str() {
        "none" => AuthMode::None,
        "token" => {
            if !tokens {
                errors.push(format!("{section}.auth: `token` needs security.tokens_file"));
            }
            AuthMode::Token
        }
        "mtls" => {
            if tls.as_ref().is_none_or(|t| t.client_ca.is_none()) {
                errors.push(format!(
                    "{section}.auth: `mtls` needs TLS with a client_ca_file to check certificates against"
                ));
            }
            AuthMode::Mtls { peer_names: peer_names.clone() }
        }
        other => {
            errors.push(format!(
                "{section}.auth: expected `none`, `token` or `mtls`, found `{other}`"
            ));
            AuthMode::None
        }
    };
    if !peer_names.is_empty() && !matches!(auth, AuthMode::Mtls { .. }) {
        errors.push(format!("{section}.peer_names: only used with `auth: mtls`"));
    }
    ListenerSecurity { tls, auth }
}

/// Checks the section; `clustered`: the node has peers to call.
pub(crate) fn config(errors: &mut Vec<String>, r: &RawSecurity, clustered: bool) -> SecurityConfig {
    let tokens_file = path(&r.tokens_file);
    let grpc = listener(errors, "grpc", &r.grpc, tokens_file.is_some());
    let admin = listener(errors, "admin", &r.admin, tokens_file.is_some());
    if !r.admin.peer_names.trim().is_empty() {
        errors.push("security.admin.peer_names: peers do not call the admin port".to_owned());
    }
    let p = &r.peers;
    let identity = match (path(&p.cert_file), path(&p.key_file)) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => {
            errors.push("security.peers: cert_file and key_file go together".to_owned());
            None
        }
    };
    let peers = PeerClient {
        ca_file: path(&p.ca_file),
        identity,
        server_name: (!p.server_name.trim().is_empty()).then(|| p.server_name.trim().to_owned()),
        token_file: path(&p.token_file),
    };
    if clustered {
        if grpc.tls.is_some() && peers.ca_file.is_none() {
            errors.push(
                "security.peers.ca_file: peers serve TLS; name the CA their certificates come from"
                    .to_owned(),
            );
        }
        match &grpc.auth {
            AuthMode::Token if peers.token_file.is_none() => errors.push(
                "security.peers.token_file: peers ask for a token; name the file of this node's (a `peer` token)"
                    .to_owned(),
            ),
            AuthMode::Mtls { peer_names } => {
                if peers.identity.is_none() {
                    errors.push("security.peers.cert_file: peers ask for a client certificate; name this node's".to_owned());
                }
                if peer_names.is_empty() {
                    errors.push("security.grpc.peer_names: name the certificates nodes present to each other, or no node may forward to another".to_owned());
                }
            }
            _ => {}
        }
    }
    if peers.identity.is_some() && peers.ca_file.is_none() {
        errors.push(
            "security.peers.cert_file: a client certificate needs TLS (security.peers.ca_file)"
                .to_owned(),
        );
    }
    SecurityConfig { tokens_file, grpc, admin, peers }
}

/// TLS states, guards and the peer client, loaded from a [`SecurityConfig`].
#[derive(Debug)]
pub struct Security {
    /// The gRPC listener's TLS.
    pub grpc_tls: Option<Arc<TlsState>>,
    /// The admin listener's TLS.
    pub admin_tls: Option<Arc<TlsState>>,
    /// Who may call the gRPC listener.
    pub grpc_guard: Arc<Guard>,
    /// Who may call the admin listener.
    pub admin_guard: Arc<Guard>,
    /// How this node calls its peers.
    pub peers: ClientSecurity,
    tokens: Option<Arc<TokenFile>>,
}

impl Security {
    /// Plaintext and open (tests, embedding).
    pub fn open() -> Self {
        let guard = |name, protocol, open| {
            Arc::new(
                Guard::new(name, protocol, AuthMode::None, None, open).expect("no names to check"),
            )
        };
        Self {
            grpc_tls: None,
            admin_tls: None,
            grpc_guard: guard("grpc", Protocol::Grpc, GRPC_OPEN),
            admin_guard: guard("admin", Protocol::Http, ADMIN_OPEN),
            peers: ClientSecurity::plaintext(),
            tokens: None,
        }
    }

    /// Reads every file the configuration names.
    ///
    /// # Errors
    ///
    /// Every unreadable or invalid file, each named with its field.
    pub fn load(c: &SecurityConfig) -> Result<Self, String> {
        let mut errors = Vec::new();
        let e = &mut errors;
        let tokens = c.tokens_file.clone().and_then(|p| keep(e, TokenFile::load(p))).map(Arc::new);
        let tls = |e: &mut Vec<String>, name, l: &ListenerSecurity, certs, alpn| {
            let files = l.tls.clone()?;
            keep(e, TlsState::load(name, files, certs, alpn)).map(Arc::new)
        };
        let grpc_tls = tls(e, "grpc", &c.grpc, ClientCerts::Optional, b"h2");
        // The admin port cannot see certificates per request: mTLS is enforced in the
        // handshake.
        let admin_tls = tls(e, "admin", &c.admin, ClientCerts::Required, b"http/1.1");
        let grpc_guard = keep(
            e,
            Guard::new("grpc", Protocol::Grpc, c.grpc.auth.clone(), tokens.clone(), GRPC_OPEN),
        );
        let admin_mode = match c.admin.auth {
            AuthMode::Mtls { .. } => AuthMode::None,
            ref other => other.clone(),
        };
        let admin_guard =
            keep(e, Guard::new("admin", Protocol::Http, admin_mode, tokens.clone(), ADMIN_OPEN));
        let p = &c.peers;
        let peers = keep(
            e,
            ClientSecurity::from_files(
                p.ca_file.as_deref(),
                p.identity.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
                p.server_name.as_deref(),
                p.token_file.as_deref(),
            )
            .map_err(|e| format!("security.peers: {e}")),
        );
        for (name, l) in [("grpc", &c.grpc), ("admin", &c.admin)] {
            if l.auth == AuthMode::Token && l.tls.is_none() {
                tracing::warn!(
                    listener = name,
                    "bearer tokens are checked on a plaintext listener: they travel in clear"
                );
            }
        }
        match (grpc_guard, admin_guard, peers) {
            (Some(g), Some(a), Some(peers)) if errors.is_empty() => Ok(Self {
                grpc_tls,
                admin_tls,
                grpc_guard: Arc::new(g),
                admin_guard: Arc::new(a),
                peers,
                tokens,
            }),
            _ => Err(errors.join("\n")),
        }
    }

    /// Reads the certificate and token files again and puts changed, valid ones in
    /// force. Bad ones are logged and counted; what was in force stays.
    pub fn reload(&self) {
        for tls in [&self.grpc_tls, &self.admin_tls].into_iter().flatten() {
            report(tls.listener(), "certificate", tls.reload());
        }
        if let Some(t) = &self.tokens {
            report("tokens", "tokens", t.reload());
        }
    }

    /// Reloads every `every` until cancelled.
    pub async fn watch(self: Arc<Self>, every: Duration, cancel: CancellationToken) {
        if self.grpc_tls.is_none() && self.admin_tls.is_none() && self.tokens.is_none() {
            return;
        }
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {
                    let me = self.clone();
                    // File reads and certificate parsing stay off the runtime's workers.
                    let _ = tokio::task::spawn_blocking(move || me.reload()).await;
                }
            }
        }
    }
}

fn keep<T>(errors: &mut Vec<String>, r: Result<T, String>) -> Option<T> {
    r.map_err(|e| errors.push(e)).ok()
}

fn report(what: &'static str, kind: &str, outcome: Option<Result<(), String>>) {
    match outcome {
        None => {}
        Some(Ok(())) => {
            metrics::counter!(m::SECURITY_RELOADS, "what" => what, "result" => "ok").increment(1);
            tracing::info!(what, "new {kind} files in force");
        }
        Some(Err(e)) => {
            metrics::counter!(m::SECURITY_RELOADS, "what" => what, "result" => "failed")
                .increment(1);
            tracing::error!(what, "{kind} files not reloaded, the previous ones stay: {e}");
        }
    }
}
