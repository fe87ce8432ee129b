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

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use vzram_store::{Backing, Cells, Device, DeviceCells, DeviceConfig, Pool, StateFiles};

use crate::config::DeviceSpec;
use crate::launcher::{self, Report, Request};
use crate::worker::{self, Answer, Order, Spec};

/// How long a client may take to send its first message.
pub const FIRST_MESSAGE_WAIT: Duration = Duration::from_secs(10);
/// Waits before the next worker of a device whose workers keep failing
/// (from the second failure in a row): doubling from the first, up to the
/// last.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A worker that served this long before failing starts the count afresh.
const HEALTHY_AFTER: Duration = Duration::from_secs(60);
/// How long a compaction order may take.
const COMPACT_WAIT: Duration = Duration::from_secs(120);
/// How long a writeback or recompression order may take: a whole device
/// through a slow disk or a strong codec.
pub const TIER_WAIT: Duration = Duration::from_secs(1800);
/// How long an order waits for a device that a worker is just taking over
/// (or giving back) before it is refused as busy.
const HOLD_WAIT: Duration = Duration::from_secs(5);
/// How long a compaction waits for a busy device before skipping it.
const COMPACT_PATIENCE: Duration = Duration::from_secs(1);
/// How long a migration order may take: pre-copy lasts until the source's
/// frontend stops, which its operator decides.
pub const MIGRATE_WAIT: Duration = Duration::from_secs(24 * 3600);
/// How long a client that connects while the device's frontend still
/// looks connected waits before it is refused as a second frontend. A
/// frontend that closes and reconnects at once can beat its own hang-up
/// here (the close lands after the connect, for example while another
/// process forked from it still holds the socket until its exec).
const SECOND_FRONTEND_GRACE: Duration = Duration::from_secs(1);
/// How long stopping waits for workers to go.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// What the daemon passes every worker besides its device.
#[derive(Clone)]
pub struct WorkerEnv {
    pub seccomp: String,
    pub log_level: String,
    /// For devices added at run time: their sockets' mode, and where their
    /// state goes unless they say.
    pub socket_mode: u32,
    pub state_dir: PathBuf,
    /// `--compress-threads`; None: the cores, at most 4.
    pub compress_threads: Option<usize>,
    /// `--poll-us`; None: the default.
    pub poll_us: Option<u64>,
}

/// A launcher's answer and the descriptors that came with it.
type Reply = (Report, Vec<OwnedFd>);

/// A device's backing file as the supervisor keeps it open: holding the
/// descriptor holds the file's lock (taken when it was opened) for as long
/// as the device exists, and each worker gets a copy.
pub struct BackingFile {
    pub file: std::fs::File,
    pub path: PathBuf,
    /// Opened with O_DIRECT (false: a file system that refuses it, such as
    /// tmpfs; buffered I/O with the cache dropped after each write).
    pub direct: bool,
    /// Page blocks (the header block not counted).
    pub blocks: u64,
}

impl BackingFile {
    /// Keeps `b`'s file (a second descriptor of the same open file, so the
    /// lock stays with it when `b` goes).
    pub fn of(b: &Backing) -> io::Result<BackingFile> {
        Ok(BackingFile {
            file: b.file().try_clone()?,
            path: b.path().to_path_buf(),
            direct: b.direct(),
            blocks: b.blocks(),
        })
    }

    /// A [`Backing`] over another descriptor of the same file, for a
    /// device served in this process.
    fn open(&self) -> Result<Backing, String> {
        let file = self.file.try_clone().map_err(|e| e.to_string())?;
        Backing::from_file(file, self.path.clone(), self.direct).map_err(|e| e.to_string())
    }
}

/// A configured device as the supervisor holds it.
pub struct Served {
    pub spec: DeviceSpec,
    listener: UnixListener,
    /// The state, opened and locked once; each worker gets clones.
    files: StateFiles,
    /// The backing file, if the device has one.
    pub backing: Option<BackingFile>,
    pub cells: Cells<DeviceCells>,
    /// Workers started so far, and those that ended badly.
    pub workers: AtomicU64,
    pub failures: AtomicU64,
    pub connected: AtomicBool,
    phase: Mutex<Phase>,
    /// Last abnormal end of a worker, for `vzram stat`.
    last_failure: Mutex<Option<String>>,
    /// The control channel of the running worker, for orders. Dropping it
    /// (once no order holds a reference) ends the worker. An order holds
    /// its own reference and not this lock, so that the loop, `remove` and
    /// `stop` never wait for a long writeback.
    control: Mutex<Option<Arc<UnixStream>>>,
    /// One order at a time on the channel, so answers match their orders.
    ordering: Mutex<()>,
    /// Consecutive failures and when the next worker may start.
    backoff: Mutex<Option<(u32, Instant)>>,
    /// Added at run time (`vzram add`): its socket is the launcher's to remove.
    pub added: bool,
    /// Being removed: the loop lets go of it.
    removing: AtomicBool,
    /// An incoming device's migration listener, until its thread takes it.
    incoming: Mutex<Option<crate::migration::Listener>>,
    /// Why the last migration of the device failed, for `vzram stat`.
    pub migration_error: Mutex<Option<String>>,
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
        /// Since when another client waits in the backlog while our
        /// frontend still looks connected.
        contender: Option<Instant>,
    },
    /// The supervisor itself holds the device (compacting, resetting or
    /// tiering one that has no frontend).
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
        backing: Option<BackingFile>,
    ) -> Result<Served, vzram_store::StoreError> {
        let cells = Cells::<DeviceCells>::shared(&files.stats)?;
        // Counted per daemon run (the worker adds to it).
        cells.connections.store(0, Relaxed);
        Ok(Served {
            spec,
            listener,
            files,
            backing,
            cells,
            workers: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            connected: AtomicBool::new(false),
            phase: Mutex::new(Phase::Idle),
            last_failure: Mutex::new(None),
            control: Mutex::new(None),
            ordering: Mutex::new(()),
            backoff: Mutex::new(None),
            added: false,
            removing: AtomicBool::new(false),
            incoming: Mutex::new(None),
            migration_error: Mutex::new(None),
        })
    }

    /// Gives an incoming device its listener (taken by
    /// [`Supervisor::start_incoming`]).
    pub fn with_incoming(self, l: Option<crate::migration::Listener>) -> Served {
        *self.incoming.lock().unwrap_or_else(|e| e.into_inner()) = l;
        self
    }

    fn set_migration_error(&self, e: Option<String>) {
        *self
            .migration_error
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = e;
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

    fn backoff(&self) -> MutexGuard<'_, Option<(u32, Instant)>> {
        self.backoff.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn backing_off(&self) -> bool {
        self.backoff()
            .is_some_and(|(_, until)| Instant::now() < until)
    }
}

