//! The vzram daemon. Everything that depends on its command line and its stats format
//! is in the `contract` section at the top, so a CLI change is a one-place edit.

use super::target::{Algo, BlockTarget, Env, Memory};
use crate::error::{bail, Context, Result};
use crate::sys::{daemon_rss, proc_mem, Daemon};
use crate::units::format_size;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

// ---- contract with the daemon's CLI -------------------------------------------------

/// `vzram serve --socket SOCK --size SIZE --queues N --algo ALGO --control CTRL`
fn serve_one(
    bin: &Path,
    socket: &Path,
    size: u64,
    queues: u32,
    algo: Algo,
    control: &Path,
) -> Command {
    serve_one_with(bin, socket, size, queues, algo, control, knows_fresh(bin))
}

/// Whether `bin serve` takes `--fresh`: a build from before durable state
/// (a `vzram-base` binary) has no state to discard and no such flag.
fn knows_fresh(bin: &Path) -> bool {
    Command::new(bin)
        .args(["serve", "--help"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("--fresh"))
}

fn serve_one_with(
    bin: &Path,
    socket: &Path,
    size: u64,
    queues: u32,
    algo: Algo,
    control: &Path,
    fresh: bool,
) -> Command {
    let mut c = Command::new(bin);
    c.arg("serve")
        .arg("--socket")
        .arg(socket)
        .args(["--size", &format_size(size)])
        .args(["--queues", &queues.to_string()])
        .args(["--algo", &algo.to_string()])
        .arg("--control")
        .arg(control);
    if fresh {
        // Every run starts empty, as a guest's swap does at boot.
        c.arg("--fresh");
    }
    c
}

/// One idle device of a density run.
pub struct DeviceSpec {
    pub socket: PathBuf,
    pub size: u64,
    pub queues: u32,
}

/// `vzram serve --device socket=PATH,size=1G,queues=1 ... --control CTRL`, or the same
/// devices as a TOML `[[device]]` array passed with `--config FILE`.
fn serve_many(
    bin: &Path,
    devices: &[DeviceSpec],
    control: &Path,
    config: Option<&Path>,
) -> Result<Command> {
    let mut c = Command::new(bin);
    c.arg("serve").arg("--fresh");
    match config {
        Some(path) => {
            let mut toml = String::new();
            for d in devices {
                toml.push_str(&format!(
                    "[[device]]\nsocket = \"{}\"\nsize = \"{}\"\nqueues = {}\n\n",
                    d.socket.display(),
                    format_size(d.size),
                    d.queues
                ));
            }
            std::fs::write(path, toml).context(format!("writing {}", path.display()))?;
            c.arg("--config").arg(path);
        }
        None => {
            for d in devices {
                c.arg("--device").arg(format!(
                    "socket={},size={},queues={}",
                    d.socket.display(),
                    format_size(d.size),
                    d.queues
                ));
            }
        }
    }
    c.arg("--control").arg(control);
    Ok(c)
}

/// `vzram stat --json --control CTRL`: JSON with `mem_used_total`, `compr_data_size`,
/// `orig_data_size` for the shared `pool` and for each of `devices[].stats`. The pool's
/// numbers are the daemon-wide totals; without a pool we sum the devices.
pub fn stat(bin: &Path, control: &Path) -> Result<Value> {
    let out = Command::new(bin)
        .args(["stat", "--json", "--control"])
        .arg(control)
        .output()
        .context("running vzram stat")?;
    if !out.status.success() {
        bail!(
            "vzram stat failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let v: Value = serde_json::from_slice(&out.stdout).context("parsing vzram stat output")?;
    let mut summary = serde_json::Map::new();
    for key in ["mem_used_total", "compr_data_size", "orig_data_size"] {
        let total = match v
            .get("pool")
            .and_then(|p| p.get(key))
            .and_then(Value::as_u64)
        {
            Some(n) => n,
            None => sum_key(v.get("devices").unwrap_or(&v), key),
        };
        summary.insert(key.into(), total.into());
    }
    summary.insert("raw".into(), v);
    Ok(Value::Object(summary))
}

/// In `stat`'s summary (its `raw` output): each device's `worker`, `{"state", "pid",
/// "started", "failures", "failing", "last_failure"}`, in configuration order.
pub fn worker_status(summary: &Value, device: usize) -> Option<&Value> {
    summary
        .get("raw")?
        .get("devices")?
        .get(device)?
        .get("worker")
}

/// A device's worker in `stat`'s summary; what is missing reads as 0 (not running).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct WorkerStat {
    pub running: bool,
    pub pid: Option<u32>,
    pub failing: u64,
    pub started: u64,
    pub failures: u64,
}

pub fn worker(summary: &Value, device: usize) -> WorkerStat {
    let Some(w) = worker_status(summary, device) else {
        return WorkerStat::default();
    };
    let num = |k: &str| w.get(k).and_then(Value::as_u64);
    WorkerStat {
        running: w.get("state").and_then(Value::as_str) == Some("running"),
        pid: num("pid").map(|p| p as u32),
        failing: num("failing").unwrap_or(0),
        started: num("started").unwrap_or(0),
        failures: num("failures").unwrap_or(0),
    }
}

/// The pid of each device's worker while its state is `running` (None otherwise).
pub fn worker_pids(summary: &Value) -> Vec<Option<u32>> {
    let n = summary
        .get("raw")
        .and_then(|r| r.get("devices"))
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    (0..n)
        .map(|i| {
            let w = worker(summary, i);
            w.pid.filter(|_| w.running)
        })
        .collect()
}

/// The daemon-wide byte counts of `stat`'s summary; 0 where missing (a failed
/// `stat`'s `{"error"}`, or another target's details).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StatSizes {
    pub mem_used_total: u64,
    pub compr_data_size: u64,
    pub orig_data_size: u64,
}

pub fn sizes(summary: &Value) -> StatSizes {
    let num = |k: &str| summary.get(k).and_then(Value::as_u64).unwrap_or(0);
    StatSizes {
        mem_used_total: num("mem_used_total"),
        compr_data_size: num("compr_data_size"),
        orig_data_size: num("orig_data_size"),
    }
}

// ---- end of contract ------------------------------------------------------------------

fn sum_key(v: &Value, key: &str) -> u64 {
    match v {
        Value::Object(m) => m
            .iter()
            .map(|(k, x)| {
                if k == key {
                    x.as_u64().unwrap_or(0)
                } else {
                    sum_key(x, key)
                }
            })
            .sum(),
        Value::Array(a) => a.iter().map(|x| sum_key(x, key)).sum(),
        _ => 0,
    }
}

pub struct Vzram {
    daemon: Daemon,
    socket: PathBuf,
    control: PathBuf,
    bin: PathBuf,
}

impl Vzram {
    pub fn start(
        env: &Env,
        bin: &Path,
        extra: &[String],
        algo: Algo,
        queues: u32,
        size: u64,
        seq: usize,
    ) -> Result<Vzram> {
        let socket = env.work_dir.join(format!("vzram-{seq}.sock"));
        let control = env.work_dir.join(format!("vzram-{seq}.ctl"));
        let _ = std::fs::remove_file(&socket);
        let _ = std::fs::remove_file(&control);
        let mut cmd = serve_one(bin, &socket, size, queues, algo, &control);
        cmd.args(extra);
        let mut v = Vzram {
            daemon: Daemon::spawn(
                "vzram",
                &mut cmd,
                env.work_dir.join(format!("vzram-{seq}.log")),
            )?,
            socket,
            control,
            bin: bin.to_path_buf(),
        };
        v.daemon
            .wait_for_paths(std::slice::from_ref(&v.socket), Duration::from_secs(15))?;
        Ok(v)
    }
}

impl BlockTarget for Vzram {
    fn socket(&self) -> &Path {
        &self.socket
    }

    fn daemon(&mut self) -> &mut Daemon {
        &mut self.daemon
    }

    fn memory(&mut self) -> Result<Memory> {
        let proc = proc_mem(self.daemon.pid())?;
        // The pool lives in the daemon's processes (the worker maps the device's state
        // files), so their RSS without the guest RAM they map is the whole cost while a
        // client is connected. The daemon's own view is kept alongside; a missing `stat`
        // is not fatal to a benchmark.
        let tree = daemon_rss(self.daemon.pid())?;
        let details = if self.control.exists() {
            stat(&self.bin, &self.control).unwrap_or_else(|e| serde_json::json!({ "error": e.0 }))
        } else {
            serde_json::json!({ "error": "no control socket" })
        };
        Ok(Memory {
            host_bytes: tree.own(),
            proc,
            extra_bytes: 0,
            tree,
            details,
        })
    }
}

impl Drop for Vzram {
    fn drop(&mut self) {
        let _ = self.daemon.stop();
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(&self.control);
    }
}

/// A daemon serving many idle devices (density runs).
pub struct Many {
    pub daemon: Daemon,
    pub sockets: Vec<PathBuf>,
    pub control: PathBuf,
    /// From spawn until every socket and the control socket exist.
    pub startup: Duration,
}

impl Many {
    pub fn start(
        env: &Env,
        tag: &str,
        devices: Vec<DeviceSpec>,
        use_config: bool,
        timeout: Duration,
    ) -> Result<Many> {
        let dir = env.work_dir.join(tag);
        std::fs::create_dir_all(&dir)?;
        let control = dir.join("ctl");
        let config = use_config.then(|| dir.join("devices.toml"));
        let sockets: Vec<PathBuf> = devices.iter().map(|d| d.socket.clone()).collect();
        for s in sockets.iter().chain([&control]) {
            let _ = std::fs::remove_file(s);
        }
        let mut cmd = serve_many(&env.vzram_bin, &devices, &control, config.as_deref())?;
        let t0 = std::time::Instant::now();
        let mut daemon = Daemon::spawn("vzram", &mut cmd, dir.join("vzram.log"))?;
        // The daemon binds every device socket first, then opens each device's state,
        // then binds the control socket: it is ready once that exists.
        let mut paths = sockets.clone();
        paths.push(control.clone());
        daemon.wait_for_paths(&paths, timeout)?;
        let startup = t0.elapsed();
        Ok(Many {
            daemon,
            sockets,
            control,
            startup,
        })
    }
}

impl Drop for Many {
    fn drop(&mut self) {
        let _ = self.daemon.stop();
        for s in &self.sockets {
            let _ = std::fs::remove_file(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_stat_keys_at_any_depth() {
        let v = serde_json::json!({
            "devices": [
                { "name": "a", "mem_used_total": 10, "orig_data_size": 40 },
                { "name": "b", "mem_used_total": 5, "orig_data_size": 20 }
            ]
        });
        assert_eq!(sum_key(&v, "mem_used_total"), 15);
        assert_eq!(sum_key(&v, "orig_data_size"), 60);
        assert_eq!(sum_key(&v, "compr_data_size"), 0);
    }

    #[test]
    fn stat_prefers_pool_totals() {
        let dir = std::env::temp_dir().join(format!("vzram-bench-stat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("vzram");
        std::fs::write(
            &fake,
            "#!/bin/sh\necho '{\"pool\":{\"mem_used_total\":7,\"orig_data_size\":30},\
             \"devices\":[{\"stats\":{\"mem_used_total\":7,\"orig_data_size\":30,\
             \"compr_data_size\":9}}]}'\n",
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let v = stat(&fake, Path::new("/nonexistent")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(v["mem_used_total"], 7);
        assert_eq!(v["orig_data_size"], 30);
        assert_eq!(v["compr_data_size"], 9);
    }

    #[test]
    fn reads_worker_pids() {
        let v = serde_json::json!({ "raw": { "devices": [
            { "worker": { "state": "running", "pid": 42, "failing": 0 } },
            { "worker": { "state": "idle", "pid": null, "failing": 0 } },
            { "worker": { "state": "running", "pid": null } },
        ]}});
        assert_eq!(worker_pids(&v), vec![Some(42), None, None]);
        assert_eq!(worker_status(&v, 1).unwrap()["state"], "idle");
        assert!(worker_status(&v, 3).is_none());
        assert!(worker_pids(&serde_json::json!({ "raw": {} })).is_empty());
        let w = worker(&v, 0);
        assert!(w.running && w.pid == Some(42) && w.failing == 0);
        assert_eq!(worker(&v, 3), WorkerStat::default());
    }

    #[test]
    fn reads_sizes() {
        let v = serde_json::json!({ "mem_used_total": 7, "orig_data_size": 30 });
        let s = sizes(&v);
        assert_eq!(
            (s.mem_used_total, s.compr_data_size, s.orig_data_size),
            (7, 0, 30)
        );
        assert_eq!(
            sizes(&serde_json::json!({ "error": "x" })),
            StatSizes::default()
        );
    }

    #[test]
    fn serve_command_follows_contract() {
        assert!(!knows_fresh(Path::new("/nonexistent/vzram")));
        let c = serve_one_with(
            Path::new("vz"),
            Path::new("/s"),
            1 << 30,
            2,
            Algo::Zstd(1),
            Path::new("/c"),
            true,
        );
        let args: Vec<_> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "serve",
                "--socket",
                "/s",
                "--size",
                "1G",
                "--queues",
                "2",
                "--algo",
                "zstd:1",
                "--control",
                "/c",
                "--fresh"
            ]
        );
    }
}
