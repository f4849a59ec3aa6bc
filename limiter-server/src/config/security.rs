//! The `security` section: TLS files and who may call, per listener, and how this
//! node calls its peers. Checked here; loaded into TLS states and guards by
//! `crate::security`.

use std::path::PathBuf;

use serde::Deserialize;

/// How a listener authenticates callers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthMode {
    /// Everyone is let in.
    None,
    /// A bearer token from the tokens file.
    Token,
    /// A client certificate issued by the listener's client CA; those valid for one
    /// of `peer_names` are peers.
    Mtls {
        /// DNS names or IP addresses of the certificates nodes present to each other.
        peer_names: Vec<String>,
    },
}

/// The files of a listener's TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CAs whose client certificates are accepted (PEM); none: clients are not asked.
    pub client_ca: Option<PathBuf>,
}

/// Whether a client certificate is required to finish the handshake, or only checked
/// when presented (the call is then judged by the listener's auth).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientCerts {
    /// The handshake fails without a valid client certificate.
    Required,
    /// A presented certificate must be valid; none is fine.
    Optional,
}

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
    let peer_names = super::comma_list(&r.peer_names);
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
