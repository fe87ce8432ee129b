//! The control socket's protocol: newline-delimited JSON, one reply line
//! per request, and the client's side of the exchange.
//!
//! ```text
//! {"cmd":"stat"}
//! {"cmd":"set-limit","device":"vm1","bytes":1073741824}    device by name or index
//! {"cmd":"set-limit","host":true,"bytes":0}                 0 = no limit
//! {"cmd":"compact"}                                         or with "device"
//! {"cmd":"mark-idle","device":"vm1"}
//! {"cmd":"recompress","device":"vm1","idle":true,"algo":"zstd:3"}   huge, algo optional
//! {"cmd":"writeback","device":"vm1","cold":true,"max_pages":1000}    idle, huge, incompressible
//! {"cmd":"migrate","device":"vm1","to":"unix:/run/m.sock","keep":false}
//! {"cmd":"reload"}                                          the --config file again
//! ```
//! Replies carry `"ok":true` and the result, or `"ok":false` and `"error"`,
//! and the daemon's `"version"` either way ([`Head`]).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use vzram_store::{Codec, DeviceStats, PoolStats};

use super::codec;

/// How long a writeback or recompression order may take: a whole device
/// through a slow disk or a strong codec.
pub const TIER_WAIT: Duration = Duration::from_secs(1800);
/// How long a migration order may take: pre-copy lasts until the source's
/// frontend stops, which its operator decides.
pub const MIGRATE_WAIT: Duration = Duration::from_secs(24 * 3600);

/// A request that names its reply: what [`Client::call`] sends, and what
/// the daemon's handler of it must return.
pub trait Command: Clone + Into<Request> {
    type Reply: Serialize + DeserializeOwned;
    /// How long the client waits for the reply.
    const WAIT: Duration = CLIENT_TIMEOUT;
}

pub mod cmd;

pub use cmd::{DeviceRef, NewDevice, Request};

/// How long the tiering commands wait: as long as the daemon lets an
/// order run, and a little more for the reply.
const TIER_CLIENT_WAIT: Duration = TIER_WAIT.saturating_add(CLIENT_TIMEOUT);

/// Each request struct: its `Request` variant, and its reply.
macro_rules! command {
    ($($name:ident => $reply:ty $(, wait $wait:expr)?;)*) => {$(
        impl From<cmd::$name> for Request {
            fn from(c: cmd::$name) -> Request {
                Request::$name(c)
            }
        }
        impl Command for cmd::$name {
            type Reply = $reply;
            $(const WAIT: Duration = $wait;)?
        }
    )*};
}

command! {
    Stat => StatReply;
    SetLimit => LimitSet;
    Compact => Compacted;
    Add => Added;
    Remove => Removed;
    Forget => Forgotten;
    Reset => Reset;
    ResetMax => Done;
    MarkIdle => MarkedIdle, wait TIER_CLIENT_WAIT;
    Recompress => Recompressed, wait TIER_CLIENT_WAIT;
    Writeback => WrittenBack, wait TIER_CLIENT_WAIT;
    Migrate => Migrated, wait MIGRATE_WAIT.saturating_add(CLIENT_TIMEOUT);
    CommitMigration => Committed;
    CancelMigration => Committed;
    // Behind a reload already running, and devices added or removed.
    Reload => Reloaded, wait Duration::from_secs(120);
}

/// The command that serves a left-over state again (the daemon's refusals
/// and logs, and `vzram stat`, advise it).
pub fn recover_command(name: &str, socket: &std::path::Path, size: u64) -> String {
    format!(
        "vzram add --device socket={},size={size},name={name},recover=true",
        socket.display()
    )
}

/// The reply to `stat`: the whole pool, then each device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatReply {
    pub pool: PoolStats,
    pub devices: Vec<DeviceStat>,
    /// Where `/metrics` is served, if anywhere.
    pub metrics: Option<String>,
    /// The daemon's state dir (a device's own `state-dir=` may differ).
    #[serde(default)]
    pub state_dir: PathBuf,
    /// States in the state dirs that no device serves: someone's disk,
    /// holding memory until recovered (`recover=true`) or forgotten.
    #[serde(default)]
    pub leftovers: Vec<LeftoverStat>,
}

