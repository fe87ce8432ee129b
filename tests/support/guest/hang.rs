//! The thread dump of a guest that hangs: QEMU's threads and the
//! daemon's, from `/proc` and, when it is installed, gdb.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::host::on_path;

/// Every thread of QEMU (`qemu`) and of the processes whose command line
/// names the test's directory (the daemon, its launcher and workers): its
/// state, kernel wait channel, current system call and kernel stack.
pub(super) fn hang_dump(qemu: u32, dir: &Path) -> String {
    let tag = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut pids = vec![qemu];
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmd = fs::read(e.path().join("cmdline")).unwrap_or_default();
        if pid != qemu && !tag.is_empty() && String::from_utf8_lossy(&cmd).contains(&tag) {
            pids.push(pid);
        }
    }
    let read = |p: PathBuf| fs::read_to_string(p).unwrap_or_default();
    let mut out = String::new();
    for pid in pids {
        let cmd = read(PathBuf::from(format!("/proc/{pid}/cmdline"))).replace('\0', " ");
        out += &format!("pid {pid}: {}\n", cmd.chars().take(160).collect::<String>());
        let tasks = PathBuf::from(format!("/proc/{pid}/task"));
        for t in fs::read_dir(&tasks).into_iter().flatten().flatten() {
            let p = t.path();
            let stat = read(p.join("stat"));
            let state = stat
                .rsplit(") ")
                .next()
                .and_then(|r| r.split(' ').next())
                .unwrap_or("?");
            let stack: Vec<String> = read(p.join("stack"))
                .lines()
                .take(6)
                .map(str::to_owned)
                .collect();
            out += &format!(
                "  tid {} {} state {state} wchan {} syscall {}\n",
                t.file_name().to_string_lossy(),
                read(p.join("comm")).trim(),
                read(p.join("wchan")).trim(),
                read(p.join("syscall"))
                    .split(' ')
                    .next()
                    .unwrap_or("?")
                    .trim(),
            );
            for l in stack {
                out += &format!("      {l}\n");
            }
        }
        // User-space stacks when gdb is at hand (CI installs it): which lock
        // or message a stuck thread waits for.
        if on_path("gdb") {
            let bt = Command::new("timeout")
                .args(["60", "gdb", "-batch", "-nx", "-p", &pid.to_string()])
                .args(["-ex", "thread apply all bt 12"])
                .stdin(Stdio::null())
                .output();
            if let Ok(o) = bt {
                for l in String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter(|l| l.starts_with('#') || l.starts_with("Thread "))
                {
                    out += &format!("      {l}\n");
                }
            }
        }
    }
    out
}
