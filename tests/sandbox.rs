//! The sandbox: the daemon serves under its seccomp filter (on by default,
//! on every thread), `--seccomp off` and `seccomp = false` turn it off, and
//! it runs as an unprivileged user with its sockets in a directory it owns,
//! and the Dockerfile's default command makes sockets a VMM can use.

use std::fs::Permissions;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use vzram_tests::*;

const NOBODY: u32 = 65534;

fn seccomp_of(pid: u32) -> (String, String) {
    (
        proc_status_field(pid, "Seccomp").expect("no Seccomp in /proc/PID/status"),
        proc_status_field(pid, "Seccomp_filters").unwrap_or_default(),
    )
}

/// Every thread of `pid` and of every process it started, with its Seccomp mode.
fn thread_modes(pid: u32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let tasks = process_tree(pid)
        .into_iter()
        .filter_map(|p| std::fs::read_dir(format!("/proc/{p}/task")).ok())
        .flatten();
    for t in tasks {
        let t = t.unwrap().path();
        // A thread may end between the listing and the read: skip it.
        let Ok(status) = std::fs::read_to_string(t.join("status")) else {
            continue;
        };
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k)?.strip_prefix(':'))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        out.push((field("Name"), field("Seccomp")));
    }
    out
}

/// Writes, reads back, discards and asks for stats: the whole serving path.
fn exercise(d: &Daemon, sock: &Path, queues: usize) {
    let mut c =
        Client::connect(sock, queues).unwrap_or_else(|e| panic!("connect: {e}\n{}", d.log_text()));
    for q in 0..queues {
        let off = q as u64 * MIB;
        let data = noise(q as u64 + 1, 256 * 1024);
        c.q(q).write(off, &data).unwrap();
        c.q(q)
            .write(off + MIB / 2, &pattern(7, 0, 3 * PAGE))
            .unwrap();
        assert_eq!(c.q(q).read(off, data.len()).unwrap(), data);
    }
    c.q(0).write_zeroes(0, 64 * 1024).unwrap();
    c.q(0).discard(MIB, MIB).unwrap();
    c.q(0).flush().unwrap();
    assert!(c.q(0).read(0, PAGE).unwrap().iter().all(|&b| b == 0));
    let st = d.stat();
    assert!(st.sole().stats.writes > 0, "{}", st);
    let _: Compacted = d.request(json!({"cmd": "compact"}));
    drop(c);
    wait_disconnected(d);
    // A second connection: new worker threads, started under the filter.
    let mut c = Client::connect(sock, 1).unwrap();
    assert_eq!(
        c.q(0).read(MIB / 2, 3 * PAGE).unwrap(),
        pattern(7, 0, 3 * PAGE)
    );
    drop(c);
    wait_disconnected(d);
}

