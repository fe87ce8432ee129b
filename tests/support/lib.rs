//! Helpers shared by the integration tests: find (and build) the `vzram`
//! binary, run a daemon in a temporary directory, drive its disks with the
//! `blkio` crate (driver `virtio-blk-vhost-user`), and ask its control socket
//! for stats.

use std::io::{BufRead, BufReader, Write};
use std::mem::MaybeUninit;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use serde_json::Value;

pub use serde_json::json;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The daemon binary: `$VZRAM_BIN`, else `vzram` in the target directory
/// (`$CARGO_TARGET_DIR`, or the one this test binary lives in, or
/// `<repo>/target`) after a `cargo build -p vzram`, which is a no-op when
/// the binary is fresh and so never runs a stale daemon.
pub fn vzram_bin() -> PathBuf {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(find_or_build)
        .clone()
        .unwrap_or_else(|e| panic!("{e}"))
}

fn find_or_build() -> Result<PathBuf, String> {
    if let Some(b) = std::env::var_os("VZRAM_BIN") {
        let b = PathBuf::from(b);
        return if b.is_file() {
            Ok(b)
        } else {
            Err(format!("VZRAM_BIN={} does not exist", b.display()))
        };
    }
    // This test binary is <target>/<profile>/deps/<name>-<hash>.
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let profile_dir = exe.parent().and_then(Path::parent).map(Path::to_path_buf);
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            profile_dir
                .as_ref()
                .and_then(|p| p.parent())
                .map(Path::to_path_buf)
        })
        .unwrap_or_else(|| root().join("target"));
    let release = profile_dir
        .as_ref()
        .and_then(|p| p.file_name())
        .is_some_and(|n| n == "release");
    let bin = target_dir
        .join(if release { "release" } else { "debug" })
        .join("vzram");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(root())
        .args(["build", "-p", "vzram"])
        .env("CARGO_TARGET_DIR", &target_dir);
    if release {
        cmd.arg("--release");
    }
    match cmd.stdin(Stdio::null()).output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return Err(format!(
                "cargo build -p vzram failed ({}):\n{}",
                o.status,
                String::from_utf8_lossy(&o.stderr)
            ))
        }
        // No cargo (the test binary was run by hand): use what is there.
        Err(e) => eprintln!("cannot run {cargo} ({e}); using {} as is", bin.display()),
    }
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!("no vzram binary at {}", bin.display()))
    }
}

