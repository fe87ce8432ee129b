//! A stat reply: the control socket's `{"cmd":"stat"}` answer, which is
//! also what `vzram stat --json` prints ([`crate::Daemon::stat`],
//! [`crate::Daemon::stat_cli`]), read into the daemon's own
//! [`StatReply`]: a field the reply lacks fails the parse, and a field a
//! test names is checked by the compiler. Devices are found by name (the
//! integration tests) or by socket path (the end-to-end tests), and an
//! accessor of a device the reply does not have panics, naming the reply.

use std::fmt::{self, Write as _};
use std::path::Path;

use serde_json::Value;
pub use vzram::proto::control::{
    BackingStat, DeviceStat, MigrationStat, MigrationState, StatReply, TierStat, WorkerState,
    WorkerStatus,
};
pub use vzram_store::{DeviceStats, PoolStats};

use crate::daemon::reply;
use crate::data::MIB;

/// A stat reply. Displays as its JSON, for failure messages.
#[derive(Clone, Debug, PartialEq)]
pub struct Stats(pub StatReply);

impl Stats {
    /// A stat reply line as it came (`{"ok":true,"pool":...}`); panics,
    /// naming it, when it is a refusal or lacks a field.
    pub fn parse(v: Value) -> Stats {
        Stats(reply(v))
    }

    /// Every device's entry, in the daemon's order.
    pub fn devices(&self) -> &[DeviceStat] {
        &self.0.devices
    }

    /// The entry of the device named `name`.
    pub fn dev(&self, name: &str) -> &DeviceStat {
        self.find(name)
            .unwrap_or_else(|| panic!("no device {name} in {self}"))
    }

    /// The entry of the only device (a daemon serving one).
    pub fn sole(&self) -> &DeviceStat {
        match self.devices() {
            [d] => d,
            _ => panic!("not one device in {self}"),
        }
    }

    /// The entry of the device named `name`, if there is one.
    pub fn find(&self, name: &str) -> Option<&DeviceStat> {
        self.devices().iter().find(|d| d.name == name)
    }

    /// The counters of the device named `name` (its `stats`).
    pub fn counters(&self, name: &str) -> &DeviceStats {
        &self.dev(name).stats
    }

    /// The worker of the device named `name`: state, pid, failures.
    pub fn worker(&self, name: &str) -> &WorkerStatus {
        &self.dev(name).worker
    }

    /// The pool's counters: every device summed, with the host limit.
    pub fn pool(&self) -> &PoolStats {
        &self.0.pool
    }

    /// The device whose socket is `socket`.
    pub fn dev_at(&self, socket: &Path) -> &DeviceStat {
        self.devices()
            .iter()
            .find(|d| d.socket == socket)
            .unwrap_or_else(|| panic!("no device with socket {} in {self}", socket.display()))
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match serde_json::to_string(&self.0) {
            Ok(json) => f.write_str(&json),
            Err(_) => write!(f, "{:?}", self.0),
        }
    }
}

/// The main counters on one line, sizes in MiB, for the end-to-end tests'
/// logs.
pub trait Summary {
    fn summary(&self) -> String;
}

/// The counters [`Summary`] shows, of a device or the pool.
struct Main {
    orig_data_size: u64,
    compr_data_size: u64,
    mem_used_total: u64,
    mem_used_max: u64,
    mem_limit: u64,
    same_pages: u64,
    huge_pages: u64,
    reads: u64,
    writes: u64,
    discards: u64,
    failed_writes: u64,
}

impl Main {
    fn line(&self) -> String {
        let mut s = String::new();
        let size = |s: &mut String, f: &str, v: u64| {
            let _ = write!(s, "{f}={:.1}MiB ", v as f64 / MIB as f64);
        };
        size(&mut s, "orig_data_size", self.orig_data_size);
        size(&mut s, "compr_data_size", self.compr_data_size);
        size(&mut s, "mem_used_total", self.mem_used_total);
        size(&mut s, "mem_used_max", self.mem_used_max);
        size(&mut s, "mem_limit", self.mem_limit);
        for (f, v) in [
            ("same_pages", self.same_pages),
            ("huge_pages", self.huge_pages),
            ("reads", self.reads),
            ("writes", self.writes),
            ("discards", self.discards),
            ("failed_writes", self.failed_writes),
        ] {
            let _ = write!(s, "{f}={v} ");
        }
        s.trim_end().to_string()
    }
}

impl Summary for DeviceStats {
    fn summary(&self) -> String {
        Main {
            orig_data_size: self.orig_data_size,
            compr_data_size: self.compr_data_size,
            mem_used_total: self.mem_used_total,
            mem_used_max: self.mem_used_max,
            mem_limit: self.mem_limit,
            same_pages: self.same_pages,
            huge_pages: self.huge_pages,
            reads: self.reads,
            writes: self.writes,
            discards: self.discards,
            failed_writes: self.failed_writes,
        }
        .line()
    }
}

impl Summary for DeviceStat {
    fn summary(&self) -> String {
        self.stats.summary()
    }
}

impl Summary for PoolStats {
    fn summary(&self) -> String {
        Main {
            orig_data_size: self.orig_data_size,
            compr_data_size: self.compr_data_size,
            mem_used_total: self.mem_used_total,
            mem_used_max: self.mem_used_max,
            mem_limit: self.mem_limit,
            same_pages: self.same_pages,
            huge_pages: self.huge_pages,
            reads: self.reads,
            writes: self.writes,
            discards: self.discards,
            failed_writes: self.failed_writes,
        }
        .line()
    }
}