/// Waits until the daemon has let go of the last frontend: a frontend that
/// connects before then is turned away as a second one (ECONNRESET).
fn wait_disconnected(d: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.stat().devices()[0].connected {
        assert!(
            Instant::now() < deadline,
            "the daemon still holds the last frontend after 10 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn filter_is_on_by_default_on_every_thread_and_io_works() {
    let dir = TempDir::new("sbx-on");
    let sock = dir.join("d.sock");
    let mut d = Daemon::start(
        &dir,
        &["--socket", s(&sock), "--size", "64M", "--queues", "2"],
        &[&sock],
    );
    let pid = d.pid();
    // The filter is in place once the log says so (the control socket is
    // bound before it is installed).
    assert!(d.wait_log("seccomp filter active"), "{}", d.log_text());
    let (mode, filters) = seccomp_of(pid);
    eprintln!("Seccomp: {mode}, Seccomp_filters: {filters}");
    assert_eq!(mode, "2", "seccomp filter mode expected:\n{}", d.log_text());
    assert!(
        filters.parse::<u32>().is_ok_and(|n| n >= 1),
        "Seccomp_filters: {filters}"
    );
    assert_eq!(proc_status_field(pid, "NoNewPrivs").as_deref(), Some("1"));
    assert!(
        d.log_text().contains("seccomp filter active"),
        "{}",
        d.log_text()
    );

    exercise(&d, &sock, 2);

    // Every thread of the supervisor and of the connection's worker process
    // (its handler, vring and compaction threads) carries a filter. The
    // launcher alone runs without one: it starts workers (exec), and reads
    // nothing but the supervisor's requests (SECURITY.md).
    let _connected = Client::connect(&sock, 2).unwrap_or_else(|e| panic!("connect: {e}"));
    // The worker starts its threads as it sets up: on a busy machine the
    // last may come a moment after the connection.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut threads = thread_modes(pid);
    while !threads.iter().any(|(n, _)| n == "vzram-compact") && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(50));
        threads = thread_modes(pid);
    }
    eprintln!("threads: {threads:?}");
    assert!(threads.len() >= 6, "{threads:?}");
    assert!(
        threads
            .iter()
            .filter(|(n, _)| n != "vzram-launch")
            .all(|(_, m)| m == "2"),
        "a thread without the filter: {threads:?}"
    );
    assert_eq!(
        threads.iter().filter(|(n, _)| n == "vzram-launch").count(),
        1,
        "{threads:?}"
    );
    assert!(
        threads.iter().any(|(n, _)| n == "vzram-compact"),
        "no compaction thread within 20 s: {threads:?}"
    );
    let worker = d.sole_worker_pid();
    assert_ne!(worker, pid);
    assert_eq!(seccomp_of(worker).0, "2");
    assert_eq!(
        proc_status_field(worker, "NoNewPrivs").as_deref(),
        Some("1")
    );

    // Shutdown under the filter removes the sockets (unlinkat) and exits 0.
    let st = d.terminate();
    assert!(st.success(), "{st}:\n{}", d.log_text());
    assert!(!sock.exists() && !d.control.exists());
    assert!(!d.log_text().contains("seccomp: system call"));
}

/// Each thread of `pid` (not its children): name and Seccomp_filters.
fn thread_filters(pid: u32) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let Ok(status) = std::fs::read_to_string(t.unwrap().path().join("status")) else {
            continue;
        };
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k)?.strip_prefix(':'))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        out.push((field("Name"), field("Seccomp_filters").parse().unwrap_or(0)));
    }
    out
}

#[test]
fn queue_threads_serve_under_a_narrower_filter_than_the_rest_of_the_worker() {
    let dir = TempDir::new("sbx-queue");
    let sock = dir.join("d.sock");
    let mut d = Daemon::start(
        &dir,
        &[
            "--socket",
            s(&sock),
            "--size",
            "64M",
            "--queues",
            "2",
            "--compress-threads",
            "2",
        ],
        &[&sock],
    );
    let mut c = Client::connect(&sock, 2).unwrap_or_else(|e| panic!("connect: {e}"));
    for q in 0..2 {
        let data = noise(q as u64 + 1, 512 * 1024);
        c.q(q).write(q as u64 * MIB, &data).unwrap();
        assert_eq!(c.q(q).read(q as u64 * MIB, data.len()).unwrap(), data);
    }
    let worker = d.sole_worker_pid();
    let threads = thread_filters(worker);
    eprintln!("worker threads (name, filters): {threads:?}");
    let main = proc_status_field(worker, "Seccomp_filters")
        .and_then(|f| f.parse::<u32>().ok())
        .expect("the worker's Seccomp_filters");
    assert!(main >= 1, "{threads:?}");
    // Both queues served requests: each of their threads added the queue
    // filter to the worker's. The control thread, which receives orders
    // and descriptors, keeps the worker's.
    let queues: Vec<_> = threads
        .iter()
        .filter(|(n, _)| n == "vring_worker")
        .collect();
    assert_eq!(queues.len(), 2, "{threads:?}");
    assert!(queues.iter().all(|&&(_, f)| f == main + 1), "{threads:?}");
    assert!(
        threads.iter().any(|(n, f)| n == "control" && *f == main),
        "{threads:?}"
    );
    // The compress threads narrowed their filter too.
    assert!(
        threads
            .iter()
            .filter(|(n, _)| n.starts_with("vzram-compress"))
            .all(|&(_, f)| f == main + 1),
        "{threads:?}"
    );
    drop(c);
    wait_disconnected(&d);
    let st = d.terminate();
    assert!(st.success(), "{st}:\n{}", d.log_text());
    let log = d.log_text();
    assert!(
        !log.contains("seccomp: system call") && !log.contains("cannot narrow"),
        "{log}"
    );
}

