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

/// A connected link to the service manager. Non-blocking: a message the
/// manager is too slow to take is dropped (the next status carries the
/// news), never waited for on the supervisor's loop.
pub struct Notifier {
    sock: UnixDatagram,
    watchdog: Option<std::time::Duration>,
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
        sock.set_nonblocking(true)?;
        Ok(Notifier {
            sock,
            watchdog: watchdog_from_env(),
        })
    }

    /// Sends one message: newline-separated `KEY=value` lines. A full
    /// queue at the receiver is `WouldBlock`: the message is dropped.
    pub fn send(&self, msg: &str) -> io::Result<()> {
        self.sock.send(msg.as_bytes()).map(|_| ())
    }

    /// How often the service manager wants `WATCHDOG=1` (`WatchdogSec=`):
    /// half its timeout, as sd_watchdog_enabled advises.
    pub fn watchdog_every(&self) -> Option<std::time::Duration> {
        self.watchdog.map(|t| t / 2)
    }
}

/// `$WATCHDOG_USEC`, if it is meant for this process (`$WATCHDOG_PID`
/// unset or ours).
fn watchdog_from_env() -> Option<std::time::Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.parse::<u32>().ok() != Some(std::process::id()) {
            return None;
        }
    }
    (usec > 0).then(|| std::time::Duration::from_micros(usec))
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

    #[test]
    fn a_receiver_that_stops_reading_never_blocks_a_send() {
        let name = format!("vzram-notify-full-{}", std::process::id());
        let _rx =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
                .unwrap();
        let n = Notifier::connect(format!("@{name}").as_bytes()).unwrap();
        let t = std::time::Instant::now();
        let mut dropped = 0;
        for _ in 0..10_000 {
            if let Err(e) = n.send("STATUS=serving 1 devices, 1 connected") {
                assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
                dropped += 1;
            }
        }
        assert!(dropped > 0, "the receiver's queue never filled");
        assert!(
            t.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            t.elapsed()
        );
    }
}
