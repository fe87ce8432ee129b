//! A configured device as the supervisor holds it: its socket, its
//! locked state and backing file, and what its worker is doing.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use vzram_store::{Backing, Cells, DeviceCells, StateFiles, StoreError};

use crate::config::DeviceSpec;
use crate::owner::migration::Listener;

/// Waits before the next worker of a device whose workers keep failing
/// (from the second failure in a row): doubling from the first, up to the
/// last.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A worker that served this long before failing starts the count afresh.
const HEALTHY_AFTER: Duration = Duration::from_secs(60);
/// A worker that ends cleanly is only worth its start (a fork and a whole
/// recovery) if it served a request and lived at least this long.
pub const USEFUL_LIFE: Duration = Duration::from_secs(1);
/// After a worker that was not worth its start, the next waits this many
/// times its life (so starts and recoveries take at most a quarter of the
/// time, whatever a frontend does), within these bounds.
const USELESS_WAIT_FACTOR: u32 = 3;
const USELESS_WAIT_MIN: Duration = Duration::from_millis(50);
const USELESS_WAIT_MAX: Duration = Duration::from_secs(5);
/// Restart lines of one device at most this often (the rest are counted).
const RESTART_LOG_EVERY: Duration = Duration::from_secs(10);

/// [`HEALTHY_AFTER`], or less when `VZRAM_HEALTHY_AFTER_MS` says so: a test
/// cannot let a worker serve for a minute before it kills it.
fn healthy_after() -> Duration {
    static AFTER: OnceLock<Duration> = OnceLock::new();
    *AFTER.get_or_init(|| {
        std::env::var("VZRAM_HEALTHY_AFTER_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(HEALTHY_AFTER, |ms| {
                HEALTHY_AFTER.min(Duration::from_millis(ms))
            })
    })
}

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
    pub(super) fn open(&self) -> Result<Backing, StoreError> {
        let file = self
            .file
            .try_clone()
            .map_err(|e| StoreError::backing(self.path.display(), e))?;
        Backing::from_file(file, self.path.clone(), self.direct)
    }
}

/// A configured device as the supervisor holds it.
pub struct Served {
    pub spec: DeviceSpec,
    pub(super) listener: UnixListener,
    /// The state, opened and locked once; each worker gets clones.
    pub(super) files: StateFiles,
    /// The backing file, if the device has one.
    pub backing: Option<BackingFile>,
    /// A SIGBUS on `cells` (its file truncated) gives a zero page and
    /// marks the device damaged instead of killing every device. Declared
    /// before `cells`, so it is unregistered before the mapping goes.
    pub stats_guard: Option<crate::sys::fault::Guarded>,
    pub cells: Cells<DeviceCells>,
    /// Workers started so far, and those that ended badly.
    pub workers: AtomicU64,
    pub failures: AtomicU64,
    pub connected: AtomicBool,
    pub(super) phase: Mutex<Phase>,
    /// Last abnormal end of a worker, for `vzram stat`.
    pub(super) last_failure: Mutex<Option<String>>,
    /// The control channel of the running worker, for orders. Dropping it
    /// (once no order holds a reference) ends the worker. An order holds
    /// its own reference and not this lock, so that the loop, `remove` and
    /// `stop` never wait for a long writeback.
    pub(super) control: Mutex<Option<Arc<UnixStream>>>,
    /// One order at a time on the channel, so answers match their orders.
    pub(super) ordering: Mutex<()>,
    /// Consecutive failures and when the next worker may start.
    pub(super) backoff: Mutex<Option<(u32, Instant)>>,
    /// Added at run time (`vzram add`): its socket is the launcher's to remove.
    pub added: bool,
    /// Being removed: the loop lets go of it.
    pub(super) removing: AtomicBool,
    /// Worker ends that were not a useful clean end, by [`Restart`].
    pub restarts: [AtomicU64; Restart::ALL.len()],
    /// Clients closed before any worker because their first message was
    /// not a vhost-user request.
    pub refused_clients: AtomicU64,
    /// When a restart was last logged, and how many were not since.
    restart_log: Mutex<(Option<Instant>, u64)>,
    /// Its migrations, in and out.
    pub migration: MigrationSlot,
}

/// A device's migrations as the supervisor tracks them: one `vzram
/// migrate` at a time, the incoming listener until its thread takes it,
/// the stream arriving, and why the last move failed.
#[derive(Default)]
pub struct MigrationSlot {
    sending: AtomicBool,
    listener: Mutex<Option<Listener>>,
    /// A copy of the arriving stream's socket, so `reset` and `remove` can
    /// cut it.
    arriving: Mutex<Option<OwnedFd>>,
    error: Mutex<Option<String>>,
}

/// A `vzram migrate` of the device under way; it ends when this drops.
pub struct Sending<'a>(&'a AtomicBool);

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        self.0.store(false, Relaxed);
    }
}

