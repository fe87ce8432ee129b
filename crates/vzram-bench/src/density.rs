//! Density: one vzram daemon serving many devices. What does each device cost, idle
//! and (with `--connect`) with a frontend connected to every one of them?
//!
//! `vzram serve` is a supervisor, a launcher (`vzram-launch`) and one worker process
//! per connected frontend, so everything is measured over the daemon's whole process
//! tree as well as for the supervisor alone.

use crate::cli::DensityArgs;
use crate::client::{page_io, Conn};
use crate::data::{device_page, PAGE};
use crate::error::{bail, Context, Result};
use crate::report::JsonOut;
use crate::sys::{
    proc_comm, proc_fd_limit, proc_fds, proc_mem, proc_smaps, proc_threads, proc_tree, tree_use,
    ProcMem, TreeUse,
};
use crate::targets::vzram::{DeviceSpec, Many};
use crate::targets::Env;
use crate::units::format_size;
use serde::Serialize;
use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

/// Whether every device answered and the daemon logged no error.
pub fn all_ok(rs: &[DensityResult]) -> bool {
    rs.iter().all(|r| {
        r.probed && r.log_errors == 0 && r.connected.as_ref().is_none_or(|c| c.workers == c.devices)
    })
}

#[derive(Debug, Serialize)]
pub struct DensityResult {
    pub record: String,
    pub devices: usize,
    pub dev_size: u64,
    pub queues: u32,
    pub config_file: bool,
    /// Spawn until every device socket and the control socket exist (the control
    /// socket is bound once every device's state is open).
    pub startup_ms: f64,
    /// The supervisor (the `vzram serve` process) alone.
    pub rss_bytes: u64,
    pub rss_anon_bytes: u64,
    /// (RSS - RSS with 1 device) / (devices - 1), supervisor alone.
    pub rss_per_device_bytes: Option<f64>,
    pub threads: u64,
    pub fds: u64,
    pub fd_limit: Option<u64>,
    /// The supervisor and every process under it (the launcher; workers when
    /// frontends are connected), before any frontend connects.
    pub tree: TreeUse,
    /// The same per device: (tree RSS - tree RSS with 1 device) / (devices - 1).
    pub tree_rss_per_device_bytes: Option<f64>,
    /// With `--connect`: every device connected, measured again.
    pub connected: Option<Connected>,
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
        let tree = tree_use(&proc_tree(pid));
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
        let connected = if args.connect {
            Some(connect_all(env, &mut many, mem)?)
        } else {
            None
        };
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
        let stat = match crate::targets::vzram::stat(&env.vzram_bin, &many.control) {
            Ok(st) => crate::targets::vzram::details(&st),
            Err(e) => serde_json::json!({ "error": e.0 }),
        };
        let base = out.iter().find(|r| r.devices == 1).map(|r| r.rss_bytes);
        let tree_base = out
            .iter()
            .find(|r| r.devices == 1)
            .map(|r| r.tree.rss_bytes);
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
            tree,
            tree_rss_per_device_bytes: tree_base
                .filter(|_| n > 1)
                .map(|b| (tree.rss_bytes as f64 - b as f64) / (n - 1) as f64),
            connected,
            probed,
            log_errors,
            stat,
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        eprintln!(
            "density: {n} devices: start-up {:.0} ms, RSS {:.1} MiB, {} threads, {} fds; \
             {} processes: RSS {:.1} MiB, {} threads, {} fds",
            r.startup_ms,
            r.rss_bytes as f64 / 1048576.0,
            r.threads,
            r.fds,
            r.tree.processes,
            r.tree.rss_bytes as f64 / 1048576.0,
            r.tree.threads,
            r.tree.fds
        );
        if let Some(c) = &r.connected {
            eprintln!(
                "density: {n} devices connected: {} workers, per worker RSS {:.0} KiB of which \
                 guest RAM {:.0} KiB; without it mean {:.0} KiB, max {:.0} KiB; supervisor \
                 RSS {:.1} MiB",
                c.workers,
                c.worker_rss_mean / 1024.0,
                c.guest_rss_mean / 1024.0,
                c.own_rss_mean / 1024.0,
                c.own_rss_max as f64 / 1024.0,
                c.supervisor.rss as f64 / 1048576.0
            );
        }
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
    println!("Idle devices (before any frontend connects):\n");
    println!(
        "| devices | size each | start-up ms | supervisor RSS MiB | per device KiB | threads | fds | fd limit | processes | all processes RSS MiB | per device KiB | threads | fds | log errors | probe |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let kib = |b: Option<f64>| {
        b.map(|b| format!("{:.1}", b / 1024.0))
            .unwrap_or("-".into())
    };
    for r in rs {
        println!(
            "| {} | {} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} |",
            r.devices,
            format_size(r.dev_size),
            r.startup_ms,
            r.rss_bytes as f64 / 1048576.0,
            kib(r.rss_per_device_bytes),
            r.threads,
            r.fds,
            r.fd_limit.map(|l| l.to_string()).unwrap_or("-".into()),
            r.tree.processes,
            r.tree.rss_bytes as f64 / 1048576.0,
            kib(r.tree_rss_per_device_bytes),
            r.tree.threads,
            r.tree.fds,
            r.log_errors,
            if r.probed { "ok" } else { "FAILED" }
        );
    }
    let conn: Vec<(&DensityResult, &Connected)> = rs
        .iter()
        .filter_map(|r| r.connected.as_ref().map(|c| (r, c)))
        .collect();
    if conn.is_empty() {
        return;
    }
    println!("\nEvery device connected (1 queue, 4 KiB buffer, one 4 KiB write + read each):\n");
    println!(
        "| devices | workers | connect all s | supervisor RSS MiB idle → connected | launcher RSS KiB | all processes | RSS MiB | threads | fds |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (r, c) in &conn {
        println!(
            "| {} | {} | {:.2} | {:.1} → {:.1} | {} | {} | {:.1} | {} | {} |",
            r.devices,
            c.workers,
            c.connect_s,
            c.supervisor_idle.rss as f64 / 1048576.0,
            c.supervisor.rss as f64 / 1048576.0,
            c.launcher_rss
                .map(|b| (b / 1024).to_string())
                .unwrap_or("-".into()),
            c.tree.processes,
            c.tree.rss_bytes as f64 / 1048576.0,
            c.tree.threads,
            c.tree.fds
        );
    }
    println!("\nPer worker, KiB (mean; max in parentheses). own = RSS - guest RAM:\n");
    println!(
        "| devices | RSS | RssAnon | RssFile | RssShmem | of which guest RAM | of which state/counters | own RSS | own PSS | own private | page tables | threads | fds |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (r, c) in &conn {
        let k = |v: f64| format!("{:.0}", v / 1024.0);
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | **{}** ({}) | {} | {} | {} | {:.1} | {:.1} |",
            r.devices,
            k(c.worker_rss_mean),
            k(c.rss_anon_mean),
            k(c.rss_file_mean),
            k(c.rss_shmem_mean),
            k(c.guest_rss_mean),
            k(c.state_rss_mean),
            k(c.own_rss_mean),
            k(c.own_rss_max as f64),
            k(c.own_pss_mean),
            k(c.own_private_mean),
            k(c.page_tables_mean),
            c.threads_mean,
            c.fds_mean
        );
    }
}

