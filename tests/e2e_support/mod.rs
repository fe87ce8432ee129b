//! Harness for the end-to-end tests (`tests/e2e*.rs`): finds QEMU, the test
//! guest (`contrib/guest/`) and the `vzram` binary, and wraps the daemon and
//! each QEMU guest in guards that kill them and clean up on drop.
//!
//! Each test builds a [`Ctx`] first. It serialises the tests (every boot
//! is a CPU-heavy TCG guest), owns the test's temporary directory, and, when
//! the test panics, prints the tail of every guest and daemon log and keeps
//! the directory for a post-mortem.

// Each test binary uses part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use serde_json::Value;
use vzram_tests::root;

pub const MIB: u64 = 1 << 20;
/// How long a booting guest may take to start its init (it takes 1-3 s).
const INIT_WAIT: Duration = Duration::from_secs(60);

/// Fail the test with a message; [`Ctx`] then prints the logs.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        let ok: bool = $cond;
        if !ok {
            panic!("{}: {}", stringify!($cond), format!($($fmt)+));
        }
    };
}

fn qemu_binary() -> String {
    std::env::var("QEMU").unwrap_or_else(|_| "qemu-system-x86_64".to_string())
}

/// Whether `prog` names an executable file, directly or on `PATH`.
fn on_path(prog: &str) -> bool {
    let is_exe = |p: &Path| fs::metadata(p).map(|m| m.is_file()).unwrap_or(false);
    if prog.contains('/') {
        return is_exe(Path::new(prog));
    }
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|d| is_exe(&d.join(prog))))
        .unwrap_or(false)
}

/// The tests serialise on this: two TCG guests at once on a small CI
/// machine make every timeout meaningless.
static SERIAL: Mutex<()> = Mutex::new(());

static GUEST_BUILT: OnceLock<Result<(), String>> = OnceLock::new();

