//! Descriptors: anonymous shared memory, and the open-file limit.

use std::ffi::CString;
use std::io;
use std::os::fd::FromRawFd;

/// An anonymous shared memory file.
pub fn memfd(name: &str) -> io::Result<std::fs::File> {
    let name = CString::new(name).map_err(io::Error::other)?;
    // SAFETY: a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Lifts the soft open-file limit to the hard one. Each device holds a
/// listening socket, the guard's private listener and its handle, its
/// state's locked header, its backing file if any, and,
/// while connected, two connections, guest memory files and three eventfds
/// plus an epoll per queue; the usual soft limit of 1024 runs out near 170
/// connected devices. `need` is what the caller counted.
pub fn raise_fd_limit(need: u64) {
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
