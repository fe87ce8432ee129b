//! Unix sockets: binding a listener safely, connecting to a migration
//! address with a deadline, and the small polls the supervisor makes on its sockets.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::proto::addr::Addr;
use crate::proto::launch::ConnectError;

/// A socket that cannot be bound (or connected), with its path.
#[derive(Debug, Error)]
#[error("socket {path}: {source}")]
pub struct SocketError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

impl SocketError {
    /// Whether the fix is in the configuration (a path, a port, another
    /// daemon already there), so a restart would fail the same way.
    pub fn is_config(&self) -> bool {
        use io::ErrorKind::*;
        matches!(
            self.source.kind(),
            NotFound
                | NotADirectory
                | InvalidInput
                | AlreadyExists
                | AddrInUse
                | AddrNotAvailable
                | PermissionDenied
        )
    }
}

/// Room for a unix socket's path: `sun_path` less its terminating NUL.
pub const MAX_SOCKET_PATH: usize = 107;

/// What can be told of a socket path before binding it: its length, and
/// that its directory is there (the kernel's errors say neither plainly).
pub fn check_path(path: &Path) -> Result<(), SocketError> {
    let fail = |kind, msg: String| SocketError {
        path: path.to_path_buf(),
        source: io::Error::new(kind, msg),
    };
    let n = path.as_os_str().len();
    if n > MAX_SOCKET_PATH {
        return Err(fail(
            io::ErrorKind::InvalidInput,
            format!("the path is {n} bytes, and a unix socket's path may have {MAX_SOCKET_PATH} at most"),
        ));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(fail(
            io::ErrorKind::NotADirectory,
            format!("{} is not a directory", dir.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(fail(
            io::ErrorKind::NotFound,
            format!("its directory {} does not exist", dir.display()),
        )),
        Err(e) => Err(fail(
            e.kind(),
            format!("its directory {}: {e}", dir.display()),
        )),
    }
}

/// Creates a listening socket with the given mode. A stale socket file from
/// a daemon that died is replaced; a live one is an error.
pub fn bind_socket(path: &Path, mode: u32) -> Result<UnixListener, SocketError> {
    let fail = |source: io::Error| SocketError {
        path: path.to_path_buf(),
        source,
    };
    check_path(path)?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if listened_on(path) {
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

/// Removes the `control.PID.sock` files in `dir` that nobody listens on:
/// what daemons that took a second control socket there and were killed
/// left behind.
pub fn remove_stale_controls(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let numbered = name
            .strip_prefix("control.")
            .and_then(|n| n.strip_suffix(".sock"))
            .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()));
        let is_socket = e.file_type().is_ok_and(|t| t.is_socket());
        if numbered && is_socket && !listened_on(&e.path()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Whether a process listens on the unix socket at `path`, found without
/// waiting: a non-blocking connect succeeds or, with the backlog full,
/// fails with EAGAIN; a stale socket file refuses.
fn listened_on(path: &Path) -> bool {
    let Ok(sa) = sockaddr_un(path) else {
        return false;
    };
    let Ok(fd) = unix_stream_socket(libc::SOCK_NONBLOCK) else {
        return false;
    };
    match connect_raw(&fd, &sa) {
        Ok(()) => true,
        Err(e) => e.raw_os_error() == Some(libc::EAGAIN),
    }
}

/// A new unix stream socket (close-on-exec, plus `flags`).
fn unix_stream_socket(flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: socket() makes a new descriptor, owned at once below.
    let raw = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | flags,
            0,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just created, ours alone.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn connect_raw(fd: &OwnedFd, sa: &libc::sockaddr_un) -> io::Result<()> {
    // SAFETY: a sockaddr_un we built, with its true size.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            std::ptr::from_ref(sa).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Connects to a migration address within `wait`, name resolution
/// included (which cannot be interrupted: only the launcher's connecting
/// helper calls this, and it is killed if it overstays). The connection
/// returned blocks, as the stream's sender expects.
pub fn connect(addr: &Addr, wait: Duration) -> Result<OwnedFd, ConnectError> {
    let deadline = Instant::now() + wait;
    let late = ConnectError::Deadline {
        ms: wait.as_millis() as u64,
    };
    match addr {
        Addr::Unix(p) => connect_unix(p, deadline, late),
        Addr::Tcp(hp) => {
            let addrs: Vec<SocketAddr> = hp
                .to_socket_addrs()
                .map_err(|e| ConnectError::Resolve {
                    host: hp.clone(),
                    error: e.to_string(),
                })?
                .collect();
            let mut last = ConnectError::NoAddress { host: hp.clone() };
            // Every address in turn; again while all refuse (no listener
            // yet), until the deadline.
            loop {
                let mut refused = !addrs.is_empty();
                for a in &addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(late);
                    }
                    // Non-blocking connect and poll inside, for what is left
                    // of the one deadline.
                    match TcpStream::connect_timeout(a, left) {
                        Ok(s) => {
                            let _ = s.set_nodelay(true);
                            return Ok(s.into());
                        }
                        Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                            refused = false;
                            last = late.clone();
                        }
                        Err(e) => {
                            refused &= e.raw_os_error() == Some(libc::ECONNREFUSED);
                            last = os_error(&e);
                        }
                    }
                }
                if refused && deadline.saturating_duration_since(Instant::now()) <= NOT_YET {
                    return Err(not_listening(late, libc::ECONNREFUSED));
                }
                if !refused {
                    break;
                }
                std::thread::sleep(NOT_YET);
            }
            Err(last)
        }
    }
}

/// A destination that never listened within the deadline `late` gives.
fn not_listening(late: ConnectError, errno: i32) -> ConnectError {
    match late {
        ConnectError::Deadline { ms } => ConnectError::NotListening { ms, errno },
        e => e,
    }
}

fn os_error(e: &io::Error) -> ConnectError {
    match e.raw_os_error() {
        Some(errno) => ConnectError::Os { errno },
        None => ConnectError::Other {
            error: e.to_string(),
        },
    }
}

/// A unix socket's connect cannot complete in the background: made
/// non-blocking it fails with EAGAIN while the listener's backlog is full,
/// and nothing polls ready when room appears. A send timeout bounds the
/// kernel's wait for room instead, and is cleared once connected.
fn connect_unix(
    path: &Path,
    deadline: Instant,
    late: ConnectError,
) -> Result<OwnedFd, ConnectError> {
    let sa = sockaddr_un(path).map_err(|_| ConnectError::PathTooLong)?;
    let fd = unix_stream_socket(0).map_err(|e| os_error(&e))?;
    // What the last try met, if nobody listened: said at the deadline
    // even when a wait between tries overran it (a busy host).
    let mut absent = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // A zero timeout would mean "wait forever".
        if left < Duration::from_millis(1) {
            return Err(match absent {
                Some(errno) => not_listening(late, errno),
                None => late,
            });
        }
        set_send_timeout(&fd, Some(left)).map_err(|e| os_error(&e))?;
        let Err(e) = connect_raw(&fd, &sa) else {
            set_send_timeout(&fd, None).map_err(|e| os_error(&e))?;
            return Ok(fd);
        };
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            // The backlog stayed full until the timeout.
            Some(libc::EAGAIN) | Some(libc::EINPROGRESS) => return Err(late),
            // Not there yet (libvirt starts the sender before the
            // destination device exists): again, until the deadline.
            Some(errno @ (libc::ENOENT | libc::ECONNREFUSED)) if left > NOT_YET => {
                absent = Some(errno);
                std::thread::sleep(NOT_YET)
            }
            Some(errno @ (libc::ENOENT | libc::ECONNREFUSED)) => {
                return Err(not_listening(late, errno))
            }
            _ => return Err(os_error(&e)),
        }
    }
}

/// How long a connect to an address with no listener yet waits before it
/// tries again.
const NOT_YET: Duration = Duration::from_millis(100);

fn set_send_timeout(fd: &OwnedFd, t: Option<Duration>) -> io::Result<()> {
    let t = t.unwrap_or(Duration::ZERO);
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: t.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: a timeval we own, with its size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            std::ptr::addr_of!(tv).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Binds a listener for an incoming device (`mode` for a unix socket).
/// TCP binds only here, when an address asks for it.
pub fn bind(addr: &Addr, mode: u32) -> Result<OwnedFd, SocketError> {
    match addr {
        Addr::Unix(p) => bind_socket(p, mode).map(OwnedFd::from),
        Addr::Tcp(hp) => TcpListener::bind(hp.as_str())
            .map(OwnedFd::from)
            .map_err(|source| SocketError {
                path: PathBuf::from(addr.to_string()),
                source,
            }),
    }
}

/// Whether the peer of a stream socket has closed its end.
pub fn hung_up(fd: RawFd) -> bool {
    let mut p = [libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    }];
    // SAFETY: one pollfd we own.
    unsafe { libc::poll(p.as_mut_ptr(), 1, 0) > 0 }
}

/// Whether a socket has something to read (or has closed), now.
pub fn readable(fd: RawFd) -> bool {
    vzram_blk::guard::wait_fd(fd, libc::POLLIN, Some(Duration::ZERO)).unwrap_or(false)
}

pub fn sockaddr_un(path: &Path) -> io::Result<libc::sockaddr_un> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_unix_connect_to_a_full_backlog_ends_at_its_deadline() {
        let dir = std::env::temp_dir().join(format!("vzram-connect-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("full.sock");
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).unwrap();
        // SAFETY: listen() again on our own listener only lowers its backlog.
        assert_eq!(unsafe { libc::listen(l.as_raw_fd(), 0) }, 0);
        let addr = Addr::Unix(path.clone());
        // Fill the backlog: connects that each give up soon.
        let mut held = Vec::new();
        loop {
            match connect(&addr, Duration::from_millis(50)) {
                Ok(c) => held.push(c),
                Err(ConnectError::Deadline { .. }) => break,
                Err(e) => panic!("{e}"),
            }
            assert!(held.len() < 16, "the backlog never filled");
        }
        let t = Instant::now();
        let r = connect(&addr, Duration::from_millis(300));
        let took = t.elapsed();
        assert_eq!(r.err(), Some(ConnectError::Deadline { ms: 300 }));
        assert!(
            // Ended by its deadline, not hung (a busy host may be late).
            took >= Duration::from_millis(290) && took < Duration::from_secs(30),
            "{took:?}"
        );
        // Nobody listening any more: tried again until the deadline (a
        // destination may not listen yet), then said so.
        drop((l, held));
        let r = connect(&addr, Duration::from_millis(500));
        assert_eq!(
            r.err(),
            Some(ConnectError::NotListening {
                ms: 500,
                errno: libc::ECONNREFUSED
            })
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn binding_over_a_live_socket_with_a_full_backlog_is_refused_at_once() {
        let dir = std::env::temp_dir().join(format!("vzram-bind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("live.sock");
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).unwrap();
        // SAFETY: listen() again on our own listener only lowers its backlog.
        assert_eq!(unsafe { libc::listen(l.as_raw_fd(), 0) }, 0);
        let addr = Addr::Unix(path.clone());
        let mut held = Vec::new();
        while let Ok(c) = connect(&addr, Duration::from_millis(50)) {
            held.push(c);
            assert!(held.len() < 16, "the backlog never filled");
        }
        // On a thread, so that a probe that waits fails the test, not hangs it.
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.clone();
        std::thread::spawn(move || {
            let _ = tx.send(bind_socket(&p, 0o600).map(drop));
        });
        let r = rx
            .recv_timeout(Duration::from_secs(2))
            .expect("bind_socket still waits on the full backlog after 2 s");
        let e = r.unwrap_err();
        assert_eq!(e.source.kind(), io::ErrorKind::AddrInUse, "{e}");
        // Once nobody listens, the file is stale and replaced.
        drop((l, held));
        bind_socket(&path, 0o600).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
