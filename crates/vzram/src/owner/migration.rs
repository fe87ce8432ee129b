//! Live migration as the owner of a device runs it: the connection a
//! transfer runs over (plain on a unix socket, mutual TLS on TCP), and the
//! two halves ([`send`], [`receive`]). Sockets
//! are bound and connected by the launcher (or at start-up, before the
//! sandbox): the supervisor and the workers may not. The stream itself is
//! `vzram_store::migrate`'s.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::{ClientConnection, ConnectionCommon, ServerConnection, SideData};

use vzram_store::cells::{Ask, Phase};
use vzram_store::migrate::{
    self, MigrateError, Progress, ReceiveHooks, Received, Resume, SendHooks, SendReport,
};
use vzram_store::{Context, Device};

use super::commit::{Commitment, Seen, CANCELLED, GONE_GRACE};
use super::tls;
use crate::proto::addr::Addr;
use crate::proto::tls::{ClientTls, Credentials};

/// How long one read or write on a migration connection may stall before
/// the transfer is given up: a peer that stops talking must not hold a
/// device for ever.
pub const STALL: Duration = Duration::from_secs(60);

/// A migration connection: a socket as a file, whose reads and writes give
/// up after [`STALL`] without progress, or at its deadline if it has one.
pub struct Conn {
    file: File,
    deadline: Mutex<Option<Instant>>,
    /// How long a read may find nothing before it fails with `WouldBlock`
    /// (while a verdict is open, each side also watches other things).
    patience: Mutex<Option<Duration>>,
}

impl Conn {
    pub fn new(fd: OwnedFd) -> Conn {
        Conn {
            file: File::from(fd),
            deadline: Mutex::new(None),
            patience: Mutex::new(None),
        }
    }

    /// Reads and writes after `at` fail (None: only stalls do).
    pub fn set_deadline(&self, at: Option<Instant>) {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner()) = at;
    }

    fn wait(&self, events: i16) -> io::Result<()> {
        let deadline = *self.deadline.lock().unwrap_or_else(|e| e.into_inner());
        let patience = *self.patience.lock().unwrap_or_else(|e| e.into_inner());
        let patience = patience.filter(|_| events == libc::POLLIN);
        let left = deadline.map(|t| t.saturating_duration_since(Instant::now()));
        let bound = left.map_or(STALL, |l| l.min(STALL));
        let wait = patience.map_or(bound, |p| p.min(bound));
        if vzram_blk::guard::wait_fd(self.file.as_raw_fd(), events, Some(wait))? {
            Ok(())
        } else if wait < bound {
            // Only the patience ran out.
            Err(io::Error::new(io::ErrorKind::WouldBlock, "nothing yet"))
        } else if left.is_some_and(|l| l <= STALL) {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the stream did not finish within its deadline",
            ))
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
        (&self.file).read(buf)
    }
}

impl Write for &Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.wait(libc::POLLOUT)?;
        (&self.file).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A migration connection as the stream sees it: a socket (a unix one, or
/// the plain end of a [`Tls`] relay). The stream reads and writes from
/// one thread, in turn.
pub struct Link {
    conn: Arc<Conn>,
    io: Mutex<Box<dyn Stream>>,
}

trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

/// The socket as rustls's transport (it wants one it owns).
struct Sock(Arc<Conn>);

impl Read for Sock {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self.0).read(buf)
    }
}

impl Write for Sock {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self.0).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Link {
    /// A unix socket's stream: the socket's mode is its access control.
    pub fn plain(fd: OwnedFd) -> Link {
        let conn = Arc::new(Conn::new(fd));
        Link {
            io: Mutex::new(Box::new(Sock(conn.clone()))),
            conn,
        }
    }

    /// Reads and writes after `at` fail (None: only stalls do).
    pub fn set_deadline(&self, at: Option<Instant>) {
        self.conn.set_deadline(at);
    }

    /// Reads that find nothing for `p` fail with `WouldBlock` (None: they
    /// wait as usual).
    pub fn set_patience(&self, p: Option<Duration>) {
        *self.conn.patience.lock().unwrap_or_else(|e| e.into_inner()) = p;
    }

