//! The daemon's configuration: sizes, the TOML file, `--device` specs, and
//! the checks that turn them into a [`DaemonConfig`]. Every error here is
//! the user's input, so the binary reports it in one line and exits 2.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;
use vzram_blk::config::{MAX_QUEUES, SERIAL_LEN};
use vzram_store::{Codec, PAGE_SIZE};

pub use crate::seccomp::Mode as SeccompMode;

pub const DEFAULT_QUEUES: u16 = 4;
pub const DEFAULT_SOCKET_MODE: u32 = 0o600;
/// The ager runs every third of `idle-after`; below this it would scan the
/// slot table more than once a second for little gain.
pub const MIN_IDLE_AFTER: Duration = Duration::from_secs(3);

#[derive(Debug, Error, PartialEq, Eq)]
#[error("{0}")]
pub struct ConfigError(pub String);

fn err<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError(msg.into()))
}

/// Parses `512M`, `8G`, `8Gi`, `1.5G`, `1T`, `64K` (binary units, with an
/// optional `i`, `B` or `iB`) or plain bytes. A fraction must come to a
/// whole number of bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("ib"))
        .or_else(|| t.strip_suffix(['B', 'b']))
        .or_else(|| t.strip_suffix('i'))
        .unwrap_or(t);
    let (number, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                'P' => 50,
                _ => {
                    return Err(format!(
                        "bad size {s:?}: unknown unit {c:?} (use K, M, G or T)"
                    ))
                }
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(frac) || number.ends_with('.') {
        return Err(format!(
            "bad size {s:?}: expected a number with an optional K, M, G or T"
        ));
    }
    let too_large = || format!("bad size {s:?}: too large");
    // Exact: (whole.frac * 10^k) << shift, then / 10^k, all in integers.
    let scale = 10u128
        .checked_pow(frac.len() as u32)
        .ok_or_else(too_large)?;
    let n: u128 = format!("{whole}{frac}").parse().map_err(|_| too_large())?;
    let bytes = n.checked_mul(1u128 << shift).ok_or_else(too_large)?;
    if bytes % scale != 0 {
        return Err(format!(
            "bad size {s:?}: not a whole number of bytes (sizes are multiples of {PAGE_SIZE})"
        ));
    }
    u64::try_from(bytes / scale).map_err(|_| too_large())
}

/// Parses an octal file mode such as `0600` or `660`.
pub fn parse_mode(s: &str) -> Result<u32, String> {
    let t = s.strip_prefix("0o").unwrap_or(s);
    match u32::from_str_radix(t, 8) {
        Ok(m) if m <= 0o777 && !t.is_empty() => Ok(m),
        _ => Err(format!(
            "bad socket mode {s:?}: expected octal permissions like 0600"
        )),
    }
}

/// Parses `--metrics`: an IP address and a port, `127.0.0.1:9100` or
/// `[::1]:9100` (port 0: any free one, reported by `vzram stat`).
pub fn parse_metrics_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| format!("bad metrics address {s:?}: expected IP:PORT, such as 127.0.0.1:9100"))
}

pub fn parse_codec(s: &str) -> Result<Codec, String> {
    s.parse::<Codec>()
}

/// Parses a duration: a whole number with `s`, `m` or `h` (`90s`, `10m`, `1h`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let bad = || format!("bad duration {s:?}: expected a whole number with s, m or h, such as 10m");
    let (number, unit) = t.split_at(t.len().saturating_sub(1));
    let secs_per = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(bad()),
    };
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(secs_per))
        .map(Duration::from_secs)
        .ok_or_else(|| format!("bad duration {s:?}: too long"))
}

/// The codec a device recompresses with unless told: zstd:3 for an lz4
/// device. A zstd device gets zstd:9 (or its own level, if higher): its
/// compressed pages already are zstd (a slot records the codec, not its
/// level), so only its huge pages are tried, and those deserve a strong level.
pub fn default_recompress_algo(algo: Codec) -> Codec {
    match algo {
        Codec::Lz4 => Codec::Zstd { level: 3 },
        Codec::Zstd { level } => Codec::Zstd {
            level: level.max(9),
        },
    }
}

pub fn parse_bool(s: &str) -> Result<bool, String> {
    match s {
        "true" | "yes" | "on" | "1" => Ok(true),
        "false" | "no" | "off" | "0" => Ok(false),
        _ => Err(format!("bad boolean {s:?}: expected true or false")),
    }
}

