//! The rules a configuration's values break together, typed: each names
//! the device (by its place or its name) and carries the values at fault.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;
use vzram_blk::config::{MAX_QUEUES, SERIAL_LEN};
use vzram_store::{Codec, PAGE_SIZE};

use super::parse::{size_text, MAX_DEVICE_SIZE, MAX_DISCARD_SEGMENTS};
use crate::proto::addr::Addr;
use crate::proto::tls::{SERVER_CERT, SERVER_KEY};

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Refusal {
    #[error("no device to serve: give --socket and --size, --device socket=...,size=..., or --config FILE")]
    NoDevice,
    /// The device at `index` has neither a name nor a socket.
    #[error("device {index}: no socket path")]
    NoSocketAt { index: usize },
    #[error("device {index}: socket {} gives no name; give it a name=", socket.display())]
    NoNameFrom { index: usize, socket: PathBuf },
    #[error("device {index}: bad name {name:?} (1 to 64 bytes, no spaces or '/', not starting with '.')")]
    BadName { index: usize, name: String },
    #[error("device {name}: no socket path")]
    NoSocket { name: String },
    #[error("device {name}: empty socket path")]
    EmptySocket { name: String },
    #[error("device {name}: no size: give --size N (QEMU's backend convention passes only --socket-path or --fd), size= in its --device spec, or a [[device]] with a size and no socket in --config")]
    NoSize { name: String },
    #[error("device {name}: size {} is not a positive multiple of {PAGE_SIZE} bytes (sizes are whole pages)", size_text(*size))]
    SizeNotPages { name: String, size: u64 },
    #[error("device {name}: size {} is over the largest device, {}T", size_text(*size), MAX_DEVICE_SIZE >> 40)]
    SizeTooLarge { name: String, size: u64 },
    #[error("device {name}: queues must be 1..={MAX_QUEUES}, not {queues}")]
    Queues { name: String, queues: u16 },
    #[error("device {name}: discard-segments must be 1..={MAX_DISCARD_SEGMENTS}, not {segments}")]
    DiscardSegments { name: String, segments: u16 },
    #[error("device {name}: serial {serial:?} is longer than {SERIAL_LEN} bytes")]
    SerialTooLong { name: String, serial: String },
    #[error("socket {} is used by two devices", .0.display())]
    SocketTwice(PathBuf),
    /// `from`: the socket the name was derived from, when it was.
    #[error("device name {name:?} is used twice{}", derived_hint(from.as_ref()))]
    NameTwice { name: String, from: Option<PathBuf> },
    #[error("device {name}: recover=true and fresh=true exclude each other")]
    RecoverAndFresh { name: String },
    #[error("device {name}: incoming {addr} is another device's too")]
    IncomingTwice { name: String, addr: Addr },
    #[error("device {name}: mem-limit {} is above its size {} (0 means no limit)", size_text(*mem_limit), size_text(*size))]
    MemLimitAboveSize {
        name: String,
        mem_limit: u64,
        size: u64,
    },
    #[error("device {name}: incoming socket {} is also a device or control socket", socket.display())]
    IncomingIsSocket { name: String, socket: PathBuf },
    #[error("control socket {} is also a device socket", .0.display())]
    ControlIsDevice(PathBuf),
    #[error("device {name}: empty backing-file path")]
    EmptyBacking { name: String },
    #[error("backing file {} is given to devices {other} and {name}; each device needs its own", path.display())]
    BackingShared {
        path: PathBuf,
        other: String,
        name: String,
    },
    #[error("device {name}: recompress-algo {algo} is the device's own algo; recompression needs another (such as zstd:3 for lz4)")]
    RecompressOwnAlgo { name: String, algo: Codec },
    #[error("device {name}: idle-after {}s is below the least, {}s", idle_after.as_secs(), least.as_secs())]
    IdleAfterShort {
        name: String,
        idle_after: Duration,
        least: Duration,
    },
    #[error("device {name}: auto-writeback needs a backing-file to write to")]
    WritebackWithoutBacking { name: String },
    /// `writeback`: auto-writeback asked (else auto-recompress).
    #[error("device {name}: {} needs idle-after (how long a page must go unread before it counts as cold)", if *writeback { "auto-writeback" } else { "auto-recompress" })]
    AutoWithoutIdle { name: String, writeback: bool },
    /// `--fresh NAME` or `--adopt NAME` naming no device.
    #[error("{flag} {name}: no device of that name (devices: {})", known.join(", "))]
    NoSuchDevice {
        flag: &'static str,
        name: String,
        known: Vec<String>,
    },
    #[error("device {name}: incoming {addr} needs --tls-creds with {SERVER_CERT} and {SERVER_KEY} (a stream on plain TCP is refused)")]
    IncomingNeedsTls { name: String, addr: Addr },
}

fn derived_hint(from: Option<&PathBuf>) -> String {
    from.map(|s| {
        format!(
            " (the socket {} gives the same name as another device's); give each a name=",
            s.display()
        )
    })
    .unwrap_or_default()
}
