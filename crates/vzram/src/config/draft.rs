//! A device as the user describes it (flags, `--device`, `[[device]]`),
//! before defaults and checks.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use vzram_store::Codec;

use super::de;
use super::parse::{parse_bool, parse_codec, parse_duration, parse_size};
use crate::proto::addr::Addr;
use crate::proto::control::NewDevice;

/// One device as given, before defaults and checks. The one form of all
/// three ways to give a device: the single-device flags of `vzram serve`
/// (`clap::Args`, flattened), a `[[device]]` table of the config file, and a
/// `--device` / `vzram add` spec (`socket=...,size=...`, read through the
/// same `Deserialize`), so every key means the same everywhere.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceDraft {
    /// Name of that device in stats and control requests, and of its state
    /// directory [default: the socket's file name without `.sock`/`.socket`,
    /// other characters than letters, digits, `-`, `_` and `.` made `_`:
    /// `/run/vzram/vm1.sock` is vm1]. Keep it stable: it finds the state.
    #[arg(long)]
    pub name: Option<String>,
    /// vhost-user socket of a single device (with --size). `--socket-path`
    /// is the same, as QEMU's backend-program convention names it.
    #[arg(long, alias = "socket-path", value_name = "PATH")]
    #[serde(alias = "path")]
    pub socket: Option<PathBuf>,
    /// Capacity of that device: 512M, 8G, 1T or bytes (a multiple of 4096).
    #[arg(long, value_parser = parse_size, allow_negative_numbers = true)]
    #[serde(default, deserialize_with = "de::size")]
    pub size: Option<u64>,
    /// Virtqueues of that device, one worker thread each [default: 4].
    #[arg(long, allow_negative_numbers = true)]
    #[serde(default, alias = "num-queues", deserialize_with = "de::number")]
    pub queues: Option<u16>,
    /// Compression: lz4, zstd or zstd:LEVEL [default: lz4].
    #[arg(long, value_parser = parse_codec)]
    #[serde(default, alias = "comp-algorithm", deserialize_with = "de::codec")]
    pub algo: Option<Codec>,
    /// Cap on the memory that device may use (0 = none).
    #[arg(long, value_parser = parse_size, allow_negative_numbers = true)]
    #[serde(default, alias = "mem-limit", deserialize_with = "de::size")]
    pub mem_limit: Option<u64>,
    /// Serial the guest reads with GET_ID (at most 20 bytes) [default:
    /// vzram-NAME, cut to 20 bytes; contrib/udev/60-vzram.rules matches vzram*].
    #[arg(long)]
    pub serial: Option<String>,
    /// Segments one discard or write-zeroes request may carry, as the
    /// device's config space offers them (1-256) [default: 256; Linux
    /// merges up to that many]. 1 is what qemu-storage-daemon offers:
    /// set it where a VM must see the same disk from either.
    #[arg(long, value_name = "N")]
    #[serde(default, alias = "discard-segments", deserialize_with = "de::number")]
    pub discard_segments: Option<u16>,
    /// Raw staging budget of that device: a whole-page write stores its
    /// pages as they are, on its queue thread, while the pages not
    /// compressed yet take less than this (a write of 4 pages or more only
    /// if all of them fit and the worker has one compress thread), and the
    /// compress threads compress them in the background, oldest first;
    /// past it writes compress inline, those of 4 pages or more on the
    /// compress threads. Staged pages are kept and
    /// recovered like any others and count in full against the memory
    /// limits; staging stops at 3/4 of a limit, and under a limit below
    /// 28M it takes a page per 28K of the last quarter at most (room for
    /// the compressed pages' spans). 0 = off [default: 128M: in
    /// BENCHMARKS.md staging made 4K writes 1.9x faster, and 128M a 256 MiB
    /// swap-out burst 1.2x faster than 64M].
    #[arg(long, value_parser = parse_size, allow_negative_numbers = true, value_name = "SIZE")]
    #[serde(default, deserialize_with = "de::size")]
    pub staging: Option<u64>,
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
    /// Serve the pages a state left on disk under this name holds
    /// (`recover=true`): `vzram add` refuses such a state otherwise, and a
    /// configured device with `recover=false` refuses to start on one.
    #[arg(skip)]
    #[serde(default, deserialize_with = "de::boolean")]
    pub recover: Option<bool>,
    /// Discard the device's existing state and start it empty (`fresh=true`).
    #[arg(skip)]
    #[serde(default, deserialize_with = "de::boolean")]
    pub fresh: Option<bool>,
    /// Take a state made under another name or for another socket
    /// (`adopt=true`; `--adopt` for every device).
    #[arg(skip)]
    #[serde(default, deserialize_with = "de::boolean")]
    pub adopt: Option<bool>,
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
    /// there) before it serves a request: unix:PATH (tunnel it over SSH
    /// between hosts) or tcp:HOST:PORT (mutual TLS: needs --tls-creds with
    /// server-cert.pem and server-key.pem).
    #[arg(long, value_parser = crate::proto::addr::parse_addr, value_name = "ADDR")]
    #[serde(default, deserialize_with = "de::addr")]
    pub incoming: Option<Addr>,
}

