//! What can go wrong with a request to the supervisor, typed: the control
//! socket turns it into the reply's text, and nothing below it does.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;
use vzram_store::StoreError;

use crate::proto::addr::Addr;

#[derive(Debug, Error)]
pub enum Error {
    /// The request names no device; lists those that exist.
    #[error("no device {asked}; devices (by name or index): {known}")]
    NoSuchDevice { asked: String, known: String },
    /// The request itself is wrong (a limit above the size, a codec the
    /// device already uses, two targets): the user's to fix.
    #[error("{0}")]
    Invalid(String),
    #[error("a device named {0:?} exists")]
    NameTaken(String),
    #[error("socket {} is device {device}'s", socket.display())]
    SocketTaken { socket: PathBuf, device: String },
    #[error(
        "device {0} is busy (a frontend is connecting, or another command holds it); try again"
    )]
    Busy(String),
    /// A destructive command on a device a VM is using, without `--force`.
    #[error("device {device} is in use: {frontend}; {advice}")]
    Connected {
        device: String,
        frontend: String,
        advice: String,
    },
    #[error("device {0} has no backing file (give it backing-file=PATH)")]
    NoBackingFile(String),
    #[error("device {0} is waiting for its own pages (incoming); it has nothing to send")]
    Incoming(String),
    #[error("device {0}: the arriving migration stream did not stop; try again")]
    Receiving(String),
    #[error("device {0}: a migration is already under way (`vzram stat` shows it); one at a time")]
    MigrationRunning(String),
    #[error("device {0} was sent to another daemon and its pages dropped here; `vzram reset {0}` to use it afresh")]
    AlreadySent(String),
    #[error("{what} needs mutual TLS: start the daemon with --tls-creds DIR holding ca-cert.pem, {need}")]
    NoTls {
        what: &'static str,
        need: &'static str,
    },
    #[error("device {0} has no migration waiting for its commit (`vzram stat` shows its state)")]
    NotCommitting(String),
    #[error("device {0} is still sending its pages: a commit is taken only after the last delta (when `vzram stat` says committing)")]
    CommitTooEarly(String),
    #[error("device {0} is not being sent: there is no migration to cancel (`vzram stat` shows its state)")]
    NotSending(String),
    #[error("device {0}: still in use; try again")]
    InUse(String),
    #[error("device {device}: its worker did not stop within {wait:?}")]
    WorkerStuck { device: String, wait: Duration },
    #[error("no device {0}")]
    NoIndex(usize),
    #[error("device {0} is served, not left over; `vzram remove {0}` removes it with its state")]
    Served(String),
    #[error("no left-over state named {0:?} (`vzram stat` lists them)")]
    NoLeftover(String),
    /// The order was carried out as far as it went and failed there; what
    /// it did stays done.
    #[error("device {device}: {error}")]
    Failed { device: String, error: String },
    /// The worker's channel broke: it was exiting or died.
    #[error("worker: {0}")]
    WorkerGone(String),
    #[error("the worker did not answer")]
    WorkerSilent,
    #[error("unexpected answer from the worker: {0}")]
    WorkerAnswer(String),
    #[error("the launcher did not answer")]
    LauncherSilent,
    #[error("launcher: {0}")]
    Launcher(#[source] io::Error),
    /// The launcher tried and could not (a socket in use, a state locked).
    #[error("{0}")]
    LauncherRefused(String),
    #[error("cannot connect to {to}: {error}")]
    Connect { to: Addr, error: String },
    #[error("unexpected answer from the launcher: {0}")]
    LauncherAnswer(String),
    #[error("the launcher sent the wrong descriptors")]
    LauncherFds,
    #[error("the launcher sent no connection")]
    LauncherNoConnection,
    #[error("cannot start the migration listener: {0}")]
    Thread(#[source] io::Error),
    /// A configured device that cannot start (see `daemon::run`).
    #[error("device {device}: {source}")]
    Start {
        device: String,
        #[source]
        source: StartError,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Why a configured device cannot start: its state or backing file, or
/// where its state was last served from (worded as the store words a
/// configuration it refuses).
#[derive(Debug, Error)]
pub enum StartError {
    #[error(transparent)]
    Store(StoreError),
    #[error("invalid configuration: {0}")]
    Placement(#[source] crate::owner::placement::PlacementError),
    #[error("invalid configuration: {0}")]
    Legacy(#[source] LegacyState),
}

/// A device named after its socket that has no state yet, while the state
/// an older vzram made for its place (`old`, in `dir`) is there.
#[derive(Debug, Error)]
#[error(
    "no state under its name yet, but {} holds the state an older vzram made for the device in this place (it named devices vzram0, vzram1, ...): \
     give this device name={old} to keep serving those pages, or start with `--fresh {name}` to start it empty (once it serves, `vzram forget {old}` deletes the old state)",
    dir.display()
)]
pub struct LegacyState {
    pub dir: PathBuf,
    pub old: String,
    pub name: String,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
