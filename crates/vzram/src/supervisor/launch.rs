//! Requests to the launcher, the one process that may start workers,
//! bind sockets and open files once the supervisor is sandboxed.
//!
//! [`Launcher`] is the supervisor's only writer to the launcher's socket:
//! it numbers the requests, routes each reply to whoever waits for it,
//! and keeps the watchdog's view of the launcher.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use super::error::{Error, Result};
use crate::proto::launch::{Report, Request};
use crate::proto::wire::{self, seqpacket_pair, FIRST_FD};

/// How long a request to the launcher (a socket bound, a state opened or
/// removed) may take.
const ASK_WAIT: Duration = Duration::from_secs(30);

/// Starts the launcher; returns the supervisor's end of its socket. Call
/// it before any thread starts and before the seccomp filter. `config`:
/// the configuration file, the one file the launcher opens for reading
/// when asked (SIGHUP's reload).
pub fn start(config: Option<&Path>) -> io::Result<OwnedFd> {
    let (ours, theirs) = seqpacket_pair()?;
    let child_fd = theirs.as_raw_fd();
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg("__launcher");
    cmd.args(config);
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

/// A launcher's answer and the descriptors that came with it.
pub type Reply = (Report, Vec<OwnedFd>);

/// The supervisor's end of the launcher's socket.
pub struct Launcher {
    sock: OwnedFd,
    next_id: AtomicU64,
    /// Requests waiting for their reply, by id.
    replies: Mutex<HashMap<u64, mpsc::Sender<Reply>>>,
    dog: Mutex<Dog>,
}

/// When the launcher was last pinged and last answered.
#[derive(Default)]
struct Dog {
    ping_sent: Option<Instant>,
    pong_seen: Option<Instant>,
    warned: bool,
}

/// What the watchdog may tell the service manager this turn.
#[derive(Debug, PartialEq, Eq)]
pub enum Health {
    /// The launcher answered the last ping in time.
    Answering,
    /// It has not: say so once (`true`), then stay quiet.
    Silent { first: bool },
}

/// A report read off the socket, once the launcher's own replies to
/// [`Launcher::ask`] and its pongs are dealt with.
pub enum Received {
    /// A reply or a pong, taken care of here.
    Handled,
    /// About a worker (its start, its exit): the loop's to act on.
    Worker(Report, Vec<OwnedFd>),
    /// The launcher is gone.
    Gone,
}

impl Launcher {
    pub fn new(sock: OwnedFd) -> Launcher {
        Launcher {
            sock,
            next_id: AtomicU64::new(1),
            replies: Mutex::new(HashMap::new()),
            dog: Mutex::new(Dog::default()),
        }
    }

    /// For the loop's epoll: readable when a report is there.
    pub fn fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// A fresh request id, for a request whose answer the loop reads.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Relaxed)
    }

    /// Sends a request whose reports the loop handles (a worker's
    /// start), with the descriptors it hands over.
    pub fn send(&self, req: &Request, fds: &[RawFd]) -> io::Result<()> {
        wire::send(&self.sock, req, fds)
    }

    /// Sends the launcher a request and waits for its reply (read by the
    /// loop, which must be running).
    pub fn ask(&self, req: impl FnOnce(u64) -> Request) -> Result<Reply> {
        let id = self.next_id();
        let (tx, rx) = mpsc::channel();
        self.replies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        let sent = wire::send(&self.sock, &req(id), &[]);
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

    /// Reads one report: a reply goes to its asker, a pong to the
    /// watchdog, the rest to the caller.
    pub fn receive(&self) -> io::Result<Received> {
        let Some((report, fds)) = wire::recv::<Report>(&self.sock)? else {
            return Ok(Received::Gone);
        };
        if let Report::Pong { .. } = report {
            self.dog.lock().unwrap_or_else(|e| e.into_inner()).pong_seen = Some(Instant::now());
            return Ok(Received::Handled);
        }
        let waiting = self
            .replies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&report.id());
        match waiting {
            Some(tx) => {
                // The asker may have given up; nothing to do then.
                let _ = tx.send((report, fds));
                Ok(Received::Handled)
            }
            None => Ok(Received::Worker(report, fds)),
        }
    }

    /// The watchdog's turn, every `every`: whether the launcher answered
    /// the last ping within two turns; then a new ping, unless one is
    /// still unanswered (a stuck launcher never fills the channel).
    pub fn watchdog(&self, every: Duration) -> Health {
        let mut dog = self.dog.lock().unwrap_or_else(|e| e.into_inner());
        let answered = match dog.ping_sent {
            None => true,
            Some(at) => dog.pong_seen.is_some_and(|p| p >= at),
        };
        let in_time = answered || dog.ping_sent.is_some_and(|at| at.elapsed() < 2 * every);
        let health = if in_time {
            // A silence after this one is said again.
            if answered {
                dog.warned = false;
            }
            Health::Answering
        } else {
            let first = !dog.warned;
            dog.warned = true;
            Health::Silent { first }
        };
        if answered {
            let id = self.next_id();
            if wire::send(&self.sock, &Request::Ping { id }, &[]).is_ok() {
                dog.ping_sent = Some(Instant::now());
            }
        }
        health
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A launcher's end that answers nothing unless told.
    fn pair() -> (Launcher, OwnedFd) {
        let (ours, theirs) = seqpacket_pair().unwrap();
        (Launcher::new(ours), theirs)
    }

    fn read(theirs: &OwnedFd) -> Request {
        wire::recv::<Request>(theirs).unwrap().unwrap().0
    }

    #[test]
    fn the_watchdog_waits_two_turns_for_a_pong_and_warns_once() {
        let (l, theirs) = pair();
        // Unanswered but within two turns (an hour each, so a busy
        // machine cannot make the test late): fine, and no second ping.
        let hour = Duration::from_secs(3600);
        assert_eq!(l.watchdog(hour), Health::Answering);
        let Request::Ping { id } = read(&theirs) else {
            panic!("no ping")
        };
        assert_eq!(l.watchdog(hour), Health::Answering);
        // Past two turns of a short period: silent, said once.
        let every = Duration::from_millis(5);
        std::thread::sleep(2 * every);
        assert_eq!(l.watchdog(every), Health::Silent { first: true });
        assert_eq!(l.watchdog(every), Health::Silent { first: false });
        assert!(
            !crate::sys::socket::readable(theirs.as_raw_fd()),
            "pinged twice"
        );
        // The pong comes: healthy again, and the next ping goes out.
        wire::send(&theirs, &Report::Pong { id }, &[]).unwrap();
        assert!(matches!(l.receive().unwrap(), Received::Handled));
        assert_eq!(l.watchdog(every), Health::Answering);
        assert!(matches!(read(&theirs), Request::Ping { .. }));
    }

    #[test]
    fn a_reply_goes_to_its_asker_and_a_worker_report_to_the_loop() {
        let (l, theirs) = pair();
        let l = std::sync::Arc::new(l);
        let asker = {
            let l = l.clone();
            std::thread::spawn(move || l.ask(|id| Request::Ping { id }).map(|r| r.0))
        };
        let Request::Ping { id } = read(&theirs) else {
            panic!("not the asked request")
        };
        // A report about a worker first: it is not the asker's.
        let worker = Report::Spawned {
            id: id + 100,
            pid: 7,
        };
        wire::send(&theirs, &worker, &[]).unwrap();
        wire::send(&theirs, &Report::Removed { id }, &[]).unwrap();
        assert!(matches!(
            l.receive().unwrap(),
            Received::Worker(Report::Spawned { pid: 7, .. }, _)
        ));
        assert!(matches!(l.receive().unwrap(), Received::Handled));
        assert!(matches!(asker.join().unwrap(), Ok(Report::Removed { id: got }) if got == id));
        drop(theirs);
        assert!(matches!(l.receive().unwrap(), Received::Gone));
    }
}
