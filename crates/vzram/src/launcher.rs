//! The launcher: a small process that starts worker processes for the
//! supervisor and reports how they end.
//!
//! The supervisor runs under a seccomp filter that forbids `execve` and
//! `fork`, and a filter is inherited by every child. So before installing
//! it, the supervisor starts the launcher (a fresh `exec` of its own binary,
//! with no filter) and from then on only sends it requests: "start a worker
//! with these descriptors". The launcher reads nothing else, from no one
//! else. Each worker installs its own, tighter filter once set up.
//!
//! Messages are JSON, one per datagram, on a `SOCK_SEQPACKET` pair;
//! descriptors travel with `SCM_RIGHTS`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command};

use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// Where the launcher and each worker find their inherited descriptors.
pub const FIRST_FD: RawFd = 3;

/// The biggest message either side sends.
const MAX_MESSAGE: usize = 64 << 10;

#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// Start `vzram <args>` with the descriptors sent along placed at 3, 4, …
    Spawn { id: u64, args: Vec<String> },
    /// Bind a device socket and open (or make) its state, and open and
    /// lock its backing file if it has one, for a device added at run
    /// time: the supervisor may do none of it under its filter. The reply
    /// carries the listener, the state's four files and the backing file.
    Prepare {
        id: u64,
        socket: PathBuf,
        mode: u32,
        root: PathBuf,
        name: String,
        size: u64,
        algo: String,
        shards: usize,
        backing: Option<PathBuf>,
        /// An incoming device's migration address, bound too (last fd).
        #[serde(default)]
        incoming: Option<crate::migration::Addr>,
    },
    /// Connect to another vzram's migration address; the reply carries
    /// the connection.
    Connect {
        id: u64,
        addr: crate::migration::Addr,
    },
    /// Remove a device's socket file (only if it is a socket) and its state
    /// directory (only if it holds a vzram state nobody has locked).
    Remove {
        id: u64,
        socket: Option<PathBuf>,
        state: Option<PathBuf>,
    },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum Report {
    Spawned {
        id: u64,
        pid: u32,
    },
    Failed {
        id: u64,
        error: String,
    },
    Exited {
        id: u64,
        pid: u32,
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// Descriptors: listener, state lock (header), table, arena, stats,
    /// and the backing file when there is one.
    Prepared {
        id: u64,
        dir: PathBuf,
        existing: bool,
        backing: Option<PreparedBacking>,
    },
    Removed {
        id: u64,
    },
    /// Descriptor: the connection.
    Connected {
        id: u64,
    },
}

/// What opening a backing file found.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct PreparedBacking {
    pub direct: bool,
    pub blocks: u64,
}

impl Report {
    pub fn id(&self) -> u64 {
        match self {
            Report::Spawned { id, .. }
            | Report::Failed { id, .. }
            | Report::Exited { id, .. }
            | Report::Prepared { id, .. }
            | Report::Removed { id }
            | Report::Connected { id } => *id,
        }
    }
}

/// A connected `SOCK_SEQPACKET` pair, close-on-exec.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: socketpair fills the two ints we own; checked below.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created for us.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Sends one message with descriptors.
pub fn send(sock: &impl AsRawFd, msg: &impl Serialize, fds: &[RawFd]) -> io::Result<()> {
    let bytes = serde_json::to_vec(msg).map_err(io::Error::other)?;
    vzram_blk::guard::send_all(sock.as_raw_fd(), &bytes, fds, None)
}

/// Receives one message and its descriptors; None once the peer is gone.
pub fn recv<T: DeserializeOwned>(sock: &impl AsRawFd) -> io::Result<Option<(T, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut fds = Vec::new();
    let (n, _) = vzram_blk::guard::recv_some(sock.as_raw_fd(), &mut buf, &mut fds)?;
    if n == 0 {
        return Ok(None);
    }
    let msg = serde_json::from_slice(&buf[..n]).map_err(io::Error::other)?;
    Ok(Some((msg, fds)))
}

