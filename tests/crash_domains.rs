//! One VM's fault stays with that VM: each frontend is served by a worker
//! process of its own. A worker that dies (SIGBUS from its guest's memory,
//! SIGKILL) costs its device a reconnect; another device verifying at the
//! same time sees no error and no stall; a device whose workers keep dying
//! is backed off; no process maps two guests' memory.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vzram_tests::frontend::*;
use vzram_tests::*;

const SIZE: u64 = 16 << 20;
/// Longest a verifying device may wait for one request while its
/// neighbour's worker dies.
const MAX_STALL: Duration = Duration::from_secs(1);

fn two_devices(dir: &TempDir) -> (Daemon, std::path::PathBuf, std::path::PathBuf) {
    let a = dir.join("a.sock");
    let b = dir.join("b.sock");
    let spec = |n: &str, p: &Path| format!("socket={},size={SIZE},queues=1,name={n}", p.display());
    let d = Daemon::start(
        dir,
        &["--device", &spec("a", &a), "--device", &spec("b", &b)],
        &[&a, &b],
    );
    (d, a, b)
}

/// Device B writes and reads back pages in a loop until told to stop;
/// returns how many rounds it did and the longest single round.
fn verify_in_background(sock: &Path, stop: Arc<AtomicBool>) -> JoinHandle<(u64, Duration)> {
    let sock = sock.to_path_buf();
    std::thread::spawn(move || {
        let mut c = Client::connect(&sock, 1).expect("B connects");
        let mut rounds = 0u64;
        let mut worst = Duration::ZERO;
        while !stop.load(Ordering::Relaxed) || rounds < 20 {
            let t = Instant::now();
            let off = (rounds % 1024) * 16384;
            let data = pattern(rounds, off, 16384);
            c.q(0).write(off, &data).expect("B write");
            assert_eq!(
                c.q(0).read(off, data.len()).expect("B read"),
                data,
                "B round {rounds}"
            );
            worst = worst.max(t.elapsed());
            rounds += 1;
        }
        (rounds, worst)
    })
}

fn worker_of(d: &Daemon, name: &str) -> WorkerStatus {
    d.stat().worker(name).clone()
}

