//! Harness for the end-to-end tests (`tests/e2e*.rs`): finds QEMU, the test
//! guest (`contrib/guest/`) and the `vzram` binary, and wraps the daemon and
//! each QEMU guest in guards that kill them and clean up on drop.
//!
//! Each test builds a [`Ctx`] first. It serialises the tests (every boot
//! is a CPU-heavy TCG guest), owns the test's temporary directory, and, when
//! the test panics, prints the tail of every guest and daemon log and keeps
//! the directory for a post-mortem.
//!
//! The pieces: [`Ctx`] (here), [`Guest`] and [`GuestOutput`] (a running
//! QEMU and what it printed), [`GuestOpts`], [`Qmp`], and the thread dump
//! of a hung guest. The daemon is a [`crate::Daemon`] started with
//! [`DaemonOpts`] of its own.

mod hang;
mod host;
mod hosts;
mod opts;
mod output;
mod qemu;
mod qmp;

pub use hosts::{swapping, wait_migration, Hosts};
pub use opts::GuestOpts;
pub use output::{Fields, GuestOutput};
pub use qemu::Guest;
pub use qmp::Qmp;

use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use crate::daemon::{Daemon, DaemonOpts};
pub use crate::data::MIB;
use crate::paths::{root, state_dir_for, vzram_bin};
use host::{on_path, qemu_binary};

/// How long a booting guest may take to start its init (it takes 1-3 s).
const INIT_WAIT: Duration = Duration::from_secs(60);

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
        let bin = vzram_bin();
        let mut base = std::env::temp_dir();
        if base.as_os_str().len() > 40 {
            // Unix socket paths are limited to 108 bytes.
            base = PathBuf::from("/tmp");
        }
        let dir = base.join(format!("vzram-e2e-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let _ = fs::remove_dir_all(state_dir_for(&dir));
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
    /// [`state_dir_for`] the test directory (`VZRAM_STATE_DIR`).
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
        cmd.env("VZRAM_STATE_DIR", state_dir_for(&self.dir));
        eprintln!("e2e {}: {cmd:?}", self.name);
        cmd.env("NO_COLOR", "1");
        self.add_log(
            if n == 1 {
                "daemon".into()
            } else {
                format!("daemon #{n}")
            },
            log.clone(),
        );
        let opts = DaemonOpts { term_on_drop: true };
        let mut d = Daemon::start_with(cmd, &control, &log, sockets, opts);
        d.set_args(args.to_vec());
        d
    }

    /// Starts `old`'s command line again, as a restart or an upgrade would,
    /// once `old` has exited ([`Daemon::kill9`], [`Daemon::terminate_cleanly`]): the
    /// same sockets, control socket and state directory.
    pub fn restart(&self, old: &mut Daemon) -> Daemon {
        ensure!(
            old.has_exited(),
            "restart: the old daemon (pid {}) is still running",
            old.pid()
        );
        let sockets: Vec<&Path> = old.sockets.iter().map(PathBuf::as_path).collect();
        let control = old.control.file_name().expect("control socket name");
        self.daemon_at(&control.to_string_lossy(), old.args(), &sockets)
    }

    /// Boots a guest; it runs in the background until [`Guest::wait`].
    /// Unless QEMU waits for an incoming migration, checks that the guest's
    /// init starts: a boot whose kernel shows nothing for `INIT_WAIT` (60 s) is
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
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn contrib/guest/run.sh");
        self.add_log(format!("guest {label}"), log.clone());
        Guest::start(label, &self.dir, child, &log)
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
            let _ = fs::remove_dir_all(state_dir_for(&self.dir));
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
