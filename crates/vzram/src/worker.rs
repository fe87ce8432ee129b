//! A worker: the process that serves one frontend connection of one device.
//!
//! The supervisor accepts the connection and has the launcher start
//! `vzram __worker SPEC` with these descriptors (see [`Fds`]): its control
//! channel, the host budget, the device's locked state files, the
//! connection and, for a device with one, its backing file. Nothing is
//! opened by path. The worker recovers the device
//! from its slot table, installs its own seccomp filter, and relays the
//! frontend's messages through the guard to the `vhost` crate until the
//! frontend leaves; then it exits. It maps this one guest's memory and this
//! one device's state: a fault here costs this VM a reconnect, no one else.

use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vhost::vhost_user::{Error as VhostUserError, Listener};
use vhost_user_backend::{Error as DaemonError, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vzram_blk::guard::{self, Guard, Message, Received};
use vzram_blk::{BlkBackend, BlkDevice, CompressPool};
use vzram_store::{
    Backing, Device, DeviceConfig, Filter, Pool, PoolConfig, StateFiles, StoreError,
};

use crate::config::SeccompMode;
use crate::launcher::{self, FIRST_FD};
use crate::seccomp;

/// How long a frontend may take to finish a message it has started.
const MESSAGE_WAIT: Duration = Duration::from_secs(5);
/// How often the worker publishes the gauges only it can measure.
const PUBLISH_EVERY: Duration = Duration::from_secs(1);
/// Auto-compaction inside the worker, as the daemon always did.
const COMPACT_INTERVAL: Duration = Duration::from_secs(10);
pub const COMPACT_WASTE_RATIO: f64 = 0.25;
pub const COMPACT_MIN_WASTE: u64 = 16 << 20;

/// Background tiering (`--auto-writeback`, `--auto-recompress`) works in
/// batches of this many pages with a pause after each: at most 4 MiB per
/// 100 ms (40 MiB/s) of writeback or recompression, so the queues keep the
/// CPU and the disk for the guest, and a write that must spill waits for
/// one batch at most.
pub const AUTO_BATCH_PAGES: u64 = 1024;
pub const AUTO_PAUSE: Duration = Duration::from_millis(100);

/// Exit codes the supervisor tells apart.
pub const EXIT_DONE: i32 = 0;
pub const EXIT_SETUP: i32 = 1;
/// The device's state is damaged or does not match: retrying cannot help.
pub const EXIT_STATE: i32 = 2;

/// What a worker is told on its command line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Spec {
    pub name: String,
    pub size: u64,
    pub queues: u16,
    pub algo: String,
    pub serial: String,
    pub readonly: bool,
    pub mem_limit: u64,
    /// The state directory, for messages only (the files come as descriptors).
    pub state_dir: PathBuf,
    pub seccomp: String,
    pub log_level: String,
    /// Compress-pool threads (capped at the cores); None: the cores, at
    /// most 4.
    #[serde(default)]
    pub compress_threads: Option<usize>,
    /// Longest poll of a ring that ran dry, in µs; None: the default.
    #[serde(default)]
    pub poll_us: Option<u64>,
    /// The backing file comes as descriptor [`Fds::Backing`] when set.
    pub backing: Option<BackingSpec>,
    pub tier: TierSettings,
}

/// The backing file handed over: its path (for messages and stats) and
/// whether it was opened with O_DIRECT.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BackingSpec {
    pub path: PathBuf,
    pub direct: bool,
}

/// The automatic tiering a worker runs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TierSettings {
    /// The ager runs every third of this (milliseconds); None: no ager.
    pub idle_after_ms: Option<u64>,
    pub auto_writeback: bool,
    pub auto_recompress: bool,
    pub recompress_algo: String,
}

/// The order of the inherited descriptors, from [`FIRST_FD`].
pub enum Fds {
    Control = 0,
    Host,
    Lock,
    Table,
    Arena,
    Stats,
    Frontend,
    /// Only when the spec names a backing file.
    Backing,
}

/// Which pages a writeback or recompression takes ([`Filter`], as it
/// travels).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierFilter {
    pub idle: bool,
    pub cold: bool,
    pub huge: bool,
    pub incompressible: bool,
}

impl From<TierFilter> for Filter {
    fn from(f: TierFilter) -> Filter {
        Filter {
            idle: f.idle,
            cold: f.cold,
            huge: f.huge,
            incompressible: f.incompressible,
        }
    }
}