    fn io(&self) -> std::sync::MutexGuard<'_, Box<dyn Stream>> {
        self.io.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Why a TLS session on a migration connection did not come up.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Credentials(#[from] tls::TlsError),
    #[error("TLS: {0}")]
    Tls(#[source] rustls::Error),
    #[error("TLS handshake with the source failed: {0}")]
    SourceHandshake(#[source] io::Error),
    #[error("TLS handshake with the destination {server_name} failed: {source}")]
    DestinationHandshake {
        server_name: String,
        #[source]
        source: io::Error,
    },
}

/// Why a send ended without the destination serving the pages, or
/// dropping them here failed after it did.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The commit was sent but not confirmed: the destination may serve.
    #[error("{0}: every page is kept here; if the destination serves the device (its stat says received), `vzram reset` this one")]
    Unconfirmed(#[source] MigrateError),
    #[error("{0}; every page is kept here")]
    Stream(#[source] MigrateError),
    #[error("the destination serves the pages, but dropping them here failed: {0}")]
    Drop(#[source] vzram_store::StoreError),
}

/// Why a receive did not take the device's pages.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    #[error("the device is not waiting for a migration (it is {})", .0.name())]
    NotWaiting(Phase),
    #[error(transparent)]
    Stream(#[from] MigrateError),
}

/// How long a TLS handshake may take: a peer that has not shown a valid
/// certificate by then is cut, and holds nothing meanwhile (the
/// handshake runs before any order reaches the device's owner).
pub const HANDSHAKE: Duration = Duration::from_secs(10);

/// An authenticated TLS session on a TCP migration connection, held by
/// the supervisor (the keys never leave it): [`Tls::relay`] carries its
/// plaintext to and from the device's owner over a socket pair.
pub struct Tls {
    conn: Arc<Conn>,
    tls: rustls::Connection,
}

impl Tls {
    /// The destination's end: the source must show a certificate from
    /// the CA within [`HANDSHAKE`].
    pub fn accept(fd: OwnedFd, creds: &Credentials) -> Result<Tls, SessionError> {
        let cfg = tls::server_config(creds)?;
        let conn = Arc::new(Conn::new(fd));
        conn.set_deadline(Some(Instant::now() + HANDSHAKE));
        let mut tls = ServerConnection::new(cfg).map_err(SessionError::Tls)?;
        handshake(&mut tls, &mut Sock(conn.clone())).map_err(SessionError::SourceHandshake)?;
        conn.set_deadline(None);
        Ok(Tls {
            conn,
            tls: tls.into(),
        })
    }

    /// The source's end: the destination must show a certificate from the
    /// CA for the name it was reached by, within [`HANDSHAKE`].
    pub fn connect(fd: OwnedFd, t: &ClientTls) -> Result<Tls, SessionError> {
        let cfg = tls::client_config(&t.creds)?;
        let name = tls::server_name(&t.server_name)?;
        let conn = Arc::new(Conn::new(fd));
        conn.set_deadline(Some(Instant::now() + HANDSHAKE));
        let mut tls = ClientConnection::new(cfg, name).map_err(SessionError::Tls)?;
        handshake(&mut tls, &mut Sock(conn.clone())).map_err(|source| {
            SessionError::DestinationHandshake {
                server_name: t.server_name.clone(),
                source,
            }
        })?;
        conn.set_deadline(None);
        Ok(Tls {
            conn,
            tls: tls.into(),
        })
    }

    /// Carries plaintext between the session and `plain` (the owner's end
    /// is the other half of its socket pair) until either side ends; the
    /// owner's own deadlines and stall limits bound the stream.
    pub fn relay(mut self, plain: UnixStream) {
        if let Err(e) = self.pump(&plain) {
            tracing::debug!("migration TLS relay ended: {e}");
        }
        let _ = plain.shutdown(std::net::Shutdown::Both);
        // SAFETY: shutdown on the TCP socket this session owns.
        unsafe { libc::shutdown(self.conn.file.as_raw_fd(), libc::SHUT_RDWR) };
    }

    fn flush(&mut self) -> io::Result<()> {
        while self.tls.wants_write() {
            self.tls.write_tls(&mut &*self.conn)?;
        }
        Ok(())
    }

    /// Hands `plain` what plaintext the session holds; whether the peer
    /// has closed.
    fn drain(&mut self, plain: &UnixStream, buf: &mut [u8]) -> io::Result<bool> {
        loop {
            match self.tls.reader().read(buf) {
                Ok(0) => return Ok(true),
                Ok(n) => (&*plain).write_all(&buf[..n])?,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
    }

    fn pump(&mut self, plain: &UnixStream) -> io::Result<()> {
        let mut buf = vec![0u8; 64 << 10];
        let tcp = self.conn.file.as_raw_fd();
        loop {
            self.flush()?;
            // Plaintext rustls already holds: the handshake's last read
            // may have brought the peer's first records with it.
            if self.drain(plain, &mut buf)? {
                return Ok(());
            }
            let mut fds = [
                libc::pollfd {
                    fd: tcp,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: plain.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two pollfds of ours, valid for the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, STALL.as_millis() as i32) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("nothing either way for {STALL:?}"),
                ));
            }
            if fds[0].revents != 0 {
                if self.tls.read_tls(&mut &self.conn.file)? == 0 {
                    return Ok(());
                }
                self.tls
                    .process_new_packets()
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            }
            if fds[1].revents != 0 {
                let n = (&*plain).read(&mut buf)?;
                if n == 0 {
                    self.tls.send_close_notify();
                    return self.flush();
                }
                self.tls.writer().write_all(&buf[..n])?;
            }
        }
    }
}

fn handshake<S: SideData>(tls: &mut ConnectionCommon<S>, sock: &mut Sock) -> io::Result<()> {
    while tls.is_handshaking() {
        tls.complete_io(sock)?;
    }
    // The last flight (a client's Finished) must leave before the stream.
    while tls.wants_write() {
        tls.write_tls(sock)?;
    }
    Ok(())
}

impl Read for &Link {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.io().read(buf)
    }
}

impl Write for &Link {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.io().write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.io().flush()
    }
}

/// What the owner knows of the device's frontend.
pub struct Frontend<'a> {
    /// Nothing can write: no frontend, or no ring running.
    pub quiet: &'a dyn Fn() -> bool,
    /// How many times rings were started: a change after the last delta
    /// means the VM runs here (on the source: again; on the destination:
    /// it moved).
    pub starts: &'a dyn Fn() -> u64,
    /// The frontend has gone (or there never was one).
    pub gone: &'a dyn Fn() -> bool,
}

impl Frontend<'_> {
    /// A device with no frontend: quiet from the start, nothing to wait for.
    pub const NONE: Frontend<'static> = Frontend {
        quiet: &|| true,
        starts: &|| 0,
        gone: &|| true,
    };
}

