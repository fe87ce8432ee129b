//! The TOML configuration file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::draft::DeviceDraft;
use super::error::{ConfigError, ModeError};
use super::parse::{parse_metrics_addr, parse_mode, parse_size, MAX_POLL_US};
use crate::proto::worker_spec::SeccompMode;

/// A size in the config file: a number of bytes or a string like "8G".
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl SizeValue {
    fn bytes(&self, key: &'static str) -> Result<u64, ConfigError> {
        match self {
            SizeValue::Bytes(n) => Ok(*n),
            SizeValue::Text(s) => {
                parse_size(s).map_err(|source| ConfigError::Value { key, source })
            }
        }
    }
}

/// `socket_mode` or `control_mode` in the config file: an integer written in octal
/// (`0o600`), or octal text (`"0600"`, `"600"`, `"0o600"`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ModeValue {
    Number(i64),
    Text(String),
    /// Anything else (a boolean, a float, a table), refused in [`ModeValue::mode`].
    Other(serde::de::IgnoredAny),
}

impl ModeValue {
    /// The mode of setting `key`; `raw` is the value as written in the file.
    fn mode(&self, key: &'static str, raw: &str) -> Result<u32, ModeError> {
        let raw_text = || raw.to_string();
        let n = match self {
            ModeValue::Text(s) => {
                return parse_mode(s).map_err(|source| ModeError::Text { key, source })
            }
            ModeValue::Number(n) => *n,
            ModeValue::Other(_) => {
                return Err(ModeError::NotANumber {
                    key,
                    raw: raw_text(),
                })
            }
        };
        // TOML reads `600` as six hundred, which as a mode is 0o1130, and
        // `400` as 0o620, which lets the group connect: a mode written in
        // decimal is never what was meant, so only octal (or hex, binary)
        // integers are taken, as the value they are.
        let decimal = !["0o", "0x", "0b"].iter().any(|p| raw.starts_with(p));
        if decimal {
            return Err(ModeError::Decimal {
                key,
                raw: raw_text(),
            });
        }
        match u32::try_from(n) {
            Ok(m) if m <= 0o777 => Ok(m),
            _ => Err(ModeError::Bits {
                key,
                raw: raw_text(),
            }),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(alias = "host-mem-limit")]
    host_mem_limit: Option<SizeValue>,
    control: Option<PathBuf>,
    /// `"127.0.0.1:9100"`.
    metrics: Option<String>,
    #[serde(alias = "state-dir")]
    state_dir: Option<PathBuf>,
    #[serde(alias = "socket-mode")]
    socket_mode: Option<toml::Spanned<ModeValue>>,
    #[serde(alias = "control-mode")]
    control_mode: Option<toml::Spanned<ModeValue>>,
    #[serde(alias = "incoming-mode")]
    incoming_mode: Option<toml::Spanned<ModeValue>>,
    #[serde(alias = "tls-creds")]
    tls_creds: Option<PathBuf>,
    /// `true`/`false`, or "on", "off", "log".
    seccomp: Option<SeccompValue>,
    #[serde(alias = "compress-threads")]
    compress_threads: Option<usize>,
    #[serde(alias = "host-staging")]
    host_staging: Option<SizeValue>,
    #[serde(alias = "poll-us")]
    poll_us: Option<u64>,
    #[serde(
        default,
        alias = "incoming-timeout",
        deserialize_with = "super::de::duration"
    )]
    incoming_timeout: Option<std::time::Duration>,
    #[serde(default)]
    device: Vec<DeviceDraft>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum SeccompValue {
    Bool(bool),
    Text(String),
}

