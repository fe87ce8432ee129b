//! Migration addresses: `unix:PATH` or `tcp:HOST:PORT`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where a migration stream goes or comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Addr {
    Unix(PathBuf),
    /// `HOST:PORT`, resolved when used.
    Tcp(String),
}

impl Addr {
    /// The host of a TCP address, without its port or an IPv6 address's
    /// brackets: the name the peer's certificate must carry.
    pub fn host(&self) -> Option<&str> {
        match self {
            Addr::Unix(_) => None,
            Addr::Tcp(hp) => {
                let host = hp.rsplit_once(':').map_or(hp.as_str(), |(h, _)| h);
                Some(
                    host.strip_prefix('[')
                        .and_then(|h| h.strip_suffix(']'))
                        .unwrap_or(host),
                )
            }
        }
    }
}

/// A migration address that is neither form (as given).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad migration address {0:?}: expected unix:PATH or tcp:HOST:PORT")]
pub struct ParseAddrError(pub String);

impl FromStr for Addr {
    type Err = ParseAddrError;

    fn from_str(s: &str) -> Result<Addr, ParseAddrError> {
        let bad = || ParseAddrError(s.to_string());
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(bad());
            }
            return Ok(Addr::Unix(PathBuf::from(p)));
        }
        if let Some(hp) = s.strip_prefix("tcp:") {
            let (host, port) = hp.rsplit_once(':').ok_or_else(bad)?;
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(bad());
            }
            return Ok(Addr::Tcp(hp.to_string()));
        }
        Err(bad())
    }
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Addr::Unix(p) => write!(f, "unix:{}", p.display()),
            Addr::Tcp(hp) => write!(f, "tcp:{hp}"),
        }
    }
}

impl Serialize for Addr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Addr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Addr, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

pub fn parse_addr(s: &str) -> Result<Addr, ParseAddrError> {
    s.parse()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(
            "unix:/run/m.sock".parse(),
            Ok(Addr::Unix("/run/m.sock".into()))
        );
        assert_eq!(
            "tcp:10.0.0.2:4444".parse(),
            Ok(Addr::Tcp("10.0.0.2:4444".into()))
        );
        assert_eq!("tcp:[::1]:4444".parse(), Ok(Addr::Tcp("[::1]:4444".into())));
        let host = |s: &str| s.parse::<Addr>().unwrap().host().map(str::to_string);
        assert_eq!(host("tcp:[::1]:4444").as_deref(), Some("::1"));
        assert_eq!(host("tcp:10.0.0.2:4444").as_deref(), Some("10.0.0.2"));
        assert_eq!(host("tcp:dst.example:1").as_deref(), Some("dst.example"));
        assert_eq!(host("unix:/x"), None);
        for bad in [
            "",
            "unix:",
            "tcp:host",
            "tcp::1",
            "tcp:h:99999",
            "/path",
            "udp:h:1",
        ] {
            let e = bad.parse::<Addr>().unwrap_err();
            assert!(
                e.to_string().contains("unix:PATH or tcp:HOST:PORT"),
                "{bad}: {e}"
            );
        }
        let a: Addr = "unix:/x".parse().unwrap();
        assert_eq!(a.to_string(), "unix:/x");
    }
}