/// Why a `--device` value (`spec`, as given) is no device.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("bad device option {0:?}: expected key=value")]
    NotKeyValue(String),
    #[error("device spec {spec:?}: {key} is given twice (which one is meant?)")]
    Twice { spec: String, key: String },
    /// A key no device takes, or a value its key does not.
    #[error("device spec {spec:?}: {source}")]
    Keys {
        spec: String,
        #[source]
        source: serde_json::Error,
    },
}

/// Parses a `--device` value: `socket=PATH,size=8G,queues=4,...`, with the
/// keys of a `[[device]]` table.
pub fn parse_device_spec(s: &str) -> Result<DeviceDraft, SpecError> {
    let mut map = serde_json::Map::new();
    // A space after a comma (`socket=P, size=8G`) is no part of the key.
    for part in s.split(',').map(str::trim_start).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| SpecError::NotKeyValue(part.to_string()))?;
        let k = k.trim_end();
        // `_` and `-` name the same key: `mem-limit=1G,mem_limit=2G` too.
        let dup = map
            .keys()
            .any(|o| o.replace('_', "-") == k.replace('_', "-"));
        if dup || map.insert(k.to_string(), v.to_string().into()).is_some() {
            return Err(SpecError::Twice {
                spec: s.to_string(),
                key: k.to_string(),
            });
        }
    }
    DeviceDraft::deserialize(serde_json::Value::Object(map)).map_err(|source| SpecError::Keys {
        spec: s.to_string(),
        source,
    })
}

/// What `vzram add` sends: the draft, typed (its keys are the same).
impl From<DeviceDraft> for NewDevice {
    fn from(d: DeviceDraft) -> NewDevice {
        // Every field named: a key added to one and not the other does
        // not compile.
        let DeviceDraft {
            name,
            socket,
            size,
            queues,
            algo,
            mem_limit,
            serial,
            discard_segments,
            staging,
            readonly,
            state_dir,
            recover,
            fresh,
            adopt,
            backing_file,
            recompress_algo,
            idle_after,
            auto_writeback,
            auto_recompress,
            incoming,
        } = d;
        NewDevice {
            name,
            socket,
            size,
            queues,
            algo,
            mem_limit,
            serial,
            discard_segments,
            staging,
            readonly,
            state_dir,
            recover,
            fresh,
            adopt,
            backing_file,
            recompress_algo,
            idle_after,
            auto_writeback,
            auto_recompress,
            incoming,
        }
    }
}

/// What the daemon checks of an `add`.
impl From<NewDevice> for DeviceDraft {
    fn from(d: NewDevice) -> DeviceDraft {
        let NewDevice {
            name,
            socket,
            size,
            queues,
            algo,
            mem_limit,
            serial,
            discard_segments,
            staging,
            readonly,
            state_dir,
            recover,
            fresh,
            adopt,
            backing_file,
            recompress_algo,
            idle_after,
            auto_writeback,
            auto_recompress,
            incoming,
        } = d;
        DeviceDraft {
            name,
            socket,
            size,
            queues,
            algo,
            mem_limit,
            serial,
            discard_segments,
            staging,
            readonly,
            state_dir,
            recover,
            fresh,
            adopt,
            backing_file,
            recompress_algo,
            idle_after,
            auto_writeback,
            auto_recompress,
            incoming,
        }
    }
}
