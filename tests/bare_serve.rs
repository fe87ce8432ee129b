//! The simplest launch, as a new user or QEMU's own tests make it:
//! `vzram serve --socket S --size N` with no other flag, no variable and no
//! directory made by hand, on a host that has never run vzram. Each test
//! runs the daemon in a private mount namespace whose `/run` and `/dev/shm`
//! are fresh tmpfs mounts (a holder process keeps the namespace, and its
//! state, alive between daemons); the test reaches the daemon's control
//! socket through `/proc/HOLDER/root`. Needs root (CI runs as root).

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vzram_tests::cli::Vzram;
use vzram_tests::client::Client;
use vzram_tests::daemon::{Daemon, DaemonOpts};
use vzram_tests::data::pattern;
use vzram_tests::paths::{s, vzram_bin, TempDir};

/// A private mount namespace with empty tmpfs on `/run` and `/dev/shm`,
/// kept while this lives.
struct Host {
    holder: Child,
}

impl Host {
    /// None (the test is skipped, with a line) where namespaces cannot be
    /// made: not root, or no `unshare`.
    fn new() -> Option<Host> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI runs as root: the bare-serve tests must run"
            );
            eprintln!("skipped: a private mount namespace needs root");
            return None;
        }
        let mut holder = Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c"])
            .arg(
                "mount -t tmpfs -o mode=0755 tmpfs /run && \
                 mount -t tmpfs -o mode=1777 tmpfs /dev/shm && \
                 echo ready && exec sleep 600",
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("unshare");
        let mut line = String::new();
        BufReader::new(holder.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "the namespace was not made");
        Some(Host { holder })
    }

    /// A path inside the namespace, as this process reaches it.
    fn inside(&self, p: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{p}", self.holder.id()))
    }

    /// `vzram serve ARGS` inside the namespace, with none of the variables
    /// that would point it anywhere, as `user` (uid, with that gid) if
    /// given. nsenter, setpriv and env exec in place: the pid is vzram's.
    fn command(&self, args: &[&str], user: Option<u32>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.args(["-t", &self.holder.id().to_string(), "-m", "--"]);
        if let Some(uid) = user {
            cmd.arg("setpriv")
                .arg(format!("--reuid={uid}"))
                .arg(format!("--regid={uid}"))
                .arg("--clear-groups");
        }
        cmd.arg("env");
        for v in [
            "VZRAM_STATE_DIR",
            "VZRAM_CONTROL",
            "RUNTIME_DIRECTORY",
            "XDG_RUNTIME_DIR",
        ] {
            cmd.args(["-u", v]);
        }
        cmd.arg(vzram_bin()).arg("serve").args(args);
        cmd
    }

    /// [`Host::command`], started once its device socket is bound; its
    /// control socket (a path inside) is found with `control`, which gets
    /// the daemon's pid.
    fn serve(
        &self,
        dir: &TempDir,
        args: &[&str],
        user: Option<u32>,
        control: impl Fn(u32) -> String,
    ) -> Daemon {
        static N: AtomicU64 = AtomicU64::new(0);
        let log = dir.join(&format!("bare-{}.log", N.fetch_add(1, Ordering::Relaxed)));
        let sock = PathBuf::from(args[1]);
        // The control socket's path may carry the pid.
        let opts = DaemonOpts::default();
        let mut d = Daemon::spawn(self.command(args, user), &sock, &log, &[&sock], opts);
        d.control = self.inside(&control(d.pid()));
        d.wait_serving();
        d
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// A client of `sock`, waiting while it is refused: after a kill -9 the
/// killed daemon's processes may hold the old socket open for a moment, so
/// a daemon that answers on its control socket may not be the one here yet.
fn connect(sock: &Path) -> Client {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match Client::connect(sock, 1) {
            Ok(c) => return c,
            Err(e) if Instant::now() > deadline => panic!("{}: {e}", sock.display()),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn fill(sock: &Path, seed: u64) {
    let mut c = connect(sock);
    c.q(0).write(0, &pattern(seed, 0, 32 * 4096)).unwrap();
}

fn holds(sock: &Path, seed: u64) -> bool {
    let mut c = connect(sock);
    c.q(0).read(0, 32 * 4096).unwrap() == pattern(seed, 0, 32 * 4096)
}

fn is_blank(sock: &Path) -> bool {
    let mut c = connect(sock);
    c.q(0).read(0, 32 * 4096).unwrap().iter().all(|&b| b == 0)
}

fn first_line(d: &Daemon) -> String {
    d.log_text().lines().next().unwrap_or_default().to_string()
}

const ROOT_CONTROL: &str = "/run/vzram/control.sock";

fn root_control(_pid: u32) -> String {
    ROOT_CONTROL.to_string()
}

fn second_control(pid: u32) -> String {
    format!("/run/vzram/control.{pid}.sock")
}

#[test]
fn a_bare_serve_works_keeps_its_pages_and_a_socket_elsewhere_is_another_disk() {
    let Some(host) = Host::new() else { return };
    let dir = TempDir::new("bare");
    for sub in ["a", "b"] {
        std::fs::create_dir(dir.join(sub)).unwrap();
    }
    let (a, b) = (dir.join("a/vm.sock"), dir.join("b/vm.sock"));
    let args_a = ["--socket", s(&a), "--size", "16M"];
    let args_b = ["--socket", s(&b), "--size", "16M"];

    let mut d = host.serve(&dir, &args_a, None, root_control);
    assert!(
        first_line(&d).contains(&format!("control={ROOT_CONTROL}")),
        "the first log line says where the control socket is: {}",
        d.log_text()
    );
    let run = std::fs::metadata(host.inside("/run/vzram")).unwrap();
    assert_eq!(run.permissions().mode() & 0o7777, 0o755, "/run/vzram");
    fill(&a, 1);
    // kill -9 and the same command: the same pages.
    d.kill9();
    let mut d = host.serve(&dir, &args_a, None, root_control);
    assert!(
        holds(&a, 1),
        "the pages did not outlive kill -9\n{}",
        d.log_text()
    );
    assert_eq!(d.stat().devices()[0].name, "vm");

    // A second bare daemon beside it, on a socket of the same name in
    // another directory: it serves an empty disk, with a control socket
    // of its own that its first line names.
    let mut e = host.serve(&dir, &args_b, None, second_control);
    let own = second_control(e.pid());
    assert!(
        first_line(&e).contains(&own),
        "the second daemon's first line names its control socket {own}:\n{}",
        e.log_text()
    );
    assert!(
        is_blank(&b),
        "a socket in another directory got another disk's pages"
    );
    fill(&b, 2);
    assert!(holds(&a, 1) && holds(&b, 2));
    assert_eq!(e.stat().devices()[0].name, "vm");
    // Each keyed by its whole socket path: two states, neither refused.
    let (sa, sb) = (
        d.stat().devices()[0].state.clone(),
        e.stat().devices()[0].state.clone(),
    );
    assert_ne!(sa, sb);
    assert_eq!(sa.parent(), sb.parent(), "one state dir for both");
    e.kill9();
    d.terminate_cleanly();
    // Both keep their pages over a restart of each, in the other order.
    let mut e = host.serve(&dir, &args_b, None, root_control);
    let mut d = host.serve(&dir, &args_a, None, second_control);
    assert!(holds(&b, 2), "b after its restart\n{}", e.log_text());
    assert!(holds(&a, 1), "a after its restart\n{}", d.log_text());
    d.terminate_cleanly();
    e.terminate_cleanly();
}

/// On a fresh host, a bare serve whose socket is in the runtime directory
/// it makes itself (`/run/vzram/vm1.sock`, as the examples put it): the
/// directory is made before the socket is bound, not refused as missing.
#[test]
fn a_bare_serve_may_put_its_socket_in_the_runtime_directory_it_makes() {
    let Some(host) = Host::new() else { return };
    let dir = TempDir::new("bare-run");
    let inner = "/run/vzram/vm1.sock";
    let sock = host.inside(inner);
    let mut d = Daemon::spawn(
        host.command(&["--socket", inner, "--size", "16M"], None),
        &sock,
        &dir.join("d.log"),
        &[&sock],
        DaemonOpts::default(),
    );
    d.control = host.inside(ROOT_CONTROL);
    d.wait_serving();
    fill(&sock, 3);
    assert!(holds(&sock, 3), "{}", d.log_text());
    d.terminate_cleanly();
}

#[test]
fn a_bare_serve_as_an_ordinary_user() {
    let Some(host) = Host::new() else { return };
    let dir = TempDir::new("bare-user");
    let socks = dir.join("socks");
    std::fs::create_dir(&socks).unwrap();
    // SAFETY: chown of a directory this test made, to nobody.
    let rc = unsafe {
        libc::chown(
            std::ffi::CString::new(s(&socks)).unwrap().as_ptr(),
            65534,
            65534,
        )
    };
    assert_eq!(rc, 0);
    // The test dir itself must be reachable by nobody.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = socks.join("vm.sock");
    let control = "/tmp/vzram-65534/control.sock";
    let at = |_| control.to_string();
    let args = ["--socket", s(&sock), "--size", "16M"];
    let _ = std::fs::remove_dir_all("/tmp/vzram-65534");
    let mut d = host.serve(&dir, &args, Some(65534), at);
    assert!(first_line(&d).contains(control), "{}", d.log_text());
    let m = std::fs::metadata(host.inside("/tmp/vzram-65534")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((m.uid(), m.mode() & 0o7777), (65534, 0o700));
    fill(&sock, 3);
    d.kill9();
    let mut d = host.serve(&dir, &args, Some(65534), at);
    assert!(holds(&sock, 3), "{}", d.log_text());
    d.terminate_cleanly();
    let _ = std::fs::remove_dir_all(host.inside("/tmp/vzram-65534"));
}

/// QEMU's backend program convention: `vzram --socket-path S` with a size
/// from `--size` or from the one `[[device]]` of `--config` that names no
/// socket; without either, one line saying what to add.
#[test]
fn the_backend_program_convention_takes_its_size_from_the_flags_or_the_file() {
    let dir = TempDir::new("bare-prog");
    let sock = dir.join("q.sock");
    let control = dir.join("control.sock");
    let o = Vzram::new(&["--socket-path", s(&sock), "--control", s(&control)]).output();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("no size: give --size N"), "{err}");
    assert!(!sock.exists());

    let file = dir.join("vm.toml");
    std::fs::write(&file, "[[device]]\nsize = \"8M\"\nqueues = 1\n").unwrap();
    let cases: [&[&str]; 2] = [
        &["--size", "8M", "--socket-path", s(&sock)],
        &["--socket-path", s(&sock), "--config", s(&file)],
    ];
    for args in cases {
        let mut cmd = Command::new(vzram_bin());
        cmd.args(args).arg("--control").arg(&control);
        let log = dir.join("prog.log");
        let mut d = Daemon::start_command(cmd, &control, &log, &[&sock]);
        fill(&sock, 4);
        assert!(holds(&sock, 4), "{args:?}\n{}", d.log_text());
        assert_eq!(d.stat().devices()[0].size_bytes, 8 << 20, "{args:?}");
        d.terminate_cleanly();
    }
}

/// contrib/qtest/qsd-as-vzram, started as QEMU's vhost-user-blk qtest starts
/// qemu-storage-daemon (`sh -c "exec BIN --blockdev ... --export
/// ...,addr.type=fd,addr.str=N,..."` with listening sockets inherited):
/// vzram serves each export at its socket with the image's size and the
/// queues asked for, and SIGTERM ends it with status 0.
#[test]
fn qsd_as_vzram_serves_a_qtest_s_exports() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let dir = TempDir::new("qsd-adapter");
    let mut cmdline = format!(
        "exec {} ",
        vzram_tests::paths::root()
            .join("contrib/qtest/qsd-as-vzram")
            .display()
    );
    let mut listeners = Vec::new();
    let mut socks = Vec::new();
    for (i, (mib, queues)) in [(64u64, 1u16), (32, 8)].into_iter().enumerate() {
        let img = dir.join(&format!("img{i}"));
        std::fs::File::create(&img)
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
        let sock = dir.join(&format!("s{i}.sock"));
        let l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        cmdline += &format!(
            "--blockdev driver=file,node-name=disk{i},filename={} \
             --export type=vhost-user-blk,id=disk{i},addr.type=fd,addr.str={},\
             node-name=disk{i},writable=on,num-queues={queues} ",
            img.display(),
            l.as_raw_fd()
        );
        listeners.push(l);
        socks.push((sock, mib, queues));
    }
    let fds: Vec<i32> = listeners.iter().map(|l| l.as_raw_fd()).collect();
    let control = dir.join("control.sock");
    let mut cmd = Command::new("sh");
    cmd.args(["-c", &cmdline])
        .env("VZRAM", vzram_bin())
        .env("VZRAM_CONTROL", &control);
    // SAFETY: between fork and exec only fcntl, which is async-signal-safe,
    // on descriptors this process owns: the child inherits the listeners.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let paths: Vec<&Path> = socks.iter().map(|(p, _, _)| p.as_path()).collect();
    let mut d = Daemon::start_command(cmd, &control, &dir.join("qsd.log"), &paths);
    drop(listeners);
    let st = d.stat();
    for (sock, mib, queues) in &socks {
        let dev = st.dev_at(sock);
        assert_eq!(
            (dev.size_bytes, dev.queues),
            (mib << 20, *queues),
            "{}",
            d.log_text()
        );
        let mut c = Client::connect(sock, 1).unwrap();
        c.q(0).write(0, &pattern(*mib, 0, 8 * 4096)).unwrap();
        assert_eq!(
            c.q(0).read(0, 8 * 4096).unwrap(),
            pattern(*mib, 0, 8 * 4096)
        );
    }
    let st = d.terminate();
    assert_eq!(
        st.code(),
        Some(0),
        "the harness expects exit 0 on SIGTERM\n{}",
        d.log_text()
    );
}

/// `vzram forget --gone` deletes in one command the left-overs whose
/// socket's directory is gone (a harness's temporary directories), and
/// keeps those whose command could still serve them.
#[test]
fn forget_gone_deletes_the_left_overs_of_directories_that_are_gone() {
    let dir = TempDir::new("bare-gone");
    for sub in ["keep", "tmp1", "tmp2"] {
        std::fs::create_dir(dir.join(sub)).unwrap();
    }
    let socks = ["keep", "tmp1", "tmp2"].map(|d| dir.join(&format!("{d}/vm.sock")));
    let mut args = Vec::new();
    for s in &socks {
        args.push("--device".to_string());
        args.push(format!("socket={},size=8M,queues=1", s.display()));
    }
    // Names must differ within one daemon: one daemon each.
    for (i, a) in args.chunks(2).enumerate() {
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        let ctl = format!("c{i}.sock");
        let mut cmd = Command::new(vzram_bin());
        cmd.arg("serve")
            .args(&refs)
            .arg("--control")
            .arg(dir.join(&ctl));
        let mut d = Daemon::start_command(
            cmd,
            &dir.join(&ctl),
            &dir.join(&format!("d{i}.log")),
            &[&socks[i]],
        );
        fill(&socks[i], i as u64);
        d.kill9();
    }
    std::fs::remove_dir_all(dir.join("tmp1")).unwrap();
    std::fs::remove_dir_all(dir.join("tmp2")).unwrap();
    let other = dir.join("other.sock");
    let mut d = Daemon::start(&dir, &["--socket", s(&other), "--size", "8M"], &[&other]);
    assert_eq!(d.stat().0.leftovers.len(), 3, "{:?}", d.stat().0.leftovers);
    let out = d.cli(&["forget", "--gone"]);
    assert!(
        out.contains("2 left-over states forgotten") && out.contains("1 kept"),
        "{out}"
    );
    let left = d.stat().0.leftovers.clone();
    assert_eq!(left.len(), 1, "{left:?}");
    // By pattern: only what matches the socket it was made for.
    let out = d.cli(&["forget", "--socket", &format!("{}/tmp*", s(dir.path()))]);
    assert!(
        out.contains("0 left-over states forgotten") && out.contains("1 kept"),
        "{out}"
    );
    assert_eq!(left[0].socket.as_deref(), Some(socks[0].as_path()));
    // The kept one still serves its pages to the same command.
    d.terminate_cleanly();
    let mut cmd = Command::new(vzram_bin());
    cmd.arg("serve")
        .args(&args[0..2])
        .arg("--control")
        .arg(dir.join("c0.sock"));
    let mut d = Daemon::start_command(
        cmd,
        &dir.join("c0.sock"),
        &dir.join("again.log"),
        &[&socks[0]],
    );
    assert!(holds(&socks[0], 0), "{}", d.log_text());
    d.terminate_cleanly();
}

/// With no daemon to ask (bare serves, stopped: what a harness leaves),
/// `vzram forget --gone` and `--socket PATTERN` look in the state dir
/// themselves, delete what they match and its marker beside the socket,
/// and never touch a state a running vzram serves (it holds the lock).
#[test]
fn with_no_daemon_forget_looks_in_the_state_dir_and_spares_a_served_state() {
    let dir = TempDir::new("bare-offline");
    let state = vzram_tests::paths::state_dir_for(dir.path());
    for sub in ["tmp1", "busy"] {
        std::fs::create_dir(dir.join(sub)).unwrap();
    }
    let gone = dir.join("tmp1/vm.sock");
    let here = dir.join("here.sock");
    let busy = dir.join("busy/vm.sock");
    let serve = |sock: &Path, i: usize| {
        let ctl = dir.join(&format!("c{i}.sock"));
        let mut cmd = Command::new(vzram_bin());
        cmd.args([
            "serve",
            "--socket",
            s(sock),
            "--size",
            "8M",
            "--queues",
            "1",
        ])
        .arg("--control")
        .arg(&ctl);
        Daemon::start_command(cmd, &ctl, &dir.join(&format!("d{i}.log")), &[sock])
    };
    for (i, sock) in [&gone, &here].into_iter().enumerate() {
        let mut d = serve(sock, i);
        fill(sock, i as u64);
        d.kill9();
    }
    let marker = dir.join(".here.sock.vzram-state");
    assert!(marker.exists(), "no marker beside {}", here.display());
    let mut running = serve(&busy, 2);
    fill(&busy, 2);
    // Its socket's directory goes while it serves: gone, but held.
    std::fs::remove_dir_all(dir.join("tmp1")).unwrap();
    std::fs::remove_dir_all(dir.join("busy")).unwrap();
    let states = || {
        std::fs::read_dir(&state)
            .unwrap()
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .count()
    };
    assert_eq!(states(), 3);
    let forget = |args: &[&str]| {
        let out = Vzram::new(&[])
            .arg("forget")
            .args(args)
            .args(["--control", s(&dir.join("nobody.sock"))])
            .env("VZRAM_STATE_DIR", &state)
            .output();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "vzram forget {args:?}: {text}");
        text
    };
    let out = forget(&["--gone"]);
    assert!(
        out.contains("no daemon at")
            && out.contains("1 left-over states forgotten")
            && out.contains("1 kept"),
        "{out}"
    );
    assert_eq!(states(), 2, "{out}");
    assert!(
        running.stat().0.devices.len() == 1,
        "the running daemon went"
    );
    let out = forget(&["--socket", &format!("{}/here*", s(dir.path()))]);
    assert!(out.contains("1 left-over states forgotten"), "{out}");
    assert!(!marker.exists(), "the marker of a forgotten state stays");
    assert_eq!(states(), 1, "the served state went too: {out}");
    // By name: a served state is refused with exit 2.
    let served = std::fs::read_dir(&state)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .find(|n| !n.starts_with('.'))
        .unwrap();
    let out = Vzram::new(&["forget", &served, "--state-dir", s(&state)]).output();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert_eq!(states(), 1);
    running.kill9();
}
