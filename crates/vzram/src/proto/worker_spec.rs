//! The worker's command line: the spec the supervisor has the launcher
//! pass it, the order of the descriptors it inherits, and the exit codes
//! the supervisor tells apart. Values travel typed (serde), as text where
//! a person may read them in `ps`.

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use vzram_store::Codec;

use super::codec;

/// `--seccomp on|off|log`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SeccompMode {
    /// Refuse (and die on) anything outside the list.
    #[default]
    On,
    /// No filter.
    Off,
    /// Allow everything; the kernel logs what `On` would refuse.
    Log,
}

/// A `--seccomp` value that is none of the modes (as given).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad seccomp mode {0:?}: expected on, off or log")]
pub struct ParseSeccompError(pub String);

impl FromStr for SeccompMode {
    type Err = ParseSeccompError;

    fn from_str(s: &str) -> Result<SeccompMode, ParseSeccompError> {
        match s {
            "on" | "true" | "yes" | "1" => Ok(SeccompMode::On),
            "off" | "false" | "no" | "0" => Ok(SeccompMode::Off),
            "log" => Ok(SeccompMode::Log),
            _ => Err(ParseSeccompError(s.to_string())),
        }
    }
}

impl std::fmt::Display for SeccompMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SeccompMode::On => "on",
            SeccompMode::Off => "off",
            SeccompMode::Log => "log",
        })
    }
}

/// `--log-format`, and how a worker writes its lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Text; when stderr is the journal (`JOURNAL_STREAM`), each line
    /// starts with its syslog priority and carries no timestamp.
    #[default]
    Text,
    /// One JSON object per line, for other collectors.
    Json,
}

/// `--log-level`, and the level a worker logs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }
}

/// Exit codes the supervisor tells apart.
pub const EXIT_DONE: i32 = 0;
pub const EXIT_SETUP: i32 = 1;
/// The device's state is damaged or does not match: retrying cannot help.
pub const EXIT_STATE: i32 = 2;

/// What a worker is told on its command line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Spec {
    pub name: String,
    pub size: u64,
    pub queues: u16,
    #[serde(with = "codec")]
    pub algo: Codec,
    pub serial: String,
    pub readonly: bool,
    /// Segments per discard or write-zeroes request the device offers.
    #[serde(default = "all_discard_segments")]
    pub discard_segments: u16,
    pub mem_limit: u64,
    /// Raw staging budget in bytes (0: off; a spec from before staging).
    #[serde(default)]
    pub staging: u64,
    /// The state directory, for messages only (the files come as descriptors).
    pub state_dir: PathBuf,
    pub seccomp: SeccompMode,
    pub log_level: LogLevel,
    #[serde(default)]
    pub log_format: LogFormat,
    /// Compress-pool threads (capped at the cores); None: the cores, at
    /// most 4.
    #[serde(default)]
    pub compress_threads: Option<usize>,
    /// Longest poll of a ring that ran dry, in µs; None: the default.
    #[serde(default)]
    pub poll_us: Option<u64>,
    /// The backing file comes as [`WorkerFds::backing`] when set.
    pub backing: Option<BackingSpec>,
    pub tier: TierSettings,
}

/// A worker spec from before `discard_segments` offers all of them.
fn all_discard_segments() -> u16 {
    vzram_blk::config::MAX_DISCARD_SEG as u16
}

/// The backing file handed over: its path (for messages and stats) and
/// whether it was opened with O_DIRECT.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BackingSpec {
    pub path: PathBuf,
    pub direct: bool,
}

/// The automatic tiering a worker runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TierSettings {
    /// The ager runs every third of this (milliseconds); None: no ager.
    pub idle_after_ms: Option<u64>,
    pub auto_writeback: bool,
    pub auto_recompress: bool,
    #[serde(with = "codec")]
    pub recompress_algo: Codec,
}

/// The descriptors a worker inherits, by name. They travel as a list
/// placed from [`super::wire::FIRST_FD`] on; [`WorkerFds::in_order`] and
/// [`WorkerFds::inherited`] are the one place that knows its order.
#[derive(Debug)]
pub struct WorkerFds<F> {
    /// The worker's end of its channel to the supervisor.
    pub control: F,
    /// The pool's host-wide accounting file.
    pub host: F,
    pub lock: F,
    pub table: F,
    pub arena: F,
    pub stats: F,
    /// The frontend's vhost-user connection.
    pub frontend: F,
    /// Only when the spec names a backing file.
    pub backing: Option<F>,
}

impl<F: Copy> WorkerFds<F> {
    /// The list as it is sent.
    pub fn in_order(&self) -> Vec<F> {
        let mut v = vec![
            self.control,
            self.host,
            self.lock,
            self.table,
            self.arena,
            self.stats,
            self.frontend,
        ];
        v.extend(self.backing);
        v
    }
}

impl WorkerFds<OwnedFd> {
    /// Takes the descriptors the launcher placed for this worker.
    ///
    /// # Safety
    /// Only in a worker process, and once: the descriptors from
    /// [`super::wire::FIRST_FD`] on must be the list [`WorkerFds::in_order`]
    /// made (with a backing file when `backing`), owned by nothing else.
    pub unsafe fn inherited(backing: bool) -> WorkerFds<OwnedFd> {
        let mut next = super::wire::FIRST_FD;
        let mut take = || {
            // SAFETY: the caller's promise: each number is an open
            // descriptor of ours, taken once.
            let fd = unsafe { OwnedFd::from_raw_fd(next) };
            next += 1;
            fd
        };
        WorkerFds {
            control: take(),
            host: take(),
            lock: take(),
            table: take(),
            arena: take(),
            stats: take(),
            frontend: take(),
            backing: backing.then(take),
        }
    }
}