/// Messages on the control channel, supervisor to worker. The supervisor
/// runs the same orders itself ([`execute`]) on a device no worker serves.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Order {
    Compact,
    MarkIdle,
    Recompress {
        filter: TierFilter,
        algo: String,
    },
    Writeback {
        filter: TierFilter,
        max_pages: Option<u64>,
    },
    /// Receive the device's pages from the migration connection sent along.
    Receive,
    /// Send the device's pages over the migration connection sent along,
    /// until the frontend stops; then drop them unless `keep`.
    Send {
        keep: bool,
    },
    /// An incoming device gives up waiting: it starts empty and serves.
    ResetIncoming,
}

/// And back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    Compacted {
        pages: u64,
    },
    MarkedIdle {
        pages: u64,
    },
    Recompressed {
        tried: u64,
        pages: u64,
        saved_bytes: u64,
        freed_bytes: u64,
    },
    WrittenBack {
        pages: u64,
        freed_bytes: u64,
    },
    Received {
        pages: u64,
        bytes: u64,
        records: u64,
        passes: u32,
        micros: u64,
    },
    Sent {
        pages: u64,
        bytes: u64,
        records: u64,
        passes: u32,
        final_records: u64,
        final_micros: u64,
        total_micros: u64,
    },
    IncomingReset {
        pages: u64,
    },
    /// The order was carried out as far as it went and failed there (a
    /// full backing file, an I/O error): what was done stays done.
    Failed {
        error: String,
    },
}

/// What the migration orders need besides the device: the connection
/// that came with the order, whether the device is quiet, and the gate to
/// open once an incoming device has its pages.
pub struct Migrating<'a> {
    pub conn: Option<OwnedFd>,
    pub quiet: &'a dyn Fn() -> bool,
    pub open_gate: &'a dyn Fn(),
}

/// Carries out a migration order on `dev`, here.
pub fn execute_migration(dev: &Device, order: &Order, m: Migrating<'_>) -> Answer {
    let failed = |error: String| Answer::Failed { error };
    let answer = match order {
        Order::Receive | Order::Send { .. } if m.conn.is_none() => {
            failed("no migration connection came with the order".into())
        }
        Order::Receive => {
            let conn = crate::migration::Conn::new(m.conn.expect("checked"));
            let r = crate::migration::receive(dev, &conn, &|| {});
            // Committed even if the source's confirmation was lost.
            if !dev.cells().migration.incoming() {
                (m.open_gate)();
            }
            match r {
                Ok(r) => Answer::Received {
                    pages: r.pages,
                    bytes: r.bytes,
                    records: r.records,
                    passes: r.passes,
                    micros: r.micros,
                },
                Err(e) => failed(e),
            }
        }
        Order::Send { keep } => {
            let conn = crate::migration::Conn::new(m.conn.expect("checked"));
            match crate::migration::send(dev, &conn, m.quiet, *keep) {
                Ok(r) => Answer::Sent {
                    pages: r.pages,
                    bytes: r.bytes,
                    records: r.records,
                    passes: r.passes,
                    final_records: r.final_records,
                    final_micros: r.final_micros,
                    total_micros: r.total_micros,
                },
                Err(e) => failed(e),
            }
        }
        Order::ResetIncoming => {
            let mig = &dev.cells().migration;
            if mig.state.load(Relaxed) == vzram_store::cells::MIGRATION_RECEIVING {
                failed("a migration stream is arriving; reset it once it has failed".into())
            } else {
                let pages = dev.stats().orig_data_size / vzram_store::PAGE_SIZE as u64;
                match vzram_store::migrate::empty(dev, &mut vzram_store::Context::new(0)) {
                    Ok(()) => {
                        mig.state.store(vzram_store::cells::MIGRATION_NONE, Relaxed);
                        (m.open_gate)();
                        Answer::IncomingReset { pages }
                    }
                    Err(e) => failed(e.to_string()),
                }
            }
        }
        o => execute(dev, o),
    };
    dev.stats();
    answer
}