/// A state no device serves, in a [`StatReply`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeftoverStat {
    pub name: String,
    pub dir: PathBuf,
    pub size_bytes: u64,
    /// Memory its files hold.
    pub state_bytes: u64,
    /// The socket it was made for (None: made before vzram recorded it).
    pub socket: Option<PathBuf>,
}

impl From<&vzram_store::Leftover> for LeftoverStat {
    fn from(l: &vzram_store::Leftover) -> Self {
        LeftoverStat {
            name: l.name.clone(),
            dir: l.dir.clone(),
            size_bytes: l.size_bytes,
            state_bytes: l.bytes,
            socket: l.socket.clone(),
        }
    }
}

/// One device in a [`StatReply`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceStat {
    pub index: usize,
    pub name: String,
    pub socket: PathBuf,
    pub size_bytes: u64,
    pub queues: u16,
    #[serde(with = "codec")]
    pub algo: Codec,
    pub readonly: bool,
    pub serial: String,
    pub connected: bool,
    /// The state directory.
    pub state: PathBuf,
    pub state_bytes: u64,
    /// A state file the supervisor maps lost its pages (truncated while
    /// the daemon ran): its numbers are not to be trusted; restart it.
    #[serde(default)]
    pub state_damaged: bool,
    /// Frontend connections this daemon run.
    pub connections: u64,
    pub worker: WorkerStatus,
    pub stats: DeviceStats,
    pub tier: TierStat,
    pub migration: MigrationStat,
}

#[cfg(test)]
impl DeviceStat {
    /// A device as `stat` reports it, idle and empty (for tests).
    pub fn example(name: &str, socket: &str) -> DeviceStat {
        DeviceStat {
            index: 0,
            name: name.into(),
            socket: socket.into(),
            size_bytes: 0,
            queues: 1,
            algo: Codec::Lz4,
            readonly: false,
            serial: format!("vzram-{name}"),
            connected: false,
            state: "/dev/shm/vzram/x".into(),
            state_bytes: 0,
            state_damaged: false,
            connections: 0,
            worker: WorkerStatus {
                state: WorkerState::Idle,
                pid: None,
                started: 0,
                failures: 0,
                failing: 0,
                last_failure: None,
                short_lived: 0,
                refused_clients: 0,
            },
            stats: Default::default(),
            tier: TierStat {
                backing: None,
                recompress_algo: Codec::Zstd { level: 3 },
                idle_after_secs: None,
                auto_writeback: false,
                auto_recompress: false,
            },
            migration: MigrationStat {
                state: MigrationState::None,
                incoming: None,
                error: None,
                bytes: 0,
                records: 0,
                pass: 0,
                dirty_slots: 0,
                final_ms: 0.0,
                total_ms: 0.0,
            },
        }
    }
}

/// What serves a device, as `vzram stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerState {
    Idle,
    /// A connection waits for its worker.
    Starting,
    Running,
    /// The supervisor itself holds the device (compacting, resetting or
    /// tiering one that has no frontend).
    Busy,
    /// Workers keep failing; the next waits out a backoff.
    Failing,
}

impl WorkerState {
    /// As `vzram stat` names it.
    pub fn name(self) -> &'static str {
        match self {
            WorkerState::Idle => "idle",
            WorkerState::Starting => "starting",
            WorkerState::Running => "running",
            WorkerState::Busy => "busy",
            WorkerState::Failing => "failing",
        }
    }
}

/// A device's worker: its state and its record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub state: WorkerState,
    pub pid: Option<u32>,
    /// Workers started so far.
    pub started: u64,
    /// Workers that ended badly.
    pub failures: u64,
    /// Consecutive failures (what the backoff counts).
    pub failing: u64,
    pub last_failure: Option<String>,
    /// Workers that ended cleanly without being worth their start (served
    /// nothing, or lived under a second): each makes the next wait.
    #[serde(default)]
    pub short_lived: u64,
    /// Clients closed before any worker: their first message was not a
    /// vhost-user request.
    #[serde(default)]
    pub refused_clients: u64,
}

/// A device's tiering settings, and its backing file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierStat {
    pub backing: Option<BackingStat>,
    #[serde(with = "codec")]
    pub recompress_algo: Codec,
    pub idle_after_secs: Option<u64>,
    pub auto_writeback: bool,
    pub auto_recompress: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackingStat {
    pub path: PathBuf,
    pub blocks: u64,
    /// Blocks in use: the written-back pages, one each.
    pub used_blocks: u64,
    pub direct_io: bool,
}

