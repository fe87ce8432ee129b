//! The supervisor's loop: accepts frontends, holds each connection until
//! it has something to say, has the launcher start a worker for it, and
//! hears how workers end.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::clients::FULL_PAUSE;
use super::launch::{Health, Received};
use super::served::Served;
use super::worker_slot::{Phase, Restart};
use super::{Supervisor, STOP_WAIT};
use crate::proto::launch::{Report, Request};
use crate::proto::wire;
use crate::proto::worker_spec::{self as spec, Spec, EXIT_DONE};
use crate::sys::epoll::{EventSet, Poller, Token};
use crate::sys::signals::signal_name;
use crate::sys::socket::{hung_up, readable};

/// How long a client may take to send its first message.
pub const FIRST_MESSAGE_WAIT: Duration = Duration::from_secs(10);
/// How long a client that has begun its first message may take to send
/// the rest of its header (a frontend sends it in one write).
const HEADER_WAIT: Duration = Duration::from_millis(500);
/// How often a partial header is looked at again (it is not polled: a
/// level-triggered epoll would report the bytes already there forever).
const HEADER_RECHECK: Duration = Duration::from_millis(10);
/// How long a client that connects while the device's frontend still
/// looks connected waits before it is refused as a second frontend. A
/// frontend that closes and reconnects at once can beat its own hang-up
/// here (the close lands after the connect, for example while another
/// process forked from it still holds the socket until its exec).
const SECOND_FRONTEND_GRACE: Duration = Duration::from_secs(1);

/// What the loop watches: each device's listener, by index, and whether
/// it is armed (false while a reconnecting frontend waits for its worker
/// to go).
#[derive(Default)]
struct Watch {
    listening: std::collections::HashMap<usize, bool>,
    /// Listeners not watched until then: accept failed (out of
    /// descriptors), and a level-triggered epoll would report the waiting
    /// client again at once, for ever.
    paused: std::collections::HashMap<usize, Instant>,
    /// Whether this run of failed accepts was logged.
    accept_failing: bool,
}

impl Watch {
    /// Stops watching device `i`'s listener (a new client waits in the
    /// backlog) until something arms it again.
    fn disarm(&mut self, ep: &Poller, i: usize, d: &Served) -> io::Result<()> {
        ep.modify(
            d.listener.as_raw_fd(),
            Token::Listener(i),
            EventSet::empty(),
        )?;
        self.listening.insert(i, false);
        Ok(())
    }

    fn next_resume(&self) -> Option<Instant> {
        self.paused.values().min().copied()
    }
}

impl Supervisor {
    /// The epoll loop; returns when stopping.
    pub fn run(self: Arc<Self>) {
        if let Err(e) = self.run_loop() {
            if self.stopping.load(Relaxed) {
                return;
            }
            // A daemon that serves nothing must not look alive: exit, so
            // that the service manager starts it again (every state is
            // recovered, and VMMs reconnect).
            tracing::error!("supervisor loop failed: {e}; exiting (code 1) so that the service manager restarts the daemon");
            self.loop_failed.store(true, Relaxed);
            // SAFETY: getpid has no preconditions; tgkill sends SIGTERM to
            // this process's main thread (its tid is the pid), which waits
            // for it in sigwait and then sees `loop_failed`.
            unsafe {
                let pid = libc::getpid();
                libc::syscall(libc::SYS_tgkill, pid, pid, libc::SIGTERM);
            }
        }
    }

    /// The watchdog keep-alive, from the loop: `WATCHDOG=1` only while the
    /// launcher answered the last ping in time, then the next ping. A
    /// wedged loop sends nothing at all, so systemd restarts the daemon.
    fn watchdog_tick(&self, every: Duration) {
        let n = self
            .notifier
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(n) = n else { return };
        match self.launcher.watchdog(every) {
            Health::Answering => {
                if let Err(e) = n.send("WATCHDOG=1") {
                    tracing::debug!("cannot send WATCHDOG=1: {e}");
                }
            }
            Health::Silent { first: true } => tracing::error!(
                "the launcher has not answered for {:?}: no WATCHDOG=1 until it does",
                2 * every
            ),
            Health::Silent { first: false } => {}
        }
    }

