//! Destructive operator commands on a device a VM is using (issue 37):
//! `remove`, `reset` and `forget` are refused with one line naming the
//! frontend unless `--force`; a forced remove keeps the state, and no
//! reload serves the device again blank. Every command a refusal advises
//! is run as advised.

use std::path::Path;
use std::time::{Duration, Instant};

use vzram_tests::*;

const MIB: usize = 1 << 20;

/// A `[[device]]` table.
fn device(name: &str, socket: &Path, extra: &str) -> String {
    format!(
        "[[device]]\nname = \"{name}\"\nsocket = \"{}\"\nsize = \"16M\"\nqueues = 1\n{extra}\n",
        s(socket)
    )
}

fn hup_and_wait(d: &mut Daemon, needle: &str) {
    let before = d.log_text().matches(needle).count();
    // SAFETY: kill(2) on the daemon we started; no memory is involved.
    let rc = unsafe { libc::kill(d.pid() as i32, libc::SIGHUP) };
    assert_eq!(rc, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while d.log_text().matches(needle).count() <= before {
        d.assert_alive();
        assert!(
            Instant::now() < deadline,
            "no {needle:?}:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Names the device `vm1` in `vzram CMD vm1`, refused while connected:
/// the refusal names this process (the frontend) and advises one command.
fn refused_naming_us(d: &Daemon, line: &str) -> String {
    let o = run_hint(&d.control, line);
    assert_eq!(o.status.code(), Some(2), "{o:?}\n{}", d.log_text());
    let err = refusal(&o);
    let pid = format!("pid {}", std::process::id());
    assert!(
        err.contains(&pid),
        "`{line}` does not name the frontend ({pid}): {err}"
    );
    err
}

#[test]
fn remove_of_a_connected_device_is_refused_and_forced_keeps_its_pages_through_reloads() {
    let dir = TempDir::new("guard-remove");
    let sock = dir.join("vm1.sock");
    let cfg = dir.join("vzram.toml");
    std::fs::write(&cfg, device("vm1", &sock, "")).unwrap();
    let mut d = Daemon::start(&dir, &["--config", s(&cfg)], &[&sock]);
    let data = noise(37, MIB);
    let mut c = Client::connect(&sock, 1).unwrap();
    c.q(0).write(0, &data).unwrap();
    let state = d.stat().dev("vm1").state.clone();

    // forget and remove: refused, naming the frontend.
    let err = refused_naming_us(&d, "vzram forget vm1");
    assert_eq!(
        hints(&err),
        ["vzram remove vm1 --force", "vzram forget vm1"],
        "{err}"
    );
    let err = refused_naming_us(&d, "vzram remove vm1");
    assert!(state.exists() && sock.exists(), "{err}");
    assert_eq!(hints(&err), ["vzram remove vm1 --force"], "{err}");
    // The advised command cuts the VM off and keeps its state.
    let out = run_hint_ok(&d.control, &hints(&err)[0]);
    drop(c);
    assert!(state.exists(), "a forced remove deleted the state: {out}");
    let again = hints(&out);
    assert_eq!(again.len(), 2, "{out}");
    // `vzram stat` advises the same commands for the left-over state.
    let stat = run_hint_ok(&d.control, "vzram stat");
    assert_eq!(hints(&stat), again, "{stat}");
    let st = d.stat();
    assert!(st.devices().is_empty(), "{st}");

    // The device is still in the file: a reload does not serve it again
    // blank, nor does fresh=true in the file discard it.
    hup_and_wait(&mut d, "reload done");
    assert!(d.stat().devices().is_empty(), "{}", d.log_text());
    std::fs::write(&cfg, device("vm1", &sock, "fresh = true")).unwrap();
    hup_and_wait(&mut d, "reload done");
    assert!(d.stat().devices().is_empty(), "{}", d.log_text());
    assert!(state.exists() && !sock.exists());

    // The command the remove printed serves the pages again.
    run_hint_ok(&d.control, &again[0]);
    let mut c = Client::connect(&sock, 1).unwrap();
    assert!(
        c.q(0).read(0, MIB).unwrap() == data,
        "the pages are not back"
    );
}

#[test]
fn reset_of_a_connected_device_is_refused_and_forced_cuts_it_off() {
    let dir = TempDir::new("guard-reset");
    let sock = dir.join("vm1.sock");
    let d = Daemon::start(
        &dir,
        &[
            "--device",
            &format!("socket={},size=16M,queues=1,name=vm1", s(&sock)),
        ],
        &[&sock],
    );
    let mut c = Client::connect(&sock, 1).unwrap();
    c.q(0).write(0, &noise(3, 2 * MIB)).unwrap();
    let err = refused_naming_us(&d, "vzram reset vm1");
    assert_eq!(hints(&err), ["vzram reset vm1 --force"], "{err}");
    assert_eq!(d.stat().counters("vm1").orig_data_size, 2 * MIB as u64);
    let out = run_hint_ok(&d.control, &hints(&err)[0]);
    assert!(out.contains("512 pages dropped"), "{out}");
    drop(c);
    let mut c = Client::connect(&sock, 1).unwrap();
    assert!(c.q(0).read(0, 2 * MIB).unwrap() == vec![0; 2 * MIB]);
}

/// `--device` specs for devices `a` and `b` in `dir`, b of `b_size`.
fn ab(dir: &TempDir, b_size: &str) -> Vec<String> {
    vec![
        "--device".into(),
        format!("socket={},size=16M,queues=1,name=a", s(&dir.join("a.sock"))),
        "--device".into(),
        format!(
            "socket={},size={b_size},queues=1,name=b",
            s(&dir.join("b.sock"))
        ),
    ]
}

fn start(dir: &TempDir, args: &[String], sockets: &[&Path]) -> Daemon {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    Daemon::start(dir, &a, sockets)
}

/// The one error line `serve ARGS` is refused with (after its log lines).
fn serve_refusal(dir: &TempDir, args: &[String]) -> String {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = serve_refused(dir, &a);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    let last = err.trim_end().lines().last().unwrap_or_default();
    assert!(last.starts_with("error: "), "{err}");
    last.to_string()
}

fn reads(sock: &Path, len: usize) -> Vec<u8> {
    Client::connect(sock, 1).unwrap().q(0).read(0, len).unwrap()
}

/// The WARN lines of `log` that say a state was discarded, for `device`.
fn discards(log: &str, device: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("WARN") && l.contains("discarding"))
        .filter(|l| l.contains(&format!("device={device} ")))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_refusal_for_one_device_advises_fresh_for_it_alone_and_discards_are_logged() {
    let dir = TempDir::new("guard-fresh");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let d = start(&dir, &ab(&dir, "16M"), &[&a, &b]);
    let data = noise(5, MIB);
    for sock in [&a, &b] {
        Client::connect(sock, 1)
            .unwrap()
            .q(0)
            .write(0, &data)
            .unwrap();
    }
    d.shutdown();

    // b's size changed: refused, advising the flag for b alone.
    let args = ab(&dir, "32M");
    let err = serve_refusal(&dir, &args);
    assert_eq!(flag_hints(&err), ["--fresh b"], "{err}");
    let mut with = args.clone();
    with.extend(flag_hints(&err)[0].split(' ').map(str::to_string));
    let d = start(&dir, &with, &[&a, &b]);
    assert!(reads(&a, MIB) == data, "--fresh b discarded a's pages");
    assert!(reads(&b, MIB) == vec![0; MIB]);
    let log = d.log_text();
    let lines = discards(&log, "b");
    assert_eq!(lines.len(), 1, "{log}");
    assert!(lines[0].contains("size=16777216"), "{}", lines[0]);
    assert!(discards(&log, "a").is_empty(), "{log}");
    d.shutdown();

    // A name that is no device: refused before anything is touched.
    let mut typo = args.clone();
    typo.extend(["--fresh".into(), "c".into()]);
    let err = serve_refusal(&dir, &typo);
    assert!(err.contains("--fresh c: no device of that name"), "{err}");
    // The bare flag still means every device, each discard logged.
    let mut all = args.clone();
    all.push("--fresh".into());
    let d = start(&dir, &all, &[&a, &b]);
    let log = d.log_text();
    for name in ["a", "b"] {
        let lines = discards(&log, name);
        assert!(lines.len() == 1 && lines[0].contains("size="), "{log}");
    }
    assert!(reads(&a, MIB) == vec![0; MIB]);
}

#[test]
fn after_a_fresh_start_in_the_wrong_state_dir_adopt_serves_the_right_ones_pages() {
    let dir = TempDir::new("guard-marker");
    let sock = dir.join("vm1.sock");
    let (right, wrong) = (dir.join("right"), dir.join("wrong"));
    for d in [&right, &wrong] {
        std::fs::create_dir(d).unwrap();
    }
    let dev = vec![
        "--device".to_string(),
        format!("socket={},size=16M,queues=1,name=vm1", s(&sock)),
    ];
    let in_dir = |root: &Path| {
        let mut a = dev.clone();
        a.extend(["--state-dir".into(), s(root).to_string()]);
        a
    };
    let d = start(&dir, &in_dir(&right), &[&sock]);
    let data = noise(8, MIB);
    Client::connect(&sock, 1)
        .unwrap()
        .q(0)
        .write(0, &data)
        .unwrap();
    d.shutdown();

    // Started in the wrong dir: refused; the operator takes `--fresh vm1`.
    let err = serve_refusal(&dir, &in_dir(&wrong));
    let hints = flag_hints(&err);
    assert!(hints.iter().any(|h| h == "--fresh vm1"), "{err}");
    let mut fresh = in_dir(&wrong);
    fresh.extend(["--fresh".into(), "vm1".into()]);
    start(&dir, &fresh, &[&sock]).shutdown();

    // Back in the right dir: refused, but with a way to its own pages.
    let err = serve_refusal(&dir, &in_dir(&right));
    let adopt: Vec<String> = flag_hints(&err)
        .into_iter()
        .filter(|h| h.starts_with("--adopt"))
        .collect();
    assert_eq!(adopt, ["--adopt vm1"], "{err}");
    let mut args = in_dir(&right);
    args.extend(adopt[0].split(' ').map(str::to_string));
    let d = start(&dir, &args, &[&sock]);
    assert!(
        reads(&sock, MIB) == data,
        "the right dir's pages are not served"
    );
    d.shutdown();
    // The marker records it now: a plain start serves it.
    let d = start(&dir, &in_dir(&right), &[&sock]);
    assert!(reads(&sock, MIB) == data);
    d.shutdown();
}

#[test]
fn backing_init_refuses_a_file_that_is_neither_blank_nor_vzrams_unless_forced() {
    let dir = TempDir::new("guard-backing");
    let nowhere = dir.join("no-daemon.sock");
    // A text file, typed by mistake: refused, untouched.
    let text = dir.join("notes.txt");
    let body = b"my notes, not a disk\n".repeat(1000);
    std::fs::write(&text, &body).unwrap();
    let err = refusal(&run_hint(
        &nowhere,
        &format!("vzram backing init {}", s(&text)),
    ));
    assert!(std::fs::read(&text).unwrap() == body, "changed: {err}");
    let advised = hints(&err);
    assert_eq!(
        advised,
        [format!("vzram backing init {} --force", s(&text))],
        "{err}"
    );
    run_hint_ok(&nowhere, &advised[0]);
    let now = std::fs::read(&text).unwrap();
    assert!(now[..4096].iter().all(|&b| b == 0) && now[4096..] == body[4096..]);

    // Blank at the start, data further on: not blank either.
    let late = dir.join("late.img");
    let mut img = vec![0u8; 1 << 20];
    img[700_000] = 1;
    std::fs::write(&late, &img).unwrap();
    let err = refusal(&run_hint(
        &nowhere,
        &format!("vzram backing init {}", s(&late)),
    ));
    assert!(err.contains("byte 700000 is not zero"), "{err}");

    // Blank (holes), and vzram's own: no --force needed.
    let blank = dir.join("blank.img");
    std::fs::File::create(&blank)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    run_hint_ok(&nowhere, &format!("vzram backing init {}", s(&blank)));
    let sock = dir.join("vm1.sock");
    let spec = format!(
        "socket={},size=16M,queues=1,name=vm1,backing-file={}",
        s(&sock),
        s(&blank)
    );
    let d = Daemon::start(&dir, &["--device", &spec], &[&sock]);
    let mut c = Client::connect(&sock, 1).unwrap();
    c.q(0).write(0, &noise(9, MIB)).unwrap();
    run_hint_ok(&d.control, "vzram writeback vm1");
    // In use: refused, naming the process that holds it.
    let err = refusal(&run_hint(
        &nowhere,
        &format!("vzram backing init {}", s(&blank)),
    ));
    assert!(err.contains(&format!("process {}", d.pid())), "{err}");
    drop(c);
    d.shutdown();
    run_hint_ok(&nowhere, &format!("vzram backing init {}", s(&blank)));
}

/// The two numbers `vzram mark-idle` prints: newly marked, idle in all.
fn marked(out: &str) -> (u64, u64) {
    let num = |after: &str| -> u64 {
        let tail = out.split(after).next().unwrap_or_default();
        let n = tail.rsplit(' ').next().unwrap_or_default();
        n.parse()
            .unwrap_or_else(|_| panic!("no count before {after:?}: {out}"))
    };
    (num(" pages marked idle"), num(" pages idle in all"))
}

#[test]
fn every_command_names_the_device_alike_and_mark_idle_counts_what_writeback_takes() {
    let dir = TempDir::new("guard-cli");
    let sock = dir.join("vm1.sock");
    let backing = dir.join("vm1.bk");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let spec = format!(
        "socket={},size=16M,queues=1,name=vm1,backing-file={}",
        s(&sock),
        s(&backing)
    );
    let d = Daemon::start(&dir, &["--device", &spec], &[&sock]);
    let mut c = Client::connect(&sock, 1).unwrap();
    c.q(0).write(0, &noise(4, MIB)).unwrap();
    let ctl = &d.control;

    // A second mark-idle marks nothing new, but the pages are idle still:
    // it says how many, and writeback --idle takes exactly those.
    let first = marked(&run_hint_ok(ctl, "vzram mark-idle --device vm1"));
    assert_eq!(first, (256, 256));
    let out = run_hint_ok(ctl, "vzram mark-idle vm1");
    assert_eq!(marked(&out), (0, 256), "{out}");
    let out = run_hint_ok(ctl, "vzram writeback vm1 --idle");
    assert!(out.starts_with("device vm1: wrote 256 pages"), "{out}");

    // Every device command: NAME, or --device NAME, alike.
    for name in ["vm1", "--device vm1"] {
        for cmd in [
            format!("vzram stat {name}"),
            format!("vzram set-limit {name} 8M"),
            format!("vzram compact {name}"),
            format!("vzram reset-max {name}"),
            format!("vzram mark-idle {name}"),
            format!("vzram recompress {name} --idle"),
            format!("vzram writeback {name} --huge"),
        ] {
            run_hint_ok(ctl, &cmd);
        }
    }
    assert_eq!(d.stat().counters("vm1").mem_limit, 8 << 20);

    // `forget` of a served device advises a `remove` that runs.
    drop(c);
    let err = refusal(&run_hint(ctl, "vzram forget vm1"));
    assert_eq!(hints(&err), ["vzram remove vm1"], "{err}");
    run_hint_ok(ctl, &hints(&err)[0]);
    assert!(d.stat().devices().is_empty());
}

/// A daemon in `dir` with its own control socket `ctl` (so the same
/// state dir as [`Daemon::start`]'s).
fn second(dir: &TempDir, ctl: &str, spec: &str, sock: &Path) -> Daemon {
    let control = dir.join(ctl);
    let mut cmd = std::process::Command::new(vzram_bin());
    cmd.args(["serve", "--device", spec, "--control"])
        .arg(&control);
    Daemon::start_command(cmd, &control, &dir.join(&format!("{ctl}.log")), &[sock])
}

#[test]
fn forget_never_deletes_another_state_made_at_the_path_since() {
    let dir = TempDir::new("guard-forget");
    let (a, t1, t2) = (dir.join("a.sock"), dir.join("t1.sock"), dir.join("t2.sock"));
    let da = format!("socket={},size=16M,queues=1,name=a", s(&a));
    let mut d = Daemon::start(&dir, &["--device", &da], &[&a]);
    d.cli(&[
        "add",
        "--device",
        &format!("socket={},size=16M,name=t1", s(&t1)),
    ]);
    Client::connect(&t1, 1)
        .unwrap()
        .q(0)
        .write(0, &pattern(1, 0, MIB))
        .unwrap();
    d.kill9();
    // Restarted, the daemon lists t1's state as left over.
    let control = dir.join("control.sock");
    let mut cmd = std::process::Command::new(vzram_bin());
    cmd.args(["serve", "--device", &da, "--control"])
        .arg(&control);
    let d = Daemon::start_command(cmd, &control, &dir.join("again.log"), &[&a]);
    let left = d.control(json!({"cmd": "stat"}))["leftovers"].clone();
    assert_eq!(left[0]["name"], "t1", "{left}");
    let state = std::path::PathBuf::from(left[0]["dir"].as_str().unwrap());

    // Meanwhile another state is made at that path: another daemon's
    // device of the same name (the listed one moved away).
    std::fs::rename(&state, state.with_extension("moved")).unwrap();
    let other = format!("socket={},size=16M,queues=1,name=t1", s(&t2));
    let b = second(&dir, "b.ctl", &other, &t2);
    Client::connect(&t2, 1)
        .unwrap()
        .q(0)
        .write(0, &pattern(2, 0, MIB))
        .unwrap();
    b.shutdown();

    // Forgetting the listed state leaves the new one alone.
    let err = refusal(&run_hint(&d.control, "vzram forget t1"));
    assert!(err.contains("not the state that was listed"), "{err}");
    assert!(
        state.join("header").exists(),
        "forget deleted another state: {err}"
    );
    let b = second(&dir, "b.ctl", &other, &t2);
    assert!(
        reads(&t2, MIB) == pattern(2, 0, MIB),
        "the new state lost its pages"
    );
    b.shutdown();
}

#[test]
fn the_fresh_a_refusal_advises_for_a_device_named_after_its_socket_runs() {
    let dir = TempDir::new("guard-key");
    let sock = dir.join("vm.sock");
    let spec = |size: &str| {
        vec![
            "--device".to_string(),
            format!("socket={},size={size},queues=1", s(&sock)),
        ]
    };
    let d = start(&dir, &spec("16M"), &[&sock]);
    Client::connect(&sock, 1)
        .unwrap()
        .q(0)
        .write(0, &noise(6, MIB))
        .unwrap();
    d.shutdown();
    let err = serve_refusal(&dir, &spec("32M"));
    let fresh = flag_hints(&err);
    assert_eq!(fresh.len(), 1, "{err}");
    let mut with = spec("32M");
    with.extend(fresh[0].split(' ').map(str::to_string));
    let d = start(&dir, &with, &[&sock]);
    assert!(reads(&sock, MIB) == vec![0; MIB]);
    d.shutdown();
}
