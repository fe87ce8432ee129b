//! A configuration that cannot be served, and why: every one is the
//! user's to fix.

use std::io;
use std::os::fd::RawFd;
use std::path::PathBuf;

use thiserror::Error;

use super::parse::{ValueError, MAX_POLL_US};
use super::refusal::Refusal;
use crate::owner::tls::TlsError;
use crate::proto::worker_spec::ParseSeccompError;

/// A configuration that cannot be served: every one is the user's to fix.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// A rule the values break together (a limit above the size, a name
    /// used twice, a flag without the one it needs).
    #[error(transparent)]
    Rule(#[from] Refusal),
    /// A value of the file, under its key.
    #[error("{key}: {source}")]
    Value {
        key: &'static str,
        #[source]
        source: ValueError,
    },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// What is wrong inside the file at `path`.
    #[error("{}: {source}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: Box<ConfigError>,
    },
    /// TOML that does not parse: toml's message, on one line.
    #[error("{}{message}", at_line(*line))]
    Syntax {
        line: Option<usize>,
        message: String,
    },
    #[error("line {line}: {source}")]
    Mode {
        line: usize,
        #[source]
        source: ModeError,
    },
    #[error(transparent)]
    Seccomp(#[from] ParseSeccompError),
    #[error("poll_us: {0} is more than {MAX_POLL_US} (1 s)")]
    PollUs(u64),
    /// `--fd N`: not a listening unix socket bound to a path.
    #[error("--fd {fd}: {source}")]
    Fd {
        fd: RawFd,
        #[source]
        source: io::Error,
    },
    #[error("--tls-creds: {0}")]
    TlsCreds(#[source] TlsError),
    #[error("device {0}: --fresh and --adopt exclude each other")]
    FreshAndAdopt(String),
    #[error("--size, --queues, --algo, --mem-limit, --serial, --readonly, --name and the tiering flags (--backing-file, --idle-after, ...) need --socket")]
    FlagsWithoutSocket,
}

fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!("line {l}: ")).unwrap_or_default()
}

/// A mode in the config file that is not one (`key = raw` as written).
#[derive(Debug, Error)]
pub enum ModeError {
    #[error("{key}: {source}")]
    Text {
        key: &'static str,
        #[source]
        source: ValueError,
    },
    #[error(
        "{key} = {raw} is not a mode; write it in octal: {}",
        mode_example(key)
    )]
    NotANumber { key: &'static str, raw: String },
    /// TOML reads `600` as six hundred: a mode in decimal is never meant.
    #[error(
        "{key} = {raw} is a decimal number; write the mode in octal: {}",
        decimal_hint(key, raw)
    )]
    Decimal { key: &'static str, raw: String },
    #[error("{key} = {raw} is not a mode: only the permission bits 0o000 to 0o777 can be set; for example {}", mode_example(key))]
    Bits { key: &'static str, raw: String },
}

fn mode_example(key: &str) -> String {
    format!("{key} = 0o600 or {key} = \"0600\"")
}

/// The octal a decimal mode was likely meant as, when it reads as one.
fn decimal_hint(key: &str, raw: &str) -> String {
    if (1..=4).contains(&raw.len())
        && raw.bytes().all(|b| (b'0'..=b'7').contains(&b))
        && u32::from_str_radix(raw, 8).is_ok_and(|m| m <= 0o777)
    {
        format!("{key} = 0o{raw} or {key} = \"{raw:0>4}\"")
    } else {
        mode_example(key)
    }
}