/// Where a device's migration stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MigrationState {
    None,
    /// Waits for its pages.
    Incoming,
    Receiving,
    /// A stream failed; waits for another.
    Failed,
    Sending,
    /// Sent and committed; the pages were dropped here.
    Sent,
    SendFailed,
    /// Received and committed: it serves, and takes no other stream.
    Received,
    /// Every page is here, checked; waiting for the source to commit.
    Prepared,
    /// Sent with `--keep` and committed: the pages are here too.
    Copied,
    /// The destination holds every page; waiting for the VM to move (its
    /// frontend here to go, or `vzram migrate --commit`).
    Committing,
}

impl MigrationState {
    /// As `vzram stat` and `/metrics` name it (its JSON).
    pub fn name(self) -> &'static str {
        match self {
            MigrationState::None => "none",
            MigrationState::Incoming => "incoming",
            MigrationState::Receiving => "receiving",
            MigrationState::Failed => "failed",
            MigrationState::Sending => "sending",
            MigrationState::Sent => "sent",
            MigrationState::SendFailed => "send-failed",
            MigrationState::Received => "received",
            MigrationState::Prepared => "prepared",
            MigrationState::Copied => "copied",
            MigrationState::Committing => "committing",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrationStat {
    pub state: MigrationState,
    /// The address it waits on, if configured `incoming=`.
    pub incoming: Option<String>,
    /// Why the last migration failed.
    pub error: Option<String>,
    pub bytes: u64,
    pub records: u64,
    pub pass: u64,
    pub dirty_slots: u64,
    pub final_ms: f64,
    pub total_ms: f64,
}

/// The reply to `set-limit`: a device's limit, or the host's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LimitSet {
    Device(DeviceLimitSet),
    Host(HostLimitSet),
}

impl LimitSet {
    /// What the limit is at odds with (set all the same).
    pub fn warnings(&self) -> &[String] {
        match self {
            LimitSet::Device(d) => &d.warnings,
            LimitSet::Host(h) => &h.warnings,
        }
    }
}

/// The reply to `set-limit` of a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceLimitSet {
    pub device: String,
    pub mem_limit: u64,
    /// Set, but at odds with the host limit or with what the device
    /// holds now: one line each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// The reply to `set-limit` of the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostLimitSet {
    pub host_mem_limit: u64,
    /// Set, but below a device's limit or what the devices hold now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Compacted {
    pub pages_compacted: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Added {
    pub device: String,
    pub index: usize,
    /// It serves the pages a state left under its name held
    /// (`recover=true`); false: it starts empty.
    #[serde(default)]
    pub recovered: bool,
    #[serde(default)]
    pub state: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Forgotten {
    pub name: String,
    pub dir: PathBuf,
    pub size_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Removed {
    pub device: String,
    pub removed: bool,
    /// The device was connected (`--force`): its state was kept, a
    /// left-over from now on, and this command serves it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reset {
    pub device: String,
    pub pages_dropped: u64,
}

/// The reply to `reset-max`: nothing but `ok`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkedIdle {
    pub device: String,
    /// Pages newly marked.
    pub pages_marked: u64,
    /// Pages in memory idle now, those marked before included: what
    /// `writeback --idle` and `recompress --idle` take.
    #[serde(default)]
    pub pages_idle: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recompressed {
    pub device: String,
    #[serde(with = "codec")]
    pub algo: Codec,
    pub pages_tried: u64,
    pub pages_recompressed: u64,
    pub saved_bytes: u64,
    pub freed_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrittenBack {
    pub device: String,
    pub pages_written: u64,
    pub freed_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Migrated {
    pub device: String,
    pub to: String,
    pub pages: u64,
    pub bytes: u64,
    pub records: u64,
    pub passes: u32,
    pub final_records: u64,
    pub final_ms: f64,
    pub seconds: f64,
    pub rate_mib_s: f64,
    pub kept: bool,
}

/// `commit-migration` and `cancel-migration`: the sender's state once it
/// acted on the order (`sent` or `copied` after a commit, `send-failed`
/// after a cancel).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Committed {
    pub device: String,
    pub state: MigrationState,
}

/// The reply to `reload`: the file read, what was applied, and what the
/// file changes that was not (one line each: needs a restart, a device
/// kept because a frontend is connected, a device or limit refused).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reloaded {
    pub config: PathBuf,
    pub changes: Vec<ReloadChange>,
    #[serde(default)]
    pub not_applied: Vec<String>,
}

/// One change a reload applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "change", rename_all = "kebab-case")]
pub enum ReloadChange {
    /// In the file and not served: added (`recovered`: it serves the
    /// pages of a state left under its name).
    Added {
        device: String,
        recovered: bool,
    },
    /// Gone from the file: no longer served, its state kept (left over).
    Removed {
        device: String,
    },
    DeviceLimit {
        device: String,
        mem_limit: u64,
    },
    HostLimit {
        host_mem_limit: u64,
    },
    HostStaging {
        host_staging: u64,
    },
}

/// What kind of refusal a reply is, beside its text: what the client
/// branches on (its exit code), never the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorKind {
    /// The request itself is wrong: a line that does not parse, a value
    /// out of range, a codec the device already uses.
    BadRequest,
    /// It names a device or a left-over state the daemon does not have.
    NotFound,
    /// The device's state refuses it: a name or socket taken, no backing
    /// file, a migration in the wrong phase.
    Conflict,
    /// A frontend is connected; `--force` cuts it off.
    InUse,
    /// Another command or a connecting frontend holds the device: try again.
    Busy,
    /// Carried out as far as it went and failed there (a full backing
    /// file, an unreachable destination, a state the store refused).
    Failed,
    /// The daemon itself failed (a worker or the launcher did not answer):
    /// nothing in the request to fix.
    Internal,
}

impl ErrorKind {
    /// The client's exit status for it: 2 for what the user is to fix (a
    /// request the daemon refused), 1 for a failure at run time.
    pub fn exit_code(self) -> u8 {
        match self {
            ErrorKind::BadRequest
            | ErrorKind::NotFound
            | ErrorKind::Conflict
            | ErrorKind::InUse
            | ErrorKind::Busy
            | ErrorKind::Failed => 2,
            ErrorKind::Internal => 1,
        }
    }
}

/// What every reply line carries beside its result: whether it worked,
/// the daemon's version, and a refusal's kind and reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Head {
    pub ok: bool,
    /// The daemon's [`super::VERSION`]; None from a daemon older than it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ErrorKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Head {
    /// A success's head, from this daemon.
    pub fn ok() -> Head {
        Head {
            ok: true,
            version: Some(super::VERSION.to_string()),
            kind: None,
            error: None,
        }
    }

    /// A refusal, from this daemon.
    pub fn refused(kind: ErrorKind, error: impl Into<String>) -> Head {
        Head {
            ok: false,
            version: Some(super::VERSION.to_string()),
            kind: Some(kind),
            error: Some(error.into()),
        }
    }

    /// The head of a reply line read back; None if it has none.
    pub fn of(reply: &Value) -> Option<Head> {
        Head::deserialize(reply).ok()
    }
}

/// A reply line as the daemon writes it: the head, then the result's
/// fields (an object) beside it.
#[derive(Debug, Serialize)]
pub struct ReplyLine<T: Serialize> {
    #[serde(flatten)]
    pub head: Head,
    #[serde(flatten)]
    pub body: T,
}

/// A reply line read back: `"ok":true` and the result, or `"ok":false` and
/// `"error"`.
pub fn parse_reply<T: DeserializeOwned>(reply: Value) -> Result<T, ReplyError> {
    match reply.get("ok") {
        Some(Value::Bool(true)) => serde_json::from_value(reply).map_err(ReplyError::Malformed),
        Some(Value::Bool(false)) => Err(ReplyError::Refused(Refusal {
            // A daemon older than kinds sends none (nor one this client
            // does not know).
            kind: reply
                .get("kind")
                .and_then(|k| ErrorKind::deserialize(k).ok()),
            message: reply
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("no reason given")
                .to_string(),
        })),
        _ => Err(ReplyError::Malformed(serde::de::Error::custom(
            "no \"ok\" in the reply",
        ))),
    }
}

/// A refusal read back: its kind (None from an older daemon) and text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub kind: Option<ErrorKind>,
    pub message: String,
}

