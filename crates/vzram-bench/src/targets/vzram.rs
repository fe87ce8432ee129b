//! The vzram daemon. Everything that depends on its command line and its stats format
//! is in the `contract` section at the top, so a CLI change is a one-place edit.

use super::target::{Algo, BlockTarget, Env, Memory, StatSizes};
use crate::error::{bail, Context, Result};
use crate::sys::{daemon_rss, proc_mem, Daemon};
use crate::units::format_size;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use vzram::proto::control::{parse_reply, StatReply, WorkerState, WorkerStatus};

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

/// `vzram stat --json --control CTRL`, read into the daemon's own reply type
/// ([`StatReply`]): a reply that lacks a field (another build's format, a
/// refusal) is an error, not zeros.
pub fn stat(bin: &Path, control: &Path) -> Result<StatReply> {
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
    parse_reply(v)
        .map_err(|e| e.to_string())
        .context("reading vzram stat output")
}

/// What a report keeps of a stat: the pool's byte counts (the daemon-wide
/// totals) at the top, and the whole reply under `raw`.
pub fn details(st: &StatReply) -> Value {
    let s = sizes(st);
    serde_json::json!({
        "mem_used_total": s.mem_used_total,
        "compr_data_size": s.compr_data_size,
        "orig_data_size": s.orig_data_size,
        "raw": st,
    })
}

/// The worker of the device at `device` (configuration order), if the reply
/// has that device.
pub fn worker_status(st: &StatReply, device: usize) -> Option<&WorkerStatus> {
    st.devices.get(device).map(|d| &d.worker)
}

/// A device's worker, as the benchmarks use it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct WorkerStat {
    pub running: bool,
    pub pid: Option<u32>,
    pub failing: u64,
    pub started: u64,
    pub failures: u64,
}

/// The worker of the device at `device`; a device the reply does not have
/// has no worker: not running, nothing started (the default).
pub fn worker(st: &StatReply, device: usize) -> WorkerStat {
    match worker_status(st, device) {
        None => WorkerStat::default(),
        Some(w) => WorkerStat {
            running: w.state == WorkerState::Running,
            pid: w.pid,
            failing: w.failing,
            started: w.started,
            failures: w.failures,
        },
    }
}

/// The pid of each device's worker while its state is `running` (None otherwise).
pub fn worker_pids(st: &StatReply) -> Vec<Option<u32>> {
    (0..st.devices.len())
        .map(|i| {
            let w = worker(st, i);
            w.pid.filter(|_| w.running)
        })
        .collect()
}

/// The daemon-wide byte counts of a stat: the pool's.
pub fn sizes(st: &StatReply) -> StatSizes {
    StatSizes {
        mem_used_total: st.pool.mem_used_total,
        compr_data_size: st.pool.compr_data_size,
        orig_data_size: st.pool.orig_data_size,
    }
}

