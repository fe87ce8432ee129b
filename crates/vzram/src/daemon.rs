//! The serving daemon: one pool, one store device per configured disk, one
//! listener thread per socket, and a `VhostUserDaemon` per connection.
//!
//! The store device belongs to the listener, not to the connection: when a
//! frontend goes away (QEMU quits or crashes) its queue threads end, and the
//! next connection on the same socket serves the same data.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use vhost::vhost_user::{Error as VhostUserError, Listener};
use vhost_user_backend::{Error as DaemonError, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vzram_blk::{BlkBackend, BlkDevice};
use vzram_store::{DeviceConfig, Pool, PoolConfig, StoreError};

use crate::config::{DaemonConfig, DeviceSpec, SeccompMode};
use crate::control::{self, Control};
use crate::seccomp;

/// How often the pool looks for fragmented devices to compact, and when it acts.
const COMPACT_INTERVAL: Duration = Duration::from_secs(10);
const COMPACT_WASTE_RATIO: f64 = 0.25;
const COMPACT_MIN_WASTE: u64 = 16 << 20;

#[derive(Debug, Error)]
pub enum Error {
    #[error("cannot create the page store: {0}")]
    Store(#[from] StoreError),
    #[error("socket {path}: {source}")]
    Socket { path: PathBuf, source: io::Error },
    #[error("cannot start a thread: {0}")]
    Thread(io::Error),
    #[error("cannot wait for signals: {0}")]
    Signal(io::Error),
    #[error(transparent)]
    Seccomp(#[from] seccomp::Error),
}

/// A configured disk: its store device, served on one socket.
pub struct ServedDevice {
    pub spec: DeviceSpec,
    pub blk: Arc<BlkDevice>,
    pub connected: AtomicBool,
    /// Frontend connections accepted so far.
    pub connections: AtomicU64,
}

/// Removes the socket files we created when dropped, so every way out of
/// [`run`] (signal or error) leaves no stale sockets behind.
///
/// Each file is removed with `unlinkat` relative to its directory, opened
/// (`O_PATH`) at bind time: under the seccomp filter that is the only
/// unlink allowed, so a compromised daemon cannot delete files elsewhere.
#[derive(Default)]
struct SocketFiles {
    dirs: Vec<(PathBuf, OwnedFd)>,
    files: Vec<(PathBuf, usize, CString)>,
}

impl SocketFiles {
    /// Binds `path` (see [`bind_socket`]) and remembers it for removal.
    /// Its directory is opened first, so a file we bound is always one we
    /// can remove, and a path we failed to bind is never removed.
    fn bind(&mut self, path: &Path, mode: u32) -> Result<UnixListener, Error> {
        let fail = |source: io::Error| Error::Socket {
            path: path.to_path_buf(),
            source,
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = path
            .file_name()
            .ok_or_else(|| fail(io::Error::new(io::ErrorKind::InvalidInput, "no file name")))?;
        let name = CString::new(name.as_bytes())
            .map_err(|e| fail(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
        let idx = match self.dirs.iter().position(|(d, _)| *d == dir) {
            Some(i) => i,
            None => {
                let fd = std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
                    .open(&dir)
                    .map_err(fail)?;
                self.dirs.push((dir, fd.into()));
                self.dirs.len() - 1
            }
        };
        let listener = bind_socket(path, mode)?;
        self.files.push((path.to_path_buf(), idx, name));
        Ok(listener)
    }

    /// The directory descriptors, for the seccomp filter.
    fn dir_fds(&self) -> Vec<RawFd> {
        self.dirs.iter().map(|(_, fd)| fd.as_raw_fd()).collect()
    }
}

impl Drop for SocketFiles {
    fn drop(&mut self) {
        for (path, dir, name) in &self.files {
            // SAFETY: the descriptor is an open directory we own and `name`
            // a NUL-terminated file name in it.
            let rc = unsafe { libc::unlinkat(self.dirs[*dir].1.as_raw_fd(), name.as_ptr(), 0) };
            if rc != 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!("cannot remove {}: {e}", path.display());
                }
            }
        }
    }
}

/// Runs the daemon until SIGTERM or SIGINT. Returns the signal number.
pub fn run(cfg: DaemonConfig) -> Result<i32, Error> {
    // Block the shutdown signals before any thread starts, so every thread
    // inherits the mask and only `sigwait` below ever sees them.
    let signals = ShutdownSignals::block()?;
    raise_fd_limit(&cfg.devices);

    let pool = Pool::new(PoolConfig {
        host_mem_limit: cfg.host_mem_limit,
        ..PoolConfig::default()
    })?;
    pool.spawn_auto_compaction(COMPACT_INTERVAL, COMPACT_WASTE_RATIO, COMPACT_MIN_WASTE)
        .map_err(Error::Thread)?;

    let mut devices = Vec::with_capacity(cfg.devices.len());
    for spec in &cfg.devices {
        let mut dc = DeviceConfig::new(spec.size, spec.algo);
        dc.mem_limit = spec.mem_limit;
        dc.shards = usize::from(spec.queues);
        let store = pool.create_device(dc)?;
        let blk = Arc::new(BlkDevice::new(
            store,
            spec.queues,
            spec.readonly,
            &spec.serial,
        ));
        devices.push(Arc::new(ServedDevice {
            spec: spec.clone(),
            blk,
            connected: AtomicBool::new(false),
            connections: AtomicU64::new(0),
        }));
    }

    // Bind everything before serving anything: a bad path fails the start.
    let mut files = SocketFiles::default();
    let mut listeners = Vec::with_capacity(devices.len());
    for d in &devices {
        listeners.push(files.bind(&d.spec.socket, cfg.socket_mode)?);
    }
    let control_listener = match &cfg.control {
        Some(path) => Some(files.bind(path, cfg.socket_mode)?),
        None => None,
    };

    // Set-up is done: from here on only the calls serving needs, on every
    // thread (auto-compaction already runs; the rest inherit the filter).
    // Nothing a frontend sends is read before this point.
    seccomp::install(cfg.seccomp, &files.dir_fds())?;
    match cfg.seccomp {
        SeccompMode::On => tracing::info!("seccomp filter active"),
        SeccompMode::Log => {
            tracing::warn!(
                "seccomp filter in log mode: nothing is refused, the kernel logs what would be"
            )
        }
        SeccompMode::Off => tracing::warn!("seccomp filter off"),
    }

    for (d, l) in devices.iter().zip(listeners) {
        let d = d.clone();
        std::thread::Builder::new()
            .name(format!("listen-{}", d.spec.name))
            .spawn(move || serve_device(d, l))
            .map_err(Error::Thread)?;
    }
    if let Some(l) = control_listener {
        let ctl = Arc::new(Control::new(pool.clone(), devices.clone()));
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || control::serve(l, ctl))
            .map_err(Error::Thread)?;
    }

    for d in &devices {
        tracing::info!(
            device = %d.spec.name,
            socket = %d.spec.socket.display(),
            size = d.spec.size,
            queues = d.spec.queues,
            algo = %d.spec.algo,
            readonly = d.spec.readonly,
            "serving"
        );
    }
    if let Some(c) = &cfg.control {
        tracing::info!(control = %c.display(), "control socket ready");
    }

    let sig = signals.wait()?;
    tracing::info!(signal = sig, "shutting down");
    drop(files);
    Ok(sig)
}

/// Creates a listening socket with the given mode. A stale socket file from
/// a daemon that died is replaced; a live one is an error.
fn bind_socket(path: &Path, mode: u32) -> Result<UnixListener, Error> {
    let fail = |source: io::Error| Error::Socket {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(fail(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "another process is serving it",
                )));
            }
            std::fs::remove_file(path).map_err(fail)?;
        }
        Ok(_) => {
            return Err(fail(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "exists and is not a socket",
            )))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e)),
    }
    // bind() creates the file with 0777 & ~umask. Narrow the umask around it
    // so that there is no moment where others may connect; this runs before
    // any thread that creates files starts, so the process-wide umask is ours.
    // SAFETY: umask only swaps the process file-mode mask.
    let old = unsafe { libc::umask(!mode & 0o777) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    let listener = bound.map_err(fail)?;
    // umask can only take bits away; set exactly what was asked for.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(fail)?;
    Ok(listener)
}

