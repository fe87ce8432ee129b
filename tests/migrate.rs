//! Live migration between two real daemons over a unix socket: the pages
//! arrive intact (with and without a frontend writing meanwhile), requests
//! sent to the incoming device wait and then see the migrated data, and a
//! size mismatch or a hostile stream is refused with the destination still
//! waiting and holding nothing.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use vzram_tests::*;

const SIZE: &str = "64M";
const PAGES: u64 = 64 << 8;

struct Ends {
    _da: TempDir,
    _db: TempDir,
    a: Daemon,
    b: Daemon,
    sock_a: PathBuf,
    sock_b: PathBuf,
    incoming: PathBuf,
}

/// Daemon A serves `vm` (64 MiB); daemon B serves `vm` of `size_b`,
/// incoming on a unix socket.
fn ends(tag: &str, size_b: &str) -> Ends {
    let da = TempDir::new(&format!("{tag}a"));
    let db = TempDir::new(&format!("{tag}b"));
    let sock_a = da.join("a.sock");
    let sock_b = db.join("b.sock");
    let incoming = db.join("in.sock");
    let a = Daemon::start(
        &da,
        &[
            "--socket",
            s(&sock_a),
            "--size",
            SIZE,
            "--name",
            "vm",
            "--queues",
            "2",
        ],
        &[&sock_a],
    );
    let inc = format!("unix:{}", incoming.display());
    let b = Daemon::start(
        &db,
        &[
            "--socket",
            s(&sock_b),
            "--size",
            size_b,
            "--name",
            "vm",
            "--queues",
            "2",
            "--incoming",
            &inc,
        ],
        &[&sock_b, &incoming],
    );
    Ends {
        _da: da,
        _db: db,
        a,
        b,
        sock_a,
        sock_b,
        incoming,
    }
}

fn migrate(e: &Ends, extra: &[&str]) -> Output {
    Command::new(vzram_bin())
        .args([
            "migrate",
            "--control",
            s(&e.a.control),
            "--device",
            "vm",
            "--to",
        ])
        .arg(format!("unix:{}", e.incoming.display()))
        .args(extra)
        .output()
        .unwrap()
}

fn migration(d: &Daemon) -> MigrationStat {
    d.stat().devices()[0].migration.clone()
}

fn write_all(sock: &Path, v: u64) {
    let mut c = Client::connect(sock, 2).expect("connect");
    for i in (0..PAGES).step_by(2) {
        c.q((i % 2) as usize)
            .write(i * PAGE as u64, &versioned_page_nonzero(i, v))
            .unwrap_or_else(|e| panic!("write page {i}: {e}"));
    }
}

fn check_all(c: &mut Client, want: impl Fn(u64) -> Vec<u8>, what: &str) {
    for i in 0..PAGES {
        let got = c.q(0).read(i * PAGE as u64, PAGE).unwrap();
        assert!(got == want(i), "{what}: page {i} differs");
    }
}

fn expected(i: u64, v: u64) -> Vec<u8> {
    if i.is_multiple_of(2) {
        versioned_page_nonzero(i, v)
    } else {
        vec![0; PAGE]
    }
}

#[test]
fn a_device_migrates_intact_and_the_source_drops_its_copy() {
    let e = ends("mig", SIZE);
    write_all(&e.sock_a, 1);
    let stored = e.a.stat().counters("vm").orig_data_size;
    assert_eq!(migration(&e.b).state, MigrationState::Incoming);
    let t0 = Instant::now();
    let out = migrate(&e, &[]);
    let took = t0.elapsed();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        e.b.log_text()
    );
    eprintln!("migrate: {text}(wall {took:?})");
    assert!(text.contains("pages dropped here"), "{text}");
    assert_eq!(migration(&e.b).state, MigrationState::Received);
    assert_eq!(e.b.stat().counters("vm").orig_data_size, stored);
    assert_eq!(
        e.a.stat().counters("vm").orig_data_size,
        0,
        "source dropped"
    );
    assert_eq!(migration(&e.a).state, MigrationState::Sent);
    let mut c = Client::connect(&e.sock_b, 2).expect("connect to B");
    check_all(&mut c, |i| expected(i, 1), "destination");
}