/// Sends `dev` over `conn` (see `vzram_store::migrate::send`), keeping its
/// progress in the device's cells. The move commits only on evidence that
/// the VM runs on the destination: it says its frontend started the rings,
/// or an operator said `vzram migrate --commit` after the last delta (see
/// [`Commitment`]); it aborts if the rings here start again first, on
/// `--cancel`, or once the frontend here has left and the destination's
/// did not start within [`GONE_GRACE`]. Only a committed move drops the
/// pages here, and not with `keep`.
pub fn send(
    dev: &Device,
    conn: &Link,
    fe: &Frontend<'_>,
    keep: bool,
) -> Result<SendReport, SendError> {
    let cells = dev.cells();
    let m = &cells.migration;
    cells.set_ask(Ask::None);
    let cold = (fe.gone)();
    let cancelled = || (cells.ask() == Ask::Cancel).then(|| CANCELLED.to_string());
    m.begin(Phase::Sending);
    // The ring starts counted when the device went quiet for the last delta.
    let at_quiet = AtomicU64::new(u64::MAX);
    let quiet = || {
        let starts = (fe.starts)();
        let q = (fe.quiet)();
        if q {
            at_quiet.store(starts, Relaxed);
        }
        q
    };
    let state: Mutex<Option<Commitment>> = Mutex::new(None);
    let verdict = |started_there: bool| {
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        let c = st.get_or_insert_with(|| {
            // An ask to commit from before the last delta is forgotten
            // before the phase says an ask may come (the supervisor
            // refuses one until then).
            cells.forget_commit();
            m.set(Phase::Committing);
            Commitment::new(at_quiet.load(Relaxed), cold, GONE_GRACE)
        });
        let seen = Seen {
            starts: (fe.starts)(),
            quiet: (fe.quiet)(),
            gone: (fe.gone)(),
            ask: cells.ask(),
            started_there,
        };
        c.decide(&seen, Instant::now())
    };
    let hooks = SendHooks {
        quiet: &quiet,
        verdict: &verdict,
        cancelled: &cancelled,
        progress: &|p: Progress| m.progress(p),
        patience: &|p| conn.set_patience(p),
    };
    let r = migrate::send(dev, conn, conn, &hooks);
    let rep = match r {
        Ok(rep) => rep,
        Err(e) => {
            m.set(Phase::SendFailed);
            return Err(match e {
                MigrateError::Unconfirmed(_) => SendError::Unconfirmed(e),
                e => SendError::Stream(e),
            });
        }
    };
    m.final_micros.store(rep.final_micros, Relaxed);
    m.total_micros.store(rep.total_micros, Relaxed);
    m.dirty.store(0, Relaxed);
    if keep {
        m.set(Phase::Copied);
    } else {
        m.set(Phase::Sent);
        migrate::empty(dev, &mut Context::new(0)).map_err(SendError::Drop)?;
    }
    dev.stats();
    Ok(rep)
}