/// Why a reply carries no result.
#[derive(Debug, thiserror::Error)]
pub enum ReplyError {
    #[error("daemon refused: {0}")]
    Refused(Refusal),
    #[error("bad reply: {0}")]
    Malformed(serde_json::Error),
}

/// Why [`Client::call`] got no result.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot encode the request: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("cannot talk to the daemon at {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Reply(#[from] ReplyError),
}

impl ControlError {
    /// The client's exit status: a refusal's by its kind (2 from a daemon
    /// that gives none, as all its refusals were), 1 for the rest.
    pub fn exit_code(&self) -> u8 {
        match self {
            ControlError::Reply(ReplyError::Refused(r)) => r.kind.map_or(2, ErrorKind::exit_code),
            ControlError::Reply(ReplyError::Malformed(_))
            | ControlError::Encode(_)
            | ControlError::Io { .. } => 1,
        }
    }
}

/// The client's end of a control socket.
pub struct Client {
    path: PathBuf,
}

impl Client {
    pub fn new(path: &std::path::Path) -> Client {
        Client {
            path: path.to_path_buf(),
        }
    }

    /// Sends `c` and reads its reply, waiting up to [`Command::WAIT`].
    pub fn call<C: Command>(&self, c: &C) -> Result<C::Reply, ControlError> {
        Ok(parse_reply(self.call_raw(c)?)?)
    }