/// What one worker holds, from /proc/PID/status and /proc/PID/smaps.
#[derive(Debug, Serialize, Clone)]
pub struct WorkerMem {
    pub device: usize,
    pub pid: u32,
    /// VmRSS and its split, from /proc/PID/status.
    pub status: ProcMem,
    /// Sum of Rss over /proc/PID/smaps (VmRSS without its per-thread counter lag).
    pub rss: u64,
    /// Resident pages of the frontend's memory: mappings of the same files (device and
    /// inode) the client maps shared, i.e. the regions it handed over in SET_MEM_TABLE.
    pub guest_rss: u64,
    pub guest_pss: u64,
    /// The names of those mappings.
    pub guest_files: Vec<String>,
    /// Other shared mappings: the device's state files and the host budget counters.
    pub state_rss: u64,
    /// rss - guest_rss: the daemon's own memory in this process.
    pub own_rss: u64,
    pub own_pss: u64,
    /// Private_Clean + Private_Dirty outside guest RAM: what this process alone holds.
    pub own_private: u64,
    /// Resident file-backed private mappings (the binary and libraries) by path.
    pub file_rss: std::collections::BTreeMap<String, u64>,
    /// Page tables (VmPTE): kernel memory per process, not in RSS.
    pub page_tables: u64,
    pub threads: u64,
    pub fds: u64,
}

#[derive(Debug, Serialize)]
pub struct Connected {
    pub devices: usize,
    /// Workers found running (one per device expected).
    pub workers: usize,
    /// Connecting every device and doing its write and read, one after another.
    pub connect_s: f64,
    /// This test process's open-file limit (soft, hard) after raising it.
    pub client_nofile: (u64, u64),
    /// The supervisor before any frontend connected, and with all connected.
    pub supervisor_idle: ProcMem,
    pub supervisor: ProcMem,
    pub launcher_rss: Option<u64>,
    /// Every process of the daemon, all devices connected.
    pub tree: TreeUse,
    pub worker_rss_mean: f64,
    pub rss_anon_mean: f64,
    pub rss_file_mean: f64,
    pub rss_shmem_mean: f64,
    pub guest_rss_mean: f64,
    pub state_rss_mean: f64,
    pub own_rss_mean: f64,
    pub own_rss_max: u64,
    pub own_pss_mean: f64,
    pub own_private_mean: f64,
    pub page_tables_mean: f64,
    pub threads_mean: f64,
    pub fds_mean: f64,
    pub per_worker: Vec<WorkerMem>,
}

