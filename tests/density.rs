//! Density: an idle device costs no thread, no process and five descriptors,
//! and the daemon lifts its open-file limit so many devices fit.

use vzram_tests::*;

/// Threads and open descriptors of the daemon and every process it started.
fn threads_and_fds(pid: u32) -> (usize, usize) {
    let count = |p: u32, what: &str| {
        std::fs::read_dir(format!("/proc/{p}/{what}")).map_or(0, |d| d.count())
    };
    process_tree(pid).into_iter().fold((0, 0), |(t, f), p| {
        (t + count(p, "task"), f + count(p, "fd"))
    })
}

#[test]
fn idle_devices_hold_one_thread_and_fd_each() {
    let dir = TempDir::new("density");
    let socks: Vec<_> = (0..20).map(|i| dir.join(&format!("d{i}.sock"))).collect();
    let specs: Vec<String> = socks
        .iter()
        .map(|s| format!("socket={},size=64M,queues=4", s.display()))
        .collect();
    let mut args = Vec::new();
    for spec in &specs {
        args.push("--device");
        args.push(spec.as_str());
    }
    let refs: Vec<&std::path::Path> = socks.iter().map(|p| p.as_path()).collect();
    let d = Daemon::start(&dir, &args, &refs);
    // Daemon::start returns once the control socket answers: set-up is done.
    std::thread::sleep(std::time::Duration::from_millis(100));
    let (threads, fds) = threads_and_fds(d.pid());
    let procs = process_tree(d.pid()).len();
    // No thread per device: one epoll loop watches every socket. The
    // daemon's own threads (main, supervisor loop, control) and the
    // launcher; 4 queue threads per device would be 80 more.
    assert!(threads <= 6, "{threads} threads for 20 idle devices");
    // No process per idle device: the supervisor and its launcher.
    assert_eq!(procs, 2, "{procs} processes for 20 idle devices");
    // Five descriptors a device: its socket and its state (locked header,
    // table, arena, counters), kept open to hand to its workers.
    assert!(fds <= 5 * 20 + 24, "{fds} fds for 20 idle devices");

    // A connected frontend gets a worker process with its handler and
    // queue threads...
    let c = Client::connect(&socks[0], 4).expect("connect");
    let (busy, _) = threads_and_fds(d.pid());
    assert!(
        busy >= threads + 4,
        "{busy} threads with 4 queues connected, {threads} idle"
    );
    assert_eq!(
        process_tree(d.pid()).len(),
        3,
        "one worker for one frontend"
    );
    // ...and they go away with it.
    drop(c);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while threads_and_fds(d.pid()).0 > threads || process_tree(d.pid()).len() > 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the worker outlived the connection: {} threads now, {threads} idle",
            threads_and_fds(d.pid()).0,
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    // The soft open-file limit was raised to the hard one.
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", d.pid())).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let v: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(v[3], v[4], "soft and hard open-file limits differ: {line}");
}