/// Carries out an order on `dev`, here.
pub fn execute(dev: &Device, order: &Order) -> Answer {
    let answer = match order {
        Order::Compact => Answer::Compacted {
            pages: dev.compact(),
        },
        Order::MarkIdle => Answer::MarkedIdle {
            pages: dev.mark_idle(),
        },
        Order::Recompress { filter, algo } => match crate::config::parse_codec(algo) {
            Err(e) => Answer::Failed { error: e },
            Ok(codec) => match dev.recompress((*filter).into(), codec) {
                Ok(r) => Answer::Recompressed {
                    tried: r.tried,
                    pages: r.pages,
                    saved_bytes: r.saved_bytes,
                    freed_bytes: r.freed_bytes,
                },
                Err(e) => Answer::Failed {
                    error: e.to_string(),
                },
            },
        },
        Order::Writeback { filter, max_pages } => {
            match dev.writeback((*filter).into(), *max_pages) {
                Ok(r) => Answer::WrittenBack {
                    pages: r.pages,
                    freed_bytes: r.freed_bytes,
                },
                Err(e) => Answer::Failed {
                    error: e.to_string(),
                },
            }
        }
        Order::Receive | Order::Send { .. } | Order::ResetIncoming => {
            return execute_migration(
                dev,
                order,
                Migrating {
                    conn: None,
                    quiet: &|| true,
                    open_gate: &|| {},
                },
            )
        }
    };
    // The counters the supervisor shows are current once it answers.
    dev.stats();
    answer
}

fn take(fd: Fds) -> OwnedFd {
    // SAFETY: the launcher placed our descriptors at FIRST_FD.. in the
    // order of `Fds`; each is taken once.
    unsafe { OwnedFd::from_raw_fd(FIRST_FD + fd as RawFd) }
}

/// `vzram __worker SPEC`: returns the process exit code.
pub fn main(spec_json: &str) -> i32 {
    let spec: Spec = match serde_json::from_str(spec_json) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vzram worker: bad spec: {e}");
            return EXIT_SETUP;
        }
    };
    init_logging(&spec.log_level);
    let span = tracing::info_span!("worker", device = %spec.name);
    let _enter = span.enter();
    // SAFETY: ignoring signals changes no memory. The supervisor ends a
    // worker by closing its control channel, not the terminal.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
    }
    match serve(&spec) {
        Ok(()) => EXIT_DONE,
        Err(WorkerError::State(e)) => {
            tracing::error!("{e}");
            EXIT_STATE
        }
        Err(WorkerError::Setup(e)) => {
            tracing::error!("{e}");
            EXIT_SETUP
        }
    }
}

enum WorkerError {
    State(String),
    Setup(String),
}

impl From<StoreError> for WorkerError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::State(_) | StoreError::InvalidConfig(_) => {
                WorkerError::State(e.to_string())
            }
            e => WorkerError::Setup(e.to_string()),
        }
    }
}

fn setup(what: &str) -> impl FnOnce(io::Error) -> WorkerError + '_ {
    move |e| WorkerError::Setup(format!("{what}: {e}"))
}