/// What the config file holds, as drafts for the command line to extend.
#[derive(Debug, Default)]
pub struct FileDrafts {
    pub host_mem_limit: Option<u64>,
    pub control: Option<PathBuf>,
    pub metrics: Option<SocketAddr>,
    pub state_dir: Option<PathBuf>,
    pub socket_mode: Option<u32>,
    pub control_mode: Option<u32>,
    pub incoming_mode: Option<u32>,
    pub tls_creds: Option<PathBuf>,
    pub seccomp: Option<SeccompMode>,
    pub compress_threads: Option<usize>,
    pub host_staging: Option<u64>,
    pub poll_us: Option<u64>,
    pub incoming_timeout: Option<std::time::Duration>,
    pub devices: Vec<DeviceDraft>,
}

/// Reads and parses a TOML config file.
/// The top-level keys the file takes (snake_case), as its parser lists
/// them: for checking that `--help` names them all.
pub fn keys() -> Vec<String> {
    let e = parse_file("a_key_no_file_has = 1")
        .err()
        .map(|e| e.to_string());
    let e = e.unwrap_or_default();
    let list = e.split("expected one of").nth(1).unwrap_or_default();
    let mut keys: Vec<String> = list
        .split(',')
        .map(|k| k.trim().trim_matches('`').replace('-', "_"))
        .filter(|k| !k.is_empty())
        .collect();
    keys.dedup();
    keys
}

pub fn load_file(path: &Path) -> Result<FileDrafts, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_file(&text).map_err(|e| ConfigError::File {
        path: path.to_path_buf(),
        source: Box::new(e),
    })
}

pub fn parse_file(text: &str) -> Result<FileDrafts, ConfigError> {
    let f: FileConfig = toml::from_str(text).map_err(|e| {
        // toml's messages span several lines (they quote the input); keep one.
        let msg = e
            .message()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join("; ");
        // `[device]` is one table where the file wants an array of them.
        let at = e.span().and_then(|s| text.get(s)).unwrap_or_default();
        let msg = if msg.contains("expected a sequence") && at.trim_start().starts_with("[device]") {
            "[device] is one table: each device is a [[device]] table (double brackets), one per device".to_string()
        } else {
            msg
        };
        ConfigError::Syntax {
            line: e
                .span()
                .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1),
            message: msg,
        }
    })?;
    let mode = |key: &'static str, m: Option<toml::Spanned<ModeValue>>| match m {
        None => Ok(None),
        Some(m) => {
            let span = m.span();
            let raw = text.get(span.clone()).unwrap_or_default().trim();
            let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
            m.get_ref()
                .mode(key, raw)
                .map(Some)
                .map_err(|source| ConfigError::Mode { line, source })
        }
    };
    let socket_mode = mode("socket_mode", f.socket_mode)?;
    let control_mode = mode("control_mode", f.control_mode)?;
    let incoming_mode = mode("incoming_mode", f.incoming_mode)?;
    let seccomp = match f.seccomp {
        None => None,
        Some(SeccompValue::Bool(true)) => Some(SeccompMode::On),
        Some(SeccompValue::Bool(false)) => Some(SeccompMode::Off),
        Some(SeccompValue::Text(s)) => Some(s.parse()?),
    };
    if let Some(us) = f.poll_us.filter(|&us| us > MAX_POLL_US) {
        return Err(ConfigError::PollUs(us));
    }
    let devices = f.device;
    Ok(FileDrafts {
        host_mem_limit: f
            .host_mem_limit
            .map(|s| s.bytes("host_mem_limit"))
            .transpose()?,
        control: f.control,
        metrics: f
            .metrics
            .map(|m| {
                parse_metrics_addr(&m).map_err(|source| ConfigError::Value {
                    key: "metrics",
                    source,
                })
            })
            .transpose()?,
        state_dir: f.state_dir,
        socket_mode,
        control_mode,
        incoming_mode,
        tls_creds: f.tls_creds,
        seccomp,
        compress_threads: f.compress_threads,
        host_staging: f
            .host_staging
            .map(|s| s.bytes("host_staging"))
            .transpose()?,
        poll_us: f.poll_us,
        incoming_timeout: f.incoming_timeout,
        devices,
    })
}