/// One device as given, before defaults and checks. The one form of all
/// three ways to give a device: the single-device flags of `vzram serve`
/// (`clap::Args`, flattened), a `[[device]]` table of the config file, and a
/// `--device` / `vzram add` spec (`socket=...,size=...`, read through the
/// same `Deserialize`), so every key means the same everywhere.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceDraft {
    /// Name of that device in stats and control requests [default: vzramN,
    /// N its place among all devices: vzram0 when it is the only one].
    #[arg(long)]
    pub name: Option<String>,
    /// vhost-user socket of a single device (with --size). `--socket-path`
    /// is the same, as QEMU's backend-program convention names it.
    #[arg(long, alias = "socket-path", value_name = "PATH")]
    #[serde(alias = "path")]
    pub socket: Option<PathBuf>,
    /// Capacity of that device: 512M, 8G, 1T or bytes (a multiple of 4096).
    #[arg(long, value_parser = parse_size)]
    #[serde(default, deserialize_with = "de::size")]
    pub size: Option<u64>,
    /// Virtqueues of that device, one worker thread each [default: 4].
    #[arg(long)]
    #[serde(default, alias = "num-queues", deserialize_with = "de::number")]
    pub queues: Option<u16>,
    /// Compression: lz4, zstd or zstd:LEVEL [default: lz4].
    #[arg(long, value_parser = parse_codec)]
    #[serde(default, alias = "comp-algorithm", deserialize_with = "de::codec")]
    pub algo: Option<Codec>,
    /// Cap on the memory that device may use (0 = none).
    #[arg(long, value_parser = parse_size)]
    #[serde(default, alias = "mem-limit", deserialize_with = "de::size")]
    pub mem_limit: Option<u64>,
    /// Serial the guest reads with GET_ID (at most 20 bytes) [default:
    /// vzram-NAME, cut to 20 bytes; contrib/udev/60-vzram.rules matches vzram*].
    #[arg(long)]
    pub serial: Option<String>,
    /// Offer the device read-only.
    #[arg(long, visible_alias = "read-only", num_args = 0..=1, default_missing_value = "true", value_parser = parse_bool, value_name = "BOOL")]
    #[serde(
        default,
        alias = "read-only",
        alias = "ro",
        deserialize_with = "de::boolean"
    )]
    pub readonly: Option<bool>,
    /// Where this device keeps its state (`state-dir=` in a spec, `state_dir`
    /// in the file; the daemon's `--state-dir` otherwise).
    #[arg(skip)]
    #[serde(alias = "state-dir")]
    pub state_dir: Option<PathBuf>,
    /// A file or block device on host storage that written-back pages go
    /// to, and that writes past a memory limit spill to (it must exist and
    /// hold at least 8 KiB: a header block and one page; opened with
    /// O_DIRECT where the file system takes it).
    #[arg(long, value_name = "PATH")]
    #[serde(alias = "backing-file")]
    pub backing_file: Option<PathBuf>,
    /// Codec `vzram recompress` and --auto-recompress use [default: zstd:3
    /// for an lz4 device, zstd:9 for a zstd one].
    #[arg(long, value_parser = parse_codec, value_name = "ALGO")]
    #[serde(default, alias = "recompress-algo", deserialize_with = "de::codec")]
    pub recompress_algo: Option<Codec>,
    /// Pages not read or written for this long count as cold (90s, 10m,
    /// 1h; at least 3s): runs the ager every third of it while a frontend
    /// is connected.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, alias = "idle-after", deserialize_with = "de::duration")]
    pub idle_after: Option<Duration>,
    /// After each ager pass, move cold pages to the backing file, paced
    /// (needs --backing-file and --idle-after).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_bool, value_name = "BOOL")]
    #[serde(default, alias = "auto-writeback", deserialize_with = "de::boolean")]
    pub auto_writeback: Option<bool>,
    /// After each ager pass, recompress cold pages with the recompress
    /// codec, paced (needs --idle-after). With --auto-writeback too, only
    /// the cold pages recompression cannot shrink go to the backing file.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_bool, value_name = "BOOL")]
    #[serde(default, alias = "auto-recompress", deserialize_with = "de::boolean")]
    pub auto_recompress: Option<bool>,
    /// That device waits for its pages from another vzram (`vzram migrate`
    /// there) before it serves a request: unix:PATH (recommended; tunnel it
    /// over SSH or TLS between hosts) or tcp:HOST:PORT (unencrypted: it
    /// carries guest memory in clear).
    #[arg(long, value_parser = crate::migration::parse_addr, value_name = "ADDR")]
    #[serde(default, deserialize_with = "de::addr")]
    pub incoming: Option<crate::migration::Addr>,
}

/// Parses a `--device` value: `socket=PATH,size=8G,queues=4,...`, with the
/// keys of a `[[device]]` table.
pub fn parse_device_spec(s: &str) -> Result<DeviceDraft, String> {
    let mut map = serde_json::Map::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("bad device option {part:?}: expected key=value"))?;
        map.insert(k.to_string(), serde_json::Value::String(v.to_string()));
    }
    DeviceDraft::deserialize(serde_json::Value::Object(map))
        .map_err(|e| format!("device spec {s:?}: {e}"))
}

