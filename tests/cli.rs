//! The `vzram` command line: input errors, `vzram stat`/`set-limit`/`compact`,
//! sockets and their modes, config files, and shutdown on signals.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use vzram_tests::*;

/// `vzram ARGS` in a state directory of its own, killed (and the test
/// failed) after 10 s: a daemon that wrongly starts must not hang the test.
fn vzram(args: &[&str]) -> Output {
    Vzram::new(args)
        .state_apart()
        .limit(Duration::from_secs(10))
        .output()
}

#[test]
fn bad_input_exits_2_with_a_one_line_message() {
    let dir = TempDir::new("badcli");
    let sock = dir.join("x.sock");
    let sock = s(&sock);
    let bad_toml = dir.join("bad.toml");
    std::fs::write(
        &bad_toml,
        "[[device]]\nsocket = \"/tmp/a.sock\"\nsize = \"1G\"\nqueus = 2\n",
    )
    .unwrap();
    let broken_toml = dir.join("broken.toml");
    std::fs::write(&broken_toml, "[[device]\nsocket = \n").unwrap();
    let zero_toml = dir.join("zero.toml");
    std::fs::write(
        &zero_toml,
        "[[device]]\nsocket = \"/tmp/z.sock\"\nsize = 0\n",
    )
    .unwrap();
    let dup = format!("socket={sock},size=1M");
    let over_size = format!("socket={sock},size=1G,mem-limit=2G");
    let over_size_toml = dir.join("over.toml");
    std::fs::write(
        &over_size_toml,
        "[[device]]\nsocket = \"/tmp/o.sock\"\nsize = \"64M\"\nmem_limit = \"65M\"\n",
    )
    .unwrap();

    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["serve", "--socket", sock, "--size", "12Q"], "12Q"),
        (
            vec!["serve", "--socket", sock, "--size", "5000"],
            "multiple of 4096",
        ),
        (vec!["serve", "--socket", sock, "--size", "0"], "size"),
        (vec!["serve", "--size", "1G"], "--socket"),
        (vec!["serve"], "no device"),
        (
            vec!["serve", "--socket", sock, "--size", "1G", "--queues", "0"],
            "queues",
        ),
        (
            vec!["serve", "--socket", sock, "--size", "1G", "--queues", "65"],
            "queues",
        ),
        (
            vec![
                "serve",
                "--socket",
                sock,
                "--size",
                "1G",
                "--poll-us",
                "1000001",
            ],
            "poll-us",
        ),
        (
            vec!["serve", "--socket", sock, "--size", "1G", "--poll-us=-1"],
            "poll-us",
        ),
        (
            vec![
                "serve", "--socket", sock, "--size", "1G", "--queues", "many",
            ],
            "many",
        ),
        (
            vec!["serve", "--socket", sock, "--size", "1G", "--algo", "gzip"],
            "gzip",
        ),
        (
            vec![
                "serve", "--socket", sock, "--size", "1G", "--algo", "zstd:99",
            ],
            "zstd",
        ),
        (
            vec![
                "serve",
                "--socket",
                sock,
                "--size",
                "1G",
                "--mem-limit",
                "lots",
            ],
            "lots",
        ),
        (
            vec![
                "serve",
                "--socket",
                sock,
                "--size",
                "1G",
                "--socket-mode",
                "999",
            ],
            "mode",
        ),
        (
            vec![
                "serve",
                "--socket",
                sock,
                "--size",
                "1G",
                "--serial",
                "a-serial-that-is-far-too-long",
            ],
            "serial",
        ),
        (
            vec!["serve", "--socket", sock, "--size", "1G", "--bogus"],
            "--bogus",
        ),
        (vec!["serve", "--device", "socket=/tmp/a.sock"], "size"),
        (
            vec!["serve", "--device", "socket=/tmp/a.sock,size=1G,colour=red"],
            "colour",
        ),
        (
            vec!["serve", "--device", &dup, "--device", &dup],
            "two devices",
        ),
        (vec!["serve", "--config", s(&bad_toml)], "queus"),
        (vec!["serve", "--config", s(&broken_toml)], "line"),
        (vec!["serve", "--config", s(&zero_toml)], "size"),
        (
            vec!["serve", "--config", "/nonexistent/vzram.toml"],
            "nonexistent",
        ),
        (vec!["frobnicate"], "frobnicate"),
        (
            vec!["set-limit", "--control", "/tmp/c.sock", "1G"],
            "--device",
        ),
        (
            vec!["set-limit", "--control", "/tmp/c.sock", "--host", "1Z"],
            "1Z",
        ),
        // Without a target, both choices are named.
        (
            vec!["set-limit", "--control", "/tmp/c.sock", "1G"],
            "--host",
        ),
        (
            vec!["serve", "--socket", sock, "--size", "1.3M"],
            "multiples of 4096",
        ),
        (
            vec!["serve", "--socket", sock, "--size", "4097"],
            "multiple of 4096",
        ),
        (vec!["serve", "--log-level", "loud"], "loud"),
        // A device limit above the device's size.
        (vec!["serve", "--device", &over_size], "above its size"),
        (
            vec![
                "serve",
                "--socket",
                sock,
                "--size",
                "64M",
                "--mem-limit",
                "1G",
                "--host-mem-limit",
                "8G",
            ],
            "above its size",
        ),
        (
            vec!["serve", "--config", s(&over_size_toml)],
            "above its size",
        ),
    ];
    for (args, needle) in cases {
        let o = vzram(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "vzram {args:?}: {err}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "vzram {args:?}: not one line: {err:?}"
        );
        assert!(
            err.contains(needle),
            "vzram {args:?}: {err:?} does not mention {needle:?}"
        );
        assert!(err.starts_with("error:"), "{err:?}");
    }
    // Nothing was left behind by the refused starts.
    assert!(!Path::new(sock).exists());
}

