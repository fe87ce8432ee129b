//! A guest's swap test, timed: what a user feels.
//!
//! The e2e swap scenario (`tests/e2e.rs`, `swap_under_pressure`) booted against each
//! target in turn: the test guest of `contrib/guest` (QEMU, TCG, 2 vCPUs) swaps 1.5x
//! its RAM through the target's vhost-user-blk socket for `--rounds` rounds, every
//! page checked, and powers off. Per boot: the guest's own seconds for the swap test
//! (`VZRAM-TIME`) and for its pressure (`PRESSURE ... secs=`), QEMU's wall time from
//! start to exit and its CPU time, and the daemon's CPU time over the boot (all its
//! processes). Under TCG the guest's CPU dominates the wall time; the daemon's CPU
//! says what the disk itself cost.

use crate::cli::GuestArgs;
use crate::error::{bail, Context, Result};
use crate::report::{median, JsonOut};
use crate::sys::{self, interrupted};
use crate::targets::{start_block, BlockTarget, Env, Kind, TargetSpec};
use crate::units::format_size;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One boot of the guest against one target; one JSON line each.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GuestResult {
    /// "guest" (the file may hold "run" records too; `report` skips these).
    pub record: String,
    pub target: String,
    pub target_kind: String,
    pub algo: Option<String>,
    pub rep: u32,
    pub size: u64,
    pub queues: u32,
    pub mem: u64,
    pub rounds: u32,
    /// The guest's `VZRAM-TIME test=swap secs=`: mkswap to swapoff, by its clock.
    pub swap_test_s: f64,
    /// The guest's `PRESSURE ... secs=`: the pressure rounds alone.
    pub pressure_s: f64,
    /// The guest's `GUEST ... boot_secs=`: its uptime once the disk was there.
    pub boot_s: f64,
    /// Host wall time from starting `run.sh` (a cache check of ~15 ms, then it execs
    /// QEMU) to QEMU's exit.
    pub qemu_wall_s: f64,
    /// QEMU's CPU time (all its threads: the vCPUs are TCG threads).
    pub qemu_cpu_s: f64,
    /// The daemon's CPU time over the boot: all its processes and threads, workers
    /// that have exited included.
    pub daemon_cpu_s: f64,
    pub pressure_mib: u64,
    pub pages: u64,
    pub mem_total_kb: u64,
    pub pswpin: u64,
    pub pswpout: u64,
    pub load_1m: Option<f64>,
    pub unix_time: u64,
}

/// The "guest" records of a --json file (other records are skipped).
pub fn load(path: &Path) -> Result<Vec<GuestResult>> {
    let text = std::fs::read_to_string(path).context(format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let v: serde_json::Value =
            serde_json::from_str(line).context(format!("{}:{}", path.display(), n + 1))?;
        if v.get("record").and_then(|r| r.as_str()) == Some("guest") {
            out.push(serde_json::from_value(v).context(format!("{}:{}", path.display(), n + 1))?);
        }
    }
    Ok(out)
}

/// What the guest reported, from its console.
#[derive(Clone, Debug, PartialEq)]
pub struct Console {
    pub swap_test_s: f64,
    pub pressure_s: f64,
    pub boot_s: f64,
    pub pressure_mib: u64,
    pub pages: u64,
    pub mem_total_kb: u64,
    pub pswpin: u64,
    pub pswpout: u64,
}

/// The `k=v` words of the first line that starts with `prefix`.
fn fields<'a>(lines: &'a [String], prefix: &str) -> Option<(&'a str, BTreeMap<&'a str, &'a str>)> {
    let l = lines.iter().find(|l| l.starts_with(prefix))?;
    Some((
        l.as_str(),
        l.split_whitespace()
            .filter_map(|w| w.split_once('='))
            .collect(),
    ))
}

fn field<T: std::str::FromStr>(
    lines: &[String],
    prefix: &str,
    key: &str,
) -> std::result::Result<T, String> {
    let (line, f) =
        fields(lines, prefix).ok_or_else(|| format!("the guest printed no {prefix:?} line"))?;
    f.get(key)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no number {key}= in the guest's line {line:?}"))
}