/// Builds (or confirms the cache of) the test guest, once per process.
fn build_guest() -> Result<(), String> {
    GUEST_BUILT
        .get_or_init(|| {
            let t = Instant::now();
            let out = Command::new(root().join("contrib/guest/build.sh"))
                .stdin(Stdio::null())
                .output()
                .map_err(|e| format!("cannot run contrib/guest/build.sh: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "contrib/guest/build.sh failed ({}):\n{}{}",
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            eprintln!("e2e: guest ready in {:.1}s", t.elapsed().as_secs_f64());
            Ok(())
        })
        .clone()
}

/// Per-test context. Create it first in each test so that it drops last.
pub struct Ctx {
    pub name: &'static str,
    pub dir: PathBuf,
    pub bin: PathBuf,
    started: Instant,
    logs: Mutex<Vec<(String, PathBuf)>>,
    daemons: AtomicU32,
    _serial: MutexGuard<'static, ()>,
}

impl Ctx {
    /// `None` when the test should be skipped: QEMU is missing and
    /// `VZRAM_E2E` is unset. With `VZRAM_E2E` set, a missing QEMU fails.
    pub fn new(name: &'static str) -> Option<Ctx> {
        let qemu = qemu_binary();
        if !on_path(&qemu) {
            if std::env::var_os("VZRAM_E2E").is_some() {
                panic!("e2e {name}: VZRAM_E2E is set but {qemu} was not found");
            }
            eprintln!(
                "e2e {name}: SKIPPED: {qemu} not found (set VZRAM_E2E=1 to make this a failure)"
            );
            return None;
        }
        let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = build_guest() {
            panic!("e2e {name}: {e}");
        }
        let bin = vzram_tests::vzram_bin();
        let mut base = std::env::temp_dir();
        if base.as_os_str().len() > 40 {
            // Unix socket paths are limited to 108 bytes.
            base = PathBuf::from("/tmp");
        }
        let dir = base.join(format!("vzram-e2e-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let _ = fs::remove_dir_all(vzram_tests::state_dir_for(&dir));
        fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("e2e {name}: mkdir {}: {e}", dir.display()));
        eprintln!("e2e {name}: start (dir {})", dir.display());
        Some(Ctx {
            name,
            dir,
            bin,
            started: Instant::now(),
            logs: Mutex::new(Vec::new()),
            daemons: AtomicU32::new(0),
            _serial: serial,
        })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn add_log(&self, what: String, path: PathBuf) {
        self.logs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((what, path));
    }

    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Starts `vzram serve` with `args` (sockets and sizes; `--control` is
    /// added) and waits until it serves. `sockets` are the vhost-user
    /// sockets it must create. Its device state lives in
    /// [`vzram_tests::state_dir_for`] the test directory (`VZRAM_STATE_DIR`).
    pub fn daemon(&self, args: &[String], sockets: &[&Path]) -> Daemon {
        self.daemon_at("vzram.ctl", args, sockets)
    }

    /// [`Ctx::daemon`] with its own control socket (named `control` in the
    /// test directory): a second daemon beside the first, as on another
    /// host. Both keep their state in the test's state directory, so their
    /// devices need distinct names.
    pub fn daemon_at(&self, control: &str, args: &[String], sockets: &[&Path]) -> Daemon {
        let n = self.daemons.fetch_add(1, Ordering::Relaxed) + 1;
        let control = self.path(control);
        // The first daemon logs to vzram.log, a restarted one to vzram-N.log.
        let log = if n == 1 {
            self.path("vzram.log")
        } else {
            self.path(&format!("vzram-{n}.log"))
        };
        let mut cmd = Command::new(&self.bin);
        cmd.arg("serve").args(args).arg("--control").arg(&control);
        cmd.env("VZRAM_STATE_DIR", vzram_tests::state_dir_for(&self.dir));
        let cmdline = format!("{cmd:?}");
        eprintln!("e2e {}: {cmdline}", self.name);
        let logf = File::create(&log).expect("create daemon log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(logf.try_clone().expect("dup log"))
            .stderr(logf)
            .env("NO_COLOR", "1")
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.bin.display()));
        self.add_log(
            if n == 1 {
                "daemon".into()
            } else {
                format!("daemon #{n}")
            },
            log.clone(),
        );
        let mut d = Daemon {
            child,
            bin: self.bin.clone(),
            args: args.to_vec(),
            control,
            log,
            sockets: sockets.iter().map(|s| s.to_path_buf()).collect(),
        };
        // A killed daemon leaves its socket files behind (the new one
        // replaces them), so a file is no sign of life: the control socket
        // is, bound last, once every device is set up and listening.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = d.child.try_wait().expect("try_wait") {
                panic!("daemon exited during startup ({st}): {cmdline}");
            }
            if d.sockets.iter().all(|s| s.exists()) && UnixStream::connect(&d.control).is_ok() {
                break;
            }
            ensure!(
                Instant::now() < deadline,
                "daemon not serving after 20s: {cmdline}"
            );
            thread::sleep(Duration::from_millis(20));
        }
        d
    }

    /// Starts `old`'s command line again, as a restart or an upgrade would,
    /// once `old` has exited ([`Daemon::kill`], [`Daemon::terminate`]): the
    /// same sockets, control socket and state directory.
    pub fn restart(&self, old: &mut Daemon) -> Daemon {
        ensure!(
            old.child.try_wait().expect("try_wait").is_some(),
            "restart: the old daemon (pid {}) is still running",
            old.pid()
        );
        let sockets: Vec<&Path> = old.sockets.iter().map(PathBuf::as_path).collect();
        let control = old.control.file_name().expect("control socket name");
        self.daemon_at(&control.to_string_lossy(), &old.args, &sockets)
    }

    /// Boots a guest; it runs in the background until [`Guest::wait`].
    /// Unless QEMU waits for an incoming migration, checks that the guest's
    /// init starts: a boot whose kernel shows nothing for [`INIT_WAIT`] is
    /// dumped (`hang-LABEL.txt`), killed and started once more. Before
    /// init the guest has not loaded its virtio drivers, so such a hang is
    /// the emulated machine's, not the disk's: under QEMU 7.2's TCG a boot
    /// here froze there now and then (three CI runs), both vCPUs running
    /// guest code and vzram idle in the one with a thread dump.
    pub fn boot(&self, label: &str, opts: &GuestOpts) -> Guest {
        let g = self.boot_once(label, opts);
        if opts.qemu_args.iter().any(|a| a == "-incoming") || g.reached_init(INIT_WAIT) {
            return g;
        }
        if let Some(c) = &g.child {
            g.report_hang(c.id());
        }
        eprintln!(
            "e2e {}: guest {label}: no VZRAM-INIT line in {}s (the kernel hung before init; the disk was not in use yet); booting it once more",
            self.name,
            INIT_WAIT.as_secs()
        );
        drop(g);
        self.boot_once(&format!("{label}-again"), opts)
    }

    fn boot_once(&self, label: &str, opts: &GuestOpts) -> Guest {
        let log = self.path(&format!("guest-{label}.log"));
        let mut cmd = Command::new(root().join("contrib/guest/run.sh"));
        cmd.arg("--socket").arg(&opts.socket).args([
            "--mem",
            &opts.mem,
            "--queues",
            &opts.queues.to_string(),
            "--test",
            &opts.tests,
            "--reconnect",
            &opts.reconnect.to_string(),
        ]);
        if !opts.append.is_empty() {
            cmd.args(["--append", &opts.append.join(" ")]);
        }
        for a in &opts.qemu_args {
            cmd.args(["--qemu-arg", a]);
        }
        eprintln!(
            "e2e {}: boot {label}: --test {} --queues {} --mem {} --reconnect {} {}",
            self.name,
            opts.tests,
            opts.queues,
            opts.mem,
            opts.reconnect,
            opts.append.join(" ")
        );
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn contrib/guest/run.sh");
        self.add_log(format!("guest {label}"), log.clone());
        let shared = Arc::new(Shared::default());
        let logf = Arc::new(Mutex::new(File::create(&log).expect("create guest log")));
        let readers = vec![
            reader(
                child.stdout.take().expect("stdout"),
                "",
                shared.clone(),
                logf.clone(),
            ),
            reader(
                child.stderr.take().expect("stderr"),
                "qemu-stderr: ",
                shared.clone(),
                logf,
            ),
        ];
        Guest {
            label: label.to_string(),
            dir: self.dir.clone(),
            child: Some(child),
            shared,
            readers,
            started: Instant::now(),
        }
    }

    /// Boots a guest and waits until it powers off.
    pub fn run_guest(&self, label: &str, opts: &GuestOpts, timeout: Duration) -> GuestOutput {
        self.boot(label, opts).wait(timeout)
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        let secs = self.elapsed();
        if thread::panicking() {
            let logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
            for (what, path) in logs.iter() {
                eprintln!("----- {what}: last lines of {} -----", path.display());
                eprintln!("{}", tail_of_file(path, 60));
            }
            eprintln!(
                "e2e {}: FAILED after {secs:.1}s; kept {}",
                self.name,
                self.dir.display()
            );
        } else {
            eprintln!("e2e {}: wall {secs:.1}s", self.name);
            let _ = fs::remove_dir_all(&self.dir);
            let _ = fs::remove_dir_all(vzram_tests::state_dir_for(&self.dir));
        }
    }
}

fn tail_of_file(path: &Path, n: usize) -> String {
    let mut s = String::new();
    if let Ok(mut f) = File::open(path) {
        let mut b = Vec::new();
        let _ = f.read_to_end(&mut b);
        s = String::from_utf8_lossy(&b).into_owned();
    }
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| l.trim_end_matches('\r'))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A running `vzram serve`. Dropping it stops it (SIGTERM, then SIGKILL).
pub struct Daemon {
    child: Child,
    bin: PathBuf,
    args: Vec<String>,
    pub control: PathBuf,
    pub log: PathBuf,
    sockets: Vec<PathBuf>,
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        if Instant::now() >= deadline {
            return None;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

impl Daemon {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Panics if the daemon has exited.
    pub fn assert_alive(&mut self) {
        if let Some(st) = self.child.try_wait().expect("try_wait") {
            panic!("the daemon died ({st}); see its log");
        }
    }

    /// `vzram stat --json`, parsed.
    pub fn stat(&mut self) -> Stats {
        self.assert_alive();
        let out = Command::new(&self.bin)
            .args(["stat", "--json", "--control"])
            .arg(&self.control)
            .stdin(Stdio::null())
            .output()
            .expect("run vzram stat");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        ensure!(
            out.status.success(),
            "vzram stat --json failed ({}): {}{}",
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        );
        let json: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("vzram stat --json: bad JSON ({e}): {text}"));
        Stats { json }
    }

    /// `vzram compact`; returns its output line.
    pub fn compact(&mut self) -> String {
        self.cli(&["compact"])
    }

    /// `vzram ARGS --control CTL`, which must succeed; returns its output.
    pub fn cli(&mut self, args: &[&str]) -> String {
        self.assert_alive();
        let out = Command::new(&self.bin)
            .args(args)
            .arg("--control")
            .arg(&self.control)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run vzram {args:?}: {e}"));
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        ensure!(
            out.status.success(),
            "vzram {args:?} failed ({}): {text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        text
    }

    /// SIGTERM; the daemon must exit 0 within 10 s and remove its sockets.
    pub fn shutdown(mut self) {
        self.terminate();
    }

    /// SIGTERM, as `systemctl stop` or an upgrade sends it: the daemon must
    /// exit 0 within 10 s and remove its sockets. See [`Ctx::restart`].
    pub fn terminate(&mut self) {
        signal(self.child.id(), "-TERM");
        let st = wait_timeout(&mut self.child, Duration::from_secs(10));
        ensure!(st.is_some(), "daemon still running 10s after SIGTERM");
        let st = st.unwrap_or_else(|| unreachable!());
        ensure!(st.success(), "daemon exited with {st} after SIGTERM");
        for s in self.sockets.iter().chain([&self.control]) {
            ensure!(
                !s.exists(),
                "daemon left {} behind after SIGTERM",
                s.display()
            );
        }
    }

    /// SIGKILL, as a crash or the OOM killer would: no clean-up at all.
    /// Returns once the process is gone. See [`Ctx::restart`].
    pub fn kill(&mut self) {
        self.assert_alive();
        let _ = self.child.kill();
        let st = wait_timeout(&mut self.child, Duration::from_secs(10));
        ensure!(st.is_some(), "daemon still there 10s after SIGKILL");
        let st = st.unwrap_or_else(|| unreachable!());
        ensure!(
            st.signal() == Some(libc::SIGKILL),
            "daemon ended with {st}, not by SIGKILL"
        );
    }

    /// The daemon's log so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            signal(self.child.id(), "-TERM");
            if wait_timeout(&mut self.child, Duration::from_secs(5)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
    }
}

/// `vzram stat --json`. The accessors find a device by its socket path
/// (or index) and the pool, and read one counter as `u64`.
#[derive(Clone, Debug)]
pub struct Stats {
    pub json: Value,
}

impl Stats {
    pub fn devices(&self) -> &[Value] {
        self.json
            .get("devices")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_else(|| panic!("no devices array in stat JSON: {}", self.json))
    }

    /// The device whose socket is `socket`.
    pub fn device(&self, socket: &Path) -> Counters<'_> {
        let want = socket.to_string_lossy();
        let d = self
            .devices()
            .iter()
            .find(|d| d.get("socket").and_then(Value::as_str) == Some(&want))
            .unwrap_or_else(|| panic!("no device with socket {want} in stat JSON: {}", self.json));
        Counters {
            v: d,
            what: "device",
        }
    }

    pub fn pool(&self) -> Counters<'_> {
        let p = self
            .json
            .get("pool")
            .unwrap_or_else(|| panic!("no pool in stat JSON: {}", self.json));
        Counters { v: p, what: "pool" }
    }
}

/// One object of the stat JSON.
#[derive(Clone, Copy, Debug)]
pub struct Counters<'a> {
    pub v: &'a Value,
    what: &'static str,
}

impl Counters<'_> {
    /// A counter: a member of the object itself (`size_bytes`, `queues`,
    /// `connections`, pool counters) or of a device's `stats`.
    pub fn get(&self, field: &str) -> u64 {
        self.v
            .get(field)
            .or_else(|| self.v.get("stats").and_then(|s| s.get(field)))
            .and_then(Value::as_u64)
            .unwrap_or_else(|| panic!("no counter {field} in {} stats: {}", self.what, self.v))
    }

    /// A string member, such as a device's `algo`.
    pub fn text(&self, field: &str) -> &str {
        self.v
            .get(field)
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("no string {field} in {} stats: {}", self.what, self.v))
    }

    pub fn summary(&self) -> String {
        let mut s = String::new();
        for f in [
            "orig_data_size",
            "compr_data_size",
            "mem_used_total",
            "mem_used_max",
            "mem_limit",
            "same_pages",
            "huge_pages",
            "reads",
            "writes",
            "discards",
            "failed_writes",
        ] {
            let v = self.get(f);
            if f.ends_with("_size") || f.starts_with("mem_") {
                let _ = write!(s, "{f}={:.1}MiB ", v as f64 / MIB as f64);
            } else {
                let _ = write!(s, "{f}={v} ");
            }
        }
        s.trim_end().to_string()
    }
}