/// Field readers that take a value written as text (`--device` specs) or
/// as TOML wrote it (a number, a boolean).
mod de {
    use super::*;
    use serde::Deserializer;

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Int(u64),
        Bool(bool),
        Text(String),
    }

    fn raw<'de, D: Deserializer<'de>>(d: D) -> Result<Raw, D::Error> {
        Raw::deserialize(d)
    }

    pub fn size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        match raw(d)? {
            Raw::Int(n) => Ok(Some(n)),
            Raw::Text(t) => parse_size(&t).map(Some).map_err(serde::de::Error::custom),
            Raw::Bool(_) => Err(serde::de::Error::custom("a size, not a boolean")),
        }
    }

    pub fn number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u16>, D::Error> {
        let n = match raw(d)? {
            Raw::Int(n) => n,
            Raw::Text(t) => t
                .parse()
                .map_err(|_| serde::de::Error::custom(format!("bad number {t:?}")))?,
            Raw::Bool(_) => return Err(serde::de::Error::custom("a number, not a boolean")),
        };
        u16::try_from(n)
            .map(Some)
            .map_err(|_| serde::de::Error::custom(format!("{n} is too large")))
    }

    pub fn codec<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Codec>, D::Error> {
        match raw(d)? {
            Raw::Text(t) => parse_codec(&t).map(Some).map_err(serde::de::Error::custom),
            _ => Err(serde::de::Error::custom(
                "a codec name: lz4, zstd or zstd:LEVEL",
            )),
        }
    }

    pub fn boolean<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
        match raw(d)? {
            Raw::Bool(b) => Ok(Some(b)),
            Raw::Text(t) => parse_bool(&t).map(Some).map_err(serde::de::Error::custom),
            Raw::Int(_) => Err(serde::de::Error::custom("true or false")),
        }
    }

    pub fn addr<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<crate::migration::Addr>, D::Error> {
        match raw(d)? {
            Raw::Text(t) => crate::migration::parse_addr(&t)
                .map(Some)
                .map_err(serde::de::Error::custom),
            _ => Err(serde::de::Error::custom(
                "an address: unix:PATH or tcp:HOST:PORT",
            )),
        }
    }

    pub fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        match raw(d)? {
            Raw::Text(t) => parse_duration(&t)
                .map(Some)
                .map_err(serde::de::Error::custom),
            _ => Err(serde::de::Error::custom(
                "a duration with its unit, such as \"10m\"",
            )),
        }
    }
}

/// A size in the config file: a number of bytes or a string like "8G".
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl SizeValue {
    fn bytes(&self, what: &str) -> Result<u64, ConfigError> {
        match self {
            SizeValue::Bytes(n) => Ok(*n),
            SizeValue::Text(s) => parse_size(s).map_err(|e| ConfigError(format!("{what}: {e}"))),
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
    fn mode(&self, key: &str, raw: &str) -> Result<u32, String> {
        let example = format!("{key} = 0o600 or {key} = \"0600\"");
        let n = match self {
            ModeValue::Text(s) => return parse_mode(s).map_err(|e| format!("{key}: {e}")),
            ModeValue::Number(n) => *n,
            ModeValue::Other(_) => {
                return Err(format!(
                    "{key} = {raw} is not a mode; write it in octal: {example}"
                ))
            }
        };
        // TOML reads `600` as six hundred, which as a mode is 0o1130, and
        // `400` as 0o620, which lets the group connect: a mode written in
        // decimal is never what was meant, so only octal (or hex, binary)
        // integers are taken, as the value they are.
        let decimal = !["0o", "0x", "0b"].iter().any(|p| raw.starts_with(p));
        if decimal {
            let hint = if (1..=4).contains(&raw.len())
                && raw.bytes().all(|b| (b'0'..=b'7').contains(&b))
                && u32::from_str_radix(raw, 8).is_ok_and(|m| m <= 0o777)
            {
                format!("{key} = 0o{raw} or {key} = \"{raw:0>4}\"")
            } else {
                example
            };
            return Err(format!(
                "{key} = {raw} is a decimal number; write the mode in octal: {hint}"
            ));
        }
        match u32::try_from(n) {
            Ok(m) if m <= 0o777 => Ok(m),
            _ => Err(format!(
                "{key} = {raw} is not a mode: only the permission bits 0o000 to 0o777 can be set; for example {example}"
            )),
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
    /// `true`/`false`, or "on", "off", "log".
    seccomp: Option<SeccompValue>,
    #[serde(alias = "compress-threads")]
    compress_threads: Option<usize>,
    #[serde(alias = "poll-us")]
    poll_us: Option<u64>,
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
    pub seccomp: Option<SeccompMode>,
    pub compress_threads: Option<usize>,
    pub poll_us: Option<u64>,
    pub devices: Vec<DeviceDraft>,
}

/// Reads and parses a TOML config file.
pub fn load_file(path: &Path) -> Result<FileDrafts, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
    parse_file(&text).map_err(|e| ConfigError(format!("{}: {}", path.display(), e.0)))
}

/// The longest `poll_us` (`--poll-us`) taken: a second.
pub const MAX_POLL_US: u64 = 1_000_000;

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
        match e
            .span()
            .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1)
        {
            Some(line) => ConfigError(format!("line {line}: {msg}")),
            None => ConfigError(msg),
        }
    })?;
    let mode = |key: &str, m: Option<toml::Spanned<ModeValue>>| match m {
        None => Ok(None),
        Some(m) => {
            let span = m.span();
            let raw = text.get(span.clone()).unwrap_or_default().trim();
            let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
            m.get_ref()
                .mode(key, raw)
                .map(Some)
                .map_err(|e| ConfigError(format!("line {line}: {e}")))
        }
    };
    let socket_mode = mode("socket_mode", f.socket_mode)?;
    let control_mode = mode("control_mode", f.control_mode)?;
    let seccomp = match f.seccomp {
        None => None,
        Some(SeccompValue::Bool(true)) => Some(SeccompMode::On),
        Some(SeccompValue::Bool(false)) => Some(SeccompMode::Off),
        Some(SeccompValue::Text(s)) => Some(s.parse().map_err(ConfigError)?),
    };
    if let Some(us) = f.poll_us.filter(|&us| us > MAX_POLL_US) {
        return Err(ConfigError(format!(
            "poll_us: {us} is more than {MAX_POLL_US} (1 s)"
        )));
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
            .map(|m| parse_metrics_addr(&m).map_err(|e| ConfigError(format!("metrics: {e}"))))
            .transpose()?,
        state_dir: f.state_dir,
        socket_mode,
        control_mode,
        seccomp,
        compress_threads: f.compress_threads,
        poll_us: f.poll_us,
        devices,
    })
}

