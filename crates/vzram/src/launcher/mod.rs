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
//! It only starts processes and sets up files; it never does network I/O,
//! which could wedge its one thread and with it every worker start. A
//! connection the supervisor asks for is made by a short-lived helper it
//! forks (see [`connect`]), which answers the requester directly. The
//! launcher runs without a seccomp filter (it must fork and exec).
//!
//! Messages are `proto::launch`'s, framed by `proto::wire`.

mod connect;
mod held;

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use vzram_store::{Codec, Existing, StateSpec};

use crate::owner::attach::device_config;
use crate::owner::placement;
use crate::proto::launch::{PreparedBacking, PreparedFds, Report, Request};
use crate::proto::wire::{recv, send, FIRST_FD};
use crate::sys::signals::ChildSignals;
use crate::sys::socket;

/// The launcher's main loop: start workers when asked, report their ends,
/// exit when the supervisor goes away. `config`: the configuration file
/// the daemon was started with, the one file [`Request::OpenConfig`] opens.
pub fn run(config: Option<PathBuf>) -> io::Result<()> {
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
    let mut helpers = connect::Helpers::default();
    let mut held = held::Held::new(config.clone());
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
        let rc = unsafe { libc::poll(p.as_mut_ptr(), 2, helpers.poll_timeout()) };
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
            helpers.reap();
        }
        helpers.kill_overdue();
        if p[0].revents != 0 {
            let Some((req, fds)) = recv::<Request>(&sock)? else {
                return Ok(());
            };
            if !matches!(req, Request::Started { .. }) {
                held.seal();
            }
            match (req, fds) {
                (
                    Request::Started {
                        state_dir,
                        roots,
                        sockets,
                        states,
                    },
                    _,
                ) => {
                    if !held.start(&state_dir, &roots, &sockets, &states) {
                        tracing::warn!("a second account of the daemon's start, or one after other requests: ignored");
                    }
                }
                (Request::Ping { id }, _) => send(&sock, &Report::Pong { id }, &[])?,
                (Request::Spawn { id, args }, fds) => {
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
                (
                    Request::Prepare {
                        id,
                        socket: path,
                        mode,
                        state,
                        size,
                        algo,
                        shards,
                        backing,
                        incoming,
                        incoming_mode,
                    },
                    _,
                ) => match held
                    .check_root(&state.root)
                    .map_err(OrderError::from)
                    .and_then(|()| prepare(&path, mode, state, size, algo, shards, backing))
                    .and_then(|p| match &incoming {
                        None => Ok((p, None)),
                        Some(a) => match socket::bind(a, incoming_mode) {
                            Ok(fd) => Ok((p, Some(fd))),
                            Err(e) => {
                                drop(p);
                                let _ = std::fs::remove_file(&path);
                                Err(e.into())
                            }
                        },
                    }) {
                    Ok(((listener, st, backing), incoming)) => {
                        held.prepared(&path, &st.dir);
                        let fds = PreparedFds {
                            listener: listener.as_raw_fd(),
                            lock: st.lock.as_raw_fd(),
                            table: st.table.as_raw_fd(),
                            arena: st.arena.as_raw_fd(),
                            stats: st.stats.as_raw_fd(),
                            backing: backing.as_ref().map(|b| b.file().as_raw_fd()),
                            incoming: incoming.as_ref().map(|l| l.as_raw_fd()),
                        }
                        .in_order();
                        let r = Report::Prepared {
                            id,
                            dir: st.dir.clone(),
                            existing: st.existing,
                            replaced: st.replaced,
                            backing: backing.as_ref().map(|b| PreparedBacking {
                                direct: b.direct(),
                                blocks: b.blocks(),
                            }),
                        };
                        send(&sock, &r, &fds)?;
                    }
                    Err(e) => send(
                        &sock,
                        &Report::Failed {
                            id,
                            error: e.to_string(),
                        },
                        &[],
                    )?,
                },
                (Request::Connect { id, addr, wait_ms }, fds) => {
                    // The answer goes on the socket sent along, not ours;
                    // without one there is no one to answer.
                    match <[OwnedFd; 1]>::try_from(fds) {
                        Ok([reply]) => helpers.start(
                            sock.as_raw_fd(),
                            id,
                            &addr,
                            Duration::from_millis(wait_ms),
                            reply,
                        ),
                        Err(fds) => {
                            tracing::warn!(
                                id,
                                fds = fds.len(),
                                "a connect request without one reply socket; ignored"
                            )
                        }
                    }
                }
                (
                    Request::Remove {
                        id,
                        socket,
                        state,
                        expect,
                    },
                    _,
                ) => {
                    let r = match remove(&mut held, socket.as_deref(), state.as_deref(), expect) {
                        Ok(()) => Report::Removed { id },
                        Err(e) => Report::Failed {
                            id,
                            error: e.to_string(),
                        },
                    };
                    send(&sock, &r, &[])?;
                }
                (Request::OpenConfig { id }, _) => match open_config(config.as_deref()) {
                    Ok(f) => send(&sock, &Report::Opened { id }, &[f.as_raw_fd()])?,
                    Err(e) => send(
                        &sock,
                        &Report::Failed {
                            id,
                            error: e.to_string(),
                        },
                        &[],
                    )?,
                },
            }
        }
    }
}

