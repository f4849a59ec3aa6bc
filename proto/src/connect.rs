//! How a client (an agent, a gateway, a peer node) reaches a limiter's gRPC listener:
//! in plaintext or over TLS (trusting a given CA, optionally presenting a client
//! certificate for mTLS), with an optional bearer token sent on every call.
//!
//! ```no_run
//! # fn main() -> Result<(), limiter_proto::connect::ConnectError> {
//! use limiter_proto::connect::ClientSecurity;
//! let security = ClientSecurity::plaintext().with_token("s3cret")?;
//! let channel = security.endpoint("10.0.0.5:50051")?.connect_lazy();
//! let client = limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient::with_interceptor(
//!     channel,
//!     security.auth(),
//! );
//! # let _ = client; Ok(()) }
//! ```

use std::fmt;
use std::path::Path;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// The metadata a token travels in, as `Bearer <token>`.
pub const AUTHORIZATION: &str = "authorization";

/// A channel whose calls carry the client's token.
pub type AuthChannel = InterceptedService<Channel, Auth>;

/// Why client security could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// A file could not be read.
    #[error("{what} `{path}`: {source}")]
    File {
        /// Which file (`CA file`, `certificate file`...).
        what: &'static str,
        /// Its path.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A token that cannot travel in gRPC metadata.
    #[error("the token must be non-empty visible ASCII without spaces")]
    Token,
    /// An address that is neither `host:port` nor a URL.
    #[error("`{0}` is not a valid endpoint: {1}")]
    Endpoint(String, String),
    /// TLS could not be configured on an endpoint.
    #[error("TLS for `{0}`: {1}")]
    Tls(String, String),
}

/// TLS and token settings of a client. The default is plaintext without a token.
#[derive(Clone, Default)]
pub struct ClientSecurity {
    tls: Option<ClientTlsConfig>,
    token: Option<MetadataValue<Ascii>>,
}

impl fmt::Debug for ClientSecurity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientSecurity")
            .field("tls", &self.tls.is_some())
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl ClientSecurity {
    /// Plaintext, no token.
    pub fn plaintext() -> Self {
        Self::default()
    }

    /// TLS, trusting server certificates issued by the CA in `ca_pem`.
    pub fn tls(ca_pem: impl AsRef<[u8]>) -> Self {
        Self {
            tls: Some(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem))),
            token: None,
        }
    }

    /// Checks server certificates against `name` instead of the host being dialled
    /// (nodes addressed by IP that share a certificate for one DNS name).
    ///
    /// Does nothing without TLS.
    pub fn with_server_name(mut self, name: impl Into<String>) -> Self {
        self.tls = self.tls.map(|t| t.domain_name(name));
        self
    }

    /// Presents the certificate chain and key (PEM) to servers that ask (mTLS).
    ///
    /// Does nothing without TLS.
    pub fn with_identity(mut self, cert_pem: impl AsRef<[u8]>, key_pem: impl AsRef<[u8]>) -> Self {
        self.tls = self.tls.map(|t| t.identity(Identity::from_pem(cert_pem, key_pem)));
        self
    }

    /// Sends `token` as `authorization: Bearer <token>` on every call.
    ///
    /// # Errors
    ///
    /// A token that is empty or not visible ASCII.
    pub fn with_token(mut self, token: &str) -> Result<Self, ConnectError> {
        let token = token.trim();
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConnectError::Token);
        }
        self.token = Some(format!("Bearer {token}").parse().map_err(|_| ConnectError::Token)?);
        Ok(self)
    }

    /// From files: the CA to trust (none: plaintext), an optional client certificate
    /// and key, an optional name to check servers against, an optional token file
    /// (its first line, trimmed).
    ///
    /// # Errors
    ///
    /// An unreadable file, a certificate without its key, a malformed token.
    pub fn from_files(
        ca_file: Option<&Path>,
        identity: Option<(&Path, &Path)>,
        server_name: Option<&str>,
        token_file: Option<&Path>,
    ) -> Result<Self, ConnectError> {
        let mut s = match ca_file {
            Some(ca) => Self::tls(read("CA file", ca)?),
            None => Self::plaintext(),
        };
        if let Some((cert, key)) = identity {
            s = s.with_identity(read("certificate file", cert)?, read("key file", key)?);
        }
        if let Some(name) = server_name.filter(|n| !n.is_empty()) {
            s = s.with_server_name(name);
        }
        if let Some(t) = token_file {
            let text =
                String::from_utf8(read("token file", t)?).map_err(|_| ConnectError::Token)?;
            s = s.with_token(text.lines().next().unwrap_or_default())?;
        }
        Ok(s)
    }

    /// Whether calls go over TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The URL of a `host:port` address (`https://` with TLS); URLs are kept as they are.
    pub fn url(&self, address: &str) -> String {
        if address.contains("://") {
            address.to_owned()
        } else if self.is_tls() {
            format!("https://{address}")
        } else {
            format!("http://{address}")
        }
    }

    /// An endpoint for `address` (`host:port` or a URL) with these settings.
    ///
    /// # Errors
    ///
    /// An invalid address, or TLS that cannot be set on it.
    pub fn endpoint(&self, address: &str) -> Result<Endpoint, ConnectError> {
        let url = self.url(address);
        // A scheme that disagrees with the settings would fail later, less clearly (or
        // send a token in clear).
        if self.is_tls() && url.starts_with("http://") {
            return Err(ConnectError::Tls(
                url,
                "TLS is configured but the URL says http://".into(),
            ));
        }
        if !self.is_tls() && url.starts_with("https://") {
            return Err(ConnectError::Tls(url, "an https:// URL needs a CA to trust".into()));
        }
        let endpoint = Endpoint::from_shared(url.clone())
            .map_err(|e| ConnectError::Endpoint(url.clone(), e.to_string()))?;
        match &self.tls {
            Some(tls) => {
                endpoint.tls_config(tls.clone()).map_err(|e| ConnectError::Tls(url, e.to_string()))
            }
            None => Ok(endpoint),
        }
    }

    /// The interceptor adding the token to each call (nothing without a token).
    pub fn auth(&self) -> Auth {
        Auth(self.token.clone())
    }

    /// A lazily connecting channel to `address`, its calls carrying the token.
    ///
    /// # Errors
    ///
    /// As [`Self::endpoint`].
    pub fn connect_lazy(
        &self,
        address: &str,
        configure: impl FnOnce(Endpoint) -> Endpoint,
    ) -> Result<AuthChannel, ConnectError> {
        let channel = configure(self.endpoint(address)?).connect_lazy();
        Ok(InterceptedService::new(channel, self.auth()))
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|source| ConnectError::File {
        what,
        path: path.display().to_string(),
        source,
    })
}

