//! A worker: the process that serves one frontend connection of one device.
//!
//! The supervisor accepts the connection and has the launcher start
//! `vzram __worker SPEC` with these descriptors (see [`WorkerFds`]): its control
//! channel, the host budget, the device's locked state files, the
//! connection and, for a device with one, its backing file. Nothing is
//! opened by path. The worker recovers the device
//! from its slot table, installs its own seccomp filter, and relays the
//! frontend's messages through the guard ([`relay`]) to the `vhost` crate
//! until the frontend leaves; then it exits. It maps this one guest's
//! memory and this one device's state: a fault here costs this VM a
//! reconnect, no one else.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use vhost::vhost_user::Error as VhostUserError;
use vhost_user_backend::{Error as DaemonError, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vzram_blk::guard::{self, Guard};
use vzram_blk::{BlkBackend, BlkDevice, CompressPool};
use vzram_store::{Backing, Device, Pool, PoolConfig, StateFiles, StoreError};

use crate::owner::attach::device_config;
use crate::owner::autotier::AutoTier;
use crate::owner::execute::{execute_migration, Migrating};
use crate::owner::migration::Frontend;
use crate::proto::order::Order;
use crate::proto::wire;
use crate::proto::worker_spec::{Spec, WorkerFds, EXIT_DONE, EXIT_SETUP, EXIT_STATE};
use crate::sys::{logging, seccomp};
use relay::{guarded_recv, relay, InnerSocket, Rings};

mod relay;

/// How often the worker publishes the gauges only it can measure.
const PUBLISH_EVERY: Duration = Duration::from_secs(1);
/// Auto-compaction inside the worker, as the daemon always did.
const COMPACT_INTERVAL: Duration = Duration::from_secs(10);
pub const COMPACT_WASTE_RATIO: f64 = 0.25;
pub const COMPACT_MIN_WASTE: u64 = 16 << 20;
/// The exit code of a worker that panicked, on any thread (Rust's own for
/// a panic in `main`). Not [`EXIT_DONE`], so the supervisor counts it as a
/// failure: the device's next frontend gets a new worker, after a backoff
/// if it keeps failing.
pub const EXIT_PANIC: i32 = 101;

/// `vzram __worker SPEC`: returns the process exit code.
pub fn main(spec_json: &str) -> i32 {
    let spec: Spec = match serde_json::from_str(spec_json) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vzram worker: bad spec: {e}");
            return EXIT_SETUP;
        }
    };
    logging::init(spec.log_level, spec.log_format);
    exit_on_panic();
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
        Err(e) => {
            tracing::error!("{e}");
            e.exit_code()
        }
    }
}

/// Makes a panic on any thread end the worker: a queue thread that died
/// would leave its queue wedged and the frontend waiting forever, while a
/// new worker recovers the device from its shared state and the frontend
/// reconnects.
fn exit_on_panic() {
    crate::sys::panic::exit_on_panic(
        "the worker panicked; exiting with code 101 for a new one",
        EXIT_PANIC,
    );
}

/// Why a worker could not serve: its exit code tells the supervisor
/// whether a retry can help.
#[derive(Debug, thiserror::Error)]
enum WorkerError {
    /// The device's state is damaged or does not match ([`EXIT_STATE`]).
    #[error(transparent)]
    State(StoreError),
    #[error(transparent)]
    Store(StoreError),
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Seccomp(#[from] seccomp::Error),
    #[error(transparent)]
    Signals(#[from] crate::sys::signals::HandlerError),
    /// (The crate's error is no `std::error::Error`: kept, not chained.)
    #[error("vhost-user daemon: {0}")]
    Daemon(DaemonError),
    #[error("vhost-user handler: {0}")]
    Handler(DaemonError),
}

impl WorkerError {
    fn exit_code(&self) -> i32 {
        match self {
            WorkerError::State(_) => EXIT_STATE,
            WorkerError::Store(_)
            | WorkerError::Io { .. }
            | WorkerError::Seccomp(_)
            | WorkerError::Signals(_)
            | WorkerError::Daemon(_)
            | WorkerError::Handler(_) => EXIT_SETUP,
        }
    }
}

impl From<StoreError> for WorkerError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::State(_) | StoreError::InvalidConfig(_) => WorkerError::State(e),
            e => WorkerError::Store(e),
        }
    }
}

