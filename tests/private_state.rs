//! The state root is the daemon user's alone. A local user (uid 65534
//! here, racing the daemon, which runs as root as these tests do) who
//! makes the state dir first, plants a state in it or names a directory
//! like a tombstone gets nothing served and loses nothing: the daemon
//! refuses with one line naming the path, owner and mode and the fix, and
//! deletes nothing. The root the daemon makes is 0700; the default one is
//! never a directory another user can make first.

use std::fs::Permissions;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use vzram_tests::*;

const NOBODY: u32 = 65534;

fn chown_r(p: &Path, uid: u32) {
    let o = Command::new("chown")
        .args(["-R", &uid.to_string(), s(p)])
        .output()
        .unwrap();
    assert!(o.status.success(), "chown: {}", said(&o));
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

/// Named after its socket's file, explicitly: its state directory is then
/// that name (an unnamed device's is keyed by its whole socket path).
fn dev(sock: &Path) -> String {
    let name = sock.file_stem().unwrap().to_string_lossy();
    format!("socket={},size=16M,queues=1,name={name}", s(sock))
}

fn fill(sock: &Path, seed: u64, pages: usize) {
    let mut c = Client::connect(sock, 1).unwrap();
    c.q(0).write(0, &pattern(seed, 0, pages * 4096)).unwrap();
}

fn holds(sock: &Path, seed: u64, pages: usize) -> bool {
    let mut c = Client::connect(sock, 1).unwrap();
    c.q(0).read(0, pages * 4096).unwrap() == pattern(seed, 0, pages * 4096)
}

/// Exit 2 with one error line saying each of `what`; returns that line.
fn refused_with(o: &Output, what: &[&str]) -> String {
    let t = said(o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    let errors: Vec<&str> = t.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "one error line: {t}");
    for w in what {
        assert!(errors[0].contains(w), "expected {w:?} in: {t}");
    }
    errors[0].to_string()
}

/// The shell command between the last pair of backquotes of `line`, run.
fn run_advice(line: &str) {
    let cmd = line.rsplit('`').nth(1).expect("a `command` in the line");
    let o = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    assert!(o.status.success(), "{cmd}: {}", said(&o));
}

/// A real state of device `a` holding seed 7's pages, made by a daemon
/// with `root` as its state dir, which is then stopped.
fn make_state(dir: &TempDir, root: &Path, sock: &Path) {
    let mut cmd = Command::new(vzram_bin());
    let control = dir.join("maker.ctl");
    cmd.args(["serve", "--device", &dev(sock), "--state-dir", s(root)])
        .arg("--control")
        .arg(&control);
    let d = Daemon::start_command(cmd, &control, &dir.join("maker.log"), &[sock]);
    fill(sock, 7, 16);
    d.shutdown();
    // The marker beside the socket names the old place: forgotten, as a
    // state that moved on purpose.
    let _ = std::fs::remove_file(dir.join(".a.sock.vzram-state"));
}

#[test]
fn a_state_dir_another_user_made_first_is_refused_and_nothing_in_it_deleted() {
    let dir = TempDir::new("priv-race");
    let a = dir.join("a.sock");
    // The co-tenant's root: made before the daemon's first start, holding
    // the VM's state (as if planted or copied there) and a directory named
    // like a tombstone of it.
    let root = state_dir_for(dir.path());
    std::fs::create_dir(&root).unwrap();
    make_state(&dir, &root, &a);
    let tomb = root.join(".a.gone-1-2");
    std::fs::create_dir(&tomb).unwrap();
    std::fs::write(tomb.join("theirs"), b"keep me").unwrap();
    std::fs::set_permissions(&root, Permissions::from_mode(0o755)).unwrap();
    chown_r(&root, NOBODY);

    let o = serve_refused(&dir, &["--device", &dev(&a)]);
    let line = refused_with(
        &o,
        &[s(&root), "owned by uid 65534", "mode 0755", "chown 0"],
    );
    assert!(tomb.join("theirs").exists(), "the tombstone was deleted");
    assert!(root.join("a/arena").exists(), "the state was touched");

    // Taken over by the admin as the message says: the root is root's now,
    // but the state and the tombstone in it are still the other user's:
    // the state is refused, the tombstone kept.
    run_advice(&line);
    assert_eq!(std::fs::metadata(&root).unwrap().uid(), 0);
    assert_eq!(mode(&root), 0o700);
    let o = serve_refused(&dir, &["--device", &dev(&a)]);
    let line = refused_with(
        &o,
        &[s(&root.join("a")), "owned by uid 65534", "chown -R 0"],
    );
    assert!(tomb.join("theirs").exists(), "the tombstone was deleted");
    // Taken over too: served, with its pages.
    run_advice(&line);
    let mut d = Daemon::start(&dir, &["--device", &dev(&a)], &[&a]);
    assert!(holds(&a, 7, 16), "the state taken over serves its pages");
    assert!(
        tomb.join("theirs").exists(),
        "a tombstone of another user's was deleted"
    );
    d.terminate_cleanly();
}

#[test]
fn a_state_or_state_file_open_to_others_or_a_link_is_refused() {
    let dir = TempDir::new("priv-open");
    let a = dir.join("a.sock");
    let mut d = Daemon::start(&dir, &["--device", &dev(&a)], &[&a]);
    fill(&a, 3, 16);
    let state = d.stat().dev_at(&a).state.clone();
    let root = state.parent().unwrap().to_path_buf();
    // The root the daemon made is 0700, the state 0700, its files 0600.
    assert_eq!(mode(&root), 0o700);
    assert_eq!(mode(&state), 0o700);
    for f in ["header", "table", "arena", "stats"] {
        assert_eq!(mode(&state.join(f)), 0o600, "{f}");
    }
    d.terminate_cleanly();

    for (path, m) in [
        (state.join("arena"), 0o644),
        (state.join("table"), 0o640),
        (state.clone(), 0o755),
    ] {
        std::fs::set_permissions(&path, Permissions::from_mode(m)).unwrap();
        let o = serve_refused(&dir, &["--device", &dev(&a)]);
        let line = refused_with(&o, &[s(&path), &format!("mode {m:04o}")]);
        let before = mode(&path);
        assert_eq!(before, m, "the refused start changed the mode");
        // The fix it names: chmod (the owner is right).
        let fix = line.rsplit('`').nth(1).unwrap().to_string();
        let chmod = fix.split(" && ").nth(1).unwrap();
        let o = Command::new("sh").arg("-c").arg(chmod).output().unwrap();
        assert!(o.status.success(), "{chmod}: {}", said(&o));
    }
    let mut d = Daemon::start(&dir, &["--device", &dev(&a)], &[&a]);
    assert!(holds(&a, 3, 16));
    d.terminate_cleanly();

    // A state file replaced by a link (to the same bytes) is refused.
    let arena = state.join("arena");
    let copy = root.join("arena-copy");
    std::fs::rename(&arena, &copy).unwrap();
    std::os::unix::fs::symlink(&copy, &arena).unwrap();
    let o = serve_refused(&dir, &["--device", &dev(&a)]);
    assert_eq!(o.status.code(), Some(2), "{}", said(&o));
    assert!(said(&o).contains(s(&arena)), "{}", said(&o));
    std::fs::remove_file(&arena).unwrap();
    std::fs::rename(&copy, &arena).unwrap();

    // A state dir that is a link: refused, the link and its target kept.
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::set_permissions(&elsewhere, Permissions::from_mode(0o700)).unwrap();
    let linked = PathBuf::from(format!("{}-link", s(&root)));
    std::os::unix::fs::symlink(&elsewhere, &linked).unwrap();
    let o = serve_refused(&dir, &["--device", &dev(&a), "--state-dir", s(&linked)]);
    refused_with(&o, &[s(&linked), "symbolic link"]);
    assert!(std::fs::read_dir(&elsewhere).unwrap().next().is_none());
    std::fs::remove_file(&linked).unwrap();

    // A root of our own that others may write: refused. One they may only
    // read (as older versions made it): closed, with a warning.
    std::fs::set_permissions(&root, Permissions::from_mode(0o777)).unwrap();
    let o = serve_refused(&dir, &["--device", &dev(&a)]);
    refused_with(&o, &[s(&root), "mode 0777"]);
    std::fs::set_permissions(&root, Permissions::from_mode(0o755)).unwrap();
    let mut d = Daemon::start(&dir, &["--device", &dev(&a)], &[&a]);
    assert_eq!(mode(&root), 0o700);
    assert!(d.log_text().contains("closed to group and others"));
    assert!(holds(&a, 3, 16));
    d.terminate_cleanly();
}

/// The daemon as uid 65534 with no state dir given: under its own
/// `$XDG_RUNTIME_DIR`, made 0700; the same path made first by another
/// user (root, here) is refused.
#[test]
fn the_default_state_dir_of_a_user_is_theirs() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !Path::new("/usr/bin/setpriv").is_file() || !root {
        eprintln!("skipped: needs root and setpriv");
        return;
    }
    let dir = TempDir::new("priv-xdg");
    std::fs::set_permissions(dir.path(), Permissions::from_mode(0o755)).unwrap();
    let bin = {
        let copy = dir.join("vzram");
        std::fs::copy(vzram_bin(), &copy).unwrap();
        std::fs::set_permissions(&copy, Permissions::from_mode(0o755)).unwrap();
        copy
    };
    let xdg = dir.join("xdg");
    std::fs::create_dir(&xdg).unwrap();
    std::fs::set_permissions(&xdg, Permissions::from_mode(0o700)).unwrap();
    chown_r(&xdg, NOBODY);
    let a = xdg.join("a.sock");
    let control = xdg.join("control.sock");
    let serve = || {
        let mut cmd = Command::new("/usr/bin/setpriv");
        cmd.args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
            "/usr/bin/env",
            "-u",
            "VZRAM_STATE_DIR",
            "-u",
            "RUNTIME_DIRECTORY",
        ])
        .arg(format!("XDG_RUNTIME_DIR={}", s(&xdg)))
        .arg(&bin)
        .args(["serve", "--device", &dev(&a), "--control", s(&control)]);
        cmd
    };
    let d = Daemon::start_command(serve(), &control, &dir.join("d.log"), &[&a]);
    let state = d.stat().dev_at(&a).state.clone();
    assert_eq!(state, xdg.join("vzram/state/a"));
    for p in [xdg.join("vzram"), xdg.join("vzram/state"), state] {
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(
            (m.uid(), m.mode() & 0o777),
            (NOBODY, 0o700),
            "{}",
            p.display()
        );
    }
    d.shutdown();

    // Made first by someone else.
    std::fs::remove_dir_all(xdg.join("vzram")).unwrap();
    std::fs::create_dir_all(xdg.join("vzram/state")).unwrap();
    std::fs::set_permissions(xdg.join("vzram"), Permissions::from_mode(0o777)).unwrap();
    let o = serve().output().unwrap();
    refused_with(&o, &[s(&xdg.join("vzram/state")), "owned by uid 0"]);
    assert!(!xdg.join("vzram/state/a").exists());
}