/// A compress thread that has taken no job yet already serves under the
/// queue filter: it narrows it once the worker's is in, before the
/// frontend's first message, not before its first job (an idle one would
/// otherwise wait under the wider filter for as long as the VM writes
/// nothing).
#[test]
fn idle_compress_threads_narrow_their_filter_before_any_job() {
    let dir = TempDir::new("sbx-idle");
    let sock = dir.join("d.sock");
    let mut d = Daemon::start(
        &dir,
        &[
            "--socket",
            s(&sock),
            "--size",
            "16M",
            "--compress-threads",
            "2",
        ],
        &[&sock],
    );
    // Connected, no request sent: no pool thread has had a job.
    let c = Client::connect(&sock, 1).unwrap_or_else(|e| panic!("connect: {e}"));
    let worker = d.sole_worker_pid();
    let main = proc_status_field(worker, "Seccomp_filters")
        .and_then(|f| f.parse::<u32>().ok())
        .expect("the worker's Seccomp_filters");
    let threads = thread_filters(worker);
    eprintln!("worker threads (name, filters): {threads:?}");
    let pool: Vec<_> = threads
        .iter()
        .filter(|(n, _)| n.starts_with("vzram-compress"))
        .collect();
    let want = 2.min(std::thread::available_parallelism().map_or(1, |n| n.get()));
    assert_eq!(pool.len(), want, "{threads:?}");
    assert!(
        pool.iter().all(|&&(_, f)| f == main + 1),
        "an idle compress thread keeps the worker's filter ({main}): {threads:?}"
    );
    assert_eq!(
        d.stat().sole().stats.pool_pages,
        0,
        "a pool thread took a job; the check above proves nothing"
    );
    drop(c);
    wait_disconnected(&d);
    let st = d.terminate();
    assert!(st.success(), "{st}:\n{}", d.log_text());
    assert!(!d.log_text().contains("seccomp: system call"));
}

#[test]
fn seccomp_off_and_log_modes() {
    let dir = TempDir::new("sbx-off");
    let sock = dir.join("d.sock");
    let base = ["--socket", s(&sock), "--size", "16M", "--queues", "1"];

    let args = [&base[..], &["--seccomp", "off"]].concat();
    let mut d = Daemon::start(&dir, &args, &[&sock]);
    assert_eq!(seccomp_of(d.pid()).0, "0", "--seccomp off");
    exercise(&d, &sock, 1);
    assert!(d.terminate().success());

    let cfg = dir.join("vzram.toml");
    std::fs::write(&cfg, "seccomp = false\n").unwrap();
    let args = [&base[..], &["--config", s(&cfg)]].concat();
    let mut d = Daemon::start(&dir, &args, &[&sock]);
    assert_eq!(seccomp_of(d.pid()).0, "0", "seccomp = false in the config");
    assert!(d.terminate().success());

    // The command line wins over the file.
    let args = [&base[..], &["--config", s(&cfg), "--seccomp", "on"]].concat();
    let mut d = Daemon::start(&dir, &args, &[&sock]);
    assert!(d.wait_log("seccomp filter active"), "{}", d.log_text());
    assert_eq!(seccomp_of(d.pid()).0, "2");
    assert!(d.terminate().success());

    // Log mode: one filter that refuses nothing.
    let args = [&base[..], &["--seccomp", "log"]].concat();
    let mut d = Daemon::start(&dir, &args, &[&sock]);
    assert_eq!(seccomp_of(d.pid()), ("2".into(), "1".into()));
    exercise(&d, &sock, 1);
    assert!(d.terminate().success());
}