fn serve(spec: &Spec) -> Result<(), WorkerError> {
    seccomp::report_sigbus().map_err(|e| WorkerError::Setup(e.to_string()))?;
    let control = UnixStream::from(take(Fds::Control));
    let host = std::fs::File::from(take(Fds::Host));
    let files = StateFiles::from_files(
        spec.state_dir.clone(),
        take(Fds::Lock).into(),
        take(Fds::Table).into(),
        take(Fds::Arena).into(),
        take(Fds::Stats).into(),
        spec.size,
    )?;
    let backing = match &spec.backing {
        Some(b) => Some(Backing::from_file(
            take(Fds::Backing).into(),
            b.path.clone(),
            b.direct,
        )?),
        None => None,
    };
    let codec = crate::config::parse_codec(&spec.algo).map_err(WorkerError::Setup)?;
    let pool = Pool::with_host_file(PoolConfig::default(), &host)?;
    let mut dc = DeviceConfig::new(spec.size, codec);
    dc.mem_limit = spec.mem_limit;
    // The supervisor sized the state's arena for one allocator shard per
    // queue; the pool threads share those (their contexts wrap around).
    dc.shards = usize::from(spec.queues);
    let store = pool.attach_device(dc, files, backing)?;
    if let Some(r) = store.recovery() {
        tracing::info!(
            pages = r.slots,
            spans = r.spans,
            cut_short = r.unlocked,
            ms = r.micros as f64 / 1000.0,
            "recovered the device from its state"
        );
    }
    let frontend = UnixStream::from(take(Fds::Frontend));

    let blk = Arc::new(BlkDevice::new(
        store.clone(),
        spec.queues,
        spec.readonly,
        &spec.serial,
    ));
    // One pool per process: this worker serves one device, so its threads
    // compress for this device's queues only.
    let threads = vzram_blk::pool::pool_threads(spec.compress_threads);
    let compress = Some(CompressPool::new(threads, 0).map_err(setup("thread"))?);
    // An incoming device serves nothing until its pages have arrived.
    let gated = store.cells().migration.incoming();
    if gated {
        tracing::info!("waiting for the device's pages (incoming migration): requests wait");
    }
    let poll = spec.poll_us.map_or(
        vzram_blk::poll::DEFAULT_POLL,
        std::time::Duration::from_micros,
    );
    let backend = Arc::new(
        if gated {
            BlkBackend::new_gated(blk, compress)
        } else {
            BlkBackend::with_pool(blk, compress)
        }
        .with_poll(poll),
    );
    let rings = Arc::new(Rings::default());
    let busy = Arc::new(std::sync::Mutex::new(()));
    // However this returns (set-up errors included), the order lock is
    // taken on the way out and kept until the process ends: an order under
    // way finishes (a migration's last delta is sent once the frontend is
    // gone), and none starts only to be cut short by the exit; the
    // supervisor sees the channel close and carries the order out itself.
    let quiesce = Quiesce(busy.clone());
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<vzram_blk::dirty::LogBitmap>::new());
    let mut daemon = VhostUserDaemon::new(format!("vhost-{}", spec.name), backend.clone(), mem)
        .map_err(|e| WorkerError::Setup(format!("vhost-user daemon: {e}")))?;
    // The crate accepts from a listener; ours has no name anyone else can
    // reach, and we connect before it accepts, so it finds us waiting.
    let mut inner = InnerSocket::new().map_err(setup("private socket"))?;
    let to_crate = inner.connect().map_err(setup("private socket"))?;
    daemon
        .start(&mut inner.listener)
        .map_err(|e| WorkerError::Setup(format!("vhost-user handler: {e}")))?;
    drop(inner);
    pool.spawn_auto_compaction(COMPACT_INTERVAL, COMPACT_WASTE_RATIO, COMPACT_MIN_WASTE)
        .map_err(setup("thread"))?;
    {
        let store = store.clone();
        let (backend, rings, busy) = (backend.clone(), rings.clone(), busy.clone());
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || control_loop(control, store, &backend, &rings, &busy))
            .map_err(setup("thread"))?;
    }
    if let Some(ms) = spec.tier.idle_after_ms {
        let auto = AutoTier::new(&spec.tier).map_err(WorkerError::Setup)?;
        let store = store.clone();
        let every = Duration::from_millis(ms / 3);
        std::thread::Builder::new()
            .name("ager".into())
            .spawn(move || auto.run(&store, every))
            .map_err(setup("thread"))?;
    }

    // Set-up done: nothing the frontend sends has been read yet.
    let mode: SeccompMode = spec.seccomp.parse().map_err(WorkerError::Setup)?;
    seccomp::install_worker(mode).map_err(|e| WorkerError::Setup(e.to_string()))?;

    let mut guard = Guard::new(
        vzram_blk::config::virtio_features(spec.readonly),
        vzram_blk::config::protocol_features(),
    );
    let end = match guarded_recv(&frontend, &mut guard) {
        Some(first) => {
            let n = store.cells().connections.fetch_add(1, Relaxed) + 1;
            tracing::info!(connection = n, "frontend connected");
            relay(&frontend, &to_crate, &mut guard, first, &rings)
        }
        None => "frontend left before its first message",
    };
    rings
        .disconnected
        .store(true, std::sync::atomic::Ordering::SeqCst);
    tracing::info!("frontend disconnected ({end}); data kept for the next one");
    let _ = to_crate.shutdown(std::net::Shutdown::Both);
    let _ = frontend.shutdown(std::net::Shutdown::Both);
    match daemon.wait() {
        Ok(())
        | Err(DaemonError::HandleRequest(
            VhostUserError::Disconnected | VhostUserError::PartialMessage,
        )) => {}
        Err(e) => tracing::debug!("vhost-user handler ended: {e}"),
    }
    // Leave the device compact for its idle time, and its gauges current.
    pool.compact_fragmented(COMPACT_WASTE_RATIO, COMPACT_MIN_WASTE);
    store.stats();
    // Before anything else of this connection is dropped, as an order under
    // way (a migration's last delta) may still be using the device.
    drop(quiesce);
    Ok(())
}

/// Takes the worker's order lock when dropped and never gives it back.
struct Quiesce(Arc<std::sync::Mutex<()>>);

