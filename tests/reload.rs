//! SIGHUP reads the `--config` file again, through the real daemon with
//! its seccomp filter on (the default): devices added and removed, limits
//! changed, what needs a restart logged and left, a broken file ignored,
//! a device with a frontend kept. And the one rule for limits at odds
//! with each other or with what a device holds: accepted, with a warning.

use std::path::Path;
use std::time::{Duration, Instant};

use vzram_tests::*;

const MIB: u64 = 1 << 20;

/// A `[[device]]` table.
fn device(name: &str, socket: &Path, size: &str, extra: &str) -> String {
    format!(
        "[[device]]\nname = \"{name}\"\nsocket = \"{}\"\nsize = \"{size}\"\nqueues = 1\n{extra}\n",
        s(socket)
    )
}

/// Sends SIGHUP and waits until the daemon logs `needle` one more time
/// than before (each reload ends with one line that says so).
/// The file with devices a and b (16M each), `b_extra` in b's table.
fn write_ab(cfg: &Path, a: &Path, b: &Path, b_extra: &str) {
    let text = format!(
        "{}{}",
        device("a", a, "16M", ""),
        device("b", b, "16M", b_extra)
    );
    std::fs::write(cfg, text).unwrap();
}

fn hup_and_wait(d: &mut Daemon, needle: &str) {
    let before = d.log_text().matches(needle).count();
    // SAFETY: kill(2) on the daemon we started; no memory is involved.
    let rc = unsafe { libc::kill(d.pid() as i32, libc::SIGHUP) };
    assert_eq!(rc, 0, "kill -HUP: {}", std::io::Error::last_os_error());
    let deadline = Instant::now() + Duration::from_secs(20);
    while d.log_text().matches(needle).count() <= before {
        d.assert_alive();
        assert!(
            Instant::now() < deadline,
            "no {needle:?} within 20 s after SIGHUP:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes and reads back 1 MiB on `sock`.
fn serves(sock: &Path, seed: u64) {
    let mut c = Client::connect(sock, 1).unwrap_or_else(|e| panic!("{}: {e}", sock.display()));
    let data = noise(seed, MIB as usize);
    c.q(0).write(0, &data).expect("write");
    assert_eq!(c.q(0).read(0, data.len()).expect("read"), data);
}

fn names(st: &Stats) -> Vec<String> {
    let mut n: Vec<String> = st.devices().iter().map(|d| d.name.clone()).collect();
    n.sort();
    n
}

#[test]
fn sighup_adds_removes_and_sets_limits_and_logs_what_needs_a_restart() {
    let dir = TempDir::new("reload-apply");
    let (a, b, c) = (dir.join("a.sock"), dir.join("b.sock"), dir.join("c.sock"));
    let cfg = dir.join("vzram.toml");
    std::fs::write(
        &cfg,
        format!(
            "host_mem_limit = \"64M\"\n{}{}",
            device("a", &a, "16M", "mem_limit = \"8M\""),
            device("b", &b, "16M", "")
        ),
    )
    .unwrap();
    let mut d = Daemon::start(&dir, &["--config", s(&cfg)], &[&a, &b]);
    assert!(d.wait_log("seccomp filter active"), "{}", d.log_text());
    let b_state = d.stat().dev("b").state.clone();
    assert!(b_state.exists());

    // b removed, c added, a's limit changed, a's size changed, the host
    // limit changed.
    std::fs::write(
        &cfg,
        format!(
            "host_mem_limit = \"48M\"\n{}{}",
            device("a", &a, "32M", "mem_limit = \"4M\""),
            device("c", &c, "16M", "")
        ),
    )
    .unwrap();
    hup_and_wait(&mut d, "reload done");
    let st = d.stat_cli();
    assert_eq!(names(&st), ["a", "c"], "{st}");
    assert_eq!(st.counters("a").mem_limit, 4 * MIB);
    assert_eq!(st.dev("a").size_bytes, 16 * MIB, "a size needs a restart");
    assert_eq!(st.pool().mem_limit, 48 * MIB);
    assert!(!b.exists(), "b's socket is removed");
    // An edit of the file never deletes a VM's disk: b's state is kept,
    // left over, until `vzram forget` deletes it on purpose.
    assert!(b_state.exists(), "b's state was deleted by a reload");
    let left = d.control(json!({"cmd": "stat"}))["leftovers"].clone();
    assert!(
        left.as_array().unwrap().iter().any(|l| l["name"] == "b"),
        "b is not listed as left over: {left}"
    );
    d.cli(&["forget", "b"]);
    assert!(!b_state.exists(), "vzram forget b left its state");
    serves(&c, 1);
    serves(&a, 2);
    let log = d.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("size changed in the file") && l.contains("needs a restart")),
        "{log}"
    );
    for line in [
        "reload: no longer in the file: no longer served, its state kept",
        "reload: in the file and not served: added",
        "reload: mem_limit changed in the file, set",
        "reload: host memory limit changed in the file, set",
    ] {
        assert!(log.contains(line), "no {line:?} in:\n{log}");
    }

    // The same file again: nothing to do, and the size still needs a restart.
    hup_and_wait(&mut d, "reload done");
    let log = d.log_text();
    let last = log.lines().rfind(|l| l.contains("reload done")).unwrap();
    assert!(last.contains("changes=0"), "{last}");
    assert!(last.contains("need_restart=1"), "{last}");

    // A device of the file removed by hand is the file's again on reload.
    d.cli(&["remove", "--device", "c"]);
    assert_eq!(names(&d.stat_cli()), ["a"]);
    hup_and_wait(&mut d, "reload done");
    assert_eq!(names(&d.stat_cli()), ["a", "c"]);
    serves(&c, 9);
}

#[test]
fn a_file_that_does_not_parse_changes_nothing() {
    let dir = TempDir::new("reload-broken");
    let a = dir.join("a.sock");
    let cfg = dir.join("vzram.toml");
    std::fs::write(&cfg, device("a", &a, "16M", "mem_limit = \"8M\"")).unwrap();
    let mut d = Daemon::start(&dir, &["--config", s(&cfg)], &[&a]);
    serves(&a, 3);

    // Not TOML; then TOML whose device is wrong; then no file at all.
    let b = dir.join("b.sock");
    let broken = [
        format!("[[device]\nsocket = \"{}\"\n", s(&b)),
        format!(
            "{}{}",
            device("a", &a, "16M", "mem_limit = \"4M\""),
            device("b", &b, "16M", "mem_limit = \"32M\"")
        ),
    ];
    for text in &broken {
        std::fs::write(&cfg, text).unwrap();
        hup_and_wait(&mut d, "nothing changed");
    }
    std::fs::remove_file(&cfg).unwrap();
    hup_and_wait(&mut d, "nothing changed");
    let log = d.log_text();
    assert!(!log.contains("reload done"), "{log}");
    let st = d.stat_cli();
    assert_eq!(names(&st), ["a"]);
    assert_eq!(st.counters("a").mem_limit, 8 * MIB);
    assert!(!b.exists());
    serves(&a, 4);
}

#[test]
fn a_removed_device_with_a_frontend_is_kept_until_it_goes() {
    let dir = TempDir::new("reload-connected");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let cfg = dir.join("vzram.toml");
    write_ab(&cfg, &a, &b, "");
    let mut d = Daemon::start(&dir, &["--config", s(&cfg)], &[&a, &b]);
    let mut client = Client::connect(&b, 1).unwrap();
    let data = noise(5, MIB as usize);
    client.q(0).write(0, &data).unwrap();

    std::fs::write(&cfg, device("a", &a, "16M", "")).unwrap();
    hup_and_wait(&mut d, "reload done");
    assert_eq!(names(&d.stat_cli()), ["a", "b"]);
    let log = d.log_text();
    assert!(
        log.contains("a frontend is connected: still served"),
        "no warning in:\n{log}"
    );
    // Its VM saw nothing.
    assert_eq!(client.q(0).read(0, data.len()).unwrap(), data);

    // Once the frontend is gone, the next reload removes it.
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.stat().dev("b").connected {
        assert!(Instant::now() < deadline, "b still connected");
        std::thread::sleep(Duration::from_millis(20));
    }
    hup_and_wait(&mut d, "reload done");
    assert_eq!(names(&d.stat_cli()), ["a"]);
    assert!(!b.exists());
}

#[test]
fn a_device_added_by_reload_recovers_a_left_over_state_only_when_told() {
    let dir = TempDir::new("reload-identity");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let cfg = dir.join("vzram.toml");
    write_ab(&cfg, &a, &b, "");
    let mut d = Daemon::start(&dir, &["--config", s(&cfg)], &[&a, &b]);
    serves(&b, 6);
    d.terminate_cleanly();
    drop(d);

    // Started without b: its state is left over.
    std::fs::write(&cfg, device("a", &a, "16M", "")).unwrap();
    let mut d = Daemon::start(&dir, &["--config", s(&cfg)], &[&a]);
    // Back in the file, as `vzram add` would take it: refused.
    write_ab(&cfg, &a, &b, "");
    hup_and_wait(&mut d, "reload done");
    assert_eq!(names(&d.stat_cli()), ["a"]);
    assert!(
        d.log_text()
            .contains("reload: in the file and not served, but not added"),
        "{}",
        d.log_text()
    );
    // recover=true serves its pages.
    write_ab(&cfg, &a, &b, "recover = true");
    hup_and_wait(&mut d, "reload done");
    assert_eq!(names(&d.stat_cli()), ["a", "b"]);
    let mut c = Client::connect(&b, 1).unwrap();
    assert_eq!(
        c.q(0).read(0, MIB as usize).unwrap(),
        noise(6, MIB as usize)
    );
}

#[test]
fn sighup_without_config_reloads_nothing() {
    let dir = TempDir::new("reload-none");
    let a = dir.join("a.sock");
    let mut d = Daemon::start(
        &dir,
        &["--device", &format!("socket={},size=16M,queues=1", s(&a))],
        &[&a],
    );
    hup_and_wait(&mut d, "nothing to reload");
    serves(&a, 7);
}

/// Limits at odds: accepted, with a warning to the client and in the log.
#[test]
fn limits_at_odds_are_set_with_a_warning() {
    let dir = TempDir::new("limits-warn");
    let a = dir.join("a.sock");
    let cfg = dir.join("vzram.toml");
    // At start: a device limit above the host limit.
    std::fs::write(
        &cfg,
        format!(
            "host_mem_limit = \"4M\"\n{}",
            device("a", &a, "32M", "mem_limit = \"8M\"")
        ),
    )
    .unwrap();
    let mut d = Daemon::start(&dir, &["--config", s(&cfg)], &[&a]);
    assert!(
        d.log_text()
            .contains("device a: its limit of 8M is above the host limit of 4M"),
        "{}",
        d.log_text()
    );
    let st = d.stat_cli();
    assert_eq!(st.counters("a").mem_limit, 8 * MIB);
    assert_eq!(st.pool().mem_limit, 4 * MIB);

    // set-limit: the host limit below a device's limit.
    let o = d.vzram(&["set-limit", "--host", "2M"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{o:?}");
    assert!(
        err.contains("warning: the host limit of 2M is below device a's limit"),
        "{err}"
    );
    assert_eq!(d.stat().pool().mem_limit, 2 * MIB);
    // A device limit above the host limit.
    let o = d.vzram(&["set-limit", "--device", "a", "6M"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{o:?}");
    assert!(err.contains("is above the host limit"), "{err}");
    assert_eq!(d.stat().counters("a").mem_limit, 6 * MIB);

    // A device limit below what it holds now.
    let o = d.vzram(&["set-limit", "--host", "0"]);
    assert!(o.status.success() && o.stderr.is_empty(), "{o:?}");
    let mut c = Client::connect(&a, 1).unwrap();
    let data = noise(8, 4 * MIB as usize);
    c.q(0).write(0, &data).unwrap();
    let used = d.stat().counters("a").mem_used_total;
    assert!(used > MIB, "{used}");
    let o = d.vzram(&["set-limit", "--device", "a", "1M"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{o:?}");
    assert!(
        err.contains("is below the") && err.contains("it holds now"),
        "{err}"
    );
    assert_eq!(d.stat().counters("a").mem_limit, MIB);
    // Nothing stored was dropped.
    assert_eq!(c.q(0).read(0, data.len()).unwrap(), data);
    // And the host limit below what the devices hold.
    let o = d.vzram(&["set-limit", "--host", "1M"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{o:?}");
    assert!(err.contains("the devices hold now"), "{err}");
    assert!(d.log_text().contains("the devices hold now"));

    // Still refused: a device limit above its size.
    let o = d.vzram(&["set-limit", "--device", "a", "64M"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");

    // A reload applies the same rule: a host limit below the device's.
    std::fs::write(
        &cfg,
        format!(
            "host_mem_limit = \"3M\"\n{}",
            device("a", &a, "32M", "mem_limit = \"16M\"")
        ),
    )
    .unwrap();
    hup_and_wait(&mut d, "reload done");
    let st = d.stat_cli();
    assert_eq!(st.pool().mem_limit, 3 * MIB);
    assert_eq!(st.counters("a").mem_limit, 16 * MIB);
    let log = d.log_text();
    let after = &log[log.rfind("SIGHUP").unwrap()..];
    assert!(
        after.contains("device a: its limit of 16M is above the host limit of 3M"),
        "{after}"
    );
    assert!(after.contains("the devices hold now"), "{after}");
}

/// `vzram reload`: the same reload as SIGHUP, for the daemon whose control
/// socket it names, and the reply says what changed (stdout) and what it
/// left (stderr); a refused file is exit 2 with one line, and changes
/// nothing.
#[test]
fn vzram_reload_says_what_changed_and_a_bad_file_exits_2() {
    let dir = TempDir::new("reload-cmd");
    let (a, b, c) = (dir.join("a.sock"), dir.join("b.sock"), dir.join("c.sock"));
    let cfg = dir.join("vzram.toml");
    write_ab(&cfg, &a, &b, "");
    let mut d = Daemon::start(&dir, &["--config", s(&cfg)], &[&a, &b]);
    std::fs::write(
        &cfg,
        format!(
            "host_mem_limit = \"48M\"\npoll_us = 100\n{}{}",
            device("a", &a, "32M", "mem_limit = \"4M\""),
            device("c", &c, "16M", "")
        ),
    )
    .unwrap();
    let o = d.vzram(&["reload"]);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{o:?}");
    assert!(
        out.starts_with(&format!("reloaded {}: 4 changes\n", cfg.display())),
        "{out}"
    );
    for line in [
        "  removed b (its state kept, left over)\n",
        "  added c (empty)\n",
        "  device a memory limit: 4.0 MiB\n",
        "  host memory limit: 48.0 MiB\n",
    ] {
        assert!(out.contains(line), "no {line:?} in:\n{out}");
    }
    // What it left, one line each, as the file writes it.
    assert_eq!(
        err,
        "warning: poll_us changed in the file (none -> 100 µs): needs a restart; left as it is\n\
         warning: device a: size changed in the file (16777216 bytes -> 33554432 bytes): needs a restart; left as it is\n"
    );
    assert_eq!(names(&d.stat_cli()), ["a", "c"]);
    serves(&c, 11);

    // The same file again: nothing to do.
    let o = d.vzram(&["reload"]);
    assert!(o.status.success(), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stdout).ends_with(": 0 changes\n"),
        "{o:?}"
    );

    // A file that does not parse: exit 2, one line, nothing changed.
    std::fs::write(&cfg, "[[device]\n").unwrap();
    let o = d.vzram(&["reload"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("error: ")
            && err.contains(s(&cfg))
            && err.contains("nothing changed, the devices keep serving"),
        "{err}"
    );
    assert!(o.stdout.is_empty(), "{o:?}");
    assert_eq!(names(&d.stat_cli()), ["a", "c"]);
    d.assert_alive();
}

#[test]
fn vzram_reload_without_config_exits_2() {
    let dir = TempDir::new("reload-cmd-none");
    let a = dir.join("a.sock");
    let mut d = Daemon::start(
        &dir,
        &["--device", &format!("socket={},size=16M,queues=1", s(&a))],
        &[&a],
    );
    let o = d.vzram(&["reload"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains("nothing to reload: vzram was started without --config"),
        "{o:?}"
    );
    d.assert_alive();
    serves(&a, 12);
}

/// `--pidfile`: the daemon's pid once it serves, a second daemon on it
/// refused (exit 2) without touching the first, `kill -HUP $(cat PATH)`
/// reloads the right daemon, and the file goes at a clean exit. A file
/// left unlocked (a daemon killed) is taken over.
#[test]
fn pidfile_names_this_daemon_and_refuses_a_second() {
    let dir = TempDir::new("pidfile");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let cfg = dir.join("vzram.toml");
    std::fs::write(&cfg, device("a", &a, "16M", "")).unwrap();
    let pidfile = dir.join("vzram.pid");
    // What a daemon killed with SIGKILL leaves: a pid, no lock.
    std::fs::write(&pidfile, "999999\n").unwrap();
    let mut d = Daemon::start(
        &dir,
        &["--config", s(&cfg), "--pidfile", s(&pidfile)],
        &[&a],
    );
    assert_eq!(
        std::fs::read_to_string(&pidfile).unwrap(),
        format!("{}\n", d.pid())
    );

    let o = serve_refused(
        &dir,
        &["--socket", s(&b), "--size", "16M", "--pidfile", s(&pidfile)],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert_eq!(
        err.trim(),
        format!(
            "error: --pidfile {}: another vzram (pid {}) holds it; stop that one first, or give another path",
            pidfile.display(),
            d.pid()
        )
    );
    assert!(!b.exists(), "the refused daemon bound its socket");
    assert_eq!(
        std::fs::read_to_string(&pidfile).unwrap(),
        format!("{}\n", d.pid())
    );

    // The pid in the file is the daemon's: SIGHUP through it reloads.
    std::fs::write(
        &cfg,
        format!(
            "{}{}",
            device("a", &a, "16M", ""),
            device("b", &b, "16M", "")
        ),
    )
    .unwrap();
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let before = d.log_text().matches("reload done").count();
    // SAFETY: kill(2) on the daemon we started; no memory is involved.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while d.log_text().matches("reload done").count() == before {
        assert!(Instant::now() < deadline, "{}", d.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(names(&d.stat_cli()), ["a", "b"]);

    assert_eq!(d.terminate().code(), Some(0), "{}", d.log_text());
    assert!(!pidfile.exists(), "the pid file is left after a clean exit");
}

/// The host's staging budget comes from the file and a reload sets it on
/// the running workers: at 0 no device stages whatever its own budget
/// says, and once set its 4 KiB writes are staged again.
#[test]
fn a_reload_sets_the_host_staging_budget_live() {
    let dir = TempDir::new("reload-staging");
    let a = dir.join("a.sock");
    let cfg = dir.join("vzram.toml");
    let file = |host: &str| {
        let dev = device("a", &a, "16M", "staging = \"8M\"");
        std::fs::write(&cfg, format!("host_staging = \"{host}\"\n{dev}")).unwrap();
    };
    const PAGES: u64 = 256;
    let page = |i: u64, v: u64| pattern(i ^ v << 32, i * PAGE as u64, PAGE);
    let write = |c: &mut Client, v: u64| {
        for i in 0..PAGES {
            c.q(0).write(i * PAGE as u64, &page(i, v)).unwrap();
        }
    };
    file("0");
    let mut d = Daemon::start(&dir, &["--config", s(&cfg)], &[&a]);
    let mut c = Client::connect(&a, 1).unwrap();
    write(&mut c, 1);
    let st = d.stat();
    let s = st.counters("a");
    assert_eq!((s.staged_bytes, s.staged_compressed), (0, 0), "{st}");
    assert_eq!(st.pool().staging_limit, 0, "{st}");

    file("4M");
    hup_and_wait(&mut d, "reload done");
    assert!(
        d.log_text()
            .contains("reload: host staging changed in the file, set"),
        "{}",
        d.log_text()
    );
    write(&mut c, 2);
    let st = d.settled();
    assert_eq!(st.pool().staging_limit, 4 * MIB, "{st}");
    assert_eq!(st.counters("a").staged_compressed, PAGES, "{st}");
    for i in 0..PAGES {
        let got = c.q(0).read(i * PAGE as u64, PAGE).unwrap();
        assert!(got == page(i, 2), "page {i} after the reload");
    }
    let text = d.cli_ok(&["stat"]);
    assert!(text.contains("host staging budget: 4"), "{text}");
    assert_eq!(st.pool().staging_used, 0, "{st}");
}
