//! Live migration between two real daemons over a unix socket: the pages
//! arrive intact (with and without a frontend writing meanwhile), requests
//! sent to the incoming device wait and then see the migrated data, and a
//! size mismatch or a hostile stream is refused with the destination still
//! waiting and holding nothing.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use vzram_tests::migrating::*;
use vzram_tests::*;

#[test]
fn a_device_migrates_intact_and_the_source_drops_its_copy() {
    let e = ends("mig", SIZE);
    write_all(&e.sock_a, 1);
    let stored = e.a.stat().counters("vm").orig_data_size;
    assert_eq!(migration(&e.b).state, MigrationState::Incoming);
    let t0 = Instant::now();
    let mut m = spawn_migrate(&e, &e.incoming);
    wait_state(&e.a, MigrationState::Committing, Duration::from_secs(60));
    // No frontend anywhere (a cold move): nothing says where the VM runs,
    // so nothing commits yet, and both ends hold every page.
    std::thread::sleep(Duration::from_millis(500));
    assert!(m.try_wait().unwrap().is_none(), "committed on no evidence");
    assert_eq!(migration(&e.b).state, MigrationState::Prepared);
    assert_eq!(e.a.stat().counters("vm").orig_data_size, stored);
    // Only after the last delta may the operator say the VM moved.
    let c = ask(&e, "--commit");
    assert!(c.status.success(), "{}", said(&c));
    let out = m.wait_with_output().unwrap();
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
    // The destination's VM waits for its pages (QEMU -incoming): its
    // frontend is connected, and it starts the rings once it runs.
    let cb = Client::connect(&e.sock_b, 2).expect("connect to B");
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
        // The VM moves: its frontend here leaves (the last delta); the one
        // on B has its rings running (the commit).
        tx.send(()).unwrap();
        m.join().unwrap()
    });
    let mut cb = cb;
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
    check_all(&mut cb, want, "destination");
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
        let first = c.q(1).read(0, PAGE).unwrap();
        (first, Instant::now(), c)
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        !reader.is_finished(),
        "a read completed before the pages came"
    );
    assert_eq!(migration(&e.b).state, MigrationState::Incoming);
    let began = Instant::now();
    let out = migrate(&e, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (first, done, mut c) = reader.join().unwrap();
    assert!(
        done > began,
        "the read completed before the migration began"
    );
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
    // A hears the refusal before B has recorded it.
    let m = wait_failed(&e.b, "a size mismatch");
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

/// A valid stream header for B's device (64 MiB, lz4).
fn header() -> Vec<u8> {
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
    h
}

/// A tiny hostile sender: a valid header, then whatever it is given.
fn hostile(incoming: &Path, body: &[u8]) -> Vec<u8> {
    let mut c = UnixStream::connect(incoming).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let h = header();
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
    let out = migrate_committed(&e, &[]);
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

/// Starts B again with the same arguments (`kill`: SIGKILL first).
fn restart_b(e: &mut Ends, kill: bool) {
    if kill {
        e.b.kill9();
    } else {
        e.b.terminate_cleanly();
    }
    let args: Vec<String> = e.b.args().to_vec();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    e.b = Daemon::start(&e.db, &args, &[&e.sock_b, &e.incoming]);
    // A killed daemon leaves its control socket file: wait for the new one.
    let deadline = Instant::now() + Duration::from_secs(20);
    while UnixStream::connect(&e.b.control).is_err() {
        assert!(Instant::now() < deadline, "{}", e.b.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A paused VM keeps its disk: QEMU stops the rings on every `stop`, reset
/// and reboot, so a stop is not the end of a migration. The destination
/// gets every page and waits for the commit; the rings start again (a
/// `cont`) and the move is aborted: the source still has every page, the
/// destination is empty and waits for another stream.
#[test]
fn rings_that_start_again_abort_the_move_and_the_source_keeps_every_page() {
    use vhost::VhostBackend;
    use vzram_tests::frontend::{RawDev, Setup};
    let e = ends("migc", SIZE);
    write_all(&e.sock_a, 1);
    let stored = e.a.stat().counters("vm").orig_data_size;
    let mut v = RawDev::connect(&e.sock_a);
    // QMP `stop`: the ring is stopped.
    v.fe.get_vring_base(0).expect("GET_VRING_BASE");
    let mut m = spawn_migrate(&e, &e.incoming);
    let st = wait_state(&e.a, MigrationState::Committing, Duration::from_secs(30));
    let sb = wait_state(&e.b, MigrationState::Prepared, Duration::from_secs(5));
    assert_eq!(e.b.stat().counters("vm").orig_data_size, stored);
    eprintln!("stopped VM: source {st:?}, destination {sb:?}");
    // Still waiting a second later: a stop commits nothing.
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        m.try_wait().unwrap().is_none(),
        "the migrate ended on a stop"
    );
    // QMP `cont`: the ring starts again.
    v.setup_vring(Setup::default());
    let out = m.wait_with_output().unwrap();
    let text = said(&out);
    eprintln!("after cont: {text}");
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("started again"), "{text}");
    drop(v);
    assert_eq!(migration(&e.a).state, MigrationState::SendFailed);
    assert_eq!(e.a.stat().counters("vm").orig_data_size, stored);
    let mut c = Client::connect(&e.sock_a, 2).expect("connect to A");
    check_all(&mut c, |i| expected(i, 1), "source after the abort");
    let m = wait_failed(&e.b, "abort");
    assert!(
        m.error.as_deref().unwrap().contains("started again"),
        "{m:?}"
    );
    assert_eq!(e.b.stat().counters("vm").orig_data_size, 0);
}

/// A VMM migration called off in pre-copy (QMP `migrate_cancel` while the
/// guest runs) never stops the rings, so nothing would end the send:
/// `vzram migrate --cancel` aborts it at once. The source keeps every page
/// and may migrate again; the destination drops what it took and waits.
#[test]
fn a_cancel_in_pre_copy_aborts_the_move_and_a_later_migrate_goes_through() {
    use vzram_tests::frontend::RawDev;
    let e = ends("migx", SIZE);
    write_all(&e.sock_a, 1);
    let stored = e.a.stat().counters("vm").orig_data_size;
    let cancel = || {
        Vzram::new(&["migrate", "--control", s(&e.a.control), "--device", "vm"])
            .arg("--cancel")
            .output()
    };
    // Nothing to cancel yet: refused, exit 2.
    let out = cancel();
    assert_eq!(out.status.code(), Some(2), "{}", said(&out));
    assert!(
        said(&out).contains("no migration to cancel"),
        "{}",
        said(&out)
    );
    // A running ring: the device is never quiet, the send stays in pre-copy.
    let v = RawDev::connect(&e.sock_a);
    let m = spawn_migrate(&e, &e.incoming);
    wait_state(&e.a, MigrationState::Sending, Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(30);
    while e.b.stat().counters("vm").orig_data_size < stored {
        assert!(Instant::now() < deadline, "B never got the first pass");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(migration(&e.a).state, MigrationState::Sending);
    let out = cancel();
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("send-failed"), "{text}");
    let out = m.wait_with_output().unwrap();
    let text = said(&out);
    eprintln!("after the cancel: {text}");
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("cancelled by the operator"), "{text}");
    let mb = wait_failed(&e.b, "cancel");
    assert!(mb.error.as_deref().unwrap().contains("cancelled"), "{mb:?}");
    assert_eq!(e.b.stat().counters("vm").orig_data_size, 0);
    drop(v);
    assert_eq!(migration(&e.a).state, MigrationState::SendFailed);
    assert_eq!(e.a.stat().counters("vm").orig_data_size, stored);
    let mut c = Client::connect(&e.sock_a, 2).expect("connect to A");
    check_all(&mut c, |i| expected(i, 1), "source after the cancel");
    drop(c);
    // The VM never left: a later migration is allowed and completes.
    no_worker(&e.a);
    let out = migrate_committed(&e, &[]);
    assert!(out.status.success(), "{}", said(&out));
    assert_eq!(migration(&e.b).state, MigrationState::Received);
    let mut c = Client::connect(&e.sock_b, 2).expect("connect to B");
    check_all(&mut c, |i| expected(i, 1), "destination");
}

/// A listener that confirms with a record count and checksum of its own
/// (here: 0 pages) gets an abort, and the source keeps everything.
#[test]
fn a_destination_that_confirms_what_it_did_not_get_gets_nothing_dropped() {
    let e = ends("migk", SIZE);
    write_all(&e.sock_a, 1);
    no_worker(&e.a);
    let stored = e.a.stat().counters("vm").orig_data_size;
    let fake = e.db.join("fake.sock");
    let l = std::os::unix::net::UnixListener::bind(&fake).unwrap();
    let liar = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        c.write_all(b"A").unwrap();
        c.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0usize;
        // Until the source stops sending: it waits for the confirmation.
        while let Ok(n) = c.read(&mut buf) {
            if n == 0 {
                break;
            }
            got += n;
        }
        let mut k = vec![b'K'];
        k.extend_from_slice(&[0u8; 20]);
        c.write_all(&k).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut rest = Vec::new();
        let _ = c.read_to_end(&mut rest);
        (got, rest)
    });
    let out = spawn_migrate(&e, &fake).wait_with_output().unwrap();
    let text = said(&out);
    let (got, rest) = liar.join().unwrap();
    eprintln!("a lying destination took {got} bytes; the source said: {text}");
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("the destination confirmed 0 records"),
        "{text}"
    );
    // The abort ('B', its reason) follows whatever of the stream the liar
    // had not read yet when it answered.
    let abort = String::from_utf8_lossy(&rest);
    assert!(
        abort.contains("the destination confirmed 0 records"),
        "the source did not abort: {} bytes after the answer",
        rest.len()
    );
    assert_eq!(e.a.stat().counters("vm").orig_data_size, stored);
    assert_eq!(migration(&e.a).state, MigrationState::SendFailed);
    let mut c = Client::connect(&e.sock_a, 2).expect("connect to A");
    check_all(&mut c, |i| expected(i, 1), "source");
}

