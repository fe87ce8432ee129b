//! Live migration as the owner of a device runs it: the connection a
//! transfer runs over, and the two halves ([`send`], [`receive`]). Sockets
//! are bound and connected by the launcher (or at start-up, before the
//! sandbox): the supervisor and the workers may not. The stream itself is
//! `vzram_store::migrate`'s.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use vzram_store::cells::{
    MIGRATION_FAILED, MIGRATION_INCOMING, MIGRATION_NONE, MIGRATION_RECEIVING, MIGRATION_SENDING,
    MIGRATION_SEND_FAILED, MIGRATION_SENT,
};
use vzram_store::migrate::{self, Progress, ReceiveReport, SendReport};
use vzram_store::{Context, Device};

use crate::proto::addr::Addr;

/// How long one read or write on a migration connection may stall before
/// the transfer is given up: a peer that stops talking must not hold a
/// device for ever.
pub const STALL: Duration = Duration::from_secs(60);

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

/// Marks a device configured `incoming=` as waiting for its pages, if its
/// state is new or holds nothing; one left waiting by an earlier run (a
/// transfer cut short) waits again. A state that holds pages keeps them
/// and serves: receiving into it would drop them (`--fresh` starts empty).
pub fn set_incoming(name: &str, dev: &Device) {
    let m = &dev.cells().migration;
    let empty = dev.stats().orig_data_size == 0;
    match m.state.load(Relaxed) {
        MIGRATION_RECEIVING => {
            tracing::warn!(device = %name, "a migration stream was cut short by a restart; waiting for another");
            m.state.store(MIGRATION_FAILED, Relaxed);
        }
        _ if m.incoming() => tracing::info!(device = %name, "still waiting for its pages"),
        _ if empty => m.begin(MIGRATION_INCOMING),
        _ => tracing::warn!(
            device = %name,
            "incoming is set, but the device's state holds pages: it serves them (start with --fresh to receive instead)"
        ),
    }
}
