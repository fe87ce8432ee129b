//! Signals: the daemon's shutdown signals taken with `sigwait`, SIGCHLD
//! as a descriptor for the launcher, and names for the ones that end a
//! worker.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// SIGTERM, SIGINT and SIGHUP, blocked in every thread and taken with
/// `sigwait`. SIGHUP's default action would kill the daemon and every
/// device's data with it (a closed terminal); here it reloads.
pub struct ShutdownSignals {
    set: libc::sigset_t,
}

impl ShutdownSignals {
    pub fn block() -> io::Result<ShutdownSignals> {
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
                return Err(io::Error::from_raw_os_error(rc));
            }
            Ok(ShutdownSignals { set })
        }
    }

    /// Waits for a shutdown signal; on SIGHUP calls `hup` (which hands the
    /// reload to another thread: a shutdown signal is never kept waiting)
    /// and waits on.
    pub fn wait(&self, mut hup: impl FnMut()) -> io::Result<i32> {
        loop {
            let mut sig = 0;
            // SAFETY: `set` is a valid signal set and `sig` a valid out pointer.
            let rc = unsafe { libc::sigwait(&self.set, &mut sig) };
            match rc {
                0 if sig == libc::SIGHUP => hup(),
                0 => return Ok(sig),
                libc::EINTR => continue,
                e => return Err(io::Error::from_raw_os_error(e)),
            }
        }
    }
}

/// SIGCHLD as a readable descriptor.
pub struct ChildSignals {
    pub fd: OwnedFd,
}

impl ChildSignals {
    pub fn new() -> io::Result<ChildSignals> {
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

    pub fn drain(&self) {
        let mut info = [0u8; 128];
        // SAFETY: reading whole signalfd_siginfo records into our buffer.
        while unsafe { libc::read(self.fd.as_raw_fd(), info.as_mut_ptr().cast(), info.len()) } > 0 {
        }
    }
}

pub fn signal_name(s: i32) -> String {
    let name = match s {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGSYS => "SIGSYS",
        libc::SIGABRT => "SIGABRT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGINT => "SIGINT",
        libc::SIGPIPE => "SIGPIPE",
        _ => return format!("signal {s}"),
    };
    name.to_string()
}