/// Receives into `dev` over `conn`; only a device waiting for its pages
/// takes a stream, and the stream must be whole by `deadline` (the wait
/// for the source's commit after it is not bounded: the source says every
/// few seconds that it is still there). Once every page is here, the
/// source is told as soon as `fe` shows the VM runs here (a ring running,
/// or started since the stream began). On commit the device is received
/// for good (stored in its cells, then `on_commit` runs, before the source
/// hears of it); on failure or abort it is empty and still waits, marked
/// failed.
///
/// With `from`, a receive another owner began is taken up (the device is
/// receiving or prepared). `hand_on` (the supervisor's: a frontend waits)
/// makes it stop at a record boundary and return where it stands, the
/// device left as it is, for the worker of that frontend to take up.
pub fn receive(
    dev: &Device,
    conn: &Link,
    deadline: Instant,
    fe: &Frontend<'_>,
    hand_on: Option<&dyn Fn() -> bool>,
    from: Option<Resume>,
    on_commit: &dyn Fn(),
) -> Result<Received, ReceiveError> {
    let m = &dev.cells().migration;
    let taken = match from {
        None => m.shift(&[Phase::Incoming, Phase::Failed], Phase::Receiving),
        // Cut meanwhile (a reset, a failure) it is no longer ours to take.
        Some(_) => matches!(m.phase(), Phase::Receiving | Phase::Prepared),
    };
    if !taken {
        let e = ReceiveError::NotWaiting(m.phase());
        refuse(conn, &e.to_string());
        return Err(e);
    }
    if from.is_none() {
        m.begin(Phase::Receiving);
    }
    // A receive taken up is older than this owner: every ring start it
    // counts came after the stream began.
    let starts0 = if from.is_some() { 0 } else { (fe.starts)() };
    conn.set_deadline(Some(deadline));
    let hooks = ReceiveHooks {
        progress: &|p| m.progress(p),
        prepared: &|| {
            conn.set_deadline(None);
            m.set(Phase::Prepared);
        },
        started: &|| (fe.starts)() != starts0 || !(fe.quiet)(),
        commit: &|| {
            m.set(Phase::Received);
            on_commit();
        },
        patience: &|p| conn.set_patience(p),
    };
    let r = migrate::receive_from(dev, conn, conn, &hooks, hand_on, from);
    dev.stats();
    r.map_err(|e| {
        m.set(Phase::Failed);
        e.into()
    })
}

/// Refuses a stream before reading it (best effort).
pub fn refuse(conn: &Link, why: &str) {
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

/// A send that a restart cut short committed nothing: the device keeps
/// every page and may be sent again.
pub fn settle_send(name: &str, dev: &Device) {
    let m = &dev.cells().migration;
    if m.shift(&[Phase::Sending, Phase::Committing], Phase::SendFailed) {
        tracing::warn!(device = %name, "a migration send was cut short by a restart before its commit: every page is kept here");
    }
}

/// Marks a device configured `incoming=` as waiting for its pages, if its
/// state is new or holds nothing. One whose stream was cut short (by a
/// failure or a killed process) is emptied and waits again: it was never
/// committed, so the source still has every page. One that has received
/// its stream serves: `incoming=` applies only to a device that never did.
/// A state that holds pages keeps them and serves: receiving into it would
/// drop them (`--fresh` starts empty).
pub fn set_incoming(name: &str, dev: &Device) {
    let m = &dev.cells().migration;
    let empty = dev.stats().orig_data_size == 0;
    match m.phase() {
        Phase::Receiving | Phase::Prepared | Phase::Failed => {
            let pages = dev.stats().orig_data_size / vzram_store::PAGE_SIZE as u64;
            match migrate::empty(dev, &mut Context::new(0)) {
                Ok(()) => {
                    tracing::warn!(device = %name, pages, "a migration stream was cut short before its commit: emptied; waiting for another")
                }
                Err(e) => {
                    tracing::error!(device = %name, "a migration stream was cut short, and emptying the device failed: {e}; it keeps waiting")
                }
            }
            m.set(Phase::Failed);
            dev.stats();
        }
        Phase::Incoming => tracing::info!(device = %name, "still waiting for its pages"),
        Phase::Received => tracing::info!(
            device = %name,
            "it received its migration stream already: it serves (incoming= applies only until a stream is committed)"
        ),
        Phase::None
        | Phase::Sending
        | Phase::Sent
        | Phase::SendFailed
        | Phase::Copied
        | Phase::Committing
            if empty =>
        {
            m.begin(Phase::Incoming)
        }
        Phase::None
        | Phase::Sending
        | Phase::Sent
        | Phase::SendFailed
        | Phase::Copied
        | Phase::Committing => tracing::warn!(
            device = %name,
            "incoming is set, but the device's state holds pages: it serves them (start with `--fresh {name}` to receive instead)"
        ),
    }
}