    /// [`Client::call`], the reply line as it came (for `--json`).
    pub fn call_raw<C: Command>(&self, c: &C) -> Result<Value, ControlError> {
        let req: Request = c.clone().into();
        let req = serde_json::to_value(req).map_err(ControlError::Encode)?;
        request_waiting(&self.path, &req, C::WAIT).map_err(|source| ControlError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

/// How long `vzram stat` and friends wait for the daemon.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Client side: sends one request and returns the parsed reply.
/// Gives up after [`CLIENT_TIMEOUT`] without a reply: a socket that is not
/// a control socket (a device's, say) must not hang the command.
pub fn request(path: &std::path::Path, req: &Value) -> io::Result<Value> {
    request_waiting(path, req, CLIENT_TIMEOUT)
}

/// [`request`] for a request that may take up to `wait` to carry out (a
/// writeback through a slow disk).
pub fn request_waiting(path: &std::path::Path, req: &Value, wait: Duration) -> io::Result<Value> {
    let hint = |e: io::Error| match e.kind() {
        io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::WouldBlock
        | io::ErrorKind::TimedOut => {
            io::Error::new(e.kind(), format!("{e}: is this a vzram control socket?"))
        }
        _ => e,
    };
    exchange(path, req, wait).map_err(hint)
}

fn exchange(path: &std::path::Path, req: &Value, wait: Duration) -> io::Result<Value> {
    let mut stream = UnixStream::connect(path)?;
    stream.set_read_timeout(Some(wait))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    writeln!(stream, "{req}")?;
    let mut line = String::new();
    BufReader::new(&stream)
        .take(16 << 20)
        .read_line(&mut line)?;
    if line.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "closed without a reply: is this a vzram control socket?",
        ));
    }
    serde_json::from_str(&line).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad reply ({e}): is this a vzram control socket?"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `stat`'s table and `/metrics` name a state as its JSON does.
    #[test]
    fn state_names_are_their_json() {
        use MigrationState as M;
        for m in [
            M::None,
            M::Incoming,
            M::Receiving,
            M::Failed,
            M::Sending,
            M::Sent,
            M::SendFailed,
            M::Received,
            M::Prepared,
            M::Copied,
            M::Committing,
        ] {
            assert_eq!(serde_json::to_value(m).unwrap(), m.name());
        }
        use WorkerState as W;
        for w in [W::Idle, W::Starting, W::Running, W::Busy, W::Failing] {
            assert_eq!(serde_json::to_value(w).unwrap(), w.name());
        }
    }

    /// A refusal's kind decides the exit status; an older daemon's
    /// refusal, without one, is 2 as all were.
    #[test]
    fn refusals_read_back_with_their_kind() {
        let line =
            serde_json::to_value(Head::refused(ErrorKind::Internal, "worker: gone")).unwrap();
        let e = ControlError::from(parse_reply::<Done>(line).unwrap_err());
        assert_eq!(e.to_string(), "daemon refused: worker: gone");
        assert_eq!(e.exit_code(), 1);
        let old = serde_json::json!({"ok": false, "error": "no device 7"});
        let e = ControlError::from(parse_reply::<Done>(old).unwrap_err());
        assert_eq!(e.exit_code(), 2);
    }
}
