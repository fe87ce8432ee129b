//! The supervisor: owns every device's listening socket and locked state,
//! and serves each connected frontend with a worker process of its own.
//!
//! One thread runs an epoll loop over the listening sockets, connections
//! waiting for their first message, the launcher's reports (worker starts
//! and exits) and a wake-up eventfd. It never reads what a frontend sends:
//! it only waits until a connection has something to say, and hands it
//! over. A worker that dies costs its VM a reconnect; the others notice
//! nothing. A device whose workers keep dying waits longer each time
//! (capped) and shows as failing in `vzram stat`.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vzram_store::{Cells, DeviceCells, DeviceConfig, Pool, StateFiles};

use crate::config::DeviceSpec;
use crate::launcher::{self, Report, Request};
use crate::worker::{self, Answer, Order, Spec};

/// How long a client may take to send its first message.
pub const FIRST_MESSAGE_WAIT: Duration = Duration::from_secs(10);
/// Waits before the next worker of a device whose workers keep failing:
/// doubling from the first, up to the last.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A worker that served this long before failing starts the count afresh.
const HEALTHY_AFTER: Duration = Duration::from_secs(60);
/// How long a compaction order may take.
const COMPACT_WAIT: Duration = Duration::from_secs(120);
/// How long stopping waits for workers to go.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// What the daemon passes every worker besides its device.
#[derive(Clone)]
pub struct WorkerEnv {
    pub seccomp: String,
    pub log_level: String,
}

/// A configured device as the supervisor holds it.
pub struct Served {
    pub spec: DeviceSpec,
    listener: UnixListener,
    /// The state, opened and locked once; each worker gets clones.
    files: StateFiles,
    pub cells: Cells<DeviceCells>,
    /// Workers started so far, and those that ended badly.
    pub workers: AtomicU64,
    pub failures: AtomicU64,
    pub connected: AtomicBool,
    phase: Mutex<Phase>,
    /// Last abnormal end of a worker, for `vzram stat`.
    last_failure: Mutex<Option<String>>,
    /// The control channel of the running worker, for orders.
    control: Mutex<Option<UnixStream>>,
}

enum Phase {
    Idle,
    /// A connection waiting to say something (or for a backoff to end).
    Pending {
        conn: UnixStream,
        since: Instant,
    },
    /// A worker serves it (or is being started). `frontend` is our copy of
    /// its connection, to tell a reconnect from a second frontend.
    Running {
        id: u64,
        pid: Option<u32>,
        frontend: Option<UnixStream>,
        started: Instant,
    },
    /// The supervisor itself holds the device (compacting an idle one).
    Busy,
}

/// The worker state shown by `vzram stat`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkerStatus {
    pub state: &'static str,
    pub pid: Option<u32>,
    pub started: u64,
    pub failures: u64,
    /// Consecutive failures (what the backoff counts).
    pub failing: u64,
    pub last_failure: Option<String>,
}

impl Served {
    pub fn new(
        spec: DeviceSpec,
        listener: UnixListener,
        files: StateFiles,
    ) -> Result<Served, vzram_store::StoreError> {
        let cells = Cells::<DeviceCells>::shared(&files.stats)?;
        // Counted per daemon run (the worker adds to it).
        cells.connections.store(0, Relaxed);
        Ok(Served {
            spec,
            listener,
            files,
            cells,
            workers: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            connected: AtomicBool::new(false),
            phase: Mutex::new(Phase::Idle),
            last_failure: Mutex::new(None),
            control: Mutex::new(None),
        })
    }

    pub fn state_dir(&self) -> &std::path::Path {
        &self.files.dir
    }

    pub fn state_bytes(&self) -> u64 {
        self.files.bytes()
    }

    fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Supervisor state shared by its loop, the control server and `run`.
pub struct Supervisor {
    pub devices: Vec<Arc<Served>>,
    pub pool: Arc<Pool>,
    host_file: std::fs::File,
    launcher: OwnedFd,
    wake: OwnedFd,
    env: WorkerEnv,
    next_id: AtomicU64,
    stopping: AtomicBool,
    /// Consecutive failures per device and when its next worker may start.
    backoff: Mutex<HashMap<usize, (u32, Instant)>>,
}

impl Supervisor {
    pub fn new(
        devices: Vec<Arc<Served>>,
        pool: Arc<Pool>,
        host_file: std::fs::File,
        launcher: OwnedFd,
        env: WorkerEnv,
    ) -> io::Result<Supervisor> {
        // SAFETY: a new eventfd; checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Supervisor {
            devices,
            pool,
            host_file,
            launcher,
            // SAFETY: just created for us.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
            env,
            next_id: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            backoff: Mutex::new(HashMap::new()),
        })
    }

    pub fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Stops every worker (closing its control channel ends it) and waits
    /// a little for them to go, so their state locks are free for whoever
    /// starts next.
    pub fn stop(&self) {
        self.stopping.store(true, Relaxed);
        for d in &self.devices {
            *d.control.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        self.wake();
        let deadline = Instant::now() + STOP_WAIT;
        while Instant::now() < deadline
            && self
                .devices
                .iter()
                .any(|d| matches!(*d.phase(), Phase::Running { .. }))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn worker_status(&self, i: usize) -> WorkerStatus {
        let d = &self.devices[i];
        let (state, pid) = match &*d.phase() {
            Phase::Idle => ("idle", None),
            Phase::Pending { .. } => ("starting", None),
            Phase::Running { pid, .. } => ("running", *pid),
            Phase::Busy => ("compacting", None),
        };
        let failing = self
            .backoff
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&i)
            .map_or(0, |b| u64::from(b.0));
        WorkerStatus {
            state: if failing > 0 && state != "running" {
                "failing"
            } else {
                state
            },
            pid,
            started: d.workers.load(Relaxed),
            failures: d.failures.load(Relaxed),
            failing,
            last_failure: d
                .last_failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }

    /// Compacts device `i`: through its worker when it has one, else here,
    /// holding the device so that no worker starts meanwhile.
    pub fn compact(&self, i: usize) -> Result<u64, String> {
        let d = &self.devices[i];
        {
            let mut ctl = d.control.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = ctl.as_ref() {
                let r = order_compact(c);
                if r.is_err() {
                    *ctl = None;
                }
                return r;
            }
        }
        {
            let mut ph = d.phase();
            match *ph {
                Phase::Idle => *ph = Phase::Busy,
                // A worker is starting: it will compact what it finds
                // fragmented; nothing to do from here.
                _ => return Ok(0),
            }
        }
        let r = self.compact_here(d);
        *d.phase() = Phase::Idle;
        self.wake();
        r
    }

    fn compact_here(&self, d: &Served) -> Result<u64, String> {
        let files = d.files.try_clone().map_err(|e| e.to_string())?;
        let mut dc = DeviceConfig::new(d.spec.size, d.spec.algo);
        dc.mem_limit = d.cells.budget().limit();
        dc.shards = usize::from(d.spec.queues);
        let dev = self
            .pool
            .attach_device(dc, files)
            .map_err(|e| e.to_string())?;
        let pages = dev.compact();
        dev.stats();
        Ok(pages)
    }

    /// The epoll loop; returns when stopping and every worker is gone.
    pub fn run(self: Arc<Self>) {
        if let Err(e) = self.run_loop() {
            tracing::error!("supervisor loop failed: {e}; devices no longer accept frontends");
        }
    }

    fn run_loop(&self) -> io::Result<()> {
        let ep = Epoll::new()?;
        const LAUNCHER: u64 = u64::MAX;
        const WAKE: u64 = u64::MAX - 1;
        // Tokens: 2*i for device i's listener, 2*i+1 for its pending connection.
        ep.add(self.launcher.as_raw_fd(), LAUNCHER, libc::EPOLLIN)?;
        ep.add(self.wake.as_raw_fd(), WAKE, libc::EPOLLIN)?;
        let mut armed = vec![true; self.devices.len()];
        for (i, d) in self.devices.iter().enumerate() {
            ep.add(d.listener.as_raw_fd(), 2 * i as u64, libc::EPOLLIN)?;
        }
        let mut events = vec![epoll::Event::new(epoll::Events::empty(), 0); 64];
        loop {
            let timeout = self.next_deadline();
            let n = ep.wait(&mut events, timeout)?;
            for ev in &events[..n] {
                let token = ev.data;
                match token {
                    LAUNCHER => self.on_report(&ep, &mut armed)?,
                    WAKE => {
                        let mut b = [0u8; 8];
                        // SAFETY: reading our eventfd's counter into b.
                        unsafe { libc::read(self.wake.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
                    }
                    t if t % 2 == 0 => self.on_listener(&ep, (t / 2) as usize, &mut armed)?,
                    t => self.on_pending(&ep, (t / 2) as usize)?,
                }
            }
            self.on_timers(&ep)?;
            if self.stopping.load(Relaxed) {
                return Ok(());
            }
        }
    }

    /// Milliseconds until the nearest first-message deadline or backoff end.
    fn next_deadline(&self) -> i32 {
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        let backoff = self.backoff.lock().unwrap_or_else(|e| e.into_inner());
        for (i, d) in self.devices.iter().enumerate() {
            if let Phase::Pending { since, .. } = &*d.phase() {
                let mut t = *since + FIRST_MESSAGE_WAIT;
                if let Some((_, until)) = backoff.get(&i) {
                    t = t.min((*until).max(now));
                }
                next = Some(next.map_or(t, |n| n.min(t)));
            }
            if let Phase::Busy = &*d.phase() {
                next = Some(next.map_or(now + Duration::from_millis(50), |n| {
                    n.min(now + Duration::from_millis(50))
                }));
            }
        }
        match next {
            None => -1,
            Some(t) => t.saturating_duration_since(now).as_millis().min(60_000) as i32 + 1,
        }
    }

    fn on_listener(&self, ep: &Epoll, i: usize, armed: &mut [bool]) -> io::Result<()> {
        let d = &self.devices[i];
        let mut ph = d.phase();
        match &mut *ph {
            Phase::Running { frontend, .. } => {
                // Our frontend just hung up: this is likely it reconnecting.
                // Leave it in the backlog until the worker has gone.
                if frontend.as_ref().is_some_and(|f| hung_up(f.as_raw_fd())) {
                    ep.modify(d.listener.as_raw_fd(), 2 * i as u64, 0)?;
                    armed[i] = false;
                } else if let Ok((s, _)) = d.listener.accept() {
                    tracing::warn!(device = %d.spec.name, "refused a second frontend: the device already has one");
                    drop(s);
                }
            }
            Phase::Busy => {
                ep.modify(d.listener.as_raw_fd(), 2 * i as u64, 0)?;
                armed[i] = false;
            }
            Phase::Pending { conn, since } => {
                if let Ok((s, _)) = d.listener.accept() {
                    tracing::info!(device = %d.spec.name, "a client that sent nothing gave way to the next one");
                    let _ = ep.delete(conn.as_raw_fd());
                    *conn = s;
                    *since = Instant::now();
                    ep.add(
                        conn.as_raw_fd(),
                        2 * i as u64 + 1,
                        libc::EPOLLIN | libc::EPOLLRDHUP,
                    )?;
                }
            }
            Phase::Idle => {
                if let Ok((s, _)) = d.listener.accept() {
                    ep.add(
                        s.as_raw_fd(),
                        2 * i as u64 + 1,
                        libc::EPOLLIN | libc::EPOLLRDHUP,
                    )?;
                    *ph = Phase::Pending {
                        conn: s,
                        since: Instant::now(),
                    };
                }
            }
        }
        Ok(())
    }

    /// A pending connection has something to say (or has gone).
    fn on_pending(&self, ep: &Epoll, i: usize) -> io::Result<()> {
        let d = &self.devices[i];
        let mut ph = d.phase();
        let Phase::Pending { conn, .. } = &*ph else {
            return Ok(());
        };
        let mut b = [0u8; 1];
        // SAFETY: a one-byte peek into b; nothing is consumed.
        let n = unsafe {
            libc::recv(
                conn.as_raw_fd(),
                b.as_mut_ptr().cast(),
                1,
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
        if self.backing_off(i) {
            // Stop watching it; the timer starts the worker.
            let _ = ep.delete(conn.as_raw_fd());
            return Ok(());
        }
        let Phase::Pending { conn, .. } = std::mem::replace(&mut *ph, Phase::Idle) else {
            unreachable!()
        };
        let _ = ep.delete(conn.as_raw_fd());
        self.start_worker(i, &mut ph, conn);
        Ok(())
    }

    fn backing_off(&self, i: usize) -> bool {
        let b = self.backoff.lock().unwrap_or_else(|e| e.into_inner());
        b.get(&i).is_some_and(|(_, until)| Instant::now() < *until)
    }

    /// Deadlines: silent clients are closed, backoffs end.
    fn on_timers(&self, ep: &Epoll) -> io::Result<()> {
        for (i, d) in self.devices.iter().enumerate() {
            let mut ph = d.phase();
            let Phase::Pending { conn, since } = &*ph else {
                continue;
            };
            if since.elapsed() >= FIRST_MESSAGE_WAIT && !self.backing_off(i) {
                tracing::info!(device = %d.spec.name, "a client connected and sent nothing for {FIRST_MESSAGE_WAIT:?}; closed");
                let _ = ep.delete(conn.as_raw_fd());
                *ph = Phase::Idle;
                continue;
            }
            // A backoff ended with a connection waiting that has spoken.
            if !self.backing_off(i) && readable(conn.as_raw_fd()) {
                drop(ph);
                self.on_pending(ep, i)?;
            }
        }
        Ok(())
    }

    /// Asks the launcher for a worker for device `i`, serving `conn`.
    fn start_worker(&self, i: usize, ph: &mut Phase, conn: UnixStream) {
        let d = &self.devices[i];
        let id = self.next_id.fetch_add(1, Relaxed);
        match self.spawn(i, id, &conn) {
            Ok(control) => {
                *d.control.lock().unwrap_or_else(|e| e.into_inner()) = Some(control);
                d.workers.fetch_add(1, Relaxed);
                d.connected.store(true, Relaxed);
                *ph = Phase::Running {
                    id,
                    pid: None,
                    frontend: Some(conn),
                    started: Instant::now(),
                };
            }
            Err(e) => {
                tracing::error!(device = %d.spec.name, "cannot start a worker: {e}");
                self.failed(i, format!("cannot start: {e}"), Duration::ZERO);
                *ph = Phase::Idle;
            }
        }
    }

    fn spawn(&self, i: usize, id: u64, conn: &UnixStream) -> io::Result<UnixStream> {
        let d = &self.devices[i];
        let spec = Spec {
            name: d.spec.name.clone(),
            size: d.spec.size,
            queues: d.spec.queues,
            algo: d.spec.algo.to_string(),
            serial: d.spec.serial.clone(),
            readonly: d.spec.readonly,
            mem_limit: d.cells.budget().limit(),
            state_dir: d.files.dir.clone(),
            seccomp: self.env.seccomp.clone(),
            log_level: self.env.log_level.clone(),
        };
        let (ours, theirs) = launcher::seqpacket_pair()?;
        let fds: Vec<RawFd> = vec![
            theirs.as_raw_fd(),
            self.host_file.as_raw_fd(),
            d.files.lock.as_raw_fd(),
            d.files.table.as_raw_fd(),
            d.files.arena.as_raw_fd(),
            d.files.stats.as_raw_fd(),
            conn.as_raw_fd(),
        ];
        let args = vec![
            "__worker".to_string(),
            serde_json::to_string(&spec).map_err(io::Error::other)?,
        ];
        launcher::send(&self.launcher, &Request::Spawn { id, args }, &fds)?;
        Ok(UnixStream::from(ours))
    }

    fn on_report(&self, ep: &Epoll, armed: &mut [bool]) -> io::Result<()> {
        let report = match launcher::recv::<Report>(&self.launcher)? {
            Some((r, _)) => r,
            None => {
                tracing::error!("the launcher is gone; no new workers can start");
                return Err(io::Error::other("launcher gone"));
            }
        };
        let find = |id: u64| {
            self.devices
                .iter()
                .position(|d| matches!(&*d.phase(), Phase::Running { id: r, .. } if *r == id))
        };
        match report {
            Report::Spawned { id, pid } => {
                if let Some(i) = find(id) {
                    if let Phase::Running { pid: p, .. } = &mut *self.devices[i].phase() {
                        *p = Some(pid);
                    }
                    tracing::info!(device = %self.devices[i].spec.name, pid, "worker started");
                }
            }
            Report::Failed { id, error } => {
                if let Some(i) = find(id) {
                    let d = &self.devices[i];
                    tracing::error!(device = %d.spec.name, "cannot start a worker: {error}");
                    self.ended(i, ep, armed);
                    self.failed(i, format!("cannot start: {error}"), Duration::ZERO);
                }
            }
            Report::Exited {
                id,
                pid,
                code,
                signal,
            } => {
                let Some(i) = find(id) else { return Ok(()) };
                let d = &self.devices[i];
                let ran = match &*d.phase() {
                    Phase::Running { started, .. } => started.elapsed(),
                    _ => Duration::ZERO,
                };
                self.ended(i, ep, armed);
                match (code, signal) {
                    (Some(worker::EXIT_DONE), _) => {
                        tracing::debug!(device = %d.spec.name, pid, "worker done");
                        self.backoff
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&i);
                    }
                    (Some(c), _) => {
                        let why = format!("worker {pid} exited with code {c}");
                        tracing::error!(device = %d.spec.name, "{why}; the device's state is kept, its next frontend gets a new worker");
                        self.failed(i, why, ran);
                    }
                    (None, Some(s)) => {
                        let why = format!("worker {pid} killed by {}", signal_name(s));
                        let hint = if s == libc::SIGSYS {
                            " (a call outside its seccomp filter; the worker's last log line names it)"
                        } else {
                            ""
                        };
                        tracing::error!(device = %d.spec.name, "{why}{hint}; the device's state is kept, its next frontend gets a new worker");
                        self.failed(i, why, ran);
                    }
                    (None, None) => self.failed(i, format!("worker {pid} ended"), ran),
                }
            }
        }
        Ok(())
    }

    /// A worker of device `i` is gone: the device is idle again.
    fn ended(&self, i: usize, ep: &Epoll, armed: &mut [bool]) {
        let d = &self.devices[i];
        *d.phase() = Phase::Idle;
        *d.control.lock().unwrap_or_else(|e| e.into_inner()) = None;
        d.connected.store(false, Relaxed);
        if !armed[i] {
            if let Err(e) = ep.modify(d.listener.as_raw_fd(), 2 * i as u64, libc::EPOLLIN) {
                tracing::error!(device = %d.spec.name, "cannot watch the socket again: {e}");
            } else {
                armed[i] = true;
            }
        }
    }

    fn failed(&self, i: usize, why: String, ran: Duration) {
        let d = &self.devices[i];
        d.failures.fetch_add(1, Relaxed);
        *d.last_failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
        let mut b = self.backoff.lock().unwrap_or_else(|e| e.into_inner());
        let n = match b.get(&i) {
            Some((n, _)) if ran < HEALTHY_AFTER => n + 1,
            _ => 1,
        };
        let wait = BACKOFF_FIRST
            .saturating_mul(1 << (n - 1).min(16))
            .min(BACKOFF_MAX);
        tracing::warn!(device = %d.spec.name, failures = n, "next worker in {wait:?}");
        b.insert(i, (n, Instant::now() + wait));
    }
}

fn order_compact(c: &UnixStream) -> Result<u64, String> {
    launcher::send(c, &Order::Compact, &[]).map_err(|e| format!("worker: {e}"))?;
    match vzram_blk::guard::wait_fd(c.as_raw_fd(), libc::POLLIN, Some(COMPACT_WAIT)) {
        Ok(true) => {}
        Ok(false) => return Err("the worker did not answer".into()),
        Err(e) => return Err(format!("worker: {e}")),
    }
    match launcher::recv::<Answer>(c) {
        Ok(Some((Answer::Compacted { pages }, _))) => Ok(pages),
        Ok(None) => Err("the worker went away".into()),
        Err(e) => Err(format!("worker: {e}")),
    }
}

/// Whether the peer of a stream socket has closed its end.
fn hung_up(fd: RawFd) -> bool {
    let mut p = [libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    }];
    // SAFETY: one pollfd we own.
    unsafe { libc::poll(p.as_mut_ptr(), 1, 0) > 0 }
}

fn readable(fd: RawFd) -> bool {
    vzram_blk::guard::wait_fd(fd, libc::POLLIN, Some(Duration::ZERO)).unwrap_or(false)
}

pub fn signal_name(s: i32) -> String {
    let name = match s {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGSYS => "SIGSYS",
        libc::SIGABRT => "SIGABRT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGINT => "SIGINT",
        libc::SIGPIPE => "SIGPIPE",
        _ => return format!("signal {s}"),
    };
    name.to_string()
}

/// A small epoll wrapper.
struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    fn new() -> io::Result<Epoll> {
        let fd = epoll::create(true)?;
        // SAFETY: epoll::create returned a new descriptor we now own.
        Ok(Epoll {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    fn ctl(&self, op: epoll::ControlOptions, fd: RawFd, token: u64, events: i32) -> io::Result<()> {
        epoll::ctl(
            self.fd.as_raw_fd(),
            op,
            fd,
            epoll::Event::new(epoll::Events::from_bits_truncate(events as u32), token),
        )
    }

    fn add(&self, fd: RawFd, token: u64, events: i32) -> io::Result<()> {
        self.ctl(epoll::ControlOptions::EPOLL_CTL_ADD, fd, token, events)
    }

    fn modify(&self, fd: RawFd, token: u64, events: i32) -> io::Result<()> {
        self.ctl(epoll::ControlOptions::EPOLL_CTL_MOD, fd, token, events)
    }

    fn delete(&self, fd: RawFd) -> io::Result<()> {
        self.ctl(epoll::ControlOptions::EPOLL_CTL_DEL, fd, 0, 0)
    }

    fn wait(&self, events: &mut [epoll::Event], timeout_ms: i32) -> io::Result<usize> {
        loop {
            match epoll::wait(self.fd.as_raw_fd(), timeout_ms, events) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}
