//! Process and clock helpers: /proc readings, CPU clocks, child daemon lifecycle.

use crate::error::{bail, Context, Result};
use std::collections::HashSet;
use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Set by SIGINT/SIGTERM: workers stop early and daemons are still cleaned up.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

pub fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

fn clock(id: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    unsafe { libc::clock_gettime(id, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CPU time consumed by the calling thread.
pub fn thread_cpu() -> Duration {
    clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

pub fn load_1m() -> Option<f64> {
    fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

pub fn nproc() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// A line `Key:   value kB` of /proc/PID/status, in bytes (or the raw number).
fn status_field(pid: u32, key: &str) -> Result<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status"))
        .context(format!("reading /proc/{pid}/status"))?;
    for line in s.lines() {
        if let Some(rest) = line.strip_prefix(key).and_then(|r| r.strip_prefix(':')) {
            let mut it = rest.split_whitespace();
            let n: u64 = it.next().unwrap_or("0").parse().unwrap_or(0);
            return Ok(if it.next() == Some("kB") { n * 1024 } else { n });
        }
    }
    bail!("/proc/{pid}/status has no {key}")
}

#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ProcMem {
    pub rss: u64,
    pub rss_anon: u64,
    pub rss_file: u64,
    pub rss_shmem: u64,
}

pub fn proc_mem(pid: u32) -> Result<ProcMem> {
    Ok(ProcMem {
        rss: status_field(pid, "VmRSS")?,
        rss_anon: status_field(pid, "RssAnon").unwrap_or(0),
        rss_file: status_field(pid, "RssFile").unwrap_or(0),
        rss_shmem: status_field(pid, "RssShmem").unwrap_or(0),
    })
}

/// A `kB` field of /proc/PID/status in bytes (VmPTE, RssFile...).
pub fn proc_status_bytes(pid: u32, key: &str) -> Result<u64> {
    status_field(pid, key)
}

pub fn proc_threads(pid: u32) -> Result<u64> {
    status_field(pid, "Threads")
}

pub fn proc_fds(pid: u32) -> Result<u64> {
    Ok(fs::read_dir(format!("/proc/{pid}/fd"))
        .context(format!("listing /proc/{pid}/fd"))?
        .count() as u64)
}

/// Soft "Max open files" of a process, from /proc/PID/limits.
pub fn proc_fd_limit(pid: u32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = s.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The parent pid of a process (field 4 of /proc/PID/stat), None when it is gone.
pub fn proc_ppid(pid: u32) -> Option<u32> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses; fields resume after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// `pid` and every process below it (children, their children...), `pid` first.
/// Read from each process's parent in /proc/*/stat, so it sees processes whose parent
/// is not us (the daemon's launcher and workers).
pub fn proc_tree(pid: u32) -> Vec<u32> {
    let mut all: Vec<(u32, u32)> = Vec::new();
    if let Ok(dir) = fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(pp) = proc_ppid(p) {
                all.push((p, pp));
            }
        }
    }
    tree_from(pid, &all)
}

/// The descendants of `root` (with it first) in a list of (pid, parent pid).
fn tree_from(root: u32, all: &[(u32, u32)]) -> Vec<u32> {
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        let mut kids: Vec<u32> = all
            .iter()
            .filter(|&&(p, pp)| pp == parent && p != root)
            .map(|&(p, _)| p)
            .collect();
        kids.sort_unstable();
        out.extend(kids);
        i += 1;
    }
    out
}

/// The name a process gave itself (/proc/PID/comm).
pub fn proc_comm(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// RSS, threads and fds summed over a set of processes. Pages shared between them
/// (the binary's text, shared memory) count once per process, as RSS does.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct TreeUse {
    pub processes: u64,
    pub rss_bytes: u64,
    pub rss_anon_bytes: u64,
    pub rss_file_bytes: u64,
    pub rss_shmem_bytes: u64,
    pub threads: u64,
    pub fds: u64,
}

/// Sums over `pids`; a process that exits meanwhile is skipped.
pub fn tree_use(pids: &[u32]) -> TreeUse {
    let mut t = TreeUse::default();
    for &p in pids {
        let (Ok(m), Ok(th), Ok(fd)) = (proc_mem(p), proc_threads(p), proc_fds(p)) else {
            continue;
        };
        t.processes += 1;
        t.rss_bytes += m.rss;
        t.rss_anon_bytes += m.rss_anon;
        t.rss_file_bytes += m.rss_file;
        t.rss_shmem_bytes += m.rss_shmem;
        t.threads += th;
        t.fds += fd;
    }
    t
}

/// One mapping of /proc/PID/smaps: what backs it and how much of it is resident.
#[derive(Clone, Debug, Default)]
pub struct Mapping {
    pub shared: bool,
    /// (device "maj:min", inode); inode 0 for anonymous memory.
    pub dev: String,
    pub inode: u64,
    pub path: String,
    pub rss: u64,
    pub pss: u64,
    pub private: u64,
    pub anon: u64,
}

pub fn proc_smaps(pid: u32) -> Result<Vec<Mapping>> {
    let s = fs::read_to_string(format!("/proc/{pid}/smaps"))
        .context(format!("reading /proc/{pid}/smaps"))?;
    Ok(parse_smaps(&s))
}

fn parse_smaps(s: &str) -> Vec<Mapping> {
    let mut out: Vec<Mapping> = Vec::new();
    for line in s.lines() {
        let mut it = line.split_whitespace();
        let Some(first) = it.next() else { continue };
        if let Some(key) = first.strip_suffix(':') {
            // "Key:   N kB"
            let Some(m) = out.last_mut() else { continue };
            let kb: u64 = it.next().and_then(|n| n.parse().ok()).unwrap_or(0);
            let bytes = kb * 1024;
            match key {
                "Rss" => m.rss = bytes,
                "Pss" => m.pss = bytes,
                "Private_Clean" | "Private_Dirty" => m.private += bytes,
                "Anonymous" => m.anon = bytes,
                _ => {}
            }
            continue;
        }
        // A header: "start-end perms offset dev inode [path]".
        if !first.contains('-') {
            continue;
        }
        let perms = it.next().unwrap_or("");
        let _offset = it.next();
        let dev = it.next().unwrap_or("").to_string();
        let inode: u64 = it.next().and_then(|n| n.parse().ok()).unwrap_or(0);
        let path = it.collect::<Vec<_>>().join(" ");
        out.push(Mapping {
            shared: perms.ends_with('s'),
            dev,
            inode,
            path,
            ..Mapping::default()
        });
    }
    out
}

/// (device, inode) of every file this process maps shared: the client's memory
/// regions (libblkio's memfds: its buffers and rings), which a vhost-user daemon maps
/// as guest RAM.
pub fn client_shared_files() -> Result<HashSet<(String, u64)>> {
    Ok(proc_smaps(std::process::id())?
        .into_iter()
        .filter(|m| m.shared && m.inode != 0)
        .map(|m| (m.dev, m.inode))
        .collect())
}

/// Whether a mapping of a daemon's is guest RAM (a file the client maps shared).
pub fn is_guest(m: &Mapping, guest: &HashSet<(String, u64)>) -> bool {
    m.shared && m.inode != 0 && guest.contains(&(m.dev.clone(), m.inode))
}

/// Resident memory of a daemon's processes (it and everything under it), from smaps.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct DaemonRss {
    pub processes: u64,
    pub rss: u64,
    /// The part of `rss` that is the client's memory (guest RAM) mapped by the daemon.
    pub guest_rss: u64,
    /// The part of `rss` that maps files under `$VZRAM_STATE_DIR` (the devices'
    /// state files): what of them is mapped, not what they hold.
    pub state_rss: u64,
}

