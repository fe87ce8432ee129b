//! Supervisor ↔ launcher: what the supervisor asks for (a worker started,
//! a device's socket and state prepared, a connection made, files
//! removed) and what the launcher reports back, with the ends of workers.
//!
//! The launcher itself never does network I/O: a [`Request::Connect`] is
//! carried out by a short-lived helper process it forks, which answers
//! with a [`ConnectReply`] on a socket the requester sent along, so a
//! destination that never answers holds up no one but the requester.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vzram_store::{Codec, StateSpec};

use super::addr::Addr;
use super::codec;

#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// What the daemon bound and opened itself at start, before its
    /// filter and before it read anything a client sent: sent once, as
    /// the first request, with no reply. The launcher takes it only then
    /// (a later one is ignored) and from then on removes only these
    /// sockets and states and those it prepared itself, and makes states
    /// only under these roots and those its configuration file names.
    Started {
        /// The daemon's state root (`--state-dir`, `state_dir`, or the
        /// default), where a device added with no `state-dir=` goes.
        state_dir: PathBuf,
        /// Every other root a device's `state-dir=` named at start.
        roots: Vec<PathBuf>,
        /// The devices' sockets, as their specs name them.
        sockets: Vec<PathBuf>,
        /// The devices' state directories, and the left-over ones found
        /// under the roots.
        states: Vec<PathBuf>,
    },
    /// Are you there and not stuck? Answered with [`Report::Pong`] at once:
    /// the supervisor's watchdog keep-alive depends on it.
    Ping { id: u64 },
    /// Start `vzram <args>` with the descriptors sent along placed at 3, 4, …
    Spawn { id: u64, args: Vec<String> },
    /// Bind a device socket and open (or make) its state, and open and
    /// lock its backing file if it has one, for a device added at run
    /// time: the supervisor may do none of it under its filter. The reply
    /// carries the listener, the state's four files and the backing file.
    /// The state's root must be one the launcher knows
    /// ([`Request::Started`], or a `state_dir` of its configuration file).
    Prepare {
        id: u64,
        socket: PathBuf,
        mode: u32,
        /// Where the state is, and what an existing one is to the device.
        state: StateSpec,
        size: u64,
        #[serde(with = "codec")]
        algo: Codec,
        shards: usize,
        backing: Option<PathBuf>,
        /// An incoming device's migration address, bound too (last fd),
        /// a unix socket with `incoming_mode`.
        #[serde(default)]
        incoming: Option<Addr>,
        #[serde(default = "incoming_mode")]
        incoming_mode: u32,
    },
    /// Connect to another vzram's migration address within `wait_ms`
    /// (name resolution included). Sent with one descriptor, the
    /// requester's end of a fresh socket pair: the answer, a
    /// [`ConnectReply`], comes on it, never on the launcher's socket.
    Connect {
        id: u64,
        addr: Addr,
        #[serde(default = "connect_wait_ms")]
        wait_ms: u64,
    },
    /// Remove a device's socket file (only if it is a socket) and its state
    /// directory (only if it holds a vzram state nobody has locked), each
    /// only if the daemon bound or opened it at start ([`Request::Started`])
    /// or the launcher prepared it since.
    Remove {
        id: u64,
        socket: Option<PathBuf>,
        state: Option<PathBuf>,
        /// Remove the state only if it is still this one (its creation id).
        #[serde(default)]
        expect: Option<u64>,
    },
    /// Open the configuration file for reading, to read it again on SIGHUP
    /// (the supervisor may open nothing under its filter). No path: the
    /// launcher opens the one it was started with (`__launcher CONFIG`),
    /// so a supervisor taken over cannot have it open any other file.
    /// The reply, [`Report::Opened`], carries the descriptor.
    OpenConfig { id: u64 },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum Report {
    Spawned {
        id: u64,
        pid: u32,
    },
    Failed {
        id: u64,
        error: String,
    },
    Exited {
        id: u64,
        pid: u32,
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// Descriptors: listener, state lock (header), table, arena, stats,
    /// and the backing file when there is one.
    Prepared {
        id: u64,
        dir: PathBuf,
        existing: bool,
        /// The state it replaced (fresh=true), whose backing file it may take.
        #[serde(default)]
        replaced: Option<u64>,
        backing: Option<PreparedBacking>,
    },
    Removed {
        id: u64,
    },
    Pong {
        id: u64,
    },
    /// Descriptor: the configuration file, read-only ([`Request::OpenConfig`]).
    Opened {
        id: u64,
    },
}

/// How long a connection to a migration destination may take, overall.
pub const CONNECT_WAIT: Duration = Duration::from_secs(10);

fn incoming_mode() -> u32 {
    0o600
}

fn connect_wait_ms() -> u64 {
    CONNECT_WAIT.as_millis() as u64
}

/// The answer to a [`Request::Connect`], on the socket sent with it.
#[derive(Debug, Serialize, Deserialize)]
pub enum ConnectReply {
    /// Descriptor: the connection (blocking, as a worker expects).
    Connected {
        id: u64,
    },
    Failed {
        id: u64,
        error: ConnectError,
    },
}

/// Why no connection was made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot resolve {host}: {error}")]
    Resolve { host: String, error: String },
    #[error("{host} resolves to no address")]
    NoAddress { host: String },
    #[error("no connection within {ms} ms")]
    Deadline { ms: u64 },
    /// Refused or not there on every try until the deadline (a sender may
    /// start before its destination listens; this one never did).
    #[error("nothing listened there within {ms} ms (the last try: {})", std::io::Error::from_raw_os_error(*errno))]
    NotListening { ms: u64, errno: i32 },
    #[error("socket path too long")]
    PathTooLong,
    /// The last address's error.
    #[error("{}", std::io::Error::from_raw_os_error(*errno))]
    Os { errno: i32 },
    #[error("{error}")]
    Other { error: String },
    #[error("the launcher cannot start a helper to connect: {}", std::io::Error::from_raw_os_error(*errno))]
    Helper { errno: i32 },
}

