//! Control and `/metrics` clients are bounded: idle ones cannot use up the
//! daemon's descriptors or threads, a full descriptor table never makes
//! the supervisor spin, a silent scraper never delays another scrape, and
//! when every slot is owed a reply a newcomer is told so at once.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use vzram_tests::metrics::scrape;
use vzram_tests::*;

fn dev(sock: &Path) -> String {
    format!("socket={},size=16M,queues=1,name=vm", s(sock))
}

/// Sets the daemon's soft open-file limit, as `LimitNOFILE=` would.
fn limit_fds(pid: u32, n: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit reads another process's limit into `lim`.
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            std::ptr::null(),
            &mut lim,
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    lim.rlim_cur = n.min(lim.rlim_max);
    // SAFETY: prlimit sets it from a valid limit, with no old-limit buffer.
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &lim,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
}

fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count() as u64
}

/// Whether the daemon closed `c` (EOF or a reset), without waiting.
fn closed(c: &mut UnixStream) -> bool {
    c.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return true,
            // A line telling it why; the EOF follows.
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

fn timed_stat(control: &Path) -> Duration {
    let t = Instant::now();
    let st = Stats::parse(control_request(control, &json!({"cmd": "stat"})));
    assert_eq!(st.devices().len(), 1);
    t.elapsed()
}

/// A thousand control clients that connect and say nothing, under a
/// 512-descriptor limit: the newest are kept and the longest idle closed,
/// so `stat` and a frontend are still served at once and the supervisor
/// does not spin.
#[test]
fn a_thousand_idle_control_clients_cost_nothing() {
    let dir = TempDir::new("bc-idle");
    let sock = dir.join("vm.sock");
    let d = Daemon::start(&dir, &["--device", &dev(&sock)], &[&sock]);
    limit_fds(d.pid(), 512);
    let before = cpu_ticks(d.pid());
    let t0 = Instant::now();
    let mut idle: Vec<UnixStream> = (0..1000)
        .map(|_| UnixStream::connect(&d.control).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let stat = timed_stat(&d.control);
    let t = Instant::now();
    let mut c = Client::connect(&sock, 1).unwrap();
    c.q(0).write(0, &pattern(1, 0, 4096)).unwrap();
    assert_eq!(c.q(0).read(0, 4096).unwrap(), pattern(1, 0, 4096));
    let frontend = t.elapsed();
    // Hold them a while: a spinning loop would show here.
    std::thread::sleep(Duration::from_secs(2));
    let used = cpu_ticks(d.pid()) - before;
    let secs = t0.elapsed().as_secs_f64();
    let share = used as f64 / 100.0 / secs;
    let gone = idle.iter_mut().map(closed).filter(|&c| c).count();
    eprintln!(
        "1000 idle control clients: {gone} closed by the daemon; stat {stat:?}, frontend served {frontend:?}; supervisor CPU {:.1}% over {secs:.1} s; {} fds open",
        share * 100.0,
        open_fds(d.pid())
    );
    assert!(stat < Duration::from_secs(1), "stat took {stat:?}");
    assert!(
        frontend < Duration::from_secs(1),
        "frontend took {frontend:?}"
    );
    assert!(share < 0.05, "supervisor used {:.1}% CPU", share * 100.0);
    assert!(
        gone >= 1000 - 64,
        "only {gone} of 1000 idle clients were closed"
    );
    drop(idle);
    d.shutdown();
}

/// Out of descriptors, the supervisor pauses accepting (control clients
/// and frontends) instead of spinning on EMFILE, says so once for each,
/// and serves again as soon as descriptors free.
#[test]
fn a_full_descriptor_table_never_spins() {
    let dir = TempDir::new("bc-emfile");
    let sock = dir.join("vm.sock");
    let d = Daemon::start(&dir, &["--device", &dev(&sock)], &[&sock]);
    let pid = d.pid();
    // Room for a few clients, then EMFILE for every accept.
    limit_fds(pid, open_fds(pid) + 4);
    let before = cpu_ticks(pid);
    let t0 = Instant::now();
    let mut held: Vec<UnixStream> = (0..30)
        .map(|_| UnixStream::connect(&d.control).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    // A frontend comes meanwhile: it waits in the backlog.
    let frontend = {
        let sock = sock.clone();
        std::thread::spawn(move || {
            let mut c = Client::connect(&sock, 1).unwrap();
            c.q(0).write(0, &pattern(7, 0, 4096)).unwrap();
            assert_eq!(c.q(0).read(0, 4096).unwrap(), pattern(7, 0, 4096));
            Instant::now()
        })
    };
    std::thread::sleep(Duration::from_secs(3));
    let used = cpu_ticks(pid) - before;
    let share = used as f64 / 100.0 / t0.elapsed().as_secs_f64();
    let log = d.log_text();
    let warned = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    let (control, device) = (
        warned("control socket accept"),
        warned("cannot accept a frontend"),
    );
    eprintln!(
        "out of descriptors for 3 s with 30 control clients and a frontend waiting: supervisor CPU {:.1}%, warnings: {control} control, {device} device",
        share * 100.0
    );
    assert!(share < 0.05, "supervisor used {:.1}% CPU", share * 100.0);
    assert_eq!((control, device), (1, 1), "{log}");
    assert!(
        !frontend.is_finished(),
        "a frontend was served out of descriptors"
    );
    // Freed descriptors: the waiting clients are taken and stat answers.
    // The limit goes up first: closing the clients first let the retry
    // accept the frontend with room for it but not for its worker's
    // descriptors (loaded CI run 17: "cannot start a worker: Too many open
    // files", the frontend reset).
    limit_fds(pid, 4096);
    for c in held.iter_mut() {
        c.shutdown(std::net::Shutdown::Both).unwrap();
    }
    drop(held);
    let freed = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(5);
    let stat = loop {
        let t = Instant::now();
        let mut c = UnixStream::connect(&d.control).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        writeln!(c, "{}", json!({"cmd": "stat"})).unwrap();
        let mut line = String::new();
        let _ = BufReader::new(&c).read_line(&mut line);
        if line.contains("\"ok\":true") {
            break t.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "no stat after the descriptors freed: {line:?}"
        );
    };
    let served = frontend.join();
    let log = d.log_text();
    let served = served
        .unwrap_or_else(|_| panic!("the waiting frontend failed:\n{log}"))
        .saturating_duration_since(freed);
    assert!(log.contains("descriptors are free again"), "{log}");
    assert!(log.contains("accepting frontends again"), "{log}");
    eprintln!(
        "once descriptors were free: stat served in {stat:?}, the waiting frontend {served:?} after"
    );
    assert!(served < Duration::from_secs(1), "{served:?}");
    d.shutdown();
}

/// An idle control client is closed after the idle timeout; one that keeps
/// asking is not.
#[test]
fn idle_control_clients_time_out() {
    let dir = TempDir::new("bc-timeout");
    let sock = dir.join("vm.sock");
    let control = dir.join("control.sock");
    let mut cmd = Command::new(vzram_bin());
    // Idle 1 s: a client asking every 100 ms stays far inside it however
    // slowly this test runs.
    cmd.env("VZRAM_TEST_CONTROL_IDLE_MS", "1000").args([
        "serve",
        "--device",
        &dev(&sock),
        "--control",
        s(&control),
    ]);
    let d = Daemon::start_command(cmd, &control, &dir.join("daemon.log"), &[&sock]);
    let t = Instant::now();
    let mut silent = UnixStream::connect(&control).unwrap();
    let mut busy = UnixStream::connect(&control).unwrap();
    let mut reader = BufReader::new(busy.try_clone().unwrap());
    let mut line = String::new();
    let mut answered = Instant::now();
    while t.elapsed() < Duration::from_millis(3000) {
        writeln!(busy, "{}", json!({"cmd": "stat"})).unwrap();
        line.clear();
        reader.read_line(&mut line).unwrap();
        answered = Instant::now();
        assert!(line.contains("\"ok\":true"), "{line}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(closed(&mut silent), "a silent client was kept 3 s");
    assert!(
        !closed(&mut busy),
        "a client asking every 100 ms was closed"
    );
    // Now it falls silent too.
    while !closed(&mut busy) {
        assert!(
            answered.elapsed() < Duration::from_secs(20),
            "a client idle for 20 s was kept"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let kept = answered.elapsed();
    eprintln!("the busy client, once silent, was closed {kept:?} after its last answer");
    // Idle from its last request, just before its answer came.
    assert!(kept >= Duration::from_millis(900), "closed after {kept:?}");
    d.shutdown();
}

/// When each of the 64 clients is owed a reply it has not read, there is
/// nobody to evict: the 65th is refused with a reason, at once, and served
/// as soon as a slot frees.
#[test]
fn the_65th_client_is_refused_when_every_slot_is_owed_a_reply() {
    let dir = TempDir::new("bc-cap");
    let sock = dir.join("vm.sock");
    let d = Daemon::start(&dir, &["--device", &dev(&sock)], &[&sock]);
    let many = format!("{}\n", json!({"cmd": "stat"})).repeat(500);
    let mut owed: Vec<UnixStream> = (0..64)
        .map(|_| {
            let mut c = UnixStream::connect(&d.control).unwrap();
            c.write_all(many.as_bytes()).unwrap();
            c
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    let mut late = UnixStream::connect(&d.control).unwrap();
    late.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = writeln!(late, "{}", json!({"cmd": "stat"}));
    let mut line = String::new();
    let _ = BufReader::new(&late).read_line(&mut line);
    let refused = t.elapsed();
    eprintln!("the 65th client was answered {line:?} in {refused:?}");
    let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
    assert_eq!(v["ok"], false, "{line:?}");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("refused")),
        "{line:?}"
    );
    assert!(refused < Duration::from_secs(1), "{refused:?}");
    // One owed client reads its 500 replies; then a newcomer is served.
    let mut r = BufReader::new(owed.remove(0));
    for i in 0..500 {
        line.clear();
        r.read_line(&mut line).unwrap();
        assert!(line.contains("\"ok\":true"), "reply {i}: {line}");
    }
    drop(r);
    std::thread::sleep(Duration::from_millis(200));
    let stat = timed_stat(&d.control);
    assert!(stat < Duration::from_secs(1), "stat took {stat:?}");
    drop(owed);
    d.shutdown();
}

fn metrics_addr(d: &Daemon) -> SocketAddr {
    d.stat()
        .0
        .metrics
        .clone()
        .expect("a metrics address")
        .parse()
        .unwrap()
}

/// Silent `/metrics` clients never delay a scrape: three of them, then a
/// hundred, each with a scrape that must be answered within 2 s; a silent
/// one is dropped after the 2 s it is given.
#[test]
fn silent_metrics_clients_never_delay_a_scrape() {
    let dir = TempDir::new("bc-metrics");
    let sock = dir.join("vm.sock");
    let d = Daemon::start(
        &dir,
        &["--device", &dev(&sock), "--metrics", "127.0.0.1:0"],
        &[&sock],
    );
    let addr = metrics_addr(&d);
    for n in [3, 100] {
        let mut silent: Vec<TcpStream> =
            (0..n).map(|_| TcpStream::connect(addr).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        let body = scrape(addr);
        let took = t.elapsed();
        eprintln!("{n} silent clients: a scrape answered in {took:?}");
        assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
        assert!(body.contains("vzram_pool_devices 1"), "{body}");
        assert!(took < Duration::from_secs(2), "{took:?}");
        // Those still connected are closed by their deadline.
        std::thread::sleep(Duration::from_millis(2500));
        for c in silent.iter_mut() {
            c.set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            let mut buf = Vec::new();
            assert!(
                c.read_to_end(&mut buf).is_ok(),
                "a silent client is still connected"
            );
        }
    }
    // Scrapes in parallel.
    let t = Instant::now();
    let scrapes: Vec<_> = (0..8)
        .map(|_| std::thread::spawn(move || scrape(addr)))
        .collect();
    for s in scrapes {
        assert!(s.join().unwrap().starts_with("HTTP/1.1 200 OK"));
    }
    eprintln!("8 parallel scrapes in {:?}", t.elapsed());
    d.shutdown();
}