/// How to boot a guest.
#[derive(Clone, Debug)]
pub struct GuestOpts {
    pub socket: PathBuf,
    pub mem: String,
    pub queues: u32,
    pub tests: String,
    pub append: Vec<String>,
    /// QEMU's `reconnect=` for the vhost-user chardev, in seconds (0: off):
    /// a guest whose backend goes away stalls and resumes once a daemon
    /// serves the socket again.
    pub reconnect: u32,
    /// Appended to QEMU's command line (`-incoming ...`, `-qmp ...`).
    pub qemu_args: Vec<String>,
}

impl GuestOpts {
    pub fn new(socket: &Path, tests: &str) -> GuestOpts {
        GuestOpts {
            socket: socket.to_path_buf(),
            mem: "256M".into(),
            queues: 1,
            tests: tests.into(),
            append: Vec::new(),
            reconnect: 1,
            qemu_args: Vec::new(),
        }
    }

    /// One more QEMU argument.
    pub fn qemu_arg(mut self, a: impl Into<String>) -> Self {
        self.qemu_args.push(a.into());
        self
    }

    /// QEMU's reconnect interval in seconds; 0 turns reconnecting off.
    pub fn reconnect(mut self, secs: u32) -> Self {
        self.reconnect = secs;
        self
    }

    pub fn queues(mut self, n: u32) -> Self {
        self.queues = n;
        self
    }

