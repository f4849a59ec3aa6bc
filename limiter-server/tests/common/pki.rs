//! Test certificates made with the `openssl` command line: CAs and the certificates
//! they issue (P-256 keys, PEM, valid for two days).

#![allow(dead_code)] // each test binary uses a different part

use std::path::{Path, PathBuf};
use std::process::Command;

/// A CA: its certificate and key.
#[derive(Debug, Clone)]
pub(crate) struct Ca {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A certificate and its key.
#[derive(Debug, Clone)]
pub(crate) struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Leaf {
    /// The certificate's PEM.
    pub(crate) fn cert_pem(&self) -> Vec<u8> {
        std::fs::read(&self.cert).unwrap()
    }

    /// The key's PEM.
    pub(crate) fn key_pem(&self) -> Vec<u8> {
        std::fs::read(&self.key).unwrap()
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").current_dir(dir).args(args).output().expect("openssl runs");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

impl Ca {
    /// A new self-signed CA named `name`, its files in `dir`.
    pub(crate) fn new(dir: &Path, name: &str) -> Self {
        let (cert, key) = (format!("{name}.pem"), format!("{name}.key"));
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &cert,
                "-days",
                "2",
                "-subj",
                &format!("/CN={name}"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        );
        Self { cert: dir.join(cert), key: dir.join(key) }
    }

    /// The CA certificate's PEM.
    pub(crate) fn pem(&self) -> Vec<u8> {
        std::fs::read(&self.cert).unwrap()
    }

    /// A certificate for `names` (DNS names or IP addresses), for servers and clients,
    /// its files `file.pem` and `file.key` in the CA's folder.
    pub(crate) fn issue(&self, file: &str, names: &[&str]) -> Leaf {
        let dir = self.cert.parent().unwrap();
        let sans: Vec<String> = names
            .iter()
            .map(|n| {
                if n.parse::<std::net::IpAddr>().is_ok() {
                    format!("IP:{n}")
                } else {
                    format!("DNS:{n}")
                }
            })
            .collect();
        let ext = dir.join(format!("{file}.ext"));
        std::fs::write(
            &ext,
            format!(
                "subjectAltName={}\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n",
                sans.join(",")
            ),
        )
        .unwrap();
        let (cert, key, csr) =
            (format!("{file}.pem"), format!("{file}.key"), format!("{file}.csr"));
        openssl(
            dir,
            &[
                "req",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &format!("/CN={}", names[0]),
            ],
        );
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                self.cert.to_str().unwrap(),
                "-CAkey",
                self.key.to_str().unwrap(),
                "-CAcreateserial",
                "-out",
                &cert,
                "-days",
                "2",
                "-extfile",
                ext.to_str().unwrap(),
            ],
        );
        Leaf { cert: dir.join(cert), key: dir.join(key) }
    }
}
