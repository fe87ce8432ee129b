//! Bugs the rest of the suite let through (issue 28): the backoff count
//! after a healthy run, each device's own latency histogram, a restarted
//! worker's recovered data, and the host budget after that recovery.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vzram_tests::metrics::{metric, scrape};
use vzram_tests::*;

const SIZE: u64 = 16 << 20;
const DEADLINE: Duration = Duration::from_secs(15);

fn spec(name: &str, sock: &Path) -> String {
    format!("socket={},size={SIZE},queues=1,name={name}", s(sock))
}

/// Polls `name`'s worker status until `ok`; fails with it and the log.
fn wait_worker(
    d: &Daemon,
    name: &str,
    what: &str,
    ok: impl Fn(&WorkerStatus) -> bool,
) -> WorkerStatus {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let w = d.stat().worker(name).clone();
        if ok(&w) {
            return w;
        }
        assert!(Instant::now() < deadline, "{what}: {w:?}\n{}", d.log_text());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SIGKILLs `name`'s running worker and waits until its death is counted
/// (the `failures`th); returns the status then.
fn kill_worker(d: &Daemon, name: &str, failures: u64) -> WorkerStatus {
    let w = wait_worker(d, name, "no running worker", |w| {
        w.state == WorkerState::Running && w.pid.is_some()
    });
    let pid = w.pid.unwrap() as i32;
    // SAFETY: signalling the worker pid the supervisor reports.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    wait_worker(d, name, "the kill was not counted", |w| {
        w.failures == failures && w.state != WorkerState::Running
    })
}

#[test]
fn a_healthy_run_restarts_the_backoff_count() {
    let dir = TempDir::new("sn-healthy");
    let a = dir.join("a.sock");
    let control = dir.join("control.sock");
    let mut cmd = Command::new(vzram_bin());
    cmd.args(["serve", "--device", &spec("a", &a), "--control"])
        .arg(&control)
        .env("VZRAM_HEALTHY_AFTER_MS", "1500");
    let d = Daemon::start_command(cmd, &control, &dir.join("daemon.log"), &[&a]);
    let page = pattern(1, 0, PAGE);

    // Two quick deaths in a row: the second is backed off.
    for n in 1..=2u64 {
        let mut c = Client::connect_retrying(&a, 1, &d);
        c.q(0).write(0, &page).unwrap();
        let w = kill_worker(&d, "a", n);
        assert_eq!(w.failing, n, "{w:?}");
        drop(c);
    }
    let w = d.stat().worker("a").clone();
    assert_eq!(w.state, WorkerState::Failing, "{w:?}");
    assert!(d.log_text().contains("next worker in 100ms"));

    // A worker that serves past the healthy run, then dies: a first
    // failure again, not the third in a row.
    let mut c = Client::connect_retrying(&a, 1, &d);
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(2500) {
        // An EIO here was seen once under load (CI beside a release
        // build): the daemon's log says why, if it happens again.
        let fail = |e: i32| -> ! { panic!("I/O failed: {e}\n{}", d.log_text()) };
        c.q(0).write(0, &page).unwrap_or_else(|e| fail(e));
        assert_eq!(c.q(0).read(0, PAGE).unwrap_or_else(|e| fail(e)), page);
        std::thread::sleep(Duration::from_millis(20));
    }
    let w = kill_worker(&d, "a", 3);
    assert_eq!(
        w.failing,
        1,
        "a death after {:?} of serving counted as consecutive: {w:?}",
        t.elapsed()
    );
    drop(c);
    let mut c = Client::connect_retrying(&a, 1, &d);
    assert_eq!(c.q(0).read(0, PAGE).unwrap(), page);
}

#[test]
fn each_device_reports_its_own_latency_histogram() {
    let dir = TempDir::new("sn-latency");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let d = Daemon::start(
        &dir,
        &[
            "--device",
            &spec("a", &a),
            "--device",
            &spec("b", &b),
            "--metrics",
            "127.0.0.1:0",
        ],
        &[&a, &b],
    );
    let addr: SocketAddr = d
        .stat()
        .0
        .metrics
        .expect("metrics address")
        .parse()
        .unwrap();
    // (device, writes, reads): different on each, so a swap shows.
    let plan = [("a", &a, 7u64, 3u64), ("b", &b, 19, 11)];
    for (_, sock, writes, reads) in plan {
        let mut c = Client::connect(sock, 1).unwrap();
        for p in 0..writes {
            c.q(0).write(p * 4096, &pattern(p, p * 4096, 4096)).unwrap();
        }
        for p in 0..reads {
            c.q(0).read(p * 4096, 4096).unwrap();
        }
    }
    // Both clients are gone: once their workers have exited every sample
    // is recorded.
    for (name, ..) in plan {
        wait_worker(&d, name, "the worker did not exit", |w| {
            w.state == WorkerState::Idle && w.failures == 0
        });
    }
    let body = scrape(addr);
    for (name, _, writes, reads) in plan {
        for (op, want) in [("write", writes), ("read", reads)] {
            let got = metric(
                &body,
                &format!(
                    "vzram_request_duration_seconds_count{{vzram_device=\"{name}\",op=\"{op}\"}}"
                ),
            );
            let counts: Vec<&str> = body
                .lines()
                .filter(|l| l.contains("seconds_count"))
                .collect();
            assert_eq!(got, want, "device {name}'s {op} latency count: {counts:#?}");
        }
        let st = d.stat();
        assert_eq!(st.counters(name).writes, writes, "{st}");
    }
}

