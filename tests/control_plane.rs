//! The supervisor never looks alive while serving nothing: a dead launcher
//! makes the daemon exit non-zero (so the service manager restarts it), a
//! service manager that stops reading its notify socket never stalls the
//! loop, and `WATCHDOG=1` comes only from a loop that turns and a launcher
//! that answers.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vzram_tests::*;

/// The daemon's launcher process (`vzram __launcher`).
fn launcher_of(pid: u32) -> u32 {
    process_tree(pid)
        .into_iter()
        .find(|&p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| c.split(|&b| b == 0).any(|a| a == b"__launcher"))
                .unwrap_or(false)
        })
        .expect("a launcher process")
}

fn dev(sock: &Path, name: &str) -> String {
    format!("socket={},size=16M,queues=1,name={name}", s(sock))
}

#[test]
fn a_killed_launcher_makes_the_daemon_exit_non_zero() {
    let dir = TempDir::new("cp-launcher");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let mut d = Daemon::start(
        &dir,
        &["--device", &dev(&a, "a"), "--device", &dev(&b, "b")],
        &[&a, &b],
    );
    let mut ca = Client::connect(&a, 1).unwrap();
    let mut cb = Client::connect(&b, 1).unwrap();
    ca.q(0).write(0, &pattern(1, 0, 4096)).unwrap();
    cb.q(0).write(0, &pattern(2, 0, 4096)).unwrap();
    let l = launcher_of(d.pid());
    // SAFETY: a signal to the daemon's own launcher.
    unsafe { libc::kill(l as libc::pid_t, libc::SIGKILL) };
    let t = Instant::now();
    let st = d.wait_exit(Duration::from_secs(5)).unwrap_or_else(|| {
        panic!(
            "the daemon still runs 5 s after its launcher died:\n{}",
            d.log_text()
        )
    });
    assert_eq!(st.code(), Some(1), "{st}\n{}", d.log_text());
    eprintln!(
        "the daemon exited {st} {:?} after its launcher was killed",
        t.elapsed()
    );
    assert!(
        d.log_text().contains("the launcher is gone"),
        "{}",
        d.log_text()
    );
    // A restart serves both devices with their pages.
    let d = Daemon::start(
        &dir,
        &["--device", &dev(&a, "a"), "--device", &dev(&b, "b")],
        &[&a, &b],
    );
    drop((ca, cb));
    let mut ca = Client::connect_retrying(&a, 1, &d);
    let mut cb = Client::connect_retrying(&b, 1, &d);
    assert_eq!(ca.q(0).read(0, 4096).unwrap(), pattern(1, 0, 4096));
    assert_eq!(cb.q(0).read(0, 4096).unwrap(), pattern(2, 0, 4096));
    d.shutdown();
}

