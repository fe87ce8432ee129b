//! Listening sockets handed to the daemon instead of bound by it: systemd
//! socket activation (`LISTEN_FDS`) and QEMU's backend-program convention
//! `--fd N`. Each is matched to its device by the path it is bound to, so a
//! `.socket` unit needs no names and the configuration stays the same
//! whether or not sockets are passed in.

use std::collections::HashMap;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// The first descriptor systemd passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: RawFd = 3;

/// The path a listening unix stream socket is bound to; an error if `fd`
/// is anything else.
pub fn bound_path(fd: RawFd) -> io::Result<PathBuf> {
    let opt = |name| -> io::Result<libc::c_int> {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes one int into v.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                name,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if rc == 0 {
            Ok(v)
        } else {
            Err(io::Error::last_os_error())
        }
    };
    let bad = |what: &str| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("descriptor {fd} is {what}"),
        )
    };
    if opt(libc::SO_DOMAIN)? != libc::AF_UNIX || opt(libc::SO_TYPE)? != libc::SOCK_STREAM {
        return Err(bad("not a unix stream socket"));
    }
    if opt(libc::SO_ACCEPTCONN)? == 0 {
        return Err(bad("a socket that is not listening"));
    }
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: getsockname fills addr, at most len bytes.
    let rc =
        unsafe { libc::getsockname(fd, (&mut addr as *mut libc::sockaddr_un).cast(), &mut len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let off = std::mem::size_of::<libc::sa_family_t>();
    let n = (len as usize).saturating_sub(off);
    let raw: Vec<u8> = addr.sun_path[..n.min(addr.sun_path.len())]
        .iter()
        .map(|&c| c as u8)
        .take_while(|&c| c != 0)
        .collect();
    if raw.is_empty() {
        return Err(bad("a socket with no path (unnamed or abstract)"));
    }
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(&raw)))
}

/// Takes the listening sockets passed in: `extra` (from `--fd`) and
/// systemd's, when `LISTEN_PID` is this process. Returns them by the path
/// they are bound to. The `LISTEN_*` variables are removed so that no
/// child takes them as its own.
pub fn inherited(extra: &[RawFd]) -> io::Result<HashMap<PathBuf, OwnedFd>> {
    let mut fds: Vec<RawFd> = extra.to_vec();
    let ours = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        == Some(std::process::id());
    if ours {
        let n: RawFd = std::env::var("LISTEN_FDS")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        fds.extend(LISTEN_FDS_START..LISTEN_FDS_START + n);
    }
    for v in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(v);
    }
    let mut out = HashMap::new();
    for fd in fds {
        let path = bound_path(fd)?;
        // SAFETY: F_SETFD on a descriptor passed to us; it is not for children.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        // SAFETY: a descriptor passed to this process, taken once.
        out.insert(path, unsafe { OwnedFd::from_raw_fd(fd) });
    }
    Ok(out)
}