const PAGES: u64 = 1024;

/// What page `i` holds after `k` writes of [`rewrite`]'s sequence (over
/// version 1 of every page).
fn expected(i: u64, k: u64) -> Vec<u8> {
    // The last of seq < k with seq % PAGES == i.
    let version = if k > i { 2 + (k - 1 - i) / PAGES } else { 1 };
    versioned_page(i, version)
}

/// Rewrites page `seq % PAGES` with version `2 + seq / PAGES`, seq = 0, 1,
/// ..., counting completed writes in `done`, until the connection is lost.
fn rewrite(mut c: Client, done: Arc<AtomicU64>) {
    std::thread::spawn(move || {
        for seq in 0.. {
            let i = seq % PAGES;
            let p = versioned_page(i, 2 + seq / PAGES);
            if c.q(0).write(i * PAGE as u64, &p).is_err() {
                return;
            }
            done.store(seq + 1, Ordering::SeqCst);
        }
    });
}

#[test]
fn a_worker_restarted_after_a_kill_serves_every_completed_write() {
    let dir = TempDir::new("sn-recover");
    let a = dir.join("a.sock");
    let d = Daemon::start(&dir, &["--device", &spec("a", &a)], &[&a]);
    let mut c = Client::connect(&a, 1).unwrap();
    for i in 0..PAGES {
        c.q(0)
            .write(i * PAGE as u64, &versioned_page(i, 1))
            .unwrap();
    }
    let done = Arc::new(AtomicU64::new(0));
    rewrite(c, done.clone());
    // Killed mid-way through the second pass.
    let deadline = Instant::now() + DEADLINE;
    while done.load(Ordering::SeqCst) < PAGES + PAGES / 3 {
        assert!(Instant::now() < deadline, "{}", d.log_text());
        std::thread::sleep(Duration::from_millis(1));
    }
    kill_worker(&d, "a", 1);
    // Writes before `k` completed; write `k` may have completed unseen
    // or died with the worker; none after it reached one.
    let k = done.load(Ordering::SeqCst);
    let mut c = Client::connect_retrying(&a, 1, &d);
    for i in 0..PAGES {
        let got = c.q(0).read(i * PAGE as u64, PAGE).unwrap();
        let ok = got == expected(i, k) || (i == k % PAGES && got == expected(i, k + 1));
        assert!(ok, "page {i} after {k} rewrites: not what was written");
    }
}

#[test]
fn a_recovered_device_is_charged_to_the_host_budget_once() {
    let dir = TempDir::new("sn-budget");
    let a = dir.join("a.sock");
    let d = Daemon::start(
        &dir,
        &[
            "--device",
            &format!("{},mem-limit=8M", spec("a", &a)),
            "--host-mem-limit",
            "256M",
        ],
        &[&a],
    );
    let mut c = Client::connect(&a, 1).unwrap();
    for i in 0..PAGES {
        c.q(0)
            .write(i * PAGE as u64, &versioned_page_nonzero(i, 1))
            .unwrap();
    }
    // Staged pages compressed, and the spans they left given back (kept
    // as spares they are charged; recovery gives them back): the charge
    // stays what it is.
    d.settled();
    let _: Compacted = d.request(json!({"cmd": "compact", "device": "a"}));
    let before = d.stat();
    let (host, dev) = (
        before.pool().mem_used_total,
        before.counters("a").mem_used_total,
    );
    assert!(host > 0 && host == dev, "{before}");

    kill_worker(&d, "a", 1);
    drop(c);
    // The next worker recovers the device from its state.
    let mut c = Client::connect_retrying(&a, 1, &d);
    for i in (0..PAGES).step_by(97) {
        assert_eq!(
            c.q(0).read(i * PAGE as u64, PAGE).unwrap(),
            versioned_page_nonzero(i, 1),
            "page {i}"
        );
    }
    let after = d.stat();
    assert_eq!(
        (
            after.pool().mem_used_total,
            after.counters("a").mem_used_total
        ),
        (host, dev),
        "(host used, device used) after recovery, was {host}, {dev}:\n{after}"
    );
}