/// One device, checked and with defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    pub name: String,
    pub socket: PathBuf,
    pub size: u64,
    pub queues: u16,
    pub algo: Codec,
    pub mem_limit: u64,
    pub serial: String,
    pub readonly: bool,
    /// Where this device keeps its state, if not in the daemon's directory.
    pub state_dir: Option<PathBuf>,
    /// Tiering: the backing file, the recompression codec, the ager.
    pub tier: TierSpec,
    /// Wait for the pages from another vzram at this address.
    pub incoming: Option<crate::migration::Addr>,
}

/// A device's tiering settings, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierSpec {
    pub backing_file: Option<PathBuf>,
    pub recompress_algo: Codec,
    /// Run the ager (every third of this) while a frontend is connected.
    pub idle_after: Option<Duration>,
    pub auto_writeback: bool,
    pub auto_recompress: bool,
}

impl TierSpec {
    /// No backing file, no ager; recompression on request only.
    pub fn none(algo: Codec) -> TierSpec {
        TierSpec {
            backing_file: None,
            recompress_algo: default_recompress_algo(algo),
            idle_after: None,
            auto_writeback: false,
            auto_recompress: false,
        }
    }
}

impl DeviceSpec {
    /// The directory holding this device's state directory.
    pub fn state_root<'a>(&'a self, daemon: &'a DaemonConfig) -> &'a std::path::Path {
        self.state_dir.as_deref().unwrap_or(&daemon.state_dir)
    }
}

/// Where state lives when no flag or file says: `$VZRAM_STATE_DIR`, else
/// systemd's runtime directory (kept across restarts with
/// `RuntimeDirectoryPreserve=yes`), else `/dev/shm/vzram`. The last two are
/// tmpfs, where the state's pages are plain memory.
/// How a device's serial starts unless one is given: what the udev rule in
/// `contrib/udev/60-vzram.rules` matches to tell the guest the disk is not
/// rotational. A guest sees the serial as `/sys/block/vdX/serial` and
/// `/dev/disk/by-id/virtio-<serial>`.
pub const SERIAL_PREFIX: &str = "vzram-";

/// `vzram-<name>`, cut to the 20 bytes GET_ID has room for (at a character
/// boundary).
pub fn default_serial(name: &str) -> String {
    let mut s = format!("{SERIAL_PREFIX}{name}");
    let mut end = s.len().min(SERIAL_LEN);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s
}

