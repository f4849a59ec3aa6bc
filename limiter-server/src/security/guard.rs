//! Who may call: bearer tokens from a file (reloaded when it changes) or client
//! certificates, checked per call by a tower layer on each listener. Refusals are
//! answered `UNAUTHENTICATED` (no or bad credentials) or `PERMISSION_DENIED` (a
//! client calling what only peers may), on HTTP 401 and 403, and counted.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustls::pki_types::{CertificateDer, ServerName};
use tonic::transport::server::TlsConnectInfo;

pub(crate) use crate::config::security::AuthMode;
use crate::convert::FORWARDED;
use crate::listener::ConnInfo;
use crate::metrics as m;

/// What an identity may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Roles {
    /// Decisions, leases, topology, Envoy calls.
    pub client: bool,
    /// What nodes send each other: handoffs, replicas and forwarded calls (implies
    /// `client`).
    pub peer: bool,
    /// The admin port.
    pub admin: bool,
}

/// A caller the listener recognised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Identity {
    /// Its name (a token's name; `certificate` for a client certificate).
    pub name: Arc<str>,
    /// What it may do.
    pub roles: Roles,
}

/// Tokens by the SHA-256 of their value, so that the file may hold digests only.
#[derive(Debug, Default)]
pub(crate) struct Tokens {
    by_digest: HashMap<[u8; 32], Identity>,
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    d.as_ref().try_into().expect("SHA-256 is 32 bytes")
}

fn hex32(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl Tokens {
    /// Parses a tokens file: one `name roles token` per line, roles a comma list of
    /// `client`, `peer`, `admin`; the token in clear or as `sha256:<64 hex digits>`.
    /// Blank lines and `#` comments are skipped.
    ///
    /// # Errors
    ///
    /// Every bad line, each named by file and line number.
    pub(crate) fn parse(path: &Path, text: &str) -> Result<Self, String> {
        let mut by_digest = HashMap::new();
        let mut errors = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default().trim();
            if line.is_empty() {
                continue;
            }
            let at = format!("{}:{}", path.display(), n + 1);
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [name, roles, token] = fields[..] else {
                errors.push(format!(
                    "{at}: expected `name roles token`, found {} fields",
                    fields.len()
                ));
                continue;
            };
            let mut r = Roles::default();
            for role in roles.split(',') {
                match role {
                    "client" => r.client = true,
                    "peer" => (r.peer, r.client) = (true, true),
                    "admin" => r.admin = true,
                    other => errors.push(format!(
                        "{at}: role `{other}`: expected `client`, `peer` or `admin`"
                    )),
                }
            }
            let digest = match token.strip_prefix("sha256:") {
                Some(hex) => match hex32(hex) {
                    Some(d) => d,
                    None => {
                        errors.push(format!("{at}: `sha256:` needs 64 hex digits"));
                        continue;
                    }
                },
                None => sha256(token.as_bytes()),
            };
            let identity = Identity { name: name.into(), roles: r };
            if let Some(before) = by_digest.insert(digest, identity) {
                errors.push(format!("{at}: the same token as `{}`", before.name));
            }
        }
        if errors.is_empty() { Ok(Self { by_digest }) } else { Err(errors.join("\n")) }
    }

    /// The identity holding `token`.
    pub(crate) fn find(&self, token: &str) -> Option<&Identity> {
        self.by_digest.get(&sha256(token.as_bytes()))
    }

    /// How many tokens there are.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_digest.len()
    }
}

/// The tokens file, as last read successfully.
#[derive(Debug)]
pub(crate) struct TokenFile {
    path: PathBuf,
    tokens: ArcSwap<Tokens>,
    seen: Mutex<String>,
}

impl TokenFile {
    /// Reads and parses `path`.
    ///
    /// # Errors
    ///
    /// An unreadable file, or its bad lines.
    pub(crate) fn load(path: PathBuf) -> Result<Self, String> {
        let text = Self::read(&path)?;
        let tokens = Tokens::parse(&path, &text)?;
        Ok(Self { path, tokens: ArcSwap::from_pointee(tokens), seen: Mutex::new(text) })
    }

