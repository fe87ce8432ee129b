//! What an operator meets first (issue 26): one control socket path that
//! `serve` and the client commands agree on, `vzram stat NAME`, the
//! version in the log, replies and metrics, and exit 2 with nothing left
//! on disk for a configuration error found at start.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use vzram_tests::metrics::{metric, scrape};
use vzram_tests::*;

/// The workspace's version, which the daemon's crate shares.
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// `vzram ARGS` with `env` set, and VZRAM_CONTROL and RUNTIME_DIRECTORY
/// unset unless `env` sets them; killed (and the test failed) after 10 s.
fn vzram_env(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut v = Vzram::new(args)
        .env_remove("VZRAM_CONTROL")
        .env_remove("RUNTIME_DIRECTORY")
        .limit(Duration::from_secs(10));
    for (k, val) in env {
        v = v.env(k, val);
    }
    v.output()
}

/// A daemon of one 1 MiB device at `sock`, started with `env` and no
/// `--control`; it must bind its control socket at `control`.
fn serve_without_control(
    dir: &TempDir,
    sock: &Path,
    env: &[(&str, &Path)],
    control: &Path,
) -> Daemon {
    let mut cmd = Command::new(vzram_bin());
    // One state dir whatever the control socket's (the harness's default).
    cmd.args(["serve", "--size", "1M", "--socket", s(sock), "--state-dir"])
        .arg(state_dir_for(dir.path()))
        .env_remove("VZRAM_CONTROL")
        .env_remove("RUNTIME_DIRECTORY");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let log = dir.join(&format!(
        "{}.log",
        control.file_name().unwrap().to_string_lossy()
    ));
    Daemon::start_command(cmd, control, &log, &[sock])
}

