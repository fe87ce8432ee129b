//! A running `vzram serve`: start it, talk to it over its control socket
//! or through the `vzram` CLI, and stop it the ways a host does (SIGTERM,
//! SIGKILL). The integration tests start it with [`Daemon::start`] or
//! [`Daemon::start_command`]; the end-to-end tests through
//! [`crate::guest::Ctx::daemon`].

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde_json::{json, Value};
pub use vzram::proto::control::{
    parse_reply, Added, Compacted, DeviceLimitSet, Done, HostLimitSet, MarkedIdle, Migrated,
    Recompressed, Removed, ReplyError, Reset, WrittenBack,
};

use crate::cli::{said, Vzram};
use crate::paths::{state_dir_for, vzram_bin, TempDir};
use crate::stats::Stats;

/// How dropping a [`Daemon`] stops it. The default is the integration
/// tests' way; [`crate::guest::Ctx`] sets it.
#[derive(Clone, Copy, Debug, Default)]
pub struct DaemonOpts {
    /// Dropping it sends SIGTERM and waits 5 s for the exit before SIGKILL,
    /// instead of SIGKILL at once.
    pub term_on_drop: bool,
}

/// A running `vzram serve` with a control socket; stopped on drop (see
/// [`DaemonOpts::term_on_drop`]).
pub struct Daemon {
    child: Option<Child>,
    pub control: PathBuf,
    pub sockets: Vec<PathBuf>,
    pub log: PathBuf,
    /// The `serve` arguments before `--control`, to start it again with
    /// (empty when it was started from a whole command line).
    args: Vec<String>,
    /// How it was started, for a failure's message.
    cmdline: String,
    opts: DaemonOpts,
}

impl Daemon {
    /// Starts `vzram serve ARGS --control DIR/control.sock` and waits until
    /// the control socket and every socket in `sockets` exist.
    pub fn start(dir: &TempDir, args: &[&str], sockets: &[&Path]) -> Daemon {
        let control = dir.join("control.sock");
        static N: AtomicU64 = AtomicU64::new(0);
        let log = dir.join(&format!("daemon-{}.log", N.fetch_add(1, Ordering::Relaxed)));
        let mut cmd = Command::new(vzram_bin());
        cmd.arg("serve").args(args).arg("--control").arg(&control);
        let mut d = Daemon::start_command(cmd, &control, &log, sockets);
        d.args = args.iter().map(|a| a.to_string()).collect();
        d
    }

    /// Runs `cmd`, a `vzram serve ...` command line that names its control
    /// socket `control` (possibly behind a wrapper that execs the daemon in
    /// place, such as `setpriv --reuid=...`, so that [`Daemon::pid`] stays
    /// the daemon's), with its output in `log`; waits until `control` and
    /// every socket in `sockets` exist.
    pub fn start_command(cmd: Command, control: &Path, log: &Path, sockets: &[&Path]) -> Daemon {
        Daemon::start_with(cmd, control, log, sockets, DaemonOpts::default())
    }

    /// [`Daemon::start_command`] with `opts`. Its device state lives in
    /// [`state_dir_for`] the control socket's directory (`VZRAM_STATE_DIR`).
    pub fn start_with(
        cmd: Command,
        control: &Path,
        log: &Path,
        sockets: &[&Path],
        opts: DaemonOpts,
    ) -> Daemon {
        let mut d = Daemon::spawn(cmd, control, log, sockets, opts);
        d.wait_serving();
        d
    }

