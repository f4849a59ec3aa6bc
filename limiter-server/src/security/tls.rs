//! TLS on a listener: certificates read from files, swapped in when the files change
//! (new connections get the new certificate; open connections keep theirs and are
//! not dropped), and handshakes done off the accept loop, bounded in number and time.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::listener::Conn;
use crate::metrics as m;

/// A handshake not finished in this long is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once on one listener; more wait to be accepted.
const MAX_HANDSHAKES: usize = 1024;

pub(crate) use crate::config::security::{ClientCerts, TlsFiles};

/// A listener's TLS: its files and the configuration made of them last.
pub(crate) struct TlsState {
    listener: &'static str,
    files: TlsFiles,
    client_certs: ClientCerts,
    alpn: &'static [u8],
    config: ArcSwap<rustls::ServerConfig>,
    seen: Mutex<Vec<u8>>,
}

impl std::fmt::Debug for TlsState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsState")
            .field("listener", &self.listener)
            .field("files", &self.files)
            .finish()
    }
}

/// The configuration section of `listener`'s settings.
fn section(listener: &str) -> String {
    format!("security.{listener}")
}

fn read(field: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{field}: cannot read `{}`: {e}", path.display()))
}

impl TlsState {
    /// Reads and checks the files.
    ///
    /// # Errors
    ///
    /// An unreadable file, or one that holds no usable certificate or key; the message
    /// names the field (under `security.<listener>`) and the file.
    pub(crate) fn load(
        listener: &'static str,
        files: TlsFiles,
        client_certs: ClientCerts,
        alpn: &'static [u8],
    ) -> Result<Self, String> {
        let section = section(listener);
        let contents = Self::read_all(&section, &files)?;
        let config = build(&section, &files, &contents, client_certs, alpn)?;
        Ok(Self {
            listener,
            files,
            client_certs,
            alpn,
            config: ArcSwap::from_pointee(config),
            seen: Mutex::new(contents.concat()),
        })
    }

    fn read_all(section: &str, files: &TlsFiles) -> Result<[Vec<u8>; 3], String> {
        Ok([
            read(&format!("{section}.cert_file"), &files.cert)?,
            read(&format!("{section}.key_file"), &files.key)?,
            match &files.client_ca {
                Some(ca) => read(&format!("{section}.client_ca_file"), ca)?,
                None => Vec::new(),
            },
        ])
    }

    /// Reads the files again and, if they changed and are valid, makes new handshakes
    /// use them. `None`: unchanged.
    ///
    /// A bad new certificate keeps the old one in service.
    pub(crate) fn reload(&self) -> Option<Result<(), String>> {
        let section = section(self.listener);
        let contents = match Self::read_all(&section, &self.files) {
            Ok(c) => c,
            Err(e) => return Some(Err(e)),
        };
        let joined = contents.concat();
        let mut seen = self.seen.lock();
        if *seen == joined {
            return None;
        }
        let result = build(&section, &self.files, &contents, self.client_certs, self.alpn)
            .map(|c| self.config.store(Arc::new(c)));
        // A bad version is reported once, not on every poll.
        *seen = joined;
        Some(result)
    }

    /// The listener's label in metrics.
    pub(crate) fn listener(&self) -> &'static str {
        self.listener
    }

    fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.config.load_full())
    }
}

fn build(
    section: &str,
    files: &TlsFiles,
    [cert, key, ca]: &[Vec<u8>; 3],
    client_certs: ClientCerts,
    alpn: &[u8],
) -> Result<rustls::ServerConfig, String> {
    let bad = |field: &str, path: &Path, e: &dyn std::fmt::Display| {
        format!("{section}.{field}: `{}`: {e}", path.display())
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<_, _>>()
        .map_err(|e| bad("cert_file", &files.cert, &e))?;
    if chain.is_empty() {
        return Err(bad("cert_file", &files.cert, &"no PEM certificate in the file"));
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| bad("key_file", &files.key, &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("{section}: {e}"))?;
    let builder = match &files.client_ca {
        Some(path) => {
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(ca) {
                let c = c.map_err(|e| bad("client_ca_file", path, &e))?;
                roots.add(c).map_err(|e| bad("client_ca_file", path, &e))?;
            }
            if roots.is_empty() {
                return Err(bad("client_ca_file", path, &"no PEM certificate in the file"));
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = match client_certs {
                ClientCerts::Required => verifier,
                ClientCerts::Optional => verifier.allow_unauthenticated(),
            };
            builder.with_client_cert_verifier(
                verifier.build().map_err(|e| bad("client_ca_file", path, &e))?,
            )
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| match e {
        rustls::Error::InvalidCertificate(_) => bad("cert_file", &files.cert, &e),
        e => bad("key_file", &files.key, &format!("does not suit the certificate: {e}")),
    })?;
    config.alpn_protocols = vec![alpn.to_vec()];
    Ok(config)
}

/// A connection counted by its listener, under TLS.
pub(crate) type TlsConn = TlsStream<Conn<TcpStream>>;

/// Takes the connections of `incoming` through their TLS handshake and hands over
/// those that succeed, in the order they finish. Stops when the receiver is dropped.
pub(crate) fn accept(
    mut incoming: mpsc::Receiver<Conn<TcpStream>>,
    tls: Arc<TlsState>,
) -> mpsc::Receiver<TlsConn> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let slots = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else { return };
            let tcp = tokio::select! {
                () = tx.closed() => return,
                next = incoming.recv() => match next {
                    Some(tcp) => tcp,
                    None => return,
                },
            };
            let (tx, tls) = (tx.clone(), tls.clone());
            tokio::spawn(async move {
                let peer = tcp.get_ref().peer_addr().unwrap_or_else(|_| ([0, 0, 0, 0], 0).into());
                let acceptor = tls.acceptor();
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        drop(slot);
                        let _ = tx.send(stream).await;
                    }
                    Ok(Err(e)) => {
                        metrics::counter!(m::TLS_HANDSHAKE_FAILURES, "listener" => tls.listener, "kind" => "refused").increment(1);
                        tracing::debug!(listener = tls.listener, %peer, "TLS handshake failed: {e}");
                    }
                    Err(_) => {
                        metrics::counter!(m::TLS_HANDSHAKE_FAILURES, "listener" => tls.listener, "kind" => "timeout").increment(1);
                        tracing::debug!(listener = tls.listener, %peer, "TLS handshake timed out");
                    }
                }
            });
        }
    });
    rx
}