fn stat_json(env: &[(&str, &Path)], extra: &[&str]) -> Value {
    let mut args = vec!["stat", "--json"];
    args.extend(extra);
    let o = vzram_env(&args, env);
    assert!(o.status.success(), "vzram {args:?}: {}", said(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn serve_and_the_client_find_the_same_control_socket() {
    let dir = TempDir::new("ctlpath");
    let rt = dir.join("rt");
    std::fs::create_dir(&rt).unwrap();
    let a = dir.join("a.sock");

    // systemd: the first of RUNTIME_DIRECTORY's paths.
    let runtime = PathBuf::from(format!("{}:{}", s(&rt), s(&dir.join("other"))));
    let env = [("RUNTIME_DIRECTORY", runtime.as_path())];
    let d = serve_without_control(&dir, &a, &env, &rt.join("control.sock"));
    let v = stat_json(&env, &[]);
    assert_eq!(Stats::parse(v).sole().socket, a);
    d.shutdown();
    assert!(!rt.join("control.sock").exists());

    // VZRAM_CONTROL wins over RUNTIME_DIRECTORY, for both.
    let mine = dir.join("mine.ctl");
    let env = [
        ("RUNTIME_DIRECTORY", rt.as_path()),
        ("VZRAM_CONTROL", mine.as_path()),
    ];
    let d = serve_without_control(&dir, &a, &env, &mine);
    assert!(!rt.join("control.sock").exists());
    let v = stat_json(&env, &[]);
    assert_eq!(Stats::parse(v).sole().socket, a);
    // The client without them does not find it there.
    let o = vzram_env(&["stat"], &[("RUNTIME_DIRECTORY", rt.as_path())]);
    assert_eq!(o.status.code(), Some(1), "{}", said(&o));
    assert!(
        said(&o).contains(s(&rt.join("control.sock"))),
        "{}",
        said(&o)
    );
    // --control still overrides both.
    let v = stat_json(&[], &["--control", s(&mine)]);
    assert_eq!(Stats::parse(v).sole().socket, a);
    d.shutdown();
}

/// Without a variable, a user's default control socket is in
/// `$XDG_RUNTIME_DIR/vzram`, which the daemon makes. One it cannot make, or
/// one another user made first, is a clear exit 2 with nothing left
/// behind. (Root's `/run/vzram`, made when missing, is tested in a private
/// mount namespace by tests/bare_serve.rs.)
#[test]
fn a_default_control_dir_it_cannot_make_or_that_is_not_its_own_is_a_clear_exit_2() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: runs the daemon as another user");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("ctldef");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let socks = dir.join("socks");
    std::fs::create_dir(&socks).unwrap();
    std::fs::set_permissions(&socks, std::fs::Permissions::from_mode(0o777)).unwrap();
    let a = socks.join("a.sock");
    let state = dir.join("state");
    std::fs::create_dir(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
    // A runtime dir the user may not write (root's, 0755), then one where
    // another user (root) made `vzram` first.
    let (ro, taken) = (dir.join("xdg-ro"), dir.join("xdg-taken"));
    std::fs::create_dir(&ro).unwrap();
    std::fs::create_dir_all(taken.join("vzram")).unwrap();
    for (xdg, what) in [
        (&ro, "cannot make its directory"),
        (&taken, "is not this user's own"),
    ] {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(vzram_bin())
            .args([
                "serve",
                "--size",
                "1M",
                "--socket",
                s(&a),
                "--state-dir",
                s(&state.join("s")),
            ])
            .env_remove("VZRAM_CONTROL")
            .env_remove("RUNTIME_DIRECTORY")
            .env("XDG_RUNTIME_DIR", xdg)
            .stdin(Stdio::null());
        let o = cmd.output().expect("run vzram");
        let err = said(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        let control = xdg.join("vzram/control.sock");
        assert!(
            err.starts_with(&format!("error: socket {}: ", control.display()))
                && err.contains(what),
            "{err}"
        );
        assert!(!a.exists(), "the device socket was left behind");
        assert!(
            !state.join("s").exists(),
            "the failed start made a state dir"
        );
    }
}

#[test]
fn stat_name_shows_one_device() {
    let dir = TempDir::new("statname");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let mut d = Daemon::start(
        &dir,
        &[
            "--device",
            &format!("socket={},size=1M,name=alpha", s(&a)),
            "--device",
            &format!("socket={},size=2M,name=bravo", s(&b)),
        ],
        &[&a, &b],
    );
    let all = d.cli(&["stat"]);
    assert!(all.contains("alpha") && all.contains("bravo"), "{all}");
    let one = d.cli(&["stat", "bravo"]);
    assert!(one.contains("bravo") && !one.contains("alpha"), "{one}");
    assert!(one.contains(&format!("daemon: vzram {VERSION}")), "{one}");
    // By index, as every other command takes a device.
    assert_eq!(d.cli(&["stat", "1"]), one);
    let v: Value = serde_json::from_str(&d.cli(&["stat", "--json", "alpha"])).unwrap();
    assert_eq!(v["version"], VERSION, "{v}");
    let st = Stats::parse(v);
    assert_eq!(st.sole().name, "alpha");
    assert_eq!(st.sole().size_bytes, 1 << 20);

    for json in [false, true] {
        let mut args = vec!["stat", "--control", s(&d.control), "charlie"];
        if json {
            args.push("--json");
        }
        let o = vzram_env(&args, &[]);
        let err = said(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(o.stdout.is_empty(), "{o:?}");
        assert_eq!(
            err.trim_end(),
            "error: no device \"charlie\"; the daemon serves alpha (0), bravo (1)"
        );
    }
}

#[test]
fn the_version_is_logged_replied_and_scraped() {
    let dir = TempDir::new("version");
    let a = dir.join("a.sock");
    let mut d = Daemon::start(
        &dir,
        &[
            "--socket",
            s(&a),
            "--size",
            "1M",
            "--metrics",
            "127.0.0.1:0",
        ],
        &[&a],
    );
    let o = vzram_env(&["--version"], &[]);
    assert_eq!(said(&o).trim(), format!("vzram {VERSION}"));

    let starts: Vec<String> = d
        .log_text()
        .lines()
        .filter(|l| l.contains("starting"))
        .map(str::to_string)
        .collect();
    assert_eq!(starts.len(), 1, "{}", d.log_text());
    assert!(
        starts[0].contains(" INFO ") && starts[0].contains(&format!("version={VERSION}")),
        "{}",
        starts[0]
    );

    // `stat --json`, and every reply: results and refusals.
    let v: Value = serde_json::from_str(&d.cli(&["stat", "--json"])).unwrap();
    assert_eq!(v["version"], VERSION, "{v}");
    for req in [
        json!({"cmd": "compact"}),
        json!({"cmd": "set-limit", "host": true, "bytes": 0}),
        json!({"cmd": "remove", "device": "nosuch"}),
        json!({"cmd": "frobnicate"}),
    ] {
        let r = d.control(req.clone());
        assert_eq!(r["version"], VERSION, "{req} → {r}");
    }
    // A refusal says its kind beside its text: what the client's exit
    // status follows, and a script may branch on.
    for (req, kind) in [
        (json!({"cmd": "remove", "device": "nosuch"}), "not-found"),
        (json!({"cmd": "forget", "name": "nosuch"}), "not-found"),
        (json!({"cmd": "frobnicate"}), "bad-request"),
        (
            json!({"cmd": "set-limit", "device": "a", "bytes": 1 << 30}),
            "bad-request",
        ),
        (
            json!({"cmd": "writeback", "device": "a", "idle": true}),
            "conflict",
        ),
        (
            json!({"cmd": "commit-migration", "device": "a"}),
            "conflict",
        ),
    ] {
        let r = d.control(req.clone());
        assert_eq!(
            (&r["ok"], &r["kind"]),
            (&json!(false), &json!(kind)),
            "{req} → {r}"
        );
    }

    let addr: SocketAddr = d
        .stat()
        .0
        .metrics
        .expect("a metrics address in stat")
        .parse()
        .unwrap();
    let body = scrape(addr);
    assert_eq!(
        metric(&body, &format!("vzram_build_info{{version=\"{VERSION}\"}}")),
        1
    );
}

/// A configuration error found at start: exit 2, one line naming it, and
/// no socket file or state dir made by the attempt.
fn refused_cleanly(what: &str, dir: &TempDir, args: &[&str], control: &Path, want: &str) {
    let state = state_dir_for(dir.path());
    assert!(
        !state.exists(),
        "{what}: {} is there before",
        state.display()
    );
    let before = listing(dir.path());
    let mut all = vec!["serve"];
    all.extend(args);
    let o = vzram_env(
        &all,
        &[("VZRAM_STATE_DIR", &state), ("VZRAM_CONTROL", control)],
    );
    let err = said(&o);
    assert_eq!(o.status.code(), Some(2), "{what}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{what}: {err}");
    assert!(err.starts_with("error: "), "{what}: {err}");
    assert!(err.contains(want), "{what}: {err:?} does not say {want:?}");
    assert!(
        !state.exists(),
        "{what}: the failed start made {}",
        state.display()
    );
    assert_eq!(listing(dir.path()), before, "{what}: files left behind");
}

/// Every path under `dir`, sorted.
fn listing(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                todo.push(p.clone());
            }
            out.push(p);
        }
    }
    out.sort();
    out
}

#[test]
fn configuration_errors_at_start_exit_2_and_leave_nothing() {
    let dir = TempDir::new("exit2");
    let sock = dir.join("a.sock");
    let ctl = dir.join("control.sock");
    let dev = ["--size", "1M", "--socket", s(&sock)];

    let missing = dir.join("no/such/a.sock");
    refused_cleanly(
        "socket in a missing directory",
        &dir,
        &["--size", "1M", "--socket", s(&missing)],
        &ctl,
        &format!("its directory {} does not exist", s(&dir.join("no/such"))),
    );
    refused_cleanly(
        "control socket in a missing directory",
        &dir,
        &dev,
        &dir.join("nowhere/control.sock"),
        "does not exist",
    );

    let long = dir.join(&format!("{}.sock", "x".repeat(110)));
    refused_cleanly(
        "socket path over 108 bytes",
        &dir,
        &["--size", "1M", "--socket", s(&long)],
        &ctl,
        "107 at most",
    );

    let file = dir.join("file");
    std::fs::write(&file, "keep me").unwrap();
    refused_cleanly(
        "a regular file at the socket path",
        &dir,
        &["--size", "1M", "--socket", s(&file)],
        &ctl,
        "exists and is not a socket",
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");

    // A live process on the device socket, then on the control socket.
    let live = UnixListener::bind(&sock).unwrap();
    refused_cleanly(
        "device socket in use",
        &dir,
        &dev,
        &ctl,
        "another process is serving it",
    );
    assert!(sock.exists(), "the live socket was removed");
    drop(live);
    std::fs::remove_file(&sock).unwrap();
    let live = UnixListener::bind(&ctl).unwrap();
    refused_cleanly(
        "control socket in use",
        &dir,
        &dev,
        &ctl,
        "another process is serving it",
    );
    drop(live);
    std::fs::remove_file(&ctl).unwrap();

    // Found after the sockets are bound: they go again, and no state is made.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().to_string();
    let mut args = dev.to_vec();
    args.extend(["--metrics", &port]);
    refused_cleanly("metrics port in use", &dir, &args, &ctl, &port);
}

/// A start refused for a device's state, after another device's new state
/// was made: that state and the state dir the start made both go again.
#[test]
fn a_start_refused_for_a_state_leaves_no_state_dir() {
    let dir = TempDir::new("nostate");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let old = dir.join("old");
    // b served once from `old`: the marker beside b.sock names it.
    Daemon::start(
        &dir,
        &["--socket", s(&b), "--size", "1M", "--state-dir", s(&old)],
        &[&b],
    )
    .shutdown();
    let fresh = dir.join("fresh");
    let o = vzram_env(
        &[
            "serve",
            "--state-dir",
            s(&fresh),
            "--device",
            &format!("socket={},size=1M", s(&a)),
            "--device",
            &format!("socket={},size=1M", s(&b)),
            "--control",
            s(&dir.join("control.sock")),
        ],
        &[],
    );
    let err = said(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(errors[0].contains("was last served from"), "{err}");
    assert!(
        err.contains("new device state"),
        "a's state was not made first: {err}"
    );
    assert!(!fresh.exists(), "the failed start left {}", fresh.display());
    assert!(!a.exists() && !dir.join("control.sock").exists(), "{err}");
}