/// One migration per device: while one runs a second is refused at once,
/// and a device already sent (its pages dropped) refuses another. A
/// restart of the destination after its commit does not make it incoming
/// again.
#[test]
fn one_migration_per_device_and_a_committed_destination_stays_received() {
    let mut e = ends("mig1", SIZE);
    write_all(&e.sock_a, 1);
    no_worker(&e.a);
    // A destination that accepts and says nothing holds the first migrate.
    let hold = e.db.join("hold.sock");
    let l = std::os::unix::net::UnixListener::bind(&hold).unwrap();
    let first = spawn_migrate(&e, &hold);
    let (held, _) = l.accept().unwrap();
    let second = migrate(&e, &[]);
    let text = said(&second);
    assert!(!second.status.success(), "{text}");
    assert!(text.contains("already under way"), "{text}");
    drop(held);
    let out = first.wait_with_output().unwrap();
    assert!(!out.status.success(), "{}", said(&out));
    // Now for real, then again.
    let out = migrate_committed(&e, &[]);
    assert!(out.status.success(), "{}", said(&out));
    let again = migrate(&e, &[]);
    let text = said(&again);
    assert!(!again.status.success(), "{text}");
    assert!(text.contains("was sent to another daemon"), "{text}");
    assert_eq!(migration(&e.b).state, MigrationState::Received);
    // A restart with the same `--incoming`: it serves at once.
    restart_b(&mut e, false);
    assert_eq!(migration(&e.b).state, MigrationState::Received);
    let mut c = Client::connect(&e.sock_b, 2).expect("connect to B");
    check_all(&mut c, |i| expected(i, 1), "destination after a restart");
    // A reset source can be used, and sent, again.
    let r: Reset = e.a.request(json!({"cmd": "reset", "device": "vm"}));
    assert_eq!(r.device, "vm");
    assert_eq!(migration(&e.a).state, MigrationState::None);
}

