//! TLS credentials for migration streams on TCP, as they travel from the
//! supervisor (which read them at start) to the process that runs a
//! stream, which may open no files: PEM text.

use serde::{Deserialize, Serialize};

/// One end's credentials: the CA both ends trust, and this end's
/// certificate chain and private key.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credentials {
    pub ca: String,
    pub cert: String,
    pub key: String,
}

// Orders are logged with `{:?}`: the key must never reach a log.
impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("ca", &format_args!("{} bytes", self.ca.len()))
            .field("cert", &format_args!("{} bytes", self.cert.len()))
            .field("key", &format_args!("(hidden)"))
            .finish()
    }
}

/// What a sender needs: its client credentials, and the name the
/// destination's certificate must carry (the HOST of `tcp:HOST:PORT`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientTls {
    pub creds: Credentials,
    pub server_name: String,
}

/// A credentials directory as QEMU's `tls-creds-x509` lays it out: the
/// CA, and a server pair (to receive), a client pair (to send), or both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredsDir {
    pub dir: std::path::PathBuf,
    pub server: Option<Credentials>,
    pub client: Option<Credentials>,
}

/// The file names in a credentials directory.
pub const CA_CERT: &str = "ca-cert.pem";
pub const SERVER_CERT: &str = "server-cert.pem";
pub const SERVER_KEY: &str = "server-key.pem";
pub const CLIENT_CERT: &str = "client-cert.pem";
pub const CLIENT_KEY: &str = "client-key.pem";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_key() {
        let c = Credentials {
            ca: "CA".into(),
            cert: "CERT".into(),
            key: "-----BEGIN PRIVATE KEY-----SECRET".into(),
        };
        let t = format!(
            "{:?}",
            ClientTls {
                creds: c,
                server_name: "h".into()
            }
        );
        assert!(!t.contains("SECRET") && !t.contains("PRIVATE"), "{t}");
    }
}
