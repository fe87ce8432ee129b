//! systemd readiness: with `$NOTIFY_SOCKET` set, `vzram serve` sends
//! `READY=1` once its sockets accept connections, `RELOADING=1` and
//! `READY=1` around a reload, and `STOPPING=1` on SIGTERM.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use vzram_tests::*;

fn recv(sock: &UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    let n = sock
        .recv(&mut buf)
        .expect("no notify message within the timeout");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// A daemon started without waiting for its sockets: READY=1 is the wait.
struct Served {
    child: Child,
    log: PathBuf,
}

impl Served {
    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn terminate(&mut self) -> ExitStatus {
        // SAFETY: kill only sends a signal to our own child.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("no exit within 10 s of SIGTERM:\n{}", self.log_text());
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a daemon with `NOTIFY_SOCKET=notify_addr` and returns once
/// `READY=1` has come, after checking that its sockets accepted a
/// connection right then.
fn start_and_wait_ready(dir: &TempDir, rx: &UnixDatagram, notify_addr: &str) -> Served {
    start_with_args(dir, rx, notify_addr, &[])
}

/// [`start_and_wait_ready`] with more `serve` arguments.
fn start_with_args(dir: &TempDir, rx: &UnixDatagram, notify_addr: &str, args: &[&str]) -> Served {
    let sock = dir.join("vm1.sock");
    let control = dir.join("control.sock");
    let log = dir.join("daemon.log");
    rx.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let out = std::fs::File::create(&log).unwrap();
    let child = Command::new(vzram_bin())
        .args(["serve", "--size", "1M", "--name", "vm1", "--socket"])
        .arg(&sock)
        .arg("--control")
        .arg(&control)
        .args(args)
        .env("NOTIFY_SOCKET", notify_addr)
        .env("VZRAM_STATE_DIR", state_dir_for(dir.path()))
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap();
    let mut d = Served { child, log };
    let msg = recv(rx);
    // Connect the moment READY=1 is read: a READY sent before the sockets
    // listen fails here.
    for p in [&sock, &control] {
        UnixStream::connect(p).unwrap_or_else(|e| {
            panic!(
                "READY=1 came before {} accepted connections: {e}\n{}",
                p.display(),
                d.log_text()
            )
        });
    }
    let lines: Vec<&str> = msg.lines().collect();
    assert!(lines.contains(&"READY=1"), "{msg:?}");
    assert!(lines.contains(&"STATUS=serving 1 devices"), "{msg:?}");
    assert!(d.child.try_wait().unwrap().is_none());
    d
}

#[test]
fn ready_after_the_sockets_listen_and_stopping_at_sigterm() {
    let dir = TempDir::new("notify");
    let path = dir.join("notify.sock");
    let rx = UnixDatagram::bind(&path).unwrap();
    let mut d = start_and_wait_ready(&dir, &rx, path.to_str().unwrap());
    let st = d.terminate();
    assert_eq!(st.code(), Some(0), "{}", d.log_text());
    assert_eq!(recv(&rx), "STOPPING=1");
    assert!(!Path::new(&dir.join("vm1.sock")).exists());
}

#[test]
fn abstract_notify_address() {
    let dir = TempDir::new("notifyabs");
    let name = format!("vzram-test-notify-{}", std::process::id());
    let rx =
        UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let mut d = start_and_wait_ready(&dir, &rx, &format!("@{name}"));
    assert_eq!(d.terminate().code(), Some(0), "{}", d.log_text());
    assert_eq!(recv(&rx), "STOPPING=1");
}

/// A `NOTIFY_SOCKET` nobody listens on (left over in a shell, say) costs
/// a warning, not the devices.
#[test]
fn unreachable_notify_socket_is_a_warning() {
    let dir = TempDir::new("notifybad");
    let sock = dir.join("vm1.sock");
    let control = dir.join("control.sock");
    let mut cmd = Command::new(vzram_bin());
    cmd.args(["serve", "--size", "1M", "--socket"])
        .arg(&sock)
        .arg("--control")
        .arg(&control)
        .env("NOTIFY_SOCKET", dir.join("nobody-listens"));
    let mut d = Daemon::start_command(cmd, &control, &dir.join("daemon.log"), &[&sock]);
    let mut c = Client::connect(&sock, 1).unwrap();
    c.q(0).write(0, &[1; 4096]).unwrap();
    drop(c);
    assert_eq!(d.terminate().code(), Some(0));
    let log = d.log_text();
    assert!(
        log.contains("NOTIFY_SOCKET") && log.contains("WARN"),
        "{log}"
    );
}

/// After READY, STATUS lines follow frontends coming and going.
#[test]
fn status_follows_connections() {
    let dir = TempDir::new("notifyst");
    let path = dir.join("notify.sock");
    let rx = UnixDatagram::bind(&path).unwrap();
    let mut d = start_and_wait_ready(&dir, &rx, path.to_str().unwrap());
    let c = Client::connect(&dir.join("vm1.sock"), 1).unwrap();
    assert_eq!(recv(&rx), "STATUS=serving 1 devices, 1 connected");
    drop(c);
    assert_eq!(recv(&rx), "STATUS=serving 1 devices, 0 connected");
    assert!(d.terminate().success());
}

/// CLOCK_MONOTONIC in µs, as systemd reads `MONOTONIC_USEC`.
fn monotonic_usec() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000
}

/// The two messages around one reload: `RELOADING=1` with the time it
/// began (within `[before, after]`), then `READY=1` with the status.
fn reload_messages(rx: &UnixDatagram, before: u64, after: u64) {
    let msg = recv(rx);
    let lines: Vec<&str> = msg.lines().collect();
    assert_eq!(lines.first(), Some(&"RELOADING=1"), "{msg:?}");
    let usec: u64 = lines
        .iter()
        .find_map(|l| l.strip_prefix("MONOTONIC_USEC="))
        .unwrap_or_else(|| panic!("no MONOTONIC_USEC in {msg:?}"))
        .parse()
        .unwrap();
    assert!(
        before <= usec && usec <= after,
        "{before} <= {usec} <= {after}"
    );
    assert_eq!(recv(rx), "READY=1\nSTATUS=serving 1 devices, 0 connected");
}

/// `systemctl reload` through `ExecReload=vzram reload` (systemd 252) or
/// SIGHUP (`Type=notify-reload`, 253 on): either way the unit is told
/// the reload began and ended, also when the file is refused.
#[test]
fn reloading_then_ready_around_a_reload() {
    let dir = TempDir::new("notifyrl");
    let path = dir.join("notify.sock");
    let rx = UnixDatagram::bind(&path).unwrap();
    let cfg = dir.join("vzram.toml");
    std::fs::write(&cfg, "host_mem_limit = \"64M\"\n").unwrap();
    let mut d = start_with_args(
        &dir,
        &rx,
        path.to_str().unwrap(),
        &["--config", cfg.to_str().unwrap()],
    );
    let control = dir.join("control.sock");
    let reload = || Vzram::new(&["reload", "--control"]).arg(&control).output();
    let before = monotonic_usec();
    let o = reload();
    let after = monotonic_usec();
    assert!(o.status.success(), "{o:?}");
    reload_messages(&rx, before, after);

    // Refused: still READY again (the devices serve on).
    std::fs::write(&cfg, "host_mem_limit = [\n").unwrap();
    let before = monotonic_usec();
    let o = reload();
    let after = monotonic_usec();
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    reload_messages(&rx, before, after);

    // SIGHUP: the same two messages.
    std::fs::write(&cfg, "host_mem_limit = \"32M\"\n").unwrap();
    let before = monotonic_usec();
    // SAFETY: kill only sends a signal to our own child.
    unsafe { libc::kill(d.child.id() as libc::pid_t, libc::SIGHUP) };
    let msg = recv(&rx);
    let after = monotonic_usec();
    assert!(msg.starts_with("RELOADING=1\nMONOTONIC_USEC="), "{msg:?}");
    let usec: u64 = msg.lines().nth(1).unwrap()["MONOTONIC_USEC=".len()..]
        .parse()
        .unwrap();
    assert!(
        before <= usec && usec <= after,
        "{before} <= {usec} <= {after}"
    );
    assert_eq!(recv(&rx), "READY=1\nSTATUS=serving 1 devices, 0 connected");
    assert!(d.terminate().success(), "{}", d.log_text());
}