/// Connects a small client to every device, writes and reads back one page on each,
/// and measures the daemon's processes with all of them connected.
fn connect_all(env: &Env, many: &mut Many, supervisor_idle: ProcMem) -> Result<Connected> {
    let client_nofile = crate::sys::raise_nofile();
    let n = many.sockets.len();
    let t0 = Instant::now();
    let mut conns: Vec<Conn> = Vec::with_capacity(n);
    for (i, sock) in many.sockets.iter().enumerate() {
        if crate::sys::interrupted() {
            bail!("interrupted");
        }
        let mut c = Conn::connect_small(sock).context(format!("device {i}"))?;
        let want = device_page(i);
        let mut buf = want;
        page_io(&mut c, true, 0, &mut buf).context(format!("device {i}: write"))?;
        buf = [0u8; PAGE];
        page_io(&mut c, false, 0, &mut buf).context(format!("device {i}: read"))?;
        if buf != want {
            bail!("device {i}: read back other data than written");
        }
        conns.push(c);
    }
    let connect_s = t0.elapsed().as_secs_f64();
    let pids = worker_pids(&env.vzram_bin, &many.control, n, Duration::from_secs(10))?;
    // Let start-up allocations settle, and every worker publish its gauges once.
    std::thread::sleep(Duration::from_millis(1500));
    many.daemon.check_alive()?;
    let guest = crate::sys::client_shared_files()?;
    let sup = many.daemon.pid();
    let tree_pids = proc_tree(sup);
    let tree = tree_use(&tree_pids);
    let worker_set: HashSet<u32> = pids.iter().flatten().copied().collect();
    let launcher_rss = tree_pids
        .iter()
        .find(|&&p| p != sup && !worker_set.contains(&p) && proc_comm(p) == "vzram-launch")
        .and_then(|&p| proc_mem(p).ok())
        .map(|m| m.rss);
    let mut per_worker = Vec::new();
    for (device, pid) in pids.iter().enumerate() {
        let Some(pid) = *pid else { continue };
        if !tree_pids.contains(&pid) {
            eprintln!("density: worker {pid} of device {device} is not under the daemon");
        }
        per_worker.push(worker_mem(device, pid, &guest)?);
    }
    drop(conns);
    let w = per_worker.len().max(1) as f64;
    let mean = |f: fn(&WorkerMem) -> u64| per_worker.iter().map(|m| f(m) as f64).sum::<f64>() / w;
    Ok(Connected {
        devices: n,
        workers: per_worker.len(),
        connect_s,
        client_nofile,
        supervisor_idle,
        supervisor: proc_mem(sup)?,
        launcher_rss,
        tree,
        worker_rss_mean: mean(|m| m.rss),
        rss_anon_mean: mean(|m| m.status.rss_anon),
        rss_file_mean: mean(|m| m.status.rss_file),
        rss_shmem_mean: mean(|m| m.status.rss_shmem),
        guest_rss_mean: mean(|m| m.guest_rss),
        state_rss_mean: mean(|m| m.state_rss),
        own_rss_mean: mean(|m| m.own_rss),
        own_rss_max: per_worker.iter().map(|m| m.own_rss).max().unwrap_or(0),
        own_pss_mean: mean(|m| m.own_pss),
        own_private_mean: mean(|m| m.own_private),
        page_tables_mean: mean(|m| m.page_tables),
        threads_mean: mean(|m| m.threads),
        fds_mean: mean(|m| m.fds),
        per_worker,
    })
}

fn worker_mem(device: usize, pid: u32, guest: &HashSet<(String, u64)>) -> Result<WorkerMem> {
    let status = proc_mem(pid)?;
    let maps = proc_smaps(pid)?;
    let mut m = WorkerMem {
        device,
        pid,
        status,
        rss: 0,
        guest_rss: 0,
        guest_pss: 0,
        guest_files: Vec::new(),
        state_rss: 0,
        own_rss: 0,
        own_pss: 0,
        own_private: 0,
        file_rss: Default::default(),
        page_tables: crate::sys::proc_status_bytes(pid, "VmPTE").unwrap_or(0),
        threads: proc_threads(pid)?,
        fds: proc_fds(pid)?,
    };
    for map in &maps {
        m.rss += map.rss;
        if crate::sys::is_guest(map, guest) {
            m.guest_rss += map.rss;
            m.guest_pss += map.pss;
            if !m.guest_files.contains(&map.path) {
                m.guest_files.push(map.path.clone());
            }
            continue;
        }
        if map.shared {
            m.state_rss += map.rss;
        } else if map.inode != 0 && map.rss > 0 {
            *m.file_rss.entry(map.path.clone()).or_default() += map.rss;
        }
        m.own_pss += map.pss;
        m.own_private += map.private;
    }
    m.own_rss = m.rss - m.guest_rss;
    Ok(m)
}

/// Each device's worker pid from `vzram stat --json`, once every device has one
/// running (or the timeout passes: devices without one are None).
pub fn worker_pids(
    bin: &Path,
    control: &Path,
    n: usize,
    timeout: Duration,
) -> Result<Vec<Option<u32>>> {
    let t0 = Instant::now();
    loop {
        let st = crate::targets::vzram::stat(bin, control)?;
        let pids = crate::targets::vzram::worker_pids(&st);
        let running = pids.iter().filter(|p| p.is_some()).count();
        if (pids.len() == n && running == n) || t0.elapsed() > timeout {
            if running < n {
                eprintln!("density: {running} of {n} devices have a running worker");
            }
            return Ok(pids);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