#[test]
fn writes_during_pre_copy_land_on_the_destination() {
    let e = ends("migw", SIZE);
    write_all(&e.sock_a, 1);
    // A frontend stays connected and keeps writing while the pages go:
    // its worker sends them, passes follow the writes, and the last delta
    // goes once the frontend has left.
    let sock_a = e.sock_a.clone();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rounds = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let written = rounds.clone();
    let writer = std::thread::spawn(move || {
        let mut c = Client::connect(&sock_a, 2).expect("connect");
        let mut v = 2;
        let mut last = vec![1u64; PAGES as usize];
        while rx.try_recv().is_err() {
            for i in (v % 5..PAGES).step_by(5) {
                if i.is_multiple_of(2) {
                    c.q(0)
                        .write(i * PAGE as u64, &versioned_page_nonzero(i, v))
                        .unwrap();
                    last[i as usize] = v;
                }
            }
            v += 1;
            written.store(v - 2, std::sync::atomic::Ordering::Relaxed);
        }
        last
    });
    // Only once the writer's rings run: a sender that starts first sees a
    // quiet device and finishes in one pass (a loaded machine connects late).
    let deadline = Instant::now() + Duration::from_secs(30);
    while rounds.load(std::sync::atomic::Ordering::Relaxed) < 1 {
        assert!(Instant::now() < deadline, "the writer never wrote a round");
        std::thread::sleep(Duration::from_millis(10));
    }
    let e2 = &e;
    let out = std::thread::scope(|sc| {
        let m = sc.spawn(|| migrate(e2, &["--keep"]));
        // Let a few passes go by while the writer writes (and has written
        // more than one round: a fast machine can pass three times first).
        let deadline = Instant::now() + Duration::from_secs(30);
        while migration(&e2.a).pass < 3 || rounds.load(std::sync::atomic::Ordering::Relaxed) < 3 {
            assert!(
                Instant::now() < deadline,
                "no delta passes: {:?}",
                migration(&e2.a)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(migration(&e2.a).state, MigrationState::Sending);
        assert_eq!(migration(&e2.b).state, MigrationState::Receiving);
        tx.send(()).unwrap();
        m.join().unwrap()
    });
    let last = writer.join().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("migrate while writing: {text}");
    assert!(text.contains("pages kept here"), "{text}");
    assert!(
        last.iter().any(|&v| v > 2),
        "the writer wrote during the migration"
    );
    let want = |i: u64| expected(i, last[i as usize]);
    let mut c = Client::connect(&e.sock_b, 2).expect("connect to B");
    check_all(&mut c, want, "destination");
    // --keep: the source still has everything too.
    let mut c = Client::connect(&e.sock_a, 2).expect("connect to A");
    check_all(&mut c, want, "source");
}

#[test]
fn requests_to_an_incoming_device_wait_then_see_the_migrated_pages() {
    let e = ends("migq", SIZE);
    write_all(&e.sock_a, 3);
    // The destination's frontend connects first and reads: its requests
    // wait in the ring.
    let sock_b = e.sock_b.clone();
    let reader = std::thread::spawn(move || {
        let mut c = Client::connect(&sock_b, 2).expect("connect to B");
        let t0 = Instant::now();
        let first = c.q(1).read(0, PAGE).unwrap();
        (first, t0.elapsed(), c)
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        !reader.is_finished(),
        "a read completed before the pages came"
    );
    assert_eq!(migration(&e.b).state, MigrationState::Incoming);
    let out = migrate(&e, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (first, waited, mut c) = reader.join().unwrap();
    assert!(waited >= Duration::from_millis(1500), "{waited:?}");
    assert!(
        first == versioned_page_nonzero(0, 3),
        "the waiting read saw other data"
    );
    check_all(&mut c, |i| expected(i, 3), "destination");
}

#[test]
fn a_size_mismatch_is_refused_on_both_ends() {
    let e = ends("migs", "32M");
    write_all(&e.sock_a, 1);
    let stored = e.a.stat().counters("vm").orig_data_size;
    let out = migrate(&e, &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("sizes must match") && err.lines().count() == 1,
        "{err}"
    );
    let m = migration(&e.b);
    assert_eq!(m.state, MigrationState::Failed, "{m:?}");
    assert!(
        m.error.as_deref().unwrap().contains("sizes must match"),
        "{m:?}"
    );
    assert_eq!(e.b.stat().counters("vm").orig_data_size, 0);
    assert_eq!(
        e.a.stat().counters("vm").orig_data_size,
        stored,
        "source kept"
    );
    assert_eq!(migration(&e.a).state, MigrationState::SendFailed);
}

/// The destination's migration once it shows a failure: the state is the
/// device's and the error the supervisor's, set a moment later.
fn wait_failed(d: &Daemon, what: &str) -> MigrationStat {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = migration(d);
        if m.state == MigrationState::Failed && m.error.is_some() {
            return m;
        }
        assert!(Instant::now() < deadline, "{what}: {m:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A tiny hostile sender: a valid header, then whatever it is given.
fn hostile(incoming: &Path, body: &[u8]) -> Vec<u8> {
    let mut c = UnixStream::connect(incoming).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut h = Vec::new();
    h.extend_from_slice(b"VZRAMMIG");
    h.extend_from_slice(&vzram_store::migrate::VERSION.to_le_bytes());
    h.extend_from_slice(&4096u32.to_le_bytes());
    h.extend_from_slice(&(64u64 << 20).to_le_bytes());
    h.extend_from_slice(&PAGES.to_le_bytes());
    h.push(0);
    let mut name = [0u8; 15];
    name[..3].copy_from_slice(b"lz4");
    h.extend_from_slice(&name);
    // A destination that refuses at once (it is not waiting) may close
    // before the header is in: the reply, read below, is what is checked.
    let _ = c.write_all(&h);
    let _ = c.write_all(body);
    let _ = c.shutdown(std::net::Shutdown::Write);
    let mut reply = Vec::new();
    let _ = c.read_to_end(&mut reply);
    reply
}

#[test]
fn a_hostile_stream_is_refused_and_the_destination_keeps_waiting() {
    let e = ends("migh", SIZE);
    // A raw page for slot 1, then a final marker with a wrong checksum.
    let mut body = b"P".to_vec();
    body.extend_from_slice(&1u32.to_le_bytes());
    body.push(b'R');
    body.extend_from_slice(&1u64.to_le_bytes());
    body.extend_from_slice(&[0x77; PAGE]);
    body.push(b'F');
    body.extend_from_slice(&1u64.to_le_bytes());
    body.extend_from_slice(&0xdead_beefu32.to_le_bytes());
    let reply = hostile(&e.incoming, &body);
    assert_eq!(reply.first(), Some(&b'A'), "the header was fine");
    let why = String::from_utf8_lossy(&reply);
    assert!(why.contains("checksum"), "{why}");
    let m = wait_failed(&e.b, "checksum");
    assert!(m.error.as_deref().unwrap().contains("checksum"), "{m:?}");
    assert_eq!(e.b.stat().counters("vm").orig_data_size, 0);
    // A slot past the end, and a stream cut short.
    let mut body = b"P".to_vec();
    body.extend_from_slice(&1u32.to_le_bytes());
    body.push(b'S');
    body.extend_from_slice(&(PAGES + 1).to_le_bytes());
    body.extend_from_slice(&7u64.to_le_bytes());
    let reply = hostile(&e.incoming, &body);
    assert!(String::from_utf8_lossy(&reply).contains("past the end"));
    let reply = hostile(&e.incoming, b"P\x01\x00\x00\x00R\x01\x00");
    assert!(String::from_utf8_lossy(&reply).contains("ended"));
    wait_failed(&e.b, "truncated");
    assert_eq!(e.b.stat().counters("vm").orig_data_size, 0);
    // Still waiting: requests wait, and a real migration still works.
    write_all(&e.sock_a, 5);
    let out = migrate(&e, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut c = Client::connect(&e.sock_b, 2).expect("connect to B");
    check_all(&mut c, |i| expected(i, 5), "destination");
}

#[test]
fn reset_gives_up_waiting_and_serves_an_empty_device() {
    let e = ends("migr", SIZE);
    let sock_b = e.sock_b.clone();
    let reader = std::thread::spawn(move || {
        let mut c = Client::connect(&sock_b, 2).expect("connect to B");
        c.q(0).read(0, PAGE).unwrap()
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(!reader.is_finished());
    let r: Reset = e.b.request(json!({"cmd": "reset", "device": "vm"}));
    assert_eq!(r.device, "vm", "{r:?}");
    assert!(reader.join().unwrap() == vec![0; PAGE]);
    assert_eq!(migration(&e.b).state, MigrationState::None);
    // No longer incoming: a stream is refused.
    let reply = hostile(&e.incoming, b"");
    assert!(
        reply.is_empty() || String::from_utf8_lossy(&reply).contains("not waiting"),
        "{:?}",
        String::from_utf8_lossy(&reply)
    );
}
