//! A stat reply: the control socket's `{"cmd":"stat"}` answer, which is
//! also what `vzram stat --json` prints ([`crate::Daemon::stat`],
//! [`crate::Daemon::stat_cli`]). Devices are found by name (the
//! integration tests) or by socket path (the end-to-end tests), and every
//! accessor panics, naming the reply, when what it reads is missing.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use crate::data::MIB;

/// A stat reply.
#[derive(Clone, Debug)]
pub struct Stats(pub Value);

impl Stats {
    /// Every device's entry.
    pub fn devices(&self) -> &[Value] {
        self.0
            .get("devices")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_else(|| panic!("no devices array in stat JSON: {}", self.0))
    }

    /// The entry of the device named `name`.
    fn named(&self, name: &str) -> &Value {
        self.0["devices"]
            .as_array()
            .and_then(|a| a.iter().find(|d| d["name"] == name))
            .unwrap_or_else(|| panic!("no device {name} in {}", self.0))
    }

    /// A device's counters (its `stats` object), by name.
    pub fn device_stats(&self, name: &str) -> &Value {
        &self.named(name)["stats"]
    }

    /// A device's worker process: state, pid, failures.
    pub fn worker(&self, name: &str) -> Value {
        self.named(name)["worker"].clone()
    }

    /// One counter of the device named `name`.
    pub fn dev(&self, name: &str, field: &str) -> u64 {
        self.device_stats(name)[field]
            .as_u64()
            .unwrap_or_else(|| panic!("no {field} for {name} in {}", self.0))
    }

    /// One counter of the pool.
    pub fn pool(&self, field: &str) -> u64 {
        self.0["pool"][field]
            .as_u64()
            .unwrap_or_else(|| panic!("no pool {field} in {}", self.0))
    }

    /// The device whose socket is `socket`.
    pub fn device(&self, socket: &Path) -> Counters<'_> {
        let want = socket.to_string_lossy();
        let d = self
            .devices()
            .iter()
            .find(|d| d.get("socket").and_then(Value::as_str) == Some(&want))
            .unwrap_or_else(|| panic!("no device with socket {want} in stat JSON: {}", self.0));
        Counters {
            v: d,
            what: "device",
        }
    }

    /// The pool's object, for [`Counters::get`].
    pub fn pool_counters(&self) -> Counters<'_> {
        let p = self
            .0
            .get("pool")
            .unwrap_or_else(|| panic!("no pool in stat JSON: {}", self.0));
        Counters { v: p, what: "pool" }
    }
}

/// One object of the stat JSON: a device's entry or the pool.
#[derive(Clone, Copy, Debug)]
pub struct Counters<'a> {
    pub v: &'a Value,
    what: &'static str,
}

impl Counters<'_> {
    /// A counter: a member of the object itself (`size_bytes`, `queues`,
    /// `connections`, pool counters) or of a device's `stats`.
    pub fn get(&self, field: &str) -> u64 {
        self.v
            .get(field)
            .or_else(|| self.v.get("stats").and_then(|s| s.get(field)))
            .and_then(Value::as_u64)
            .unwrap_or_else(|| panic!("no counter {field} in {} stats: {}", self.what, self.v))
    }

    /// A string member, such as a device's `algo`.
    pub fn text(&self, field: &str) -> &str {
        self.v
            .get(field)
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("no string {field} in {} stats: {}", self.what, self.v))
    }

    /// The main counters on one line, sizes in MiB.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        for f in [
            "orig_data_size",
            "compr_data_size",
            "mem_used_total",
            "mem_used_max",
            "mem_limit",
            "same_pages",
            "huge_pages",
            "reads",
            "writes",
            "discards",
            "failed_writes",
        ] {
            let v = self.get(f);
            if f.ends_with("_size") || f.starts_with("mem_") {
                let _ = write!(s, "{f}={:.1}MiB ", v as f64 / MIB as f64);
            } else {
                let _ = write!(s, "{f}={v} ");
            }
        }
        s.trim_end().to_string()
    }
}
