//! libvirt's order of events: the destination device is made incoming at
//! "migrate begin", the stream starts, and only then does the destination
//! QEMU start and set up its vhost-user device (during its realize, before
//! it listens for the RAM migration). That set-up must be answered while
//! the stream still arrives: the supervisor, which receives for a device
//! no VM uses, hands the stream to the worker of the frontend that
//! connects. Used to deadlock: the set-up waited for the whole pre-copy,
//! which waited for the VM to stop on the source, which waited for QEMU's
//! migration, which waited for the destination QEMU.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vzram_tests::frontend::{Ram, RawDev, Setup};
use vzram_tests::migrating::*;
use vzram_tests::*;

/// A sending to B (its ring running), B's supervisor receiving with no
/// frontend; then B's QEMU connects and sets up (no ring yet, as QEMU at
/// realize) while A's guest keeps writing. Returns once that set-up is
/// done, with the pages A's guest wrote meanwhile (version 2).
struct Underway {
    e: Ends,
    va: RawDev,
    vb: RawDev,
    m: std::process::Child,
    stored: u64,
    rewritten: u64,
}

fn stream_then_frontend(tag: &str) -> Underway {
    let e = ends(tag, SIZE);
    write_all(&e.sock_a, 1);
    let stored = e.a.stat().counters("vm").orig_data_size;
    let mut va = RawDev::connect(&e.sock_a);
    let m = spawn_migrate(&e, &e.incoming);
    wait_state(&e.a, MigrationState::Sending, Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(30);
    while e.b.stat().counters("vm").orig_data_size < stored {
        assert!(Instant::now() < deadline, "B never got the first pass");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        e.b.stat().worker("vm").pid,
        None,
        "no frontend yet: B's supervisor receives"
    );
    // B's QEMU starts: its vhost-user set-up, as at device realize.
    let sock_b = e.sock_b.clone();
    let setup: JoinHandle<RawDev> = std::thread::spawn(move || {
        let mut vb = RawDev::handshake(&sock_b, Ram::standard());
        let table = vb.ram.table();
        vb.fe.set_mem_table(&table).expect("SET_MEM_TABLE");
        vb.fe.get_queue_num().expect("GET_QUEUE_NUM");
        vb
    });
    // Meanwhile A's guest writes: the stream carries records, not only
    // passes, while it changes hands.
    let mut rewritten = 0;
    // Only against a hang: the raw frontend waits for its answers for ever.
    let guard = Instant::now() + Duration::from_secs(90);
    while !setup.is_finished() {
        assert!(
            Instant::now() < guard,
            "B's frontend got no answer to its vhost-user set-up while the stream arrived (A is {:?}, B is {:?})\n{}",
            migration(&e.a).state,
            migration(&e.b).state,
            e.b.log_text()
        );
        if rewritten < PAGES / 2 {
            let i = rewritten * 2;
            assert_eq!(va.write(i * 8, &versioned_page_nonzero(i, 2)), 0);
            rewritten += 1;
        } else {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let vb = setup.join().unwrap_or_else(|_| {
        panic!(
            "B's frontend got no answer to its vhost-user set-up while the stream arrived (A is {:?}, B is {:?})",
            migration(&e.a).state,
            migration(&e.b).state
        )
    });
    // The set-up was done during the pre-copy: A's ring still runs.
    let (ma, mb) = (migration(&e.a), migration(&e.b));
    assert!(
        ma.state == MigrationState::Sending && mb.state == MigrationState::Receiving,
        "the set-up was not answered during the pre-copy: A {ma:?}, B {mb:?}\n{}",
        e.b.log_text()
    );
    assert!(
        e.b.stat().worker("vm").pid.is_some(),
        "B's frontend has a worker"
    );
    Underway {
        e,
        va,
        vb,
        m,
        stored,
        rewritten,
    }
}

/// Waits until B's worker `pid` holds the stream: the socket accepted on
/// B's incoming address is among its descriptors. A worker that has just
/// started may not have it yet; killed then, it never took the stream on,
/// and B's supervisor rightly goes on receiving it itself.
fn wait_holds_stream(e: &Ends, pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let streams = accepted_on(&e.incoming);
        let held = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|f| std::fs::read_link(f.path()).ok())
            .any(|l| {
                streams
                    .iter()
                    .any(|i| l.to_str() == Some(&format!("socket:[{i}]")))
            });
        if held {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "B's worker {pid} never took the stream on\n{}",
            e.b.log_text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Inodes of the connected sockets accepted on unix address `path`, from
/// /proc/net/unix (columns: Num RefCount Protocol Flags Type St Inode Path;
/// St 03 is connected).
fn accepted_on(path: &std::path::Path) -> Vec<u64> {
    let text = std::fs::read_to_string("/proc/net/unix").expect("/proc/net/unix");
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let ours = f.len() >= 8 && f[5] == "03" && Some(f[7]) == path.to_str();
            ours.then(|| f[6].parse().ok()).flatten()
        })
        .collect()
}

fn want(i: u64, rewritten: u64) -> Vec<u8> {
    if i.is_multiple_of(2) && i / 2 < rewritten {
        versioned_page_nonzero(i, 2)
    } else {
        expected(i, 1)
    }
}

/// The whole order: stream, destination QEMU set up during the pre-copy,
/// the source's rings stop (its last delta), the destination's start, the
/// commit; every page on the destination, the ones written during the
/// hand-over included.
#[test]
fn a_frontend_that_connects_while_the_stream_arrives_is_set_up_at_once() {
    let Underway {
        e,
        va,
        mut vb,
        m,
        rewritten,
        ..
    } = stream_then_frontend("migord");
    let b_log = e.b.log_text();
    assert!(b_log.contains("its worker takes the stream on"), "{b_log}");
    // QEMU's migration ends: A's VM stops, B's starts.
    va.fe.get_vring_base(0).expect("GET_VRING_BASE");
    wait_state(&e.a, MigrationState::Committing, Duration::from_secs(30));
    wait_state(&e.b, MigrationState::Prepared, Duration::from_secs(10));
    vb.setup_vring(Setup::default());
    let out = m.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", said(&out));
    assert_eq!(migration(&e.a).state, MigrationState::Sent);
    assert_eq!(migration(&e.b).state, MigrationState::Received);
    // B's VM reads on its own ring.
    let (status, got) = vb.read(8, PAGE);
    assert_eq!(status, 0);
    assert!(got == want(1, rewritten), "page 1 through B's ring");
    drop((va, vb));
    let mut c = Client::connect_retrying(&e.sock_b, 2, &e.b);
    check_all(&mut c, |i| want(i, rewritten), "destination");
}

/// The worker that took the stream on is killed (kill -9): as a failed
/// stream, the source keeps and serves every page, and the destination
/// waits for another stream, its requests held.
#[test]
fn a_kill_of_the_worker_that_took_the_stream_on_fails_the_move_only() {
    let Underway {
        e,
        va,
        vb,
        m,
        rewritten,
        stored,
    } = stream_then_frontend("migordk");
    let pid = e.b.worker_pid("vm");
    wait_holds_stream(&e, pid);
    // SAFETY: a signal to the worker process the test just looked up.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let out = m.wait_with_output().unwrap();
    let text = said(&out);
    assert!(!out.status.success(), "{text}");
    assert_eq!(migration(&e.a).state, MigrationState::SendFailed);
    wait_failed(&e.b, "B's worker killed");
    assert!(e.a.stat().counters("vm").orig_data_size >= stored);
    drop((va, vb));
    let mut c = Client::connect_retrying(&e.sock_a, 2, &e.a);
    check_all(&mut c, |i| want(i, rewritten), "source");
}

/// The other side of libvirt's order: a sender started before its
/// destination listens retries, but one sent to an address nobody ever
/// listens on (a typo, a destination that never ran its hook) fails once
/// its connect deadline is over, saying so, and changes nothing here.
#[test]
fn a_sender_to_an_address_nobody_listens_on_fails_after_its_retries_saying_why() {
    let e = ends("migtypo", SIZE);
    write_all(&e.sock_a, 1);
    let nowhere = e.db.join("typo.migrate");
    let mut m = spawn_migrate(&e, &nowhere);
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        m.try_wait().unwrap().is_none(),
        "no retry: it failed at once"
    );
    // Only against a hang: the connect deadline is 10 s.
    let guard = Instant::now() + Duration::from_secs(90);
    while m.try_wait().unwrap().is_none() {
        assert!(Instant::now() < guard, "the sender never gave up");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = m.wait_with_output().unwrap();
    let text = said(&out);
    eprintln!("a sender to nowhere: {text}");
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains(&format!("cannot connect to unix:{}", nowhere.display()))
            && text.contains("nothing listened there within 10000 ms"),
        "{text}"
    );
    assert!(!migration(&e.a).state.eq(&MigrationState::Sending));
    let mut c = Client::connect_retrying(&e.sock_a, 2, &e.a);
    check_all(&mut c, |i| expected(i, 1), "source");
}

/// The destination daemon is killed (kill -9 of its supervisor; its
/// launcher and workers die with it) once the frontend's worker has taken
/// the stream on: the source keeps and serves every page, and the
/// restarted destination starts empty, waiting for another stream.
#[test]
fn a_kill_of_the_destination_daemon_after_the_hand_over_fails_the_move_only() {
    let Underway {
        mut e,
        va,
        vb,
        m,
        rewritten,
        stored,
    } = stream_then_frontend("migordd");
    let worker = e.b.worker_pid("vm");
    e.b.kill9();
    let out = m.wait_with_output().unwrap();
    let text = said(&out);
    assert!(!out.status.success(), "{text}");
    assert_eq!(migration(&e.a).state, MigrationState::SendFailed);
    drop(vb);
    // The worker goes with its launcher; then B starts again.
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{worker}")).exists() {
        assert!(Instant::now() < deadline, "B's worker outlived its daemon");
        std::thread::sleep(Duration::from_millis(10));
    }
    let args: Vec<String> = e.b.args().to_vec();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    e.b = Daemon::start(&e.db, &args, &[&e.sock_b, &e.incoming]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(&e.b.control).is_err() {
        assert!(Instant::now() < deadline, "{}", e.b.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(migration(&e.b).state, MigrationState::Failed);
    assert_eq!(e.b.stat().counters("vm").orig_data_size, 0);
    assert!(e.a.stat().counters("vm").orig_data_size >= stored);
    drop(va);
    let mut c = Client::connect_retrying(&e.sock_a, 2, &e.a);
    check_all(&mut c, |i| want(i, rewritten), "source");
}
