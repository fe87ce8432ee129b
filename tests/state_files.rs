//! A state's files are its own: every data file carries its state's
//! creation id, so files of two devices mixed offline are refused naming
//! both; a state from before the ids is bound on its first open; the marker
//! beside a socket is replaced, never written through; a backing file that
//! is a link into a state is refused whatever the link's own path says.
//! Each through the real daemon.

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use vzram_tests::*;

fn dev(sock: &Path, extra: &str) -> String {
    format!("socket={},size=16M,queues=1{extra}", s(sock))
}

fn fill(sock: &Path, seed: u64, pages: usize) {
    let mut c = Client::connect(sock, 1).unwrap();
    c.q(0).write(0, &pattern(seed, 0, pages * 4096)).unwrap();
}

fn holds(sock: &Path, seed: u64, pages: usize) -> bool {
    let mut c = Client::connect(sock, 1).unwrap();
    c.q(0).read(0, pages * 4096).unwrap() == pattern(seed, 0, pages * 4096)
}

/// Exit 2 with one error line saying each of `what`.
fn refused_with(o: &Output, what: &[&str]) {
    let t = said(o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    let errors: Vec<&str> = t.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "one error line: {t}");
    for w in what {
        assert!(errors[0].contains(w), "expected {w:?} in: {t}");
    }
}

fn swap(a: &Path, b: &Path) {
    let tmp = a.with_extension("swap");
    std::fs::rename(a, &tmp).unwrap();
    std::fs::rename(b, a).unwrap();
    std::fs::rename(&tmp, b).unwrap();
}

/// Two devices, x on a.sock and y on b.sock, holding seeds 1 and 2.
fn two_devices(dir: &TempDir) -> (Daemon, [String; 2], PathBuf) {
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let specs = [dev(&a, ",name=x"), dev(&b, ",name=y")];
    let d = Daemon::start(
        dir,
        &["--device", &specs[0], "--device", &specs[1]],
        &[&a, &b],
    );
    fill(&a, 1, 64);
    fill(&b, 2, 64);
    let root = d.stat().dev("x").state.parent().unwrap().to_path_buf();
    (d, specs, root)
}

#[test]
fn files_of_two_states_mixed_offline_are_refused_naming_both() {
    let dir = TempDir::new("bind-mix");
    let (mut d, [dx, dy], root) = two_devices(&dir);
    d.terminate_cleanly();
    let args = ["--device", &dx, "--device", &dy];
    for f in ["table", "arena", "stats"] {
        let (x, y) = (root.join("x").join(f), root.join("y").join(f));
        swap(&x, &y);
        let o = serve_refused(&dir, &args);
        refused_with(
            &o,
            &[
                &format!("{}: belongs to another state", x.display()) as &str,
                s(&root.join("y/header")),
                s(&root.join("x/header")),
            ],
        );
        swap(&x, &y);
    }
    // Put back, each serves its own pages.
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let mut d = Daemon::start(&dir, &args, &[&a, &b]);
    assert!(holds(&a, 1, 64) && holds(&b, 2, 64));
    d.terminate_cleanly();
}

/// A state as a vzram before the ids made it: header version 3, each data
/// file its data alone.
fn make_old(state: &Path) {
    let h = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(state.join("header"))
        .unwrap();
    let mut b = [0u8; 32];
    h.read_exact_at(&mut b, 0).unwrap();
    assert_eq!(u32::from_le_bytes(b[8..12].try_into().unwrap()), 4);
    let size = u64::from_le_bytes(b[16..24].try_into().unwrap());
    let arena = u64::from_le_bytes(b[24..32].try_into().unwrap());
    h.write_all_at(&3u32.to_le_bytes(), 8).unwrap();
    let cut = |f: &str, len: u64| {
        let p = state.join(f);
        let was = std::fs::metadata(&p).unwrap().len();
        assert!(was > len, "{f} has no id past its data");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(len)
            .unwrap();
    };
    cut("table", size / 4096 * 8);
    cut("arena", arena);
    // The counters' length is the daemon's business: cut the id only.
    let stats = std::fs::metadata(state.join("stats")).unwrap().len();
    cut("stats", stats - 32);
}

