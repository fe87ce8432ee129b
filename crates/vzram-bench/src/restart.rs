//! Worker restart: how long a VM's disk is gone when its worker process dies.
//!
//! One daemon per data size, one device holding that much data (written through a
//! client, corpus pages), a small client connected. Each round:
//!
//! 1. **kill**: SIGKILL the device's worker (pid from `vzram stat --json`), close the
//!    old client as a VMM does when its socket dies, and time from the kill until a
//!    new connection has completed its first 4 KiB read (checked against what was
//!    written). The supervisor waits before a device's next worker after a failure
//!    (100 ms for a first failure, doubling), so this includes that wait.
//! 2. **reconnect**: close that client cleanly (its worker exits normally, which also
//!    clears the failure count, so the next kill is a first failure again) and time
//!    until a new connection's first read: a new worker without the backoff.
//!
//! The new worker recovers the device from its slot table, hence two data sizes.

use crate::cli::RestartArgs;
use crate::client::{page_io, run_queue, Bitmap, Conn, WorkerCfg, PREFILL_DEPTH};
use crate::data::{Corpus, PAGE};
use crate::error::{bail, Context, Result};
use crate::job::OpGen;
use crate::measure::Window;
use crate::report::JsonOut;
use crate::targets::vzram::{self, worker_status, DeviceSpec, Many};
use crate::targets::Env;
use crate::units::format_size;
use serde::Serialize;
use std::path::Path;
use std::time::{Duration, Instant};

/// Milliseconds of the rounds of one kind, and their summary.
#[derive(Debug, Default, Serialize)]
pub struct Times {
    /// Until the new connection's handshake completed (`blkio_connect` + start).
    pub connect_ms: Vec<f64>,
    /// Until its first 4 KiB read completed.
    pub first_read_ms: Vec<f64>,
    pub median_ms: f64,
    pub p90_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    pub connect_median_ms: f64,
}

impl Times {
    fn push(&mut self, connect: Duration, read: Duration) {
        self.connect_ms.push(connect.as_secs_f64() * 1e3);
        self.first_read_ms.push(read.as_secs_f64() * 1e3);
    }

    fn summarize(&mut self) {
        self.median_ms = median(&self.first_read_ms);
        self.p90_ms = nearest_rank(&self.first_read_ms, 0.9);
        self.min_ms = nearest_rank(&self.first_read_ms, 0.0);
        self.max_ms = nearest_rank(&self.first_read_ms, 1.0);
        self.connect_median_ms = median(&self.connect_ms);
    }
}

