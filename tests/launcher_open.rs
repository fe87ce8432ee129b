//! The launcher opens for reading only the configuration file it was
//! started with (`__launcher CONFIG`, from `serve --config`): the order
//! names no path, so a supervisor taken over cannot have it open another
//! file. It removes only sockets and states the daemon made at start or it
//! prepared itself, and makes states only under the roots it knows. Driven
//! on the real binary's launcher over its real socket, and through the
//! real daemon.

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use vzram::proto::launch::{Report, Request};
use vzram::proto::wire::{recv, send, seqpacket_pair, FIRST_FD};
use vzram_store::{Codec, Existing, StateSpec};
use vzram_tests::*;

/// `vzram __launcher [config]` with our socket's other end at FIRST_FD.
fn launcher(config: Option<&Path>) -> (Child, OwnedFd) {
    let (ours, theirs) = seqpacket_pair().unwrap();
    let fd = theirs.as_raw_fd();
    let mut cmd = Command::new(vzram_bin());
    cmd.arg("__launcher").args(config).stdin(Stdio::null());
    // SAFETY: only dup2 between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, FIRST_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    drop(theirs);
    (child, ours)
}

#[test]
fn the_launcher_opens_its_configuration_file_and_no_path_it_is_sent() {
    let dir = TempDir::new("launch-open");
    let cfg = dir.join("vzram.toml");
    std::fs::write(&cfg, "seccomp = true\n").unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "not for the supervisor\n").unwrap();

    let (mut child, sock) = launcher(Some(&cfg));
    send(&sock, &Request::OpenConfig { id: 1 }, &[]).unwrap();
    let (report, fds) = recv::<Report>(&sock).unwrap().expect("a reply");
    assert!(matches!(report, Report::Opened { id: 1 }), "{report:?}");
    let mut text = String::new();
    std::fs::File::from(fds.into_iter().next().expect("the file"))
        .read_to_string(&mut text)
        .unwrap();
    assert_eq!(text, "seccomp = true\n");

    // The order as it was (`Open` with any path): never a descriptor. The
    // launcher takes it for the malformed message it is and stops, which
    // the supervisor sees as a launcher gone.
    let old = json!({"Open": {"id": 2, "path": secret}});
    send(&sock, &old, &[]).unwrap();
    match recv::<serde_json::Value>(&sock) {
        Ok(None) | Err(_) => {}
        Ok(Some((reply, fds))) => panic!(
            "the launcher answered an order naming {}: {reply} with {} descriptor(s)",
            secret.display(),
            fds.len()
        ),
    }
    let st = child.wait().unwrap();
    assert!(!st.success(), "{st}");
}

#[test]
fn a_launcher_started_without_a_configuration_file_opens_none() {
    let (mut child, sock) = launcher(None);
    send(&sock, &Request::OpenConfig { id: 7 }, &[]).unwrap();
    let (report, fds) = recv::<Report>(&sock).unwrap().expect("a reply");
    match report {
        Report::Failed { id: 7, error } => {
            assert!(error.contains("without a configuration file"), "{error}")
        }
        r => panic!("{r:?}"),
    }
    assert!(fds.is_empty());
    drop(sock);
    assert!(child.wait().unwrap().success());
}

/// One order, its reply.
fn ask(sock: &OwnedFd, req: &Request) -> Report {
    send(sock, req, &[]).unwrap();
    recv::<Report>(sock).unwrap().expect("a reply").0
}

fn prepare(id: u64, socket: &Path, root: &Path, name: &str) -> Request {
    Request::Prepare {
        id,
        socket: socket.to_path_buf(),
        mode: 0o600,
        state: StateSpec {
            root: root.to_path_buf(),
            name: name.to_string(),
            existing: Existing::Refuse,
            socket: Some(socket.to_path_buf()),
            adopt: false,
        },
        size: 16 << 20,
        algo: Codec::Lz4,
        shards: 1,
        backing: None,
        incoming: None,
        incoming_mode: 0o600,
    }
}

fn remove(id: u64, socket: Option<&Path>, state: Option<&Path>) -> Request {
    Request::Remove {
        id,
        socket: socket.map(Path::to_path_buf),
        state: state.map(Path::to_path_buf),
        expect: None,
    }
}

/// A supervisor taken over cannot have the launcher delete a socket or a
/// state it never made: here another service's socket and another
/// daemon's left-over state, named in a `Remove` the launcher gets first.
#[test]
fn the_launcher_removes_no_socket_or_state_it_did_not_make() {
    let dir = TempDir::new("launch-rm");
    // Another vzram's device, stopped: its state is left in its state dir.
    let a = dir.join("a.sock");
    let mut other = Daemon::start(&dir, &["--socket", s(&a), "--size", "16M"], &[&a]);
    let state = other.stat().sole().state.clone();
    other.terminate_cleanly();
    assert!(state.join("header").exists(), "{}", state.display());
    // Someone else's socket (nobody listens: the launcher's own check
    // for a socket in use would not stop it).
    let victim = dir.join("agent.sock");
    drop(std::os::unix::net::UnixListener::bind(&victim).unwrap());

    let (mut child, sock) = launcher(None);
    match ask(&sock, &remove(1, Some(&victim), None)) {
        Report::Failed { id: 1, error } => {
            assert!(error.contains("not a socket this daemon made"), "{error}")
        }
        r => panic!("a socket it never made: {r:?}"),
    }
    assert!(victim.exists(), "{} was deleted", victim.display());
    match ask(&sock, &remove(2, None, Some(&state))) {
        Report::Failed { id: 2, error } => {
            assert!(error.contains("not a state this daemon made"), "{error}")
        }
        r => panic!("a state it never made: {r:?}"),
    }
    assert!(
        state.join("header").exists(),
        "{} was deleted",
        state.display()
    );
    // An account of the start that comes late (after an order, as a
    // supervisor taken over would send it) is ignored.
    send(
        &sock,
        &Request::Started {
            state_dir: state.parent().unwrap().to_path_buf(),
            roots: vec![],
            sockets: vec![victim.clone()],
            states: vec![state.clone()],
        },
        &[],
    )
    .unwrap();
    assert!(matches!(
        ask(&sock, &remove(3, Some(&victim), Some(&state))),
        Report::Failed { id: 3, .. }
    ));
    assert!(victim.exists() && state.join("header").exists());
    drop(sock);
    assert!(child.wait().unwrap().success());
}

