//! Device state outlives the daemon: SIGKILL or SIGTERM, start again with
//! the same command line, and every page reads back; state that does not
//! match the configuration stops the start instead of serving a blank disk;
//! `--fresh` discards on purpose; one daemon per state. (A SIGKILL in the
//! middle of writes at QD32 is `tests/kill_io.rs`.)

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use vzram_tests::*;

const DEV: &str = "16M";
const PAGES: u64 = 16 << 8; // 16 MiB

/// Starts the daemon; a killed one's socket files are removed first, so
/// that waiting for them waits for the new daemon.
fn start(dir: &TempDir, sock: &Path, extra: &[&str]) -> Daemon {
    let _ = std::fs::remove_file(sock);
    let _ = std::fs::remove_file(dir.join("control.sock"));
    let mut args = vec![
        "--socket",
        s(sock),
        "--size",
        DEV,
        "--name",
        "vm1",
        "--queues",
        "2",
    ];
    args.extend_from_slice(extra);
    Daemon::start(dir, &args, &[sock])
}

fn write_all(sock: &Path, v: u64, every: u64) {
    let mut c = Client::connect(sock, 2).expect("connect");
    for i in (0..PAGES).step_by(every as usize) {
        c.q((i % 2) as usize)
            .write(i * PAGE as u64, &versioned_page(i, v))
            .unwrap_or_else(|e| panic!("write page {i}: {e}"));
    }
}

fn check_all(sock: &Path, v: u64, every: u64, what: &str) {
    let mut c = Client::connect(sock, 2).expect("connect");
    for i in 0..PAGES {
        let got = c.q(0).read(i * PAGE as u64, PAGE).unwrap();
        let want = if every != 0 && i % every == 0 {
            versioned_page(i, v)
        } else {
            vec![0; PAGE]
        };
        assert!(got == want, "{what}: page {i} differs");
    }
}

#[test]
fn sigkill_then_the_same_command_line_serves_every_page() {
    let dir = TempDir::new("dur9");
    let sock = dir.join("v.sock");
    let mut d = start(&dir, &sock, &[]);
    write_all(&sock, 1, 3);
    // Staged pages compressed: the sizes recovery must rebuild.
    let before = d.settled();
    let state = before.devices()[0].state.clone();
    assert!(
        !state.as_os_str().is_empty(),
        "stat shows the state: {before}"
    );
    assert!(before.devices()[0].state_bytes > 0, "{before}");
    d.kill9();
    // The socket file of a killed daemon is left behind; the next start
    // replaces it.
    let d = start(&dir, &sock, &[]);
    check_all(&sock, 1, 3, "after SIGKILL");
    let after = d.stat();
    let rebuilt = |st: &Stats| {
        let c = st.counters("vm1");
        [
            ("orig_data_size", c.orig_data_size),
            ("compr_data_size", c.compr_data_size),
            ("same_pages", c.same_pages),
            ("huge_pages", c.huge_pages),
        ]
    };
    for ((f, a), (_, b)) in rebuilt(&after).into_iter().zip(rebuilt(&before)) {
        assert_eq!(a, b, "{f} rebuilt from the slots");
    }
    assert_eq!(after.devices()[0].state, state);
    assert!(
        d.log_text().contains("recovered the device from its state"),
        "{}",
        d.log_text()
    );
    // Directories 0700, files 0600.
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&state), 0o700);
    for f in ["header", "table", "arena"] {
        assert_eq!(mode(&state.join(f)), 0o600, "{f}");
    }
    // And it goes on working: overwrite, read back.
    write_all(&sock, 2, 5);
    let mut c = Client::connect(&sock, 1).unwrap();
    assert_eq!(c.q(0).read(0, PAGE).unwrap(), versioned_page(0, 2));
}

#[test]
fn sigterm_and_restart_is_an_upgrade() {
    let dir = TempDir::new("durterm");
    let sock = dir.join("v.sock");
    let mut d = start(&dir, &sock, &[]);
    write_all(&sock, 7, 2);
    assert!(d.terminate().success());
    assert!(!sock.exists(), "SIGTERM removes the socket");
    let _d = start(&dir, &sock, &[]);
    check_all(&sock, 7, 2, "after SIGTERM and restart");
}

#[test]
fn state_that_does_not_match_stops_the_start_and_fresh_discards_it() {
    let dir = TempDir::new("durmis");
    let sock = dir.join("v.sock");
    let mut d = start(&dir, &sock, &[]);
    write_all(&sock, 3, 4);
    assert!(d.terminate().success());

    // Another size: refused, one line naming the file, exit 2, no socket.
    let out = serve_refused(
        &dir,
        &["--socket", s(&sock), "--size", "32M", "--name", "vm1"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err
        .trim_end()
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        last.starts_with("error:") && last.contains("vm1/header") && last.contains("--fresh"),
        "{err}"
    );
    assert!(!sock.exists());

    // The old size still finds the data; a second daemon on the same state
    // (another socket) is refused while it runs.
    let _d = start(&dir, &sock, &[]);
    check_all(&sock, 3, 4, "after the refused start");
    let other = dir.join("w.sock");
    let out = serve_refused(
        &dir,
        &["--socket", s(&other), "--size", DEV, "--name", "vm1"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("in use by another vzram"), "{err}");
    drop(_d);

    // --fresh: empty, whatever was there.
    let _d = start(&dir, &sock, &["--fresh"]);
    check_all(&sock, 0, 0, "after --fresh");
}