/// Lifts the soft open-file limit to the hard one. Each device holds a
/// listening socket and, while connected, a connection, guest memory files
/// and three eventfds plus an epoll per queue; the usual soft limit of 1024
/// runs out near 170 connected devices.
fn raise_fd_limit(devices: &[DeviceSpec]) {
    let need: u64 = 64
        + devices
            .iter()
            .map(|d| 2 + 8 + 5 * u64::from(d.queues))
            .sum::<u64>();
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads one valid rlimit; raising soft to hard needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim = raised;
        }
    }
    if lim.rlim_cur < need {
        tracing::warn!(
            limit = lim.rlim_cur,
            need,
            "open-file limit is too low for every device to be connected at once; raise it (LimitNOFILE=, ulimit -Hn)"
        );
    }
}

/// Blocks until `fd` is readable (a listener: a connection is pending).
fn wait_readable(fd: RawFd) -> io::Result<()> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd, owned by this frame, for the whole call.
        let rc = unsafe { libc::poll(&mut p, 1, -1) };
        if rc >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Accepts frontends on one socket, one at a time, forever.
fn serve_device(dev: Arc<ServedDevice>, listener: UnixListener) {
    let fd = listener.as_raw_fd();
    let mut listener = Listener::from(listener);
    let name = dev.spec.name.clone();
    loop {
        // An idle device keeps only this thread: the connection's handler
        // and queue threads are made once a frontend is knocking.
        if let Err(e) = wait_readable(fd) {
            tracing::error!(device = %name, "cannot wait for a frontend: {e}");
            std::thread::sleep(Duration::from_secs(1));
            continue;
        }
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let backend = Arc::new(BlkBackend::new(dev.blk.clone()));
        let mut daemon = match VhostUserDaemon::new(format!("vhost-{name}"), backend, mem) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(device = %name, "cannot set up the vhost-user daemon: {e}");
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        // Blocks until a frontend connects.
        if let Err(e) = daemon.start(&mut listener) {
            tracing::error!(device = %name, "cannot accept a frontend: {e}");
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let n = dev.connections.fetch_add(1, Ordering::Relaxed) + 1;
        dev.connected.store(true, Ordering::Relaxed);
        tracing::info!(device = %name, connection = n, "frontend connected");
        match daemon.wait() {
            Ok(())
            | Err(DaemonError::HandleRequest(
                VhostUserError::Disconnected | VhostUserError::PartialMessage,
            )) => {
                tracing::info!(device = %name, "frontend disconnected; data kept for the next one");
            }
            Err(e) => {
                tracing::warn!(device = %name, "frontend connection ended: {e}; data kept for the next one")
            }
        }
        // Dropping the daemon stops and joins this connection's queue threads.
        drop(daemon);
        dev.connected.store(false, Ordering::Relaxed);
    }
}

/// SIGTERM and SIGINT, blocked in every thread and taken with `sigwait`.
struct ShutdownSignals {
    set: libc::sigset_t,
}

impl ShutdownSignals {
    fn block() -> Result<ShutdownSignals, Error> {
        // SAFETY: sigset_t is plain data; the sig* calls only fill it in and
        // change this thread's mask, which new threads inherit.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::sigaddset(&mut set, libc::SIGINT);
            let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            if rc != 0 {
                return Err(Error::Signal(io::Error::from_raw_os_error(rc)));
            }
            Ok(ShutdownSignals { set })
        }
    }

    fn wait(&self) -> Result<i32, Error> {
        loop {
            let mut sig = 0;
            // SAFETY: `set` is a valid signal set and `sig` a valid out pointer.
            let rc = unsafe { libc::sigwait(&self.set, &mut sig) };
            match rc {
                0 => return Ok(sig),
                libc::EINTR => continue,
                e => return Err(Error::Signal(io::Error::from_raw_os_error(e))),
            }
        }
    }
}