/// A header, then `body` written slowly: `pace` between bytes.
fn trickle(incoming: &Path, body: &[u8], pace: Duration) -> std::thread::JoinHandle<()> {
    let incoming = incoming.to_path_buf();
    let body = body.to_vec();
    std::thread::spawn(move || {
        let mut c = UnixStream::connect(&incoming).unwrap();
        if c.write_all(&header()).is_err() {
            return;
        }
        for b in body {
            std::thread::sleep(pace);
            if c.write_all(&[b]).is_err() {
                return;
            }
        }
        std::thread::sleep(Duration::from_secs(30));
    })
}

/// Raw pages for slots 0.. as a stream body (no final marker).
fn raw_pages(n: u64) -> Vec<u8> {
    let mut body = b"P".to_vec();
    body.extend_from_slice(&1u32.to_le_bytes());
    for i in 0..n {
        body.push(b'R');
        body.extend_from_slice(&i.to_le_bytes());
        body.extend_from_slice(&versioned_page_nonzero(i, 1));
    }
    body
}

/// A peer that sends a byte now and then (never stalling long enough for
/// the per-read limit) is cut at the stream's deadline; `reset` cuts one
/// at once instead of being refused.
#[test]
fn a_trickling_peer_is_cut_at_the_deadline_and_reset_cuts_it_at_once() {
    let e = ends_with("migt", SIZE, &["--incoming-timeout", "3s"]);
    let t = Instant::now();
    let _peer = trickle(&e.incoming, &raw_pages(1), Duration::from_millis(500));
    wait_state(&e.b, MigrationState::Receiving, Duration::from_secs(5));
    let m = wait_failed_within(&e.b, Duration::from_secs(15));
    let took = t.elapsed();
    eprintln!("trickling peer cut after {took:?}: {m:?}");
    assert!(m.error.as_deref().unwrap().contains("deadline"), "{m:?}");
    // The whole timeout, not one cut to whole seconds as the owner gets it.
    assert!(took >= Duration::from_secs(3), "{took:?}");
    assert!(took < Duration::from_secs(8), "{took:?}");
    // Reset during a stream: it is cut and the device serves, empty.
    let _peer = trickle(&e.incoming, &raw_pages(1), Duration::from_millis(500));
    wait_state(&e.b, MigrationState::Receiving, Duration::from_secs(5));
    let t = Instant::now();
    let r: Reset = e.b.request(json!({"cmd": "reset", "device": "vm"}));
    assert_eq!(r.device, "vm");
    eprintln!("reset during a stream took {:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert_eq!(migration(&e.b).state, MigrationState::None);
}

fn wait_failed_within(d: &Daemon, limit: Duration) -> MigrationStat {
    wait_state(d, MigrationState::Failed, limit)
}

/// A destination killed mid-stream holds nothing when it starts again: the
/// stream was never committed.
#[test]
fn a_destination_killed_mid_stream_starts_empty() {
    let mut e = ends("migx", SIZE);
    let body = raw_pages(200);
    let _peer = trickle(&e.incoming, &body[..body.len() - 10], Duration::ZERO);
    // Wait until most pages are stored.
    let deadline = Instant::now() + Duration::from_secs(20);
    while e.b.stat().counters("vm").orig_data_size < 150 * PAGE as u64 {
        assert!(Instant::now() < deadline, "{:?}", migration(&e.b));
        std::thread::sleep(Duration::from_millis(20));
    }
    restart_b(&mut e, true);
    let m = migration(&e.b);
    eprintln!("after kill -9 mid-stream and a restart: {m:?}");
    assert_eq!(m.state, MigrationState::Failed, "{m:?}");
    assert_eq!(e.b.stat().counters("vm").orig_data_size, 0);
    assert!(e.b.log_text().contains("cut short before its commit"));
}

/// The incoming socket has its own mode: whoever connects writes the
/// device's pages, so a group that may reach the device sockets
/// (`--socket-mode 0660`) does not get it.
#[test]
fn the_incoming_socket_has_its_own_mode() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let e = ends_with("inmode", SIZE, &["--socket-mode", "0660"]);
    assert_eq!(mode(&e.sock_b), 0o660);
    assert_eq!(mode(&e.incoming), 0o600, "the default");
    drop(e);
    let e = ends_with("inmode2", SIZE, &["--incoming-mode", "0640"]);
    assert_eq!(mode(&e.incoming), 0o640);
}