#[test]
fn a_state_from_before_the_ids_is_bound_on_its_first_open() {
    let dir = TempDir::new("bind-old");
    let (mut d, [dx, dy], root) = two_devices(&dir);
    d.terminate_cleanly();
    make_old(&root.join("x"));
    make_old(&root.join("y"));
    let lens = |st: &str| {
        ["table", "arena", "stats"].map(|f| std::fs::metadata(root.join(st).join(f)).unwrap().len())
    };
    let before = lens("x");
    let args = ["--device", &dx, "--device", &dy];
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let mut d = Daemon::start(&dir, &args, &[&a, &b]);
    assert!(holds(&a, 1, 64) && holds(&b, 2, 64));
    d.terminate_cleanly();
    // Bound now: every file is longer by its id, and a mix is refused.
    let after = lens("x");
    assert!(
        before.iter().zip(&after).all(|(b, a)| a > b),
        "{before:?} {after:?}"
    );
    let header = std::fs::read(root.join("x/header")).unwrap();
    assert_eq!(header[8], 4, "the header was rewritten as version 4");
    swap(&root.join("x/table"), &root.join("y/table"));
    let o = serve_refused(&dir, &args);
    refused_with(&o, &["belongs to another state"]);
    swap(&root.join("x/table"), &root.join("y/table"));
    // A version 4 state with a file of no id (an older state's put in).
    make_old(&root.join("y"));
    std::fs::OpenOptions::new()
        .write(true)
        .open(root.join("y/header"))
        .unwrap()
        .write_all_at(&4u32.to_le_bytes(), 8)
        .unwrap();
    let o = serve_refused(&dir, &args);
    refused_with(&o, &[s(&root.join("y/table")), "carries no creation id"]);
}

/// The marker beside a socket is written to a new file and renamed over
/// the old: whatever the old name was a link to (a hard link to another
/// file, planted or left by a copy) keeps its bytes, and a reader never
/// sees half a marker.
#[test]
fn the_marker_beside_a_socket_is_replaced_never_written_through() {
    let dir = TempDir::new("bind-marker");
    let a = dir.join("a.sock");
    let marker = dir.join(".a.sock.vzram-state");
    let victim = dir.join("victim.txt");
    std::fs::write(&victim, b"someone's file\n").unwrap();
    std::fs::hard_link(&victim, &marker).unwrap();
    let mut d = Daemon::start(&dir, &["--device", &dev(&a, "")], &[&a]);
    let state = d.stat().dev_at(&a).state.clone();
    d.terminate_cleanly();
    assert_eq!(
        std::fs::read_to_string(&victim).unwrap(),
        "someone's file\n",
        "the marker was written through into the file it was linked to"
    );
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap().trim_end(),
        s(&state)
    );
    assert_ne!(
        std::fs::metadata(&marker).unwrap().ino(),
        std::fs::metadata(&victim).unwrap().ino()
    );
}

/// `backing-file=` naming a symbolic link to a file of a state (served, or
/// left over and unlocked) is refused as the file itself is: never taken
/// as pages, never written.
#[test]
fn a_backing_file_that_links_into_a_state_is_refused() {
    let dir = TempDir::new("bind-link");
    let (a, b, c) = (dir.join("a.sock"), dir.join("b.sock"), dir.join("c.sock"));
    // x: left over (nobody holds it); y: served.
    let (mut d, [_, dy], root) = two_devices(&dir);
    d.terminate_cleanly();
    let mut d = Daemon::start(&dir, &["--device", &dy], &[&b]);
    for (target, file) in [("x", "arena"), ("x", "table"), ("y", "arena")] {
        let real = root.join(target).join(file);
        let link = dir.join(&format!("{target}-{file}.img"));
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let before = std::fs::read(&real).unwrap();
        let spec = dev(&c, &format!(",backing-file={}", s(&link)));
        let o = Vzram::new(&["add", "--device", &spec, "--control", s(&d.control)]).output();
        refused_with(&o, &["inside the state of a device"]);
        assert!(
            std::fs::read(&real).unwrap() == before,
            "{} was changed",
            real.display()
        );
    }
    d.terminate_cleanly();
    // The same at start.
    let link = dir.join("x-arena.img");
    let spec = dev(&c, &format!(",backing-file={}", s(&link)));
    let o = serve_refused(&dir, &["--device", &dy, "--device", &spec]);
    refused_with(&o, &["inside the state of a device"]);
    let mut d = Daemon::start(&dir, &["--device", &dev(&a, ",name=x")], &[&a]);
    assert!(holds(&a, 1, 64), "x keeps its pages");
    d.terminate_cleanly();
}

/// `vzram serve ARGS`, started once its control socket answers (a killed
/// daemon leaves the old socket file behind).
fn serve_after_kill(dir: &TempDir, args: &[&str], sockets: &[&Path]) -> Daemon {
    let control = dir.join("control.sock");
    let mut cmd = Command::new(vzram_bin());
    cmd.arg("serve").args(args).arg("--control").arg(&control);
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let log = dir.join(&format!("restart-{n}.log"));
    Daemon::start_command(cmd, &control, &log, sockets)
}

