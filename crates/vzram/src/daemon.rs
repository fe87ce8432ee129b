//! The serving daemon: one pool, one store device per configured disk, one
//! listener thread per socket, and a `VhostUserDaemon` per connection.
//!
//! The store device belongs to the listener, not to the connection: when a
//! frontend goes away (QEMU quits or crashes) its queue threads end, and the
//! next connection on the same socket serves the same data.

use std::ffi::CString;
use std::io::{self, Read};
use std::net::{Shutdown, SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
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
use vzram_blk::guard::{self, Guard, Message, Received};
use vzram_blk::{BlkBackend, BlkDevice};
use vzram_store::{DeviceConfig, Pool, PoolConfig, StateSpec, StoreError};

use crate::config::{DaemonConfig, DeviceSpec, SeccompMode};
use crate::control::{self, Control};
use crate::metrics;
use crate::notify::Notifier;
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
    #[error("metrics address {addr}: {source}")]
    Metrics { addr: SocketAddr, source: io::Error },
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
    seccomp::report_sigbus()?;
    raise_fd_limit(&cfg.devices);
    // Connected now: the seccomp filter allows sending, not connecting.
    // One nobody listens on (left over in a shell) is not worth failing for.
    let notifier = Notifier::from_env().unwrap_or_else(|e| {
        tracing::warn!("NOTIFY_SOCKET: {e}; the service manager will not hear from vzram");
        None
    });

    let pool = Pool::new(PoolConfig {
        host_mem_limit: cfg.host_mem_limit,
        ..PoolConfig::default()
    })?;
    pool.spawn_auto_compaction(COMPACT_INTERVAL, COMPACT_WASTE_RATIO, COMPACT_MIN_WASTE)
        .map_err(Error::Thread)?;

    // Bind everything before serving anything, and before touching any
    // state: a bad path or a socket in use fails the start.
    let mut files = SocketFiles::default();
    let mut listeners = Vec::with_capacity(cfg.devices.len());
    for (i, spec) in cfg.devices.iter().enumerate() {
        let outer = files.bind(&spec.socket, cfg.socket_mode)?;
        let inner = InnerSocket::new(&i.to_string()).map_err(|source| Error::Socket {
            path: spec.socket.clone(),
            source,
        })?;
        listeners.push((outer, inner));
    }

    let mut devices = Vec::with_capacity(cfg.devices.len());
    for spec in &cfg.devices {
        let mut dc = DeviceConfig::new(spec.size, spec.algo);
        dc.mem_limit = spec.mem_limit;
        dc.shards = usize::from(spec.queues);
        dc.state = Some(StateSpec {
            root: spec.state_root(&cfg).to_path_buf(),
            name: spec.name.clone(),
            fresh: cfg.fresh,
        });
        let store = pool.create_device(dc)?;
        let state = store.state_dir().map(|p| p.display().to_string());
        match store.recovery() {
            Some(r) => tracing::info!(
                device = %spec.name,
                state = state.as_deref().unwrap_or("-"),
                pages = r.slots,
                spans = r.spans,
                cut_short = r.unlocked,
                ms = r.micros as f64 / 1000.0,
                "recovered the device from its state"
            ),
            None => {
                tracing::info!(device = %spec.name, state = state.as_deref().unwrap_or("-"), "new device state")
            }
        }
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

    let control_listener = match &cfg.control {
        Some(path) => Some(files.bind(path, cfg.control_mode)?),
        None => None,
    };
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

    for (d, (outer, inner)) in devices.iter().zip(listeners) {
        let d = d.clone();
        std::thread::Builder::new()
            .name(format!("listen-{}", d.spec.name))
            .spawn(move || serve_device(d, outer, inner))
            .map_err(Error::Thread)?;
    }
    let ctl = Arc::new(
        Control::new(pool.clone(), devices.clone())
            .with_metrics(metrics_listener.as_ref().map(|(_, a)| *a)),
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

    // Every socket listens and every device's state is recovered.
    notify(
        &notifier,
        &format!("READY=1\nSTATUS=serving {} devices", devices.len()),
    );

    let sig = signals.wait()?;
    tracing::info!(signal = sig, "shutting down");
    notify(&notifier, "STOPPING=1");
    drop(files);
    Ok(sig)
}

/// Tells the service manager, if there is one; a lost message is logged,
/// not fatal (the devices serve either way).
fn notify(notifier: &Option<Notifier>, msg: &str) {
    if let Some(n) = notifier {
        if let Err(e) = n.send(msg) {
            tracing::warn!("cannot notify the service manager ({msg:?}): {e}");
        }
    }
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
/// listening socket, the guard's private listener and its handle, its
/// state's locked header, and,
/// while connected, two connections, guest memory files and three eventfds
/// plus an epoll per queue; the usual soft limit of 1024 runs out near 170
/// connected devices.
fn raise_fd_limit(devices: &[DeviceSpec]) {
    let need: u64 = 64
        + devices
            .iter()
            .map(|d| 5 + 8 + 5 * u64::from(d.queues))
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

/// How long a frontend may take to send its first message, and to finish
/// any message it has started: a client that connects and says nothing must
/// not keep the device from the next frontend for long.
const FIRST_MESSAGE_WAIT: Duration = Duration::from_secs(10);
const MESSAGE_WAIT: Duration = Duration::from_secs(5);

/// The socket the `vhost` crate accepts from. Only the guard (see
/// [`vzram_blk::guard`]) connects to it, through `/proc/self/fd`: its file
/// is unlinked before it starts listening, so no other process can reach it.
pub struct InnerSocket {
    listener: Listener,
    path: PathBuf,
    _file: OwnedFd,
}

impl InnerSocket {
    /// Made before the seccomp filter is installed (it binds and opens).
    fn new(tag: &str) -> io::Result<InnerSocket> {
        let mut dir = std::env::temp_dir();
        let name = format!(".vzram-{}-{tag}-{:x}", std::process::id(), nanos());
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
        if unsafe { libc::listen(sock.as_raw_fd(), 4) } != 0 {
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

fn sockaddr_un(path: &Path) -> io::Result<libc::sockaddr_un> {
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

/// Accepts frontends on one socket, one at a time, forever.
fn serve_device(dev: Arc<ServedDevice>, listener: UnixListener, mut inner: InnerSocket) {
    let name = dev.spec.name.clone();
    loop {
        // An idle device keeps only this thread: the connection's handler
        // and queue threads are made once a frontend has said something.
        match listener.accept() {
            Ok((stream, _)) => serve_frontend(&dev, &listener, &mut inner, stream),
            Err(e) => {
                tracing::error!(device = %name, "cannot accept a frontend: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Serves one frontend connection: its messages go through the guard to
/// the `vhost` crate, the crate's replies come back, and anyone else who
/// connects meanwhile is turned away at once.
fn serve_frontend(
    dev: &ServedDevice,
    listener: &UnixListener,
    inner: &mut InnerSocket,
    frontend: UnixStream,
) {
    let name = &dev.spec.name;
    let mut guard = Guard::new(
        vzram_blk::config::virtio_features(dev.spec.readonly),
        vzram_blk::config::protocol_features(),
    );
    // The first message decides whether this is a frontend at all: a probe
    // (a second `vzram serve` checking the socket) connects and leaves. A
    // client that has said nothing yet gives way to the next one, so a
    // silent connection cannot keep the VM off its disk.
    let mut frontend = frontend;
    let first = loop {
        match wait_two(
            frontend.as_raw_fd(),
            listener.as_raw_fd(),
            FIRST_MESSAGE_WAIT,
        ) {
            Ok(Ready::First) => break guarded_recv(name, &frontend, &mut guard),
            Ok(Ready::Second) => {
                if let Ok((next, _)) = listener.accept() {
                    tracing::info!(device = %name, "a client that sent nothing gave way to the next one");
                    frontend = next;
                }
            }
            Ok(Ready::Neither) => {
                tracing::info!(device = %name, "a client connected and sent nothing for {FIRST_MESSAGE_WAIT:?}; closed");
                return;
            }
            Err(e) => {
                tracing::warn!(device = %name, "waiting for a frontend's first message: {e}");
                return;
            }
        }
    };
    let Some(first) = first else {
        tracing::debug!(device = %name, "a client connected and left without a request");
        return;
    };

    let backend = Arc::new(BlkBackend::new(dev.blk.clone()));
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
    let mut daemon = match VhostUserDaemon::new(format!("vhost-{name}"), backend, mem) {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(device = %name, "cannot set up the vhost-user daemon: {e}");
            return;
        }
    };
    // Connect first: the crate's accept then finds the connection waiting.
    let to_crate = match inner.connect() {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(device = %name, "cannot reach the vhost-user handler: {e}");
            return;
        }
    };
    if let Err(e) = daemon.start(&mut inner.listener) {
        tracing::error!(device = %name, "cannot start the vhost-user handler: {e}");
        // Our connection may still wait in the backlog: take it out, or the
        // next frontend's handler would be paired with this dead one.
        // (poll, not a non-blocking listener: that is an ioctl the filter refuses)
        drop(to_crate);
        let fd = inner.listener.as_raw_fd();
        while wait_two(fd, fd, Duration::ZERO).is_ok_and(|r| !matches!(r, Ready::Neither)) {
            if !matches!(inner.listener.accept(), Ok(Some(_))) {
                break;
            }
        }
        return;
    }
    let n = dev.connections.fetch_add(1, Ordering::Relaxed) + 1;
    dev.connected.store(true, Ordering::Relaxed);
    tracing::info!(device = %name, connection = n, "frontend connected");

    let end = relay(name, &frontend, &to_crate, listener, &mut guard, first);
    tracing::info!(device = %name, "frontend disconnected ({end}); data kept for the next one");
    // The crate's thread ends once its socket closes.
    let _ = to_crate.shutdown(Shutdown::Both);
    let _ = frontend.shutdown(Shutdown::Both);
    match daemon.wait() {
        Ok(())
        | Err(DaemonError::HandleRequest(
            VhostUserError::Disconnected | VhostUserError::PartialMessage,
        )) => {}
        Err(e) => tracing::debug!(device = %name, "vhost-user handler ended: {e}"),
    }
    // Dropping the daemon stops and joins this connection's queue threads.
    drop(daemon);
    dev.connected.store(false, Ordering::Relaxed);
}

/// Reads one frontend message through the guard; None when the frontend
/// is gone or was refused (logged here).
fn guarded_recv(name: &str, frontend: &UnixStream, guard: &mut Guard) -> Option<Message> {
    match guard::recv_message(frontend, guard, MESSAGE_WAIT) {
        Ok(Received::Message(m)) => Some(m),
        Ok(Received::Closed) => None,
        Ok(Received::Refused(r)) => {
            tracing::warn!(device = %name, "refused a frontend message and closed the connection: {r}");
            None
        }
        Err(e) => {
            tracing::info!(device = %name, "frontend connection: {e}");
            None
        }
    }
}

/// Moves messages both ways until either side closes; returns why it ended.
fn relay(
    name: &str,
    frontend: &UnixStream,
    to_crate: &UnixStream,
    listener: &UnixListener,
    guard: &mut Guard,
    first: Message,
) -> &'static str {
    if guard::send_message(to_crate, &first).is_err() {
        return "handler gone";
    }
    drop(first);
    let mut buf = [0u8; guard::MAX_PAYLOAD + guard::HEADER_LEN];
    let fds = [
        frontend.as_raw_fd(),
        to_crate.as_raw_fd(),
        listener.as_raw_fd(),
    ];
    loop {
        let ready = match poll_many(&fds) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(device = %name, "poll: {e}");
                return "poll failed";
            }
        };
        if ready[1] {
            // Replies carry no descriptors for the features we offer.
            match (&*to_crate).read(&mut buf) {
                Ok(0) | Err(_) => return "handler closed the connection",
                Ok(n) => {
                    if guard::send_all(frontend.as_raw_fd(), &buf[..n], &[], Some(MESSAGE_WAIT))
                        .is_err()
                    {
                        return "frontend stopped reading";
                    }
                }
            }
        }
        if ready[0] {
            match guarded_recv(name, frontend, guard) {
                Some(m) => {
                    if guard::send_message(to_crate, &m).is_err() {
                        return "handler closed the connection";
                    }
                }
                None => return "frontend closed or refused",
            }
        }
        // Someone else knocking. If our frontend has just hung up, let the
        // newcomer wait for the teardown instead (a VMM reconnecting).
        if ready[2] && !hung_up(frontend.as_raw_fd()) {
            turn_away(name, listener);
        }
    }
}

/// Whether the peer of a stream socket has closed its end.
fn hung_up(fd: RawFd) -> bool {
    let mut p = [libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    }];
    poll_fds(&mut p, 0).is_ok_and(|n| n > 0)
}

/// Accepts and closes a connection on a device that already has a
/// frontend (one that has sent a message): it learns at once instead of
/// hanging.
fn turn_away(name: &str, listener: &UnixListener) {
    if let Ok((s, _)) = listener.accept() {
        tracing::warn!(device = %name, "refused a second frontend: the device already has one");
        drop(s);
    }
}

enum Ready {
    First,
    Second,
    Neither,
}

fn wait_two(a: RawFd, b: RawFd, timeout: Duration) -> io::Result<Ready> {
    let mut p = [a, b].map(|fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    });
    let rc = poll_fds(&mut p, timeout.as_millis() as i32)?;
    Ok(if rc == 0 {
        Ready::Neither
    } else if p[0].revents != 0 {
        Ready::First
    } else {
        Ready::Second
    })
}

/// Which of `fds` are readable (or hung up), waiting as long as it takes.
fn poll_many(fds: &[RawFd; 3]) -> io::Result<[bool; 3]> {
    let mut p = fds.map(|fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    });
    poll_fds(&mut p, -1)?;
    Ok(p.map(|p| p.revents != 0))
}

fn poll_fds(p: &mut [libc::pollfd], ms: i32) -> io::Result<i32> {
    loop {
        // SAFETY: valid pollfds owned by the caller for the whole call.
        let rc = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
        if rc >= 0 {
            return Ok(rc);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
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