impl MigrationSlot {
    /// The device's send, unless one is under way already.
    pub fn begin_send(&self) -> Option<Sending<'_>> {
        (!self.sending.swap(true, Relaxed)).then_some(Sending(&self.sending))
    }

    pub fn sending(&self) -> bool {
        self.sending.load(Relaxed)
    }

    pub fn set_listener(&self, l: Option<Listener>) {
        *lock(&self.listener) = l;
    }

    /// The incoming listener, for the thread that accepts on it.
    pub fn take_listener(&self) -> Option<Listener> {
        lock(&self.listener).take()
    }

    /// A stream arrives (Some) or has ended (None).
    pub fn set_arriving(&self, stream: Option<OwnedFd>) {
        *lock(&self.arriving) = stream;
    }

    pub fn arriving(&self) -> bool {
        lock(&self.arriving).is_some()
    }

    /// Shuts the arriving stream down, if there is one: its receiver's
    /// next read or write fails and it undoes what it applied.
    pub fn cut(&self) -> bool {
        let arriving = lock(&self.arriving);
        let Some(fd) = arriving.as_ref() else {
            return false;
        };
        // SAFETY: shutdown of a socket we own a descriptor of.
        unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
        true
    }

    /// Why the last move failed, for `vzram stat`.
    pub fn error(&self) -> Option<String> {
        lock(&self.error).clone()
    }

    pub fn set_error(&self, e: Option<String>) {
        *lock(&self.error) = e;
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) enum Phase {
    Idle,
    /// A connection waiting to say something (or for a backoff to end).
    Pending {
        conn: UnixStream,
        since: Instant,
        /// Since when part of its first header is there (the rest must
        /// follow soon).
        partial: Option<Instant>,
    },
    /// A worker serves it (or is being started). `frontend` is our copy of
    /// its connection, to tell a reconnect from a second frontend.
    Running {
        id: u64,
        pid: Option<u32>,
        frontend: Option<UnixStream>,
        started: Instant,
        /// Requests the device had served when the worker started.
        served_before: u64,
        /// Since when another client waits in the backlog while our
        /// frontend still looks connected.
        contender: Option<Instant>,
    },
    /// The supervisor itself holds the device (compacting, resetting or
    /// tiering one that has no frontend).
    Busy,
}

impl Served {
    pub fn new(
        spec: DeviceSpec,
        listener: UnixListener,
        files: StateFiles,
        backing: Option<BackingFile>,
    ) -> Result<Served, StoreError> {
        let cells = Cells::<DeviceCells>::shared(&files.stats)?;
        let (ptr, len) = cells.mapping();
        let stats_guard = crate::sys::fault::register(ptr, len, &files.dir.join("stats"), true);
        // Counted per daemon run (the worker adds to it).
        cells.connections.store(0, Relaxed);
        Ok(Served {
            spec,
            listener,
            files,
            backing,
            stats_guard,
            cells,
            workers: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            connected: AtomicBool::new(false),
            phase: Mutex::new(Phase::Idle),
            last_failure: Mutex::new(None),
            control: Mutex::new(None),
            ordering: Mutex::new(()),
            backoff: Mutex::new(None),
            restarts: Default::default(),
            refused_clients: AtomicU64::new(0),
            restart_log: Mutex::new((None, 0)),
            added: false,
            removing: AtomicBool::new(false),
            migration: MigrationSlot::default(),
        })
    }

    /// Gives an incoming device its listener (taken by
    /// [`Supervisor::start_incoming`]).
    pub fn with_incoming(self, l: Option<Listener>) -> Served {
        self.migration.set_listener(l);
        self
    }

    pub fn state_dir(&self) -> &std::path::Path {
        &self.files.dir
    }

    pub fn state_bytes(&self) -> u64 {
        self.files.bytes()
    }

    /// The frontend connected (or connecting) to the device, as a refusal
    /// names it: its process, by the socket's peer credentials, and since
    /// when. None while no frontend is there.
    pub(super) fn frontend(&self) -> Option<String> {
        self.frontend_in(&self.phase())
    }

    /// [`Served::frontend`] under a phase lock the caller holds.
    pub(super) fn frontend_in(&self, ph: &Phase) -> Option<String> {
        let (conn, since, how) = match ph {
            Phase::Running {
                frontend: Some(f),
                started,
                ..
            } => (f, *started, "connected"),
            Phase::Pending { conn, since, .. } => (conn, *since, "connecting"),
            _ => return None,
        };
        // One that has hung up is going: its worker ends by itself.
        if crate::sys::socket::hung_up(std::os::fd::AsRawFd::as_raw_fd(conn)) {
            return None;
        }
        let who = match peer(conn) {
            Some((pid, uid)) => format!("frontend pid {pid} (uid {uid})"),
            None => "a frontend".to_string(),
        };
        Some(format!(
            "{who} on {}, {how} for {}s",
            self.spec.socket.display(),
            since.elapsed().as_secs()
        ))
    }

    pub(super) fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn backoff(&self) -> MutexGuard<'_, Option<(u32, Instant)>> {
        self.backoff.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn backing_off(&self) -> bool {
        self.backoff()
            .is_some_and(|(_, until)| Instant::now() < until)
    }