    pub fn mem(mut self, m: &str) -> Self {
        self.mem = m.into();
        self
    }

    /// A kernel argument such as `vzram.seed=3`.
    pub fn arg(mut self, a: impl Into<String>) -> Self {
        self.append.push(a.into());
        self
    }
}

#[derive(Default)]
struct Shared {
    state: Mutex<Lines>,
    cv: Condvar,
}

#[derive(Default)]
struct Lines {
    lines: Vec<String>,
    eof: u32,
}

fn reader<R: Read + Send + 'static>(
    r: R,
    prefix: &'static str,
    shared: Arc<Shared>,
    log: Arc<Mutex<File>>,
) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut r = BufReader::new(r);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let line = String::from_utf8_lossy(&buf);
            let line = format!("{prefix}{}", line.trim_end_matches(['\n', '\r']));
            if let Ok(mut f) = log.lock() {
                let _ = writeln!(f, "{line}");
            }
            let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
            st.lines.push(line);
            shared.cv.notify_all();
        }
        let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.eof += 1;
        shared.cv.notify_all();
    })
}

/// A QEMU running the test guest. Dropping it kills QEMU.
pub struct Guest {
    pub label: String,
    /// The test's directory: a hang dump goes there, and it names the
    /// test's daemon processes (their arguments and state paths hold it).
    dir: PathBuf,
    child: Option<Child>,
    shared: Arc<Shared>,
    readers: Vec<JoinHandle<()>>,
    started: Instant,
}