/// A directory under the system temp dir, removed on drop. Kept short:
/// unix socket paths are limited to 108 bytes.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        // A long $TMPDIR would push socket paths past 108 bytes.
        let mut base = std::env::temp_dir();
        if base.as_os_str().len() > 40 {
            base = PathBuf::from("/tmp");
        }
        let p = base.join(format!(
            "vz-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("mkdir {}: {e}", p.display()));
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        // The state of daemons started for it or for a directory inside it.
        let state = state_dir_for(&self.0);
        let (Some(base), Some(prefix)) = (state.parent(), state.file_name()) else {
            return;
        };
        let prefix = prefix.to_string_lossy();
        let inside = format!("{prefix}_");
        for e in std::fs::read_dir(base).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name == prefix || name.starts_with(&inside) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Where daemons started for a test directory keep their device state: on
/// tmpfs as in production, named after the directory's whole path, and
/// removed with it (see [`TempDir`]'s drop). Daemons get it as
/// `VZRAM_STATE_DIR`.
pub fn state_dir_for(test_dir: &Path) -> PathBuf {
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    base.join(format!(
        "vzstate{}",
        test_dir.to_string_lossy().replace('/', "_")
    ))
}

/// A running `vzram serve` with a control socket; killed on drop.
pub struct Daemon {
    child: Option<Child>,
    pub control: PathBuf,
    pub sockets: Vec<PathBuf>,
    pub log: PathBuf,
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
        Daemon::start_command(cmd, &control, &log, sockets)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends one control request and returns the reply.
    pub fn control(&self, req: Value) -> Value {
        control_request(&self.control, &req)
    }

    /// `{"cmd":"stat"}`; asserts it succeeded.
    pub fn stat(&self) -> Stats {
        let v = self.control(json!({"cmd": "stat"}));
        assert_eq!(v["ok"], true, "stat failed: {v}");
        Stats(v)
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

    /// SIGKILL, as a crash or the OOM killer would; waits for the exit.
    pub fn kill9(&mut self) {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGKILL) };
        let st = self
            .wait_exit(Duration::from_secs(10))
            .expect("daemon gone");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(st.signal(), Some(libc::SIGKILL));
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
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `vzram serve ARGS`, which must refuse to start: its output, or a
/// panic if it is still running after 10 s.
pub fn serve_refused(dir: &TempDir, args: &[&str]) -> std::process::Output {
    let mut child = Command::new(vzram_bin())
        .arg("serve")
        .args(args)
        .env("VZRAM_STATE_DIR", state_dir_for(dir.path()))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("vzram serve {args:?} started instead of refusing");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// One request on a control socket.
pub fn control_request(path: &Path, req: &Value) -> Value {
    let mut s =
        UnixStream::connect(path).unwrap_or_else(|e| panic!("connect {}: {e}", path.display()));
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    writeln!(s, "{req}").unwrap();
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad control reply {line:?}: {e}"))
}

/// A stat reply.
pub struct Stats(pub Value);

impl Stats {
    /// A device's counters, by name.
    pub fn device(&self, name: &str) -> &Value {
        self.0["devices"]
            .as_array()
            .and_then(|a| a.iter().find(|d| d["name"] == name))
            .map(|d| &d["stats"])
            .unwrap_or_else(|| panic!("no device {name} in {}", self.0))
    }

    /// A device's worker process: state, pid, failures.
    pub fn worker(&self, name: &str) -> Value {
        self.0["devices"]
            .as_array()
            .and_then(|a| a.iter().find(|d| d["name"] == name))
            .map(|d| d["worker"].clone())
            .unwrap_or_else(|| panic!("no device {name} in {}", self.0))
    }

    pub fn dev(&self, name: &str, field: &str) -> u64 {
        self.device(name)[field]
            .as_u64()
            .unwrap_or_else(|| panic!("no {field} for {name} in {}", self.0))
    }

    pub fn pool(&self, field: &str) -> u64 {
        self.0["pool"][field]
            .as_u64()
            .unwrap_or_else(|| panic!("no pool {field} in {}", self.0))
    }
}

/// Bytes of the shared buffer each queue gets.
pub const QUEUE_BUF: usize = 4 << 20;

/// How long one request may take before a test fails instead of hanging.
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// A blkio connection to one vzram device.
pub struct Client {
    pub queues: Vec<Queue>,
    // Dropped after the queues: it owns the connection and the buffers.
    pub blkio: Blkio,
    _region: MemoryRegion,
}

/// One virtqueue with its own slice of the shared buffer.
pub struct Queue {
    q: Blkioq,
    buf: *mut u8,
    len: usize,
}

// SAFETY: `buf` points into a memory region that lives as long as the Blkio
// that owns it, which outlives every Queue; each Queue has its own slice.
unsafe impl Send for Queue {}

impl Client {
    pub fn connect(socket: &Path, num_queues: usize) -> Result<Client, blkio::Error> {
        Client::connect_with(socket, num_queues, false)
    }

    pub fn connect_with(
        socket: &Path,
        num_queues: usize,
        read_only: bool,
    ) -> Result<Client, blkio::Error> {
        let mut b = Blkio::new("virtio-blk-vhost-user")?;
        b.set_str("path", socket.to_str().expect("utf-8 path"))?;
        b.set_bool("read-only", read_only)?;
        b.connect()?;
        b.set_i32("num-queues", num_queues as i32)?;
        let started = b.start()?;
        let region = b.alloc_mem_region(QUEUE_BUF * num_queues)?;
        b.map_mem_region(&region)?;
        let queues = started
            .queues
            .into_iter()
            .enumerate()
            .map(|(i, q)| Queue {
                q,
                // SAFETY: the offset stays inside the region just allocated.
                buf: unsafe { (region.addr as *mut u8).add(i * QUEUE_BUF) },
                len: QUEUE_BUF,
            })
            .collect();
        Ok(Client {
            queues,
            blkio: b,
            _region: region,
        })
    }

    pub fn capacity(&self) -> u64 {
        self.blkio.get_u64("capacity").expect("capacity")
    }

    pub fn q(&mut self, i: usize) -> &mut Queue {
        &mut self.queues[i]
    }
}

/// A completed request's result: 0 or a negative errno (-EIO for IOERR,
/// -ENOTSUP for UNSUPP).
pub type IoResult = Result<(), i32>;

impl Queue {
    /// Its part of the shared buffer.
    pub fn buf(&mut self) -> &mut [u8] {
        // SAFETY: see `unsafe impl Send`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.buf, self.len) }
    }

    pub fn buf_ptr(&self) -> *mut u8 {
        self.buf
    }

    pub fn raw(&mut self) -> &mut Blkioq {
        &mut self.q
    }

    /// Waits for one completion; returns (user_data, ret).
    pub fn wait_one(&mut self) -> (usize, i32) {
        let mut c = [MaybeUninit::<Completion>::uninit()];
        let mut timeout = IO_TIMEOUT;
        let n = self
            .q
            .do_io(&mut c, 1, Some(&mut timeout), None)
            .expect("blkio do_io");
        assert_eq!(n, 1, "no completion within {IO_TIMEOUT:?}");
        // SAFETY: do_io filled in one completion.
        let c = unsafe { c[0].assume_init_read() };
        (c.user_data, c.ret)
    }

    fn sync(&mut self) -> IoResult {
        match self.wait_one().1 {
            0 => Ok(()),
            e => Err(e),
        }
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) -> IoResult {
        assert!(data.len() <= self.len);
        self.buf()[..data.len()].copy_from_slice(data);
        self.q
            .write(offset, self.buf, data.len(), 0, ReqFlags::empty());
        self.sync()
    }

    pub fn read(&mut self, offset: u64, len: usize) -> Result<Vec<u8>, i32> {
        assert!(len <= self.len);
        self.buf()[..len].fill(0xa5);
        self.q.read(offset, self.buf, len, 0, ReqFlags::empty());
        self.sync()?;
        Ok(self.buf()[..len].to_vec())
    }

    /// A write from several separate pieces of the buffer (one descriptor each).
    pub fn writev(&mut self, offset: u64, pieces: &[&[u8]]) -> IoResult {
        let mut iov = Vec::new();
        let mut at = 0;
        for p in pieces {
            // Leave gaps between the pieces so they really are separate.
            self.buf()[at..at + p.len()].copy_from_slice(p);
            iov.push(libc::iovec {
                // SAFETY: inside our slice of the region (checked by the copy above).
                iov_base: unsafe { self.buf.add(at) }.cast(),
                iov_len: p.len(),
            });
            at += p.len() + 512;
        }
        self.q
            .writev(offset, iov.as_ptr(), iov.len() as u32, 0, ReqFlags::empty());
        self.sync()
    }

    pub fn discard(&mut self, offset: u64, len: u64) -> IoResult {
        self.q.discard(offset, len, 0, ReqFlags::empty());
        self.sync()
    }

    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> IoResult {
        self.q.write_zeroes(offset, len, 0, ReqFlags::empty());
        self.sync()
    }

    pub fn flush(&mut self) -> IoResult {
        self.q.flush(0, ReqFlags::empty());
        self.sync()
    }
}

/// Deterministic test data: every 8 bytes name the (seed, byte offset), so a
/// misplaced sector is easy to see and never equals another's.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    let start = offset & !7;
    let mut pos = start;
    while pos < offset + len as u64 {
        v.extend_from_slice(&((seed << 48) ^ pos).to_le_bytes());
        pos += 8;
    }
    let skip = (offset - start) as usize;
    v[skip..skip + len].to_vec()
}

/// xorshift64*, seeded through [`mix`], so a test's choices replay from its seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(mix(seed) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// splitmix64's finaliser.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Incompressible data (xorshift), for tests that must fill memory.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// `pid` and every process it started, and theirs (from each thread's
/// `/proc/PID/task/TID/children`). Checks of the daemon's memory, threads,
/// descriptors and sandbox go over all of them, so they keep checking
/// something once devices are served by worker processes.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        i += 1;
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            out.extend(
                kids.split_whitespace()
                    .filter_map(|k| k.parse::<u32>().ok()),
            );
        }
    }
    out
}

