//! The control socket's protocol: newline-delimited JSON, one reply line
//! per request, and the client's side of the exchange.
//!
//! ```text
//! {"cmd":"stat"}
//! {"cmd":"set-limit","device":"vm1","bytes":1073741824}    device by name or index
//! {"cmd":"set-limit","host":true,"bytes":0}                 0 = no limit
//! {"cmd":"compact"}                                         or with "device"
//! {"cmd":"mark-idle","device":"vm1"}
//! {"cmd":"recompress","device":"vm1","idle":true,"algo":"zstd:3"}   huge, algo optional
//! {"cmd":"writeback","device":"vm1","cold":true,"max_pages":1000}    idle, huge, incompressible
//! {"cmd":"migrate","device":"vm1","to":"unix:/run/m.sock","keep":false}
//! ```
//! Replies carry `"ok":true` and the result, or `"ok":false` and `"error"`.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// How long a writeback or recompression order may take: a whole device
/// through a slow disk or a strong codec.
pub const TIER_WAIT: Duration = Duration::from_secs(1800);
/// How long a migration order may take: pre-copy lasts until the source's
/// frontend stops, which its operator decides.
pub const MIGRATE_WAIT: Duration = Duration::from_secs(24 * 3600);

/// A device named in a request: its name, or its index as a number or string.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DeviceRef {
    Index(u64),
    Name(String),
}

/// A control request: what the client sends and the daemon parses, one
/// JSON line each (`{"cmd":"set-limit",...}`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    Stat {},
    SetLimit {
        #[serde(skip_serializing_if = "Option::is_none")]
        device: Option<DeviceRef>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        host: bool,
        bytes: u64,
    },
    Compact {
        #[serde(skip_serializing_if = "Option::is_none")]
        device: Option<DeviceRef>,
    },
    /// A new device, in `--device` syntax (`socket=...,size=...`).
    Add {
        device: String,
    },
    Remove {
        device: DeviceRef,
    },
    Reset {
        device: DeviceRef,
    },
    ResetMax {
        #[serde(skip_serializing_if = "Option::is_none")]
        device: Option<DeviceRef>,
    },
    MarkIdle {
        device: DeviceRef,
    },
    Recompress {
        device: DeviceRef,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        idle: bool,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        huge: bool,
        /// `zstd:LEVEL`; the device's recompress-algo when absent.
        #[serde(skip_serializing_if = "Option::is_none")]
        algo: Option<String>,
    },
    Writeback {
        device: DeviceRef,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        idle: bool,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        cold: bool,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        huge: bool,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        incompressible: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        max_pages: Option<u64>,
    },
    /// Send the device's pages to another vzram's incoming device.
    Migrate {
        device: DeviceRef,
        /// `unix:PATH` or `tcp:HOST:PORT`.
        to: String,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        keep: bool,
    },
}

impl DeviceRef {
    /// As the command line gives it: a name (a number is taken as an index
    /// by the daemon if no device has that name).
    pub fn named(s: &str) -> DeviceRef {
        DeviceRef::Name(s.to_string())
    }
}

/// How long `vzram stat` and friends wait for the daemon.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Client side: sends one request and returns the parsed reply.
/// Gives up after [`CLIENT_TIMEOUT`] without a reply: a socket that is not
/// a control socket (a device's, say) must not hang the command.
pub fn request(path: &std::path::Path, req: &Value) -> io::Result<Value> {
    request_waiting(path, req, CLIENT_TIMEOUT)
}

/// [`request`] for a request that may take up to `wait` to carry out (a
/// writeback through a slow disk).
pub fn request_waiting(path: &std::path::Path, req: &Value, wait: Duration) -> io::Result<Value> {
    let hint = |e: io::Error| match e.kind() {
        io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::WouldBlock
        | io::ErrorKind::TimedOut => {
            io::Error::new(e.kind(), format!("{e}: is this a vzram control socket?"))
        }
        _ => e,
    };
    exchange(path, req, wait).map_err(hint)
}

fn exchange(path: &std::path::Path, req: &Value, wait: Duration) -> io::Result<Value> {
    let mut stream = UnixStream::connect(path)?;
    stream.set_read_timeout(Some(wait))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    writeln!(stream, "{req}")?;
    let mut line = String::new();
    BufReader::new(&stream)
        .take(16 << 20)
        .read_line(&mut line)?;
    if line.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "closed without a reply: is this a vzram control socket?",
        ));
    }
    serde_json::from_str(&line).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad reply ({e}): is this a vzram control socket?"),
        )
    })
}