/// kill -9 in the middle of `vzram remove` of a state large enough that
/// deleting it takes a while (1 GiB of its arena's file allocated, as a
/// full VM's pages would be: tmpfs frees them in the unlink): the kill is
/// sent the moment the removal shows, so it lands while the files go. The
/// next start finds a tombstone it finishes, or the whole state, never a
/// half-deleted state under the device's name.
#[test]
fn kill9_in_the_middle_of_deleting_a_large_state() {
    let dir = TempDir::new("bind-bigrm");
    let (a, x) = (dir.join("a.sock"), dir.join("x.sock"));
    let da = dev(&a, "");
    let dx = format!("socket={},size=64M,queues=1,name=x", s(&x));
    let mut d = Daemon::start(&dir, &["--device", &da], &[&a]);
    let mut landed = 0;
    for round in 0..4u64 {
        let o = Vzram::new(&["add", "--device", &dx, "--control", s(&d.control)]).output();
        assert!(o.status.success(), "round {round}: {}", said(&o));
        fill(&x, round, 64);
        let state = d.stat().dev("x").state.clone();
        let root = state.parent().unwrap().to_path_buf();
        {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(state.join("arena"))
                .unwrap();
            let len = f.metadata().unwrap().len() as i64;
            use std::os::fd::AsRawFd;
            // SAFETY: fallocate on a file this test opened; blocks past
            // the end, the size kept.
            let rc =
                unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, len, 1 << 30) };
            assert_eq!(rc, 0, "fallocate: {}", std::io::Error::last_os_error());
        }
        let control = d.control.clone();
        let t = std::thread::spawn(move || {
            Vzram::new(&["remove", "--device", "x", "--control", s(&control)]).output()
        });
        // The removal shows as the state's directory gone (renamed to a
        // tombstone) or one of its four files gone.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::fs::read_dir(&state).map_or(0, |r| r.count()) == 4 {
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: the removal never started: {}",
                d.log_text()
            );
            std::hint::spin_loop();
        }
        d.kill9_tree();
        let _ = t.join();
        let names = || -> Vec<String> {
            std::fs::read_dir(&root)
                .unwrap()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        };
        let left = names();
        if left.iter().any(|n| n != "a") {
            landed += 1;
        }
        d = serve_after_kill(&dir, &["--device", &da], &[&a]);
        let now = names();
        let kept = now.iter().any(|n| n == "x");
        if kept {
            // Cut before it began: the whole state, served again.
            let o = Vzram::new(&["add", "--device", &format!("{dx},recover=true")])
                .args(["--control", s(&d.control)])
                .output();
            assert!(
                o.status.success(),
                "round {round}: left after the kill {left:?}, after the start {now:?}: {}",
                said(&o)
            );
            assert!(
                holds(&x, round, 64),
                "round {round}: a kept state lost pages"
            );
            let o = Vzram::new(&["remove", "--device", "x", "--control", s(&d.control)]).output();
            assert!(o.status.success(), "{}", said(&o));
        }
        assert!(
            names().iter().all(|n| n.starts_with("a-")),
            "round {round}: left after the kill {left:?}, in the state dir after the start: {:?}\n{}",
            names(),
            d.log_text()
        );
    }
    eprintln!("{landed} of 4 kills landed in the middle of a deletion");
    assert!(landed > 0, "no kill landed in the middle of a deletion");
    d.terminate_cleanly();
}

/// The backing file is bound too: its block 0 names the state whose pages
/// it holds. Two devices' backing files swapped in the configuration are
/// refused, naming both states' ids.
#[test]
fn backing_files_swapped_between_two_devices_are_refused() {
    let dir = TempDir::new("bind-backing");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let (fa, fb) = (dir.join("a.img"), dir.join("b.img"));
    for f in [&fa, &fb] {
        std::fs::File::create(f).unwrap().set_len(4 << 20).unwrap();
    }
    let spec = |sock: &Path, name: &str, file: &Path| {
        dev(sock, &format!(",name={name},backing-file={}", s(file)))
    };
    let (dx, dy) = (spec(&a, "x", &fa), spec(&b, "y", &fb));
    let mut d = Daemon::start(&dir, &["--device", &dx, "--device", &dy], &[&a, &b]);
    let ids: Vec<String> = ["x", "y"]
        .iter()
        .map(|n| {
            let h = std::fs::read(d.stat().dev(n).state.join("header")).unwrap();
            format!("{:016x}", u64::from_le_bytes(h[32..40].try_into().unwrap()))
        })
        .collect();
    d.terminate_cleanly();
    let o = serve_refused(
        &dir,
        &[
            "--device",
            &spec(&a, "x", &fb),
            "--device",
            &spec(&b, "y", &fa),
        ],
    );
    refused_with(
        &o,
        &[
            s(&fb),
            "another device's written-back pages",
            &ids[1],
            &ids[0],
        ],
    );
    let mut d = Daemon::start(&dir, &["--device", &dx, "--device", &dy], &[&a, &b]);
    d.terminate_cleanly();
}