/// A field of `/proc/PID/status` as written there, without the key: `"2"`
/// for `Seccomp`, `"1234 kB"` for `VmRSS`. None when the process or the
/// field is missing.
pub fn proc_status_field(pid: u32, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

/// A memory field of `/proc/PID/status` (`VmRSS`, `RssAnon`, `RssShmem`...)
/// in bytes.
pub fn proc_status_bytes(pid: u32, key: &str) -> Option<u64> {
    let v = proc_status_field(pid, key)?;
    let kib: u64 = v.strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib * 1024)
}

impl Daemon {
    /// Runs `cmd`, a `vzram serve ...` command line that names its control
    /// socket `control` (possibly behind a wrapper that execs the daemon in
    /// place, such as `setpriv --reuid=...`, so that [`Daemon::pid`] stays
    /// the daemon's), with its output in `log`; waits until `control` and
    /// every socket in `sockets` exist.
    pub fn start_command(
        mut cmd: Command,
        control: &Path,
        log: &Path,
        sockets: &[&Path],
    ) -> Daemon {
        let log_file = std::fs::File::create(log).expect("create daemon log");
        if let Some(dir) = control.parent() {
            cmd.env("VZRAM_STATE_DIR", state_dir_for(dir));
        }
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
        let mut d = Daemon {
            child: Some(child),
            control: control.to_path_buf(),
            sockets: sockets.iter().map(|p| p.to_path_buf()).collect(),
            log: log.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if d.sockets.iter().all(|s| s.exists()) && d.control.exists() {
                return d;
            }
            if let Some(st) = d.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("vzram exited early ({st}):\n{}", d.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "vzram sockets not there after 20 s:\n{}",
                d.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_tree_finds_grandchildren() {
        // A shell that starts a sleep and waits for it: child and grandchild.
        let mut child = Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .spawn()
            .unwrap();
        let me = std::process::id();
        let deadline = Instant::now() + Duration::from_secs(10);
        let tree = loop {
            let t = process_tree(me);
            if t.len() >= 3 || Instant::now() > deadline {
                break t;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let _ = Command::new("pkill")
            .args(["-P", &child.id().to_string()])
            .status();
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(tree[0], me);
        assert!(tree.contains(&child.id()), "{tree:?}");
        assert!(tree.len() >= 3, "no grandchild in {tree:?}");
    }
}
