//! `--metrics ADDR:PORT`: an HTTP client reads `/metrics` and finds the
//! numbers `vzram stat` reports; bad requests are answered and the daemon
//! keeps serving.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use vzram_tests::metrics::metric;
use vzram_tests::*;

/// Sends `request` as is and returns the whole reply (the server closes).
fn http(addr: SocketAddr, request: &[u8]) -> String {
    let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(request).unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    out
}

fn get(addr: SocketAddr, path: &str) -> String {
    http(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes(),
    )
}

fn status(reply: &str) -> &str {
    reply.lines().next().unwrap_or_default()
}

#[test]
fn metrics_match_stat_and_bad_requests_do_no_harm() {
    let dir = TempDir::new("metrics");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let d = Daemon::start(
        &dir,
        &[
            "--device",
            &format!("socket={},size=64M,name=vm1,mem-limit=32M", s(&a)),
            "--device",
            &format!("socket={},size=16M,name=vm2", s(&b)),
            "--host-mem-limit",
            "1G",
            "--metrics",
            "127.0.0.1:0",
        ],
        &[&a, &b],
    );
    // Port 0: the bound address is in the stat reply.
    let addr: SocketAddr = d
        .stat()
        .0
        .metrics
        .unwrap_or_else(|| panic!("no metrics address in stat:\n{}", d.log_text()))
        .parse()
        .unwrap();
    assert_ne!(addr.port(), 0);
    assert!(d.log_text().contains(&addr.to_string()));

    let mut c = Client::connect(&a, 1).unwrap();
    for p in 0..300u64 {
        c.q(0).write(p * 4096, &pattern(p, p * 4096, 4096)).unwrap();
    }
    c.q(0).write(2 << 20, &[0u8; 8 * 4096]).unwrap();
    for p in 0..10u64 {
        c.q(0).read(p * 4096, 4096).unwrap();
    }
    c.q(0).discard(0, 4 * 4096).unwrap();

    // A slow client (sends half a request and stops) must not wedge the
    // server for the next one longer than its time limit.
    let mut slow = TcpStream::connect(addr).unwrap();
    slow.write_all(b"GET /metr").unwrap();

    // Staged pages compressed: the scrape and the stat below agree.
    d.settled();
    let started = Instant::now();
    let reply = get(addr, "/metrics");
    assert!(started.elapsed() < Duration::from_secs(15));
    assert_eq!(status(&reply), "HTTP/1.1 200 OK", "{reply}");
    assert!(
        reply.contains("Content-Type: text/plain; version=0.0.4"),
        "{reply}"
    );
    let body = reply.split("\r\n\r\n").nth(1).unwrap();
    let st = d.stat();
    let (vm1, vm2) = (st.counters("vm1"), st.counters("vm2"));
    for (series, dev, want) in [
        ("vzram_orig_data_bytes", "vm1", vm1.orig_data_size),
        ("vzram_compr_data_bytes", "vm1", vm1.compr_data_size),
        ("vzram_mem_used_bytes", "vm1", vm1.mem_used_total),
        ("vzram_mem_limit_bytes", "vm1", vm1.mem_limit),
        ("vzram_same_pages", "vm1", vm1.same_pages),
        ("vzram_huge_pages", "vm1", vm1.huge_pages),
        ("vzram_read_bytes_total", "vm1", vm1.reads * PAGE as u64),
        ("vzram_write_bytes_total", "vm1", vm1.writes * PAGE as u64),
        (
            "vzram_discard_bytes_total",
            "vm1",
            vm1.discards * PAGE as u64,
        ),
        ("vzram_failed_reads_total", "vm1", vm1.failed_reads),
        ("vzram_failed_writes_total", "vm1", vm1.failed_writes),
        ("vzram_pages_compacted_total", "vm1", vm1.pages_compacted),
        ("vzram_limit_hits_total", "vm1", vm1.limit_hits),
        ("vzram_write_bytes_total", "vm2", vm2.writes * PAGE as u64),
        ("vzram_orig_data_bytes", "vm2", vm2.orig_data_size),
    ] {
        let got = metric(body, &format!("{series}{{vzram_device=\"{dev}\"}}"));
        assert_eq!(got, want, "{series} of {dev}\n{body}");
    }
    // The numbers are the workload's (308 pages), not zeros on both sides.
    assert_eq!(
        metric(body, "vzram_write_bytes_total{vzram_device=\"vm1\"}"),
        308 * 4096
    );
    // One latency sample a request: 301 writes, 10 reads, 1 discard.
    let lat = |op: &str, what: &str| {
        metric(
            body,
            &format!("vzram_request_duration_seconds_{what}{{vzram_device=\"vm1\",op=\"{op}\"}}"),
        )
    };
    assert_eq!(lat("write", "count"), 301, "{body}");
    assert_eq!(lat("read", "count"), 10);
    assert_eq!(lat("discard", "count"), 1);
    assert!(body.contains("# TYPE vzram_request_duration_seconds histogram"));
    assert_eq!(
        metric(
            body,
            "vzram_request_duration_seconds_bucket{vzram_device=\"vm1\",op=\"write\",le=\"+Inf\"}"
        ),
        301
    );
    assert_eq!(
        metric(body, "vzram_read_bytes_total{vzram_device=\"vm1\"}"),
        10 * 4096
    );
    assert_eq!(metric(body, "vzram_same_pages{vzram_device=\"vm1\"}"), 8);
    assert_eq!(
        metric(body, "vzram_mem_limit_bytes{vzram_device=\"vm1\"}"),
        32 << 20
    );
    assert_eq!(metric(body, "vzram_connected{vzram_device=\"vm1\"}"), 1);
    assert_eq!(metric(body, "vzram_connected{vzram_device=\"vm2\"}"), 0);
    let pool = st.pool();
    for (series, want) in [
        ("vzram_pool_mem_used_bytes", pool.mem_used_total),
        ("vzram_pool_orig_data_bytes", pool.orig_data_size),
        ("vzram_pool_mem_limit_bytes", pool.mem_limit),
        ("vzram_pool_devices", pool.devices),
    ] {
        assert_eq!(metric(body, series), want, "{series}\n{body}");
    }
    assert_eq!(metric(body, "vzram_pool_mem_limit_bytes"), 1 << 30);
    assert!(
        body.contains("# TYPE vzram_read_bytes_total counter"),
        "{body}"
    );
    // node_exporter's block devices carry `device`: never mixed with ours.
    assert!(!body.contains("{device="), "{body}");
    assert!(body.contains("# TYPE vzram_mem_used_bytes gauge"), "{body}");
    drop(slow);

    // Bad requests get an answer; the daemon and the endpoint stay up.
    assert!(status(&get(addr, "/")).contains(" 404 "));
    assert!(status(&get(addr, "/nothing")).contains(" 404 "));
    assert!(status(&http(addr, b"POST /metrics HTTP/1.1\r\n\r\n")).contains(" 405 "));
    assert!(status(&http(addr, b"hello\r\n\r\n")).contains(" 400 "));
    let huge = format!(
        "GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n",
        "a".repeat(64 << 10)
    );
    let mut big = TcpStream::connect(addr).unwrap();
    big.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // The server may close before reading it all; only its answer matters.
    let _ = big.write_all(huge.as_bytes());
    let mut r = String::new();
    let _ = big.read_to_string(&mut r);
    assert!(r.is_empty() || status(&r).contains(" 400 "), "{r}");
    // A client that connects and leaves.
    drop(TcpStream::connect(addr).unwrap());
    assert_eq!(status(&get(addr, "/metrics")), "HTTP/1.1 200 OK");
    c.q(0).write(0, &[3; 4096]).unwrap();
    let body = get(addr, "/metrics");
    assert_eq!(
        metric(&body, "vzram_write_bytes_total{vzram_device=\"vm1\"}"),
        309 * 4096
    );
}