    /// [`Daemon::start_with`] without waiting: for a daemon whose control
    /// socket is known only once its pid is (set `control`, then
    /// [`Daemon::wait_serving`]).
    pub fn spawn(
        mut cmd: Command,
        control: &Path,
        log: &Path,
        sockets: &[&Path],
        opts: DaemonOpts,
    ) -> Daemon {
        let log_file = std::fs::File::create(log).expect("create daemon log");
        if let Some(dir) = control.parent() {
            cmd.env("VZRAM_STATE_DIR", state_dir_for(dir));
        }
        let cmdline = format!("{cmd:?}");
        let child = cmd
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("dup log"))
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        Daemon {
            child: Some(child),
            control: control.to_path_buf(),
            sockets: sockets.iter().map(|p| p.to_path_buf()).collect(),
            log: log.to_path_buf(),
            args: Vec::new(),
            cmdline,
            opts,
        }
    }

    /// Waits 20 s at most until [`Daemon::serving`]; panics if the daemon
    /// exits first.
    pub fn wait_serving(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if self.serving() {
                return;
            }
            if let Some(st) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "vzram exited early ({st}): {}\n{}",
                    self.cmdline,
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "vzram not serving after 20 s: {}\n{}",
                self.cmdline,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether every socket listens and the control socket answers a
    /// request. A socket file alone is not enough: bind() makes it before
    /// listen() runs, and a connect in between is refused (a loaded CI run
    /// failed so, right after the daemon's "control socket ready"). Nor is
    /// listening: the daemon listens before it opens any state, so a test
    /// that looked at the state then saw it as it was before the start (a
    /// loaded CI run read a state dir's mode before the daemon closed it).
    /// A request is answered only once every device is set up.
    fn serving(&self) -> bool {
        let listening = listening_unix_sockets();
        // A path reached through /proc/PID/root (a daemon in a private
        // mount namespace) is bound as the rest of it.
        let listens = |p: &Path| {
            if listening.contains(p) {
                return true;
            }
            let mut parts = p.iter().skip(1);
            let proc_root = parts.next() == Some("proc".as_ref())
                && parts.next().is_some()
                && parts.next() == Some("root".as_ref());
            proc_root && listening.contains(&Path::new("/").join(parts.collect::<PathBuf>()))
        };
        self.sockets.iter().all(|s| listens(s)) && answers(&self.control)
    }

    /// The `serve` arguments it was started with, before `--control`
    /// (empty after [`Daemon::start_command`]).
    pub fn args(&self) -> &[String] {
        &self.args
    }

    pub(crate) fn set_args(&mut self, args: Vec<String>) {
        self.args = args;
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the log says `needle` within 20 s: the control socket is
    /// bound before the last start-up lines are written (the seccomp
    /// filter's, for one), and a busy host may be slow between them.
    pub fn wait_log(&self, needle: &str) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if self.log_text().contains(needle) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the daemon has exited (and been reaped, or can be now).
    pub fn has_exited(&mut self) -> bool {
        match self.child.as_mut() {
            None => true,
            Some(c) => c.try_wait().expect("wait for vzram").is_some(),
        }
    }

    /// Panics if the daemon has exited.
    pub fn assert_alive(&mut self) {
        let child = self.child.as_mut().expect("daemon already stopped");
        if let Some(st) = child.try_wait().expect("wait for vzram") {
            panic!("the daemon died ({st}); see its log:\n{}", self.log_text());
        }
    }

    /// Sends one control request and returns the reply as it came: for
    /// the tests of the wire format itself (refusals, their `"error"`).
    pub fn control(&self, req: Value) -> Value {
        control_request(&self.control, &req)
    }

    /// Sends one control request that must succeed, and reads its reply
    /// into `T` (one of the [`vzram::proto::control`] replies); panics,
    /// naming the request and the reply, on a refusal or a missing field.
    pub fn request<T: DeserializeOwned>(&self, req: Value) -> T {
        request_at(&self.control, req)
    }

    /// `{"cmd":"stat"}`, which must succeed.
    pub fn stat(&self) -> Stats {
        Stats(self.request(json!({"cmd": "stat"})))
    }

    /// `stat` once no device has staged pages left (stored raw by a write,
    /// waiting for its worker's compress threads): memory and sizes are
    /// then what they stay. Waits 30 s at most, then fails with the stat.
    pub fn settled(&self) -> Stats {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let st = self.stat();
            if st.devices().iter().all(|d| d.stats.staged_bytes == 0) {
                return st;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "staged pages not compressed in 30 s: {st}\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The pid of the worker serving device `name` (None: the sole
    /// device). The supervisor hears it from the launcher, which on a busy
    /// machine may come after the worker has served: waits up to 20 s.
    pub fn worker_pid_of(&self, name: Option<&str>) -> u32 {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let st = self.stat();
            let w = match name {
                Some(n) => st.worker(n),
                None => &st.sole().worker,
            };
            if let Some(pid) = w.pid {
                return pid;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no worker pid for {name:?} in 20 s: {st}\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// [`Daemon::worker_pid_of`] device `name`.
    pub fn worker_pid(&self, name: &str) -> u32 {
        self.worker_pid_of(Some(name))
    }

    /// [`Daemon::worker_pid_of`] the sole device.
    pub fn sole_worker_pid(&self) -> u32 {
        self.worker_pid_of(None)
    }

    /// `/proc/PID/task/TID` of the sole device's worker's
    /// `vzram-compress-*` threads (the compress pool).
    pub fn compress_tasks(&self) -> Vec<PathBuf> {
        let pid = self.sole_worker_pid();
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
            .map(|t| t.path())
            .filter(|t| {
                std::fs::read_to_string(t.join("comm"))
                    .is_ok_and(|c| c.starts_with("vzram-compress"))
            })
            .collect()
    }

    /// Times the compress pool's threads went to sleep: it grows only when
    /// a submission woke them (CPU ticks are too coarse, and schedstat is
    /// off on some kernels).
    pub fn pool_sleeps(&self) -> u64 {
        self.compress_tasks()
            .into_iter()
            .filter_map(|t| {
                let st = std::fs::read_to_string(t.join("status")).ok()?;
                st.lines()
                    .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            })
            .sum()
    }

    /// `vzram stat --json`, as an operator reads it, parsed; the daemon
    /// must be alive and the command succeed.
    pub fn stat_cli(&mut self) -> Stats {
        let text = self.cli(&["stat", "--json"]);
        let json: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("vzram stat --json: bad JSON ({e}): {text}"));
        Stats::parse(json)
    }

    /// `vzram ARGS --control CTL`, as it came.
    pub fn vzram(&self, args: &[&str]) -> Output {
        Vzram::new(args).control(&self.control).output()
    }

    /// `vzram ARGS --control CTL`, which must succeed (the failure shows
    /// the daemon's log); its stdout.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        let out = self.vzram(args);
        assert!(
            out.status.success(),
            "vzram {args:?} failed ({}): {}\nthe daemon's log:\n{}",
            out.status,
            said(&out),
            self.log_text()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// [`Daemon::cli_ok`] of a daemon that must be alive; its stdout
    /// trimmed.
    pub fn cli(&mut self, args: &[&str]) -> String {
        self.assert_alive();
        self.cli_ok(args).trim().to_string()
    }

    /// `vzram compact`; returns its output line.
    pub fn compact(&mut self) -> String {
        self.cli(&["compact"])
    }

    /// Waits up to `timeout` for the daemon to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut()?;
        loop {
            if let Some(st) = child.try_wait().expect("wait for vzram") {
                self.child = None;
                return Some(st);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, as a crash or the OOM killer would: no clean-up at all.
    /// The daemon must be alive, and be gone by that signal within 10 s.
    /// See [`crate::guest::Ctx::restart`].
    pub fn kill9(&mut self) {
        self.assert_alive();
        // SAFETY: a signal to our own child, which has not been reaped.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGKILL) };
        let st = self
            .wait_exit(Duration::from_secs(10))
            .expect("daemon still there 10 s after SIGKILL");
        assert_eq!(
            st.signal(),
            Some(libc::SIGKILL),
            "daemon ended with {st}, not by SIGKILL"
        );
    }

    /// SIGKILL to the daemon and every process it started, then a wait
    /// (10 s at most) until all are gone: a killed worker tearing down its
    /// mappings still holds its state's lock for a moment, and systemd too
    /// waits for the whole cgroup before a restart.
    pub fn kill9_tree(&mut self) {
        let tree = crate::procs::process_tree(self.pid());
        for &p in &tree {
            // SAFETY: signals to the daemon's own processes.
            unsafe { libc::kill(p as libc::pid_t, libc::SIGKILL) };
        }
        let _ = self.wait_exit(Duration::from_secs(10));
        let gone = |p: &u32| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).map_or(true, |st| {
                st.rsplit(") ").next().is_some_and(|r| r.starts_with('Z'))
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !tree.iter().all(gone) {
            assert!(Instant::now() < deadline, "killed processes stay");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGTERM, then waits (10 s at most) for the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("daemon already stopped");
        // SAFETY: kill only sends a signal to our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(st) = child.try_wait().expect("wait for vzram") {
                return st;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "vzram did not exit within 10 s of SIGTERM:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, as `systemctl stop` or an upgrade sends it: the daemon must
    /// exit 0 within 10 s and remove its sockets. See
    /// [`crate::guest::Ctx::restart`].
    pub fn terminate_cleanly(&mut self) {
        let st = self.terminate();
        assert!(st.success(), "daemon exited with {st} after SIGTERM");
        for s in self.sockets.iter().chain([&self.control]) {
            assert!(
                !s.exists(),
                "daemon left {} behind after SIGTERM",
                s.display()
            );
        }
    }

    /// [`Daemon::terminate_cleanly`], and done with it.
    pub fn shutdown(mut self) {
        self.terminate_cleanly();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // A failing test says what the daemon logged: an EIO under load
        // has its cause there (`request failed: ...`), and the test's
        // directory is gone once it ends.
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = &lines[lines.len().saturating_sub(60)..];
            eprintln!(
                "--- the last {} lines of {} ---\n{}\n---",
                tail.len(),
                self.log.display(),
                tail.join("\n")
            );
        }
        let Some(mut c) = self.child.take() else {
            return;
        };
        if self.opts.term_on_drop {
            if let Ok(None) = c.try_wait() {
                // SAFETY: a signal to our own child, which has not been reaped.
                unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
                let deadline = Instant::now() + Duration::from_secs(5);
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = c.try_wait() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            } else {
                return;
            }
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Runs `vzram serve ARGS`, which must refuse to start: its output (the
/// test fails if it is still running after 10 s). Its control socket, unless
/// ARGS name one, is `DIR/refused.ctl` (`VZRAM_CONTROL`): not that of a
/// [`Daemon`] running for `dir`, which would stop it first.
pub fn serve_refused(dir: &TempDir, args: &[&str]) -> Output {
    Vzram::new(&["serve"])
        .args(args)
        .env("VZRAM_STATE_DIR", state_dir_for(dir.path()))
        .env("VZRAM_CONTROL", dir.join("refused.ctl"))
        .limit(Duration::from_secs(10))
        .output()
}

/// A reply line read into `T`; panics, naming the reply, when it is a
/// refusal (`"ok":false`) or lacks one of `T`'s fields.
pub fn reply<T: DeserializeOwned>(v: Value) -> T {
    let text = v.to_string();
    parse_reply(v).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// The paths of the unix sockets that listen now, from /proc/net/unix
/// (columns: Num RefCount Protocol Flags Type St Inode Path; a listening
/// socket has __SO_ACCEPTCON, 0x10000, in Flags).
pub fn listening_unix_sockets() -> std::collections::HashSet<PathBuf> {
    let text = std::fs::read_to_string("/proc/net/unix").expect("/proc/net/unix");
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let flags = u32::from_str_radix(f.get(3)?, 16).ok()?;
            (f.len() >= 8 && flags & 0x10000 != 0).then(|| PathBuf::from(f[7]))
        })
        .collect()
}

/// Whether the control socket at `path` answers a `stat` within a second
/// (it waits in the backlog while the daemon sets up its devices).
fn answers(path: &Path) -> bool {
    let Ok(mut s) = UnixStream::connect(path) else {
        return false;
    };
    let mut line = String::new();
    s.set_read_timeout(Some(Duration::from_secs(1))).is_ok()
        && writeln!(s, "{}", json!({"cmd": "stat"})).is_ok()
        && BufReader::new(&s).read_line(&mut line).is_ok_and(|n| n > 0)
}

/// [`Daemon::request`] on the control socket at `path`.
pub fn request_at<T: DeserializeOwned>(path: &Path, req: Value) -> T {
    let v = control_request(path, &req);
    let text = v.to_string();
    parse_reply(v).unwrap_or_else(|e| panic!("{req}: {e}: {text}"))
}

/// One request on a control socket; the reply as it came.
pub fn control_request(path: &Path, req: &Value) -> Value {
    let mut s =
        UnixStream::connect(path).unwrap_or_else(|e| panic!("connect {}: {e}", path.display()));
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    writeln!(s, "{req}").unwrap();
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad control reply {line:?}: {e}"))
}
