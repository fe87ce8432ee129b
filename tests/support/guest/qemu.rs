//! [`Guest`]: a QEMU running the test guest, its console read line by
//! line into its log and into memory for the waits.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::hang::hang_dump;
use super::output::GuestOutput;

/// The console lines so far, shared with the reader threads.
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
    pub(super) child: Option<Child>,
    shared: Arc<Shared>,
    readers: Vec<JoinHandle<()>>,
    started: Instant,
}

impl Guest {
    /// Takes over `child` (`contrib/guest/run.sh`, stdout and stderr
    /// piped): its console goes to `log` and into memory.
    pub(super) fn start(label: &str, dir: &Path, mut child: Child, log: &Path) -> Guest {
        let shared = Arc::new(Shared::default());
        let logf = Arc::new(Mutex::new(File::create(log).expect("create guest log")));
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
            dir: dir.to_path_buf(),
            child: Some(child),
            shared,
            readers,
            started: Instant::now(),
        }
    }

    /// What QEMU (`pid`) and the daemon were blocked in, printed and kept
    /// as `hang-LABEL.txt`: a guest that times out is otherwise a silent
    /// console.
    pub(super) fn report_hang(&self, pid: u32) {
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
    pub(super) fn reached_init(&self, limit: Duration) -> bool {
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
