//! Listening sockets passed to the daemon instead of bound by it: QEMU's
//! backend-program convention (`--fd N`, `--socket-path`) and systemd socket
//! activation (`LISTEN_FDS`, matched to devices by the path bound).

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use vzram_tests::*;

/// A bound, listening socket, for a child to inherit.
fn listener(path: &Path) -> UnixListener {
    UnixListener::bind(path).unwrap()
}

fn io_works(sock: &Path) {
    let mut c = Client::connect(sock, 1).expect("connect");
    let data = noise(5, 1 << 20);
    c.q(0).write(0, &data).unwrap();
    assert_eq!(c.q(0).read(0, data.len()).unwrap(), data);
}

#[test]
fn fd_convention_serves_the_passed_socket() {
    let dir = TempDir::new("passfd");
    let sock = dir.join("p.sock");
    let l = listener(&sock);
    let fd = l.as_raw_fd();
    let control = dir.join("control.sock");
    let mut cmd = Command::new(vzram_bin());
    cmd.args(["serve", "--fd", "5", "--size", "16M", "--queues", "1"])
        .arg("--control")
        .arg(&control);
    // SAFETY: only fcntl and dup2 between fork and exec. The listener may
    // itself be fd 5 (tests open fds in parallel), and dup2 onto itself
    // would keep close-on-exec: place it from a copy above.
    unsafe {
        cmd.pre_exec(move || {
            let hi = libc::fcntl(fd, libc::F_DUPFD, 100);
            if hi < 0 || libc::dup2(hi, 5) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut d = Daemon::start_command(cmd, &control, &dir.join("d.log"), &[&sock]);
    drop(l);
    io_works(&sock);
    assert!(
        d.log_text()
            .contains("using the listening socket passed in"),
        "{}",
        d.log_text()
    );
    let st = d.stat();
    assert_eq!(st.devices()[0].socket, sock);
    assert!(d.terminate().success());
    // Not ours to remove.
    assert!(sock.exists());

    // Anything but a listening unix socket is refused, on one line.
    let o = Vzram::new(&["serve", "--fd", "0", "--size", "16M"]).output();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.starts_with("error: --fd 0:"), "{err}");
}

#[test]
fn socket_path_is_the_same_as_socket() {
    let dir = TempDir::new("passpath");
    let sock = dir.join("q.sock");
    let d = Daemon::start(
        &dir,
        &["--socket-path", s(&sock), "--size", "16M"],
        &[&sock],
    );
    io_works(&sock);
    drop(d);
}

/// QEMU's backend-program convention starts the program itself, with no
/// subcommand: `vzram --socket-path PATH ...` is `vzram serve ...`.
#[test]
fn the_program_itself_serves_a_socket_path() {
    let dir = TempDir::new("passprog");
    let sock = dir.join("q.sock");
    let control = dir.join("control.sock");
    let mut cmd = Command::new(vzram_bin());
    cmd.args(["--socket-path", s(&sock), "--size", "16M", "--control"])
        .arg(&control);
    let mut d = Daemon::start_command(cmd, &control, &dir.join("d.log"), &[&sock]);
    io_works(&sock);
    assert!(d.terminate().success());
}

#[test]
fn systemd_socket_activation_by_path() {
    let dir = TempDir::new("passsd");
    let a = dir.join("a.sock");
    let b = dir.join("b.sock");
    // systemd passes b first and a second: the paths decide, not the order.
    let (lb, la) = (listener(&b), listener(&a));
    let (fb, fa) = (lb.as_raw_fd(), la.as_raw_fd());
    let control = dir.join("control.sock");
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("LISTEN_PID=$$ LISTEN_FDS=2 exec \"$0\" \"$@\"")
        .arg(vzram_bin())
        .arg("serve")
        .arg("--device")
        .arg(format!("socket={},size=16M,name=a", s(&a)))
        .arg("--device")
        .arg(format!("socket={},size=16M,name=b", s(&b)))
        .arg("--control")
        .arg(&control);
    // SAFETY: only dup2 between fork and exec; 3 and 4 are free in the
    // child once both are placed (the sources sit above them).
    unsafe {
        cmd.pre_exec(move || {
            let hi_b = libc::fcntl(fb, libc::F_DUPFD, 100);
            let hi_a = libc::fcntl(fa, libc::F_DUPFD, 100);
            if hi_a < 0 || hi_b < 0 || libc::dup2(hi_b, 3) < 0 || libc::dup2(hi_a, 4) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut d = Daemon::start_command(cmd, &control, &dir.join("d.log"), &[&a, &b]);
    drop((la, lb));
    io_works(&a);
    io_works(&b);
    let log = d.log_text();
    assert_eq!(
        log.matches("using the listening socket passed in").count(),
        2,
        "{log}"
    );
    // Workers must not see LISTEN_* (they would take the sockets as theirs).
    let _c = Client::connect(&a, 1).unwrap();
    let pid = d.worker_pid("a");
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    assert!(!env.is_empty());
    assert!(!String::from_utf8_lossy(&env).contains("LISTEN_"));
    assert!(d.terminate().success());
}

/// systemd's `SocketMode=` is one mode for every socket of a unit: a
/// control socket passed in at the device sockets' 0660 would let every
/// QEMU of the group remove, reset or migrate any device. The daemon gives
/// it `--control-mode` (default 0600) before it serves, and says so.
#[test]
fn a_passed_control_socket_gets_the_control_mode() {
    use std::os::unix::fs::PermissionsExt;
    for (flag, want) in [(None, 0o600), (Some("0640"), 0o640)] {
        let dir = TempDir::new("passctl");
        let a = dir.join("a.sock");
        let control = dir.join("control.sock");
        let (la, lc) = (listener(&a), listener(&control));
        for p in [&a, &control] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o660)).unwrap();
        }
        let (fa, fc) = (la.as_raw_fd(), lc.as_raw_fd());
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("LISTEN_PID=$$ LISTEN_FDS=2 exec \"$0\" \"$@\"")
            .arg(vzram_bin())
            .arg("serve")
            .arg("--device")
            .arg(format!("socket={},size=16M,name=a", s(&a)))
            .arg("--control")
            .arg(&control);
        if let Some(m) = flag {
            cmd.args(["--control-mode", m]);
        }
        // SAFETY: only dup2 between fork and exec, as above.
        unsafe {
            cmd.pre_exec(move || {
                let hi_a = libc::fcntl(fa, libc::F_DUPFD, 100);
                let hi_c = libc::fcntl(fc, libc::F_DUPFD, 100);
                if hi_a < 0 || hi_c < 0 || libc::dup2(hi_a, 3) < 0 || libc::dup2(hi_c, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut d = Daemon::start_command(cmd, &control, &dir.join("d.log"), &[&a]);
        drop((la, lc));
        // The passed control socket listens before the daemon is up.
        assert!(d.stat().devices()[0].socket == a);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&control), want, "{flag:?}\n{}", d.log_text());
        assert_eq!(
            mode(&a),
            0o660,
            "a device socket passed in is left as it is"
        );
        assert!(
            d.log_text()
                .contains("the control socket passed in had mode 0660"),
            "{}",
            d.log_text()
        );
        io_works(&a);
        assert!(d.terminate().success());
    }
}