pub fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("VZRAM_STATE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    match std::env::var_os("RUNTIME_DIRECTORY") {
        Some(d) if !d.is_empty() => {
            let first = d
                .to_string_lossy()
                .split(':')
                .next()
                .unwrap_or("")
                .to_string();
            PathBuf::from(first).join("state")
        }
        _ => PathBuf::from("/dev/shm/vzram"),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonConfig {
    /// Pool-wide cap on memory; 0 = none.
    pub host_mem_limit: u64,
    pub control: Option<PathBuf>,
    pub socket_mode: u32,
    /// The control socket's own mode: it changes limits, so it stays the
    /// admin's even when the VMM's group may reach the device sockets.
    pub control_mode: u32,
    /// Where to serve `/metrics`, if anywhere.
    pub metrics: Option<SocketAddr>,
    /// The sandbox; [`DaemonConfig::build`] leaves it on.
    pub seccomp: SeccompMode,
    /// Directory of the devices' state ([`default_state_dir`] unless given).
    pub state_dir: PathBuf,
    /// Discard existing state and start every device empty.
    pub fresh: bool,
    /// Listening sockets passed in (`--fd`), besides systemd's.
    pub inherit_fds: Vec<std::os::fd::RawFd>,
    /// Compress-pool threads per worker; None: the cores, at most 4.
    pub compress_threads: Option<usize>,
    /// Longest poll of a ring that ran dry, in µs; None: the default.
    pub poll_us: Option<u64>,
    pub devices: Vec<DeviceSpec>,
}

impl DaemonConfig {
    /// Fills in defaults and checks everything that can be checked before
    /// touching the system.
    pub fn build(
        host_mem_limit: Option<u64>,
        control: Option<PathBuf>,
        socket_mode: Option<u32>,
        drafts: Vec<DeviceDraft>,
    ) -> Result<DaemonConfig, ConfigError> {
        if drafts.is_empty() {
            return err("no device to serve: give --socket and --size, --device socket=...,size=..., or --config FILE");
        }
        let mut devices = Vec::with_capacity(drafts.len());
        let mut sockets = HashSet::new();
        let mut names = HashSet::new();
        let mut backing: Vec<(PathBuf, String)> = Vec::new();
        let mut incoming = HashSet::new();
        for (i, d) in drafts.into_iter().enumerate() {
            let name = d.name.clone().unwrap_or_else(|| format!("vzram{i}"));
            // The name is also the state directory's name.
            if name.is_empty()
                || name.len() > 64
                || name.starts_with('.')
                || name.contains('/')
                || name.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                return err(format!(
                    "device {i}: bad name {name:?} (1 to 64 bytes, no spaces or '/', not starting with '.')"
                ));
            }
            let algo = d.algo.unwrap_or(Codec::Lz4);
            let tier = tier_spec(&name, algo, &d, &mut backing)?;
            let Some(socket) = d.socket else {
                return err(format!("device {name}: no socket path"));
            };
            if socket.as_os_str().is_empty() {
                return err(format!("device {name}: empty socket path"));
            }
            let Some(size) = d.size else {
                return err(format!("device {name}: no size"));
            };
            if size == 0 || size % PAGE_SIZE as u64 != 0 {
                return err(format!(
                    "device {name}: size {size} bytes is not a positive multiple of {PAGE_SIZE} (sizes are whole pages)"
                ));
            }
            let queues = d.queues.unwrap_or(DEFAULT_QUEUES);
            if !(1..=MAX_QUEUES).contains(&usize::from(queues)) {
                return err(format!(
                    "device {name}: queues must be 1..={MAX_QUEUES}, not {queues}"
                ));
            }
            let serial = d.serial.unwrap_or_else(|| default_serial(&name));
            if serial.len() > SERIAL_LEN {
                return err(format!(
                    "device {name}: serial {serial:?} is longer than {SERIAL_LEN} bytes"
                ));
            }
            if !sockets.insert(socket.clone()) {
                return err(format!(
                    "socket {} is used by two devices",
                    socket.display()
                ));
            }
            if !names.insert(name.clone()) {
                return err(format!("device name {name:?} is used twice"));
            }
            if let Some(a) = &d.incoming {
                if !incoming.insert(a.clone()) {
                    return err(format!(
                        "device {name}: incoming {a} is another device's too"
                    ));
                }
            }
            let mem_limit = d.mem_limit.unwrap_or(0);
            if mem_limit > size {
                // Compressed pages take at most a page each: a limit above
                // the size is a typo, or meant for another device.
                return err(format!(
                    "device {name}: mem-limit {mem_limit} is above its size {size} (0 means no limit)"
                ));
            }
            let host = host_mem_limit.unwrap_or(0);
            if mem_limit != 0 && host != 0 && mem_limit > host {
                return err(format!(
                    "device {name}: mem-limit {mem_limit} is above the host limit {host}"
                ));
            }
            devices.push(DeviceSpec {
                name,
                socket,
                size,
                queues,
                algo,
                mem_limit,
                serial,
                readonly: d.readonly.unwrap_or(false),
                state_dir: d.state_dir,
                tier,
                incoming: d.incoming,
            });
        }
        for d in &devices {
            if let Some(crate::migration::Addr::Unix(p)) = &d.incoming {
                if sockets.contains(p) || control.as_ref() == Some(p) {
                    return err(format!(
                        "device {}: incoming socket {} is also a device or control socket",
                        d.name,
                        p.display()
                    ));
                }
            }
        }
        if let Some(c) = &control {
            if sockets.contains(c) {
                return err(format!(
                    "control socket {} is also a device socket",
                    c.display()
                ));
            }
        }
        Ok(DaemonConfig {
            host_mem_limit: host_mem_limit.unwrap_or(0),
            control,
            socket_mode: socket_mode.unwrap_or(DEFAULT_SOCKET_MODE),
            control_mode: DEFAULT_SOCKET_MODE,
            metrics: None,
            seccomp: SeccompMode::default(),
            state_dir: default_state_dir(),
            fresh: false,
            inherit_fds: Vec::new(),
            compress_threads: None,
            poll_us: None,
            devices,
        })
    }
}

