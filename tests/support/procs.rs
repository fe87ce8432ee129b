//! The daemon's processes as `/proc` shows them: its process tree and the
//! fields of `/proc/PID/status`.

/// `pid` and every process it started, and theirs (from each thread's
/// `/proc/PID/task/TID/children`). Checks of the daemon's memory, threads,
/// descriptors and sandbox go over all of them, so they keep checking
/// something once devices are served by worker processes.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        i += 1;
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            out.extend(
                kids.split_whitespace()
                    .filter_map(|k| k.parse::<u32>().ok()),
            );
        }
    }
    out
}

/// A field of `/proc/PID/status` as written there, without the key: `"2"`
/// for `Seccomp`, `"1234 kB"` for `VmRSS`. None when the process or the
/// field is missing.
pub fn proc_status_field(pid: u32, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

/// A memory field of `/proc/PID/status` (`VmRSS`, `RssAnon`, `RssShmem`...)
/// in bytes.
pub fn proc_status_bytes(pid: u32, key: &str) -> Option<u64> {
    let v = proc_status_field(pid, key)?;
    let kib: u64 = v.strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib * 1024)
}

/// A process's user + system CPU time in clock ticks (all its threads;
/// 100 a second).
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat; `rest` starts at field 3.
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::process::Command;
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn process_tree_finds_grandchildren() {
        // A shell that starts a sleep and waits for it: child and grandchild.
        let mut child = Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .spawn()
            .unwrap();
        let me = std::process::id();
        let deadline = Instant::now() + Duration::from_secs(10);
        let tree = loop {
            let t = process_tree(me);
            if t.len() >= 3 || Instant::now() > deadline {
                break t;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let _ = Command::new("pkill")
            .args(["-P", &child.id().to_string()])
            .status();
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(tree[0], me);
        assert!(tree.contains(&child.id()), "{tree:?}");
        assert!(tree.len() >= 3, "no grandchild in {tree:?}");
    }
}