impl Guest {
    /// What QEMU (`pid`) and the daemon were blocked in, printed and kept
    /// as `hang-LABEL.txt`: a guest that times out is otherwise a silent
    /// console.
    fn report_hang(&self, pid: u32) {
        let dump = hang_dump(pid, &self.dir);
        let at = self.dir.join(format!("hang-{}.txt", self.label));
        let _ = fs::write(&at, &dump);
        eprintln!(
            "----- guest {}: timed out; threads ({}) -----\n{dump}",
            self.label,
            at.display()
        );
    }

    /// Waits up to `limit` for a console line containing `needle`: the
    /// line, or Err(true) once QEMU has exited, Err(false) at the limit.
    fn await_line(&self, needle: &str, limit: Duration) -> Result<String, bool> {
        let deadline = Instant::now() + limit;
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(l) = st.lines.iter().find(|l| l.contains(needle)) {
                return Ok(l.clone());
            }
            if st.eof >= 2 {
                return Err(true);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(false);
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits for a console line containing `needle` and returns it.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> String {
        match self.await_line(needle, timeout) {
            Ok(l) => l,
            Err(exited) => {
                if !exited {
                    if let Some(c) = &self.child {
                        self.report_hang(c.id());
                    }
                }
                panic!(
                    "guest {}: no line with {needle:?} after {:.0}s ({})",
                    self.label,
                    self.started.elapsed().as_secs_f64(),
                    if exited { "QEMU exited" } else { "timeout" }
                )
            }
        }
    }

    /// Waits up to `limit` for the guest's init to start (its `VZRAM-INIT`
    /// line). True also when QEMU has exited: [`Self::wait`] reports that.
    fn reached_init(&self, limit: Duration) -> bool {
        !matches!(self.await_line("VZRAM-INIT", limit), Err(false))
    }

    /// Whether the guest has printed a line containing `needle` so far.
    pub fn printed(&self, needle: &str) -> bool {
        let st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.lines.iter().any(|l| l.contains(needle))
    }

    /// Waits for QEMU to exit, killing it after `timeout` (a failure).
    pub fn wait(self, timeout: Duration) -> GuestOutput {
        self.wait_polling(timeout, Duration::from_secs(3600), || {})
    }

    /// Like [`Self::wait`], calling `poll` every `every` while QEMU runs,
    /// e.g. to sample the daemon's stats.
    pub fn wait_polling(
        mut self,
        timeout: Duration,
        every: Duration,
        mut poll: impl FnMut(),
    ) -> GuestOutput {
        let deadline = Instant::now() + timeout;
        let mut next = Instant::now() + every;
        // The child stays in `self` while `poll` runs, so a panic there
        // still kills QEMU (Drop).
        let status = loop {
            let child = self.child.as_mut().expect("guest already reaped");
            if let Ok(Some(st)) = child.try_wait() {
                break Some(st);
            }
            let now = Instant::now();
            if now >= deadline {
                let pid = child.id();
                self.report_hang(pid);
                let child = self.child.as_mut().expect("guest already reaped");
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            if now >= next {
                poll();
                next = Instant::now() + every;
            }
            thread::sleep(Duration::from_millis(50));
        };
        self.child = None;
        let out = self.collect(status);
        ensure!(
            out.status.is_some(),
            "guest {}: still running after {}s, killed",
            out.label,
            timeout.as_secs()
        );
        out
    }

    /// SIGKILLs QEMU, as if it crashed.
    pub fn kill(mut self) -> GuestOutput {
        let mut child = self.child.take().expect("guest already reaped");
        let _ = child.kill();
        let st = child.wait().ok();
        self.collect(st)
    }

    fn collect(&mut self, status: Option<ExitStatus>) -> GuestOutput {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        let lines = std::mem::take(
            &mut self
                .shared
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .lines,
        );
        let out = GuestOutput {
            label: self.label.clone(),
            lines,
            status,
            secs: self.started.elapsed().as_secs_f64(),
        };
        out.print_summary();
        out
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What a guest printed. Fields of a result line are parsed by [`Self::fields`].
#[derive(Clone, Debug)]
pub struct GuestOutput {
    pub label: String,
    pub lines: Vec<String>,
    pub status: Option<ExitStatus>,
    pub secs: f64,
}

/// Prefixes of the guest's own result lines.
const RESULT_PREFIXES: &[&str] = &[
    "GUEST ", "DISK ", "PRESSURE", "SWAP", "FS ", "TRIM ", "RAW ", "DISCARD ", "HOLD ", "VZRAM-",
];

impl GuestOutput {
    fn print_summary(&self) {
        eprintln!(
            "  guest {} ran {:.1}s, qemu {:?}",
            self.label, self.secs, self.status
        );
        for l in &self.lines {
            if RESULT_PREFIXES.iter().any(|p| l.starts_with(p)) || l.starts_with("qemu-stderr") {
                let l: String = l.chars().take(200).collect();
                eprintln!("  | {l}");
            }
        }
    }

    /// The first line that starts with `prefix` (our lines always start a
    /// line; kernel lines never look like them).
    pub fn line(&self, prefix: &str) -> Option<&str> {
        self.lines
            .iter()
            .map(String::as_str)
            .find(|l| l.starts_with(prefix))
    }

    /// The `k=v` fields of the first line starting with `prefix`; panics
    /// when there is none.
    pub fn fields(&self, prefix: &str) -> Fields {
        let l = self
            .line(prefix)
            .unwrap_or_else(|| panic!("guest {}: no line starting with {prefix:?}", self.label));
        let map = l
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Fields {
            line: l.to_string(),
            map,
        }
    }

    /// The rc of `VZRAM-GUEST-DONE rc=N`, if the guest got that far.
    pub fn done_rc(&self) -> Option<i64> {
        self.line("VZRAM-GUEST-DONE ")
            .map(|_| self.fields("VZRAM-GUEST-DONE ").num("rc"))
    }

    /// The guest finished every scenario successfully and QEMU exited 0.
    pub fn expect_ok(&self) -> &Self {
        ensure!(
            self.done_rc() == Some(0),
            "guest {}: wanted VZRAM-GUEST-DONE rc=0, got {:?}; failures: {:?}",
            self.label,
            self.line("VZRAM-GUEST-DONE"),
            self.lines
                .iter()
                .filter(|l| l.starts_with("VZRAM-GUEST-FAIL"))
                .collect::<Vec<_>>()
        );
        ensure!(
            self.status.is_some_and(|s| s.success()),
            "guest {}: QEMU exited with {:?}",
            self.label,
            self.status
        );
        self
    }
}

/// The `k=v` fields of one guest line.
#[derive(Clone, Debug)]
pub struct Fields {
    pub line: String,
    pub map: BTreeMap<String, String>,
}

impl Fields {
    pub fn str(&self, k: &str) -> &str {
        self.map
            .get(k)
            .unwrap_or_else(|| panic!("no {k}= in guest line {:?}", self.line))
    }

    pub fn num(&self, k: &str) -> i64 {
        let v = self.str(k);
        v.parse()
            .unwrap_or_else(|_| panic!("{k}={v} is not an integer in guest line {:?}", self.line))
    }

    pub fn float(&self, k: &str) -> f64 {
        let v = self.str(k);
        v.parse()
            .unwrap_or_else(|_| panic!("{k}={v} is not a number in guest line {:?}", self.line))
    }
}

/// A QMP connection to a QEMU started with `-qmp unix:PATH,server=on,wait=off`.
pub struct Qmp {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Qmp {
    /// Connects (waiting up to `timeout` for QEMU to create the socket) and
    /// leaves capabilities negotiation mode.
    pub fn connect(path: &Path, timeout: Duration) -> Qmp {
        let deadline = Instant::now() + timeout;
        let s = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(100)),
                Err(e) => panic!("QMP {}: {e}", path.display()),
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("QMP timeout");
        let mut q = Qmp {
            r: BufReader::new(s.try_clone().expect("QMP clone")),
            w: s,
        };
        let greeting = q.line();
        ensure!(
            greeting.get("QMP").is_some(),
            "not a QMP greeting: {greeting}"
        );
        q.execute("qmp_capabilities", serde_json::json!({}));
        q
    }

    fn line(&mut self) -> Value {
        let mut l = String::new();
        let n = self.r.read_line(&mut l).expect("QMP read");
        ensure!(n > 0, "QMP: QEMU closed the connection");
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("QMP: bad JSON ({e}): {l}"))
    }

    /// Runs a command and returns its `return` value; an `error` panics.
    /// Events that arrive meanwhile are skipped.
    pub fn execute(&mut self, cmd: &str, args: Value) -> Value {
        let msg = serde_json::json!({ "execute": cmd, "arguments": args });
        writeln!(self.w, "{msg}").expect("QMP write");
        loop {
            let v = self.line();
            if let Some(r) = v.get("return") {
                return r.clone();
            }
            if let Some(e) = v.get("error") {
                panic!("QMP {cmd}: {e}");
            }
        }
    }
}

/// Every thread of QEMU (`qemu`) and of the processes whose command line
/// names the test's directory (the daemon, its launcher and workers): its
/// state, kernel wait channel, current system call and kernel stack.
fn hang_dump(qemu: u32, dir: &Path) -> String {
    let tag = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut pids = vec![qemu];
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmd = fs::read(e.path().join("cmdline")).unwrap_or_default();
        if pid != qemu && !tag.is_empty() && String::from_utf8_lossy(&cmd).contains(&tag) {
            pids.push(pid);
        }
    }
    let read = |p: PathBuf| fs::read_to_string(p).unwrap_or_default();
    let mut out = String::new();
    for pid in pids {
        let cmd = read(PathBuf::from(format!("/proc/{pid}/cmdline"))).replace('\0', " ");
        out += &format!("pid {pid}: {}\n", cmd.chars().take(160).collect::<String>());
        let tasks = PathBuf::from(format!("/proc/{pid}/task"));
        for t in fs::read_dir(&tasks).into_iter().flatten().flatten() {
            let p = t.path();
            let stat = read(p.join("stat"));
            let state = stat
                .rsplit(") ")
                .next()
                .and_then(|r| r.split(' ').next())
                .unwrap_or("?");
            let stack: Vec<String> = read(p.join("stack"))
                .lines()
                .take(6)
                .map(str::to_owned)
                .collect();
            out += &format!(
                "  tid {} {} state {state} wchan {} syscall {}\n",
                t.file_name().to_string_lossy(),
                read(p.join("comm")).trim(),
                read(p.join("wchan")).trim(),
                read(p.join("syscall"))
                    .split(' ')
                    .next()
                    .unwrap_or("?")
                    .trim(),
            );
            for l in stack {
                out += &format!("      {l}\n");
            }
        }
        // User-space stacks when gdb is at hand (CI installs it): which lock
        // or message a stuck thread waits for.
        if on_path("gdb") {
            let bt = Command::new("timeout")
                .args(["60", "gdb", "-batch", "-nx", "-p", &pid.to_string()])
                .args(["-ex", "thread apply all bt 12"])
                .stdin(Stdio::null())
                .output();
            if let Ok(o) = bt {
                for l in String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter(|l| l.starts_with('#') || l.starts_with("Thread "))
                {
                    out += &format!("      {l}\n");
                }
            }
        }
    }
    out
}
