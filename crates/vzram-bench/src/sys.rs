//! Process and clock helpers: /proc readings, CPU clocks, child daemon lifecycle.

use crate::bail;
use crate::error::{Context, Result};
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

/// utime+stime of the whole process (all threads), from /proc/PID/stat.
pub fn proc_cpu(pid: u32) -> Result<Duration> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat"))
        .context(format!("reading /proc/{pid}/stat"))?;
    // The command name may contain spaces; fields resume after the last ')'.
    let rest = &s[s.rfind(')').map(|i| i + 2).unwrap_or(0)..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state is field 3 in the man page, so utime (14) and stime (15) are 11, 12.
    let ticks: u64 = f.get(11).and_then(|x| x.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|x| x.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
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
}
