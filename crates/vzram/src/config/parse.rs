//! Values as a person types them: sizes, modes, codecs, durations,
//! booleans, addresses. Every error is the user's input.

use std::net::SocketAddr;
use std::time::Duration;

use thiserror::Error;
use vzram_store::{Codec, ParseCodecError, PAGE_SIZE};

pub const DEFAULT_QUEUES: u16 = 4;
/// A device's raw staging budget when none is given. Measured (BENCHMARKS.md,
/// raw staging): 4K writes at QD32 1.9x, larger writes and memory 10 s
/// after a burst as without it; a 256 MiB swap-out burst 1.2x what 64M
/// gave, with the same memory 10 s after it.
pub const DEFAULT_STAGING: u64 = 128 << 20;
/// The host's staging budget per core when none is given: a core compresses
/// it in about 120 ms (7.5 us a page), so a host of many VMs bursting at
/// once keeps its raw pages no longer than that.
pub const DEFAULT_HOST_STAGING_PER_CORE: u64 = 64 << 20;
pub const DEFAULT_SOCKET_MODE: u32 = 0o600;
/// The ager runs every third of `idle-after`; below this it would scan the
/// slot table more than once a second for little gain.
pub const MIN_IDLE_AFTER: Duration = Duration::from_secs(3);

/// A value as a person typed it (the text, as typed) that does not parse.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ValueError {
    #[error("bad size {0:?}: a size cannot be negative (0 means none where a limit is meant)")]
    NegativeSize(String),
    #[error("bad size {text:?}: unknown unit {unit:?} (use K, M, G or T)")]
    SizeUnit { text: String, unit: char },
    #[error("bad size {0:?}: expected a number with an optional K, M, G or T")]
    SizeSyntax(String),
    #[error("bad size {0:?}: too large")]
    SizeTooLarge(String),
    #[error("bad size {0:?}: not a whole number of bytes (sizes are multiples of {PAGE_SIZE})")]
    SizeFraction(String),
    #[error("bad socket mode {0:?}: expected octal permissions like 0600")]
    Mode(String),
    #[error("bad metrics address {text:?}: {fault}; expected IP:PORT, localhost:PORT or :PORT, such as 127.0.0.1:9100")]
    MetricsAddr { text: String, fault: AddrFault },
    #[error(transparent)]
    Codec(#[from] ParseCodecError),
    #[error("bad duration {0:?}: expected whole numbers with d, h, m or s, such as 10m or 1h30m")]
    Duration(String),
    #[error("bad duration {0:?}: too long")]
    DurationTooLong(String),
    #[error("bad boolean {0:?}: expected true or false")]
    Bool(String),
}

/// What is wrong with a metrics address.
#[derive(Debug, Clone, Copy, Error, PartialEq, Eq)]
pub enum AddrFault {
    #[error("no port")]
    NoPort,
    #[error("not a port")]
    NotAPort,
    #[error("a host name other than localhost (give its IP address)")]
    HostName,
}

/// Parses `512M`, `8G`, `8Gi`, `1.5G`, `1T`, `64K` (binary units, with an
/// optional `i`, `B` or `iB`) or plain bytes. A fraction must come to a
/// whole number of bytes.
pub fn parse_size(s: &str) -> Result<u64, ValueError> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(ValueError::NegativeSize(s.to_string()));
    }
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
                    return Err(ValueError::SizeUnit {
                        text: s.to_string(),
                        unit: c,
                    })
                }
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(frac) || number.ends_with('.') {
        return Err(ValueError::SizeSyntax(s.to_string()));
    }
    let too_large = || ValueError::SizeTooLarge(s.to_string());
    // Exact: (whole.frac * 10^k) << shift, then / 10^k, all in integers.
    let scale = 10u128
        .checked_pow(frac.len() as u32)
        .ok_or_else(too_large)?;
    let n: u128 = format!("{whole}{frac}").parse().map_err(|_| too_large())?;
    let bytes = n.checked_mul(1u128 << shift).ok_or_else(too_large)?;
    if bytes % scale != 0 {
        return Err(ValueError::SizeFraction(s.to_string()));
    }
    u64::try_from(bytes / scale).map_err(|_| too_large())
}

