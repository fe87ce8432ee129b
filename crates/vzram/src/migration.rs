//! Live migration as the daemon runs it: the addresses (`unix:PATH`,
//! `tcp:HOST:PORT`), the connection a transfer runs over, and the two
//! halves ([`send`], [`receive`]) that the process owning the device's
//! allocator runs: its worker while a frontend is connected, else the
//! supervisor. Sockets are bound and connected by the launcher (or at
//! start-up, before the sandbox): the supervisor and the workers may not.
//! The stream itself is `vzram_store::migrate`'s.

use std::fmt;
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vzram_store::cells::{
    MIGRATION_FAILED, MIGRATION_INCOMING, MIGRATION_NONE, MIGRATION_RECEIVING, MIGRATION_SENDING,
    MIGRATION_SEND_FAILED, MIGRATION_SENT,
};
use vzram_store::migrate::{self, Progress, ReceiveReport, SendReport};
use vzram_store::{Context, Device};

/// How long one read or write on a migration connection may stall before
/// the transfer is given up: a peer that stops talking must not hold a
/// device for ever.
pub const STALL: Duration = Duration::from_secs(60);
/// How long connecting to a destination may take.
pub const CONNECT_WAIT: Duration = Duration::from_secs(10);

/// Where a migration stream goes or comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Addr {
    Unix(PathBuf),
    /// `HOST:PORT`, resolved when used.
    Tcp(String),
}

impl FromStr for Addr {
    type Err = String;

    fn from_str(s: &str) -> Result<Addr, String> {
        let bad = || format!("bad migration address {s:?}: expected unix:PATH or tcp:HOST:PORT");
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

pub fn parse_addr(s: &str) -> Result<Addr, String> {
    s.parse()
}

impl Addr {
    /// Connects (for the launcher, which may).
    pub fn connect(&self) -> io::Result<OwnedFd> {
        match self {
            Addr::Unix(p) => Ok(UnixStream::connect(p)?.into()),
            Addr::Tcp(hp) => {
                let mut last = io::Error::other(format!("{hp} resolves to no address"));
                for a in hp.to_socket_addrs()? {
                    match TcpStream::connect_timeout(&a, CONNECT_WAIT) {
                        Ok(s) => {
                            let _ = s.set_nodelay(true);
                            return Ok(s.into());
                        }
                        Err(e) => last = e,
                    }
                }
                Err(last)
            }
        }
    }

    /// Binds a listener for an incoming device (`mode` for a unix socket).
    /// TCP binds only here, when an address asks for it.
    pub fn bind(&self, mode: u32) -> Result<OwnedFd, String> {
        match self {
            Addr::Unix(p) => crate::daemon::bind_socket(p, mode)
                .map(OwnedFd::from)
                .map_err(|e| e.to_string()),
            Addr::Tcp(hp) => TcpListener::bind(hp.as_str())
                .map(OwnedFd::from)
                .map_err(|e| format!("{self}: {e}")),
        }
    }
}

/// A migration connection: a socket as a file, whose reads and writes give
/// up after [`STALL`] without progress.
pub struct Conn(File);

impl Conn {
    pub fn new(fd: OwnedFd) -> Conn {
        Conn(File::from(fd))
    }

    fn wait(&self, events: i16) -> io::Result<()> {
        if vzram_blk::guard::wait_fd(self.0.as_raw_fd(), events, Some(STALL))? {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the other end sent nothing for {STALL:?}"),
            ))
        }
    }
}

impl Read for &Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.wait(libc::POLLIN)?;
        (&self.0).read(buf)
    }
}

impl Write for &Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.wait(libc::POLLOUT)?;
        (&self.0).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Sends `dev` over `conn` (see `vzram_store::migrate::send`), keeping its
/// progress in the device's cells. `quiet` says whether the frontend has
/// stopped (or there is none). Once the destination confirms, the pages are
/// dropped here unless `keep`, or unless the frontend started again.
pub fn send(
    dev: &Device,
    conn: &Conn,
    quiet: &dyn Fn() -> bool,
    keep: bool,
) -> Result<SendReport, String> {
    let m = &dev.cells().migration;
    m.begin(MIGRATION_SENDING);
    let r = migrate::send(dev, conn, conn, quiet, &|p: Progress| m.progress(p));
    let rep = match r {
        Ok(rep) => rep,
        Err(e) => {
            m.state.store(MIGRATION_SEND_FAILED, Relaxed);
            return Err(e.to_string());
        }
    };
    m.final_micros.store(rep.final_micros, Relaxed);
    m.total_micros.store(rep.total_micros, Relaxed);
    m.dirty.store(0, Relaxed);
    m.state.store(MIGRATION_SENT, Relaxed);
    if !keep {
        if quiet() {
            migrate::empty(dev, &mut Context::new(0)).map_err(|e| {
                format!("the destination has the pages, but dropping them here failed: {e}")
            })?;
        } else {
            return Err(
                "the destination confirmed, but the frontend started the device again meanwhile: the pages are kept here (the destination's copy is older)"
                    .into(),
            );
        }
    }
    dev.stats();
    Ok(rep)
}

/// Receives into `dev` over `conn`; only a device waiting for its pages
/// takes a stream. On success the device is no longer incoming
/// (`on_commit` runs then, before the source hears of it); on failure it
/// stays incoming, empty, marked failed.
pub fn receive(dev: &Device, conn: &Conn, on_commit: &dyn Fn()) -> Result<ReceiveReport, String> {
    let m = &dev.cells().migration;
    if !matches!(m.state.load(Relaxed), MIGRATION_INCOMING | MIGRATION_FAILED) {
        let why = format!(
            "the device is not waiting for a migration (it is {})",
            m.state_name()
        );
        refuse(conn, &why);
        return Err(why);
    }
    m.begin(MIGRATION_RECEIVING);
    let r = migrate::receive(dev, conn, conn, &|p| m.progress(p), &|| {
        m.state.store(MIGRATION_NONE, Relaxed);
        on_commit();
    });
    dev.stats();
    r.map_err(|e| {
        m.state.store(MIGRATION_FAILED, Relaxed);
        e.to_string()
    })
}

/// Refuses a stream before reading it (best effort).
pub fn refuse(conn: &Conn, why: &str) {
    let m = &why.as_bytes()[..why.len().min(1024)];
    let mut b = vec![b'X'];
    b.extend_from_slice(&(m.len() as u16).to_le_bytes());
    b.extend_from_slice(m);
    let _ = (&*conn).write_all(&b);
}

/// A bound listener for an incoming device.
pub enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    pub fn new(addr: &Addr, fd: OwnedFd) -> Listener {
        match addr {
            Addr::Unix(_) => Listener::Unix(UnixListener::from(fd)),
            Addr::Tcp(_) => Listener::Tcp(TcpListener::from(fd)),
        }
    }

    pub fn fd(&self) -> std::os::fd::RawFd {
        match self {
            Listener::Unix(l) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        }
    }

    pub fn accept(&self) -> io::Result<OwnedFd> {
        Ok(match self {
            Listener::Unix(l) => l.accept()?.0.into(),
            Listener::Tcp(l) => l.accept()?.0.into(),
        })
    }
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
            assert!(e.contains("unix:PATH or tcp:HOST:PORT"), "{bad}: {e}");
        }
        let a: Addr = "unix:/x".parse().unwrap();
        assert_eq!(a.to_string(), "unix:/x");
    }
}