/// setpriv (util-linux) or runuser drops to `nobody` and execs the daemon.
fn drop_to_nobody() -> Option<Vec<String>> {
    let found = |p: &str| Path::new(p).is_file();
    for setpriv in ["/usr/bin/setpriv", "/bin/setpriv"] {
        if found(setpriv) {
            return Some(vec![
                setpriv.into(),
                format!("--reuid={NOBODY}"),
                format!("--regid={NOBODY}"),
                "--clear-groups".into(),
                "--".into(),
            ]);
        }
    }
    None
}

/// Whether user `nobody` can execute `bin` (every directory above it
/// searchable by others, the file executable by others).
fn others_can_exec(bin: &Path) -> bool {
    let ok = |p: &Path, bit: u32| std::fs::metadata(p).is_ok_and(|m| m.mode() & bit != 0);
    ok(bin, 0o001) && bin.ancestors().skip(1).all(|d| ok(d, 0o001))
}

/// The daemon binary, or a copy in `dir` that other users can execute.
fn bin_for_others(dir: &TempDir) -> PathBuf {
    let bin = vzram_bin();
    if others_can_exec(&bin) {
        return bin;
    }
    let copy = dir.join("vzram");
    std::fs::copy(&bin, &copy).unwrap();
    std::fs::set_permissions(&copy, Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(dir.path(), Permissions::from_mode(0o755)).unwrap();
    copy
}

fn chown(p: &Path, uid: u32, gid: u32) {
    let c = std::ffi::CString::new(s(p)).unwrap();
    // SAFETY: chown of a path the test created, NUL-terminated.
    let rc = unsafe { libc::chown(c.as_ptr(), uid, gid) };
    assert_eq!(rc, 0, "chown {}", p.display());
}

/// Connects to the unix socket `path` from a child process running as
/// `uid`:`gid` (no other groups): Ok, or the errno of connect.
fn connect_as(path: &Path, uid: u32, gid: u32) -> Result<(), i32> {
    // Everything the child needs is made before fork: after it, only system
    // calls (this process has threads).
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = s(path).as_bytes();
    assert!(bytes.len() < addr.sun_path.len(), "socket path too long");
    for (d, b) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: the child only makes system calls and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: async-signal-safe calls on values made before fork; the
        // child never returns into the test harness.
        unsafe {
            let fail = |step: i32| libc::_exit(100 + step);
            if libc::setgroups(0, std::ptr::null()) != 0 {
                fail(1);
            }
            if libc::setgid(gid) != 0 {
                fail(2);
            }
            if libc::setuid(uid) != 0 {
                fail(3);
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if fd < 0 {
                fail(4);
            }
            let r = libc::connect(fd, (&raw const addr).cast::<libc::sockaddr>(), len);
            let errno = *libc::__errno_location();
            libc::_exit(if r == 0 { 0 } else { errno.min(99) });
        }
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child: status {status}");
    match libc::WEXITSTATUS(status) {
        0 => Ok(()),
        n if n >= 100 => panic!("child could not become {uid}:{gid} (step {})", n - 100),
        errno => Err(errno),
    }
}

/// The Dockerfile's default command, run the way its comment says: as the
/// image's user (the uid its `useradd` gives), with the host's socket
/// directory owned by that uid and the VMM's group, setgid. The device
/// socket comes out 0660 in the VMM's group: a VMM user in that group
/// connects, others do not, and the control socket stays the daemon's.
#[test]
fn dockerfile_default_command_makes_sockets_the_vmm_can_use() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: needs root to run the daemon and a VMM as other users");
        return;
    }
    let Some(setpriv) = drop_to_nobody().map(|w| w[0].clone()) else {
        eprintln!("SKIP: no setpriv");
        return;
    };
    const VMM_UID: u32 = NOBODY;
    const VMM_GID: u32 = 10_077; // stands in for kvm
    const OTHER_GID: u32 = NOBODY;

    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    let uid: u32 = dockerfile
        .split_once("--uid ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|u| u.parse().ok())
        .expect("a useradd --uid in the Dockerfile");
    let cmd_line = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("CMD "))
        .expect("a CMD in the Dockerfile");
    let cmd: Vec<String> = serde_json::from_str(cmd_line).expect("CMD in JSON form");
    // State on a volume the host mounts (a tmpfs), never the container's
    // own /dev/shm that `docker restart` replaces.
    let state_in_image = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("ENV VZRAM_STATE_DIR="))
        .expect("ENV VZRAM_STATE_DIR in the Dockerfile");
    let volumes = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("VOLUME "))
        .expect("a VOLUME in the Dockerfile");
    assert!(
        volumes.contains(&format!("\"{state_in_image}\"")),
        "the state dir {state_in_image} is not a volume: {volumes}"
    );
    assert!(
        dockerfile.contains(&format!(":{state_in_image} ")),
        "the Dockerfile's run line does not bind-mount the state dir"
    );

    let dir = TempDir::new("docker");
    // Stands in for the host's /run/vzram, prepared as the comment says.
    let run = dir.join("run");
    std::fs::create_dir(&run).unwrap();
    chown(&run, uid, VMM_GID);
    std::fs::set_permissions(&run, Permissions::from_mode(0o2770)).unwrap();
    // Stands in for the host's tmpfs bind-mounted as the state volume.
    let state = dir.join("state");
    std::fs::create_dir(&state).unwrap();
    chown(&state, uid, uid);
    std::fs::set_permissions(&state, Permissions::from_mode(0o700)).unwrap();
    let mut args: Vec<String> = cmd
        .iter()
        .map(|a| a.replace("/run/vzram", s(&run)))
        .collect();
    args.extend(["--state-dir".into(), s(&state).into()]);
    let path_after = |flag: &str| {
        let i = args.iter().position(|a| a == flag).unwrap_or_else(|| {
            panic!("the Dockerfile's CMD has no {flag}: {cmd:?}");
        });
        PathBuf::from(&args[i + 1])
    };
    let sock = path_after("--socket");
    let control = path_after("--control");

    let mut c = Command::new(setpriv);
    c.args([
        format!("--reuid={uid}"),
        format!("--regid={uid}"),
        "--clear-groups".into(),
        "--".into(),
    ])
    .arg(bin_for_others(&dir))
    .args(&args);
    let mut d = Daemon::start_command(c, &control, &dir.join("daemon.log"), &[&sock]);

    let meta = std::fs::metadata(&sock).unwrap();
    assert_eq!(
        (
            meta.uid(),
            meta.gid(),
            format!("{:o}", meta.mode() & 0o7777)
        ),
        (uid, VMM_GID, "660".into()),
        "device socket (uid, gid, mode)"
    );
    let meta = std::fs::metadata(&control).unwrap();
    assert_eq!(
        (meta.uid(), format!("{:o}", meta.mode() & 0o777)),
        (uid, "600".into()),
        "control socket"
    );

    assert_eq!(
        connect_as(&sock, VMM_UID, VMM_GID),
        Ok(()),
        "the VMM's user"
    );
    assert_eq!(
        connect_as(&sock, VMM_UID, OTHER_GID),
        Err(libc::EACCES),
        "a user outside the VMM's group"
    );
    assert_eq!(
        connect_as(&control, VMM_UID, VMM_GID),
        Err(libc::EACCES),
        "the control socket is the daemon user's"
    );
    // The socket serves: a VMM (root here) does I/O on it.
    exercise(&d, &sock, 1);
    assert!(d.terminate().success(), "{}", d.log_text());
    assert!(
        state.join("vzram").join("table").exists(),
        "the device's state is not in the state volume"
    );
}

