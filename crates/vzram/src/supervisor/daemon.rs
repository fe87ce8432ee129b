//! Start-up of the serving daemon: binds every device's socket, then adds
//! each configured device as `vzram add` adds one ([`Supervisor::add`],
//! which opens and recovers its state here, before the filter), then
//! supervises. Each frontend
//! connection is served by a worker process of its own; the device's state
//! lives in shared files, so a worker's end, or the daemon's, loses nothing.

use std::ffi::CString;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;
use vzram_store::{Pool, PoolConfig, StoreError};

use super::control::{self, Control};
use super::error::{LegacyState, StartError};
use super::launch;
use super::metrics;
use super::opening::{Adding, Configured, NewStates};
use super::pidfile::{PidFile, PidFileError};
use super::reload::Reloads;
use super::{Supervisor, WorkerEnv};
use crate::config::{DaemonConfig, DeviceSpec, Reload, SeccompMode};
use crate::owner::migration::Listener;
use crate::owner::placement;
use crate::proto::addr::Addr;
use crate::proto::launch::Request as LaunchRequest;
use crate::proto::worker_spec::{LogFormat, LogLevel};
use crate::sys::fds::{memfd, raise_fd_limit};
use crate::sys::listen;
use crate::sys::notify::Notifier;
use crate::sys::seccomp;
use crate::sys::signals::ShutdownSignals;
use crate::sys::socket::{self, bind_socket, SocketError};

