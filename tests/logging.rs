//! Log lines for journald and for other collectors: under systemd (stderr
//! is the stream `JOURNAL_STREAM` names) each line starts with its syslog
//! priority and carries no timestamp, so `journalctl -p warning` finds the
//! warnings; `--log-format json` writes one object per line. Both from the
//! supervisor and from a device's worker process.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use vzram_tests::*;

/// Whether `dir` is on tmpfs (the daemon warns about a state dir that is
/// not).
fn on_tmpfs(dir: &Path) -> bool {
    let c = std::ffi::CString::new(s(dir)).unwrap();
    // SAFETY: statfs fills in a buffer we own, for a path we own.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type == libc::TMPFS_MAGIC
    }
}

/// A daemon with stderr to `dir/d.log`, its state in `dir/state`, `env`
/// and `extra` flags; a client does I/O so that its worker logs too.
fn run(dir: &TempDir, env: &[(&str, String)], extra: &[&str]) -> String {
    let sock = dir.join("a.sock");
    let control = dir.join("control.sock");
    let log = dir.join("d.log");
    let mut cmd = Command::new(vzram_bin());
    cmd.args(["serve", "--socket", s(&sock), "--size", "16M"])
        .args(["--state-dir", s(&dir.join("state"))])
        .arg("--control")
        .arg(&control)
        .args(extra);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut d = Daemon::start_command(cmd, &control, &log, &[&sock]);
    let mut c = Client::connect(&sock, 1).expect("connect");
    c.q(0).write(0, &vec![7u8; PAGE]).unwrap();
    drop(c);
    assert!(d.stat().worker("a").started >= 1);
    assert!(d.terminate().success());
    std::fs::read_to_string(&log).unwrap()
}

#[test]
fn under_journald_each_line_starts_with_its_priority_and_has_no_timestamp() {
    let dir = TempDir::new("journal");
    let log = dir.join("d.log");
    // The journal's stream: the file the daemon's stderr will be (the
    // harness truncates it, the inode stays).
    std::fs::File::create(&log).unwrap();
    let m = std::fs::metadata(&log).unwrap();
    let text = run(
        &dir,
        &[("JOURNAL_STREAM", format!("{}:{}", m.dev(), m.ino()))],
        &[],
    );
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() > 3, "{text}");
    for l in &lines {
        let p = l.get(..3).unwrap_or_default();
        assert!(
            matches!(p, "<3>" | "<4>" | "<6>" | "<7>"),
            "a line without its priority: {l:?}\n{text}"
        );
        // journald stamps lines itself: no 2026-12-05T... of our own.
        assert!(
            !l.contains("Z ") || !l.chars().nth(4).is_some_and(|c| c.is_ascii_digit()),
            "a timestamp: {l:?}"
        );
        assert!(!l.contains('\x1b'), "colour codes: {l:?}");
    }
    for l in &lines {
        if l.contains(" INFO ") {
            assert!(l.starts_with("<6>"), "{l:?}");
        }
        if l.contains(" WARN ") {
            assert!(l.starts_with("<4>"), "{l:?}");
        }
    }
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("<6>") && l.contains("worker{")),
        "no worker line with its priority:\n{text}"
    );
    if !on_tmpfs(&dir.join("state")) {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("<4>") && l.contains("not on tmpfs")),
            "the state-dir warning is not at warning priority:\n{text}"
        );
    }
}

/// `JOURNAL_STREAM` inherited by a process whose stderr went elsewhere:
/// plain lines, with their timestamps.
#[test]
fn a_journal_stream_that_is_not_stderr_changes_nothing() {
    let dir = TempDir::new("nojournal");
    let other = dir.join("other");
    std::fs::File::create(&other).unwrap();
    let m = std::fs::metadata(&other).unwrap();
    let text = run(
        &dir,
        &[("JOURNAL_STREAM", format!("{}:{}", m.dev(), m.ino()))],
        &[],
    );
    let first = text.lines().next().unwrap_or_default();
    assert!(!first.starts_with('<'), "{first:?}");
    assert!(
        first.get(..2).is_some_and(|y| y == "20"),
        "no timestamp: {first:?}"
    );
}

#[test]
fn json_logs_are_one_object_per_line_from_every_process() {
    let dir = TempDir::new("jsonlog");
    let text = run(&dir, &[], &["--log-format", "json"]);
    let mut worker = false;
    for l in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}"));
        assert!(v["level"].is_string() && v["timestamp"].is_string(), "{l}");
        assert!(v["fields"]["message"].is_string(), "{l}");
        worker |= v["span"]["name"] == "worker";
    }
    assert!(worker, "no line from the worker process:\n{text}");
}