impl Drop for Quiesce {
    fn drop(&mut self) {
        std::mem::forget(self.0.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

/// Which rings the frontend has started and not stopped, as the relay sees
/// its messages: a sender's "quiet". A ring is stopped once the handler has
/// answered its GET_VRING_BASE (it drains what it holds first).
#[derive(Default)]
pub struct Rings {
    pub disconnected: std::sync::atomic::AtomicBool,
    active: std::sync::atomic::AtomicU64,
    stopping: std::sync::atomic::AtomicU64,
}

impl Rings {
    /// Nothing can write: no frontend, or no ring running.
    pub fn quiet(&self) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        self.disconnected.load(SeqCst) || self.active.load(SeqCst) == 0
    }

    fn message(&self, m: &Message) {
        use std::sync::atomic::Ordering::SeqCst;
        let index = |n: usize| {
            m.payload
                .get(..n)
                .map(|b| b.iter().rev().fold(0u64, |a, &x| a << 8 | u64::from(x)))
        };
        match m.header.code {
            guard::code::SET_VRING_KICK => {
                if let Some(i) = index(8).map(|v| v & 0xff).filter(|&i| i < 64) {
                    self.active.fetch_or(1 << i, SeqCst);
                }
            }
            guard::code::GET_VRING_BASE => {
                if let Some(i) = index(4).filter(|&i| i < 64) {
                    self.stopping.fetch_or(1 << i, SeqCst);
                }
            }
            _ => {}
        }
    }

    /// The handler answered: the rings asked to stop are stopped.
    fn replied(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        let s = self.stopping.swap(0, SeqCst);
        if s != 0 {
            self.active.fetch_and(!s, SeqCst);
        }
    }
}

/// Answers the supervisor; publishes gauges meanwhile. The supervisor
/// closing the channel (it is stopping, or gone) ends the worker: the
/// device's state is in the shared files, so there is nothing to save.
fn control_loop(
    control: UnixStream,
    store: Arc<Device>,
    backend: &BlkBackend,
    rings: &Rings,
    busy: &std::sync::Mutex<()>,
) {
    loop {
        store.stats();
        match guard::wait_fd(control.as_raw_fd(), libc::POLLIN, Some(PUBLISH_EVERY)) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(_) => std::process::exit(EXIT_DONE),
        }
        match launcher::recv::<Order>(&control) {
            Ok(Some((order, mut fds))) => {
                let one = busy.lock().unwrap_or_else(|e| e.into_inner());
                let m = Migrating {
                    conn: fds.pop(),
                    quiet: &|| rings.quiet(),
                    open_gate: &|| {
                        tracing::info!("the device's pages are here: requests run");
                        backend.open_gate()
                    },
                };
                let answer = execute_migration(&store, &order, m);
                let sent = launcher::send(&control, &answer, &[]);
                drop(one);
                if sent.is_err() {
                    std::process::exit(EXIT_DONE);
                }
            }
            Ok(None) | Err(_) => {
                tracing::info!("the supervisor closed the control channel; stopping");
                std::process::exit(EXIT_DONE);
            }
        }
    }
}

/// The ager and what runs after each of its passes.
struct AutoTier {
    writeback: bool,
    recompress: Option<vzram_store::Codec>,
}

impl AutoTier {
    fn new(t: &TierSettings) -> Result<AutoTier, String> {
        Ok(AutoTier {
            writeback: t.auto_writeback,
            recompress: if t.auto_recompress {
                Some(crate::config::parse_codec(&t.recompress_algo)?)
            } else {
                None
            },
        })
    }