#[derive(Debug, Error)]
pub enum Error {
    #[error("cannot create the page store: {0}")]
    Store(#[from] StoreError),
    /// A device that cannot start: its state or its backing file.
    #[error("device {name}: {source}")]
    Device { name: String, source: StoreError },
    #[error(transparent)]
    Socket(#[from] SocketError),
    #[error("cannot start a thread: {0}")]
    Thread(io::Error),
    #[error("cannot wait for signals: {0}")]
    Signal(io::Error),
    #[error(transparent)]
    Seccomp(#[from] seccomp::Error),
    #[error(transparent)]
    SignalHandler(#[from] crate::sys::signals::HandlerError),
    #[error("a socket passed in: {0}")]
    Passed(io::Error),
    #[error("cannot start worker processes: {0}")]
    Launcher(io::Error),
    #[error("metrics address {addr}: {source}")]
    Metrics { addr: SocketAddr, source: io::Error },
    /// A device's socket was last served from a state elsewhere (worded
    /// as the store words a configuration it refuses).
    #[error("device {name}: invalid configuration: {source}")]
    Placement {
        name: String,
        #[source]
        source: placement::PlacementError,
    },
    #[error("device {name}: invalid configuration: {source}")]
    LegacyState {
        name: String,
        #[source]
        source: LegacyState,
    },
    /// `--pidfile`: its path, or another daemon holds it.
    #[error(transparent)]
    Pidfile(#[from] PidFileError),
    #[error("--pidfile: cannot write it: {0}")]
    PidfileWrite(#[source] io::Error),
    #[error(
        "the supervisor's loop failed (see the log); exiting so that the daemon is started again"
    )]
    LoopFailed,
    /// A configured device refused as `vzram add` refuses one (a name
    /// or socket taken, an incoming address without TLS): the
    /// configuration's checks leave none of these.
    #[error(transparent)]
    Add(super::error::Error),
}

/// A configured device that [`Supervisor::add`] could not add, worded as
/// start-up words it.
impl From<super::error::Error> for Error {
    fn from(e: super::error::Error) -> Error {
        use super::error::Error as Add;
        match e {
            Add::Start { device, source } => match source {
                StartError::Store(source) => Error::Device {
                    name: device,
                    source,
                },
                StartError::Placement(source) => Error::Placement {
                    name: device,
                    source,
                },
                StartError::Legacy(source) => Error::LegacyState {
                    name: device,
                    source,
                },
            },
            Add::Store(s) => Error::Store(s),
            e => Error::Add(e),
        }
    }
}

/// A control socket passed in (systemd's `SocketMode=` is one mode for
/// every socket of a unit) gets `--control-mode` all the same: whoever can
/// connect may remove, reset or migrate any device. Refused if it cannot.
fn control_mode_of_passed(path: &Path, mode: u32) -> Result<(), Error> {
    use std::os::unix::fs::PermissionsExt;
    let fail = |source: io::Error| {
        Error::Passed(io::Error::new(
            source.kind(),
            format!(
                "the control socket {} cannot be given mode {mode:04o} (--control-mode): {source}",
                path.display()
            ),
        ))
    };
    let was = std::fs::metadata(path).map_err(fail)?.permissions().mode() & 0o7777;
    if was != mode {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(fail)?;
        tracing::warn!(
            socket = %path.display(),
            "the control socket passed in had mode {was:04o}: set to {mode:04o} (--control-mode)"
        );
    }
    Ok(())
}

impl Error {
    /// State that does not match the configuration, or a backing file that
    /// is missing, too small or taken, is a configuration error: the fix is
    /// a flag (`--fresh`) or the config, not a retry.
    /// So is a socket path that cannot be bound (a missing directory, too
    /// long, a file or a live daemon in the way) and a metrics port that
    /// is taken.
    pub fn is_config(&self) -> bool {
        let store = match self {
            Error::Store(s) | Error::Device { source: s, .. } => s,
            Error::Socket(e) => return e.is_config(),
            Error::Add(e) => {
                return matches!(
                    e,
                    super::error::Error::NameTaken(_)
                        | super::error::Error::SocketTaken { .. }
                        | super::error::Error::NoTls { .. }
                )
            }
            Error::Pidfile(_)
            | Error::PidfileWrite(_)
            | Error::Placement { .. }
            | Error::LegacyState { .. } => return true,
            Error::Metrics { source, .. } => {
                return matches!(
                    source.kind(),
                    io::ErrorKind::AddrInUse
                        | io::ErrorKind::AddrNotAvailable
                        | io::ErrorKind::PermissionDenied
                )
            }
            _ => return false,
        };
        matches!(
            store,
            StoreError::State(_) | StoreError::InvalidConfig(_) | StoreError::Backing(_)
        )
    }
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
        let fail = |source: io::Error| {
            Error::Socket(SocketError {
                path: path.to_path_buf(),
                source,
            })
        };
        // Before the directory is opened: its errors say what is wrong.
        socket::check_path(path)?;
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

/// Binds the control socket nobody named. Its directory is made if
/// missing, as systemd's `RuntimeDirectory=` would: root's `/run/vzram`
/// 0755, a user's 0700; one that is there must be a directory of this
/// user's (of root's, for root), and a user's must be private. When another
/// daemon listens on it (two bare `vzram serve`), this one takes
/// `control.PID.sock` beside it, so they do not collide; `taken` says so.
fn bind_default_control(
    files: &mut SocketFiles,
    taken: &mut Option<PathBuf>,
    cfg: &mut DaemonConfig,
) -> Result<UnixListener, Error> {
    control_dir(&cfg.control)?;
    match files.bind(&cfg.control, cfg.control_mode) {
        Err(Error::Socket(e)) if e.source.kind() == io::ErrorKind::AddrInUse => {
            let alt = cfg
                .control
                .with_file_name(format!("control.{}.sock", std::process::id()));
            if let Some(dir) = cfg.control.parent() {
                socket::remove_stale_controls(dir);
            }
            let l = files.bind(&alt, cfg.control_mode)?;
            *taken = Some(std::mem::replace(&mut cfg.control, alt));
            Ok(l)
        }
        r => r,
    }
}

/// Makes (or checks) the directory of the default control socket
/// `control`.
fn control_dir(control: &Path) -> Result<(), Error> {
    match control.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => runtime_dir(dir).map_err(|source| {
            Error::Socket(SocketError {
                path: control.to_path_buf(),
                source,
            })
        }),
        None => Ok(()),
    }
}

/// Makes (or checks) the directory of a default control socket: see
/// [`bind_default_control`].
fn runtime_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let euid = crate::config::euid();
    let mode = if euid == 0 { 0o755 } else { 0o700 };
    match std::fs::DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => {
            // The mode is cut by the umask; set it whole.
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))?;
            return Ok(());
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(io::Error::new(
                e.kind(),
                format!(
                "its directory {} cannot be made: its parent does not exist (give --control PATH)",
                dir.display()
            ),
            ))
        }
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!(
                    "cannot make its directory {}: {e} (give --control PATH)",
                    dir.display()
                ),
            ))
        }
    }
    let m = std::fs::symlink_metadata(dir)?;
    let open_to_others = euid != 0 && m.permissions().mode() & 0o077 != 0;
    if !m.is_dir() || m.uid() != euid || open_to_others {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "its directory {} is not this user's own (a {}, owner uid {}, mode {:04o}): another user may have made it first; remove it or give --control PATH",
                dir.display(),
                if m.is_dir() { "directory" } else if m.is_symlink() { "symbolic link" } else { "file" },
                m.uid(),
                m.permissions().mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

/// Runs the daemon until SIGTERM or SIGINT. Returns the signal number.
/// SIGHUP reads the configuration file again when `reload` says how.
/// `pidfile`: where to write the supervisor's pid (`--pidfile`).
pub fn run(
    mut cfg: DaemonConfig,
    log_level: LogLevel,
    log_format: LogFormat,
    reload: Option<Reload>,
    pidfile: Option<&Path>,
) -> Result<i32, Error> {
    // Block the shutdown signals before any thread starts, so every thread
    // inherits the mask and only `sigwait` below ever sees them.
    let signals = ShutdownSignals::block().map_err(Error::Signal)?;
    // Sockets passed in (systemd, `--fd`) are taken (close-on-exec, and
    // LISTEN_* cleared) before anything is started that could inherit them.
    let mut passed = listen::inherited(&cfg.inherit_fds).map_err(Error::Passed)?;
    // Before any thread and before the filter: the launcher is the one
    // process allowed to start workers.
    let launcher =
        launch::start(reload.as_ref().map(|r| r.path.as_path())).map_err(Error::Launcher)?;
    // A supervisor thread that died (the loop that admits frontends, the
    // control server) would leave a daemon that looks alive and serves
    // nothing; one that exits is restarted by its service manager, which
    // recovers every state, and the VMMs reconnect.
    crate::sys::panic::exit_on_panic(
        "the supervisor panicked; exiting (code 1) so that the service manager restarts the daemon",
        1,
    );
    // Taken before anything is bound: a second daemon on the same pid
    // file leaves the first one's sockets alone.
    let pidfile = pidfile.map(PidFile::take).transpose()?;
    crate::sys::fault::report_sigbus()?;
    raise_fd_limit(fds_needed(&cfg.devices));
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
            host_staging: cfg.host_staging,
            ..PoolConfig::default()
        },
        &host_file,
    )?;

    // Bind everything before serving anything, and before touching any
    // state: a bad path or a socket in use fails the start.
    // Sockets passed in are used as they are and left for their owner to
    // remove; the rest are bound here.
    let mut files = SocketFiles::default();
    // The default runtime directory first: a device's socket may be in it
    // (`/run/vzram/vm1.sock`, as the examples put them).
    if cfg.control_defaulted && !passed.contains_key(&cfg.control) {
        control_dir(&cfg.control)?;
    }
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
    // Migration listeners of incoming devices: TCP only when asked. One
    // that cannot be had (an address in use, no network under the service
    // manager's sandbox) stops only its device's migration: the device
    // waits, says why in its stat, and the others start.
    let mut incoming = Vec::with_capacity(cfg.devices.len());
    for spec in &cfg.devices {
        let bound = match &spec.incoming {
            None => Ok(None),
            Some(a @ Addr::Unix(p)) => files
                .bind(p, cfg.incoming_mode)
                .map(|fd| Some(Listener::new(a, fd.into())))
                .map_err(|e| e.to_string()),
            // Mutual TLS (checked in the configuration).
            Some(a) => socket::bind(a, 0)
                .map(|fd| Some(Listener::new(a, fd)))
                .map_err(|e| e.to_string()),
        };
        incoming.push(bound.map_err(|e| {
            let a = spec
                .incoming
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default();
            let why = format!("cannot listen for its migration on {a}: {e}; its requests wait (fix the address and restart, or vzram reset serves it empty)");
            tracing::error!(device = %spec.name, "{why}");
            why
        }));
    }

    // The default control socket taken by another daemon: the one this
    // daemon took instead (said once the start is logged).
    let mut control_fallback: Option<PathBuf> = None;
    let control_listener = match passed.remove(&cfg.control) {
        Some(fd) => {
            control_mode_of_passed(&cfg.control, cfg.control_mode)?;
            UnixListener::from(fd)
        }
        None if cfg.control_defaulted => {
            bind_default_control(&mut files, &mut control_fallback, &mut cfg)?
        }
        None => files.bind(&cfg.control, cfg.control_mode)?,
    };
    for path in passed.keys() {
        tracing::warn!(socket = %path.display(), "a socket was passed in that no device uses; closed");
    }
    drop(passed);
    // Bound here: the filter allows no new socket, and no getsockname to
    // learn the port of a `:0` afterwards. Like the sockets, before any
    // state is touched, so a port in use leaves nothing made.
    let metrics_listener = match cfg.metrics {
        Some(addr) => {
            let fail = |source| Error::Metrics { addr, source };
            let l = TcpListener::bind(addr).map_err(fail)?;
            let bound = l.local_addr().map_err(fail)?;
            Some((l, bound))
        }
        None => None,
    };
    if let Some(p) = &pidfile {
        p.write().map_err(Error::PidfileWrite)?;
    }

    // Logged once the sockets and ports are ours: a start refused for
    // them says so in its one error line, nothing else.
    tracing::info!(
        version = %crate::proto::VERSION,
        control = %cfg.control.display(),
        "vzram starting"
    );
    if let Some(taken) = control_fallback {
        tracing::warn!(
            "another vzram listens on the default control socket {}: this one's is {} (give its commands --control {})",
            taken.display(),
            cfg.control.display(),
            cfg.control.display()
        );
    }

    // States (and state dirs) made by this start are deleted again if it
    // fails: declared before the supervisor, so dropped after its devices
    // (their locks released).
    let mut made = NewStates::default();
    let roots = state_roots(&cfg, &mut made.roots)?;
    let sup = Arc::new(
        Supervisor::new(
            Vec::new(),
            pool,
            host_file,
            launcher,
            WorkerEnv {
                seccomp: cfg.seccomp,
                log_level,
                log_format,
                socket_mode: cfg.socket_mode,
                state_dir: cfg.state_dir.clone(),
                control: cfg.control.clone(),
                compress_threads: cfg.compress_threads,
                incoming_timeout: cfg.incoming_timeout,
                incoming_mode: cfg.incoming_mode,
                tls: cfg.tls.clone().map(Arc::new),
                poll_us: cfg.poll_us,
            },
        )
        .map_err(Error::Launcher)?,
    );
    // Every state there is left over until its device is added: what
    // finds a state made under a device's name alone (`state_key`).
    *sup.registry.leftovers() = roots
        .iter()
        .flat_map(|r| vzram_store::state::leftovers(r, &[]))
        .collect();
    // Every device's state is opened, locked and recovered here, once, as
    // `vzram add` adds a device: a damaged or mismatched one stops the
    // start, and the numbers `stat` shows are exact from the first moment.
    for ((spec, listener), incoming) in cfg.devices.iter().zip(listeners).zip(incoming) {
        let how = Configured {
            listener,
            incoming,
            fresh: cfg.fresh.covers_device(spec),
            adopt: cfg.adopt.covers_device(spec),
            older_name: older_name(&cfg, spec),
            made: &mut made,
        };
        sup.add(spec.clone(), Adding::Configured(how))?;
    }
    for l in sup.registry.leftovers().iter() {
        tracing::warn!(
            state = %l.dir.display(),
            size = l.size_bytes,
            mib_held = l.bytes >> 20,
            made_for = %l.socket.as_deref().map_or("an unrecorded socket".into(), |s| s.display().to_string()),
            "a device state no device serves is left over: `{}` serves it, `vzram forget {}` deletes it",
            super::devices::recover_hint(
                &l.name,
                l.socket.as_deref().unwrap_or(Path::new("PATH")),
                l.size_bytes
            ),
            l.name
        );
    }

    // glibc installs its thread-signal handlers (rt_sigaction) when the
    // first thread starts; let that happen before the filter forbids it.
    std::thread::Builder::new()
        .spawn(|| {})
        .and_then(|t| t.join().map_err(|_| io::Error::other("thread panicked")))
        .map_err(Error::Thread)?;
    // Markers beside the sockets are written once nothing can fail the
    // start for the configuration's sake.
    for (_, d) in sup.devices() {
        if let Err(e) = placement::record(&d.spec.socket, &d.files.dir) {
            tracing::warn!(device = %d.spec.name, socket = %d.spec.socket.display(), "cannot record where the state is beside the socket ({e}); a change of state dir will go unnoticed");
        }
    }
    // Opened now: the filter lets nothing be opened later.
    let procs = match &metrics_listener {
        Some(_) => match metrics::ProcFiles::open() {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!(
                    "cannot open /proc/self for the process_* metrics: {e}; they are left out"
                );
                None
            }
        },
        None => None,
    };
    // Before the filter and before anything a client sends is read: what
    // the launcher may remove later besides what it prepares itself, and
    // the roots it may make states under (proto::launch::Request::Started).
    let states = sup
        .devices()
        .iter()
        .map(|(_, d)| d.files.dir.clone())
        .chain(sup.registry.leftovers().iter().map(|l| l.dir.clone()))
        .collect();
    sup.launcher
        .send(
            &LaunchRequest::Started {
                state_dir: cfg.state_dir.clone(),
                roots: roots.clone(),
                sockets: cfg.devices.iter().map(|d| d.socket.clone()).collect(),
                states,
            },
            &[],
        )
        .map_err(Error::Launcher)?;
    // Set-up is done: from here on only the calls supervising needs.
    let mut unlink_dirs = files.dir_fds();
    unlink_dirs.extend(pidfile.as_ref().map(|p| p.dir_fd()));
    seccomp::install(cfg.seccomp, &unlink_dirs)?;
    made.keep();
    match cfg.seccomp {
        SeccompMode::On => tracing::info!("seccomp filter active"),
        SeccompMode::Log => {
            tracing::warn!(
                "seccomp filter in log mode: nothing is refused, the kernel logs what would be"
            )
        }
        SeccompMode::Off => tracing::warn!("seccomp filter off"),
    }

    // Limits at odds with each other or with what recovered states hold
    // are accepted, with a warning, as `set-limit` accepts them (each
    // device's were said as it was added).
    sup.host_limit_warnings(false);
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
    let reloads = Reloads::start(sup.clone(), cfg.clone(), reload).map_err(Error::Thread)?;
    let ctl = Arc::new(
        Control::new(sup.clone())
            .with_metrics(metrics_listener.as_ref().map(|(_, a)| *a))
            .with_reloads(reloads.clone()),
    );
    {
        let ctl = ctl.clone();
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || control::serve(control_listener, ctl))
            .map_err(Error::Thread)?;
    }
    if let Some((l, addr)) = metrics_listener {
        let ctl = ctl.clone();
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || {
                metrics::serve(l, move || {
                    let mut s = ctl.sample();
                    if let Some(p) = &procs {
                        s.process = p.sample();
                    }
                    s
                })
            })
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
    tracing::info!(control = %cfg.control.display(), "control socket ready");

    // Every socket listens and every device's state is recovered.
    // Status lines may follow at once: the supervisor has the notifier
    // before READY is sent.
    sup.set_notifier(notifier.clone());
    notify(
        &notifier,
        &format!("READY=1\nSTATUS=serving {} devices", sup.devices().len()),
    );

    let sig = signals.wait(|| reloads.request()).map_err(Error::Signal)?;
    if sup.loop_failed() {
        notify(&notifier, "STOPPING=1");
        drop(files);
        return Err(Error::LoopFailed);
    }
    tracing::info!(signal = sig, "shutting down");
    notify(&notifier, "STOPPING=1");
    sup.stop();
    let _ = looping.join();
    drop(files);
    Ok(sig)
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

