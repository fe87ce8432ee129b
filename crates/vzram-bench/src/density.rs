//! Density: one vzram daemon serving many idle devices. What does each device cost?

use crate::cli::{format_size, DensityArgs};
use crate::error::Result;
use crate::report::JsonOut;
use crate::sys::{proc_fd_limit, proc_fds, proc_mem, proc_threads};
use crate::targets::vzram::{DeviceSpec, Many};
use crate::targets::Env;
use serde::Serialize;
use std::time::Duration;

/// Whether every device answered and the daemon logged no error.
pub fn all_ok(rs: &[DensityResult]) -> bool {
    rs.iter().all(|r| r.probed && r.log_errors == 0)
}

#[derive(Debug, Serialize)]
pub struct DensityResult {
    pub record: String,
    pub devices: usize,
    pub dev_size: u64,
    pub queues: u32,
    pub config_file: bool,
    /// Spawn until every device socket exists.
    pub startup_ms: f64,
    pub rss_bytes: u64,
    pub rss_anon_bytes: u64,
    /// (RSS - RSS with 1 device) / (devices - 1).
    pub rss_per_device_bytes: Option<f64>,
    pub threads: u64,
    pub fds: u64,
    pub fd_limit: Option<u64>,
    /// First and last device answered a 4 KiB read.
    pub probed: bool,
    /// `vzram stat --json` summary (or the error it gave).
    /// Lines with ERROR in the daemon's log (devices that failed to set up).
    pub log_errors: u64,
    /// `vzram stat --json` summary (or the error it gave).
    pub stat: serde_json::Value,
    pub unix_time: u64,
}

pub fn run(env: &Env, args: &DensityArgs, mut json: Option<JsonOut>) -> Result<Vec<DensityResult>> {
    let mut counts = args.devices.clone();
    // A one-device baseline, so per-device cost excludes the daemon's fixed cost.
    if !counts.contains(&1) {
        counts.insert(0, 1);
    }
    let mut out: Vec<DensityResult> = Vec::new();
    for &n in &counts {
        if crate::sys::interrupted() {
            break;
        }
        eprintln!("density: starting vzram with {n} devices ...");
        let tag = format!("density-{n}");
        let devices: Vec<DeviceSpec> = (0..n)
            .map(|i| DeviceSpec {
                socket: env.work_dir.join(&tag).join(format!("d{i}.sock")),
                size: args.dev_size,
                queues: args.queues,
            })
            .collect();
        let timeout = Duration::from_secs_f64(args.timeout);
        let mut many = Many::start(env, &tag, devices, args.config, timeout)?;
        // Let start-up allocations settle before sampling.
        std::thread::sleep(Duration::from_millis(200));
        let pid = many.daemon.pid();
        let mem = proc_mem(pid)?;
        let threads = proc_threads(pid)?;
        let fds = proc_fds(pid)?;
        let fd_limit = proc_fd_limit(pid);
        let mut probed = true;
        let mut stuck = Vec::new();
        for s in [many.sockets.first(), many.sockets.last()]
            .into_iter()
            .flatten()
        {
            // A socket can exist with nobody serving it (a device that failed to set
            // up): the vhost-user handshake then blocks, so probe from a thread.
            let (tx, rx) = std::sync::mpsc::channel();
            let path = s.clone();
            let h = std::thread::spawn(move || {
                let _ = tx.send(crate::client::probe(&path));
            });
            let res = match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(r) => {
                    let _ = h.join();
                    r
                }
                Err(_) => {
                    stuck.push(h); // unblocked once the daemon is stopped
                    Err(format!("{}: no answer within 10 s", s.display()).into())
                }
            };
            if let Err(e) = res {
                eprintln!("density: {n} devices: probe failed: {e}");
                probed = false;
            }
        }
        many.daemon.check_alive()?;
        let log_errors = std::fs::read_to_string(&many.daemon.log)
            .map(|l| l.lines().filter(|l| l.contains("ERROR")).count() as u64)
            .unwrap_or(0);
        if log_errors > 0 {
            eprintln!(
                "density: {n} devices: {log_errors} ERROR lines in the daemon log, the last: {}",
                many.daemon.log_tail()
            );
        }
        let stat = crate::targets::vzram::stat(&env.vzram_bin, &many.control)
            .unwrap_or_else(|e| serde_json::json!({ "error": e.0 }));
        let base = out.iter().find(|r| r.devices == 1).map(|r| r.rss_bytes);
        let r = DensityResult {
            record: "density".into(),
            devices: n,
            dev_size: args.dev_size,
            queues: args.queues,
            config_file: args.config,
            startup_ms: many.startup.as_secs_f64() * 1e3,
            rss_bytes: mem.rss,
            rss_anon_bytes: mem.rss_anon,
            rss_per_device_bytes: base
                .filter(|_| n > 1)
                .map(|b| (mem.rss as f64 - b as f64) / (n - 1) as f64),
            threads,
            fds,
            fd_limit,
            probed,
            log_errors,
            stat,
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        eprintln!(
            "density: {n} devices: start-up {:.0} ms, RSS {:.1} MiB, {} threads, {} fds",
            r.startup_ms,
            r.rss_bytes as f64 / 1048576.0,
            r.threads,
            r.fds
        );
        if let Some(j) = json.as_mut() {
            j.write(&r)?;
        }
        drop(many);
        for h in stuck {
            let _ = h.join();
        }
        out.push(r);
    }
    Ok(out)
}

pub fn print_table(rs: &[DensityResult]) {
    println!(
        "| devices | size each | start-up ms | RSS MiB | RSS per device KiB | threads | fds | fd limit | log errors | probe |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for r in rs {
        println!(
            "| {} | {} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} |",
            r.devices,
            format_size(r.dev_size),
            r.startup_ms,
            r.rss_bytes as f64 / 1048576.0,
            r.rss_per_device_bytes
                .map(|b| format!("{:.1}", b / 1024.0))
                .unwrap_or("-".into()),
            r.threads,
            r.fds,
            r.fd_limit.map(|l| l.to_string()).unwrap_or("-".into()),
            r.log_errors,
            if r.probed { "ok" } else { "FAILED" }
        );
    }
}