/// Parses an octal file mode such as `0600` or `660`.
pub fn parse_mode(s: &str) -> Result<u32, ValueError> {
    let t = s.strip_prefix("0o").unwrap_or(s);
    match u32::from_str_radix(t, 8) {
        Ok(m) if m <= 0o777 && !t.is_empty() => Ok(m),
        _ => Err(ValueError::Mode(s.to_string())),
    }
}

/// A size as a user would type it, exactly: `2G`, `8232K`, `512 bytes`
/// (messages name sizes this way, never as a bare count of bytes).
pub fn size_text(bytes: u64) -> String {
    for (unit, shift) in [("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    format!("{bytes} bytes")
}

/// Below this, a memory limit holds too few pages for a disk to work:
/// most writes would fail (`set-limit vm1 512` meant 512M).
pub const FEW_PAGES: u64 = 256;

/// The warning a memory limit of `bytes` deserves for being tiny, if it is.
pub fn tiny_limit(what: &str, bytes: u64) -> Option<String> {
    let page = 4096;
    (bytes != 0 && bytes < FEW_PAGES * page).then(|| {
        let hint = if bytes < 1024 {
            format!(" (a size without a unit is bytes: did you mean {bytes}M?)")
        } else {
            String::new()
        };
        format!(
            "{what} of {} holds at most {} pages: most writes will fail{hint}",
            size_text(bytes),
            bytes / page
        )
    })
}

/// Parses `--metrics`: an address and a port, `127.0.0.1:9100`,
/// `[::1]:9100`, `localhost:9100` (127.0.0.1), or `:9100` (every
/// interface, as Prometheus exporters take it); port 0: any free one,
/// reported by `vzram stat`. Other host names are not looked up: a reload
/// reads the file again under the seccomp filter, where no lookup may run.
pub fn parse_metrics_addr(s: &str) -> Result<SocketAddr, ValueError> {
    let bad = |fault| ValueError::MetricsAddr {
        text: s.to_string(),
        fault,
    };
    if let Ok(a) = s.parse() {
        return Ok(a);
    }
    let (host, port) = s.rsplit_once(':').ok_or_else(|| bad(AddrFault::NoPort))?;
    let port: u16 = port.parse().map_err(|_| bad(AddrFault::NotAPort))?;
    match host {
        "" => Ok(SocketAddr::from(([0, 0, 0, 0], port))),
        h if h.eq_ignore_ascii_case("localhost") => Ok(SocketAddr::from(([127, 0, 0, 1], port))),
        _ => Err(bad(AddrFault::HostName)),
    }
}

pub fn parse_codec(s: &str) -> Result<Codec, ParseCodecError> {
    s.parse::<Codec>()
}

/// The largest device: its slot table (1/512 of it) is mapped whole, and
/// must fit the address space with room for the pool.
pub const MAX_DEVICE_SIZE: u64 = 64 << 40;

/// Parses a duration: whole numbers each with `s`, `m`, `h` or `d`, largest
/// unit first (`90s`, `10m`, `1h30m`, `2d`).
pub fn parse_duration(s: &str) -> Result<Duration, ValueError> {
    let t = s.trim();
    let bad = || ValueError::Duration(s.to_string());
    let too_long = || ValueError::DurationTooLong(s.to_string());
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

pub fn parse_bool(s: &str) -> Result<bool, ValueError> {
    match s {
        "true" | "yes" | "on" | "1" => Ok(true),
        "false" | "no" | "off" | "0" => Ok(false),
        _ => Err(ValueError::Bool(s.to_string())),
    }
}

/// Most segments a discard or write-zeroes request may carry (the block
/// layer's own limit, and the default offer).
pub const MAX_DISCARD_SEGMENTS: u16 = vzram_blk::config::MAX_DISCARD_SEG as u16;

/// The longest `poll_us` (`--poll-us`) taken: a second.
pub const MAX_POLL_US: u64 = 1_000_000;
