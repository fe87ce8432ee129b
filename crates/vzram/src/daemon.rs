//! The serving daemon: binds every device's socket, opens (and recovers)
//! every device's state, then supervises. Each frontend connection is
//! served by a worker process of its own (see [`crate::supervisor`] and
//! [`crate::worker`]); the device's state lives in shared files, so a
//! worker's end, or the daemon's, loses nothing.

use std::ffi::CString;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;
use vzram_store::{BackingSpec, DeviceConfig, Pool, PoolConfig, StateSpec, StoreError};

use crate::config::{DaemonConfig, DeviceSpec, SeccompMode};
use crate::control::{self, Control};
use crate::launcher;
use crate::listen;
use crate::metrics;
use crate::notify::Notifier;
use crate::seccomp;
use crate::supervisor::{BackingFile, Served, Supervisor, WorkerEnv};

#[derive(Debug, Error)]
pub enum Error {
    #[error("cannot create the page store: {0}")]
    Store(#[from] StoreError),
    /// A device that cannot start: its state or its backing file.
    #[error("device {name}: {source}")]
    Device { name: String, source: StoreError },
    #[error("socket {path}: {source}")]
    Socket { path: PathBuf, source: io::Error },
    #[error("cannot start a thread: {0}")]
    Thread(io::Error),
    #[error("cannot wait for signals: {0}")]
    Signal(io::Error),
    #[error(transparent)]
    Seccomp(#[from] seccomp::Error),
    #[error("a socket passed in: {0}")]
    Passed(io::Error),
    #[error("cannot start worker processes: {0}")]
    Launcher(io::Error),
    #[error("metrics address {addr}: {source}")]
    Metrics { addr: SocketAddr, source: io::Error },
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
pub fn run(cfg: DaemonConfig, log_level: &str) -> Result<i32, Error> {
    // Block the shutdown signals before any thread starts, so every thread
    // inherits the mask and only `sigwait` below ever sees them.
    let signals = ShutdownSignals::block()?;
    // Sockets passed in (systemd, `--fd`) are taken (close-on-exec, and
    // LISTEN_* cleared) before anything is started that could inherit them.
    let mut passed = listen::inherited(&cfg.inherit_fds).map_err(Error::Passed)?;
    // Before any thread and before the filter: the launcher is the one
    // process allowed to start workers.
    let launcher = launcher::start().map_err(Error::Launcher)?;
    seccomp::report_sigbus()?;
    raise_fd_limit(&cfg.devices);
    // Connected now: the seccomp filter allows sending, not connecting.
    // One nobody listens on (left over in a shell) is not worth failing for.
    let notifier = Notifier::from_env()
        .unwrap_or_else(|e| {
            tracing::warn!("NOTIFY_SOCKET: {e}; the service manager will not hear from vzram");
            None
        })
        .map(Arc::new);

    // The host budget, shared with every worker.
    let host_file = memfd("vzram-host").map_err(Error::Launcher)?;
    let pool = Pool::with_host_file(
        PoolConfig {
            host_mem_limit: cfg.host_mem_limit,
            ..PoolConfig::default()
        },
        &host_file,
    )?;

    // Bind everything before serving anything, and before touching any
    // state: a bad path or a socket in use fails the start.
    // Sockets passed in are used as they are and left for their owner to
    // remove; the rest are bound here.
    let mut files = SocketFiles::default();
    let mut listeners = Vec::with_capacity(cfg.devices.len());
    for spec in &cfg.devices {
        listeners.push(match passed.remove(&spec.socket) {
            Some(fd) => {
                tracing::info!(device = %spec.name, socket = %spec.socket.display(), "using the listening socket passed in");
                UnixListener::from(fd)
            }
            None => files.bind(&spec.socket, cfg.socket_mode)?,
        });
    }
    // Migration listeners of incoming devices: TCP only when asked.
    let mut incoming = Vec::with_capacity(cfg.devices.len());
    for spec in &cfg.devices {
        incoming.push(match &spec.incoming {
            None => None,
            Some(a @ crate::migration::Addr::Unix(p)) => Some(crate::migration::Listener::new(
                a,
                files.bind(p, cfg.socket_mode)?.into(),
            )),
            Some(a) => {
                let fd = a.bind(cfg.socket_mode).map_err(|e| Error::Socket {
                    path: PathBuf::from(a.to_string()),
                    source: io::Error::other(e),
                })?;
                tracing::warn!(device = %spec.name, incoming = %a, "migration stream on plain TCP: guest memory travels unencrypted; prefer a unix socket through an SSH or TLS tunnel");
                Some(crate::migration::Listener::new(a, fd))
            }
        });
    }

    // Every device's state is opened, locked and recovered here, once: a
    // damaged or mismatched one stops the start, and the numbers `stat`
    // shows are exact from the first moment. Then the mapping goes; the
    // locked files stay, for the workers.
    let mut devices = Vec::with_capacity(cfg.devices.len());
    for ((spec, listener), incoming) in cfg.devices.iter().zip(listeners).zip(incoming) {
        let mut dc = DeviceConfig::new(spec.size, spec.algo);
        dc.mem_limit = spec.mem_limit;
        dc.shards = usize::from(spec.queues);
        dc.state = Some(StateSpec {
            root: spec.state_root(&cfg).to_path_buf(),
            name: spec.name.clone(),
            fresh: cfg.fresh,
        });
        // Opened (and locked) here, before the filter, with the state: a
        // missing, small or taken file stops the start.
        dc.backing = spec
            .tier
            .backing_file
            .clone()
            .map(|path| BackingSpec { path });
        let device_error = |source| Error::Device {
            name: spec.name.clone(),
            source,
        };
        let store = pool.create_device(dc).map_err(device_error)?;
        store.stats();
        let Some(state) = store.state_files() else {
            unreachable!("a daemon's device always has state");
        };
        let state_files = state.try_clone().map_err(device_error)?;
        let backing = match store.backing() {
            Some(b) => {
                let kept = BackingFile::of(b).map_err(|e| {
                    device_error(StoreError::Backing(format!("{}: {e}", b.path().display())))
                })?;
                tracing::info!(
                    device = %spec.name,
                    backing = %kept.path.display(),
                    blocks = kept.blocks,
                    used = b.used(),
                    direct_io = kept.direct,
                    "backing file ready"
                );
                Some(kept)
            }
            None => None,
        };
        let dir = state_files.dir.display().to_string();
        match store.recovery() {
            Some(r) => tracing::info!(
                device = %spec.name,
                state = %dir,
                pages = r.slots,
                spans = r.spans,
                cut_short = r.unlocked,
                ms = r.micros as f64 / 1000.0,
                "recovered the device from its state"
            ),
            None => tracing::info!(device = %spec.name, state = %dir, "new device state"),
        }
        if spec.incoming.is_some() {
            crate::supervisor::set_incoming(&spec.name, &store);
        } else if store.cells().migration.incoming() {
            tracing::warn!(device = %spec.name, "the device waits for its pages from a migration but has no incoming address: its requests wait; vzram reset serves it empty");
        }
        drop(store);
        devices.push(Arc::new(
            Served::new(spec.clone(), listener, state_files, backing)?.with_incoming(incoming),
        ));
    }

    let control_listener = match &cfg.control {
        Some(path) => Some(match passed.remove(path) {
            Some(fd) => UnixListener::from(fd),
            None => files.bind(path, cfg.control_mode)?,
        }),
        None => None,
    };
    for path in passed.keys() {
        tracing::warn!(socket = %path.display(), "a socket was passed in that no device uses; closed");
    }
    drop(passed);
    // Bound here: the filter allows no new socket, and no getsockname to
    // learn the port of a `:0` afterwards.
    let metrics_listener = match cfg.metrics {
        Some(addr) => {
            let fail = |source| Error::Metrics { addr, source };
            let l = TcpListener::bind(addr).map_err(fail)?;
            let bound = l.local_addr().map_err(fail)?;
            Some((l, bound))
        }
        None => None,
    };

    // glibc installs its thread-signal handlers (rt_sigaction) when the
    // first thread starts; let that happen before the filter forbids it.
    std::thread::Builder::new()
        .spawn(|| {})
        .and_then(|t| t.join().map_err(|_| io::Error::other("thread panicked")))
        .map_err(Error::Thread)?;
    // Set-up is done: from here on only the calls supervising needs.
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

    let sup = Arc::new(
        Supervisor::new(
            devices,
            pool,
            host_file,
            launcher,
            WorkerEnv {
                seccomp: cfg.seccomp.to_string(),
                log_level: log_level.to_string(),
                socket_mode: cfg.socket_mode,
                state_dir: cfg.state_dir.clone(),
                compress_threads: cfg.compress_threads,
                poll_us: cfg.poll_us,
            },
        )
        .map_err(Error::Launcher)?,
    );
    let looping = {
        let sup = sup.clone();
        std::thread::Builder::new()
            .name("supervisor".into())
            .spawn(move || sup.run())
            .map_err(Error::Thread)?
    };
    for (_, d) in sup.devices() {
        sup.start_incoming(d).map_err(Error::Thread)?;
    }
    let ctl = Arc::new(
        Control::new(sup.clone()).with_metrics(metrics_listener.as_ref().map(|(_, a)| *a)),
    );
    if let Some(l) = control_listener {
        let ctl = ctl.clone();
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || control::serve(l, ctl))
            .map_err(Error::Thread)?;
    }
    if let Some((l, addr)) = metrics_listener {
        let ctl = ctl.clone();
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || metrics::serve(l, ctl))
            .map_err(Error::Thread)?;
        tracing::info!(metrics = %addr, "metrics endpoint ready: http://{addr}/metrics");
    }

    for (_, d) in sup.devices() {
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

    // Every socket listens and every device's state is recovered.
    // Status lines may follow at once: the supervisor has the notifier
    // before READY is sent.
    sup.set_notifier(notifier.clone());
    notify(
        &notifier,
        &format!("READY=1\nSTATUS=serving {} devices", sup.devices().len()),
    );

    let sig = signals.wait()?;
    tracing::info!(signal = sig, "shutting down");
    notify(&notifier, "STOPPING=1");
    sup.stop();
    let _ = looping.join();
    drop(files);
    Ok(sig)
}

/// An anonymous shared memory file.
fn memfd(name: &str) -> io::Result<std::fs::File> {
    let name = CString::new(name).map_err(io::Error::other)?;
    // SAFETY: a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Tells the service manager, if there is one; a lost message is logged,
/// not fatal (the devices serve either way).
fn notify(notifier: &Option<Arc<Notifier>>, msg: &str) {
    if let Some(n) = notifier {
        if let Err(e) = n.send(msg) {
            tracing::warn!("cannot notify the service manager ({msg:?}): {e}");
        }
    }
}

/// Creates a listening socket with the given mode. A stale socket file from
/// a daemon that died is replaced; a live one is an error.
pub(crate) fn bind_socket(path: &Path, mode: u32) -> Result<UnixListener, Error> {
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
/// listening socket, the guard's private listener and its handle, its
/// state's locked header, its backing file if any, and,
/// while connected, two connections, guest memory files and three eventfds
/// plus an epoll per queue; the usual soft limit of 1024 runs out near 170
/// connected devices.
fn raise_fd_limit(devices: &[DeviceSpec]) {
    let need: u64 = 64
        + devices
            .iter()
            .map(|d| 5 + 8 + 5 * u64::from(d.queues) + u64::from(d.tier.backing_file.is_some()))
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

/// SIGTERM, SIGINT and SIGHUP, blocked in every thread and taken with
/// `sigwait`. SIGHUP's default action would kill the daemon and every
/// device's data with it (a closed terminal, a reload by habit).
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
            libc::sigaddset(&mut set, libc::SIGHUP);
            let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            if rc != 0 {
                return Err(Error::Signal(io::Error::from_raw_os_error(rc)));
            }
            Ok(ShutdownSignals { set })
        }
    }

    /// Waits for a shutdown signal; SIGHUP is logged and ignored (there is
    /// nothing to reload).
    fn wait(&self) -> Result<i32, Error> {
        loop {
            let mut sig = 0;
            // SAFETY: `set` is a valid signal set and `sig` a valid out pointer.
            let rc = unsafe { libc::sigwait(&self.set, &mut sig) };
            match rc {
                0 if sig == libc::SIGHUP => {
                    tracing::info!("SIGHUP ignored: vzram has no configuration to reload; devices keep serving")
                }
                0 => return Ok(sig),
                libc::EINTR => continue,
                e => return Err(Error::Signal(io::Error::from_raw_os_error(e))),
            }
        }
    }
}
