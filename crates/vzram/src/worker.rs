//! A worker: the process that serves one frontend connection of one device.
//!
//! The supervisor accepts the connection and has the launcher start
//! `vzram __worker SPEC` with these descriptors (see [`Fds`]): its control
//! channel, the host budget, the device's locked state files and the
//! connection. Nothing is opened by path. The worker recovers the device
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
use vzram_blk::{BlkBackend, BlkDevice};
use vzram_store::{Device, DeviceConfig, Pool, PoolConfig, StateFiles, StoreError};

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
}

/// Messages on the control channel, supervisor to worker.
#[derive(Debug, Serialize, Deserialize)]
pub enum Order {
    Compact,
}

/// And back.
#[derive(Debug, Serialize, Deserialize)]
pub enum Answer {
    Compacted { pages: u64 },
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
    let codec = crate::config::parse_codec(&spec.algo).map_err(WorkerError::Setup)?;
    let pool = Pool::with_host_file(PoolConfig::default(), &host)?;
    let mut dc = DeviceConfig::new(spec.size, codec);
    dc.mem_limit = spec.mem_limit;
    dc.shards = usize::from(spec.queues);
    let store = pool.attach_device(dc, files, None)?;
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
    let backend = Arc::new(BlkBackend::new(blk));
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
    let mut daemon = VhostUserDaemon::new(format!("vhost-{}", spec.name), backend, mem)
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
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || control_loop(control, store))
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
            relay(&frontend, &to_crate, &mut guard, first)
        }
        None => "frontend left before its first message",
    };
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
    Ok(())
}

/// Answers the supervisor; publishes gauges meanwhile. The supervisor
/// closing the channel (it is stopping, or gone) ends the worker: the
/// device's state is in the shared files, so there is nothing to save.
fn control_loop(control: UnixStream, store: Arc<Device>) {
    loop {
        store.stats();
        match guard::wait_fd(control.as_raw_fd(), libc::POLLIN, Some(PUBLISH_EVERY)) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(_) => std::process::exit(EXIT_DONE),
        }
        match launcher::recv::<Order>(&control) {
            Ok(Some((Order::Compact, _))) => {
                let pages = store.compact();
                store.stats();
                if launcher::send(&control, &Answer::Compacted { pages }, &[]).is_err() {
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
) -> &'static str {
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
                    if guard::send_message(to_crate, &m).is_err() {
                        return "handler closed the connection";
                    }
                }
                None => return "frontend closed or refused",
            }
        }
    }
}
