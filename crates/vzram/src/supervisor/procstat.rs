//! The supervisor's own `process_*` numbers for `/metrics` (the names
//! every Prometheus client library exports): memory, descriptors, start
//! time and CPU time. The workers are processes of their own and not
//! counted here.
//!
//! The seccomp filter lets the supervisor open no file, so the procfs
//! files are opened at start, before it, and read again at each scrape
//! with `pread` at offset 0 (procfs renders them anew on each read).
//! Open descriptors: the size `fstat` gives `/proc/self/fd` (Linux 6.2
//! on), else a `ppoll` of every slot of the descriptor table (`FDSize`),
//! whose closed slots answer POLLNVAL. CPU time is
//! `clock_gettime(CLOCK_PROCESS_CPUTIME_ID)`.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};

/// Opened before the filter, read at each scrape.
pub struct ProcFiles {
    statm: File,
    status: File,
    limits: File,
    fd_dir: File,
    /// Seconds since the epoch; fixed, so worked out once.
    start_time: Option<f64>,
}

/// One scrape's numbers; None where a read failed (the series is left out).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ProcessSample {
    pub resident_bytes: Option<u64>,
    pub virtual_bytes: Option<u64>,
    pub open_fds: Option<u64>,
    pub max_fds: Option<u64>,
    pub start_time_seconds: Option<f64>,
    pub cpu_seconds: Option<f64>,
}

impl ProcFiles {
    /// Opens this process's files. Call it before the seccomp filter.
    pub fn open() -> io::Result<ProcFiles> {
        let mut dir = std::fs::OpenOptions::new();
        dir.read(true).custom_flags(libc::O_DIRECTORY);
        Ok(ProcFiles {
            statm: File::open("/proc/self/statm")?,
            status: File::open("/proc/self/status")?,
            limits: File::open("/proc/self/limits")?,
            fd_dir: dir.open("/proc/self/fd")?,
            start_time: start_time(),
        })
    }

    pub fn sample(&self) -> ProcessSample {
        // SAFETY: sysconf has no preconditions (glibc answers from the
        // auxiliary vector, no system call).
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        let statm = read(&self.statm);
        let pages = |i: usize| {
            statm
                .as_deref()
                .and_then(|t| t.split_whitespace().nth(i))
                .and_then(|v| v.parse::<u64>().ok())
                .map(|p| p * page)
        };
        let max_fds = read(&self.limits).and_then(|t| max_open_files(&t));
        ProcessSample {
            virtual_bytes: pages(0),
            resident_bytes: pages(1),
            open_fds: self.open_fds(max_fds),
            max_fds,
            start_time_seconds: self.start_time,
            cpu_seconds: cpu_seconds(),
        }
    }

    fn open_fds(&self, max_fds: Option<u64>) -> Option<u64> {
        match self.fd_dir.metadata() {
            Ok(m) if m.len() > 0 => Some(m.len()),
            // An older kernel: poll the table.
            _ => {
                let slots = read(&self.status).and_then(|t| field(&t, "FDSize:"))?;
                count_by_poll(slots.min(max_fds.unwrap_or(slots)))
            }
        }
    }
}

/// A procfs file's text, read anew from its start.
fn read(f: &File) -> Option<String> {
    let mut buf = vec![0u8; 8192];
    let mut len = 0;
    loop {
        match f.read_at(&mut buf[len..], len as u64) {
            Ok(0) => break,
            Ok(n) => {
                len += n;
                if len == buf.len() {
                    buf.resize(buf.len() * 2, 0);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    buf.truncate(len);
    String::from_utf8(buf).ok()
}

/// `NAME:  value ...` in /proc/self/status.
fn field(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The soft limit in `Max open files  SOFT  HARD  files`.
fn max_open_files(limits: &str) -> Option<u64> {
    let rest = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?;
    let soft = rest.split_whitespace().next()?;
    match soft {
        "unlimited" => Some(u64::MAX),
        v => v.parse().ok(),
    }
}

/// Open descriptors below `slots`: one `ppoll` with no events asked, no
/// wait; a closed one answers POLLNVAL.
fn count_by_poll(slots: u64) -> Option<u64> {
    let mut fds: Vec<libc::pollfd> = (0..slots.min(1 << 20) as i32)
        .map(|fd| libc::pollfd {
            fd,
            events: 0,
            revents: 0,
        })
        .collect();
    let zero = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `fds` is a valid array of `fds.len()` pollfds that ppoll may
    // write; `zero` a valid timespec; no signal mask is changed.
    let rc = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            &zero,
            std::ptr::null(),
        )
    };
    if rc < 0 {
        return None;
    }
    Some(
        fds.iter()
            .filter(|p| p.revents & libc::POLLNVAL == 0)
            .count() as u64,
    )
}

/// This process's user and system CPU time, all threads.
fn cpu_seconds() -> Option<f64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    (rc == 0).then_some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
}

/// When this process started, in seconds since the epoch: the boot time
/// (/proc/stat's btime) plus its start in clock ticks after boot (field
/// 22 of /proc/self/stat).
fn start_time() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces and parentheses.
    let after = &stat[stat.rfind(')')? + 1..];
    let ticks: u64 = after.split_whitespace().nth(22 - 3)?.parse().ok()?;
    let boot = std::fs::read_to_string("/proc/stat").ok()?;
    let btime: u64 = boot
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| btime as f64 + ticks as f64 / hz as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Other tests open and close files meanwhile: counts are compared
    // loosely here; tests/metrics.rs compares exactly, on a daemon.
    #[test]
    fn reads_this_process() {
        let p = ProcFiles::open().unwrap();
        let s = p.sample();
        assert!(s.resident_bytes.unwrap() > 0, "{s:?}");
        assert!(
            s.virtual_bytes.unwrap() >= s.resident_bytes.unwrap(),
            "{s:?}"
        );
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let start = s.start_time_seconds.unwrap();
        assert!(
            start <= now + 1.0 && start > now - 24.0 * 3600.0,
            "{start} {now}"
        );
        assert!(s.max_fds.unwrap() >= s.open_fds.unwrap(), "{s:?}");
        assert!(s.cpu_seconds.unwrap() > 0.0, "{s:?}");
    }

    /// The fallback for kernels before 6.2: 64 files more, 64 more counted.
    #[test]
    fn poll_counts_the_open_descriptors() {
        let p = ProcFiles::open().unwrap();
        let held: Vec<File> = (0..64)
            .map(|_| File::open("/proc/self/status").unwrap())
            .collect();
        let slots = read(&p.status).and_then(|t| field(&t, "FDSize:")).unwrap();
        let by_poll = count_by_poll(slots).unwrap();
        assert!(by_poll >= 64 + 3, "{by_poll}");
        let by_dir = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        assert!(by_poll.abs_diff(by_dir) < 16, "{by_poll} {by_dir}");
        drop(held);
        assert_eq!(
            max_open_files(
                "Max open files            1024                 524288               files\n"
            ),
            Some(1024)
        );
    }
}
