//! Mutual TLS for migration streams on TCP (rustls, TLS 1.3 only): the
//! credentials directory read at start, and the configurations each end
//! of a stream builds from the PEM text it was sent.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::proto::tls::{
    Credentials, CredsDir, CA_CERT, CLIENT_CERT, CLIENT_KEY, SERVER_CERT, SERVER_KEY,
};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{what}: {why}")]
    Pem { what: &'static str, why: String },
    #[error("{}: {file} without {other}", dir.display())]
    HalfPair {
        dir: PathBuf,
        file: &'static str,
        other: &'static str,
    },
    #[error("{}: neither {SERVER_CERT} (to receive) nor {CLIENT_CERT} (to send)", dir.display())]
    NoPair { dir: PathBuf },
    #[error("the {what} credentials: {why}")]
    Config { what: &'static str, why: String },
    #[error("{0:?} is not a name a certificate can carry")]
    Name(String),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn chain(pem: &str, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            what,
            why: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            what,
            why: "no certificate in it".into(),
        });
    }
    Ok(certs)
}

fn key(pem: &str, what: &'static str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|e| TlsError::Pem {
        what,
        why: e.to_string(),
    })
}

fn roots(ca: &str) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in chain(ca, CA_CERT)? {
        roots.add(c).map_err(|e| TlsError::Pem {
            what: CA_CERT,
            why: e.to_string(),
        })?;
    }
    Ok(Arc::new(roots))
}

/// The destination's configuration: its certificate, and a client
/// certificate signed by the CA required of every peer.
pub fn server_config(c: &Credentials) -> Result<Arc<ServerConfig>, TlsError> {
    let bad = |e: rustls::Error| TlsError::Config {
        what: "server",
        why: e.to_string(),
    };
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(&c.ca)?, provider())
        .build()
        .map_err(|e| TlsError::Config {
            what: "server",
            why: e.to_string(),
        })?;
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(bad)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain(&c.cert, SERVER_CERT)?, key(&c.key, SERVER_KEY)?)
        .map_err(bad)?;
    // One stream per connection: nothing resumes a session.
    cfg.send_tls13_tickets = 0;
    Ok(Arc::new(cfg))
}

/// The source's configuration: the destination must show a certificate
/// from the CA for `server_name`; this end shows its own.
pub fn client_config(c: &Credentials) -> Result<Arc<ClientConfig>, TlsError> {
    let bad = |e: rustls::Error| TlsError::Config {
        what: "client",
        why: e.to_string(),
    };
    let cfg = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(bad)?
        .with_root_certificates(roots(&c.ca)?)
        .with_client_auth_cert(chain(&c.cert, CLIENT_CERT)?, key(&c.key, CLIENT_KEY)?)
        .map_err(bad)?;
    Ok(Arc::new(cfg))
}

pub fn server_name(name: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(name.to_string()).map_err(|_| TlsError::Name(name.into()))
}

fn read(dir: &Path, file: &str) -> Result<Option<String>, TlsError> {
    let path = dir.join(file);
    match std::fs::read_to_string(&path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TlsError::Read { path, source }),
    }
}

/// Reads a credentials directory and checks that what it holds makes a
/// working configuration, so that a bad file stops the start rather than
/// the first migration.
pub fn load_dir(dir: &Path) -> Result<CredsDir, TlsError> {
    let d = dir.to_path_buf();
    let ca = read(dir, CA_CERT)?.ok_or_else(|| TlsError::Read {
        path: dir.join(CA_CERT),
        source: io::Error::from(io::ErrorKind::NotFound),
    })?;
    let pair = |cert: &'static str, key: &'static str| -> Result<Option<Credentials>, TlsError> {
        match (read(dir, cert)?, read(dir, key)?) {
            (Some(c), Some(k)) => Ok(Some(Credentials {
                ca: ca.clone(),
                cert: c,
                key: k,
            })),
            (None, None) => Ok(None),
            (Some(_), None) => Err(TlsError::HalfPair {
                dir: d.clone(),
                file: cert,
                other: key,
            }),
            (None, Some(_)) => Err(TlsError::HalfPair {
                dir: d.clone(),
                file: key,
                other: cert,
            }),
        }
    };
    let server = pair(SERVER_CERT, SERVER_KEY)?;
    let client = pair(CLIENT_CERT, CLIENT_KEY)?;
    if let Some(s) = &server {
        server_config(s)?;
    }
    if let Some(c) = &client {
        client_config(c)?;
    }
    if server.is_none() && client.is_none() {
        return Err(TlsError::NoPair { dir: d });
    }
    Ok(CredsDir {
        dir: dir.to_path_buf(),
        server,
        client,
    })
}
