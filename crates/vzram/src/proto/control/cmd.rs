//! The requests, one struct each (the fields of its line).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vzram_store::Codec;

use crate::proto::addr::Addr;

/// A device named in a request: its name, or its index as a number or string.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DeviceRef {
    Index(u64),
    Name(String),
}

impl DeviceRef {
    /// As the command line gives it: a name (a number is taken as an index
    /// by the daemon if no device has that name).
    pub fn named(s: &str) -> DeviceRef {
        DeviceRef::Name(s.to_string())
    }
}

/// A control request: what the client sends and the daemon parses, one
/// JSON line each (`{"cmd":"set-limit",...}`): the `cmd` tag, then the
/// fields of its struct here. Each of those names its reply
/// (`control::Command::Reply`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum Request {
    Stat(Stat),
    SetLimit(SetLimit),
    Compact(Compact),
    Add(Add),
    Remove(Remove),
    Forget(Forget),
    Reset(Reset),
    ResetMax(ResetMax),
    MarkIdle(MarkIdle),
    Recompress(Recompress),
    Writeback(Writeback),
    Migrate(Migrate),
    CommitMigration(CommitMigration),
    CancelMigration(CancelMigration),
    Reload(Reload),
}

/// A device `vzram add` asks for: the keys of a `--device` spec (the
/// config's `DeviceDraft`, which converts to and from it), typed: the
/// client parsed the text, the daemon checks the values. Absent keys take
/// their defaults, as on the command line.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewDevice {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queues: Option<u16>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::proto::codec::optional"
    )]
    pub algo: Option<Codec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discard_segments: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readonly: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_dir: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recover: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fresh: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adopt: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing_file: Option<PathBuf>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::proto::codec::optional"
    )]
    pub recompress_algo: Option<Codec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_after: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_writeback: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_recompress: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incoming: Option<Addr>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stat {}

/// A device's memory limit (`device`), or the host's (`host`); 0 is
/// no limit.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetLimit {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceRef>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub host: bool,
    pub bytes: u64,
}

/// One device, or all of them.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compact {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceRef>,
}

/// A new device, as `--device` gives one, parsed by the client.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Add {
    /// Boxed: the largest request by far.
    pub device: Box<NewDevice>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Remove {
    pub device: DeviceRef,
    /// Also a device a frontend is connected to: it is cut off, and
    /// its state kept as a left-over (refused without it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// Delete a left-over state (one no device serves) by its name.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Forget {
    pub name: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reset {
    pub device: DeviceRef,
    /// Also a device a frontend is connected to: it is cut off first
    /// (refused without it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResetMax {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceRef>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MarkIdle {
    pub device: DeviceRef,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recompress {
    pub device: DeviceRef,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub idle: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub huge: bool,
    /// `zstd:LEVEL`; the device's recompress-algo when absent.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::proto::codec::optional"
    )]
    pub algo: Option<Codec>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Writeback {
    pub device: DeviceRef,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub idle: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cold: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub huge: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incompressible: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pages: Option<u64>,
}

/// Send the device's pages to another vzram's incoming device.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Migrate {
    pub device: DeviceRef,
    /// `unix:PATH` or `tcp:HOST:PORT` (a malformed one is refused
    /// when the request is read).
    pub to: Addr,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep: bool,
}

/// The VM of a device being sent has moved (its VMM keeps the source
/// process): commit now.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommitMigration {
    pub device: DeviceRef,
}

/// The VMM's migration of a device being sent was called off (the
/// guest runs here): abort, the destination drops its copy.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelMigration {
    pub device: DeviceRef,
}

/// Read the `--config` file again and apply it, as SIGHUP does; a
/// file that does not parse is a refusal.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reload {}