/// Check a swap test's console and read its numbers. Fails, naming the line, unless
/// the guest finished (`VZRAM-GUEST-DONE rc=0`), the swap test passed (`VZRAM-TIME
/// ... rc=0`), no page came back wrong (`mismatches=0`, no `-MISMATCH` line), and the
/// guest swapped both ways, as the e2e test requires.
pub fn parse_console(lines: &[String]) -> Result<Console> {
    if let Some(l) = lines.iter().find(|l| {
        l.starts_with("VZRAM-GUEST-FAIL")
            || l.contains("-MISMATCH ")
            || l.starts_with("PRESSURE FAIL")
    }) {
        bail!("the guest reported a failure: {l:?}");
    }
    let done: i64 = field(lines, "VZRAM-GUEST-DONE ", "rc")
        .map_err(|_| "the guest did not finish (no VZRAM-GUEST-DONE line)")?;
    let rc: i64 = field(lines, "VZRAM-TIME test=swap ", "rc")?;
    if rc != 0 || done != 0 {
        bail!("the guest's swap test failed: swap rc={rc}, guest rc={done}");
    }
    let mismatches: u64 = field(lines, "PRESSURE rounds=", "mismatches")?;
    if mismatches != 0 {
        bail!("{mismatches} pages came back wrong from swap");
    }
    let c = Console {
        swap_test_s: field(lines, "VZRAM-TIME test=swap ", "secs")?,
        pressure_s: field(lines, "PRESSURE rounds=", "secs")?,
        boot_s: field(lines, "GUEST ", "boot_secs")?,
        pressure_mib: field(lines, "PRESSURE rounds=", "mib")?,
        pages: field(lines, "PRESSURE rounds=", "pages")?,
        mem_total_kb: field(lines, "GUEST ", "mem_total_kb")?,
        pswpin: field(lines, "SWAP pswpin=", "pswpin")?,
        pswpout: field(lines, "SWAP pswpin=", "pswpout")?,
    };
    if c.pswpout == 0 || c.pswpin == 0 {
        bail!(
            "the guest did not swap both ways (pswpout={}, pswpin={}): nothing was measured",
            c.pswpout,
            c.pswpin
        );
    }
    Ok(c)
}

/// `--run-sh`, else contrib/guest/run.sh here, else in the tree this was built from.
fn run_sh(arg: Option<&Path>) -> PathBuf {
    if let Some(p) = arg {
        return p.to_path_buf();
    }
    let here = PathBuf::from("contrib/guest/run.sh");
    if here.is_file() {
        return here;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../contrib/guest/run.sh")
}

fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Fail early, with the fix in the message, when the guest cannot be booted.
fn check(script: &Path) -> Result<()> {
    if !script.is_file() {
        bail!(
            "{} not found (run from the vzram source tree or pass --run-sh)",
            script.display()
        );
    }
    let qemu = std::env::var("QEMU").unwrap_or_else(|_| "qemu-system-x86_64".into());
    if sys::find_program(Path::new(&qemu)).is_none() {
        bail!("{qemu} not found (apt-get install qemu-system-x86)");
    }
    // run.sh builds the guest on first use (apt, a kernel download); do that once,
    // here, so no boot's time includes it.
    let build = script.with_file_name("build.sh");
    let out = Command::new(&build)
        .stdin(Stdio::null())
        .output()
        .context(format!("running {}", build.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed ({}): {}",
            build.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

pub fn run(env: &Env, args: &GuestArgs, mut json: Option<JsonOut>) -> Result<Vec<GuestResult>> {
    let mut targets: Vec<TargetSpec> = crate::targets::parse_targets(&args.targets, args.algo)?;
    if let Some(t) = targets.iter().find(|t| t.kind == Kind::Codec) {
        bail!("--targets: {} has no socket for a guest", t.label());
    }
    for (t, why) in crate::targets::skipped(&targets) {
        eprintln!("{}: skipped: {why}", t.label());
        targets.retain(|x| *x != t);
    }
    if targets.is_empty() {
        bail!("no target left to run");
    }
    env.check(&targets)?;
    let script = run_sh(args.run_sh.as_deref());
    check(&script)?;
    let repeat = args.repeat.max(1);
    let total = targets.len() * repeat as usize;
    let mut done = 0;
    let mut results = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    'outer: for rep in 0..repeat {
        for t in &targets {
            if interrupted() {
                failures.push("interrupted".into());
                break 'outer;
            }
            done += 1;
            let tag = format!(
                "[{done}/{total}] {} guest swap rep {}/{repeat}",
                t.label(),
                rep + 1
            );
            eprintln!("{tag} ...");
            match one(env, args, &script, t, rep, done) {
                Ok(r) => {
                    eprintln!(
                        "{tag}: swap test {:.1} s (pressure {:.1} s), QEMU wall {:.1} s, \
                         QEMU CPU {:.1} s, daemon CPU {:.2} s, load {:.1}",
                        r.swap_test_s,
                        r.pressure_s,
                        r.qemu_wall_s,
                        r.qemu_cpu_s,
                        r.daemon_cpu_s,
                        r.load_1m.unwrap_or(f64::NAN)
                    );
                    if let Some(j) = json.as_mut() {
                        j.write(&r)?;
                    }
                    results.push(r);
                }
                Err(e) => {
                    eprintln!("{tag}: FAILED: {e}");
                    failures.push(format!("{tag}: {e}"));
                }
            }
        }
    }
    if !failures.is_empty() {
        print_table(&results);
        bail!(
            "{} of {total} guest runs failed; first: {}",
            failures.len(),
            failures[0]
        );
    }
    Ok(results)
}

/// A guest's console, one line per console line, also written to a log file.
fn reader<R: Read + Send + 'static>(
    r: R,
    prefix: &'static str,
    lines: Arc<Mutex<Vec<String>>>,
    log: Arc<Mutex<File>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(r);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            // Kernel lines end in \r\n, the guest's own in \n.
            let line = String::from_utf8_lossy(&buf);
            let line = format!("{prefix}{}", line.trim_matches(['\n', '\r']));
            if let Ok(mut f) = log.lock() {
                let _ = writeln!(f, "{line}");
            }
            lines.lock().unwrap_or_else(|e| e.into_inner()).push(line);
        }
    })
}