/// Starts the launcher; returns the supervisor's end of its socket. Call
/// it before any thread starts and before the seccomp filter.
pub fn start() -> io::Result<OwnedFd> {
    let (ours, theirs) = seqpacket_pair()?;
    let child_fd = theirs.as_raw_fd();
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg("__launcher");
    // SAFETY: between fork and exec only async-signal-safe calls: dup2
    // places the socket at FIRST_FD (clearing close-on-exec), prctl makes
    // the launcher die with the supervisor.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(child_fd, FIRST_FD) < 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()?;
    drop(theirs);
    Ok(ours)
}

/// The launcher's main loop: start workers when asked, report their ends,
/// exit when the supervisor goes away.
pub fn run() -> io::Result<()> {
    // SAFETY: FIRST_FD was placed by the supervisor for us alone.
    let sock = unsafe { OwnedFd::from_raw_fd(FIRST_FD) };
    // Ctrl-C in a terminal reaches the whole process group; the supervisor
    // decides when workers stop, not the terminal.
    // SAFETY: ignoring signals changes no memory.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
    }
    // SAFETY: prctl on this process: a name `ps` shows, and no privilege
    // gained through exec for anything it starts.
    unsafe {
        libc::prctl(libc::PR_SET_NAME, c"vzram-launch".as_ptr());
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
    }
    let sigchld = ChildSignals::new()?;
    let mut children: Vec<(u64, Child)> = Vec::new();
    loop {
        let mut p = [
            libc::pollfd {
                fd: sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: sigchld.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two pollfds we own.
        let rc = unsafe { libc::poll(p.as_mut_ptr(), 2, -1) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if p[1].revents != 0 {
            sigchld.drain();
            reap(&sock, &mut children)?;
        }
        if p[0].revents != 0 {
            match recv::<Request>(&sock)? {
                None => return Ok(()),
                Some((Request::Spawn { id, args }, fds)) => {
                    let report = match spawn(&args, fds) {
                        Ok(child) => {
                            let pid = child.id();
                            children.push((id, child));
                            Report::Spawned { id, pid }
                        }
                        Err(e) => Report::Failed {
                            id,
                            error: e.to_string(),
                        },
                    };
                    send(&sock, &report, &[])?;
                }
                Some((
                    Request::Prepare {
                        id,
                        socket,
                        mode,
                        root,
                        name,
                        size,
                        algo,
                        shards,
                        backing,
                        incoming,
                    },
                    _,
                )) => match prepare(&socket, mode, root, name, size, &algo, shards, backing)
                    .and_then(|p| match &incoming {
                        None => Ok((p, None)),
                        Some(a) => match a.bind(mode) {
                            Ok(fd) => Ok((p, Some(fd))),
                            Err(e) => {
                                drop(p);
                                let _ = std::fs::remove_file(&socket);
                                Err(e)
                            }
                        },
                    }) {
                    Ok(((listener, st, backing), incoming)) => {
                        let mut fds = vec![
                            listener.as_raw_fd(),
                            st.lock.as_raw_fd(),
                            st.table.as_raw_fd(),
                            st.arena.as_raw_fd(),
                            st.stats.as_raw_fd(),
                        ];
                        fds.extend(backing.as_ref().map(|b| b.file().as_raw_fd()));
                        fds.extend(incoming.as_ref().map(|l| l.as_raw_fd()));
                        let r = Report::Prepared {
                            id,
                            dir: st.dir.clone(),
                            existing: st.existing,
                            backing: backing.as_ref().map(|b| PreparedBacking {
                                direct: b.direct(),
                                blocks: b.blocks(),
                            }),
                        };
                        send(&sock, &r, &fds)?;
                    }
                    Err(error) => send(&sock, &Report::Failed { id, error }, &[])?,
                },
                Some((Request::Connect { id, addr }, _)) => match addr.connect() {
                    Ok(conn) => send(&sock, &Report::Connected { id }, &[conn.as_raw_fd()])?,
                    Err(e) => send(
                        &sock,
                        &Report::Failed {
                            id,
                            error: e.to_string(),
                        },
                        &[],
                    )?,
                },
                Some((Request::Remove { id, socket, state }, _)) => {
                    let r = match remove(socket.as_deref(), state.as_deref()) {
                        Ok(()) => Report::Removed { id },
                        Err(error) => Report::Failed { id, error },
                    };
                    send(&sock, &r, &[])?;
                }
            }
        }
    }
}

type Prepared = (
    std::os::unix::net::UnixListener,
    vzram_store::StateFiles,
    Option<vzram_store::Backing>,
);

#[allow(clippy::too_many_arguments)]
fn prepare(
    socket: &std::path::Path,
    mode: u32,
    root: PathBuf,
    name: String,
    size: u64,
    algo: &str,
    shards: usize,
    backing: Option<PathBuf>,
) -> Result<Prepared, String> {
    let codec = crate::config::parse_codec(algo)?;
    let listener = crate::daemon::bind_socket(socket, mode).map_err(|e| e.to_string())?;
    // Before the state: a missing or locked backing file leaves nothing
    // made behind but the socket, removed below.
    let backing = match backing {
        None => None,
        Some(path) => match vzram_store::Backing::open(&vzram_store::BackingSpec { path }) {
            Ok(b) => Some(b),
            Err(e) => {
                drop(listener);
                let _ = std::fs::remove_file(socket);
                return Err(e.to_string());
            }
        },
    };
    let mut dc = vzram_store::DeviceConfig::new(size, codec);
    dc.shards = shards;
    dc.state = Some(vzram_store::StateSpec {
        root,
        name,
        fresh: false,
    });
    match vzram_store::device::open_state(&dc) {
        Ok(st) => Ok((listener, st, backing)),
        Err(e) => {
            drop(listener);
            let _ = std::fs::remove_file(socket);
            Err(e.to_string())
        }
    }
}

fn remove(socket: Option<&std::path::Path>, state: Option<&std::path::Path>) -> Result<(), String> {
    use std::os::unix::fs::FileTypeExt;
    if let Some(p) = socket {
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.file_type().is_socket() => {
                std::fs::remove_file(p).map_err(|e| format!("{}: {e}", p.display()))?
            }
            Ok(_) => return Err(format!("{} is not a socket; left alone", p.display())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{}: {e}", p.display())),
        }
    }
    if let Some(dir) = state {
        vzram_store::state::remove(dir).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn reap(sock: &OwnedFd, children: &mut Vec<(u64, Child)>) -> io::Result<()> {
    let mut i = 0;
    while i < children.len() {
        match children[i].1.try_wait() {
            Ok(Some(status)) => {
                let (id, child) = children.swap_remove(i);
                send(
                    sock,
                    &Report::Exited {
                        id,
                        pid: child.id(),
                        code: status.code(),
                        signal: status.signal(),
                    },
                    &[],
                )?;
            }
            _ => i += 1,
        }
    }
    Ok(())
}

fn spawn(args: &[String], fds: Vec<OwnedFd>) -> io::Result<Child> {
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let mut cmd = Command::new("/proc/self/exe");
    cmd.args(args);
    // SAFETY: between fork and exec only async-signal-safe calls. The
    // descriptors are first moved above every target number, so placing
    // one never overwrites another still to be placed.
    unsafe {
        cmd.pre_exec(move || {
            let high = FIRST_FD + raw.len() as RawFd + 64;
            let mut moved = [0 as RawFd; 32];
            for (i, &fd) in raw.iter().enumerate().take(32) {
                let m = libc::fcntl(fd, libc::F_DUPFD, high);
                if m < 0 {
                    return Err(io::Error::last_os_error());
                }
                moved[i] = m;
            }
            for (i, &m) in moved.iter().enumerate().take(raw.len().min(32)) {
                if libc::dup2(m, FIRST_FD + i as RawFd) < 0 {
                    return Err(io::Error::last_os_error());
                }
                libc::close(m);
            }
            // A worker outlives neither the launcher nor (so) the supervisor.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn();
    drop(fds);
    child
}

/// SIGCHLD as a readable descriptor.
struct ChildSignals {
    fd: OwnedFd,
}

impl ChildSignals {
    fn new() -> io::Result<ChildSignals> {
        // SAFETY: sigset_t is plain data; blocking SIGCHLD in this
        // single-threaded process and reading it from a signalfd instead.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGCHLD);
            if libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
            let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(ChildSignals {
                fd: OwnedFd::from_raw_fd(fd),
            })
        }
    }

    fn drain(&self) {
        let mut info = [0u8; 128];
        // SAFETY: reading whole signalfd_siginfo records into our buffer.
        while unsafe { libc::read(self.fd.as_raw_fd(), info.as_mut_ptr().cast(), info.len()) } > 0 {
        }
    }
}
