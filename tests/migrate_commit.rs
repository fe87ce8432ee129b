//! A migration commits only on evidence that the VM runs on the
//! destination (its frontend started the rings, or an operator's
//! `--commit` after the last delta). A worker killed mid-send, an early
//! `--commit`, a pause, a QEMU exit (a save) or a `migrate` client that
//! hangs up leaves every page on the source, serving, and the destination
//! empty and waiting.

use std::time::{Duration, Instant};

use vhost::VhostBackend;
use vzram_tests::frontend::{Ram, RawDev, Setup};
use vzram_tests::migrating::*;
use vzram_tests::*;

/// Waits until B holds `stored` bytes: the first pass is there.
fn first_pass(e: &Ends, stored: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while e.b.stat().counters("vm").orig_data_size < stored {
        assert!(Instant::now() < deadline, "B never got the first pass");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A kept every page and serves them; B dropped its copy and waits.
fn source_whole_destination_waiting(e: &Ends, stored: u64, what: &str) -> MigrationStat {
    assert_eq!(migration(&e.a).state, MigrationState::SendFailed, "{what}");
    assert_eq!(e.a.stat().counters("vm").orig_data_size, stored, "{what}");
    let mb = wait_failed(&e.b, what);
    assert_eq!(e.b.stat().counters("vm").orig_data_size, 0, "{what}");
    let mut c = Client::connect_retrying(&e.sock_a, 2, &e.a);
    check_all(&mut c, |i| expected(i, 1), what);
    mb
}

/// The OOM killer, a panic or a SIGBUS takes the worker mid-send: the
/// supervisor does not send again holding the device itself (with no
/// frontend that looked like a finished move and committed at once, and
/// the VM's QEMU reconnected to an empty source). The send failed, as a
/// cancel would: the source serves every page, the destination, its
/// stream cut, drops its copy and waits.
#[test]
fn a_worker_killed_mid_send_leaves_the_source_serving_and_the_destination_waiting() {
    let e = ends("migk9", SIZE);
    write_all(&e.sock_a, 1);
    let stored = e.a.stat().counters("vm").orig_data_size;
    // A running ring: the guest writes, the send stays in pre-copy.
    let v = RawDev::connect(&e.sock_a);
    let m = spawn_migrate(&e, &e.incoming);
    wait_state(&e.a, MigrationState::Sending, Duration::from_secs(30));
    first_pass(&e, stored);
    let pid = e.a.worker_pid("vm");
    // SAFETY: a signal to the worker process the test just looked up.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let out = m.wait_with_output().unwrap();
    let text = said(&out);
    eprintln!("after kill -9 of the worker: {text}");
    assert!(!out.status.success(), "the send went on: {text}");
    assert!(text.contains("worker ended mid-send"), "{text}");
    drop(v);
    source_whole_destination_waiting(&e, stored, "worker killed");
}

/// `--commit` during pre-copy is refused (it used to be kept, and the
/// VM's next plain pause committed); a pause then commits nothing, and
/// the rings starting again abort the move.
#[test]
fn a_commit_before_the_last_delta_is_refused_and_a_pause_commits_nothing() {
    let e = ends("migec", SIZE);
    write_all(&e.sock_a, 1);
    let stored = e.a.stat().counters("vm").orig_data_size;
    let mut v = RawDev::connect(&e.sock_a);
    let m = spawn_migrate(&e, &e.incoming);
    wait_state(&e.a, MigrationState::Sending, Duration::from_secs(30));
    let out = ask(&e, "--commit");
    let text = said(&out);
    eprintln!("--commit in pre-copy: {text}");
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("only after the last delta"), "{text}");
    // QMP `stop`: the last delta goes, and the verdict waits.
    v.fe.get_vring_base(0).expect("GET_VRING_BASE");
    wait_state(&e.a, MigrationState::Committing, Duration::from_secs(30));
    wait_state(&e.b, MigrationState::Prepared, Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        migration(&e.a).state,
        MigrationState::Committing,
        "a pause committed"
    );
    assert_eq!(e.a.stat().counters("vm").orig_data_size, stored);
    // QMP `cont`: the VM runs here.
    v.setup_vring(Setup::default());
    let out = m.wait_with_output().unwrap();
    let text = said(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("started again"), "{text}");
    drop(v);
    source_whole_destination_waiting(&e, stored, "cont after an early commit");
}

/// `virsh save` with a forgotten sender: QEMU stops the rings and exits,
/// and nothing starts on the destination. That is no migration: once the
/// grace for the destination's start has passed the move is aborted, and
/// the restored VM reads every page on the source.
#[test]
fn a_qemu_exit_after_a_pause_commits_nothing() {
    let e = ends("migsv", SIZE);
    write_all(&e.sock_a, 1);
    let stored = e.a.stat().counters("vm").orig_data_size;
    let v = RawDev::connect(&e.sock_a);
    v.fe.get_vring_base(0).expect("GET_VRING_BASE");
    let m = spawn_migrate(&e, &e.incoming);
    wait_state(&e.a, MigrationState::Committing, Duration::from_secs(30));
    wait_state(&e.b, MigrationState::Prepared, Duration::from_secs(10));
    // The saved QEMU exits.
    drop(v);
    let out = m.wait_with_output().unwrap();
    let text = said(&out);
    eprintln!("after the QEMU exit: {text}");
    assert!(!out.status.success(), "the exit committed: {text}");
    assert!(text.contains("did not start its rings"), "{text}");
    let mb = source_whole_destination_waiting(&e, stored, "QEMU exit");
    assert!(
        mb.error.as_deref().unwrap().contains("did not start"),
        "{mb:?}"
    );
}

/// Whichever side's rings start first wins: rings that start here after
/// the last delta and stop again before the destination's VM starts still
/// abort the move (the VM ran here; the destination's copy is stale).
#[test]
fn rings_that_ran_here_after_the_last_delta_win_over_a_later_start_there() {
    let e = ends("migss", SIZE);
    write_all(&e.sock_a, 1);
    let stored = e.a.stat().counters("vm").orig_data_size;
    let mut va = RawDev::connect(&e.sock_a);
    va.fe.get_vring_base(0).expect("GET_VRING_BASE");
    // B's QEMU waits for the migration: connected, no ring started.
    let mut vb = RawDev::handshake(&e.sock_b, Ram::standard());
    let table = vb.ram.table();
    vb.fe.set_mem_table(&table).expect("SET_MEM_TABLE");
    let m = spawn_migrate(&e, &e.incoming);
    wait_state(&e.a, MigrationState::Committing, Duration::from_secs(30));
    wait_state(&e.b, MigrationState::Prepared, Duration::from_secs(10));
    // A `cont` and a `stop` here, quickly; then B's VM starts.
    va.setup_vring(Setup::default());
    va.fe.get_vring_base(0).expect("GET_VRING_BASE");
    vb.setup_vring(Setup::default());
    let out = m.wait_with_output().unwrap();
    let text = said(&out);
    eprintln!("start and stop here, then a start there: {text}");
    assert!(!out.status.success(), "committed: {text}");
    assert!(text.contains("started again here"), "{text}");
    drop((va, vb));
    source_whole_destination_waiting(&e, stored, "a start here first");
}

/// The destination's VM starting its rings is the evidence: the source
/// commits with its own frontend still there (QEMU keeps its paused
/// source process until libvirt's Confirm).
#[test]
fn the_destination_starting_its_rings_commits() {
    let e = ends("migds", SIZE);
    write_all(&e.sock_a, 1);
    let stored = e.a.stat().counters("vm").orig_data_size;
    let va = RawDev::connect(&e.sock_a);
    va.fe.get_vring_base(0).expect("GET_VRING_BASE");
    let mut vb = RawDev::handshake(&e.sock_b, Ram::standard());
    let table = vb.ram.table();
    vb.fe.set_mem_table(&table).expect("SET_MEM_TABLE");
    let m = spawn_migrate(&e, &e.incoming);
    wait_state(&e.a, MigrationState::Committing, Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(migration(&e.a).state, MigrationState::Committing);
    vb.setup_vring(Setup::default());
    let out = m.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", said(&out));
    assert_eq!(migration(&e.a).state, MigrationState::Sent);
    assert_eq!(migration(&e.b).state, MigrationState::Received);
    assert_eq!(e.b.stat().counters("vm").orig_data_size, stored);
    assert_eq!(e.a.stat().counters("vm").orig_data_size, 0);
    drop((va, vb));
    let mut c = Client::connect_retrying(&e.sock_b, 2, &e.b);
    check_all(&mut c, |i| expected(i, 1), "destination");
}

/// Ctrl-C on `vzram migrate` used to leave its send running, to be
/// committed by whatever came next: now the send is cancelled.
#[test]
fn a_migrate_whose_client_hangs_up_is_cancelled() {
    let e = ends("mighu", SIZE);
    write_all(&e.sock_a, 1);
    let stored = e.a.stat().counters("vm").orig_data_size;
    let v = RawDev::connect(&e.sock_a);
    let mut m = spawn_migrate(&e, &e.incoming);
    wait_state(&e.a, MigrationState::Sending, Duration::from_secs(30));
    first_pass(&e, stored);
    m.kill().unwrap();
    m.wait().unwrap();
    wait_state(&e.a, MigrationState::SendFailed, Duration::from_secs(20));
    drop(v);
    let mb = source_whole_destination_waiting(&e, stored, "client hung up");
    assert!(mb.error.as_deref().unwrap().contains("cancelled"), "{mb:?}");
}

/// Evacuating a host runs a `migrate` per device, each holding its control
/// connection for the whole send: 64 of them used to fill the control
/// socket's cap, and `stat`, `--cancel` and `--commit` were refused. A
/// running send no longer counts against the cap.
#[test]
fn sixty_four_sends_leave_room_for_stat_and_cancel() {
    use std::io::Write;
    use std::os::unix::net::{UnixListener, UnixStream};
    const N: usize = 64;
    let dir = TempDir::new("mig64");
    let socks: Vec<_> = (0..N).map(|i| dir.join(&format!("d{i}.sock"))).collect();
    let specs: Vec<String> = (0..N)
        .map(|i| format!("socket={},size=4M,name=d{i}", s(&socks[i])))
        .collect();
    let mut args = Vec::new();
    for sp in &specs {
        args.extend(["--device", sp.as_str()]);
    }
    let paths: Vec<&std::path::Path> = socks.iter().map(|p| p.as_path()).collect();
    let d = Daemon::start(&dir, &args, &paths);
    // A destination that takes every stream and says nothing: each send
    // waits for its answer.
    let hold = dir.join("hold.sock");
    let l = UnixListener::bind(&hold).unwrap();
    let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let keep = held.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            keep.lock().unwrap().push(c.unwrap());
        }
    });
    let clients: Vec<UnixStream> = (0..N)
        .map(|i| {
            let mut c = UnixStream::connect(&d.control).unwrap();
            let req = json!({"cmd": "migrate", "device": format!("d{i}"), "to": format!("unix:{}", hold.display())});
            writeln!(c, "{req}").unwrap();
            c
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while held.lock().unwrap().len() < N {
        assert!(
            Instant::now() < deadline,
            "{} sends connected",
            held.lock().unwrap().len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // All 64 under way: an operator still sees them and steers them.
    let st = d.control(json!({"cmd": "stat"}));
    assert_eq!(st["ok"], true, "stat refused: {st}");
    let c = d.control(json!({"cmd": "cancel-migration", "device": "d0"}));
    assert_eq!(c["ok"], true, "cancel refused: {c}");
    let c = d.control(json!({"cmd": "commit-migration", "device": "d1"}));
    let err = c["error"].as_str().unwrap_or_default().to_string();
    assert!(err.contains("after the last delta"), "{c}");
    // The destination goes: every send fails, every page stays.
    held.lock().unwrap().clear();
    drop(clients);
    let st = d.stat();
    assert!(st
        .devices()
        .iter()
        .all(|m| m.migration.state != MigrationState::Sent));
}

/// libvirt's order: the sender is started before the destination device
/// exists (its hook runs at "migrate begin", the source's before `virsh
/// migrate`). It tries again until its connect deadline instead of failing
/// at once.
#[test]
fn a_sender_started_before_the_destination_exists_connects_once_it_does() {
    let e = ends("migearly", SIZE);
    write_all(&e.sock_a, 1);
    let late = e.db.join("late.sock");
    let mut m = spawn_migrate(&e, &late);
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        m.try_wait().unwrap().is_none(),
        "the sender gave up at once"
    );
    let spec = format!(
        "socket={},size={SIZE},name=late,incoming=unix:{}",
        s(&e.db.join("late-dev.sock")),
        s(&late)
    );
    let out = Vzram::new(&["add", "--control", s(&e.b.control), "--device", &spec]).output();
    assert!(out.status.success(), "{}", said(&out));
    wait_state(&e.a, MigrationState::Committing, Duration::from_secs(30));
    let c = ask(&e, "--commit");
    assert!(c.status.success(), "{}", said(&c));
    let out = m.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", said(&out));
    let st = e.b.stat();
    assert_eq!(st.dev("late").migration.state, MigrationState::Received);
}