/// The middle value (the mean of the two middle ones for an even count).
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// The smallest value with at least a fraction `q` of the values at or below it.
fn nearest_rank(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

#[derive(Debug, Serialize)]
pub struct RestartResult {
    pub record: String,
    pub data_bytes: u64,
    pub dev_size: u64,
    pub corpus: String,
    pub fill_s: f64,
    /// `vzram stat` after the fill: orig_data_size and mem_used_total of the pool.
    pub orig_data_size: u64,
    pub mem_used_total: u64,
    pub kill: Times,
    pub reconnect: Times,
    /// The device's `failing` count right after each kill's reconnect (1 = a first
    /// failure, 100 ms backoff).
    pub failing_after_kill: Vec<u64>,
    /// Each worker's recovery of the device from its slot table, from the daemon's log
    /// ("recovered the device from its state ... ms=X"), for every worker after the
    /// fill: the part of a restart that grows with the data.
    pub recovery_ms: Vec<f64>,
    pub recovery_median_ms: f64,
    /// Workers started and failures, from `vzram stat` at the end.
    pub workers_started: u64,
    pub failures: u64,
    pub load_1m: Option<f64>,
    pub unix_time: u64,
}

pub fn run(env: &Env, args: &RestartArgs, mut json: Option<JsonOut>) -> Result<Vec<RestartResult>> {
    let mut out = Vec::new();
    for &data in &args.data {
        if crate::sys::interrupted() {
            break;
        }
        if data > args.dev_size {
            bail!(
                "--data {} does not fit a {} device (--dev-size)",
                format_size(data),
                format_size(args.dev_size)
            );
        }
        let r = one_size(env, args, data)?;
        eprintln!(
            "restart: {} stored: kill -> first read median {:.1} ms (p90 {:.1}); clean \
             reconnect median {:.1} ms (p90 {:.1})",
            format_size(data),
            r.kill.median_ms,
            r.kill.p90_ms,
            r.reconnect.median_ms,
            r.reconnect.p90_ms
        );
        if let Some(j) = json.as_mut() {
            j.write(&r)?;
        }
        out.push(r);
    }
    Ok(out)
}

/// Connect, then read `page` and compare it with the corpus: returns (connected, read)
/// as times since `t0`, and the connection.
fn connect_and_read(
    socket: &Path,
    corpus: &Corpus,
    page: u64,
    t0: Instant,
) -> Result<(Conn, Duration, Duration)> {
    let mut c = Conn::connect_small(socket).context("reconnecting")?;
    let connected = t0.elapsed();
    let mut buf = [0u8; PAGE];
    page_io(&mut c, false, page * PAGE as u64, &mut buf).context("first read")?;
    let read = t0.elapsed();
    if buf[..] != *corpus.page(page) {
        bail!("page {page} read back other data than was written");
    }
    Ok((c, connected, read))
}

/// The device's running worker: its pid and the device's failure count. With
/// `clear`, also waits (up to 5 s) for that count to be 0.
fn running_worker(env: &Env, control: &Path, clear: bool) -> Result<(u32, u64)> {
    let t0 = Instant::now();
    loop {
        let st = vzram::stat(&env.vzram_bin, control)?;
        let w = vzram::worker(&st, 0);
        if let (true, Some(pid)) = (w.running, w.pid) {
            if !clear || w.failing == 0 || t0.elapsed() > Duration::from_secs(5) {
                return Ok((pid, w.failing));
            }
        }
        if t0.elapsed() > Duration::from_secs(10) {
            bail!(
                "no running worker after 10 s: {}",
                worker_status(&st, 0)
                    .map(|w| format!("{w:?}"))
                    .unwrap_or_else(|| "no device 0 in the stat".into())
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn one_size(env: &Env, args: &RestartArgs, data: u64) -> Result<RestartResult> {
    let tag = format!("restart-{}", format_size(data));
    let socket = env.work_dir.join(&tag).join("d0.sock");
    let dev = DeviceSpec {
        socket: socket.clone(),
        size: args.dev_size,
        queues: 1,
    };
    eprintln!("restart: filling {} ...", format_size(data));
    let mut many = Many::start(env, &tag, vec![dev], false, Duration::from_secs(30))?;
    let load_1m = crate::sys::load_1m();
    let corpus = &env.corpus;

    // Fill [0, data) with corpus pages through one ordinary client.
    let t_fill = Instant::now();
    {
        let mut c = Conn::connect(&socket, 1, PREFILL_DEPTH, PAGE as u64, false)?;
        let bufs = c.buffers();
        let gen = OpGen::fill_once(0, data, c.prefill_chunk);
        let cfg = WorkerCfg {
            queue_index: 0,
            iodepth: PREFILL_DEPTH,
            corpus,
            verify: false,
            allow_zero: true,
            slice_start: 0,
            think: std::time::Duration::ZERO,
        };
        let mut written = Bitmap::new(data);
        run_queue(
            &mut c.queues[0],
            bufs,
            &cfg,
            gen,
            Window::exhaust(Instant::now()),
            &mut written,
        )
        .context("filling the device")?;
        if written.count() * PAGE as u64 != data {
            bail!("the fill wrote {} pages", written.count());
        }
    }
    let fill_s = t_fill.elapsed().as_secs_f64();
    // The filling worker recovered an empty device: its recovery is not counted.
    let log_path = many.daemon.log.clone();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let skip = recovery_times(&log()).len();
    let mut held = Conn::connect_small(&socket)?;
    running_worker(env, &many.control, false)?;
    let st = vzram::stat(&env.vzram_bin, &many.control)?;
    let sizes = vzram::sizes(&st);
    let (orig_data_size, mem_used_total) = (sizes.orig_data_size, sizes.mem_used_total);
    if orig_data_size < data {
        bail!("vzram stat says {orig_data_size} bytes stored after writing {data}");
    }

    let pages = data / PAGE as u64;
    let mut kill = Times::default();
    let mut reconnect = Times::default();
    let mut failing_after_kill = Vec::new();
    for rep in 0..args.repeat {
        if crate::sys::interrupted() {
            bail!("interrupted");
        }
        // Spread the first reads over the data (a different page each round).
        let page = (rep as u64 * 7919) % pages;
        let (pid, failing) = running_worker(env, &many.control, true)?;
        if failing != 0 {
            eprintln!("restart: round {rep}: the device still counts {failing} failures");
        }
        let t0 = Instant::now();
        // SAFETY: kill(2) has no memory effects; `pid` is the worker the daemon reports
        // as running for our device (a process of our daemon's tree).
        if unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) } != 0 {
            bail!("kill {pid}: {}", std::io::Error::last_os_error());
        }
        drop(held);
        let (c, connected, read) = connect_and_read(&socket, corpus, page, t0)
            .context(format!("round {rep}, after killing worker {pid}"))?;
        kill.push(connected, read);
        // A page far from the first one, outside the timing: the data survived.
        let mut buf = [0u8; PAGE];
        let mut c = c;
        let last = pages - 1 - page;
        page_io(&mut c, false, last * PAGE as u64, &mut buf)?;
        if buf[..] != *corpus.page(last) {
            bail!("round {rep}: page {last} differs after the restart");
        }
        let (new_pid, failing) = running_worker(env, &many.control, false)?;
        if new_pid == pid {
            bail!("round {rep}: worker {pid} still reported after SIGKILL");
        }
        failing_after_kill.push(failing);

        // Clean disconnect and reconnect: a new worker, no failure, no backoff.
        linger(connected_at(t0, connected));
        let t0 = Instant::now();
        drop(c);
        let (c, connected, read) = connect_and_read(&socket, corpus, page, t0)
            .context(format!("round {rep}, clean reconnect"))?;
        reconnect.push(connected, read);
        held = c;
        linger(connected_at(t0, connected));
        many.daemon.check_alive()?;
    }
    drop(held);
    kill.summarize();
    reconnect.summarize();
    let st = vzram::stat(&env.vzram_bin, &many.control)?;
    let w = vzram::worker(&st, 0);
    let recovery_ms: Vec<f64> = recovery_times(&log()).into_iter().skip(skip).collect();
    Ok(RestartResult {
        record: "restart".into(),
        data_bytes: data,
        dev_size: args.dev_size,
        corpus: corpus.name.clone(),
        fill_s,
        orig_data_size,
        mem_used_total,
        kill,
        reconnect,
        failing_after_kill,
        recovery_median_ms: median(&recovery_ms),
        recovery_ms,
        workers_started: w.started,
        failures: w.failures,
        load_1m,
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    })
}

/// How long each connection is kept before the next kill or disconnect. A
/// worker that ends before it served a second (the supervisor's
/// `USEFUL_LIFE`) keeps its device's failure count and delays the next, as
/// against a frontend that connects and leaves in a loop; a VM's worker
/// serves far longer. Past this, every kill is a first failure and every
/// clean end starts the count afresh, as on a host.
const SERVE_FOR: Duration = Duration::from_millis(1100);

/// When a connection timed from `t0` completed its handshake.
fn connected_at(t0: Instant, connected: Duration) -> Instant {
    t0 + connected
}

/// Sleeps until the worker connected at `at` has served [`SERVE_FOR`].
fn linger(at: Instant) {
    if let Some(left) = SERVE_FOR.checked_sub(at.elapsed()) {
        std::thread::sleep(left);
    }
}

/// The `ms=` of each worker's "recovered the device from its state" log line.
fn recovery_times(log: &str) -> Vec<f64> {
    let log = crate::sys::strip_ansi(log);
    log.lines()
        .filter(|l| l.contains("worker") && l.contains("recovered the device from its state"))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("ms="))
                .and_then(|v| v.parse().ok())
        })
        .collect()
}

