//! Connections for the supervisor, made by short-lived helper processes so
//! that the launcher's loop never waits on the network: a destination
//! whose backlog is full, or a name that takes long to resolve, holds up
//! only its helper, which is killed if it overstays.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::proto::addr::Addr;
use crate::proto::launch::{ConnectError, ConnectReply};
use crate::proto::wire::send;
use crate::sys::socket;

/// Time a helper gets beyond its connect deadline to send its answer
/// (and to be killed by its own alarm) before the launcher kills it.
const GRACE: Duration = Duration::from_secs(2);

/// The longest connect deadline a request gets, whatever it asks.
const MAX_WAIT: Duration = Duration::from_secs(300);

/// The helpers still running, by pid, with when they are killed.
#[derive(Default)]
pub struct Helpers {
    live: Vec<(libc::pid_t, Instant)>,
}

impl Helpers {
    /// Starts a helper that connects to `addr` within `wait` and answers
    /// on `reply`; returns at once. `launcher` is the launcher's own
    /// socket, which the helper closes.
    pub fn start(&mut self, launcher: RawFd, id: u64, addr: &Addr, wait: Duration, reply: OwnedFd) {
        let wait = wait.min(MAX_WAIT);
        // SAFETY: the launcher is single-threaded (it starts no threads and
        // sets up no logging thread), so the child is a full copy of a
        // consistent process: no lock is held by a thread that is not
        // there, and it may allocate and resolve names. The child never
        // returns into the launcher's loop: `helper` ends in _exit.
        let pid = unsafe { libc::fork() };
        match pid {
            0 => helper(launcher, id, addr, wait, &reply),
            p if p > 0 => {
                tracing::debug!(id, pid = p, %addr, "connecting helper started");
                self.live.push((p, Instant::now() + wait + GRACE));
            }
            _ => {
                let errno = io::Error::last_os_error().raw_os_error().unwrap_or(0);
                let r = ConnectReply::Failed {
                    id,
                    error: ConnectError::Helper { errno },
                };
                // The requester's socket pair is fresh and empty: this
                // send does not wait.
                let _ = send(&reply, &r, &[]);
            }
        }
        // `reply` closes here: the helper and the requester hold it now.
    }

    /// Reaps the helpers that have ended (only those: workers are the
    /// launcher's `Child`ren, reaped and reported apart).
    pub fn reap(&mut self) {
        self.live.retain(|&(pid, _)| {
            let mut status = 0;
            // SAFETY: waiting on one pid of ours, without blocking.
            let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            rc == 0
        });
    }

    /// Kills the helpers past their time; the SIGCHLD that follows reaps
    /// them. A pid not yet reaped is still ours, so the kill hits no one
    /// else.
    pub fn kill_overdue(&mut self) {
        let now = Instant::now();
        for &(pid, until) in &self.live {
            if until <= now {
                tracing::warn!(pid, "a connecting helper overstayed; killed");
                // SAFETY: a signal to our own unreaped child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }

    /// How long the loop may sleep before a helper must be killed (poll's
    /// milliseconds; -1: no helper).
    pub fn poll_timeout(&self) -> i32 {
        let now = Instant::now();
        self.live
            .iter()
            .map(|&(_, until)| until.saturating_duration_since(now))
            .min()
            // Rounded up, so that a wake-up finds the helper overdue.
            .map_or(-1, |d| {
                (d.as_millis().min(MAX_WAIT.as_millis() * 2) as i32) + 1
            })
    }
}

/// The helper process: connect, answer, exit. Never returns.
fn helper(launcher: RawFd, id: u64, addr: &Addr, wait: Duration, reply: &OwnedFd) -> ! {
    // SAFETY: in the helper only: it must not keep the supervisor's
    // channel open (the supervisor sees the launcher gone only once every
    // copy is closed), it dies with the launcher, and its own alarm ends
    // it a little after its deadline even if name resolution hangs.
    unsafe {
        libc::close(launcher);
        libc::prctl(libc::PR_SET_NAME, c"vzram-connect".as_ptr());
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        libc::signal(libc::SIGALRM, libc::SIG_DFL);
        libc::alarm((wait + GRACE / 2).as_secs().max(1) as libc::c_uint);
    }
    // A panic must not unwind into a copy of the launcher's loop.
    let r = std::panic::catch_unwind(|| {
        let r = match socket::connect(addr, wait) {
            Ok(conn) => send(reply, &ConnectReply::Connected { id }, &[conn.as_raw_fd()]),
            Err(error) => send(reply, &ConnectReply::Failed { id, error }, &[]),
        };
        r.is_ok()
    });
    let code = if matches!(r, Ok(true)) { 0 } else { 1 };
    // SAFETY: ends this process without running the launcher's exit
    // handlers or destructors, which belong to the launcher.
    unsafe { libc::_exit(code) }
}
