//! `vzram migrate` (send a device to another vzram) and the incoming
//! side (accept a stream for a device that waits for its pages).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vzram_store::cells::{Ask, Phase};

use super::error::{Error, Result};
use super::orders::{failed, HOLD_WAIT};
use super::served::Served;
use super::Supervisor;
use crate::owner::migration::{refuse, Link, Listener, Tls};
use crate::proto::addr::Addr;
use crate::proto::control::MIGRATE_WAIT;
use crate::proto::launch::{ConnectReply, Request, CONNECT_WAIT};
use crate::proto::order::{self, Arrival};
use crate::proto::tls::ClientTls;
use crate::proto::wire::{self, seqpacket_pair};
use crate::sys::socket::readable;

/// How long past its connect deadline a helper's answer is waited for.
const REPLY_GRACE: Duration = Duration::from_secs(3);
/// TLS handshakes an incoming device runs at once.
const MAX_PENDING: usize = 8;

/// Starts relaying `session` over a new socket pair; the other end, for
/// the device's owner.
fn relayed(session: Tls) -> io::Result<OwnedFd> {
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    std::thread::Builder::new()
        .name("tls-relay".into())
        .spawn(move || session.relay(ours))?;
    Ok(theirs.into())
}

impl Supervisor {
    /// Sends device `d` to the vzram at `to` (see `vzram migrate`): its
    /// worker does while a frontend is connected, else this process. A
    /// worker that went away before it began is replaced by another
    /// attempt; one that dies mid-send is not: the send failed, every page
    /// stays here, and the destination drops what it took when the stream
    /// is cut. `client_gone` says the requester hung up: the send is
    /// cancelled then (nobody would hear its verdict).
    pub fn migrate(
        &self,
        d: &Served,
        to: &Addr,
        keep: bool,
        client_gone: &(dyn Fn() -> bool + Sync),
    ) -> Result<order::Sent> {
        // One at a time: a second sender would find nothing, or race the
        // first to the commit.
        let Some(_sending) = d.migration.begin_send() else {
            return Err(Error::MigrationRunning(d.spec.name.clone()));
        };
        let tls = match to.host() {
            None => None,
            Some(host) => {
                let creds = self.env.tls.as_ref().and_then(|t| t.client.clone());
                Some(ClientTls {
                    creds: creds.ok_or(Error::NoTls {
                        what: "a migration to tcp:",
                        need: "client-cert.pem and client-key.pem",
                    })?,
                    server_name: host.to_string(),
                })
            }
        };
        let m = &d.cells.migration;
        if m.phase() == Phase::Sent {
            return Err(Error::AlreadySent(d.spec.name.clone()));
        }
        let finished = AtomicBool::new(false);
        std::thread::scope(|sc| {
            // The requester's hang-up cancels the send, whatever its phase
            // (once it has begun: the sender clears any ask as it begins).
            sc.spawn(|| {
                while !finished.load(Relaxed) {
                    if client_gone() && m.sending() {
                        tracing::warn!(device = %d.spec.name, "the `vzram migrate` client hung up: the send is cancelled");
                        d.cells.set_ask(Ask::Cancel);
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            });
            let r = self.send_attempts(d, to, keep, tls);
            finished.store(true, Relaxed);
            r
        })
    }

    fn send_attempts(
        &self,
        d: &Served,
        to: &Addr,
        keep: bool,
        tls: Option<ClientTls>,
    ) -> Result<order::Sent> {
        let m = &d.cells.migration;
        const ATTEMPTS: usize = 3;
        let mut last = String::new();
        for attempt in 1..=ATTEMPTS {
            let fd = self.connect(to, CONNECT_WAIT)?;
            // On TCP this process authenticates the destination and relays
            // the plaintext: the owner gets a socket, never a key.
            let fd = match &tls {
                None => fd,
                Some(t) => {
                    let session = Tls::connect(fd, t).map_err(|e| {
                        let e = e.to_string();
                        d.migration.set_error(Some(e.clone()));
                        failed(d, e)
                    })?;
                    relayed(session)?
                }
            };
            tracing::info!(device = %d.spec.name, to = %to, attempt, keep, "migrating");
            let order = order::Send { keep };
            // Until its outcome is recorded below (each arm returns or
            // tries again once it is).
            let _settling = d.migration.settle();
            match self.on_owner(d, &order, Some(fd), HOLD_WAIT) {
                Ok((Err(error), _)) => {
                    d.migration.set_error(Some(error.to_string()));
                    return Err(failed(d, error));
                }
                Ok((Ok(sent), _)) => {
                    d.migration.set_error(None);
                    return Ok(sent);
                }
                // The channel broke: the worker is gone.
                Err(e) => match m.phase() {
                    Phase::Sent | Phase::Copied => {
                        return Err(failed(d, format!("{e}, after the commit")));
                    }
                    // It had begun: as a cancel, every page stays here and
                    // the destination, its stream cut, drops its copy
                    // (unless it had taken the commit: it says received).
                    Phase::Sending | Phase::Committing => {
                        m.shift(&[Phase::Sending, Phase::Committing], Phase::SendFailed);
                        let why = format!(
                            "the device's worker ended mid-send ({e}): every page is kept here and it serves; the destination drops what it took (if its stat says received, it had taken the commit: `vzram reset` this one instead)"
                        );
                        tracing::error!(device = %d.spec.name, "{why}");
                        d.migration.set_error(Some(why.clone()));
                        return Err(failed(d, why));
                    }
                    // It never began: nothing was sent, try again.
                    _ => {
                        tracing::warn!(device = %d.spec.name, "migration attempt {attempt}: {e}");
                        last = e.to_string();
                    }
                },
            }
        }
        // The reason first: `stat` never shows the failure without it.
        d.migration.set_error(Some(last.clone()));
        m.set(Phase::SendFailed);
        Err(failed(d, last))
    }

    /// `vzram migrate --commit`: the VM has moved, for a VMM that keeps its
    /// source process after its migration. Waits a little for the sender
    /// to act on it; returns the state then.
    /// Taken only after the last delta (the phase is committing): one
    /// given earlier would commit whatever pause came next.
    pub fn commit_migration(&self, d: &Served) -> Result<&'static str> {
        let m = &d.cells.migration;
        match m.phase() {
            Phase::Committing => {}
            Phase::Sending => return Err(Error::CommitTooEarly(d.spec.name.clone())),
            Phase::None
            | Phase::Incoming
            | Phase::Receiving
            | Phase::Failed
            | Phase::Sent
            | Phase::SendFailed
            | Phase::Received
            | Phase::Prepared
            | Phase::Copied => return Err(Error::NotCommitting(d.spec.name.clone())),
        }
        self.ask_sender(d, Ask::Commit);
        Ok(m.state_name())
    }

    /// `vzram migrate --cancel`: the VMM's own migration was called off
    /// (the guest runs here): the sender aborts, at once in pre-copy, and
    /// the destination drops its copy. Waits a little for the sender to
    /// act on it; returns the state then.
    pub fn cancel_migration(&self, d: &Served) -> Result<&'static str> {
        if !d.cells.migration.sending() {
            return Err(Error::NotSending(d.spec.name.clone()));
        }
        self.ask_sender(d, Ask::Cancel);
        Ok(d.cells.migration.state_name())
    }

