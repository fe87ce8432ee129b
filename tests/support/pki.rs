//! Test certificates for migrations on `tcp:` (mutual TLS): one CA and
//! the pairs it signs, laid out as QEMU's tls-creds-x509 directories.

use std::path::PathBuf;

use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

use crate::TempDir;

/// A CA and the two pairs it signs, as credentials directories laid out
/// as QEMU's tls-creds-x509: `dest` (server) and `source` (client).
pub struct Pki {
    pub dest: PathBuf,
    pub source: PathBuf,
}

pub fn pki(dir: &TempDir, tag: &str) -> Pki {
    pki_naming(dir, tag, &["127.0.0.1", "localhost"])
}

/// [`pki`], the destination's certificate naming `names` only.
pub fn pki_naming(dir: &TempDir, tag: &str, names: &[&str]) -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, format!("vzram test CA {tag}"));
    let ca = ca.self_signed(&ca_key).unwrap();
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(names.iter().map(|n| n.to_string()).collect());
    let (client_cert, client_key) = leaf(vec!["source.example".into()]);
    let dest = dir.join(&format!("{tag}-dest"));
    let source = dir.join(&format!("{tag}-source"));
    for (d, files) in [
        (
            &dest,
            [
                ("server-cert.pem", server_cert),
                ("server-key.pem", server_key),
            ],
        ),
        (
            &source,
            [
                ("client-cert.pem", client_cert),
                ("client-key.pem", client_key),
            ],
        ),
    ] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("ca-cert.pem"), ca.pem()).unwrap();
        for (name, text) in files {
            std::fs::write(d.join(name), text).unwrap();
        }
    }
    Pki { dest, source }
}