/// What opening a backing file found.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct PreparedBacking {
    pub direct: bool,
    pub blocks: u64,
}

impl Report {
    pub fn id(&self) -> u64 {
        match self {
            Report::Spawned { id, .. }
            | Report::Failed { id, .. }
            | Report::Exited { id, .. }
            | Report::Prepared { id, .. }
            | Report::Removed { id }
            | Report::Pong { id }
            | Report::Opened { id } => *id,
        }
    }
}

/// The descriptors a [`Report::Prepared`] carries, by name: the launcher
/// sends [`PreparedFds::in_order`], the supervisor takes them with
/// [`PreparedFds::received`]; nothing else knows their order.
#[derive(Debug)]
pub struct PreparedFds<F> {
    /// The device's listening vhost-user socket.
    pub listener: F,
    pub lock: F,
    pub table: F,
    pub arena: F,
    pub stats: F,
    /// When the device has a backing file.
    pub backing: Option<F>,
    /// When the device waits for an incoming migration.
    pub incoming: Option<F>,
}

impl<F: Copy> PreparedFds<F> {
    /// The list as it is sent.
    pub fn in_order(&self) -> Vec<F> {
        let mut v = vec![self.listener, self.lock, self.table, self.arena, self.stats];
        v.extend(self.backing);
        v.extend(self.incoming);
        v
    }
}

impl PreparedFds<std::os::fd::OwnedFd> {
    /// The list as it came, for a device with (or without) a backing file
    /// and an incoming listener; None if it is not that list's length.
    pub fn received(
        fds: Vec<std::os::fd::OwnedFd>,
        backing: bool,
        incoming: bool,
    ) -> Option<PreparedFds<std::os::fd::OwnedFd>> {
        if fds.len() != 5 + usize::from(backing) + usize::from(incoming) {
            return None;
        }
        let mut fds = fds.into_iter();
        let mut next = || fds.next();
        Some(PreparedFds {
            listener: next()?,
            lock: next()?,
            table: next()?,
            arena: next()?,
            stats: next()?,
            backing: if backing { Some(next()?) } else { None },
            incoming: if incoming { Some(next()?) } else { None },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::PreparedFds;

    fn fds(n: usize) -> Vec<std::os::fd::OwnedFd> {
        (0..n)
            .map(|_| std::fs::File::open("/dev/null").unwrap().into())
            .collect()
    }

    #[test]
    fn prepared_descriptors_are_taken_by_name_and_counted() {
        let sent = PreparedFds {
            listener: 0,
            lock: 1,
            table: 2,
            arena: 3,
            stats: 4,
            backing: None,
            incoming: Some(5),
        };
        assert_eq!(sent.in_order(), [0, 1, 2, 3, 4, 5]);
        let got = PreparedFds::received(fds(6), false, true).expect("six for an incoming device");
        assert!(got.backing.is_none() && got.incoming.is_some());
        let got = PreparedFds::received(fds(7), true, true).expect("seven with a backing file");
        assert!(got.backing.is_some() && got.incoming.is_some());
        // One short, or one more than the device needs: refused.
        assert!(PreparedFds::received(fds(5), true, false).is_none());
        assert!(PreparedFds::received(fds(6), false, false).is_none());
    }
}