    /// Every `every`: one ager pass, then the paced passes over the pages
    /// it found cold. Ends with the process.
    fn run(&self, store: &Device, every: Duration) {
        let cold = Filter {
            cold: true,
            ..Filter::default()
        };
        // With recompression on, cold pages stay in memory in the smaller
        // codec; only those it cannot shrink go to disk.
        let to_disk = Filter {
            incompressible: self.recompress.is_some(),
            ..cold
        };
        loop {
            std::thread::sleep(every);
            let n = store.age();
            tracing::debug!(cold = n, "ager pass");
            if n == 0 {
                continue;
            }
            if let Some(codec) = self.recompress {
                let (mut pages, mut saved) = (0, 0);
                let done = paced(|| {
                    let r = store.recompress_some(cold, codec, Some(AUTO_BATCH_PAGES))?;
                    pages += r.pages;
                    saved += r.saved_bytes;
                    Ok(r.tried)
                });
                if pages > 0 {
                    tracing::info!(pages, saved_bytes = saved, "recompressed cold pages");
                }
                if let Err(e) = done {
                    tracing::warn!("background recompression stopped: {e}");
                }
            }
            if self.writeback {
                let mut pages = 0;
                let done = paced(|| {
                    let r = store.writeback(to_disk, Some(AUTO_BATCH_PAGES))?;
                    pages += r.pages;
                    Ok(r.pages)
                });
                if pages > 0 {
                    tracing::info!(pages, "wrote cold pages back");
                }
                if let Err(e) = done {
                    tracing::warn!("background writeback stopped: {e}");
                }
            }
            store.stats();
        }
    }
}

/// Runs `batch` until it does nothing (returns 0) or fails, pausing after
/// each batch that did something.
fn paced(mut batch: impl FnMut() -> Result<u64, StoreError>) -> Result<(), StoreError> {
    while batch()? > 0 {
        std::thread::sleep(AUTO_PAUSE);
    }
    Ok(())
}

fn init_logging(level: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

/// The socket the `vhost` crate accepts from. Only this worker connects to
/// it, through `/proc/self/fd`: its file is unlinked before it listens.
struct InnerSocket {
    listener: Listener,
    path: PathBuf,
    _file: OwnedFd,
}

impl InnerSocket {
    fn new() -> io::Result<InnerSocket> {
        let mut dir = std::env::temp_dir();
        let name = format!(".vzram-w{}-{:x}", std::process::id(), nanos());
        if dir.join(&name).as_os_str().len() > 100 {
            dir = PathBuf::from("/tmp");
        }
        let path = dir.join(name);
        // SAFETY: a new socket; its result is checked.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: we own the descriptor just created.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        let addr = sockaddr_un(&path)?;
        // SAFETY: addr is a valid sockaddr_un of the given length.
        let rc = unsafe {
            libc::bind(
                sock.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH)
            .open(&path);
        let _ = std::fs::remove_file(&path);
        let file: OwnedFd = file?.into();
        // Listening starts only now that the name is gone.
        // SAFETY: a bound socket we own.
        if unsafe { libc::listen(sock.as_raw_fd(), 1) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(InnerSocket {
            listener: Listener::from(UnixListener::from(sock)),
            path: PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd())),
            _file: file,
        })
    }

    fn connect(&self) -> io::Result<UnixStream> {
        UnixStream::connect(&self.path)
    }
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

fn sockaddr_un(path: &std::path::Path) -> io::Result<libc::sockaddr_un> {
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Ok(addr)
}

/// Reads one frontend message through the guard; None when the frontend
/// is gone or was refused (logged here).
fn guarded_recv(frontend: &UnixStream, guard: &mut Guard) -> Option<Message> {
    match guard::recv_message(frontend, guard, MESSAGE_WAIT) {
        Ok(Received::Message(m)) => Some(m),
        Ok(Received::Closed) => None,
        Ok(Received::Refused(r)) => {
            tracing::warn!("refused a frontend message and closed the connection: {r}");
            None
        }
        Err(e) => {
            tracing::info!("frontend connection: {e}");
            None
        }
    }
}

/// Moves messages both ways until either side closes; returns why it ended.
fn relay(
    frontend: &UnixStream,
    to_crate: &UnixStream,
    guard: &mut Guard,
    first: Message,
    rings: &Rings,
) -> &'static str {
    rings.message(&first);
    if guard::send_message(to_crate, &first).is_err() {
        return "handler gone";
    }
    drop(first);
    let mut buf = [0u8; guard::MAX_PAYLOAD + guard::HEADER_LEN];
    loop {
        let mut p = [frontend.as_raw_fd(), to_crate.as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: two pollfds we own for the whole call.
        let rc = unsafe { libc::poll(p.as_mut_ptr(), 2, -1) };
        if rc < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return "poll failed";
        }
        if p[1].revents != 0 {
            // Replies carry no descriptors for the features we offer.
            match (&*to_crate).read(&mut buf) {
                Ok(0) | Err(_) => return "handler closed the connection",
                Ok(n) => {
                    rings.replied();
                    if guard::send_all(frontend.as_raw_fd(), &buf[..n], &[], Some(MESSAGE_WAIT))
                        .is_err()
                    {
                        return "frontend stopped reading";
                    }
                }
            }
        }
        if p[0].revents != 0 {
            match guarded_recv(frontend, guard) {
                Some(m) => {
                    rings.message(&m);
                    if guard::send_message(to_crate, &m).is_err() {
                        return "handler closed the connection";
                    }
                }
                None => return "frontend closed or refused",
            }
        }
    }
}