/// Checks a draft's tiering keys. `taken` holds the backing files of the
/// devices checked so far (path, device): two devices may not share one.
fn tier_spec(
    name: &str,
    algo: Codec,
    d: &DeviceDraft,
    taken: &mut Vec<(PathBuf, String)>,
) -> Result<TierSpec, ConfigError> {
    let backing_file = d.backing_file.clone();
    if let Some(p) = &backing_file {
        if p.as_os_str().is_empty() {
            return err(format!("device {name}: empty backing-file path"));
        }
        if let Some((_, other)) = taken.iter().find(|(q, _)| q == p) {
            return err(format!(
                "backing file {} is given to devices {other} and {name}; each device needs its own",
                p.display()
            ));
        }
        taken.push((p.clone(), name.to_string()));
    }
    let recompress_algo = d
        .recompress_algo
        .unwrap_or_else(|| default_recompress_algo(algo));
    if d.recompress_algo == Some(algo) {
        return err(format!(
            "device {name}: recompress-algo {recompress_algo} is the device's own algo; recompression needs another (such as zstd:3 for lz4)"
        ));
    }
    if let Some(t) = d.idle_after {
        if t < MIN_IDLE_AFTER {
            return err(format!(
                "device {name}: idle-after {}s is below the least, {}s",
                t.as_secs(),
                MIN_IDLE_AFTER.as_secs()
            ));
        }
    }
    let auto_writeback = d.auto_writeback.unwrap_or(false);
    let auto_recompress = d.auto_recompress.unwrap_or(false);
    if auto_writeback && backing_file.is_none() {
        return err(format!(
            "device {name}: auto-writeback needs a backing-file to write to"
        ));
    }
    if (auto_writeback || auto_recompress) && d.idle_after.is_none() {
        let which = if auto_writeback {
            "auto-writeback"
        } else {
            "auto-recompress"
        };
        return err(format!(
            "device {name}: {which} needs idle-after (how long a page must go unread before it counts as cold)"
        ));
    }
    Ok(TierSpec {
        backing_file,
        recompress_algo,
        idle_after: d.idle_after,
        auto_writeback,
        auto_recompress,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("8G"), Ok(8 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("8Gi"), Ok(8 << 30));
        assert_eq!(parse_size("512Mi"), Ok(512 << 20));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("0.5M"), Ok(512 << 10));
        assert_eq!(parse_size("1.25GiB"), Ok(5 << 28));
        assert!(parse_size("1.3M")
            .unwrap_err()
            .contains("multiples of 4096"));
        for bad in [
            "",
            "G",
            "12Q",
            "-1G",
            "8 G",
            "99999999999T",
            "1.G",
            ".5G",
            "1..5G",
            "1.5.G",
            "8iG",
            "1.0000000000000000000000000000000000000001G",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn modes() {
        assert_eq!(parse_mode("0600"), Ok(0o600));
        assert_eq!(parse_mode("660"), Ok(0o660));
        assert!(parse_mode("0800").is_err());
        assert!(parse_mode("1777").is_err());
        assert!(parse_mode("").is_err());
    }

    #[test]
    fn device_spec() {
        let d = parse_device_spec("socket=/tmp/a.sock,size=1G,queues=2,mem-limit=256M,algo=zstd:3,serial=abc,readonly=true")
            .unwrap();
        assert_eq!(d.socket, Some(PathBuf::from("/tmp/a.sock")));
        assert_eq!(d.size, Some(1 << 30));
        assert_eq!(d.queues, Some(2));
        assert_eq!(d.mem_limit, Some(256 << 20));
        assert_eq!(d.algo, Some(Codec::Zstd { level: 3 }));
        assert_eq!(d.readonly, Some(true));
        assert!(parse_device_spec("socket=/a,colour=red").is_err());
        assert!(parse_device_spec("socket").is_err());
        assert!(parse_device_spec("size=12Q").is_err());
        assert!(parse_device_spec("algo=gzip").is_err());
    }

    fn draft(sock: &str, size: u64) -> DeviceDraft {
        DeviceDraft {
            socket: Some(sock.into()),
            size: Some(size),
            ..Default::default()
        }
    }

    #[test]
    fn default_serials() {
        assert_eq!(default_serial("vm1"), "vzram-vm1");
        // Cut to 20 bytes, not across a character.
        assert_eq!(default_serial("a-rather-long-name"), "vzram-a-rather-long-");
        assert_eq!(default_serial("abcdefghijklmé"), "vzram-abcdefghijklm");
        let named = DaemonConfig::build(
            None,
            None,
            None,
            vec![DeviceDraft {
                name: Some("a-name-far-longer-than-twenty-bytes".into()),
                ..draft("/a", 4096)
            }],
        )
        .unwrap();
        assert_eq!(named.devices[0].serial, "vzram-a-name-far-lon");
    }

    #[test]
    fn build_checks() {
        let ok = DaemonConfig::build(None, None, None, vec![draft("/a", 1 << 20)]).unwrap();
        assert_eq!(ok.devices[0].queues, DEFAULT_QUEUES);
        assert_eq!(ok.devices[0].name, "vzram0");
        assert_eq!(ok.devices[0].serial, "vzram-vzram0");
        assert_eq!(ok.socket_mode, 0o600);
        let bad =
            |drafts: Vec<DeviceDraft>| DaemonConfig::build(None, None, None, drafts).unwrap_err();
        bad(vec![]);
        bad(vec![draft("/a", 0)]);
        bad(vec![draft("/a", 5000)]);
        bad(vec![draft("/a", 4096), draft("/a", 4096)]);
        bad(vec![DeviceDraft {
            queues: Some(0),
            ..draft("/a", 4096)
        }]);
        bad(vec![DeviceDraft {
            queues: Some(65),
            ..draft("/a", 4096)
        }]);
        bad(vec![DeviceDraft {
            serial: Some("x".repeat(21)),
            ..draft("/a", 4096)
        }]);
        bad(vec![DeviceDraft {
            size: None,
            ..draft("/a", 4096)
        }]);
        bad(vec![
            DeviceDraft {
                name: Some("d".into()),
                ..draft("/a", 4096)
            },
            DeviceDraft {
                name: Some("d".into()),
                ..draft("/b", 4096)
            },
        ]);
        assert!(
            DaemonConfig::build(None, Some("/a".into()), None, vec![draft("/a", 4096)]).is_err()
        );
        let limited = DeviceDraft {
            mem_limit: Some(2 << 20),
            ..draft("/a", 4 << 20)
        };
        let e = DaemonConfig::build(Some(1 << 20), None, None, vec![limited.clone()]).unwrap_err();
        assert!(e.0.contains("above the host limit"), "{e}");
        assert!(DaemonConfig::build(Some(2 << 20), None, None, vec![limited.clone()]).is_ok());
        assert!(DaemonConfig::build(Some(0), None, None, vec![limited.clone()]).is_ok());
        // A limit above the device's size, with or without a host limit.
        let e = bad(vec![DeviceDraft {
            size: Some(1 << 20),
            ..limited.clone()
        }]);
        assert!(e.0.contains("above its size"), "{e}");
        let e = DaemonConfig::build(
            Some(8 << 20),
            None,
            None,
            vec![DeviceDraft {
                size: Some(1 << 20),
                ..limited.clone()
            }],
        )
        .unwrap_err();
        assert!(e.0.contains("above its size"), "{e}");
        // Equal to the size is allowed.
        assert!(DaemonConfig::build(
            None,
            None,
            None,
            vec![DeviceDraft {
                size: Some(2 << 20),
                ..limited
            }]
        )
        .is_ok());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        for bad in [
            "",
            "10",
            "m",
            "1.5m",
            "-1m",
            "10d",
            "10 m",
            "99999999999999999999h",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn tiering_keys() {
        let d = parse_device_spec(
            "socket=/a,size=1G,backing-file=/var/lib/vz/a.img,recompress-algo=zstd:5,idle-after=10m,auto-writeback=true,auto-recompress=yes",
        )
        .unwrap();
        assert_eq!(d.backing_file, Some(PathBuf::from("/var/lib/vz/a.img")));
        assert_eq!(d.recompress_algo, Some(Codec::Zstd { level: 5 }));
        assert_eq!(d.idle_after, Some(Duration::from_secs(600)));
        assert_eq!(
            (d.auto_writeback, d.auto_recompress),
            (Some(true), Some(true))
        );
        let c = DaemonConfig::build(None, None, None, vec![d]).unwrap();
        let t = &c.devices[0].tier;
        assert!(t.auto_writeback && t.auto_recompress);
        assert_eq!(t.recompress_algo, Codec::Zstd { level: 5 });

        // Defaults: zstd:3 for lz4, zstd:9 (or its own, higher) for zstd.
        let plain = DaemonConfig::build(None, None, None, vec![draft("/a", 4096)]).unwrap();
        assert_eq!(plain.devices[0].tier, TierSpec::none(Codec::Lz4));
        assert_eq!(
            plain.devices[0].tier.recompress_algo,
            Codec::Zstd { level: 3 }
        );
        assert_eq!(
            default_recompress_algo(Codec::Zstd { level: 1 }),
            Codec::Zstd { level: 9 }
        );
        assert_eq!(
            default_recompress_algo(Codec::Zstd { level: 15 }),
            Codec::Zstd { level: 15 }
        );

        let bad =
            |drafts: Vec<DeviceDraft>| DaemonConfig::build(None, None, None, drafts).unwrap_err().0;
        let with = |f: fn(&mut DeviceDraft)| {
            let mut d = draft("/a", 4096);
            d.name = Some("vm1".into());
            f(&mut d);
            d
        };
        let e = bad(vec![with(|d| d.auto_writeback = Some(true))]);
        assert!(e.contains("vm1") && e.contains("backing-file"), "{e}");
        let e = bad(vec![with(|d| {
            d.auto_writeback = Some(true);
            d.backing_file = Some("/b".into());
        })]);
        assert!(e.contains("idle-after"), "{e}");
        let e = bad(vec![with(|d| d.auto_recompress = Some(true))]);
        assert!(e.contains("auto-recompress needs idle-after"), "{e}");
        // Recompression alone needs no backing file.
        assert!(DaemonConfig::build(
            None,
            None,
            None,
            vec![with(|d| {
                d.auto_recompress = Some(true);
                d.idle_after = Some(Duration::from_secs(60));
            })]
        )
        .is_ok());
        let e = bad(vec![with(|d| d.idle_after = Some(Duration::from_secs(2)))]);
        assert!(e.contains("idle-after 2s"), "{e}");
        let e = bad(vec![with(|d| d.recompress_algo = Some(Codec::Lz4))]);
        assert!(e.contains("own algo"), "{e}");
        let e = bad(vec![
            with(|d| d.backing_file = Some("/b".into())),
            DeviceDraft {
                backing_file: Some("/b".into()),
                ..draft("/c", 4096)
            },
        ]);
        assert!(
            e.contains("backing file /b") && e.contains("vm1") && e.contains("vzram1"),
            "{e}"
        );
        assert!(parse_device_spec("socket=/a,idle-after=10").is_err());
        assert!(parse_device_spec("socket=/a,auto-writeback=maybe").is_err());
        assert!(parse_device_spec("socket=/a,recompress-algo=gzip").is_err());

        let f = parse_file(
            "[[device]]\nsocket = \"/a\"\nsize = \"1G\"\nbacking_file = \"/b\"\nidle_after = \"1h\"\nauto_writeback = true\nrecompress_algo = \"zstd:7\"\n",
        )
        .unwrap();
        let d = &f.devices[0];
        assert_eq!(d.backing_file, Some(PathBuf::from("/b")));
        assert_eq!(d.idle_after, Some(Duration::from_secs(3600)));
        assert_eq!(d.auto_writeback, Some(true));
        let e = parse_file("[[device]]\nidle_after = 600\n").unwrap_err().0;
        assert!(e.contains("duration"), "{e}");
    }

    #[test]
    fn toml_file() {
        let f = parse_file(
            r#"
            host_mem_limit = "16G"
            control = "/run/vzram/control.sock"
            socket_mode = "0660"

            [[device]]
            socket = "/run/vzram/vm1.sock"
            size = "8G"
            queues = 2
            algo = "zstd"
            mem_limit = 1073741824
            serial = "vm1-swap"

            [[device]]
            name = "scratch"
            socket = "/run/vzram/vm2.sock"
            size = 4194304
            readonly = true
            "#,
        )
        .unwrap();
        assert_eq!(f.host_mem_limit, Some(16 << 30));
        assert_eq!(f.socket_mode, Some(0o660));
        assert_eq!(f.devices.len(), 2);
        assert_eq!(f.devices[0].mem_limit, Some(1 << 30));
        assert_eq!(f.devices[1].readonly, Some(true));
        let e = parse_file("[[device]]\nsocket = \"/a\"\nsise = \"1G\"\n").unwrap_err();
        assert!(e.0.contains("sise") && e.0.starts_with("line 3"), "{e}");
        assert!(!e.0.contains('\n'));
        assert!(parse_file("host_mem_limit = \"lots\"").is_err());
        assert!(parse_file("[[device]]\nsize = \"8X\"").is_err());
        let mode = |text: &str| parse_file(text).map(|f| f.socket_mode.unwrap());
        // A TOML integer is the mode as written, in octal; a string is
        // octal text.
        assert_eq!(mode("socket_mode = 0o600"), Ok(0o600));
        assert_eq!(mode("socket_mode = 0o660"), Ok(0o660));
        assert_eq!(mode("socket_mode = 0o0"), Ok(0));
        assert_eq!(mode("socket_mode = 0x1b0"), Ok(0o660));
        assert_eq!(mode("socket_mode = \"0660\""), Ok(0o660));
        assert_eq!(mode("socket_mode = \"660\""), Ok(0o660));
        assert_eq!(mode("socket_mode = \"0o660\""), Ok(0o660));
        assert_eq!(mode("socket-mode = '0640'"), Ok(0o640));
        // Neither 0o1130 nor a guess at 0o600: refused, with a hint.
        let e = mode("\n\nsocket_mode = 600").unwrap_err().0;
        assert!(e.starts_with("line 3: socket_mode = 600 "), "{e}");
        assert!(e.contains("0o600") && e.contains("\"0600\""), "{e}");
        // 400 would be 0o620 (the group may connect): refused too.
        let e = mode("socket_mode = 400").unwrap_err().0;
        assert!(e.contains("0o400") && e.contains("\"0400\""), "{e}");
        let e = mode("socket_mode = 384").unwrap_err().0;
        assert!(e.contains("decimal") && e.contains("0o600"), "{e}");
        for bad in [
            "socket_mode = 0",
            "socket_mode = -1",
            "socket_mode = 0o1777",
            "socket_mode = 0o4600",
            "socket_mode = 0x10000",
            "socket_mode = 99999999999",
            "socket_mode = \"999\"",
            "socket_mode = \"0o1777\"",
            "socket_mode = \"\"",
            "socket_mode = true",
        ] {
            let e = mode(bad).unwrap_err().0;
            assert!(
                e.contains("socket_mode") || e.contains("socket mode"),
                "{bad}: {e}"
            );
            assert!(!e.contains('\n'), "{bad}: {e}");
        }
        assert_eq!(
            parse_file("seccomp = false").unwrap().seccomp,
            Some(SeccompMode::Off)
        );
        assert_eq!(
            parse_file("seccomp = \"log\"").unwrap().seccomp,
            Some(SeccompMode::Log)
        );
        assert_eq!(parse_file("").unwrap().seccomp, None);
        assert_eq!(parse_file("poll_us = 50").unwrap().poll_us, Some(50));
        assert_eq!(parse_file("poll-us = 0").unwrap().poll_us, Some(0));
        assert_eq!(parse_file("").unwrap().poll_us, None);
        let e = parse_file("poll_us = 1000001").unwrap_err().0;
        assert!(e.contains("poll_us") && !e.contains('\n'), "{e}");
        assert!(parse_file("seccomp = \"sometimes\"").is_err());
        assert_eq!(
            parse_file("metrics = \"127.0.0.1:9100\"").unwrap().metrics,
            Some("127.0.0.1:9100".parse().unwrap())
        );
        assert!(parse_file("metrics = \"localhost\"")
            .unwrap_err()
            .0
            .contains("metrics"));
        let f = parse_file("socket_mode = 0o660\ncontrol_mode = \"0640\"").unwrap();
        assert_eq!((f.socket_mode, f.control_mode), (Some(0o660), Some(0o640)));
        let e = parse_file("control_mode = 600").unwrap_err().0;
        assert!(e.contains("control_mode = 0o600"), "{e}");
    }
}