fn setup(what: &'static str) -> impl FnOnce(io::Error) -> WorkerError {
    move |source| WorkerError::Io { what, source }
}

fn serve(spec: &Spec) -> Result<(), WorkerError> {
    crate::sys::fault::report_sigbus()?;
    // SAFETY: this is the worker, and `serve` runs once: the launcher
    // placed the list the supervisor sent for this spec.
    let fds = unsafe { WorkerFds::inherited(spec.backing.is_some()) };
    let control = UnixStream::from(fds.control);
    let host = std::fs::File::from(fds.host);
    let files = StateFiles::from_files(
        spec.state_dir.clone(),
        fds.lock.into(),
        fds.table.into(),
        fds.arena.into(),
        fds.stats.into(),
        spec.size,
    )?;
    let backing = match (&spec.backing, fds.backing) {
        (Some(b), Some(fd)) => Some(Backing::from_file(fd.into(), b.path.clone(), b.direct)?),
        _ => None,
    };
    let pool = Pool::with_host_file(PoolConfig::default(), &host)?;
    // The supervisor sized the state's arena for one allocator shard per
    // queue; the pool threads share those (their contexts wrap around).
    let dc = device_config(spec.size, spec.algo, spec.queues, spec.mem_limit);
    let store = pool.attach_device(dc, files, backing)?;
    // A SIGBUS in the state's files names the file (unregistered before
    // `store` unmaps them: declared after it).
    let _named: Vec<crate::sys::fault::Guarded> = match store.state_files() {
        Some(st) => store
            .state_mappings()
            .iter()
            .filter_map(|&(name, p, len)| {
                crate::sys::fault::register(p, len, &st.dir.join(name), false)
            })
            .collect(),
        None => Vec::new(),
    };
    if let Some(r) = store.recovery() {
        tracing::info!(
            pages = r.slots,
            spans = r.spans,
            cut_short = r.unlocked,
            staged = r.staged,
            ms = r.micros as f64 / 1000.0,
            "recovered the device from its state"
        );
    }
    let frontend = UnixStream::from(fds.frontend);

    let blk = Arc::new(
        BlkDevice::new(store.clone(), spec.queues, spec.readonly, &spec.serial)
            .with_dwz_segments(u32::from(spec.discard_segments)),
    );
    // One pool per process: this worker serves one device, so its threads
    // compress for this device's queues only.
    let threads = vzram_blk::pool::pool_threads(spec.compress_threads);
    let compress = CompressPool::new(threads, 0).map_err(setup("thread"))?;
    let poll = spec.poll_us.map_or(
        vzram_blk::poll::DEFAULT_POLL,
        std::time::Duration::from_micros,
    );
    // `--poll-us 0` asks for no polling at all: queue and pool threads
    // then sleep at once when they wait for pages or work.
    compress.set_spin(poll);
    // The queue and compress threads serve requests under a narrower
    // filter than the rest, each put on itself before its first request
    // (after the process filter, installed below).
    let backing_fd = store.backing().map(|b| b.file().as_raw_fd());
    let narrow = seccomp::QueueFilter::new(spec.seccomp, backing_fd, store.arena_fd())?
        .map(|f| -> vzram_blk::ThreadHook { Arc::new(move || f.enter()) });
    if let Some(h) = &narrow {
        compress.set_thread_hook(h.clone());
    }
    // The pool's threads compress staged pages when they have no job:
    // those writes stage here, and those a worker before left (with
    // staging=0 too). With no threads, nobody would: writes compress inline.
    if compress.serve_staging(&store) {
        store.set_staging_budget(spec.staging);
    } else if spec.staging > 0 {
        tracing::info!("no compress threads: writes compress inline (staging off)");
    }
    // Kept to have idle pool threads narrow their filter once the process
    // filter is in: one might otherwise wait for work under the wider one.
    let pool_threads = narrow.is_some().then(|| compress.clone());
    let compress = Some(compress);
    // An incoming device serves nothing until its pages have arrived.
    let gated = store.cells().migration.incoming();
    if gated {
        tracing::info!("waiting for the device's pages (incoming migration): requests wait");
    }
    let mut backend = if gated {
        BlkBackend::new_gated(blk, compress)
    } else {
        BlkBackend::with_pool(blk, compress)
    }
    .with_poll(poll);
    if let Some(h) = narrow {
        backend = backend.with_thread_hook(h);
    }
    let backend = Arc::new(backend);
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
        .map_err(WorkerError::Daemon)?;
    // The crate accepts from a listener; ours has no name anyone else can
    // reach, and we connect before it accepts, so it finds us waiting.
    let mut inner = InnerSocket::new().map_err(setup("private socket"))?;
    let to_crate = inner.connect().map_err(setup("private socket"))?;
    daemon
        .start(&mut inner.listener)
        .map_err(WorkerError::Handler)?;
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
        let auto = AutoTier::new(&spec.tier);
        let store = store.clone();
        let every = Duration::from_millis(ms / 3);
        std::thread::Builder::new()
            .name("ager".into())
            .spawn(move || auto.run(&store, every))
            .map_err(setup("thread"))?;
    }

    // Set-up done: nothing the frontend sends has been read yet.
    seccomp::install_worker(spec.seccomp)?;
    if let Some(p) = pool_threads {
        // Before the frontend's first message: no job has run yet, so each
        // thread is idle and answers at once.
        if !p.run_thread_hook(Duration::from_secs(10)) {
            tracing::warn!("a compress thread has not narrowed its seccomp filter yet; it does before its first job");
        }
    }

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
    // Pages still staged are compressed before the worker goes: with no
    // worker the device would keep them raw until the next frontend.
    let cx = &mut vzram_store::Context::new(0);
    while store.compress_staged(cx, 64) > 0 {}
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
        // Spares a burst left that no staged page took for a tick go back.
        store.release_unused_spares();
        store.stats();
        match guard::wait_fd(control.as_raw_fd(), libc::POLLIN, Some(PUBLISH_EVERY)) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(_) => std::process::exit(EXIT_DONE),
        }
        match wire::recv::<Order>(&control) {
            Ok(Some((order, mut fds))) => {
                let one = busy.lock().unwrap_or_else(|e| e.into_inner());
                let m = Migrating {
                    conn: fds.pop(),
                    frontend: Frontend {
                        quiet: &|| rings.quiet(),
                        starts: &|| rings.starts(),
                        gone: &|| rings.gone(),
                    },
                    open_gate: &|| {
                        tracing::info!("the device's pages are here: requests run");
                        backend.open_gate()
                    },
                    // A worker serves its frontend while it receives.
                    hand_on: None,
                };
                let answer = execute_migration(&store, &order, m);
                let sent = wire::send(&control, &answer, &[]);
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

#[cfg(test)]
mod tests {
    use super::*;

    const CHILD: &str = "VZRAM_PANIC_HOOK_CHILD";

    /// A panic on a thread other than `main` (a queue's) ends the process
    /// with [`EXIT_PANIC`], the message logged first. The child is this
    /// test binary again, running this test alone.
    #[test]
    fn a_panic_on_any_thread_ends_the_worker() {
        if std::env::var_os(CHILD).is_some() {
            exit_on_panic();
            let t = std::thread::spawn(|| panic!("queue thread gave up"));
            let _ = t.join();
            std::process::exit(0);
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "worker::tests::a_panic_on_any_thread_ends_the_worker",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(EXIT_PANIC), "{err}");
        assert!(err.contains("queue thread gave up"), "{err}");
    }
}