fn wait_for(d: &Daemon, what: &str, mut ok: impl FnMut(&WorkerStatus) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let w = worker_of(d, "a");
        if ok(&w) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {w:?}\n{}", d.log_text());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A frontend that truncates its own memory under the worker and kicks:
/// the worker faults (SIGBUS). Keep it until the failure shows, so that its
/// socket closing is not what ends the worker.
fn sigbus_frontend(sock: &Path) -> RawDev {
    let mut v = RawDev::connect(sock);
    v.truncate_memory_and_kick();
    v
}

#[test]
fn a_worker_killed_by_its_guest_memory_stops_no_one_else() {
    let dir = TempDir::new("cd-bus");
    let (mut d, a, b) = two_devices(&dir);
    let mut ca = Client::connect(&a, 1).unwrap();
    let before = noise(3, 1 << 20);
    ca.q(0).write(0, &before).unwrap();
    drop(ca);

    let stop = Arc::new(AtomicBool::new(false));
    let verify = verify_in_background(&b, stop.clone());
    std::thread::sleep(Duration::from_millis(200));
    let v = sigbus_frontend(&a);
    wait_for(&d, "a's worker never died", |w| w.failures == 1);
    drop(v);
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let (rounds, worst) = verify.join().expect("B's verify failed");
    eprintln!("B: {rounds} rounds, worst {worst:?}");
    assert!(
        worst < MAX_STALL,
        "B stalled {worst:?} while A's worker died"
    );

    assert!(d.wait_exit(Duration::ZERO).is_none(), "{}", d.log_text());
    let w = worker_of(&d, "a");
    assert!(
        w.last_failure.as_deref().unwrap().contains("SIGBUS"),
        "{w:?}"
    );
    // A serves a clean frontend again, with its data.
    let mut ca = Client::connect(&a, 1).unwrap();
    assert_eq!(ca.q(0).read(0, before.len()).unwrap(), before);
}

#[test]
fn a_worker_sigkilled_mid_io_costs_a_reconnect_only() {
    let dir = TempDir::new("cd-kill");
    let (d, a, b) = two_devices(&dir);
    let data = noise(4, 4 << 20);
    let mut ca = Client::connect(&a, 1).unwrap();
    ca.q(0).write(0, &data).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let verify = verify_in_background(&b, stop.clone());
    // A rewrites the same bytes over and over (every page stays old-or-new
    // = the same) while its worker is killed. Its client only times out on
    // the lost connection, so the thread is left to end with the test.
    let a_writes = Arc::new(std::sync::atomic::AtomicU64::new(0));
    {
        let a_writes = a_writes.clone();
        let data = data.clone();
        std::thread::spawn(move || {
            let mut i = 0usize;
            loop {
                let off = (i % 64) * 65536;
                if ca.q(0).write(off as u64, &data[off..off + 65536]).is_err() {
                    return;
                }
                i += 1;
                a_writes.store(i as u64, Ordering::Relaxed);
            }
        });
    }
    std::thread::sleep(Duration::from_millis(300));
    let pid = d.worker_pid("a") as i32;
    // SAFETY: signalling a process we just looked up.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    wait_for(&d, "the supervisor never saw the kill", |w| w.failures == 1);
    eprintln!(
        "A wrote {} times before the kill",
        a_writes.load(Ordering::Relaxed)
    );
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let (rounds, worst) = verify.join().expect("B's verify failed");
    eprintln!("B: {rounds} rounds, worst {worst:?}");
    assert!(worst < MAX_STALL, "B stalled {worst:?}");
    assert!(worker_of(&d, "a")
        .last_failure
        .as_deref()
        .unwrap()
        .contains("SIGKILL"));

    let t = Instant::now();
    let mut ca = Client::connect(&a, 1).unwrap();
    assert_eq!(ca.q(0).read(0, data.len()).unwrap(), data);
    eprintln!("A reconnected and read 4 MiB back in {:?}", t.elapsed());
}

#[test]
fn a_device_whose_workers_keep_dying_is_backed_off() {
    let dir = TempDir::new("cd-loop");
    let (d, a, b) = two_devices(&dir);
    let stop = Arc::new(AtomicBool::new(false));
    let verify = verify_in_background(&b, stop.clone());
    // When each worker was serving (its handshake answered).
    let mut served = Vec::new();
    for i in 1..=4u64 {
        let v = sigbus_frontend(&a);
        served.push(Instant::now());
        wait_for(&d, "no failure counted", |w| w.failures == i);
        drop(v);
    }
    stop.store(true, Ordering::Relaxed);
    let (rounds, worst) = verify.join().expect("B's verify failed");
    eprintln!("B: {rounds} rounds, worst {worst:?}");
    assert!(worst < MAX_STALL, "B stalled {worst:?}");
    let w = worker_of(&d, "a");
    assert_eq!(w.failing, 4, "{w:?}");
    assert_eq!(w.state, WorkerState::Failing, "{w:?}");
    // The daemon's account: no wait after the first death, then doubling.
    let log = d.log_text();
    for (n, wait) in [(1, "0ns"), (2, "100ms"), (3, "200ms"), (4, "400ms")] {
        let line = format!("{n} failures in a row, next worker in {wait}");
        assert!(log.contains(&line), "{line}:\n{log}");
    }
    // And the waits were kept: each worker died after it served, so the
    // next served no sooner than the wait after it. Not much later either,
    // though a loaded machine may take a while to start a worker.
    let gaps: Vec<Duration> = served.windows(2).map(|w| w[1] - w[0]).collect();
    eprintln!("from one worker serving to the next: {gaps:?}");
    for (k, gap) in gaps.iter().enumerate() {
        let backoff = match k {
            0 => Duration::ZERO,
            k => Duration::from_millis(100 << (k - 1)),
        };
        assert!(
            *gap >= backoff && *gap < backoff + Duration::from_secs(5),
            "{gaps:?}"
        );
    }
    // After a useful clean connection (a request served, a second
    // lived) the device is healthy again.
    std::thread::sleep(Duration::from_millis(500));
    let mut ca = Client::connect(&a, 1).unwrap();
    ca.q(0).write(0, &[7u8; 4096]).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    drop(ca);
    let deadline = Instant::now() + Duration::from_secs(10);
    while worker_of(&d, "a").failing != 0 {
        assert!(Instant::now() < deadline, "{:?}", worker_of(&d, "a"));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The memfd inodes `pid` maps (`/memfd:` mappings).
fn memfd_inodes(pid: u32) -> std::collections::BTreeSet<String> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("/memfd:"))
        .filter_map(|l| l.split_whitespace().nth(4).map(str::to_string))
        .collect()
}

#[test]
fn no_process_maps_two_guests_memory() {
    let dir = TempDir::new("cd-maps");
    let (d, a, b) = two_devices(&dir);
    let mut ca = Client::connect(&a, 1).unwrap();
    let mut cb = Client::connect(&b, 1).unwrap();
    ca.q(0).write(0, &[1u8; 4096]).unwrap();
    cb.q(0).write(0, &[2u8; 4096]).unwrap();
    // Guest memory: the memfds this test process (both "guests") maps.
    let guests = memfd_inodes(std::process::id());
    let wa = d.worker_pid("a");
    let wb = d.worker_pid("b");
    assert_ne!(wa, wb);
    let ma: Vec<_> = memfd_inodes(wa).intersection(&guests).cloned().collect();
    let mb: Vec<_> = memfd_inodes(wb).intersection(&guests).cloned().collect();
    eprintln!("guest memfds: {guests:?}; worker a maps {ma:?}, worker b maps {mb:?}");
    assert!(
        !ma.is_empty() && !mb.is_empty(),
        "workers map no guest memory?"
    );
    assert!(
        ma.iter().all(|i| !mb.contains(i)),
        "both workers map {ma:?} / {mb:?}"
    );
    for p in process_tree(d.pid()) {
        if p != wa && p != wb {
            let m: Vec<_> = memfd_inodes(p).intersection(&guests).cloned().collect();
            assert!(m.is_empty(), "process {p} maps guest memory {m:?}");
        }
    }
}

/// SIGTERM with a frontend connected: the worker is told to go and the
/// daemon exits as soon as it has, not after a timeout.
#[test]
fn stopping_with_a_connected_worker_is_prompt() {
    let dir = TempDir::new("cd-stop");
    let (mut d, a, _b) = two_devices(&dir);
    let mut ca = Client::connect(&a, 1).unwrap();
    ca.q(0).write(0, &[3u8; 4096]).unwrap();
    let worker = d.worker_pid("a");
    let t = Instant::now();
    assert!(d.terminate().success(), "{}", d.log_text());
    let took = t.elapsed();
    eprintln!("stopped in {took:?}");
    assert!(took < Duration::from_secs(2), "stopping took {took:?}");
    assert!(
        proc_status_field(worker, "State").is_none_or(|s| s.starts_with('Z')),
        "worker {worker} outlived the daemon"
    );
}
