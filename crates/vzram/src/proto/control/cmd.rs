//! The requests, one struct each (the fields of its line).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{
    Added, Command, Committed, Compacted, DeviceRef, Done, Forgotten, LimitSet, MarkedIdle,
    Migrated, Recompressed, Reloaded, Removed, Request, StatReply, WrittenBack, CLIENT_TIMEOUT,
    MIGRATE_WAIT, TIER_WAIT,
};
use crate::proto::addr::Addr;

/// How long the tiering commands wait: as long as the daemon lets an
/// order run, and a little more for the reply.
const TIER_CLIENT_WAIT: Duration = TIER_WAIT.saturating_add(CLIENT_TIMEOUT);

/// Each request struct: its `Request` variant, and its reply.
macro_rules! command {
    ($($name:ident => $reply:ty $(, wait $wait:expr)?;)*) => {$(
        impl From<$name> for Request {
            fn from(c: $name) -> Request {
                Request::$name(c)
            }
        }
        impl Command for $name {
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
    Reset => super::Reset;
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
    pub device: Box<super::NewDevice>,
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
        with = "super::codec_opt"
    )]
    pub algo: Option<vzram_store::Codec>,
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