#[test]
fn bad_metrics_address_is_refused() {
    let dir = TempDir::new("metricsbad");
    let sock = dir.join("a.sock");
    let o = Vzram::new(&[
        "serve",
        "--size",
        "1M",
        "--metrics",
        "localhost",
        "--socket",
    ])
    .arg(&sock)
    .env("VZRAM_STATE_DIR", state_dir_for(dir.path()))
    .output();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("IP:PORT"), "{err}");
}

/// A `process_*` series' value (a float, as the encoder writes it).
fn process_metric(body: &str, name: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {name} in\n{body}"))
        .parse()
        .unwrap()
}

/// The supervisor's `process_*` series, read from its /proc/self under
/// the seccomp filter (on, the default), match what /proc/PID says from
/// outside, and follow it: descriptors opened in the daemon are counted
/// at the next scrape.
#[test]
fn process_metrics_are_the_supervisors() {
    let t0 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let dir = TempDir::new("metrics-proc");
    let a = dir.join("a.sock");
    let d = Daemon::start(
        &dir,
        &[
            "--device",
            &format!("socket={},size=16M,name=vm1", s(&a)),
            "--metrics",
            "127.0.0.1:0",
        ],
        &[&a],
    );
    assert!(d.wait_log("seccomp filter active"), "{}", d.log_text());
    let addr: SocketAddr = d.stat().0.metrics.unwrap().parse().unwrap();
    let proc_dir = format!("/proc/{}", d.pid());
    let fds_now = || std::fs::read_dir(format!("{proc_dir}/fd")).unwrap().count() as f64;

    // Counted from outside just before and just after a scrape: the
    // daemon's count lies between, plus the scrape's own connection
    // (connections of earlier requests may still be closing).
    let scrape = || {
        let before = fds_now();
        let body = vzram_tests::metrics::scrape(addr);
        let after = fds_now();
        let fds = process_metric(&body, "process_open_fds");
        assert!(
            after.min(before) <= fds && fds <= after.max(before) + 1.0,
            "{before} {fds} {after}"
        );
        body
    };
    let body = scrape();
    for name in [
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ] {
        assert!(
            body.contains(&format!("# TYPE {name} gauge")),
            "{name}:\n{body}"
        );
    }
    assert!(
        body.contains("# TYPE process_cpu_seconds_total counter"),
        "{body}"
    );

    let rss = process_metric(&body, "process_resident_memory_bytes");
    let statm = std::fs::read_to_string(format!("{proc_dir}/statm")).unwrap();
    let pages: Vec<f64> = statm
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    let ratio = rss / (pages[1] * 4096.0);
    assert!(rss > 0.0 && ratio > 0.5 && ratio < 2.0, "{rss} {statm}");
    assert!(process_metric(&body, "process_virtual_memory_bytes") >= rss);
    let limits = std::fs::read_to_string(format!("{proc_dir}/limits")).unwrap();
    let soft: f64 = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(process_metric(&body, "process_max_fds"), soft);
    let start = process_metric(&body, "process_start_time_seconds");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        t0 - 2.0 <= start && start <= now + 2.0,
        "{t0} {start} {now}"
    );
    let cpu = process_metric(&body, "process_cpu_seconds_total");
    assert!(cpu > 0.0, "{cpu}");

    // 20 control clients that stay connected: 20 descriptors more at the
    // next scrape (less the earlier connections that closed meanwhile).
    let first = process_metric(&body, "process_open_fds");
    let held: Vec<_> = (0..20)
        .map(|_| std::os::unix::net::UnixStream::connect(&d.control).unwrap())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while fds_now() < first + 16.0 {
        assert!(
            Instant::now() < deadline,
            "the daemon did not accept 20 clients: {first} {}",
            fds_now()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let body = scrape();
    let fds = process_metric(&body, "process_open_fds");
    assert!(fds >= first + 16.0, "{first} -> {fds}");
    assert!(process_metric(&body, "process_cpu_seconds_total") >= cpu);
    drop(held);
}