    /// How often the service manager wants `WATCHDOG=1`, if at all.
    fn watchdog_every(&self) -> Option<Duration> {
        self.notifier
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|n| n.watchdog_every())
    }

    fn run_loop(&self) -> io::Result<()> {
        let mut ep = Poller::new()?;
        ep.add(self.launcher.fd(), Token::Launcher, EventSet::IN)?;
        ep.add(self.wake.as_raw_fd(), Token::Wake, EventSet::IN)?;
        let mut watch = Watch::default();
        self.sync_devices(&ep, &mut watch)?;
        let mut stop_seen: Option<Instant> = None;
        let mut next_dog = Instant::now();
        // A loop that hangs, for the watchdog's test (debug builds only):
        // so long after its first keep-alive, however slow the start.
        #[cfg(debug_assertions)]
        let hang_after = std::env::var("VZRAM_TEST_HANG_LOOP_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis);
        #[cfg(debug_assertions)]
        let mut hang_at: Option<Instant> = None;
        loop {
            #[cfg(debug_assertions)]
            if hang_at.is_some_and(|t| Instant::now() >= t) {
                tracing::warn!("VZRAM_TEST_HANG_LOOP_MS: the loop hangs now");
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
            let mut timeout = if self.stopping.load(Relaxed) {
                50
            } else {
                self.next_deadline()
            };
            if let Some(t) = watch.next_resume() {
                let ms = t.saturating_duration_since(Instant::now()).as_millis() as i32 + 1;
                timeout = if timeout < 0 { ms } else { timeout.min(ms) };
            }
            let dog = self.watchdog_every();
            if dog.is_some() {
                let ms = next_dog
                    .saturating_duration_since(Instant::now())
                    .as_millis() as i32
                    + 1;
                timeout = if timeout < 0 { ms } else { timeout.min(ms) };
            }
            for token in ep.wait(timeout)? {
                match token {
                    Token::Launcher => self.on_report(&ep, &mut watch)?,
                    Token::Wake => {
                        // Non-blocking: nothing to read means a wake-up
                        // already taken.
                        let _ = self.wake.read();
                        self.sync_devices(&ep, &mut watch)?;
                    }
                    Token::Listener(i) => {
                        // A supervisor thread that panics, for the test that
                        // the daemon then exits (debug builds only).
                        #[cfg(debug_assertions)]
                        if std::env::var_os("VZRAM_TEST_PANIC_ON_FRONTEND").is_some() {
                            panic!("VZRAM_TEST_PANIC_ON_FRONTEND: a frontend connected");
                        }
                        let Some(d) = self.device(i) else { continue };
                        self.on_listener(&ep, i, &d, &mut watch)?;
                    }
                    Token::Pending(i) => {
                        let Some(d) = self.device(i) else { continue };
                        self.on_pending(&ep, &d)?;
                    }
                }
            }
            self.on_timers(&ep, &mut watch)?;
            if let Some(every) = dog {
                if Instant::now() >= next_dog {
                    self.watchdog_tick(every);
                    next_dog = Instant::now() + every;
                    #[cfg(debug_assertions)]
                    if hang_at.is_none() {
                        hang_at = hang_after.map(|d| Instant::now() + d);
                    }
                }
            }
            if self.stopping.load(Relaxed) {
                // Stay to hear the workers' exits (stop() waits on them),
                // but not for ever.
                let since = *stop_seen.get_or_insert_with(Instant::now);
                let running = self.devices().iter().any(|(_, d)| d.worker.running());
                if !running || since.elapsed() > STOP_WAIT {
                    return Ok(());
                }
            }
        }
    }

    /// Watches devices added since the last call, lets go of those being
    /// removed, and listens again on those a hold has let go of.
    fn sync_devices(&self, ep: &Poller, watch: &mut Watch) -> io::Result<()> {
        for (i, d) in self.devices() {
            let removing = d.worker.closed();
            match watch.listening.get(&i).copied() {
                None if !removing => {
                    ep.add(d.listener.as_raw_fd(), Token::Listener(i), EventSet::IN)?;
                    watch.listening.insert(i, true);
                }
                Some(_) if removing => {
                    let _ = ep.delete(d.listener.as_raw_fd());
                    watch.listening.remove(&i);
                    watch.paused.remove(&i);
                    let mut ph = d.worker.phase();
                    match &*ph {
                        Phase::Pending { conn, .. } => {
                            let _ = ep.delete(conn.as_raw_fd());
                            *ph = Phase::Idle;
                        }
                        Phase::Running { .. } => {
                            // Closing its control channel ends the worker.
                            d.worker.end_channel();
                        }
                        _ => {}
                    }
                }
                // Disarmed while the supervisor held the device (a frontend
                // came meanwhile and waits in the backlog): the hold is over.
                Some(false) if d.worker.idle() && !watch.paused.contains_key(&i) => {
                    ep.modify(d.listener.as_raw_fd(), Token::Listener(i), EventSet::IN)?;
                    watch.listening.insert(i, true);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Milliseconds until the nearest first-message deadline or backoff end.
    fn next_deadline(&self) -> i32 {
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        let mut at = |t: Instant| next = Some(next.map_or(t, |n: Instant| n.min(t)));
        for (_, d) in self.devices() {
            match &*d.worker.phase() {
                Phase::Pending {
                    partial: Some(_), ..
                } => at(now + HEADER_RECHECK),
                Phase::Pending { since, .. } => {
                    let mut t = *since + FIRST_MESSAGE_WAIT;
                    if let Some(until) = d.worker.backoff_until() {
                        t = t.min(until.max(now));
                    }
                    at(t);
                }
                Phase::Busy => at(now + Duration::from_millis(50)),
                Phase::Running {
                    contender: Some(t), ..
                } => at((*t + SECOND_FRONTEND_GRACE).max(now)),
                _ => {}
            }
        }
        match next {
            None => -1,
            Some(t) => t.saturating_duration_since(now).as_millis().min(60_000) as i32 + 1,
        }
    }

    fn on_listener(&self, ep: &Poller, i: usize, d: &Served, watch: &mut Watch) -> io::Result<()> {
        if d.worker.closed() || self.stopping.load(Relaxed) {
            return Ok(());
        }
        let mut ph = d.worker.phase();
        match &mut *ph {
            Phase::Running { contender, .. } => {
                // Likely our frontend reconnecting: leave the new client in
                // the backlog until the worker has gone (its end arms the
                // listener again). If the frontend still looks connected
                // after a grace, the timers refuse the newcomer.
                watch.disarm(ep, i, d)?;
                contender.get_or_insert_with(Instant::now);
            }
            Phase::Busy => {
                watch.disarm(ep, i, d)?;
            }
            Phase::Pending {
                conn,
                since,
                partial,
            } => {
                if let Some(s) = self.accept(ep, i, d, watch)? {
                    // Debug: a storm of clients makes one of these each.
                    tracing::debug!(device = %d.spec.name, "a client that sent nothing gave way to the next one");
                    let _ = ep.delete(conn.as_raw_fd());
                    *conn = s;
                    *since = Instant::now();
                    *partial = None;
                    ep.add(
                        conn.as_raw_fd(),
                        Token::Pending(i),
                        EventSet::IN | EventSet::READ_HANG_UP,
                    )?;
                }
            }
            Phase::Idle => {
                if let Some(s) = self.accept(ep, i, d, watch)? {
                    ep.add(
                        s.as_raw_fd(),
                        Token::Pending(i),
                        EventSet::IN | EventSet::READ_HANG_UP,
                    )?;
                    *ph = Phase::Pending {
                        conn: s,
                        since: Instant::now(),
                        partial: None,
                    };
                }
            }
        }
        Ok(())
    }

    /// The client waiting on `d`'s listener; on a failure (out of
    /// descriptors, most likely) the listener is left alone for a moment
    /// and the failure logged once, not once a turn.
    fn accept(
        &self,
        ep: &Poller,
        i: usize,
        d: &Served,
        watch: &mut Watch,
    ) -> io::Result<Option<UnixStream>> {
        match d.listener.accept() {
            Ok((s, _)) => {
                if watch.accept_failing {
                    tracing::info!(device = %d.spec.name, "accepting frontends again");
                    watch.accept_failing = false;
                }
                Ok(Some(s))
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(None),
            Err(e) => {
                if !watch.accept_failing {
                    tracing::warn!(device = %d.spec.name, "cannot accept a frontend: {e}; device sockets are not accepting for {FULL_PAUSE:?} at a time until it succeeds");
                    watch.accept_failing = true;
                }
                watch.disarm(ep, i, d)?;
                watch.paused.insert(i, Instant::now() + FULL_PAUSE);
                Ok(None)
            }
        }
    }

    /// A pending connection has something to say (or has gone). A worker
    /// is forked for it only once a whole, valid vhost-user header is
    /// there: garbage costs a close, not a fork and a recovery.
    fn on_pending(&self, ep: &Poller, d: &Served) -> io::Result<()> {
        let mut ph = d.worker.phase();
        let Phase::Pending { conn, partial, .. } = &mut *ph else {
            return Ok(());
        };
        if d.worker.closed() {
            let _ = ep.delete(conn.as_raw_fd());
            *ph = Phase::Idle;
            return Ok(());
        }
        let mut head = [0u8; HEADER_LEN];
        // SAFETY: a peek of at most head.len() bytes into head; nothing is
        // consumed, so the worker reads the message whole.
        let n = unsafe {
            libc::recv(
                conn.as_raw_fd(),
                head.as_mut_ptr().cast(),
                head.len(),
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n <= 0 {
            if n == 0 || io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock {
                tracing::debug!(device = %d.spec.name, "a client connected and left without a request");
                let _ = ep.delete(conn.as_raw_fd());
                *ph = Phase::Idle;
            }
            return Ok(());
        }
        if (n as usize) < HEADER_LEN {
            // Stop watching it (the bytes there would wake the loop at
            // once, again and again); the timers look again.
            let _ = ep.delete(conn.as_raw_fd());
            let since = *partial.get_or_insert_with(Instant::now);
            if hung_up(conn.as_raw_fd()) || since.elapsed() >= HEADER_WAIT {
                tracing::debug!(device = %d.spec.name, bytes = n, "a client sent part of a header and stopped; closed");
                *ph = Phase::Idle;
            }
            return Ok(());
        }
        if let Err(why) = check_header(&head) {
            d.worker.count_refused();
            tracing::debug!(device = %d.spec.name, "a client's first message is not vhost-user ({why}); closed");
            let _ = ep.delete(conn.as_raw_fd());
            *ph = Phase::Idle;
            return Ok(());
        }
        if d.worker.backing_off() {
            // Stop watching it; the timer starts the worker.
            let _ = ep.delete(conn.as_raw_fd());
            return Ok(());
        }
        let Phase::Pending { conn, .. } = std::mem::replace(&mut *ph, Phase::Idle) else {
            unreachable!()
        };
        let _ = ep.delete(conn.as_raw_fd());
        self.start_worker(d, &mut ph, conn);
        Ok(())
    }

    /// Deadlines: silent clients are closed, backoffs end, second
    /// frontends are refused.
    fn on_timers(&self, ep: &Poller, watch: &mut Watch) -> io::Result<()> {
        let now = Instant::now();
        let resumed: Vec<usize> = watch
            .paused
            .iter()
            .filter(|(_, t)| now >= **t)
            .map(|(i, _)| *i)
            .collect();
        for i in resumed {
            watch.paused.remove(&i);
            // A phase that wants the listener quiet disarms it again.
            if let Some(d) = self.device(i).filter(|d| !d.worker.closed()) {
                ep.modify(d.listener.as_raw_fd(), Token::Listener(i), EventSet::IN)?;
                watch.listening.insert(i, true);
            }
        }
        for (i, d) in self.devices() {
            let mut ph = d.worker.phase();
            if let Phase::Running {
                frontend,
                contender,
                ..
            } = &mut *ph
            {
                let Some(t) = *contender else { continue };
                if t.elapsed() < SECOND_FRONTEND_GRACE {
                    continue;
                }
                *contender = None;
                // A frontend that has hung up is going: its worker's end
                // arms the listener again and serves the newcomer.
                if frontend.as_ref().is_some_and(|f| hung_up(f.as_raw_fd())) {
                    continue;
                }
                // Only if one is there: the listener blocks.
                let waiting = readable(d.listener.as_raw_fd());
                if let Some(Ok((s, _))) = waiting.then(|| d.listener.accept()) {
                    tracing::warn!(device = %d.spec.name, "refused a second frontend: the device already has one");
                    drop(s);
                }
                if !d.worker.closed() {
                    ep.modify(d.listener.as_raw_fd(), Token::Listener(i), EventSet::IN)?;
                    watch.listening.insert(i, true);
                }
                continue;
            }
            let Phase::Pending {
                conn,
                since,
                partial,
            } = &*ph
            else {
                continue;
            };
            if partial.is_some() {
                drop(ph);
                self.on_pending(ep, &d)?;
                continue;
            }
            if since.elapsed() >= FIRST_MESSAGE_WAIT && !d.worker.backing_off() {
                tracing::info!(device = %d.spec.name, "a client connected and sent nothing for {FIRST_MESSAGE_WAIT:?}; closed");
                let _ = ep.delete(conn.as_raw_fd());
                *ph = Phase::Idle;
                continue;
            }
            // A backoff ended with a connection waiting that has spoken.
            if !d.worker.backing_off() && readable(conn.as_raw_fd()) {
                drop(ph);
                self.on_pending(ep, &d)?;
            }
        }
        Ok(())
    }

    /// Asks the launcher for a worker for `d`, serving `conn`.
    fn start_worker(&self, d: &Served, ph: &mut Phase, conn: UnixStream) {
        let id = self.launcher.next_id();
        match self.spawn(d, id, &conn) {
            Ok(control) => {
                d.worker.count_start(control);
                *ph = Phase::Running {
                    id,
                    pid: None,
                    frontend: Some(conn),
                    started: Instant::now(),
                    served_before: d.requests_served(),
                    contender: None,
                };
                self.tell_status();
            }
            Err(e) => {
                d.worker.failed(
                    &d.spec.name,
                    Restart::StartFailed,
                    format!("cannot start a worker: {e}"),
                    Duration::ZERO,
                );
                *ph = Phase::Idle;
            }
        }
    }

    fn spawn(&self, d: &Served, id: u64, conn: &UnixStream) -> io::Result<UnixStream> {
        let spec = Spec {
            name: d.spec.name.clone(),
            size: d.spec.size,
            queues: d.spec.queues,
            algo: d.spec.algo,
            serial: d.spec.serial.clone(),
            readonly: d.spec.readonly,
            discard_segments: d.spec.discard_segments,
            mem_limit: d.cells.budget().limit(),
            staging: d.spec.staging,
            state_dir: d.files.dir.clone(),
            seccomp: self.env.seccomp,
            log_level: self.env.log_level,
            log_format: self.env.log_format,
            compress_threads: self.env.compress_threads,
            poll_us: self.env.poll_us,
            backing: d.backing.as_ref().map(|b| spec::BackingSpec {
                path: b.path.clone(),
                direct: b.direct,
            }),
            tier: spec::TierSettings {
                idle_after_ms: d.spec.tier.idle_after.map(|t| t.as_millis() as u64),
                auto_writeback: d.spec.tier.auto_writeback,
                auto_recompress: d.spec.tier.auto_recompress,
                recompress_algo: d.spec.tier.recompress_algo,
            },
        };
        let (ours, theirs) = wire::seqpacket_pair()?;
        let fds: spec::WorkerFds<RawFd> = spec::WorkerFds {
            control: theirs.as_raw_fd(),
            host: self.host_file.as_raw_fd(),
            lock: d.files.lock.as_raw_fd(),
            table: d.files.table.as_raw_fd(),
            arena: d.files.arena.as_raw_fd(),
            stats: d.files.stats.as_raw_fd(),
            frontend: conn.as_raw_fd(),
            backing: d.backing.as_ref().map(|b| b.file.as_raw_fd()),
        };
        let args = vec![
            "__worker".to_string(),
            serde_json::to_string(&spec).map_err(io::Error::other)?,
        ];
        self.launcher
            .send(&Request::Spawn { id, args }, &fds.in_order())?;
        Ok(UnixStream::from(ours))
    }

    fn on_report(&self, ep: &Poller, watch: &mut Watch) -> io::Result<()> {
        let (report, _fds) = match self.launcher.receive()? {
            Received::Handled => return Ok(()),
            Received::Worker(report, fds) => (report, fds),
            Received::Gone => {
                tracing::error!("the launcher is gone; no new workers can start");
                return Err(io::Error::other("launcher gone"));
            }
        };
        let id = report.id();
        let Some((i, d)) = self
            .devices()
            .into_iter()
            .find(|(_, d)| matches!(&*d.worker.phase(), Phase::Running { id: r, .. } if *r == id))
        else {
            return Ok(());
        };
        match report {
            Report::Spawned { pid, .. } => {
                if let Phase::Running { pid: p, .. } = &mut *d.worker.phase() {
                    *p = Some(pid);
                }
                tracing::info!(device = %d.spec.name, pid, "worker started");
            }
            Report::Failed { error, .. } => {
                self.ended(ep, i, &d, watch);
                d.worker.failed(
                    &d.spec.name,
                    Restart::StartFailed,
                    format!("cannot start a worker: {error}"),
                    Duration::ZERO,
                );
            }
            Report::Exited {
                pid, code, signal, ..
            } => {
                let (ran, before) = match &*d.worker.phase() {
                    Phase::Running {
                        started,
                        served_before,
                        ..
                    } => (started.elapsed(), *served_before),
                    Phase::Idle | Phase::Pending { .. } | Phase::Busy => (Duration::ZERO, 0),
                };
                let served = d.requests_served().saturating_sub(before);
                self.ended(ep, i, &d, watch);
                match (code, signal) {
                    (Some(EXIT_DONE), _) => {
                        tracing::debug!(device = %d.spec.name, pid, served, "worker done after {ran:?}");
                        d.worker.ended_cleanly(&d.spec.name, ran, served);
                    }
                    (Some(c), _) => {
                        let why = format!("worker {pid} exited with code {c}");
                        d.worker.failed(&d.spec.name, Restart::Error, why, ran);
                    }
                    (None, Some(s)) => {
                        let hint = if s == libc::SIGSYS {
                            " (a call outside its seccomp filter; the worker's last log line names it)"
                        } else {
                            ""
                        };
                        let why = format!("worker {pid} killed by {}{hint}", signal_name(s));
                        d.worker.failed(&d.spec.name, Restart::Signal, why, ran);
                    }
                    (None, None) => {
                        let why = format!("worker {pid} ended");
                        d.worker.failed(&d.spec.name, Restart::Signal, why, ran);
                    }
                }
            }
            Report::Prepared { .. }
            | Report::Removed { .. }
            | Report::Pong { .. }
            | Report::Opened { .. } => {}
        }
        Ok(())
    }

    /// A worker of device `i` is gone: the device is idle again.
    fn ended(&self, ep: &Poller, i: usize, d: &Served, watch: &mut Watch) {
        d.worker.gone();
        self.tell_status();
        if watch.listening.get(&i) == Some(&false) && !d.worker.closed() {
            if let Err(e) = ep.modify(d.listener.as_raw_fd(), Token::Listener(i), EventSet::IN) {
                tracing::error!(device = %d.spec.name, "cannot watch the socket again: {e}");
            } else {
                watch.listening.insert(i, true);
            }
        }
    }
}

/// A vhost-user message header: request, flags, payload size.
const HEADER_LEN: usize = 12;

/// Whether `head` can start a frontend's conversation: a request the
/// protocol knows, version 1, not a reply, no reserved flag, a payload the
/// worker would accept (the rules the worker's vhost-user library applies).
fn check_header(head: &[u8; HEADER_LEN]) -> Result<(), &'static str> {
    use vhost::vhost_user::message::{FrontendReq, MAX_MSG_SIZE};
    let word = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    let (request, flags, size) = (word(0), word(4), word(8));
    if FrontendReq::try_from(request).is_err() {
        return Err("unknown request");
    }
    // Bits 0-1: the version (1); bit 2: a reply; bit 3: reply wanted.
    if flags & 0x3 != 0x1 {
        return Err("not version 1");
    }
    if flags & 0x4 != 0 {
        return Err("a reply, not a request");
    }
    if flags & !0xf != 0 {
        return Err("reserved flags set");
    }
    if size as usize > MAX_MSG_SIZE {
        return Err("payload too large");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(request: u32, flags: u32, size: u32) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&request.to_le_bytes());
        h[4..8].copy_from_slice(&flags.to_le_bytes());
        h[8..].copy_from_slice(&size.to_le_bytes());
        h
    }

    #[test]
    fn only_a_frontend_request_header_passes() {
        // GET_FEATURES as QEMU, cloud-hypervisor and libblkio send it first.
        assert_eq!(check_header(&head(1, 0x1, 0)), Ok(()));
        // SET_FEATURES with NEED_REPLY and its 8-byte payload.
        assert_eq!(check_header(&head(2, 0x9, 8)), Ok(()));
        assert!(check_header(&head(0, 0x1, 0)).is_err(), "request 0");
        assert!(
            check_header(&head(9999, 0x1, 0)).is_err(),
            "unknown request"
        );
        assert!(check_header(&head(1, 0x0, 0)).is_err(), "version 0");
        assert!(check_header(&head(1, 0x2, 0)).is_err(), "version 2");
        assert!(check_header(&head(1, 0x5, 0)).is_err(), "a reply");
        assert!(check_header(&head(1, 0x11, 0)).is_err(), "reserved flag");
        assert!(check_header(&head(1, 0x1, 0x1001)).is_err(), "too big");
        assert!(check_header(b"GET / HTTP/1").is_err());
        assert!(check_header(&[0xff; HEADER_LEN]).is_err());
    }
}