/// The daemon's CPU over the tree once its numbers stop moving: after QEMU left, a
/// vzram worker finishes and is reaped by its launcher, and its time only then
/// lands in the launcher's children's time. Sampled until two readings agree.
fn settled_cpu(pid: u32) -> Result<Duration> {
    let mut last = sys::tree_cpu_total(pid)?;
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(100));
        let now = sys::tree_cpu_total(pid)?;
        if now == last {
            break;
        }
        last = now;
    }
    Ok(last)
}

/// Boot the guest once against a fresh daemon of target `t`.
fn one(
    env: &Env,
    args: &GuestArgs,
    script: &Path,
    t: &TargetSpec,
    rep: u32,
    seq: usize,
) -> Result<GuestResult> {
    let load_1m = sys::load_1m();
    let mut target = start_block(env, t, args.queues, args.size, seq)?;
    let r = boot(env, args, script, t, target.as_mut(), seq);
    // A daemon that died explains a failed boot better than the console does.
    let alive = target.daemon().check_alive();
    drop(target);
    if matches!(t.kind, Kind::Vzram | Kind::VzramBase) {
        remove_own_state();
    }
    let (console, wall, qemu_cpu, daemon_cpu) = match (alive, r) {
        (Err(e), _) | (Ok(()), Err(e)) => return Err(e),
        (Ok(()), Ok(v)) => v,
    };
    Ok(GuestResult {
        record: "guest".into(),
        target: t.label(),
        target_kind: t.kind.name().into(),
        algo: (t.kind != Kind::Qsd).then(|| t.algo.to_string()),
        rep,
        size: args.size,
        queues: args.queues,
        mem: args.mem,
        rounds: args.rounds,
        swap_test_s: console.swap_test_s,
        pressure_s: console.pressure_s,
        boot_s: console.boot_s,
        qemu_wall_s: wall.as_secs_f64(),
        qemu_cpu_s: qemu_cpu.as_secs_f64(),
        daemon_cpu_s: daemon_cpu.as_secs_f64(),
        pressure_mib: console.pressure_mib,
        pages: console.pages,
        mem_total_kb: console.mem_total_kb,
        pswpin: console.pswpin,
        pswpout: console.pswpout,
        load_1m,
        unix_time: unix_time(),
    })
}