#[test]
fn runs_as_an_unprivileged_user_with_sockets_in_its_own_directory() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let dir = TempDir::new("sbx-user");
    let sockdir: PathBuf = dir.join("run");
    std::fs::create_dir(&sockdir).unwrap();
    let sock = sockdir.join("d.sock");
    let control = sockdir.join("control.sock");
    let args = [
        "--socket",
        s(&sock),
        "--size",
        "32M",
        "--queues",
        "2",
        "--control",
        s(&control),
    ];

    let mut d = if euid == 0 {
        let Some(wrapper) = drop_to_nobody() else {
            eprintln!("SKIP: running as root and there is no setpriv to drop to nobody");
            return;
        };
        // The socket directory belongs to the daemon's user, mode 0700;
        // root (the test, standing in for the VMM) connects anyway.
        chown(&sockdir, NOBODY, NOBODY);
        std::fs::set_permissions(&sockdir, Permissions::from_mode(0o700)).unwrap();
        // The binary must be reachable for nobody, else run a copy.
        let bin = bin_for_others(&dir);
        let mut cmd = Command::new(&wrapper[0]);
        cmd.args(&wrapper[1..]).arg(&bin).arg("serve").args(args);
        // The log is opened by us and handed over as stdout/stderr.
        let d = Daemon::start_command(cmd, &control, &dir.join("daemon.log"), &[&sock]);
        let uid = proc_status_field(d.pid(), "Uid").unwrap();
        assert!(
            uid.split_whitespace().all(|u| u == NOBODY.to_string()),
            "Uid: {uid}"
        );
        d
    } else {
        eprintln!("not root (euid {euid}): the daemon runs as this user");
        let mut cmd = Command::new(vzram_bin());
        cmd.arg("serve").args(args);
        Daemon::start_command(cmd, &control, &dir.join("daemon.log"), &[&sock])
    };
    let pid = d.pid();
    // The control socket answers before the filter is in place.
    assert!(d.wait_log("seccomp filter active"), "{}", d.log_text());
    let owner = std::fs::metadata(&sock).unwrap().uid();
    let mode = std::fs::metadata(&sock).unwrap().mode() & 0o777;
    eprintln!(
        "daemon pid {pid} Uid: {:?}, socket owner {owner} mode {mode:o}, Seccomp {:?}",
        proc_status_field(pid, "Uid"),
        seccomp_of(pid)
    );
    if euid == 0 {
        assert_eq!(owner, NOBODY, "socket made by the daemon's user");
    }
    assert_eq!(mode, 0o600);
    assert_eq!(seccomp_of(pid).0, "2");
    assert_eq!(
        proc_status_field(pid, "CapEff").as_deref(),
        Some("0000000000000000")
    );

    exercise(&d, &sock, 2);

    let st = d.terminate();
    assert!(st.success(), "{st}:\n{}", d.log_text());
    assert!(!sock.exists(), "socket left behind");
}

