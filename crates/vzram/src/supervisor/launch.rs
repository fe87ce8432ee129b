//! Requests to the launcher, the one process that may start workers,
//! bind sockets and open files once the supervisor is sandboxed.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::time::Duration;

use super::error::{Error, Result};
use super::Supervisor;
use crate::proto::launch::{Report, Request};
use crate::proto::wire::{self, seqpacket_pair, FIRST_FD};

/// How long a request to the launcher (a socket bound, a state opened or
/// removed) may take.
const ASK_WAIT: Duration = Duration::from_secs(30);

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

impl Supervisor {
    /// Sends the launcher a request and waits for its reply (read by the
    /// loop, which must be running).
    pub fn ask(&self, req: impl FnOnce(u64) -> Request) -> Result<(Report, Vec<OwnedFd>)> {
        let id = self.next_id.fetch_add(1, Relaxed);
        let (tx, rx) = mpsc::channel();
        self.replies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        let sent = wire::send(&self.launcher, &req(id), &[]);
        let r = match sent {
            Ok(()) => rx.recv_timeout(ASK_WAIT).map_err(|_| Error::LauncherSilent),
            Err(e) => Err(Error::Launcher(e)),
        };
        self.replies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        r
    }
}