    fn read(path: &Path) -> Result<String, String> {
        std::fs::read_to_string(path)
            .map_err(|e| format!("security.tokens_file: cannot read `{}`: {e}", path.display()))
    }

    /// Reads the file again; `None` when unchanged. A bad version keeps the old tokens.
    pub(crate) fn reload(&self) -> Option<Result<(), String>> {
        let text = match Self::read(&self.path) {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        let mut seen = self.seen.lock();
        if *seen == text {
            return None;
        }
        let result = Tokens::parse(&self.path, &text).map(|t| self.tokens.store(Arc::new(t)));
        *seen = text;
        Some(result)
    }

    /// The tokens now in force.
    pub(crate) fn current(&self) -> arc_swap::Guard<Arc<Tokens>> {
        self.tokens.load()
    }
}

/// Which protocol a listener speaks, for the shape of its refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// gRPC: status in trailers-only responses.
    Grpc,
    /// HTTP: 401 and 403.
    Http,
}

/// Why a call was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No token, or no client certificate.
    NoCredentials,
    /// An `authorization` value that is not `Bearer <token>`.
    Malformed,
    /// A token nobody holds.
    UnknownToken,
    /// A known caller asking what its roles do not allow.
    NotAllowed,
}

impl Refusal {
    /// The `reason` label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::NoCredentials => "no_credentials",
            Self::Malformed => "malformed",
            Self::UnknownToken => "unknown_token",
            Self::NotAllowed => "not_allowed",
        }
    }

    fn message(self, listener: &str, needed: &str) -> String {
        match self {
            Self::NoCredentials => format!(
                "the {listener} listener needs credentials: `authorization: Bearer <token>` or a client certificate, as configured"
            ),
            Self::Malformed => "`authorization` must be `Bearer <token>`".to_owned(),
            Self::UnknownToken => "the token is not known".to_owned(),
            Self::NotAllowed => format!("this call needs the `{needed}` role"),
        }
    }
}

/// A listener's gatekeeper.
#[derive(Debug)]
pub(crate) struct Guard {
    listener: &'static str,
    protocol: Protocol,
    mode: AuthMode,
    tokens: Option<Arc<TokenFile>>,
    peer_names: Vec<ServerName<'static>>,
    /// Paths let through without credentials (health checks).
    open_paths: &'static [&'static str],
}

/// Whether a certificate is valid for one of `names`.
fn valid_for(cert: &CertificateDer<'_>, names: &[ServerName<'static>]) -> bool {
    webpki::EndEntityCert::try_from(cert)
        .is_ok_and(|ee| names.iter().any(|n| ee.verify_is_valid_for_subject_name(n).is_ok()))
}

