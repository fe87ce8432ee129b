//! Values as a person types them: sizes, modes, codecs, durations,
//! booleans, addresses. Every error is the user's input.

use std::net::SocketAddr;
use std::time::Duration;

use thiserror::Error;
use vzram_store::{Codec, PAGE_SIZE};

pub const DEFAULT_QUEUES: u16 = 4;
pub const DEFAULT_SOCKET_MODE: u32 = 0o600;
/// The ager runs every third of `idle-after`; below this it would scan the
/// slot table more than once a second for little gain.
pub const MIN_IDLE_AFTER: Duration = Duration::from_secs(3);

#[derive(Debug, Error, PartialEq, Eq)]
#[error("{0}")]
pub struct ConfigError(pub String);

pub(super) fn err<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
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

/// The largest device: its slot table (1/512 of it) is mapped whole, and
/// must fit the address space with room for the pool.
pub const MAX_DEVICE_SIZE: u64 = 64 << 40;

/// Parses a duration: whole numbers each with `s`, `m`, `h` or `d`, largest
/// unit first (`90s`, `10m`, `1h30m`, `2d`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let bad = || {
        format!(
            "bad duration {s:?}: expected whole numbers with d, h, m or s, such as 10m or 1h30m"
        )
    };
    let too_long = || format!("bad duration {s:?}: too long");
    let mut total: u64 = 0;
    let mut last_unit = u64::MAX;
    let mut rest = t;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let (number, tail) = rest.split_at(digits);
        let unit = tail.chars().next().ok_or_else(bad)?;
        let secs_per = match unit {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86400,
            _ => return Err(bad()),
        };
        // Each unit once, largest first: `1m1h` is a typo, not 61 minutes.
        if number.is_empty() || secs_per >= last_unit {
            return Err(bad());
        }
        last_unit = secs_per;
        let n: u64 = number.parse().map_err(|_| too_long())?;
        total = n
            .checked_mul(secs_per)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(too_long)?;
        rest = &tail[1..];
    }
    Ok(Duration::from_secs(total))
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

/// The longest `poll_us` (`--poll-us`) taken: a second.
pub const MAX_POLL_US: u64 = 1_000_000;