/// The vzram state this run's daemons kept (`$VZRAM_STATE_DIR`, set by `main` to a
/// directory of this invocation's on tmpfs): a daemon recreates it, so each boot
/// leaves no pool behind in memory. A directory the caller chose is left alone.
fn remove_own_state() {
    if let Some(dir) = std::env::var_os("VZRAM_STATE_DIR").map(PathBuf::from) {
        let ours = format!("vzram-bench-state-{}", std::process::id());
        if dir.file_name().is_some_and(|n| n == ours.as_str()) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Run the guest to its power-off: (console, QEMU wall, QEMU CPU, daemon CPU).
fn boot(
    env: &Env,
    args: &GuestArgs,
    script: &Path,
    t: &TargetSpec,
    target: &mut dyn BlockTarget,
    seq: usize,
) -> Result<(Console, Duration, Duration, Duration)> {
    let daemon_pid = target.daemon().pid();
    let log_path = env.work_dir.join(format!("guest-{seq}.log"));
    let log = Arc::new(Mutex::new(
        File::create(&log_path).context(format!("creating {}", log_path.display()))?,
    ));
    let lines = Arc::new(Mutex::new(Vec::new()));
    let mut cmd = Command::new(script);
    // As tests/e2e.rs boots its swap test (its GuestOpts defaults: reconnect 1).
    cmd.arg("--socket")
        .arg(target.socket())
        .args(["--queues", &args.queues.to_string()])
        .args(["--mem", &format_size(args.mem)])
        .args(["--test", "swap", "--reconnect", "1"])
        .args(["--append", &format!("vzram.rounds={}", args.rounds)])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let cpu0 = sys::tree_cpu_total(daemon_pid)?;
    let t0 = Instant::now();
    let mut child = cmd
        .spawn()
        .context(format!("starting {}", script.display()))?;
    let readers = [
        reader(child.stdout.take().unwrap(), "", lines.clone(), log.clone()),
        reader(
            child.stderr.take().unwrap(),
            "qemu-stderr: ",
            lines.clone(),
            log,
        ),
    ];
    // run.sh execs QEMU, so the child is QEMU. It is not waited for until it has
    // exited (state Z), so its CPU time can still be read.
    let pid = child.id();
    let timeout = Duration::from_secs_f64(args.timeout);
    let mut last_check = Instant::now();
    let mut failed = None;
    let (wall, qemu_cpu) = loop {
        if sys::proc_state(pid).is_none_or(|s| s == 'Z') {
            break (t0.elapsed(), sys::proc_cpu(pid).unwrap_or_default());
        }
        if interrupted() {
            failed = Some("interrupted".to_string());
        } else if t0.elapsed() > timeout {
            failed = Some(format!("the guest did not power off within {timeout:?}"));
        } else if last_check.elapsed() > Duration::from_millis(500) {
            last_check = Instant::now();
            // With reconnect on, QEMU would wait for a dead daemon for ever.
            if let Err(e) = target.daemon().check_alive() {
                failed = Some(e.0);
            }
        }
        if failed.is_some() {
            let _ = child.kill();
            break (t0.elapsed(), Duration::ZERO);
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let status = child.wait()?;
    for r in readers {
        let _ = r.join();
    }
    let console = std::mem::take(&mut *lines.lock().unwrap_or_else(|e| e.into_inner()));
    if let Some(f) = failed {
        bail!("{}: {f} (console in {})", t.label(), log_path.display());
    }
    let console =
        parse_console(&console).map_err(|e| format!("{e} (console in {})", log_path.display()))?;
    if !status.success() {
        bail!(
            "QEMU exited with {status} (console in {})",
            log_path.display()
        );
    }
    let daemon_cpu = settled_cpu(daemon_pid)?.saturating_sub(cpu0);
    Ok((console, wall, qemu_cpu, daemon_cpu))
}

/// How one number is read from a result.
type Metric = fn(&GuestResult) -> f64;

/// The daemon's CPU per page the guest swapped out or in, µs.
fn cpu_per_page(r: &GuestResult) -> f64 {
    r.daemon_cpu_s * 1e6 / (r.pswpin + r.pswpout).max(1) as f64
}

/// The numbers compared.
const METRICS: [(&str, Metric); 6] = [
    ("swap test s (guest)", |r| r.swap_test_s),
    ("pressure s (guest)", |r| r.pressure_s),
    ("QEMU wall s (host)", |r| r.qemu_wall_s),
    ("QEMU CPU s", |r| r.qemu_cpu_s),
    ("daemon CPU s", |r| r.daemon_cpu_s),
    ("daemon CPU µs / swapped page", cpu_per_page),
];

/// Targets in first-seen order.
fn labels(rs: &[GuestResult]) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for r in rs {
        if !v.contains(&r.target) {
            v.push(r.target.clone());
        }
    }
    v
}

fn med(rs: &[GuestResult], target: &str, f: Metric) -> f64 {
    median(rs.iter().filter(|r| r.target == target).map(f).collect())
}

/// `target`'s value over qsd's, per repeat (the two boots of one round).
fn pair_ratios(rs: &[GuestResult], target: &str, f: Metric) -> Vec<f64> {
    rs.iter()
        .filter(|r| r.target == target)
        .filter_map(|r| {
            rs.iter()
                .find(|q| q.target_kind == "qsd" && q.rep == r.rep)
                .map(|q| f(r) / f(q))
        })
        .collect()
}

pub fn print_table(rs: &[GuestResult]) {
    let ts = labels(rs);
    if ts.is_empty() {
        return;
    }
    println!("| target | boots | swap test s (guest) | pressure s (guest) | QEMU wall s | QEMU CPU s | daemon CPU s | daemon CPU µs / swapped page | guest boot s | load (1 min) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for t in &ts {
        println!(
            "| {t} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.1} |",
            rs.iter().filter(|r| &r.target == t).count(),
            med(rs, t, |r| r.swap_test_s),
            med(rs, t, |r| r.pressure_s),
            med(rs, t, |r| r.qemu_wall_s),
            med(rs, t, |r| r.qemu_cpu_s),
            med(rs, t, |r| r.daemon_cpu_s),
            med(rs, t, cpu_per_page),
            med(rs, t, |r| r.boot_s),
            med(rs, t, |r| r.load_1m.unwrap_or(f64::NAN)),
        );
    }
    println!();
    let Some(qsd) = ts.iter().find(|t| *t == "qsd") else {
        return;
    };
    for t in ts.iter().filter(|t| *t != qsd) {
        // Each round boots both targets back to back, so a pair shares the machine's
        // load of the moment; the median of the pairs resists drift between rounds.
        println!("| {t} / qsd | ratio of medians | per-pair ratios: median (min–max) |");
        println!("|---|---:|---:|");
        for (name, f) in METRICS {
            let p = pair_ratios(rs, t, f);
            let range = if p.is_empty() {
                "-".to_string()
            } else {
                let lo = p.iter().cloned().fold(f64::INFINITY, f64::min);
                let hi = p.iter().cloned().fold(0.0, f64::max);
                format!("{:.3}× ({lo:.3}–{hi:.3})", median(p.clone()))
            };
            println!(
                "| {name} | {:.3}× | {range} |",
                med(rs, t, f) / med(rs, qsd, f)
            );
        }
        println!();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A swap test's console as the guest prints it (kernel lines trimmed of \r).
    const OK: &str = "\
[    0.000000] Linux version 6.1.0-57-cloud-amd64
GUEST kernel=6.1.0-57-cloud-amd64 mem_total_kb=223420 cpus=2 boot_secs=2.17
UDEV running=1 rotational=0 serial=vzram-vzram0
SWAP start mib=327 rounds=2 mem_total_kb=223420 discard=0 rotational=0
PRESSURE-ROUND pass=0 fill pages=83712 mismatches=0 secs=9.1
PRESSURE-ROUND pass=1 verify+rewrite pages=83712 mismatches=0 secs=9.6
PRESSURE-ROUND pass=2 verify pages=83712 mismatches=0 secs=6.5
PRESSURE rounds=2 pages=83712 mib=327 mismatches=0 secs=25.2
SWAPS /dev/vda                                partition\t1048572\t215000\t-2
SWAP pswpin=140000 pswpout=190000 swap_total_kb=1048572 swap_free_kb=833572
VZRAM-TIME test=swap secs=28.8 rc=0
VZRAM-GUEST-DONE rc=0
[   31.100000] reboot: Power down
";

    fn lines(s: &str) -> Vec<String> {
        s.lines().map(str::to_string).collect()
    }

    fn edit(from: &str, to: &str) -> Vec<String> {
        assert!(OK.contains(from), "{from}");
        lines(&OK.replace(from, to))
    }

    #[test]
    fn reads_a_passing_swap_test() {
        let c = parse_console(&lines(OK)).unwrap();
        assert_eq!(
            c,
            Console {
                swap_test_s: 28.8,
                pressure_s: 25.2,
                boot_s: 2.17,
                pressure_mib: 327,
                pages: 83712,
                mem_total_kb: 223420,
                pswpin: 140000,
                pswpout: 190000,
            }
        );
    }

    #[test]
    fn rejects_failed_or_wrong_runs() {
        let cases = [
            // Pages read back wrong: the summary's count, or a mismatch line alone.
            (
                edit("mib=327 mismatches=0", "mib=327 mismatches=3"),
                "3 pages came back wrong",
            ),
            (
                edit(
                    "PRESSURE rounds=2",
                    "PRESSURE-MISMATCH page=7 round=0 seed=1 first_bad_off=0 \
                     want_kind=text got_magic=no got_index=0 got_round=0 got_seed=0\n\
                     PRESSURE rounds=2",
                ),
                "reported a failure",
            ),
            // The scenario or the guest failed.
            (
                edit("secs=28.8 rc=0", "secs=28.8 rc=1"),
                "swap test failed: swap rc=1",
            ),
            (edit("DONE rc=0", "DONE rc=1"), "guest rc=1"),
            (
                edit("VZRAM-GUEST-DONE rc=0", "VZRAM-GUEST-FAIL test=swap rc=1"),
                "reported a failure",
            ),
            // Killed before the end (no DONE), or no pressure summary at all.
            (edit("VZRAM-GUEST-DONE rc=0\n", ""), "did not finish"),
            (
                edit(
                    "PRESSURE rounds=2 pages=83712 mib=327 mismatches=0 secs=25.2\n",
                    "",
                ),
                "no \"PRESSURE rounds=\" line",
            ),
            // A swap test that never swapped measured nothing.
            (edit("pswpin=140000", "pswpin=0"), "did not swap both ways"),
        ];
        for (console, want) in cases {
            let e = parse_console(&console).unwrap_err().0;
            assert!(e.contains(want), "{e:?} should say {want:?}");
        }
        // The OOM killer ended the pressure (rc 137): swap did not absorb it.
        let oom = edit("SWAPS /dev/vda", "PRESSURE FAIL rc=137\nSWAPS /dev/vda");
        assert!(parse_console(&oom)
            .unwrap_err()
            .0
            .contains("reported a failure"));
    }

    fn result(target: &str, rep: u32, swap: f64, cpu: f64) -> GuestResult {
        GuestResult {
            record: "guest".into(),
            target: target.into(),
            target_kind: target.split('/').next().unwrap().into(),
            algo: None,
            rep,
            size: 1 << 30,
            queues: 2,
            mem: 256 << 20,
            rounds: 2,
            swap_test_s: swap,
            pressure_s: swap - 3.0,
            boot_s: 2.0,
            qemu_wall_s: swap + 4.0,
            qemu_cpu_s: 2.0 * swap,
            daemon_cpu_s: cpu,
            pressure_mib: 327,
            pages: 83712,
            mem_total_kb: 223420,
            pswpin: 1,
            pswpout: 1,
            load_1m: None,
            unix_time: 0,
        }
    }

    #[test]
    fn pairs_ratios_by_repeat() {
        let rs = [
            result("vzram/lz4", 0, 30.0, 1.0),
            result("qsd", 0, 40.0, 2.0),
            result("vzram/lz4", 1, 36.0, 1.5),
            result("qsd", 1, 30.0, 2.0),
        ];
        assert_eq!(labels(&rs), ["vzram/lz4", "qsd"]);
        assert_eq!(med(&rs, "vzram/lz4", |r| r.swap_test_s), 33.0);
        assert_eq!(
            pair_ratios(&rs, "vzram/lz4", |r| r.swap_test_s),
            [0.75, 1.2]
        );
        assert_eq!(
            pair_ratios(&rs, "vzram/lz4", |r| r.daemon_cpu_s),
            [0.5, 0.75]
        );
        // 1 s over 2 swapped pages.
        assert_eq!(cpu_per_page(&rs[0]), 0.5e6);
        // A --json file holds other records too; `report` reads the guest ones back.
        let path = std::env::temp_dir().join(format!("vzram-bench-guest-{}", std::process::id()));
        let mut text = String::from("{\"record\":\"density\"}\n");
        for r in &rs {
            text.push_str(&serde_json::to_string(r).unwrap());
            text.push('\n');
        }
        std::fs::write(&path, text).unwrap();
        let back = load(&path);
        std::fs::remove_file(&path).unwrap();
        let back = back.unwrap();
        assert_eq!(back.len(), 4);
        assert_eq!(
            (back[2].target.as_str(), back[2].swap_test_s),
            ("vzram/lz4", 36.0)
        );
    }
}
