//! systemd's readiness protocol (`sd_notify`): datagrams such as `READY=1`
//! to the unix socket named by `$NOTIFY_SOCKET` (a path, or an abstract
//! address written `@name`).
//!
//! The socket is made and connected at start, before the seccomp filter,
//! which allows neither a datagram socket nor (usefully) a new connect;
//! later messages are a plain `send` on it.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// A connected link to the service manager.
pub struct Notifier {
    sock: UnixDatagram,
}

impl Notifier {
    /// The link `$NOTIFY_SOCKET` asks for; `Ok(None)` when it is unset.
    pub fn from_env() -> io::Result<Option<Notifier>> {
        match std::env::var_os("NOTIFY_SOCKET") {
            Some(p) if !p.is_empty() => Notifier::connect(p.as_bytes()).map(Some),
            _ => Ok(None),
        }
    }

    fn connect(path: &[u8]) -> io::Result<Notifier> {
        let addr = match path.strip_prefix(b"@") {
            Some(name) => SocketAddr::from_abstract_name(name)?,
            None => SocketAddr::from_pathname(std::ffi::OsStr::from_bytes(path))?,
        };
        let sock = UnixDatagram::unbound()?;
        sock.connect_addr(&addr)?;
        Ok(Notifier { sock })
    }

    /// Sends one message: newline-separated `KEY=value` lines.
    pub fn send(&self, msg: &str) -> io::Result<()> {
        self.sock.send(msg.as_bytes()).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_and_abstract_addresses() {
        let dir = std::env::temp_dir().join(format!("vzram-notify-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("n.sock");
        let _ = std::fs::remove_file(&path);
        let rx = UnixDatagram::bind(&path).unwrap();
        let n = Notifier::connect(path.as_os_str().as_bytes()).unwrap();
        n.send("READY=1\nSTATUS=x").unwrap();
        let mut buf = [0u8; 64];
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"READY=1\nSTATUS=x");
        let _ = std::fs::remove_dir_all(&dir);

        let name = format!("vzram-notify-test-{}", std::process::id());
        let rx = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
            .unwrap();
        let n = Notifier::connect(format!("@{name}").as_bytes()).unwrap();
        n.send("STOPPING=1").unwrap();
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"STOPPING=1");
        assert!(Notifier::connect(b"/nonexistent/vzram/notify").is_err());
    }
}
