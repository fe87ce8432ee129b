//! Who may talk on a device socket, and what the daemon does about the rest:
//! SIGHUP does not kill it, a second frontend on a busy socket is turned away
//! at once (instead of hanging, then getting the first VM's disk), `vzram
//! stat` pointed at a device socket fails quickly, and probes (a second
//! `vzram serve`, a bare connect) are not counted as connections.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;
use vzram_tests::*;

/// `vzram stat --json` on the daemon's control socket: the device entry
/// named `name` (with `connected`, `connections` and `stats`).
fn stat_device(d: &Daemon, name: &str) -> DeviceStat {
    let o = Vzram::new(&["stat", "--json"])
        .control(&d.control)
        .limit(Duration::from_secs(20))
        .output();
    assert!(o.status.success(), "vzram stat --json: {}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).expect("stat JSON");
    Stats::parse(v).dev(name).clone()
}

fn connections(d: &Daemon, name: &str) -> u64 {
    stat_device(d, name).connections
}

/// Whether `pid` is a live process (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    proc_status_field(pid, "State").is_some_and(|st| !st.starts_with('Z'))
}

/// Waits (at most `limit`) until the daemon's log contains `needle`.
fn wait_for_log(d: &Daemon, needle: &str, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if d.log_text().contains(needle) {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

const PAGES: u64 = 64;

fn write_pages(c: &mut Client, seed: u64) {
    for p in 0..PAGES {
        c.q(0)
            .write(p * 4096, &pattern(seed, p * 4096, 4096))
            .unwrap();
    }
}

fn check_pages(c: &mut Client, seed: u64, what: &str) {
    for p in 0..PAGES {
        let got = c.q(0).read(p * 4096, 4096).unwrap();
        assert!(
            got == pattern(seed, p * 4096, 4096),
            "{what}: page {p} does not read back"
        );
    }
}

/// Connects a new blkio client on another thread and checks that it sees
/// pages written with `seed`; fails instead of hanging when the daemon does
/// not serve it within 30 s.
fn new_client_sees(sock: &Path, seed: u64, what: &str) {
    let (tx, rx) = mpsc::channel();
    let sock = sock.to_path_buf();
    let what2 = what.to_string();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(move || {
            let mut c = Client::connect(&sock, 1).expect("blkio connect");
            check_pages(&mut c, seed, &what2);
        });
        let _ = tx.send(r.is_ok());
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(true) => {}
        Ok(false) => panic!("{what}: the new client failed (see its panic above)"),
        Err(_) => panic!("{what}: a new client was not served within 30 s"),
    }
}

#[test]
fn sighup_is_ignored_and_the_data_kept() {
    let dir = TempDir::new("hup");
    let sock = dir.join("d.sock");
    let mut d = Daemon::start(
        &dir,
        &[
            "--socket",
            s(&sock),
            "--size",
            "16M",
            "--name",
            "vm1",
            "--queues",
            "1",
        ],
        &[&sock],
    );
    let mut a = Client::connect(&sock, 1).unwrap();
    write_pages(&mut a, 1);

    let pid = d.pid();
    // SAFETY: kill only sends a signal to our own child.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGHUP) }, 0);
    let sent = Instant::now();
    // No sign of death for a second, and the log says it was ignored.
    loop {
        if !alive(pid) {
            let status = d.terminate();
            panic!(
                "the daemon died of SIGHUP ({status}) within {:?}; sockets left: {}\n{}",
                sent.elapsed(),
                sock.exists(),
                d.log_text()
            );
        }
        if sent.elapsed() >= Duration::from_secs(1) && d.log_text().contains("SIGHUP") {
            break;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(10),
            "no log line about SIGHUP within 10 s:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // The connected frontend is still served, and a new one sees the data.
    check_pages(&mut a, 1, "same connection after SIGHUP");
    drop(a);
    new_client_sees(&sock, 1, "new connection after SIGHUP");
    assert_eq!(connections(&d, "vm1"), 2);

    let status = d.terminate();
    assert_eq!(status.code(), Some(0), "{status}:\n{}", d.log_text());
    for p in [&sock, &d.control] {
        assert!(!p.exists(), "{} left behind", p.display());
    }
}

/// A vhost-user GET_FEATURES request: code 1, flags 1 (version 1), size 0.
/// A daemon serving one 16 MiB device `vm1` with one queue on `sock`.
fn vm1(dir: &TempDir, sock: &Path) -> Daemon {
    Daemon::start(
        dir,
        &[
            "--socket",
            s(sock),
            "--size",
            "16M",
            "--name",
            "vm1",
            "--queues",
            "1",
        ],
        &[sock],
    )
}

fn get_features() -> [u8; 12] {
    let mut m = [0u8; 12];
    m[0..4].copy_from_slice(&1u32.to_le_bytes());
    m[4..8].copy_from_slice(&1u32.to_le_bytes());
    m
}

#[test]
fn a_second_frontend_is_turned_away_promptly() {
    let dir = TempDir::new("second");
    let sock = dir.join("d.sock");
    let d = vm1(&dir, &sock);
    let mut a = Client::connect(&sock, 1).unwrap();
    write_pages(&mut a, 2);

    // B: a raw frontend on the same socket asks for the features.
    let start = Instant::now();
    let mut b = UnixStream::connect(&sock).expect("connect B");
    b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    b.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    // The daemon may close B before the request is even written (EPIPE):
    // that is as good as closing it after.
    let wrote = b.write_all(&get_features());
    let mut buf = [0u8; 64];
    match b.read(&mut buf) {
        Ok(0) => {}
        Ok(n) => panic!(
            "the second frontend was answered ({n} bytes: {:?}) while the first is connected",
            &buf[..n]
        ),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => panic!(
            "the second frontend got neither a reply nor a close within 5 s \
             (write: {wrote:?}); log:\n{}",
            d.log_text()
        ),
        // ECONNRESET: closed with our request unread.
        Err(_) => {}
    }
    let took = start.elapsed();
    drop(b);
    assert!(took < Duration::from_secs(5), "closed only after {took:?}");
    assert!(
        wait_for_log(&d, "refused a second frontend", Duration::from_secs(10)),
        "no log line about the refused frontend:\n{}",
        d.log_text()
    );

    // A is still served, reads and writes.
    a.q(0).write(PAGES * 4096, &[0x5a; 4096]).unwrap();
    check_pages(&mut a, 2, "first frontend after the second was refused");
    assert_eq!(a.q(0).read(PAGES * 4096, 4096).unwrap(), vec![0x5a; 4096]);
    let dev = stat_device(&d, "vm1");
    assert_eq!(dev.connections, 1, "{dev:?}");
    assert!(dev.connected, "{dev:?}");

    // Once A has gone, C is served and sees A's data.
    drop(a);
    new_client_sees(&sock, 2, "client after the first left");
    assert_eq!(connections(&d, "vm1"), 2);
}

/// A frontend whose hang-up lands only after its reconnect (a process
/// forked from it held the socket a moment longer; a kill_io run in CI
/// hit this) is its own reconnect, not a second frontend: it is served
/// once the old connection goes, not turned away.
#[test]
fn a_reconnect_that_beats_its_own_hang_up_is_served() {
    let dir = TempDir::new("beats");
    let sock = dir.join("d.sock");
    let d = vm1(&dir, &sock);
    {
        let mut c = Client::connect(&sock, 1).unwrap();
        write_pages(&mut c, 4);
    }
    // The old connection: it has spoken, so a worker serves it.
    let mut old = UnixStream::connect(&sock).expect("connect the old frontend");
    old.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    old.write_all(&get_features()).unwrap();
    let mut reply = [0u8; 20];
    old.read_exact(&mut reply).expect("the features reply");

    let (tx, rx) = mpsc::channel();
    let sock2 = sock.clone();
    let t = std::thread::spawn(move || {
        let r = Client::connect(&sock2, 1).map_err(|e| e.to_string());
        tx.send(()).unwrap();
        r
    });
    // The new one has connected and waits; the old one goes only now.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        rx.try_recv().is_err(),
        "the reconnect ended (served or refused) while the old frontend is still there"
    );
    drop(old);
    let mut c = t
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("the reconnect was refused: {e}\n{}", d.log_text()));
    check_pages(&mut c, 4, "reconnect that beat its hang-up");
    assert!(
        !d.log_text().contains("refused a second frontend"),
        "the reconnect was told the device is busy:\n{}",
        d.log_text()
    );
}

/// `vzram stat --control <device socket>` must fail with a one-line error,
/// exit 1, well within 12 s (the client gives up after 10 s at most).
/// Returns the error line.
fn stat_on_device_socket(sock: &Path, what: &str) -> String {
    let (o, took) = Vzram::new(&["stat", "--control", s(sock)])
        .limit(Duration::from_secs(20))
        .timed();
    let err = stderr(&o);
    eprintln!("{what}: vzram stat took {took:?}: {err:?}");
    assert_eq!(o.status.code(), Some(1), "{what}: {err:?}");
    assert!(took < Duration::from_secs(12), "{what}: took {took:?}");
    assert_eq!(err.trim_end().lines().count(), 1, "{what}: {err:?}");
    assert!(err.starts_with("error:"), "{what}: {err:?}");
    assert!(o.stdout.is_empty(), "{what}: stdout {:?}", o.stdout);
    assert!(
        err.contains("control socket?"),
        "{what}: no hint in {err:?}"
    );
    err
}

#[test]
fn stat_on_an_idle_device_socket_fails_quickly() {
    let dir = TempDir::new("statidle");
    let sock = dir.join("d.sock");
    let d = vm1(&dir, &sock);
    // Which error it names depends on when the daemon hangs up on the
    // request line (a reset, a broken pipe, no reply): only its shape and
    // speed are checked.
    let err = stat_on_device_socket(&sock, "idle");
    assert!(err.contains(s(&sock)), "{err:?}");
    // The control client's line is no frontend: not counted, and the device
    // serves the next real one.
    assert_eq!(
        connections(&d, "vm1"),
        0,
        "the stat request was counted as a frontend connection:\n{}",
        d.log_text()
    );
    let mut c = Client::connect(&sock, 1).unwrap();
    write_pages(&mut c, 3);
    check_pages(&mut c, 3, "frontend after the stat");
    assert_eq!(connections(&d, "vm1"), 1, "{}", d.log_text());
}

#[test]
fn stat_on_a_busy_device_socket_fails_quickly() {
    let dir = TempDir::new("statbusy");
    let sock = dir.join("d.sock");
    let d = vm1(&dir, &sock);
    let mut c = Client::connect(&sock, 1).unwrap();
    write_pages(&mut c, 4);
    let err = stat_on_device_socket(&sock, "busy");
    assert!(err.contains(s(&sock)), "{err:?}");
    // The connected frontend did not notice.
    check_pages(&mut c, 4, "frontend after the stat");
    let dev = stat_device(&d, "vm1");
    assert_eq!(dev.connections, 1, "{dev:?}");
    assert!(dev.connected, "{dev:?}");
}

#[test]
fn probes_of_a_served_socket_are_not_connections() {
    let dir = TempDir::new("probe");
    let sock = dir.join("d.sock");
    let d = vm1(&dir, &sock);

    // A second daemon on the same socket checks it, finds it live, gives up.
    let ctl = dir.join("second-control.sock");
    let (o, took) = Vzram::new(&["serve", "--socket", s(&sock), "--size", "1M"])
        .control(&ctl)
        .limit(Duration::from_secs(20))
        .timed();
    let err = stderr(&o);
    eprintln!("second serve: {:?} after {took:?}: {err:?}", o.status);
    assert_eq!(o.status.code(), Some(2), "{err:?}");
    assert!(err.contains("another process is serving it"), "{err:?}");
    let dev = stat_device(&d, "vm1");
    assert_eq!(dev.connections, 0, "after the second serve: {dev:?}");
    assert!(!dev.connected, "after the second serve: {dev:?}");

    // A bare connect and close.
    drop(UnixStream::connect(&sock).unwrap());
    let dev = stat_device(&d, "vm1");
    assert_eq!(dev.connections, 0, "after a bare connect: {dev:?}");

    // A real frontend is counted, once: the daemon takes connections in
    // order, so by now both probes have been dealt with.
    let mut c = Client::connect(&sock, 1).unwrap();
    write_pages(&mut c, 5);
    let dev = stat_device(&d, "vm1");
    assert_eq!(dev.connections, 1, "with one real frontend: {dev:?}");
    assert!(dev.connected, "{dev:?}");
    assert!(
        !d.log_text().contains("connection=2"),
        "a probe was logged as a connection:\n{}",
        d.log_text()
    );
}

/// A client that connects and says nothing must not keep the VM off its
/// disk: it gives way to the next client, which is served at once and is
/// not told the device is busy.
#[test]
fn a_silent_client_gives_way_to_the_vm() {
    let dir = TempDir::new("silent");
    let sock = dir.join("d.sock");
    let d = Daemon::start(
        &dir,
        &["--socket", s(&sock), "--size", "16M", "--name", "vm1"],
        &[&sock],
    );
    let _silent = UnixStream::connect(&sock).expect("connect the silent client");
    let start = Instant::now();
    let mut c = Client::connect(&sock, 1)
        .unwrap_or_else(|e| panic!("the VM was refused: {e}\n{}", d.log_text()));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "the VM waited {:?} behind a silent client",
        start.elapsed()
    );
    // An EIO here was seen once under load: the log says why if it recurs
    // (the daemon warns of each request the host fails).
    for p in 0..PAGES {
        if let Err(e) = c.q(0).write(p * 4096, &pattern(9, p * 4096, 4096)) {
            panic!("write {p} behind a silent client: {e}\n{}", d.log_text());
        }
    }
    check_pages(&mut c, 9, "behind a silent client");
    assert!(
        !d.log_text().contains("refused a second frontend"),
        "the VM was told the device is busy:\n{}",
        d.log_text()
    );
    assert_eq!(connections(&d, "vm1"), 1);
}