/// A log that cannot be written stops nothing: with stderr on a full
/// disk (`/dev/full`, as a log file's disk can fill), every device is
/// served, workers come and go, and the control socket answers. A failed
/// log write used to panic the thread that logged: the worker exited
/// mid-request, and the supervisor's loop died, leaving a daemon that
/// accepted frontends and never answered them.
#[test]
fn a_log_that_cannot_be_written_stops_nothing() {
    let dir = TempDir::new("cp-full");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let control = dir.join("control.sock");
    let mut cmd = Command::new("sh");
    cmd.args(["-c", r#"exec "$0" "$@" >/dev/full 2>&1"#])
        .arg(vzram_bin())
        .args([
            "serve",
            "--device",
            &dev(&a, "a"),
            "--device",
            &dev(&b, "b"),
        ])
        .arg("--control")
        .arg(&control);
    let d = Daemon::start_command(cmd, &control, &dir.join("daemon.log"), &[&a, &b]);
    for round in 1..=3u64 {
        let mut ca = Client::connect(&a, 1).unwrap();
        let mut cb = Client::connect(&b, 1).unwrap();
        ca.q(0).write(0, &pattern(round, 0, 4096)).unwrap();
        cb.q(0).write(4096, &pattern(round + 10, 0, 4096)).unwrap();
        assert_eq!(ca.q(0).read(0, 4096).unwrap(), pattern(round, 0, 4096));
        assert_eq!(
            cb.q(0).read(4096, 4096).unwrap(),
            pattern(round + 10, 0, 4096)
        );
    }
    let st = d.stat();
    for name in ["a", "b"] {
        let w = st.worker(name);
        assert_eq!((w.started, w.failures), (3, 0), "{name}: {w:?}");
    }
    d.shutdown();
}

/// A supervisor thread that panics takes the daemon down (code 1, for the
/// service manager to restart it) instead of leaving it half alive: the
/// loop that admits frontends gone, a VMM's connection would be accepted
/// by the kernel and never answered.
#[test]
fn a_panic_in_the_supervisor_ends_the_daemon() {
    let dir = TempDir::new("cp-panic");
    let a = dir.join("a.sock");
    let control = dir.join("control.sock");
    let mut cmd = Command::new(vzram_bin());
    cmd.env("VZRAM_TEST_PANIC_ON_FRONTEND", "1")
        .args(["serve", "--device", &dev(&a, "a"), "--control"])
        .arg(&control);
    let mut d = Daemon::start_command(cmd, &control, &dir.join("daemon.log"), &[&a]);
    let _vmm = std::os::unix::net::UnixStream::connect(&a).unwrap();
    let st = d.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| {
        panic!(
            "the daemon still runs 20 s after its loop panicked:\n{}",
            d.log_text()
        )
    });
    let log = d.log_text();
    assert_eq!(st.code(), Some(1), "{st}\n{log}");
    assert!(log.contains("the supervisor panicked"), "{log}");
    // Started again, it serves.
    let d = Daemon::start(&dir, &["--device", &dev(&a, "a")], &[&a]);
    let mut c = Client::connect(&a, 1).unwrap();
    c.q(0).write(0, &pattern(5, 0, 4096)).unwrap();
    assert_eq!(c.q(0).read(0, 4096).unwrap(), pattern(5, 0, 4096));
    d.shutdown();
}

/// A daemon whose notify socket is `addr`, with more variables in `env`.
fn notified(dir: &TempDir, addr: &str, env: &[(&str, &str)]) -> (Child, std::path::PathBuf) {
    let sock = dir.join("vm.sock");
    let log = dir.join("daemon.log");
    let out = std::fs::File::create(&log).unwrap();
    let mut cmd = Command::new(vzram_bin());
    cmd.args(["serve", "--size", "16M", "--queues", "1", "--socket"])
        .arg(&sock)
        .arg("--control")
        .arg(dir.join("control.sock"))
        .env("NOTIFY_SOCKET", addr)
        .env("VZRAM_STATE_DIR", state_dir_for(dir.path()))
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    for (k, v) in env {
        cmd.env(k, v);
    }
    (cmd.spawn().unwrap(), log)
}

fn wait_for(p: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !p.exists() {
        assert!(Instant::now() < deadline, "{} never appeared", p.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_notify_socket_nobody_reads_never_stalls_the_daemon() {
    let dir = TempDir::new("cp-notify");
    let name = format!("vzram-cp-notify-{}", std::process::id());
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let rx = UnixDatagram::bind_addr(&addr).unwrap();
    let (mut child, log) = notified(&dir, &format!("@{name}"), &[]);
    let sock = dir.join("vm.sock");
    wait_for(&dir.join("control.sock"));
    // The service manager stops reading, and its queue fills up.
    let filler = UnixDatagram::unbound().unwrap();
    filler.connect_addr(&addr).unwrap();
    filler.set_nonblocking(true).unwrap();
    let mut queued = 0;
    while filler.send(b"STATUS=filler").is_ok() {
        queued += 1;
        assert!(queued < 1_000_000);
    }
    let mut worst = Duration::ZERO;
    for i in 0..20u64 {
        let mut c = Client::connect(&sock, 1).unwrap();
        c.q(0).write(i * 4096, &pattern(i, 0, 4096)).unwrap();
        drop(c);
        let t = Instant::now();
        let st = Stats::parse(control_request(
            &dir.join("control.sock"),
            &json!({"cmd": "stat"}),
        ));
        worst = worst.max(t.elapsed());
        assert_eq!(st.devices().len(), 1);
    }
    eprintln!("{queued} datagrams filled the notify queue; 20 frontends came and went; worst stat {worst:?}");
    assert!(worst < Duration::from_secs(1), "stat took {worst:?}");
    let mut c = Client::connect(&sock, 1).unwrap();
    assert_eq!(c.q(0).read(19 * 4096, 4096).unwrap(), pattern(19, 0, 4096));
    drop(rx);
    let _ = child.kill();
    let _ = child.wait();
    let _ = log;
}

/// Throws away what `rx` holds (sent before the moment being tested).
fn drain(rx: &UnixDatagram) {
    rx.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 4096];
    while rx.recv(&mut buf).is_ok() {}
    rx.set_nonblocking(false).unwrap();
}

/// Counts `WATCHDOG=1` datagrams on `rx` for `d`.
fn watchdogs(rx: &UnixDatagram, d: Duration) -> usize {
    let end = Instant::now() + d;
    let mut n = 0;
    let mut buf = [0u8; 4096];
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        rx.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        match rx.recv(&mut buf) {
            Ok(k) => {
                n += buf[..k]
                    .split(|&b| b == b'\n')
                    .filter(|l| *l == b"WATCHDOG=1")
                    .count()
            }
            Err(_) => break,
        }
    }
    n
}

/// Reads `rx` until the daemon says `READY=1`: its loop turns and it has
/// its notifier.
fn ready(rx: &UnixDatagram) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no READY=1");
        rx.set_read_timeout(Some(left)).unwrap();
        if let Ok(k) = rx.recv(&mut buf) {
            if buf[..k].split(|&b| b == b'\n').any(|l| l == b"READY=1") {
                return;
            }
        }
    }
}