impl DaemonRss {
    /// The daemon's own memory: RSS of its processes without guest RAM.
    pub fn own(&self) -> u64 {
        self.rss - self.guest_rss
    }
}

pub fn daemon_rss(pid: u32) -> Result<DaemonRss> {
    let guest = client_shared_files()?;
    let state = std::env::var("VZRAM_STATE_DIR")
        .ok()
        .filter(|d| !d.is_empty());
    let mut r = DaemonRss::default();
    for p in proc_tree(pid) {
        // A process that has just exited is skipped, unless it is the daemon itself.
        let maps = match proc_smaps(p) {
            Ok(m) => m,
            Err(e) if p == pid => return Err(e),
            Err(_) => continue,
        };
        r.processes += 1;
        for m in &maps {
            r.rss += m.rss;
            if is_guest(m, &guest) {
                r.guest_rss += m.rss;
            } else if state.as_deref().is_some_and(|d| m.path.starts_with(d)) {
                r.state_rss += m.rss;
            }
        }
    }
    Ok(r)
}

/// CPU time of a daemon and every process under it (its workers).
pub fn tree_cpu(pid: u32) -> Result<Duration> {
    let mut t = proc_cpu(pid)?;
    for p in proc_tree(pid).into_iter().skip(1) {
        t += proc_cpu(p).unwrap_or_default();
    }
    Ok(t)
}

