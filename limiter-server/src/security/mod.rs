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

pub(crate) mod guard;
pub(crate) mod tls;

use std::sync::Arc;
use std::time::Duration;

use limiter_proto::connect::ClientSecurity;
use tokio_util::sync::CancellationToken;

pub(crate) use crate::config::security::{AuthMode, ClientCerts, ListenerSecurity, SecurityConfig};

use self::guard::{Guard, Protocol, TokenFile};
use self::tls::TlsState;
use crate::metrics as m;

/// gRPC paths open without credentials.
const GRPC_OPEN: &[&str] = &["/grpc.health.v1.Health/"];
/// Admin paths open without credentials.
const ADMIN_OPEN: &[&str] = &["/healthz", "/readyz"];

/// TLS states, guards and the peer client, loaded from a [`SecurityConfig`].
#[derive(Debug)]
pub(crate) struct Security {
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
    /// Reads every file the configuration names.
    ///
    /// # Errors
    ///
    /// Every unreadable or invalid file, each named with its field.
    pub(crate) fn load(c: &SecurityConfig) -> Result<Self, String> {
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
    pub(crate) fn reload(&self) {
        for tls in [&self.grpc_tls, &self.admin_tls].into_iter().flatten() {
            report(tls.listener(), "certificate", tls.reload());
        }
        if let Some(t) = &self.tokens {
            report("tokens", "tokens", t.reload());
        }
    }

    /// Reloads every `every` until cancelled.
    pub(crate) async fn watch(self: Arc<Self>, every: Duration, cancel: CancellationToken) {
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