    /// Requests served so far (reads, writes and discards), from the
    /// shared counters.
    pub(super) fn requests_served(&self) -> u64 {
        self.cells.latencies().iter().map(|(_, l)| l.count).sum()
    }

    /// Counts a restart and logs it. Failures are logged each time (their
    /// backoff doubles, so a crash loop logs a line per 30 s at most); the
    /// short clean ends a frontend can cause at will, at most once per
    /// [`RESTART_LOG_EVERY`] for the device, with a count of the rest.
    fn note_restart(&self, why: Restart, line: &str) {
        self.restarts[why as usize].fetch_add(1, Relaxed);
        if why != Restart::Short {
            tracing::error!(device = %self.spec.name, reason = why.name(), "{line}");
            return;
        }
        let mut log = self.restart_log.lock().unwrap_or_else(|e| e.into_inner());
        if log.0.is_some_and(|t| t.elapsed() < RESTART_LOG_EVERY) {
            log.1 += 1;
            return;
        }
        let quiet = std::mem::take(&mut log.1);
        log.0 = Some(Instant::now());
        drop(log);
        if quiet > 0 {
            tracing::info!(device = %self.spec.name, reason = why.name(), "{line} ({quiet} more like it not logged)");
        } else {
            tracing::info!(device = %self.spec.name, reason = why.name(), "{line}");
        }
    }
}

/// The process and user at the other end of `s` (SO_PEERCRED).
fn peer(s: &UnixStream) -> Option<(i32, u32)> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which we own.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some((cred.pid, cred.uid))
}

/// Why a device's worker ended other than by serving and leaving cleanly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restart {
    /// It ended cleanly but served nothing or lived under [`USEFUL_LIFE`].
    Short,
    /// It exited with an error code.
    Error,
    /// A signal killed it.
    Signal,
    /// It could not be started.
    StartFailed,
}

impl Restart {
    pub const ALL: [Restart; 4] = [
        Restart::Short,
        Restart::Error,
        Restart::Signal,
        Restart::StartFailed,
    ];

    /// The `reason` label of `vzram_worker_restarts_total`.
    pub fn name(self) -> &'static str {
        match self {
            Restart::Short => "short",
            Restart::Error => "error",
            Restart::Signal => "signal",
            Restart::StartFailed => "start_failed",
        }
    }
}

/// A worker ended cleanly: if it served requests for long enough the
/// backoff starts afresh; if not (a frontend that sets up and leaves, in a
/// loop) its start was mostly a recovery, and the next waits three times
/// as long as it lived, so one tenant cannot keep a core busy recovering.
/// Returns the wait, if any.
pub fn ended_cleanly(d: &Served, ran: Duration, served: u64) -> Option<Duration> {
    let mut b = d.backoff();
    if served > 0 && ran >= USEFUL_LIFE {
        *b = None;
        return None;
    }
    let wait = ran
        .saturating_mul(USELESS_WAIT_FACTOR)
        .clamp(USELESS_WAIT_MIN, USELESS_WAIT_MAX);
    // The failure count stays as it was: an error before still counts.
    let n = b.map_or(0, |(n, _)| n);
    *b = Some((n, Instant::now() + wait));
    drop(b);
    d.note_restart(
        Restart::Short,
        &format!(
            "the worker ended after {ran:.1?} having served {served} requests; next worker in {wait:?}"
        ),
    );
    Some(wait)
}

/// Counts a worker's bad end and sets when the next may start: a first
/// failure costs only the reconnect, repeats wait, doubling.
pub fn failed(d: &Served, kind: Restart, why: String, ran: Duration) {
    d.failures.fetch_add(1, Relaxed);
    *d.last_failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.clone());
    let mut b = d.backoff();
    let n = match *b {
        Some((n, _)) if ran < healthy_after() => n + 1,
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
    *b = Some((n, Instant::now() + wait));
    drop(b);
    d.note_restart(
        kind,
        &format!(
            "{why}; the device's state is kept; {n} failures in a row, next worker in {wait:?}"
        ),
    );
}

#[cfg(test)]
mod migration_slot_tests {
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    use super::MigrationSlot;

    #[test]
    fn one_send_at_a_time_until_the_first_ends() {
        let m = MigrationSlot::default();
        let first = m.begin_send().expect("the first send");
        assert!(m.sending());
        assert!(m.begin_send().is_none(), "a second send while one runs");
        drop(first);
        assert!(!m.sending());
        assert!(m.begin_send().is_some());
    }

    #[test]
    fn a_cut_ends_the_arriving_stream_for_its_sender() {
        let m = MigrationSlot::default();
        assert!(!m.cut(), "nothing arrives");
        let (ours, mut sender) = UnixStream::pair().unwrap();
        m.set_arriving(Some(ours.into()));
        assert!(m.arriving());
        assert!(m.cut());
        let mut buf = [0u8; 1];
        assert_eq!(sender.read(&mut buf).unwrap(), 0, "the sender sees the end");
        m.set_arriving(None);
        assert!(!m.arriving());
    }
}