/// A worker stopped and continued (SIGSTOP/SIGCONT: job control, a
/// debugger, a checkpoint tool) resumes its interrupted timed waits with
/// restart_syscall. The filter must let that through: refused, it killed
/// the worker with SIGSYS (seen when a hung-guest dump attached gdb).
#[test]
fn a_worker_stopped_and_continued_keeps_serving() {
    let dir = TempDir::new("stopcont");
    let sock = dir.join("d.sock");
    let d = Daemon::start(&dir, &["--socket", s(&sock), "--size", "16M"], &[&sock]);
    let mut c =
        Client::connect(&sock, 1).unwrap_or_else(|e| panic!("connect: {e}\n{}", d.log_text()));
    c.q(0).write(0, &pattern(3, 0, 4 * PAGE)).unwrap();
    let pid = d.sole_worker_pid() as i32;
    for _ in 0..3 {
        // SAFETY: kill only sends signals, to our daemon's worker.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: as above.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
        // Its control thread's one-second poll, among others, restarts now.
        std::thread::sleep(Duration::from_millis(1200));
    }
    assert_eq!(
        c.q(0).read(0, 4 * PAGE).unwrap(),
        pattern(3, 0, 4 * PAGE),
        "{}",
        d.log_text()
    );
    assert_eq!(d.stat().sole().worker.pid, Some(pid as u32));
    assert!(!d.log_text().contains("SIGSYS"), "{}", d.log_text());
}