/// Adds `authorization: Bearer <token>` to calls.
#[derive(Clone, Default)]
pub struct Auth(Option<MetadataValue<Ascii>>);

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "Auth(<token>)" } else { "Auth(none)" })
    }
}

impl Interceptor for Auth {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(t) = &self.0 {
            request.metadata_mut().insert(AUTHORIZATION, t.clone());
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_get_the_scheme_of_their_transport() {
        let plain = ClientSecurity::plaintext();
        assert_eq!(plain.url("10.0.0.1:50051"), "http://10.0.0.1:50051");
        assert_eq!(plain.url("https://a:1"), "https://a:1");
        let tls = ClientSecurity::tls(b"");
        assert!(tls.is_tls());
        assert_eq!(tls.url("node-a:50051"), "https://node-a:50051");
    }

    #[test]
    fn tokens_are_checked_and_sent_as_bearer() {
        assert!(ClientSecurity::plaintext().with_token("").is_err());
        assert!(ClientSecurity::plaintext().with_token("has space").is_err());
        assert!(ClientSecurity::plaintext().with_token("naïve").is_err());
        let s = ClientSecurity::plaintext().with_token(" abc \n").unwrap();
        assert!(format!("{s:?}").contains("redacted"), "{s:?}");
        let r = s.auth().call(tonic::Request::new(())).unwrap();
        assert_eq!(r.metadata().get(AUTHORIZATION).unwrap(), "Bearer abc");
        let r = ClientSecurity::plaintext().auth().call(tonic::Request::new(())).unwrap();
        assert!(r.metadata().get(AUTHORIZATION).is_none());
    }

    #[test]
    fn a_scheme_must_agree_with_the_settings() {
        let plain = ClientSecurity::plaintext();
        let e = plain.endpoint("https://a:1").unwrap_err();
        assert!(e.to_string().contains("needs a CA"), "{e}");
        assert!(plain.endpoint("a:1").is_ok());
        let e = ClientSecurity::tls(b"").endpoint("http://a:1").unwrap_err();
        assert!(e.to_string().contains("says http://"), "{e}");
    }

    #[test]
    fn missing_files_are_named() {
        let e =
            ClientSecurity::from_files(Some(Path::new("/nonexistent/ca.pem")), None, None, None)
                .unwrap_err();
        assert!(e.to_string().contains("CA file `/nonexistent/ca.pem`"), "{e}");
    }
}