pub fn print_table(rs: &[RestartResult]) {
    println!(
        "| data written | stored (pool) | rounds | kill → first read: median ms | p90 ms | min–max ms | of which connect (median) | clean reconnect → first read: median ms | p90 ms | min–max ms | recovery in the worker (median ms) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rs {
        println!(
            "| {} | {:.1} MiB | {} | **{:.1}** | {:.1} | {:.1}–{:.1} | {:.1} | **{:.1}** | {:.1} | {:.1}–{:.1} | {:.2} |",
            format_size(r.data_bytes),
            r.mem_used_total as f64 / 1048576.0,
            r.kill.first_read_ms.len(),
            r.kill.median_ms,
            r.kill.p90_ms,
            r.kill.min_ms,
            r.kill.max_ms,
            r.kill.connect_median_ms,
            r.reconnect.median_ms,
            r.reconnect.p90_ms,
            r.reconnect.min_ms,
            r.reconnect.max_ms,
            r.recovery_median_ms,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_ranks() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(median(&v), 5.5);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(nearest_rank(&v, 0.9), 9.0);
        assert_eq!(nearest_rank(&v, 0.0), 1.0);
        assert_eq!(nearest_rank(&v, 1.0), 10.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn reads_recovery_times_from_the_log() {
        let log = "\x1b[2m2026-11-30T23:54:06Z\x1b[0m INFO vzram::daemon: new device state device=vzram0\n\
                   2026-11-30T23:54:06Z INFO worker{device=vzram0}: vzram::worker: recovered the \
                   device from its state pages=0 spans=0 cut_short=0 ms=0.009\n\
                   2026-11-30T23:54:07Z INFO \x1b[3mworker\x1b[0m{device=vzram0}: vzram::worker: \
                   recovered the device from its state pages=5 spans=1 cut_short=0 \x1b[3mms\x1b[0m=6.5\n";
        assert_eq!(recovery_times(log), vec![0.009, 6.5]);
    }
}
