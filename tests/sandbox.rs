//! The sandbox: the daemon serves under its seccomp filter (on by default,
//! on every thread), `--seccomp off` and `seccomp = false` turn it off, and
//! it runs as an unprivileged user with its sockets in a directory it owns.

use std::fs::Permissions;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use vzram_tests::*;

const MIB: u64 = 1 << 20;
const PAGE: usize = 4096;
const NOBODY: u32 = 65534;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

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
    assert!(st.dev("vzram0", "writes") > 0, "{}", st.0);
    assert_eq!(d.control(json!({"cmd": "compact"}))["ok"], true);
    drop(c);
    // A second connection: new worker threads, started under the filter.
    let mut c = Client::connect(sock, 1).unwrap();
    assert_eq!(
        c.q(0).read(MIB / 2, 3 * PAGE).unwrap(),
        pattern(7, 0, 3 * PAGE)
    );
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
    let threads = thread_modes(pid);
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
    assert!(threads.iter().any(|(n, _)| n == "vzram-compact"));
    let worker = d.stat().worker("vzram0")["pid"]
        .as_u64()
        .expect("a worker pid") as u32;
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
        let c = std::ffi::CString::new(s(&sockdir)).unwrap();
        // SAFETY: chown of a directory we just created, by path.
        assert_eq!(unsafe { libc::chown(c.as_ptr(), NOBODY, NOBODY) }, 0);
        std::fs::set_permissions(&sockdir, Permissions::from_mode(0o700)).unwrap();
        // The binary must be reachable for nobody, else run a copy.
        let mut bin = vzram_bin();
        if !others_can_exec(&bin) {
            let copy = dir.join("vzram");
            std::fs::copy(&bin, &copy).unwrap();
            std::fs::set_permissions(&copy, Permissions::from_mode(0o755)).unwrap();
            std::fs::set_permissions(dir.path(), Permissions::from_mode(0o755)).unwrap();
            bin = copy;
        }
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