/// Before names came from sockets, a device without `name=` was `vzramN`,
/// N its place in the config: that name, for a device named after its
/// socket whose old name no other device has (see
/// [`LegacyState`]).
fn older_name(cfg: &DaemonConfig, spec: &DeviceSpec) -> Option<String> {
    let i = cfg.devices.iter().position(|d| d.name == spec.name)?;
    let old = format!("vzram{i}");
    let derived =
        crate::config::name_from_socket(&spec.socket).as_deref() == Some(spec.name.as_str());
    (derived && old != spec.name && !cfg.devices.iter().any(|d| d.name == old)).then_some(old)
}

/// Every state root the devices use, each checked once: logged with its
/// file system and room, made if missing (under a parent that exists),
/// and cleared of what a crash left half made or half deleted. Those it
/// made are added to `made`.
fn state_roots(cfg: &DaemonConfig, made: &mut Vec<PathBuf>) -> Result<Vec<PathBuf>, Error> {
    let mut roots: Vec<PathBuf> = Vec::new();
    for spec in &cfg.devices {
        let r = spec.state_root(cfg).to_path_buf();
        if !roots.contains(&r) {
            roots.push(r);
        }
    }
    for root in &roots {
        let here: Vec<&DeviceSpec> = cfg
            .devices
            .iter()
            .filter(|d| d.state_root(cfg) == root)
            .collect();
        let fail = |m: String| Error::Device {
            name: here[0].name.clone(),
            source: StoreError::InvalidConfig(m),
        };
        // The built-in default may make its parent (`/run/vzram`); a
        // state dir given is made only under one that exists.
        let parent = cfg
            .state_parent
            .as_ref()
            .filter(|_| root == &cfg.state_dir)
            .map(|p| (p.dir.as_path(), p.mode));
        match vzram_store::state::prepare_root(root, parent) {
            Ok(true) => made.push(root.clone()),
            Ok(false) => {}
            Err(StoreError::InvalidConfig(m)) => return Err(fail(m)),
            Err(e) => return Err(fail(e.to_string())),
        }
        vzram_store::state::finish_removals(root, None);
        let limit: u64 = here
            .iter()
            .map(|d| if d.mem_limit > 0 { d.mem_limit } else { d.size })
            .sum();
        match placement::room(root) {
            Ok(r) if !r.in_memory => tracing::warn!(
                state_dir = %root.display(),
                "the state dir is not on tmpfs: the pool's pages are written to a disk file system (page cache and writeback, not plain memory); use a tmpfs directory"
            ),
            Ok(r) if r.free_bytes < limit => tracing::warn!(
                state_dir = %root.display(),
                free_mib = r.free_bytes >> 20,
                devices_may_store_mib = limit >> 20,
                "the state dir has less room than its devices may store: writes past it fail with an I/O error (\"state dir is full\")"
            ),
            Ok(r) => tracing::info!(
                state_dir = %root.display(),
                free_mib = r.free_bytes >> 20,
                devices_may_store_mib = limit >> 20,
                "state dir"
            ),
            Err(e) => {
                tracing::warn!(state_dir = %root.display(), "cannot inspect the state dir: {e}")
            }
        }
    }
    Ok(roots)
}

/// What [`crate::sys::fds::raise_fd_limit`] must allow: each device holds
/// a listening socket, the guard's private listener and its handle, its
/// state's locked header, its backing file if any, and, while connected,
/// two connections, guest memory files and three eventfds plus an epoll
/// per queue.
fn fds_needed(devices: &[DeviceSpec]) -> u64 {
    64 + devices
        .iter()
        .map(|d| 5 + 8 + 5 * u64::from(d.queues) + u64::from(d.tier.backing_file.is_some()))
        .sum::<u64>()
}
