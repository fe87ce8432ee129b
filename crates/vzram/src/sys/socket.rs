//! Unix sockets: binding a listener safely, connecting to a migration
//! address, and the small polls the supervisor makes on its sockets.

use std::io;
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

use crate::proto::addr::Addr;

/// How long connecting to a migration destination may take.
pub const CONNECT_WAIT: Duration = Duration::from_secs(10);

/// A socket that cannot be bound (or connected), with its path.
#[derive(Debug, Error)]
#[error("socket {path}: {source}")]
pub struct SocketError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Creates a listening socket with the given mode. A stale socket file from
/// a daemon that died is replaced; a live one is an error.
pub fn bind_socket(path: &Path, mode: u32) -> Result<UnixListener, SocketError> {
    let fail = |source: io::Error| SocketError {
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

/// Connects to a migration address (for the launcher, which may).
pub fn connect(addr: &Addr) -> io::Result<OwnedFd> {
    match addr {
        Addr::Unix(p) => Ok(UnixStream::connect(p)?.into()),
        Addr::Tcp(hp) => {
            let mut last = io::Error::other(format!("{hp} resolves to no address"));
            for a in hp.to_socket_addrs()? {
                match TcpStream::connect_timeout(&a, CONNECT_WAIT) {
                    Ok(s) => {
                        let _ = s.set_nodelay(true);
                        return Ok(s.into());
                    }
                    Err(e) => last = e,
                }
            }
            Err(last)
        }
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