/// Why [`Request::OpenConfig`] got no file.
#[derive(Debug, thiserror::Error)]
enum OpenConfigError {
    #[error(
        "the daemon was started without a configuration file (--config); there is none to read"
    )]
    NoConfig,
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
}

/// Opens the configuration file the launcher was started with; there is
/// no other file it opens for reading on request.
fn open_config(config: Option<&Path>) -> Result<std::fs::File, OpenConfigError> {
    let path = config.ok_or(OpenConfigError::NoConfig)?;
    open_regular(path).map_err(|source| OpenConfigError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Opens `path` read-only if it is a regular file. Without blocking: a
/// FIFO given as the configuration file would hold up the launcher.
fn open_regular(path: &Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(f)
}

/// Why the launcher could not carry out a `Prepare` or a `Remove`; its
/// text goes back to the supervisor in `Report::Failed`.
#[derive(Debug, thiserror::Error)]
enum OrderError {
    #[error(transparent)]
    Placement(#[from] placement::PlacementError),
    #[error(transparent)]
    Socket(#[from] socket::SocketError),
    #[error(transparent)]
    Store(#[from] vzram_store::StoreError),
    #[error("{0} queues")]
    Queues(usize),
    #[error("{}: not the state that was listed (made again or gone since); left alone", .0.display())]
    NotListed(PathBuf),
    #[error("{} is not a socket; left alone", .0.display())]
    NotASocket(PathBuf),
    #[error(transparent)]
    Held(#[from] held::Refused),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

type Prepared = (
    std::os::unix::net::UnixListener,
    vzram_store::StateFiles,
    Option<vzram_store::Backing>,
);

fn prepare(
    path: &Path,
    mode: u32,
    state: StateSpec,
    size: u64,
    algo: Codec,
    shards: usize,
    backing: Option<PathBuf>,
) -> Result<Prepared, OrderError> {
    placement::check(
        path,
        &state.root.join(&state.name),
        state.existing == Existing::Discard,
        state.adopt,
    )?;
    let listener = socket::bind_socket(path, mode)?;
    // Before the state: a missing or locked backing file leaves nothing
    // made behind but the socket, removed below.
    let backing = match backing {
        None => None,
        Some(file) => match vzram_store::Backing::open(&vzram_store::BackingSpec { path: file }) {
            Ok(b) => Some(b),
            Err(e) => {
                drop(listener);
                let _ = std::fs::remove_file(path);
                return Err(e.into());
            }
        },
    };
    let queues = u16::try_from(shards).map_err(|_| OrderError::Queues(shards))?;
    let mut dc = device_config(size, algo, queues, 0);
    dc.state = Some(state);
    let opened = vzram_store::device::open_state(&dc).and_then(|st| {
        if let Some(b) = &backing {
            vzram_store::device::check_claim_or_undo(b, &st)?;
        }
        Ok(st)
    });
    match opened {
        Ok(st) => {
            if let Err(e) = placement::record(path, &st.dir) {
                tracing::warn!(socket = %path.display(), "cannot record where the state is beside the socket: {e}");
            }
            Ok((listener, st, backing))
        }
        Err(e) => {
            drop(listener);
            let _ = std::fs::remove_file(path);
            Err(e.into())
        }
    }
}

fn remove(
    held: &mut held::Held,
    socket: Option<&Path>,
    state: Option<&Path>,
    expect: Option<u64>,
) -> Result<(), OrderError> {
    held.check_remove(socket, state)?;
    if let (Some(dir), Some(id)) = (state, expect) {
        if vzram_store::Leftover::read(dir).map(|l| l.creation_id) != Some(id) {
            return Err(OrderError::NotListed(dir.to_path_buf()));
        }
    }
    let io = |p: &Path| {
        let path = p.to_path_buf();
        move |source| OrderError::Io { path, source }
    };
    use std::os::unix::fs::FileTypeExt;
    if let Some(p) = socket {
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.file_type().is_socket() => std::fs::remove_file(p).map_err(io(p))?,
            Ok(_) => return Err(OrderError::NotASocket(p.to_path_buf())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(p)(e)),
        }
        held.removed(Some(p), None);
    }
    if let Some(dir) = state {
        let made_for = vzram_store::Leftover::read(dir).and_then(|l| l.socket);
        vzram_store::state::remove(dir)?;
        held.removed(None, Some(dir));
        if let Some(p) = socket {
            placement::forget(p);
        }
        // A left-over's marker beside its socket, if it names this state.
        if let Some(p) = made_for.filter(|p| placement::recorded(p).as_deref() == Some(dir)) {
            placement::forget(&p);
        }
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

/// Starts a worker, `vzram __worker SPEC`, and nothing else: any other
/// command line of the binary (`backing init --force`, a `serve` of its
/// own) would do with paths what the orders are kept from doing.
fn spawn(args: &[String], fds: Vec<OwnedFd>) -> io::Result<Child> {
    if !matches!(args, [cmd, _spec] if cmd == "__worker") {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the launcher starts workers only (`__worker SPEC`)",
        ));
    }
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