/// States are made only under the roots of the daemon's start: a root
/// the order names is refused and nothing is made; under a known one the
/// launcher prepares, and removes what it prepared, once.
#[test]
fn the_launcher_makes_states_only_under_roots_it_knows() {
    let dir = TempDir::new("launch-root");
    let root = state_dir_for(dir.path());
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::set_permissions(
        &elsewhere,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let (mut child, sock) = launcher(None);
    send(
        &sock,
        &Request::Started {
            state_dir: root.clone(),
            roots: vec![],
            sockets: vec![],
            states: vec![],
        },
        &[],
    )
    .unwrap();
    let a = dir.join("a.sock");
    for (id, r) in [
        (1, elsewhere.clone()),
        (2, root.join("..").join("elsewhere")),
    ] {
        match ask(&sock, &prepare(id, &a, &r, "a")) {
            Report::Failed { error, .. } => assert!(
                error.contains("is not one this daemon was started with"),
                "{error}"
            ),
            r => panic!("a state under {}: {r:?}", elsewhere.display()),
        }
        assert!(!a.exists(), "a refused order leaves no socket");
        assert!(!elsewhere.join("a").exists(), "nor a state");
    }
    let report = ask(&sock, &prepare(3, &a, &root, "a"));
    let Report::Prepared { dir: made, .. } = report else {
        panic!("{report:?}");
    };
    assert_eq!(made, root.join("a"));
    assert!(matches!(
        ask(&sock, &remove(4, Some(&a), Some(&made))),
        Report::Removed { id: 4 }
    ));
    assert!(!a.exists() && !made.exists());
    // Removed once: a socket made there again is someone else's.
    drop(std::os::unix::net::UnixListener::bind(&a).unwrap());
    assert!(matches!(
        ask(&sock, &remove(5, Some(&a), None)),
        Report::Failed { id: 5, .. }
    ));
    assert!(a.exists());
    drop(sock);
    assert!(child.wait().unwrap().success());
}

/// Through the daemon: `vzram add` with a state dir it was not started
/// with is refused, with advice that works; one the configuration file
/// names is taken (a reload's device).
#[test]
fn a_state_dir_added_at_run_time_must_be_one_the_daemon_knows() {
    let dir = TempDir::new("launch-add");
    let cfg = dir.join("vzram.toml");
    let c = dir.join("c.sock");
    let first = format!(
        "[[device]]\nname = \"c\"\nsocket = \"{}\"\nsize = \"16M\"\n",
        s(&c)
    );
    std::fs::write(&cfg, &first).unwrap();
    let mut d = Daemon::start(&dir, &["--config", s(&cfg)], &[&c]);
    let own = dir.join("own");
    std::fs::create_dir(&own).unwrap();
    std::fs::set_permissions(&own, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let a = dir.join("a.sock");
    let spec = format!("socket={},size=16M", s(&a));
    let o = d.vzram(&["add", "--device", &format!("{spec},state-dir={}", s(&own))]);
    assert_eq!(o.status.code(), Some(2), "{}", said(&o));
    assert!(
        said(&o).contains("is not one this daemon was started with"),
        "{}",
        said(&o)
    );
    assert!(!a.exists() && std::fs::read_dir(&own).unwrap().next().is_none());
    // The advice: without state-dir=, or named in the file and reloaded.
    let o = d.vzram(&["add", "--device", &spec]);
    assert!(o.status.success(), "{}", said(&o));
    let made = d.stat().dev_at(&a).state.clone();
    assert!(
        made.starts_with(state_dir_for(dir.path())),
        "{}",
        made.display()
    );
    let b = dir.join("b.sock");
    std::fs::write(
        &cfg,
        format!(
            "{first}[[device]]\nname = \"b\"\nsocket = \"{}\"\nsize = \"16M\"\nstate_dir = \"{}\"\n",
            s(&b),
            s(&own)
        ),
    )
    .unwrap();
    let o = d.vzram(&["reload"]);
    assert!(o.status.success(), "{}", said(&o));
    assert!(b.exists() && own.join("b").is_dir(), "{}", d.log_text());
    d.terminate_cleanly();
}

/// `Spawn` starts a worker and no other command line of the binary: one
/// that blanks a file's header (`backing init --force`) is refused.
#[test]
fn the_launcher_starts_workers_and_nothing_else() {
    let dir = TempDir::new("launch-spawn");
    let file = dir.join("data");
    std::fs::write(&file, vec![7u8; 1 << 20]).unwrap();
    let (mut child, sock) = launcher(None);
    let args = ["backing", "init", s(&file), "--force"].map(String::from);
    match ask(
        &sock,
        &Request::Spawn {
            id: 1,
            args: args.to_vec(),
        },
    ) {
        Report::Failed { id: 1, error } => {
            assert!(error.contains("starts workers only"), "{error}")
        }
        r => panic!("started {args:?}: {r:?}"),
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        std::fs::read(&file).unwrap().iter().all(|&b| b == 7),
        "{} was written",
        file.display()
    );
    drop(sock);
    assert!(child.wait().unwrap().success());
}