impl Guard {
    /// A guard for `listener` (`grpc` or `admin`).
    ///
    /// # Errors
    ///
    /// A peer name that is neither a DNS name nor an IP address.
    pub(crate) fn new(
        listener: &'static str,
        protocol: Protocol,
        mode: AuthMode,
        tokens: Option<Arc<TokenFile>>,
        open_paths: &'static [&'static str],
    ) -> Result<Self, String> {
        let peer_names = match &mode {
            AuthMode::Mtls { peer_names } => peer_names
                .iter()
                .map(|n| {
                    ServerName::try_from(n.clone())
                        .map_err(|_| format!("security.{listener}.peer_names: `{n}` is neither a DNS name nor an IP address"))
                })
                .collect::<Result<_, _>>()?,
            _ => Vec::new(),
        };
        Ok(Self { listener, protocol, mode, tokens, peer_names, open_paths })
    }

    /// Who is calling, or why the call is refused. `needs` is the role the call needs.
    fn identify<B>(&self, req: &http::Request<B>, needs: Role) -> Result<(), Refusal> {
        match &self.mode {
            AuthMode::None => Ok(()),
            AuthMode::Token => {
                let Some(value) = req.headers().get(http::header::AUTHORIZATION) else {
                    return Err(Refusal::NoCredentials);
                };
                let token = value
                    .to_str()
                    .ok()
                    .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
                    .map(str::trim)
                    .ok_or(Refusal::Malformed)?;
                let tokens = self.tokens.as_ref().map(|t| t.current());
                let id =
                    tokens.as_ref().and_then(|t| t.find(token)).ok_or(Refusal::UnknownToken)?;
                needs.allowed(id.roles).then_some(()).ok_or(Refusal::NotAllowed)
            }
            AuthMode::Mtls { .. } => {
                let certs = req
                    .extensions()
                    .get::<TlsConnectInfo<ConnInfo>>()
                    .and_then(TlsConnectInfo::peer_certs)
                    .filter(|c| !c.is_empty())
                    .ok_or(Refusal::NoCredentials)?;
                // The handshake verified the chain; any such certificate is a client.
                let ok = match needs {
                    Role::Client | Role::Admin => true,
                    Role::Peer => valid_for(&certs[0], &self.peer_names),
                };
                ok.then_some(()).ok_or(Refusal::NotAllowed)
            }
        }
    }

    fn role_for<B>(&self, req: &http::Request<B>) -> Option<Role> {
        let path = req.uri().path();
        if self.open_paths.iter().any(|p| path.starts_with(p)) {
            return None;
        }
        Some(match self.protocol {
            Protocol::Http => Role::Admin,
            Protocol::Grpc
                if path == "/limiter.v1.RateLimiter/Handoff"
                    || path == "/limiter.v1.RateLimiter/Replicate"
                    || req.headers().contains_key(FORWARDED) =>
            {
                Role::Peer
            }
            Protocol::Grpc => Role::Client,
        })
    }

    /// Checks a call; counts and logs a refusal.
    fn check<B>(&self, req: &http::Request<B>) -> Result<(), (Refusal, Role)> {
        if self.mode == AuthMode::None {
            return Ok(());
        }
        let Some(needs) = self.role_for(req) else { return Ok(()) };
        self.identify(req, needs).map_err(|refusal| {
            metrics::counter!(m::AUTH_REFUSALS, "listener" => self.listener, "reason" => refusal.label())
                .increment(1);
            tracing::debug!(listener = self.listener, path = req.uri().path(), reason = refusal.label(), "call refused");
            (refusal, needs)
        })
    }

    fn refuse<R: Default>(&self, refusal: Refusal, needs: Role) -> http::Response<R> {
        let message = refusal.message(self.listener, needs.label());
        match self.protocol {
            Protocol::Grpc => match refusal {
                Refusal::NotAllowed => tonic::Status::permission_denied(message),
                _ => tonic::Status::unauthenticated(message),
            }
            .into_http(),
            Protocol::Http => {
                let mut r = http::Response::new(R::default());
                *r.status_mut() = match refusal {
                    Refusal::NotAllowed => http::StatusCode::FORBIDDEN,
                    _ => http::StatusCode::UNAUTHORIZED,
                };
                r.headers_mut().insert(
                    http::header::WWW_AUTHENTICATE,
                    http::HeaderValue::from_static("Bearer"),
                );
                r
            }
        }
    }
}

/// The role a call needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Client,
    Peer,
    Admin,
}

impl Role {
    fn allowed(self, roles: Roles) -> bool {
        match self {
            Self::Client => roles.client,
            Self::Peer => roles.peer,
            Self::Admin => roles.admin,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Peer => "peer",
            Self::Admin => "admin",
        }
    }
}

/// The tower layer putting a [`Guard`] in front of a listener's services.
#[derive(Debug, Clone)]
pub(crate) struct GuardLayer(pub Arc<Guard>);

impl<S> tower::Layer<S> for GuardLayer {
    type Service = Guarded<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Guarded { inner, guard: self.0.clone() }
    }
}

/// A service behind a [`Guard`].
#[derive(Debug, Clone)]
pub(crate) struct Guarded<S> {
    inner: S,
    guard: Arc<Guard>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<S, B, R> tower::Service<http::Request<B>> for Guarded<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    R: Default + Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        match self.guard.check(&req) {
            Ok(()) => Box::pin(self.inner.call(req)),
            Err((refusal, needs)) => {
                let response = self.guard.refuse(refusal, needs);
                Box::pin(std::future::ready(Ok(response)))
            }
        }
    }
}

#[cfg(test)]
mod tests;
