//! Devices added, reset and removed on a running daemon (`vzram add`,
//! `remove`, `reset`, `reset-max`), while another device keeps verifying.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use vzram_tests::*;

/// Writes and reads back on `sock` until `stop`; returns the rounds and
/// the slowest round.
fn verify(sock: &Path, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<(u64, Duration)> {
    let sock = sock.to_path_buf();
    std::thread::spawn(move || {
        let mut c = Client::connect(&sock, 1).expect("connect");
        let (mut rounds, mut worst) = (0u64, Duration::ZERO);
        while !stop.load(Ordering::Relaxed) || rounds < 20 {
            let t = Instant::now();
            let off = (rounds % 512) * 16384;
            let data = pattern(rounds, off, 16384);
            c.q(0).write(off, &data).expect("write");
            assert_eq!(c.q(0).read(off, data.len()).expect("read"), data);
            worst = worst.max(t.elapsed());
            rounds += 1;
        }
        (rounds, worst)
    })
}

#[test]
fn add_use_and_remove_while_another_device_verifies() {
    let dir = TempDir::new("rt-add");
    let a = dir.join("a.sock");
    let b = dir.join("b.sock");
    let d = Daemon::start(
        &dir,
        &["--device", &format!("socket={},size=16M,queues=1", s(&a))],
        &[&a],
    );
    let stop = Arc::new(AtomicBool::new(false));
    let v = verify(&a, stop.clone());

    let o = d.vzram(&[
        "add",
        "--device",
        &format!("socket={},size=32M,queues=2,name=vmb,mem-limit=8M", s(&b)),
    ]);
    assert!(o.status.success(), "{:?}", o);
    assert!(String::from_utf8_lossy(&o.stdout).contains("added device vmb"));
    let st = d.stat();
    assert_eq!(st.counters("vmb").size_bytes, 32 << 20);
    assert_eq!(st.counters("vmb").mem_limit, 8 << 20);
    let state = dir_of(&st, "vmb");
    assert!(state.join("table").exists(), "{}", state.display());

    // The new device serves, with its limit.
    let mut c = Client::connect(&b, 2).unwrap();
    let data = noise(7, 1 << 20);
    c.q(1).write(0, &data).unwrap();
    assert_eq!(c.q(0).read(0, data.len()).unwrap(), data);
    let used = d.stat().counters("vmb").mem_used_total;
    assert!(used > 0);

    // Refused: a name or socket in use, a bad spec; one line, exit 2.
    for bad in [
        format!("socket={},size=1M,name=other", s(&b)),
        format!("socket={}/c.sock,size=1M,name=vmb", dir.path().display()),
        format!("socket={}/c.sock,size=1000", dir.path().display()),
    ] {
        let o = d.vzram(&["add", "--device", &bad]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{bad}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }

    // Remove once the frontend has gone (while connected it is refused:
    // tests/guarded.rs): the socket and the state are deleted, the pool
    // gets its memory back.
    drop(c);
    let o = d.vzram(&["remove", "vmb"]);
    assert!(o.status.success(), "{o:?}\n{}", d.log_text());
    assert!(!b.exists(), "socket left behind");
    assert!(!state.exists(), "state left behind: {}", state.display());
    let st = d.stat();
    assert!(st.devices().len() == 1, "{}", st);
    // The pool holds what the remaining device holds (it keeps writing,
    // so the two are read until they agree).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st = d.stat();
        let (pool, a_used) = (st.pool().mem_used_total, st.counters("a").mem_used_total);
        if pool == a_used {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "pool {pool}, a {a_used}, vmb held {used}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let o = d.vzram(&["remove", "--device", "vmb"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("a (0)"));

    // Added again under the same name: a new, empty device.
    let o = d.vzram(&[
        "add",
        "--device",
        &format!("socket={},size=32M,name=vmb", s(&b)),
    ]);
    assert!(o.status.success(), "{o:?}");
    let mut c = Client::connect(&b, 1).unwrap();
    assert_eq!(c.q(0).read(0, PAGE).unwrap(), vec![0; PAGE]);
    drop(c);

    stop.store(true, Ordering::Relaxed);
    let (rounds, worst) = v.join().expect("the other device's verify failed");
    eprintln!("verify: {rounds} rounds, worst {worst:?}");
    assert!(
        worst < Duration::from_secs(1),
        "the other device stalled {worst:?}"
    );
}

fn dir_of(st: &Stats, name: &str) -> std::path::PathBuf {
    let state = &st.dev(name).state;
    assert!(!state.as_os_str().is_empty(), "no state for {name}: {}", st);
    state.clone()
}

#[test]
fn reset_drops_the_data_and_is_refused_while_connected() {
    let dir = TempDir::new("rt-reset");
    let a = dir.join("a.sock");
    let d = Daemon::start(
        &dir,
        &[
            "--device",
            &format!("socket={},size=16M,queues=1,name=vm1", s(&a)),
        ],
        &[&a],
    );
    let mut c = Client::connect(&a, 1).unwrap();
    c.q(0).write(0, &noise(2, 2 << 20)).unwrap();
    let r = d.control(json!({"cmd": "reset", "device": "vm1"}));
    assert_eq!(r["ok"], false, "{r}");
    assert!(
        r["error"]
            .as_str()
            .unwrap()
            .contains("is in use: frontend pid"),
        "{r}"
    );
    drop(c);
    // The worker goes once the frontend has; then reset may act.
    let deadline = Instant::now() + Duration::from_secs(10);
    let r: Reset = loop {
        let r = d.control(json!({"cmd": "reset", "device": "vm1"}));
        let text = r.to_string();
        match parse_reply(r) {
            Ok(r) => break r,
            Err(ReplyError::Refused(_)) if Instant::now() <= deadline => {}
            Err(e) => panic!("{e}: {text}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!((r.device.as_str(), r.pages_dropped), ("vm1", 512), "{r:?}");
    let st = d.stat();
    assert_eq!(st.counters("vm1").orig_data_size, 0);
    assert_eq!(st.counters("vm1").mem_used_total, 0, "{}", st);
    // As zram's reset: the I/O counters start again, and the pages the
    // reset dropped are no guest discards.
    let io = st.counters("vm1");
    assert_eq!(
        (io.reads, io.writes, io.discards, io.failed_writes),
        (0, 0, 0, 0),
        "{io:?}"
    );
    let max = st.counters("vm1").mem_used_max;
    assert!(max > 0);
    let mut c = Client::connect(&a, 1).unwrap();
    assert_eq!(c.q(0).read(0, 2 << 20).unwrap(), vec![0; 2 << 20]);
    drop(c);

    let o = d.vzram(&["reset-max", "--device", "vm1"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(d.stat().counters("vm1").mem_used_max, 0);
}

/// `add` carries the device typed (the client parsed `--device` once): a
/// raw request gives numbers and names, not spec text; the daemon checks
/// the values. A bad spec is the client's to refuse, daemon or none.
#[test]
fn add_carries_a_typed_device() {
    let dir = TempDir::new("rt-typed");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let d = Daemon::start(
        &dir,
        &["--device", &format!("socket={},size=16M,queues=1", s(&a))],
        &[&a],
    );
    let r: Added = d.request(json!({"cmd": "add", "device": {
        "socket": b, "size": 8 << 20, "name": "raw", "algo": "zstd:3", "idle_after": {"secs": 60, "nanos": 0},
    }}));
    assert_eq!((r.device.as_str(), r.recovered), ("raw", false), "{r:?}");
    let st = d.stat();
    let raw = st.dev("raw");
    assert_eq!(
        (raw.size_bytes, raw.algo.to_string()),
        (8 << 20, "zstd:3".into())
    );
    assert_eq!(raw.tier.idle_after_secs, Some(60));
    // The values are checked there as on the command line; spec text is
    // no device.
    for (bad, kind) in [
        (
            json!({"socket": dir.join("c.sock"), "size": 1000}),
            "bad-request",
        ),
        (
            json!({"socket": b, "size": 1 << 20, "name": "other"}),
            "conflict",
        ),
        (
            json!(format!("socket={},size=1M", s(&dir.join("c.sock")))),
            "bad-request",
        ),
        (
            json!({"socket": dir.join("c.sock"), "size": "1M"}),
            "bad-request",
        ),
    ] {
        let r = d.control(json!({"cmd": "add", "device": bad}));
        assert_eq!(
            (&r["ok"], &r["kind"]),
            (&json!(false), &json!(kind)),
            "{bad} → {r}"
        );
    }
    // A spec that does not parse never reaches a daemon: exit 2, one line.
    let o = std::process::Command::new(vzram_bin())
        .args([
            "add",
            "--device",
            "socket=/x.sock,size=1M,colour=red",
            "--control",
        ])
        .arg(dir.join("nothing.sock"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("colour"), "{err}");
}

/// An added device is checked against the daemon's own control socket
/// (here not the default one): neither its socket nor its incoming
/// address may be it. Refused before anything is bound, as a config
/// file's device would be.
#[test]
fn add_is_checked_against_the_daemons_own_control_socket() {
    let dir = TempDir::new("rt-control");
    let a = dir.join("a.sock");
    let d = Daemon::start(
        &dir,
        &["--device", &format!("socket={},size=16M,queues=1", s(&a))],
        &[&a],
    );
    let control = dir.join("control.sock");
    let x = dir.join("x.sock");
    for (bad, says) in [
        (
            format!("socket={},size=1M,name=c", s(&control)),
            format!("control socket {} is also a device socket", s(&control)),
        ),
        (
            format!("socket={},size=1M,incoming=unix:{}", s(&x), s(&control)),
            format!(
                "device x: incoming socket {} is also a device or control socket",
                s(&control)
            ),
        ),
    ] {
        let o = d.vzram(&["add", "--device", &bad]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains(&says), "{bad}: {err}");
    }
    assert!(!x.exists(), "a refused add left its socket");
    assert_eq!(d.stat().devices().len(), 1);
    // The control socket still answers.
    assert!(d.vzram(&["stat"]).status.success());
}