// ---- end of contract ------------------------------------------------------------------

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
        let st = if self.control.exists() {
            stat(&self.bin, &self.control)
        } else {
            Err("no control socket".into())
        };
        let (details, stat_sizes) = match &st {
            Ok(st) => (details(st), Some(sizes(st))),
            Err(e) => (serde_json::json!({ "error": e.0 }), None),
        };
        // A page written through a state file and not mapped (a staged page,
        // pwrite) is memory that no RSS shows: the state files count by the
        // blocks they hold, not by what of them is mapped.
        let held: Option<u64> = st
            .as_ref()
            .ok()
            .map(|st| st.devices.iter().map(|d| d.state_bytes).sum());
        let host_bytes = match held {
            Some(b) if tree.state_rss > 0 => tree.own() - tree.state_rss + b,
            _ => tree.own(),
        };
        Ok(Memory {
            host_bytes,
            proc,
            extra_bytes: 0,
            tree,
            details,
            stat_sizes,
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

    use vzram::proto::control::{DeviceStat, MigrationStat, MigrationState, TierStat};
    use vzram_store::{Codec, DeviceStats, PoolStats};

    /// A device in a stat reply whose worker is `state`, with `pid`.
    fn device(index: usize, state: WorkerState, pid: Option<u32>) -> DeviceStat {
        DeviceStat {
            index,
            name: format!("vzram{index}"),
            socket: format!("/run/d{index}.sock").into(),
            size_bytes: 1 << 30,
            queues: 1,
            algo: Codec::Lz4,
            readonly: false,
            serial: String::new(),
            connected: pid.is_some(),
            state: format!("/var/lib/vzram/d{index}").into(),
            state_bytes: 4096,
            state_damaged: false,
            connections: 1,
            worker: WorkerStatus {
                state,
                pid,
                started: 3,
                failures: 2,
                failing: 1,
                last_failure: None,
                short_lived: 0,
                refused_clients: 0,
            },
            stats: DeviceStats {
                mem_used_total: 7,
                orig_data_size: 30,
                compr_data_size: 9,
                ..DeviceStats::default()
            },
            tier: TierStat {
                backing: None,
                recompress_algo: Codec::Zstd { level: 3 },
                idle_after_secs: None,
                auto_writeback: false,
                auto_recompress: false,
            },
            migration: MigrationStat {
                state: MigrationState::None,
                incoming: None,
                error: None,
                bytes: 0,
                records: 0,
                pass: 0,
                dirty_slots: 0,
                final_ms: 0.0,
                total_ms: 0.0,
            },
        }
    }

    fn reply(devices: Vec<DeviceStat>) -> StatReply {
        StatReply {
            pool: PoolStats {
                devices: devices.len() as u64,
                mem_used_total: 70,
                orig_data_size: 300,
                compr_data_size: 90,
                ..PoolStats::default()
            },
            devices,
            state_dir: PathBuf::new(),
            leftovers: Vec::new(),
            metrics: None,
        }
    }

    /// `stat` through a fake `vzram` that prints `out`.
    fn stat_of(tag: &str, out: &Value) -> Result<StatReply> {
        let dir =
            std::env::temp_dir().join(format!("vzram-bench-stat-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (fake, json) = (dir.join("vzram"), dir.join("stat.json"));
        std::fs::write(&json, out.to_string()).unwrap();
        std::fs::write(&fake, format!("#!/bin/sh\ncat '{}'\n", json.display())).unwrap();
        std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let st = stat(&fake, Path::new("/nonexistent"));
        std::fs::remove_dir_all(&dir).unwrap();
        st
    }

    #[test]
    fn stat_reads_the_reply_and_keeps_the_pool_totals() {
        let want = reply(vec![device(0, WorkerState::Running, Some(42))]);
        let mut out = serde_json::to_value(&want).unwrap();
        out["ok"] = true.into();
        let st = stat_of("ok", &out).unwrap();
        assert_eq!(st, want);
        let v = details(&st);
        assert_eq!(v["mem_used_total"], 70);
        assert_eq!(v["orig_data_size"], 300);
        assert_eq!(v["compr_data_size"], 90);
        assert_eq!(v["raw"]["devices"][0]["worker"]["pid"], 42);
    }

    #[test]
    fn stat_refuses_a_reply_it_cannot_read() {
        let mut out =
            serde_json::to_value(reply(vec![device(0, WorkerState::Idle, None)])).unwrap();
        out["ok"] = true.into();
        // A misspelt or missing counter is an error, not 0.
        let mut missing = out.clone();
        missing["pool"]
            .as_object_mut()
            .unwrap()
            .remove("mem_used_total");
        let e = stat_of("missing", &missing).unwrap_err();
        assert!(e.0.contains("mem_used_total"), "{e}");
        // A reply without a pool (an older format) is not summed up.
        let mut no_pool = out.clone();
        no_pool.as_object_mut().unwrap().remove("pool");
        assert!(stat_of("nopool", &no_pool).is_err());
        // A refusal says why.
        let e = stat_of(
            "refused",
            &serde_json::json!({"ok": false, "error": "busy"}),
        )
        .unwrap_err();
        assert!(e.0.contains("busy"), "{e}");
    }

    #[test]
    fn reads_worker_pids() {
        let v = reply(vec![
            device(0, WorkerState::Running, Some(42)),
            device(1, WorkerState::Idle, None),
            device(2, WorkerState::Running, None),
        ]);
        assert_eq!(worker_pids(&v), vec![Some(42), None, None]);
        assert_eq!(worker_status(&v, 1).unwrap().state, WorkerState::Idle);
        assert!(worker_status(&v, 3).is_none());
        assert!(worker_pids(&reply(Vec::new())).is_empty());
        let w = worker(&v, 0);
        assert_eq!(
            w,
            WorkerStat {
                running: true,
                pid: Some(42),
                failing: 1,
                started: 3,
                failures: 2,
            }
        );
        // No such device: no worker, not running.
        assert_eq!(worker(&v, 3), WorkerStat::default());
    }

    #[test]
    fn reads_sizes() {
        let s = sizes(&reply(vec![device(0, WorkerState::Idle, None)]));
        assert_eq!(
            (s.mem_used_total, s.compr_data_size, s.orig_data_size),
            (70, 90, 300)
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