/// Lift this process's soft open-file limit to its hard limit; returns (soft, hard).
pub fn raise_nofile() -> (u64, u64) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid, writable rlimit struct of ours.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            let want = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                r = want;
            }
        }
    }
    (r.rlim_cur, r.rlim_max)
}

/// What is read from one /proc/PID/stat: the state letter and CPU clock ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StatTimes {
    state: char,
    /// utime + stime: the process, all its threads.
    own: u64,
    /// cutime + cstime: its children that have exited and been waited for.
    children: u64,
}

fn parse_stat(s: &str) -> Option<StatTimes> {
    // The command name may contain spaces and parentheses; fields resume after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state is field 3 in the man page, so utime, stime, cutime, cstime
    // (14-17) are 11-14.
    let n = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    Some(StatTimes {
        state: f.first()?.chars().next()?,
        own: n(11) + n(12),
        children: n(13) + n(14),
    })
}

fn read_stat(pid: u32) -> Result<StatTimes> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat"))
        .context(format!("reading /proc/{pid}/stat"))?;
    parse_stat(&s).ok_or_else(|| format!("/proc/{pid}/stat: cannot parse {s:?}").into())
}

fn ticks(n: u64) -> Duration {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_nanos(n * 1_000_000_000 / hz)
}

/// utime+stime of the whole process (all threads), from /proc/PID/stat.
pub fn proc_cpu(pid: u32) -> Result<Duration> {
    Ok(ticks(read_stat(pid)?.own))
}

/// The state letter of a process (`R`, `S`, `Z`...); None when it is gone. A child
/// of ours that has exited stays `Z` until we wait for it, with its CPU times.
pub fn proc_state(pid: u32) -> Option<char> {
    read_stat(pid).ok().map(|t| t.state)
}

/// CPU time of a daemon's whole tree, including processes that have already exited:
/// each process's own time plus that of the children it has waited for. A vzram
/// worker ends when its frontend leaves and its launcher reaps it; its time then
/// moves into the launcher's children's time, so the sum over the tree stays whole
/// (unlike [`tree_cpu`], which loses it).
pub fn tree_cpu_total(pid: u32) -> Result<Duration> {
    let mut t = 0;
    for p in proc_tree(pid) {
        match read_stat(p) {
            Ok(s) => t += s.own + s.children,
            Err(e) if p == pid => return Err(e),
            // Exited between the listing and the read.
            Err(_) => {}
        }
    }
    Ok(ticks(t))
}