/// Waits until the daemon's log at `log` holds `text`.
fn logged(log: &Path, text: &str) {
    logged_more(log, text, 0)
}

/// Waits until the daemon's log at `log` holds `text` more than `seen` times.
fn logged_more(log: &Path, text: &str, seen: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = std::fs::read_to_string(log).unwrap_or_default();
        if now.matches(text).count() > seen {
            return;
        }
        assert!(Instant::now() < deadline, "never logged {text:?}:\n{now}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn watchdog_keepalives_come_only_from_a_loop_that_turns() {
    let dir = TempDir::new("cp-dog");
    let name = format!("vzram-cp-dog-{}", std::process::id());
    let rx =
        UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    // WatchdogSec=0.4s: a keep-alive every 0.2 s; the loop hangs 4 s
    // after its first.
    let (mut child, log) = notified(
        &dir,
        &format!("@{name}"),
        &[
            ("WATCHDOG_USEC", "400000"),
            ("VZRAM_TEST_HANG_LOOP_MS", "4000"),
        ],
    );
    ready(&rx);
    let healthy = watchdogs(&rx, Duration::from_millis(1500));
    assert!(
        healthy >= 4,
        "{healthy} keep-alives in 1.5 s\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    // Its last keep-alive was sent before this line was logged.
    logged(&log, "the loop hangs now");
    drain(&rx);
    let hung = watchdogs(&rx, Duration::from_millis(1500));
    assert!(child.try_wait().unwrap().is_none(), "the daemon exited");
    assert_eq!(hung, 0, "keep-alives from a hung loop");
    eprintln!("{healthy} keep-alives in 1.5 s while the loop turned, {hung} in 1.5 s once it hung");
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn no_watchdog_keepalive_without_an_answering_launcher() {
    let dir = TempDir::new("cp-dog-l");
    let name = format!("vzram-cp-dogl-{}", std::process::id());
    let rx =
        UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let (mut child, log) = notified(&dir, &format!("@{name}"), &[("WATCHDOG_USEC", "400000")]);
    ready(&rx);
    assert!(watchdogs(&rx, Duration::from_millis(1000)) >= 2);
    // Said once a silence: a launcher slow before may have been said.
    const SILENT: &str = "the launcher has not answered";
    let before = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .matches(SILENT)
        .count();
    // SIGSTOP, not SIGKILL: a launcher that is there but stuck.
    let l = launcher_of(child.id());
    // SAFETY: a signal to the daemon's own launcher.
    unsafe { libc::kill(l as libc::pid_t, libc::SIGSTOP) };
    // Logged after the last keep-alive, once the launcher is found silent.
    logged_more(&log, SILENT, before);
    drain(&rx);
    let stuck = watchdogs(&rx, Duration::from_millis(1200));
    // SAFETY: as above.
    unsafe { libc::kill(l as libc::pid_t, libc::SIGCONT) };
    let again = watchdogs(&rx, Duration::from_millis(1200));
    eprintln!(
        "keep-alives: {stuck} in 1.2 s with the launcher stopped, {again} once it runs again"
    );
    assert_eq!(stuck, 0, "keep-alives while the launcher cannot answer");
    assert!(again >= 2, "keep-alives came back: {again}");
    let _ = child.kill();
    let _ = child.wait();
}