#[test]
fn help_and_version_exit_0() {
    let o = vzram(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).contains("serve"));
    let o = vzram(&["serve", "--help"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).contains("--host-mem-limit"));
    assert_eq!(vzram(&["--version"]).status.code(), Some(0));
}

/// QEMU's backend-program conventions (docs/interop/vhost-user.rst):
/// `--print-capabilities` prints `{"type": "block", "features": [...]}`
/// and exits 0, whatever else is on the command line, doing nothing else.
#[test]
fn print_capabilities_follows_qemu_conventions() {
    let dir = TempDir::new("caps");
    let sock = dir.join("x.sock");
    for args in [
        vec!["--print-capabilities"],
        vec![
            "serve",
            "--socket",
            s(&sock),
            "--size",
            "1G",
            "--print-capabilities",
        ],
        vec!["serve", "--bogus", "--print-capabilities"],
    ] {
        let o = vzram(&args);
        assert_eq!(o.status.code(), Some(0), "vzram {args:?}: {}", stderr(&o));
        assert!(o.stderr.is_empty(), "vzram {args:?}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("vzram {args:?}: not JSON ({e}): {:?}", o.stdout));
        assert_eq!(v["type"], "block", "{v}");
        let features = v["features"].as_array().expect("a features list");
        // Only features vhost-user.json defines for "block".
        for f in features {
            assert!(f == "read-only" || f == "blk-file", "{v}");
        }
        assert!(features.iter().any(|f| f == "read-only"), "{v}");
        assert!(!sock.exists(), "vzram {args:?} served a socket");
    }
    // The feature it names is a real flag: `--read-only` starts a
    // read-only device.
    let d = Daemon::start(
        &dir,
        &["--socket", s(&sock), "--size", "1M", "--read-only"],
        &[&sock],
    );
    let st = d.stat();
    assert!(st.devices()[0].readonly, "{st}");
}

/// A compaction asked for just as a frontend leaves (its worker going) is
/// carried out and counted. It used to answer "0 pages" there: skipped while
/// the worker was being reaped, or cut short by the worker's exit.
#[test]
fn compact_as_the_frontend_leaves_still_compacts() {
    let dir = TempDir::new("compactleave");
    let sock = dir.join("vm.sock");
    // Without staging: the worker compacts by itself once it has compressed
    // a burst's staged pages, and on a loaded host that can land after the
    // discards below and take the gain (loaded CI run 13: 0 pages in round
    // 19, the supervisor's compaction finding nothing left to do).
    let d = Daemon::start(
        &dir,
        &["--socket", s(&sock), "--size", "64M", "--staging", "0"],
        &[&sock],
    );
    // The window lasts from the worker seeing the frontend go until the
    // supervisor has reaped it (a few ms, more on a loaded host): rounds
    // land at points across it.
    for round in 0..24u64 {
        let delay_ms = round / 2;
        let mut c = Client::connect(&sock, 1).unwrap();
        for p in 0..2048u64 {
            let seed = round * 10_000 + p;
            c.q(0)
                .write(p * 4096, &pattern(seed, p * 4096, 4096))
                .unwrap();
        }
        // Three pages of every four go: their spans are left a quarter full.
        for p in (0..2048u64).filter(|p| p % 4 != 0) {
            c.q(0).discard(p * 4096, 4096).unwrap();
        }
        drop(c);
        std::thread::sleep(Duration::from_millis(delay_ms));
        let r = d.control(json!({"cmd": "compact"}));
        let Compacted {
            pages_compacted: pages,
        } = reply(r.clone());
        assert!(
            pages > 0,
            "round {round}: compaction as the frontend left did nothing: {r}\n{}",
            d.log_text()
        );
    }
}

/// `compact` of every device skips one that stays busy (here a frontend
/// that connected and says nothing) within a second or so, and still
/// compacts the others.
#[test]
fn compact_skips_a_busy_device_and_does_the_rest() {
    let dir = TempDir::new("compactbusy");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let dev = |p: &Path| format!("socket={},size=64M", s(p));
    let d = Daemon::start(
        &dir,
        &["--device", &dev(&a), "--device", &dev(&b)],
        &[&a, &b],
    );
    let mut c = Client::connect(&b, 1).unwrap();
    for p in 0..2048u64 {
        c.q(0).write(p * 4096, &pattern(p, p * 4096, 4096)).unwrap();
    }
    // The pages compressed (not staged any more), as they stay.
    d.settled();
    for p in (0..2048u64).filter(|p| p % 4 != 0) {
        c.q(0).discard(p * 4096, 4096).unwrap();
    }
    drop(c);
    // Device a: a frontend that connects and never speaks.
    let _silent = std::os::unix::net::UnixStream::connect(&a).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let t = std::time::Instant::now();
    let r: Compacted = d.request(json!({"cmd": "compact"}));
    let took = t.elapsed();
    assert!(r.pages_compacted > 0, "{r:?}");
    assert!(took < Duration::from_secs(4), "compact took {took:?}");
}

#[test]
fn stat_set_limit_and_compact_commands() {
    let dir = TempDir::new("stat");
    let sock = dir.join("vm1.sock");
    let d = Daemon::start(
        &dir,
        &[
            "--socket",
            s(&sock),
            "--size",
            "64M",
            "--name",
            "vm1",
            "--queues",
            "2",
        ],
        &[&sock],
    );
    let mut c = Client::connect(&sock, 2).unwrap();
    for p in 0..512u64 {
        c.q(0).write(p * 4096, &pattern(p, p * 4096, 4096)).unwrap();
    }
    c.q(1).write(4 << 20, &[0u8; 65536]).unwrap();
    let ctl = s(&d.control);

    // Staged pages compressed: sizes are what they stay.
    d.settled();
    let o = vzram(&["stat", "--control", ctl]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = String::from_utf8(o.stdout).unwrap();
    eprintln!("{table}");
    for col in [
        "ORIG_DATA",
        "COMPR_DATA",
        "MEM_USED",
        "RATIO",
        "SAME_PAGES",
        "READ_PAGES",
        "WRITE_PAGES",
        "DISCARD_PAGES",
    ] {
        assert!(table.contains(col), "no {col} column:\n{table}");
    }
    let row = table
        .lines()
        .find(|l| l.starts_with("vm1 "))
        .unwrap_or_else(|| panic!("no vm1 row:\n{table}"));
    // 512 pattern pages plus 16 zero pages.
    assert!(row.contains("2.1 MiB"), "orig data size in {row:?}");
    assert!(table.lines().any(|l| l.starts_with("(pool)")), "{table}");
    let io = table
        .lines()
        .filter(|l| l.starts_with("vm1 "))
        .nth(1)
        .expect("io_stat row");
    assert!(
        io.contains("64.0 MiB") && io.contains("lz4") && io.contains("yes"),
        "{io:?}"
    );

    let o = vzram(&["stat", "--json", "--control", ctl]);
    assert!(o.status.success());
    let v = Stats::parse(serde_json::from_slice(&o.stdout).unwrap());
    let dev = &v.devices()[0];
    assert_eq!(dev.name, "vm1");
    assert_eq!(dev.socket, sock);
    assert_eq!(dev.stats.orig_data_size, 528 * 4096);
    assert_eq!(dev.stats.same_pages, 16);
    assert!(dev.stats.compr_data_size < 512 * 4096, "{v}");
    assert_eq!(v.pool().devices, 1);

    let o = vzram(&["set-limit", "--control", ctl, "--device", "vm1", "32M"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(d.stat().counters("vm1").mem_limit, 32 << 20);
    // Above the device's 64 MiB: refused, the limit kept.
    let o = vzram(&["set-limit", "--control", ctl, "--device", "vm1", "512M"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("above its size"), "{}", stderr(&o));
    assert_eq!(d.stat().counters("vm1").mem_limit, 32 << 20);
    let o = vzram(&["set-limit", "--control", ctl, "--device", "0", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(d.stat().counters("vm1").mem_limit, 0);
    let o = vzram(&["set-limit", "--control", ctl, "--host", "1G"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(d.stat().pool().mem_limit, 1 << 30);
    let o = vzram(&["set-limit", "--control", ctl, "--device", "nosuch", "1G"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    // Readable, with the names that would have worked.
    assert_eq!(
        stderr(&o).trim_end(),
        "error: daemon refused: no device \"nosuch\"; devices (by name or index): vm1 (0)"
    );

    let o = vzram(&["compact", "--control", ctl]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("compacted"));

    // No daemon on that socket: a runtime failure, exit 1.
    let o = vzram(&["stat", "--control", s(&dir.join("nothing.sock"))]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("cannot talk to the daemon"));
}

#[test]
fn sigterm_and_sigint_exit_0_and_remove_the_sockets() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let dir = TempDir::new("sig");
        let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
        let mut d = Daemon::start(
            &dir,
            &[
                "--device",
                &format!("socket={},size=8M", s(&a)),
                "--device",
                &format!("socket={},size=8M", s(&b)),
            ],
            &[&a, &b],
        );
        // A connected client must not keep the daemon from exiting.
        let mut c = Client::connect(&a, 1).unwrap();
        c.q(0).write(0, &[7; 4096]).unwrap();
        let status = if sig == libc::SIGTERM {
            d.terminate()
        } else {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(d.pid() as libc::pid_t, sig) };
            d.terminate()
        };
        assert_eq!(status.code(), Some(0), "signal {sig}: {}", d.log_text());
        for p in [&a, &b, &d.control] {
            assert!(!p.exists(), "signal {sig}: {} left behind", p.display());
        }
        assert!(d.log_text().contains("shutting down"));
    }
}

#[test]
fn sockets_get_the_requested_mode() {
    let dir = TempDir::new("mode");
    let a = dir.join("a.sock");
    let d = Daemon::start(&dir, &["--socket", s(&a), "--size", "1M"], &[&a]);
    let mode = |p: &PathBuf| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&a), 0o600);
    assert_eq!(mode(&d.control), 0o600);
    drop(d);

    let dir = TempDir::new("mode2");
    let b = dir.join("b.sock");
    let d = Daemon::start(
        &dir,
        &["--socket", s(&b), "--size", "1M", "--socket-mode", "0660"],
        &[&b],
    );
    assert_eq!(mode(&b), 0o660);
    // The control socket changes limits: --socket-mode does not open it.
    assert_eq!(mode(&d.control), 0o600);
    drop(d);

    let dir = TempDir::new("mode3");
    let c = dir.join("c.sock");
    let d = Daemon::start(
        &dir,
        &["--socket", s(&c), "--size", "1M", "--control-mode", "0640"],
        &[&c],
    );
    assert_eq!(mode(&c), 0o600);
    assert_eq!(mode(&d.control), 0o640);
}

#[test]
fn config_file_with_two_devices() {
    let dir = TempDir::new("toml");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let cfg = dir.join("vzram.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
host_mem_limit = "256M"
socket_mode = "0640"

[[device]]
name = "swap1"
socket = "{}"
size = "64M"
queues = 2
algo = "zstd:3"
mem_limit = "32M"
serial = "swap-one"

[[device]]
name = "swap2"
socket = "{}"
size = 16777216
readonly = true
"#,
            s(&a),
            s(&b)
        ),
    )
    .unwrap();
    let d = Daemon::start(&dir, &["--config", s(&cfg)], &[&a, &b]);
    let st = d.stat();
    let devs = st.devices();
    assert_eq!(devs.len(), 2, "{st}");
    assert_eq!(devs[0].name, "swap1");
    assert_eq!(devs[0].algo.to_string(), "zstd:3");
    assert_eq!(devs[0].queues, 2);
    assert_eq!(devs[0].serial, "swap-one");
    assert_eq!(devs[0].stats.mem_limit, 32 << 20);
    assert_eq!(devs[1].size_bytes, 16 << 20);
    assert!(devs[1].readonly, "{st}");
    assert_eq!(devs[1].queues, 4);
    assert_eq!(st.pool().mem_limit, 256 << 20);
    assert_eq!(
        std::fs::metadata(&a).unwrap().permissions().mode() & 0o777,
        0o640
    );
    let mut c = Client::connect(&a, 2).unwrap();
    c.q(1).write(8192, &pattern(5, 8192, 8192)).unwrap();
    assert_eq!(c.q(0).read(8192, 8192).unwrap(), pattern(5, 8192, 8192));
}

#[test]
fn stale_socket_is_replaced_and_a_live_one_refused() {
    let dir = TempDir::new("stale");
    let sock = dir.join("d.sock");
    // A socket file nobody listens on, as a killed daemon leaves behind.
    drop(UnixListener::bind(&sock).unwrap());
    assert!(std::fs::metadata(&sock).unwrap().file_type().is_socket());
    let d = Daemon::start(&dir, &["--socket", s(&sock), "--size", "1M"], &[&sock]);
    let mut c = Client::connect(&sock, 1).unwrap();
    c.q(0).write(0, &[1; 4096]).unwrap();

    // A second daemon on the same socket must not steal it: a
    // configuration error, exit 2.
    let o = vzram(&["serve", "--socket", s(&sock), "--size", "1M"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("another process"), "{}", stderr(&o));
    assert_eq!(c.q(0).read(0, 4096).unwrap(), vec![1; 4096]);

    // A regular file in the way is not deleted.
    let file = dir.join("file");
    std::fs::write(&file, "keep me").unwrap();
    let o = vzram(&["serve", "--socket", s(&file), "--size", "1M"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
    drop(d);
}

/// Connects to the unix socket `path` from a forked child running as
/// `uid`/`gid` with no supplementary groups. Ok, or the errno of connect.
fn connect_as(uid: u32, gid: u32, path: &Path) -> Result<(), i32> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    assert!(bytes.len() < addr.sun_path.len(), "socket path too long");
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, &b) in addr.sun_path.iter_mut().zip(bytes) {
        *d = b as libc::c_char;
    }
    // SAFETY: the child runs only raw system calls and _exit, which are
    // async-signal-safe, so forking this multi-threaded test process is
    // sound; everything it needs (addr) was prepared before the fork. The
    // raw setgroups/setgid/setuid change the credentials of the calling
    // thread only, which in the child is the only thread.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: see above; addr lives on this (copied) stack.
        unsafe {
            if libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) != 0 {
                libc::_exit(101);
            }
            if libc::syscall(libc::SYS_setgid, gid) != 0 {
                libc::_exit(102);
            }
            if libc::syscall(libc::SYS_setuid, uid) != 0 {
                libc::_exit(103);
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            if fd < 0 {
                libc::_exit(104);
            }
            let rc = libc::connect(
                fd,
                (&addr as *const libc::sockaddr_un).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            );
            if rc == 0 {
                libc::_exit(0);
            }
            let e = *libc::__errno_location();
            libc::_exit(if (1..100).contains(&e) { e } else { 100 });
        }
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut status = 0;
    loop {
        // SAFETY: waiting for our own child; status is a valid out pointer.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        assert!(rc >= 0, "waitpid: {}", std::io::Error::last_os_error());
        if rc == pid {
            break;
        }
        if std::time::Instant::now() > deadline {
            // SAFETY: killing and reaping our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            panic!("connect as uid {uid} to {} hung", path.display());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(libc::WIFEXITED(status), "connect child died: {status:#x}");
    match libc::WEXITSTATUS(status) {
        0 => Ok(()),
        e @ 1..=99 => Err(e),
        step => panic!("connect child could not drop privileges or make a socket (exit {step})"),
    }
}

/// `socket_mode` in the config file is the mode the sockets get, and that
/// mode is what keeps other users out: an unprivileged user connects only
/// when the mode lets others write. (A TOML integer used to be re-read as
/// octal text, so `socket_mode = 0o660` made the sockets 0432, which lets
/// anyone connect, and `socket_mode = 0o600` was refused.)
#[test]
fn config_socket_mode_is_the_socket_mode_and_keeps_others_out() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: connecting as another user needs root");
        return;
    }
    const NOBODY: u32 = 65534;
    for (written, want, nobody_may_connect) in [
        ("0o600", 0o600, false),
        ("0o660", 0o660, false),
        ("0o666", 0o666, true),
        ("\"0660\"", 0o660, false),
        ("\"660\"", 0o660, false),
        ("\"0o666\"", 0o666, true),
    ] {
        let dir = TempDir::new("cmode");
        // Others may search the directory, so the socket's own mode decides.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let sock = dir.join("a.sock");
        let cfg = dir.join("vzram.toml");
        std::fs::write(
            &cfg,
            format!(
                "socket_mode = {written}\n[[device]]\nsocket = \"{}\"\nsize = \"1M\"\n",
                s(&sock)
            ),
        )
        .unwrap();
        let d = Daemon::start(&dir, &["--config", s(&cfg)], &[&sock]);
        // The control socket keeps its own mode (--control-mode, 0600).
        for (p, want, nobody_may_connect) in [
            (&sock, want, nobody_may_connect),
            (&d.control, 0o600, false),
        ] {
            let m = std::fs::metadata(p).unwrap();
            assert_eq!(
                m.permissions().mode() & 0o7777,
                want,
                "socket_mode = {written}: {} has mode {:o}",
                p.display(),
                m.permissions().mode() & 0o7777
            );
            // The group is root's, so 0o660 gives nobody nothing.
            assert_eq!(std::os::unix::fs::MetadataExt::gid(&m), 0);
            let got = connect_as(NOBODY, NOBODY, p);
            if nobody_may_connect {
                assert_eq!(
                    got,
                    Ok(()),
                    "socket_mode = {written}: uid {NOBODY} cannot connect to {}",
                    p.display()
                );
            } else {
                assert_eq!(
                    got,
                    Err(libc::EACCES),
                    "socket_mode = {written}: uid {NOBODY} and {}",
                    p.display()
                );
            }
        }
        // Root still gets in, and the daemon still serves.
        let mut c = Client::connect(&sock, 1).unwrap();
        c.q(0).write(0, &[9; 4096]).unwrap();
        assert_eq!(c.q(0).read(0, 4096).unwrap(), vec![9; 4096]);
    }
}

/// A decimal `socket_mode` is refused with a hint, not read as octal or
/// as a mode nobody meant.
#[test]
fn config_socket_mode_in_decimal_is_refused() {
    let dir = TempDir::new("cmodedec");
    let sock = dir.join("a.sock");
    for (written, hint) in [
        ("600", "0o600"),
        ("660", "0o660"),
        ("384", "0o600"),
        ("0o1777", "0o600"),
        ("-1", "0o600"),
        ("\"999\"", "0600"),
    ] {
        let cfg = dir.join("vzram.toml");
        std::fs::write(
            &cfg,
            format!(
                "socket_mode = {written}\n[[device]]\nsocket = \"{}\"\nsize = \"1M\"\n",
                s(&sock)
            ),
        )
        .unwrap();
        let o = vzram(&["serve", "--config", s(&cfg)]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "socket_mode = {written}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err:?}");
        assert!(
            err.contains("socket_mode") && err.contains(hint),
            "socket_mode = {written}: {err:?} does not suggest {hint}"
        );
        assert!(!sock.exists());
    }
}

/// Errors at run time print once (not also as a log line), on one line.
#[test]
fn runtime_errors_print_once() {
    let dir = TempDir::new("once");
    let missing = dir.join("no/such/dir/a.sock");
    let sock = dir.join("a.sock");
    for (args, code) in [
        (vec!["serve", "--socket", s(&missing), "--size", "1M"], 2),
        // Too large for its slot table: refused before anything is made.
        (vec!["serve", "--socket", s(&sock), "--size", "100T"], 2),
    ] {
        let o = vzram(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(code), "vzram {args:?}: {err}");
        let errors: Vec<&str> = err
            .lines()
            .filter(|l| l.contains("ERROR") || l.starts_with("error:"))
            .collect();
        assert_eq!(errors.len(), 1, "vzram {args:?}: {err}");
        assert!(errors[0].starts_with("error:"), "{err}");
    }
}

#[test]
fn sizes_take_fractions_and_binary_suffixes() {
    let dir = TempDir::new("sizes");
    let a = dir.join("a.sock");
    let b = dir.join("b.sock");
    let d = Daemon::start(
        &dir,
        &[
            "--device",
            &format!("socket={},size=1.5M,name=a,mem-limit=0.5Mi", s(&a)),
            "--device",
            &format!("socket={},size=8Mi,name=b", s(&b)),
        ],
        &[&a, &b],
    );
    let st = d.stat();
    assert_eq!(st.counters("a").size_bytes, 3 << 19);
    assert_eq!(st.counters("a").mem_limit, 1 << 19);
    assert_eq!(st.counters("b").size_bytes, 8 << 20);
}

/// `vzram stat` without `--control` asks $RUNTIME_DIRECTORY/control.sock,
/// else /run/vzram/control.sock (`operator.rs` has `$VZRAM_CONTROL` too).
#[test]
fn stat_has_a_default_control_socket() {
    let dir = TempDir::new("defctl");
    let a = dir.join("a.sock");
    let _d = Daemon::start(&dir, &["--socket", s(&a), "--size", "1M"], &[&a]);
    let o = Vzram::new(&["stat", "--json"])
        .env("RUNTIME_DIRECTORY", dir.path())
        .env_remove("VZRAM_CONTROL")
        .output();
    assert!(o.status.success(), "{}", stderr(&o));
    let v = Stats::parse(serde_json::from_slice(&o.stdout).unwrap());
    assert_eq!(v.devices()[0].socket, a);
    let o = Vzram::new(&["compact"])
        .env("RUNTIME_DIRECTORY", dir.path())
        .env_remove("VZRAM_CONTROL")
        .output();
    assert!(o.status.success(), "{}", stderr(&o));
    if !Path::new("/run/vzram/control.sock").exists() {
        let o = Vzram::new(&["stat"])
            .env_remove("RUNTIME_DIRECTORY")
            .env_remove("VZRAM_CONTROL")
            .output();
        assert_eq!(o.status.code(), Some(1));
        assert!(
            stderr(&o).contains("/run/vzram/control.sock"),
            "{}",
            stderr(&o)
        );
    }
}

/// `--log-level` filters the daemon's log; RUST_LOG, when set, wins.
#[test]
fn log_level_flag_and_rust_log() {
    for (level, rust_log, info_shown) in [
        (None, None, true),
        (Some("warn"), None, false),
        (Some("warn"), Some("info"), true),
        (Some("debug"), Some("error"), false),
    ] {
        let dir = TempDir::new("loglevel");
        let a = dir.join("a.sock");
        let log = dir.join("log");
        let mut cmd = Command::new(vzram_bin());
        cmd.args(["serve", "--size", "1M", "--socket"])
            .arg(&a)
            .arg("--control")
            .arg(dir.join("control.sock"))
            .env("VZRAM_STATE_DIR", state_dir_for(dir.path()))
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if let Some(l) = level {
            cmd.args(["--log-level", l]);
        }
        if let Some(r) = rust_log {
            cmd.env("RUST_LOG", r);
        }
        let mut child = cmd.spawn().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !a.exists() {
            assert!(std::time::Instant::now() < deadline, "no socket");
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        assert!(child.wait().unwrap().success());
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(
            text.contains(" INFO ") && text.contains("shutting down"),
            info_shown,
            "--log-level {level:?}, RUST_LOG={rust_log:?}:\n{text}"
        );
    }
}