/// Supervisor state shared by its loop, the control server and `run`.
pub struct Supervisor {
    /// By index; a removed device leaves a hole, so indices stay put.
    devices: RwLock<Vec<Option<Arc<Served>>>>,
    pub pool: Arc<Pool>,
    host_file: std::fs::File,
    launcher: OwnedFd,
    wake: OwnedFd,
    env: WorkerEnv,
    next_id: AtomicU64,
    stopping: AtomicBool,
    /// The service manager, told how many devices are connected.
    notifier: Mutex<Option<Arc<crate::notify::Notifier>>>,
    /// One `add` at a time (names and sockets must stay unique).
    adding: Mutex<()>,
    /// Launcher requests waiting for their reply, by id.
    replies: Mutex<std::collections::HashMap<u64, mpsc::Sender<Reply>>>,
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
            devices: RwLock::new(devices.into_iter().map(Some).collect()),
            pool,
            host_file,
            launcher,
            // SAFETY: just created for us.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
            env,
            next_id: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            replies: Mutex::new(std::collections::HashMap::new()),
            adding: Mutex::new(()),
            notifier: Mutex::new(None),
        })
    }

    /// Device `i`, if it exists (and was not removed).
    pub fn device(&self, i: usize) -> Option<Arc<Served>> {
        let list = self.devices.read().unwrap_or_else(|e| e.into_inner());
        list.get(i).cloned().flatten()
    }

    /// Every device, with its index.
    pub fn devices(&self) -> Vec<(usize, Arc<Served>)> {
        let list = self.devices.read().unwrap_or_else(|e| e.into_inner());
        list.iter()
            .enumerate()
            .filter_map(|(i, d)| d.clone().map(|d| (i, d)))
            .collect()
    }

    /// Status lines for the service manager from now on.
    pub fn set_notifier(&self, n: Option<Arc<crate::notify::Notifier>>) {
        *self.notifier.lock().unwrap_or_else(|e| e.into_inner()) = n;
    }

    /// `STATUS=` for systemd: devices, and how many have a frontend.
    fn tell_status(&self) {
        let n = self
            .notifier
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(n) = n {
            let all = self.devices();
            let connected = all
                .iter()
                .filter(|(_, d)| d.connected.load(Relaxed))
                .count();
            let msg = format!(
                "STATUS=serving {} devices, {connected} connected",
                all.len()
            );
            if let Err(e) = n.send(&msg) {
                tracing::debug!("cannot tell the service manager ({msg}): {e}");
            }
        }
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
        // Sockets added at run time are the launcher's to remove, while
        // it is still there to ask.
        for (_, d) in self.devices() {
            if d.added {
                let _ = self.ask(|id| Request::Remove {
                    id,
                    socket: Some(d.spec.socket.clone()),
                    state: None,
                });
            }
        }
        self.stopping.store(true, Relaxed);
        let all = self.devices();
        for (_, d) in &all {
            *d.control.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        self.wake();
        let deadline = Instant::now() + STOP_WAIT;
        while Instant::now() < deadline
            && all
                .iter()
                .any(|(_, d)| matches!(*d.phase(), Phase::Running { .. }))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn worker_status(&self, d: &Served) -> WorkerStatus {
        let (state, pid) = match &*d.phase() {
            Phase::Idle => ("idle", None),
            Phase::Pending { .. } => ("starting", None),
            Phase::Running { pid, .. } => ("running", *pid),
            // The supervisor itself holds the device: compacting, resetting
            // or tiering it.
            Phase::Busy => ("busy", None),
        };
        let failing = d.backoff().map_or(0, |b| u64::from(b.0));
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

    /// Compacts device `d`: through its worker when it has one, else here,
    /// holding the device so that no worker starts meanwhile.
    ///
    /// The pages given back are read from the device's shared counter: a
    /// worker that compacted and then went before it could answer (its
    /// frontend had just left) is asked again, and the second pass finds
    /// nothing left to do. The count includes any compaction the worker
    /// ran by itself meanwhile. A device that stays busy (a frontend
    /// connecting, another command holding it) for a second is skipped:
    /// 0 pages, as compaction is only ever an optimisation.
    pub fn compact(&self, d: &Served) -> Result<u64, String> {
        let counted = || d.cells.stats(d.spec.size).pages_compacted;
        let before = counted();
        match self.carry_out(d, &Order::Compact, COMPACT_WAIT, COMPACT_PATIENCE)? {
            Some(Answer::Compacted { pages }) => Ok(pages.max(counted().saturating_sub(before))),
            Some(a) => Err(unexpected(a)),
            None => {
                tracing::info!(device = %d.spec.name, "busy; not compacted");
                Ok(0)
            }
        }
    }

    /// Carries out a tiering order on device `d`: through its worker when
    /// it has one, else here, holding the device. A failure the order met
    /// (a full backing file) is an error, with what was done kept.
    pub fn tier(&self, d: &Served, order: &Order) -> Result<Answer, String> {
        let needs_backing = matches!(order, Order::Writeback { .. });
        if needs_backing && d.backing.is_none() {
            return Err(format!(
                "device {} has no backing file (give it backing-file=PATH)",
                d.spec.name
            ));
        }
        self.carry_out(d, order, TIER_WAIT, HOLD_WAIT)?.ok_or_else(|| {
            format!(
                "device {} is busy (a frontend is connecting, or another command holds it); try again",
                d.spec.name
            )
        })
    }

    /// Carries out `order` on `d`: through its worker when it has one, else
    /// here, holding the device. A worker that is going (its frontend had
    /// just left) or starting is asked again, never skipped: an order that
    /// met a device in transition used to report nothing done. None if
    /// the device was neither served nor free to hold for `patience`.
    fn carry_out(
        &self,
        d: &Served,
        order: &Order,
        wait: Duration,
        patience: Duration,
    ) -> Result<Option<Answer>, String> {
        let deadline = Instant::now() + patience;
        let answer = loop {
            match self.order_worker(d, order, wait) {
                Some(Ok(a)) => break a,
                Some(Err(Asked::Silent)) => return Err(Asked::Silent.to_string()),
                // The worker was going (its frontend had just left) or died:
                // whatever it did is in the device, and every tiering order
                // can run again; whoever holds the device next takes it.
                Some(Err(Asked::Gone(e))) => {
                    tracing::info!(device = %d.spec.name, "worker went away during an order ({e}); asking again")
                }
                None => {}
            }
            if let Some(a) = self.hold(d, |dev| worker::execute(dev, order))? {
                break a;
            }
            // A worker is being started or is going: ask again soon.
            if Instant::now() > deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        match answer {
            Answer::Failed { error } => Err(format!("device {}: {error}", d.spec.name)),
            a => Ok(Some(a)),
        }
    }

    /// Sends `order` to `d`'s worker and waits for its answer; None if no
    /// worker serves `d`. A worker that cannot be asked loses its channel,
    /// which ends it (its frontend reconnects to a new one).
    fn order_worker(
        &self,
        d: &Served,
        order: &Order,
        wait: Duration,
    ) -> Option<Result<Answer, Asked>> {
        self.order_worker_with(d, order, wait, &mut None)
    }

    /// [`Supervisor::order_worker`], handing the worker `fd` with the
    /// order (taken out of it only if there is a worker to send it to).
    fn order_worker_with(
        &self,
        d: &Served,
        order: &Order,
        wait: Duration,
        fd: &mut Option<OwnedFd>,
    ) -> Option<Result<Answer, Asked>> {
        let _one = d.ordering.lock().unwrap_or_else(|e| e.into_inner());
        let c = d
            .control
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()?;
        let fd = fd.take();
        let raw: Vec<RawFd> = fd.iter().map(AsRawFd::as_raw_fd).collect();
        let r = ask_worker(&c, order, &raw, wait);
        drop(fd);
        if r.is_err() {
            let mut ctl = d.control.lock().unwrap_or_else(|e| e.into_inner());
            // Unless a new worker took over meanwhile.
            if ctl.as_ref().is_some_and(|now| Arc::ptr_eq(now, &c)) {
                *ctl = None;
            }
        }
        Some(r)
    }

    /// Drops every page of `d`; refused while a frontend is connected,
    /// unless the device waits for its pages (incoming): then it gives up
    /// waiting and serves, empty, whether a frontend is connected or not.
    pub fn reset(&self, d: &Served) -> Result<u64, String> {
        let m = &d.cells.migration;
        if m.incoming() {
            if m.state.load(Relaxed) == vzram_store::cells::MIGRATION_RECEIVING {
                return Err(format!(
                    "device {}: a migration stream is arriving; reset once it has failed",
                    d.spec.name
                ));
            }
            let (answer, _) = self.on_owner(d, &Order::ResetIncoming, None, HOLD_WAIT)?;
            return match answer {
                Answer::IncomingReset { pages } => {
                    d.set_migration_error(None);
                    tracing::warn!(device = %d.spec.name, "incoming device reset: it serves, empty");
                    Ok(pages)
                }
                Answer::Failed { error } => Err(format!("device {}: {error}", d.spec.name)),
                a => Err(unexpected(a)),
            };
        }
        let dropped = self.hold(d, |dev| {
            let pages = dev.stats().orig_data_size / 4096;
            let r = dev.discard(&mut vzram_store::Context::new(0), 0..dev.num_slots());
            dev.compact();
            r.map(|()| pages)
        })?;
        match dropped {
            Some(r) => r.map_err(|e| e.to_string()),
            None => Err(format!(
                "device {} has a frontend (or one connecting); disconnect it first",
                d.spec.name
            )),
        }
    }

    /// Carries out a migration order where the device's allocator is: its
    /// worker, or here (holding the device) when it has none. `fd` goes
    /// with the order. Waits up to `hold_wait` for a worker that is just
    /// starting or going. Also says whether a worker took the order.
    fn on_owner(
        &self,
        d: &Served,
        order: &Order,
        fd: Option<OwnedFd>,
        hold_wait: Duration,
    ) -> Result<(Answer, bool), String> {
        let mut fd = fd;
        let deadline = Instant::now() + hold_wait;
        loop {
            if let Some(r) = self.order_worker_with(d, order, MIGRATE_WAIT, &mut fd) {
                return r.map(|a| (a, true)).map_err(|e| e.to_string());
            }
            let here = self.hold(d, |dev| {
                let open = || {};
                worker::execute_migration(
                    dev,
                    order,
                    worker::Migrating {
                        conn: fd.take(),
                        quiet: &|| true,
                        open_gate: &open,
                    },
                )
            })?;
            if let Some(a) = here {
                return Ok((a, false));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "device {} is busy (a frontend is connecting, or another command holds it); try again",
                    d.spec.name
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends device `d` to the vzram at `to` (see `vzram migrate`): its
    /// worker does while a frontend is connected, else this process. A
    /// worker that goes away mid-way (its frontend left, or it died) is
    /// replaced by another attempt from the start.
    pub fn migrate(
        &self,
        d: &Served,
        to: &crate::migration::Addr,
        keep: bool,
    ) -> Result<Answer, String> {
        const ATTEMPTS: usize = 3;
        let mut last = String::new();
        for attempt in 1..=ATTEMPTS {
            let (report, mut fds) = self.ask(|id| Request::Connect {
                id,
                addr: to.clone(),
            })?;
            match report {
                Report::Connected { .. } => {}
                Report::Failed { error, .. } => {
                    return Err(format!("cannot connect to {to}: {error}"))
                }
                r => return Err(format!("unexpected answer from the launcher: {r:?}")),
            }
            let fd = fds
                .pop()
                .ok_or_else(|| "the launcher sent no connection".to_string())?;
            tracing::info!(device = %d.spec.name, to = %to, attempt, keep, "migrating");
            match self.on_owner(d, &Order::Send { keep }, Some(fd), HOLD_WAIT) {
                Ok((Answer::Failed { error }, _)) => {
                    d.set_migration_error(Some(error.clone()));
                    return Err(format!("device {}: {error}", d.spec.name));
                }
                Ok((a, _)) => {
                    d.set_migration_error(None);
                    return Ok(a);
                }
                // The channel broke: the worker is gone.
                Err(e) => {
                    tracing::warn!(device = %d.spec.name, "migration attempt {attempt}: {e}");
                    last = e;
                }
            }
        }
        d.cells
            .migration
            .state
            .store(vzram_store::cells::MIGRATION_SEND_FAILED, Relaxed);
        d.set_migration_error(Some(last.clone()));
        Err(format!("device {}: {last}", d.spec.name))
    }

    /// Accepts migration streams for incoming device `d` on its own thread
    /// until one has brought its pages.
    pub fn start_incoming(self: &Arc<Self>, d: Arc<Served>) -> io::Result<()> {
        let Some(l) = d.incoming.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Ok(());
        };
        let sup = self.clone();
        std::thread::Builder::new()
            .name(format!("incoming-{}", d.spec.name))
            .spawn(move || sup.incoming_loop(&d, l))
            .map(drop)
    }

    fn incoming_loop(&self, d: &Served, l: crate::migration::Listener) {
        use crate::migration::{refuse, Conn};
        loop {
            if self.stopping.load(Relaxed) || d.removing.load(Relaxed) {
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
                refuse(
                    &Conn::new(fd),
                    &format!("device {} is not waiting for a migration", d.spec.name),
                );
                return;
            }
            tracing::info!(device = %d.spec.name, "a migration stream connected");
            match self.on_owner(d, &Order::Receive, Some(fd), MIGRATE_WAIT) {
                Ok((
                    Answer::Received {
                        pages,
                        bytes,
                        micros,
                        ..
                    },
                    by_worker,
                )) => {
                    d.set_migration_error(None);
                    tracing::info!(
                        device = %d.spec.name,
                        pages,
                        bytes,
                        ms = micros / 1000,
                        by_worker,
                        "migration received: the device serves"
                    );
                }
                Ok((Answer::Failed { error }, _)) | Err(error) => {
                    tracing::error!(device = %d.spec.name, "migration stream failed: {error}; requests keep waiting for another (or vzram reset)");
                    let m = &d.cells.migration;
                    if m.incoming() {
                        m.state.store(vzram_store::cells::MIGRATION_FAILED, Relaxed);
                    }
                    d.set_migration_error(Some(error));
                }
                Ok((a, _)) => tracing::error!(device = %d.spec.name, "{}", unexpected(a)),
            }
            if !d.cells.migration.incoming() {
                return;
            }
        }
    }

    /// Runs `f` on device `d` in this process, if no worker serves it (None
    /// if one does); no worker starts meanwhile.
    fn hold<T>(&self, d: &Served, f: impl FnOnce(&Device) -> T) -> Result<Option<T>, String> {
        {
            let mut ph = d.phase();
            match *ph {
                Phase::Idle => *ph = Phase::Busy,
                _ => return Ok(None),
            }
        }
        let r = self.attach(d).map(|dev| {
            let out = f(&dev);
            dev.stats();
            out
        });
        *d.phase() = Phase::Idle;
        self.wake();
        r.map(Some)
    }

    /// The device of `d`, recovered in this process from its state.
    fn attach(&self, d: &Served) -> Result<Arc<Device>, String> {
        attach(
            &self.pool,
            &d.spec,
            &d.files,
            d.backing.as_ref(),
            d.cells.budget().limit(),
        )
    }

    /// Adds a device at run time; returns its index.
    pub fn add(self: &Arc<Self>, spec: DeviceSpec) -> Result<usize, String> {
        let _one = self.adding.lock().unwrap_or_else(|e| e.into_inner());
        for (_, d) in self.devices() {
            if d.spec.name == spec.name {
                return Err(format!("a device named {:?} exists", spec.name));
            }
            if d.spec.socket == spec.socket {
                return Err(format!(
                    "socket {} is device {}'s",
                    spec.socket.display(),
                    d.spec.name
                ));
            }
        }
        let root = spec
            .state_dir
            .clone()
            .unwrap_or_else(|| self.env.state_dir.clone());
        let (report, fds) = self.ask(|id| Request::Prepare {
            id,
            socket: spec.socket.clone(),
            mode: self.env.socket_mode,
            root,
            name: spec.name.clone(),
            size: spec.size,
            algo: spec.algo.to_string(),
            shards: usize::from(spec.queues),
            backing: spec.tier.backing_file.clone(),
            incoming: spec.incoming.clone(),
        })?;
        let (dir, existing, prepared_backing) = match report {
            Report::Prepared {
                dir,
                existing,
                backing,
                ..
            } => (dir, existing, backing),
            Report::Failed { error, .. } => return Err(error),
            r => return Err(format!("unexpected answer from the launcher: {r:?}")),
        };
        let mut fds = fds.into_iter();
        let mut next = || {
            fds.next()
                .ok_or_else(|| "the launcher sent the wrong descriptors".to_string())
        };
        let (listener, lock, table, arena, stats) = (next()?, next()?, next()?, next()?, next()?);
        let backing = match (spec.tier.backing_file.clone(), prepared_backing) {
            (Some(path), Some(b)) => Some(BackingFile {
                file: next()?.into(),
                path,
                direct: b.direct,
                blocks: b.blocks,
            }),
            (None, None) => None,
            _ => return Err("the launcher sent the wrong descriptors".to_string()),
        };
        let incoming = match &spec.incoming {
            Some(a) => Some(crate::migration::Listener::new(a, next()?)),
            None => None,
        };
        let socket = spec.socket.clone();
        let undo = |e: String| {
            let _ = self.ask(|id| Request::Remove {
                id,
                socket: Some(socket.clone()),
                state: None,
            });
            e
        };
        let files = StateFiles::from_files(
            dir,
            lock.into(),
            table.into(),
            arena.into(),
            stats.into(),
            spec.size,
        )
        .map_err(|e| undo(e.to_string()))?;
        let dev =
            attach(&self.pool, &spec, &files, backing.as_ref(), spec.mem_limit).map_err(undo)?;
        match dev.recovery() {
            Some(r) if existing => tracing::info!(
                device = %spec.name,
                pages = r.slots,
                ms = r.micros as f64 / 1000.0,
                "added; recovered the device from its state"
            ),
            _ => tracing::info!(device = %spec.name, socket = %spec.socket.display(), "added"),
        }
        if spec.incoming.is_some() {
            set_incoming(&spec.name, &dev);
        }
        drop(dev);
        let mut served = Served::new(spec, listener.into(), files, backing)
            .map_err(|e| undo(e.to_string()))?
            .with_incoming(incoming);
        served.added = true;
        let i = {
            let mut list = self.devices.write().unwrap_or_else(|e| e.into_inner());
            list.push(Some(Arc::new(served)));
            list.len() - 1
        };
        self.wake();
        self.tell_status();
        if let Some(d) = self.device(i) {
            self.start_incoming(d)
                .map_err(|e| format!("cannot start the migration listener: {e}"))?;
        }
        Ok(i)
    }

    /// Removes device `i` for good: its frontend is disconnected, its
    /// socket and its state deleted, its memory given back.
    pub fn remove(&self, i: usize) -> Result<(), String> {
        let Some(d) = self.device(i) else {
            return Err(format!("no device {i}"));
        };
        d.removing.store(true, Relaxed);
        self.wake();
        let deadline = Instant::now() + STOP_WAIT;
        while !matches!(*d.phase(), Phase::Idle) {
            if Instant::now() > deadline {
                return Err(format!(
                    "device {}: its worker did not stop within {STOP_WAIT:?}",
                    d.spec.name
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.devices.write().unwrap_or_else(|e| e.into_inner())[i] = None;
        d.cells.release(self.pool.host_cells());
        let socket = d.spec.socket.clone();
        let dir = d.files.dir.clone();
        let name = d.spec.name.clone();
        // Everyone else lets go within moments (a stat, the loop's turn);
        // the state can be deleted only once its lock is free.
        let mut d = d;
        let deadline = Instant::now() + STOP_WAIT;
        loop {
            match Arc::try_unwrap(d) {
                Ok(served) => {
                    drop(served);
                    break;
                }
                Err(again) if Instant::now() < deadline => {
                    d = again;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(_) => return Err(format!("device {name}: still in use; try again")),
            }
        }
        let (report, _) = self.ask(|id| Request::Remove {
            id,
            socket: Some(socket),
            state: Some(dir),
        })?;
        match report {
            Report::Removed { .. } => {
                tracing::info!(device = %name, "removed, with its state");
                self.tell_status();
                Ok(())
            }
            Report::Failed { error, .. } => Err(error),
            r => Err(format!("unexpected answer from the launcher: {r:?}")),
        }
    }

    /// The epoll loop; returns when stopping.
    pub fn run(self: Arc<Self>) {
        if let Err(e) = self.run_loop() {
            tracing::error!("supervisor loop failed: {e}; devices no longer accept frontends");
        }
    }

    fn run_loop(&self) -> io::Result<()> {
        let ep = Epoll::new()?;
        // Tokens: 2*i for device i's listener, 2*i+1 for its pending connection.
        ep.add(self.launcher.as_raw_fd(), LAUNCHER, libc::EPOLLIN)?;
        ep.add(self.wake.as_raw_fd(), WAKE, libc::EPOLLIN)?;
        let mut watch = Watch::default();
        self.sync_devices(&ep, &mut watch)?;
        let mut events = vec![epoll::Event::new(epoll::Events::empty(), 0); 64];
        let mut stop_seen: Option<Instant> = None;
        loop {
            let timeout = if self.stopping.load(Relaxed) {
                50
            } else {
                self.next_deadline()
            };
            let n = ep.wait(&mut events, timeout)?;
            for ev in &events[..n] {
                let token = ev.data;
                match token {
                    LAUNCHER => self.on_report(&ep, &mut watch)?,
                    WAKE => {
                        let mut b = [0u8; 8];
                        // SAFETY: reading our eventfd's counter into b.
                        unsafe { libc::read(self.wake.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
                        self.sync_devices(&ep, &mut watch)?;
                    }
                    t => {
                        let i = (t / 2) as usize;
                        let Some(d) = self.device(i) else { continue };
                        if t % 2 == 0 {
                            self.on_listener(&ep, i, &d, &mut watch)?;
                        } else {
                            self.on_pending(&ep, &d)?;
                        }
                    }
                }
            }
            self.on_timers(&ep, &mut watch)?;
            if self.stopping.load(Relaxed) {
                // Stay to hear the workers' exits (stop() waits on them),
                // but not for ever.
                let since = *stop_seen.get_or_insert_with(Instant::now);
                let running = self
                    .devices()
                    .iter()
                    .any(|(_, d)| matches!(*d.phase(), Phase::Running { .. }));
                if !running || since.elapsed() > STOP_WAIT {
                    return Ok(());
                }
            }
        }
    }

    /// Watches devices added since the last call, lets go of those being
    /// removed, and listens again on those a hold has let go of.
    fn sync_devices(&self, ep: &Epoll, watch: &mut Watch) -> io::Result<()> {
        for (i, d) in self.devices() {
            let removing = d.removing.load(Relaxed);
            match watch.listening.get(&i).copied() {
                None if !removing => {
                    ep.add(d.listener.as_raw_fd(), 2 * i as u64, libc::EPOLLIN)?;
                    watch.listening.insert(i, true);
                }
                Some(_) if removing => {
                    let _ = ep.delete(d.listener.as_raw_fd());
                    watch.listening.remove(&i);
                    let mut ph = d.phase();
                    match &*ph {
                        Phase::Pending { conn, .. } => {
                            let _ = ep.delete(conn.as_raw_fd());
                            *ph = Phase::Idle;
                        }
                        Phase::Running { .. } => {
                            // Closing its control channel ends the worker.
                            *d.control.lock().unwrap_or_else(|e| e.into_inner()) = None;
                        }
                        _ => {}
                    }
                }
                // Disarmed while the supervisor held the device (a frontend
                // came meanwhile and waits in the backlog): the hold is over.
                Some(false) if matches!(*d.phase(), Phase::Idle) => {
                    ep.modify(d.listener.as_raw_fd(), 2 * i as u64, libc::EPOLLIN)?;
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
            match &*d.phase() {
                Phase::Pending { since, .. } => {
                    let mut t = *since + FIRST_MESSAGE_WAIT;
                    if let Some((_, until)) = *d.backoff() {
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

    fn on_listener(&self, ep: &Epoll, i: usize, d: &Served, watch: &mut Watch) -> io::Result<()> {
        if d.removing.load(Relaxed) || self.stopping.load(Relaxed) {
            return Ok(());
        }
        let mut ph = d.phase();
        match &mut *ph {
            Phase::Running { contender, .. } => {
                // Likely our frontend reconnecting: leave the new client in
                // the backlog until the worker has gone (its end arms the
                // listener again). If the frontend still looks connected
                // after a grace, the timers refuse the newcomer.
                ep.modify(d.listener.as_raw_fd(), 2 * i as u64, 0)?;
                watch.listening.insert(i, false);
                contender.get_or_insert_with(Instant::now);
            }
            Phase::Busy => {
                ep.modify(d.listener.as_raw_fd(), 2 * i as u64, 0)?;
                watch.listening.insert(i, false);
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
    fn on_pending(&self, ep: &Epoll, d: &Served) -> io::Result<()> {
        let mut ph = d.phase();
        let Phase::Pending { conn, .. } = &*ph else {
            return Ok(());
        };
        if d.removing.load(Relaxed) {
            let _ = ep.delete(conn.as_raw_fd());
            *ph = Phase::Idle;
            return Ok(());
        }
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
        if d.backing_off() {
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
    fn on_timers(&self, ep: &Epoll, watch: &mut Watch) -> io::Result<()> {
        for (i, d) in self.devices() {
            let mut ph = d.phase();
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
                if !d.removing.load(Relaxed) {
                    ep.modify(d.listener.as_raw_fd(), 2 * i as u64, libc::EPOLLIN)?;
                    watch.listening.insert(i, true);
                }
                continue;
            }
            let Phase::Pending { conn, since } = &*ph else {
                continue;
            };
            if since.elapsed() >= FIRST_MESSAGE_WAIT && !d.backing_off() {
                tracing::info!(device = %d.spec.name, "a client connected and sent nothing for {FIRST_MESSAGE_WAIT:?}; closed");
                let _ = ep.delete(conn.as_raw_fd());
                *ph = Phase::Idle;
                continue;
            }
            // A backoff ended with a connection waiting that has spoken.
            if !d.backing_off() && readable(conn.as_raw_fd()) {
                drop(ph);
                self.on_pending(ep, &d)?;
            }
        }
        Ok(())
    }

    /// Asks the launcher for a worker for `d`, serving `conn`.
    fn start_worker(&self, d: &Served, ph: &mut Phase, conn: UnixStream) {
        let id = self.next_id.fetch_add(1, Relaxed);
        match self.spawn(d, id, &conn) {
            Ok(control) => {
                *d.control.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(control));
                d.workers.fetch_add(1, Relaxed);
                d.connected.store(true, Relaxed);
                *ph = Phase::Running {
                    id,
                    pid: None,
                    frontend: Some(conn),
                    started: Instant::now(),
                    contender: None,
                };
                self.tell_status();
            }
            Err(e) => {
                tracing::error!(device = %d.spec.name, "cannot start a worker: {e}");
                failed(d, format!("cannot start: {e}"), Duration::ZERO);
                *ph = Phase::Idle;
            }
        }
    }

    fn spawn(&self, d: &Served, id: u64, conn: &UnixStream) -> io::Result<UnixStream> {
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
            compress_threads: self.env.compress_threads,
            poll_us: self.env.poll_us,
            backing: d.backing.as_ref().map(|b| worker::BackingSpec {
                path: b.path.clone(),
                direct: b.direct,
            }),
            tier: worker::TierSettings {
                idle_after_ms: d.spec.tier.idle_after.map(|t| t.as_millis() as u64),
                auto_writeback: d.spec.tier.auto_writeback,
                auto_recompress: d.spec.tier.auto_recompress,
                recompress_algo: d.spec.tier.recompress_algo.to_string(),
            },
        };
        let (ours, theirs) = launcher::seqpacket_pair()?;
        // In the order of `worker::Fds`.
        let mut fds: Vec<RawFd> = vec![
            theirs.as_raw_fd(),
            self.host_file.as_raw_fd(),
            d.files.lock.as_raw_fd(),
            d.files.table.as_raw_fd(),
            d.files.arena.as_raw_fd(),
            d.files.stats.as_raw_fd(),
            conn.as_raw_fd(),
        ];
        if let Some(b) = &d.backing {
            fds.push(b.file.as_raw_fd());
        }
        let args = vec![
            "__worker".to_string(),
            serde_json::to_string(&spec).map_err(io::Error::other)?,
        ];
        launcher::send(&self.launcher, &Request::Spawn { id, args }, &fds)?;
        Ok(UnixStream::from(ours))
    }

    /// Sends the launcher a request and waits for its reply (read by the
    /// loop, which must be running).
    pub fn ask(&self, req: impl FnOnce(u64) -> Request) -> Result<(Report, Vec<OwnedFd>), String> {
        let id = self.next_id.fetch_add(1, Relaxed);
        let (tx, rx) = mpsc::channel();
        self.replies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        let sent = launcher::send(&self.launcher, &req(id), &[]);
        let r = match sent {
            Ok(()) => rx
                .recv_timeout(ASK_WAIT)
                .map_err(|_| "the launcher did not answer".to_string()),
            Err(e) => Err(format!("launcher: {e}")),
        };
        self.replies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        r
    }

    fn on_report(&self, ep: &Epoll, watch: &mut Watch) -> io::Result<()> {
        let (report, fds) = match launcher::recv::<Report>(&self.launcher)? {
            Some(r) => r,
            None => {
                tracing::error!("the launcher is gone; no new workers can start");
                return Err(io::Error::other("launcher gone"));
            }
        };
        let id = report.id();
        let waiting = self
            .replies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        if let Some(tx) = waiting {
            let _ = tx.send((report, fds));
            return Ok(());
        }
        let Some((i, d)) = self
            .devices()
            .into_iter()
            .find(|(_, d)| matches!(&*d.phase(), Phase::Running { id: r, .. } if *r == id))
        else {
            return Ok(());
        };
        match report {
            Report::Spawned { pid, .. } => {
                if let Phase::Running { pid: p, .. } = &mut *d.phase() {
                    *p = Some(pid);
                }
                tracing::info!(device = %d.spec.name, pid, "worker started");
            }
            Report::Failed { error, .. } => {
                tracing::error!(device = %d.spec.name, "cannot start a worker: {error}");
                self.ended(ep, i, &d, watch);
                failed(&d, format!("cannot start: {error}"), Duration::ZERO);
            }
            Report::Exited {
                pid, code, signal, ..
            } => {
                let ran = match &*d.phase() {
                    Phase::Running { started, .. } => started.elapsed(),
                    _ => Duration::ZERO,
                };
                self.ended(ep, i, &d, watch);
                match (code, signal) {
                    (Some(worker::EXIT_DONE), _) => {
                        tracing::debug!(device = %d.spec.name, pid, "worker done");
                        *d.backoff() = None;
                    }
                    (Some(c), _) => {
                        let why = format!("worker {pid} exited with code {c}");
                        tracing::error!(device = %d.spec.name, "{why}; the device's state is kept, its next frontend gets a new worker");
                        failed(&d, why, ran);
                    }
                    (None, Some(s)) => {
                        let why = format!("worker {pid} killed by {}", signal_name(s));
                        let hint = if s == libc::SIGSYS {
                            " (a call outside its seccomp filter; the worker's last log line names it)"
                        } else {
                            ""
                        };
                        tracing::error!(device = %d.spec.name, "{why}{hint}; the device's state is kept, its next frontend gets a new worker");
                        failed(&d, why, ran);
                    }
                    (None, None) => failed(&d, format!("worker {pid} ended"), ran),
                }
            }
            Report::Prepared { .. } | Report::Removed { .. } | Report::Connected { .. } => {}
        }
        Ok(())
    }

    /// A worker of device `i` is gone: the device is idle again.
    fn ended(&self, ep: &Epoll, i: usize, d: &Served, watch: &mut Watch) {
        *d.phase() = Phase::Idle;
        *d.control.lock().unwrap_or_else(|e| e.into_inner()) = None;
        d.connected.store(false, Relaxed);
        self.tell_status();
        if watch.listening.get(&i) == Some(&false) && !d.removing.load(Relaxed) {
            if let Err(e) = ep.modify(d.listener.as_raw_fd(), 2 * i as u64, libc::EPOLLIN) {
                tracing::error!(device = %d.spec.name, "cannot watch the socket again: {e}");
            } else {
                watch.listening.insert(i, true);
            }
        }
    }
}

const LAUNCHER: u64 = u64::MAX;
const WAKE: u64 = u64::MAX - 1;
/// How long a request to the launcher (a socket bound, a state opened or
/// removed) may take.
const ASK_WAIT: Duration = Duration::from_secs(30);

/// What the loop watches: each device's listener, by index, and whether
/// it is armed (false while a reconnecting frontend waits for its worker
/// to go).
#[derive(Default)]
struct Watch {
    listening: std::collections::HashMap<usize, bool>,
}

fn failed(d: &Served, why: String, ran: Duration) {
    d.failures.fetch_add(1, Relaxed);
    *d.last_failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    let mut b = d.backoff();
    let n = match *b {
        Some((n, _)) if ran < HEALTHY_AFTER => n + 1,
        _ => 1,
    };
    // A first failure costs only the reconnect; repeats wait, doubling.
    let wait = if n == 1 {
        Duration::ZERO
    } else {
        BACKOFF_FIRST
            .saturating_mul(1 << (n - 2).min(16))
            .min(BACKOFF_MAX)
    };
    tracing::warn!(device = %d.spec.name, failures = n, "next worker in {wait:?}");
    *b = Some((n, Instant::now() + wait));
}

/// Marks a device configured `incoming=` as waiting for its pages, if its
/// state is new or holds nothing; one left waiting by an earlier run (a
/// transfer cut short) waits again. A state that holds pages keeps them
/// and serves: receiving into it would drop them (`--fresh` starts empty).
pub fn set_incoming(name: &str, dev: &Device) {
    use vzram_store::cells::{MIGRATION_FAILED, MIGRATION_INCOMING, MIGRATION_RECEIVING};
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

/// Recovers a device from `files` (and its backing file) in this process
/// (the state stays locked by the supervisor's own descriptors).
fn attach(
    pool: &Arc<Pool>,
    spec: &DeviceSpec,
    files: &StateFiles,
    backing: Option<&BackingFile>,
    limit: u64,
) -> Result<Arc<Device>, String> {
    let files = files.try_clone().map_err(|e| e.to_string())?;
    let backing = backing.map(BackingFile::open).transpose()?;
    let mut dc = DeviceConfig::new(spec.size, spec.algo);
    dc.mem_limit = limit;
    dc.shards = usize::from(spec.queues);
    pool.attach_device(dc, files, backing)
        .map_err(|e| e.to_string())
}

/// Why a worker gave no answer to an order.
#[derive(Debug)]
enum Asked {
    /// Its channel broke: it was exiting (its frontend had left) or died.
    Gone(String),
    /// It did not answer within the wait.
    Silent,
}

impl std::fmt::Display for Asked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Asked::Gone(e) => write!(f, "worker: {e}"),
            Asked::Silent => write!(f, "the worker did not answer"),
        }
    }
}

/// Sends a worker an order and waits up to `wait` for its answer.
fn ask_worker(
    c: &UnixStream,
    order: &Order,
    fds: &[RawFd],
    wait: Duration,
) -> Result<Answer, Asked> {
    launcher::send(c, order, fds).map_err(|e| Asked::Gone(e.to_string()))?;
    match vzram_blk::guard::wait_fd(c.as_raw_fd(), libc::POLLIN, Some(wait)) {
        Ok(true) => {}
        Ok(false) => return Err(Asked::Silent),
        Err(e) => return Err(Asked::Gone(e.to_string())),
    }
    match launcher::recv::<Answer>(c) {
        Ok(Some((a, _))) => Ok(a),
        Ok(None) => Err(Asked::Gone("it went away".into())),
        Err(e) => Err(Asked::Gone(e.to_string())),
    }
}

fn unexpected(a: Answer) -> String {
    format!("unexpected answer from the worker: {a:?}")
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
        Ok(Epoll {
            // SAFETY: epoll::create returned a new descriptor we now own.
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