/// A daemon we started: killed and reaped on drop, whatever happened.
pub struct Daemon {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Daemon {
    pub fn spawn(name: &str, cmd: &mut Command, log: PathBuf) -> Result<Daemon> {
        let out = fs::File::create(&log).context(format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .context(format!("starting {name} ({:?})", cmd.get_program()))?;
        Ok(Daemon {
            name: name.to_string(),
            child,
            log,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last lines of the daemon's log, for error messages (one line).
    pub fn log_tail(&self) -> String {
        let s = strip_ansi(&fs::read_to_string(&self.log).unwrap_or_default());
        let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
        lines[lines.len().saturating_sub(3)..].join(" | ")
    }

    /// Fails if the daemon has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(st) = self.child.try_wait()? {
            bail!("{} exited ({}): {}", self.name, st, self.log_tail());
        }
        Ok(())
    }

    /// Wait until every path exists (sockets being created), or fail on exit/timeout.
    pub fn wait_for_paths(&mut self, paths: &[PathBuf], timeout: Duration) -> Result<Duration> {
        let t0 = Instant::now();
        let mut next = 0;
        loop {
            while next < paths.len() && paths[next].exists() {
                next += 1;
            }
            if next == paths.len() {
                return Ok(t0.elapsed());
            }
            self.check_alive()?;
            if t0.elapsed() > timeout || interrupted() {
                bail!(
                    "{}: {} did not appear within {:?}: {}",
                    self.name,
                    paths[next].display(),
                    timeout,
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGTERM, then SIGKILL after a grace period. Returns how it ended.
    pub fn stop(&mut self) -> Result<String> {
        if let Some(st) = self.child.try_wait()? {
            return Ok(format!("already exited: {st}"));
        }
        // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if let Some(st) = self.child.try_wait()? {
                return Ok(match st.signal() {
                    Some(s) => format!("signal {s}"),
                    None => format!("exit {}", st.code().unwrap_or(-1)),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        Ok("killed after 5 s".into())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// Drop terminal colour codes (ESC [ ... letter) that daemons write to their logs.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c == '\x1b' {
            for d in it.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Look a program up the way a shell would, for clear "not found" errors up front.
pub fn find_program(p: &Path) -> Option<PathBuf> {
    if p.components().count() > 1 {
        return p.is_file().then(|| p.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(p))
            .find(|c| c.is_file())
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn strips_colour_codes() {
        assert_eq!(
            super::strip_ansi("\x1b[2mts\x1b[0m \x1b[31mERROR\x1b[0m x"),
            "ts ERROR x"
        );
    }

    #[test]
    fn process_tree_walks_grandchildren() {
        // 1 -> 10 -> {20, 21}; 21 -> 30; 40 elsewhere.
        let all = [(10, 1), (20, 10), (21, 10), (30, 21), (40, 2), (1, 0)];
        assert_eq!(super::tree_from(10, &all), vec![10, 20, 21, 30]);
        assert_eq!(super::tree_from(40, &all), vec![40]);
    }

    #[test]
    fn parses_smaps() {
        let s = "\
7f00-7f10 rw-s 00000000 00:01 1234                       /memfd:libblkio-buf (deleted)
Size:                 64 kB
Rss:                   8 kB
Pss:                   4 kB
Private_Clean:         0 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
VmFlags: rd wr sh mr mw me ms sd
7f20-7f30 rw-p 00000000 00:00 0 
Rss:                  12 kB
Pss:                  12 kB
Private_Clean:         4 kB
Private_Dirty:         8 kB
Anonymous:            12 kB
";
        let m = super::parse_smaps(s);
        assert_eq!(m.len(), 2);
        assert!(m[0].shared && m[0].inode == 1234 && m[0].dev == "00:01");
        assert_eq!(m[0].path, "/memfd:libblkio-buf (deleted)");
        assert_eq!((m[0].rss, m[0].pss, m[0].private), (8192, 4096, 0));
        assert!(!m[1].shared && m[1].inode == 0 && m[1].path.is_empty());
        assert_eq!((m[1].rss, m[1].private, m[1].anon), (12288, 12288, 12288));
    }

    #[test]
    fn parses_stat() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt
        // cmajflt utime stime cutime cstime ...
        let s = "42 (qemu (x) y) Z 1 42 42 0 -1 4194560 10 0 0 0 700 55 30 4 20 0 3 0";
        let t = super::parse_stat(s).unwrap();
        assert_eq!((t.state, t.own, t.children), ('Z', 755, 34));
        assert!(super::parse_stat("garbage").is_none());
        let me = std::process::id();
        assert!(matches!(super::proc_state(me), Some('R' | 'S')));
        assert!(super::tree_cpu_total(me).is_ok());
    }

    #[test]
    fn own_process_is_its_own_tree() {
        let me = std::process::id();
        assert_eq!(super::proc_tree(me)[0], me);
        assert_eq!(
            super::proc_ppid(me),
            Some(std::os::unix::process::parent_id())
        );
    }
}