    /// Asks the sender and waits (a while) until it has acted and the send's
    /// outcome is recorded here: `stat` right after says how it ended, and why.
    fn ask_sender(&self, d: &Served, ask: Ask) {
        d.cells.set_ask(ask);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let m = &d.cells.migration;
        let acting = || m.sending() || (m.phase() == Phase::SendFailed && d.migration.settling());
        while acting() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Cuts the stream arriving for `d`, if any, and waits for its receiver
    /// to give up (it empties the device): for `reset` and `remove`.
    pub fn cut_arriving(&self, d: &Served) -> Result<()> {
        if !d.migration.cut() {
            return Ok(());
        }
        tracing::warn!(device = %d.spec.name, "the arriving migration stream is cut");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while d.migration.arriving() {
            if std::time::Instant::now() > deadline {
                return Err(Error::Receiving(d.spec.name.clone()));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// A connection to `to` within `wait`, made by a helper the launcher
    /// starts, which answers on a socket pair of ours: this (control)
    /// thread waits for it, the launcher and the loop do not.
    fn connect(&self, to: &Addr, wait: Duration) -> Result<OwnedFd> {
        let fail = |error: String| Error::Connect {
            to: to.clone(),
            error,
        };
        let (ours, theirs) = seqpacket_pair()?;
        let id = self.launcher.next_id();
        let req = Request::Connect {
            id,
            addr: to.clone(),
            wait_ms: wait.as_millis() as u64,
        };
        self.launcher
            .send(&req, &[theirs.as_raw_fd()])
            .map_err(Error::Launcher)?;
        drop(theirs);
        // The helper is killed a little after `wait`, which closes its end;
        // this is a last bound should even that not happen.
        let limit = wait + REPLY_GRACE;
        if !vzram_blk::guard::wait_fd(ours.as_raw_fd(), libc::POLLIN, Some(limit))? {
            return Err(fail(format!("no answer within {} ms", limit.as_millis())));
        }
        match wire::recv::<ConnectReply>(&ours)? {
            Some((ConnectReply::Connected { id: got }, mut fds)) if got == id => {
                fds.pop().ok_or(Error::LauncherNoConnection)
            }
            Some((ConnectReply::Failed { id: got, error }, _)) if got == id => {
                Err(fail(error.to_string()))
            }
            Some((r, _)) => Err(Error::LauncherAnswer(format!("{r:?}"))),
            None => Err(fail("the connecting helper ended without an answer".into())),
        }
    }

    /// Accepts migration streams for incoming device `d` on its own thread
    /// until one has brought its pages.
    pub fn start_incoming(self: &Arc<Self>, d: Arc<Served>) -> io::Result<()> {
        let Some(l) = d.migration.take_listener() else {
            return Ok(());
        };
        let sup = self.clone();
        std::thread::Builder::new()
            .name(format!("incoming-{}", d.spec.name))
            .spawn(move || sup.incoming_loop(&d, l))
            .map(drop)
    }

    fn incoming_loop(self: &Arc<Self>, d: &Arc<Served>, l: Listener) {
        let pending = Arc::new(AtomicUsize::new(0));
        loop {
            if self.stopping.load(Relaxed) || d.worker.closed() {
                return;
            }
            match vzram_blk::guard::wait_fd(l.fd(), libc::POLLIN, Some(Duration::from_millis(500)))
            {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    tracing::error!(device = %d.spec.name, "migration listener: {e}");
                    return;
                }
            }
            let fd = match l.accept() {
                Ok(fd) => fd,
                Err(e) => {
                    tracing::warn!(device = %d.spec.name, "migration listener accept: {e}");
                    continue;
                }
            };
            if !d.cells.migration.incoming() {
                // On TCP the peer hears nothing before a handshake; this
                // thread does not hold one up for it.
                if let Listener::Unix(_) = l {
                    refuse(
                        &Link::plain(fd),
                        &format!("device {} is not waiting for a migration", d.spec.name),
                    );
                }
                return;
            }
            if let Listener::Unix(_) = l {
                self.take_stream(d, fd);
                if !d.cells.migration.incoming() {
                    return;
                }
                continue;
            }
            let Some(creds) = self.env.tls.as_ref().and_then(|t| t.server.clone()) else {
                tracing::error!(device = %d.spec.name, "a TCP migration stream without server credentials: refused");
                continue;
            };
            // Each handshake on a thread of its own, a few at a time: a
            // peer that stalls holds one slot for HANDSHAKE at most, and
            // the source behind it is not kept waiting.
            if pending.fetch_add(1, Relaxed) >= MAX_PENDING {
                pending.fetch_sub(1, Relaxed);
                tracing::warn!(device = %d.spec.name, "{MAX_PENDING} TLS handshakes pending: a migration connection is refused");
                continue;
            }
            let (sup, dev, pending) = (self.clone(), d.clone(), pending.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("tls-{}", d.spec.name))
                .spawn(move || {
                    let session = Tls::accept(fd, &creds);
                    pending.fetch_sub(1, Relaxed);
                    match session {
                        Err(e) => {
                            tracing::warn!(device = %dev.spec.name, "{e}: refused before it reached the device");
                        }
                        Ok(session) => match relayed(session) {
                            Ok(plain) => sup.take_stream(&dev, plain),
                            Err(e) => tracing::warn!(device = %dev.spec.name, "migration relay: {e}"),
                        },
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!(device = %d.spec.name, "migration handshake thread: {e}");
            }
        }
    }

    /// Has the owner of `d` receive the stream on `fd` (a unix socket, or
    /// the plain end of a TLS relay), and logs how it went. While no VM
    /// uses the device this process receives, holding it; a frontend that
    /// connects meanwhile (libvirt starts the destination QEMU once the
    /// stream runs) must not wait for the whole stream: the receive stops
    /// at a record boundary, and the worker started for that frontend
    /// takes it up where it stopped.
    fn take_stream(&self, d: &Served, fd: OwnedFd) {
        tracing::info!(device = %d.spec.name, "a migration stream connected");
        let copy = match fd.try_clone() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(device = %d.spec.name, "migration stream: {e}");
                return;
            }
        };
        d.migration.set_arriving(Some(copy));
        let deadline = Instant::now() + self.env.incoming_timeout;
        let mut resume = None;
        let r = loop {
            // Each owner gets its own descriptor; ours keeps the stream
            // open between two.
            let conn = match fd.try_clone() {
                Ok(c) => c,
                Err(e) => break Err(Error::from(e)),
            };
            let order = order::Receive {
                within: deadline.saturating_duration_since(Instant::now()),
                resume,
            };
            match self.on_owner(d, &order, Some(conn), MIGRATE_WAIT) {
                Ok((Ok(Arrival::HandedOn(h)), _)) => {
                    tracing::info!(device = %d.spec.name, "a frontend connected while the migration stream arrived: its worker takes the stream on");
                    resume = Some(h.resume);
                    self.await_frontend(d);
                }
                Ok((Ok(Arrival::Received(r)), by_worker)) => break Ok((Ok(r), by_worker)),
                Ok((Err(error), by_worker)) => break Ok((Err(error), by_worker)),
                Err(e) => break Err(e),
            }
        };
        drop(fd);
        // The outcome is recorded before the stream counts as ended: until
        // then `stat` shows a failure the owner marked as still receiving,
        // never failed without its reason.
        match r {
            Ok((
                Ok(order::Received {
                    pages,
                    bytes,
                    micros,
                    ..
                }),
                by_worker,
            )) => {
                d.migration.set_error(None);
                tracing::info!(
                    device = %d.spec.name,
                    pages,
                    bytes,
                    ms = micros / 1000,
                    by_worker,
                    "migration received: the device serves"
                );
            }
            Ok((Err(error), _)) => self.incoming_failed(d, error.0),
            Err(e) => self.incoming_failed(d, e.to_string()),
        }
        d.migration.set_arriving(None);
    }

    /// After a receive stopped for a waiting frontend: until the loop has
    /// taken that frontend (its worker is starting), so that this process
    /// does not take the device straight back. A client that went away
    /// unheard ends the wait (the receive goes on here).
    fn await_frontend(&self, d: &Served) {
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline && d.worker.idle() && readable(d.listener.as_raw_fd()) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A stream for incoming device `d` failed: it keeps waiting.
    fn incoming_failed(&self, d: &Served, error: String) {
        tracing::error!(device = %d.spec.name, "migration stream failed: {error}; requests keep waiting for another (or vzram reset)");
        let m = &d.cells.migration;
        m.shift(
            &[Phase::Incoming, Phase::Receiving, Phase::Prepared],
            Phase::Failed,
        );
        d.migration.set_error(Some(error));
    }
}
