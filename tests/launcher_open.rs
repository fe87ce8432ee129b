//! The launcher opens for reading only the configuration file it was
//! started with (`__launcher CONFIG`, from `serve --config`): the order
//! names no path, so a supervisor taken over cannot have it open another
//! file. Driven on the real binary's launcher over its real socket.

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use vzram::proto::launch::{Report, Request};
use vzram::proto::wire::{recv, send, seqpacket_pair, FIRST_FD};
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
