//! Signals: the daemon's shutdown signals taken with `sigwait`, SIGCHLD
//! as a descriptor for the launcher, names for the ones that end a
//! worker, and the handlers that say why one is dying: SIGSYS (a call the
//! seccomp filter refused) here, SIGBUS beside the fault table
//! ([`super::fault`]).

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

/// A signal handler that could not be installed.
#[derive(Debug, thiserror::Error)]
#[error("cannot install a handler for {signal}: {source}")]
pub struct HandlerError {
    signal: String,
    #[source]
    source: io::Error,
}

/// The part of `siginfo_t` a SIGSYS from seccomp fills in (`_sigsys`).
#[repr(C)]
struct SigsysInfo {
    signo: libc::c_int,
    errno: libc::c_int,
    code: libc::c_int,
    _pad: libc::c_int,
    call_addr: *mut libc::c_void,
    syscall: libc::c_int,
    arch: libc::c_uint,
}

/// A line built on the stack and written with write(2): all a signal
/// handler may do.
pub(super) struct Line {
    buf: [u8; 256],
    len: usize,
}

impl Line {
    pub(super) fn new() -> Line {
        Line {
            buf: [0; 256],
            len: 0,
        }
    }

    pub(super) fn put(&mut self, b: &[u8]) -> &mut Line {
        let n = b.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&b[..n]);
        self.len += n;
        self
    }

    pub(super) fn num(&mut self, mut v: u64, radix: u64) -> &mut Line {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b"0123456789abcdef"[(v % radix) as usize];
            v /= radix;
            if v == 0 {
                break;
            }
        }
        self.put(&digits[i..])
    }

    pub(super) fn write(&self) {
        // SAFETY: write(2) on stderr from a buffer we own.
        unsafe { libc::write(2, self.buf.as_ptr().cast(), self.len) };
    }
}

/// Writes which call was refused, then dies of SIGSYS. Only
/// async-signal-safe work here: formatting on the stack and write(2).
extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t, and for SIGSYS with
    // SYS_SECCOMP its union holds the `_sigsys` fields laid out as above.
    let nr = unsafe { (*(info as *const SigsysInfo)).syscall };
    let mut line = Line::new();
    line.put(b"vzram: seccomp: system call ");
    if nr < 0 {
        line.put(b"-");
    }
    line.num(u64::from(nr.unsigned_abs()), 10)
        .put(b" is not allowed; exiting (--seccomp off or log to debug)\n")
        .write();
    // SA_RESETHAND made SIGSYS fatal again and SA_NODEFER left it unblocked:
    // a second refused call (kexec_load is never on the list) kills us with
    // SIGSYS and a core dump, without running anything.
    // SAFETY: the filter refuses the call before the kernel looks at it.
    unsafe { libc::syscall(libc::SYS_kexec_load, 0, 0, 0, 0) };
    // Not reached with the filter in place; be sure anyway.
    // SAFETY: _exit ends the process and is async-signal-safe.
    unsafe { libc::_exit(128 + libc::SIGSYS) };
}

fn set_handler(sig: libc::c_int, handler: usize) -> Result<(), HandlerError> {
    set_handler_flags(
        sig,
        handler,
        libc::SA_SIGINFO | libc::SA_RESETHAND | libc::SA_NODEFER,
    )
}

pub(super) fn set_handler_flags(
    sig: libc::c_int,
    handler: usize,
    flags: libc::c_int,
) -> Result<(), HandlerError> {
    // SAFETY: a zeroed sigaction is valid; we fill in a handler with the
    // SA_SIGINFO signature and install it for `sig` only.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler;
        sa.sa_flags = flags;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
            return Err(HandlerError {
                signal: signal_name(sig),
                source: io::Error::last_os_error(),
            });
        }
    }
    Ok(())
}

/// Names a call the seccomp filter refused before SIGSYS kills us (see
/// [`on_sigsys`]). Installed with the filter, in `--seccomp on` only.
pub fn report_sigsys() -> Result<(), HandlerError> {
    set_handler(libc::SIGSYS, on_sigsys as *const () as usize)
}
