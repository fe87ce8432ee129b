//! The `vzram` command line as a test runs it: one runner, [`Vzram`], for
//! every test that types a client command (`stat`, `add`, `migrate`, ...)
//! or a `serve` that must refuse. Its output is captured, its stdin is
//! closed, and a command still running after its limit is killed and
//! fails the test instead of hanging the suite.

use std::ffi::OsStr;
use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::paths::{vzram_bin, TempDir};

/// How long a command may run unless the test sets its own
/// [`Vzram::limit`]: far more than any client command needs on a busy host.
pub const CLI_LIMIT: Duration = Duration::from_secs(120);

/// `vzram ARGS`, built up, then run with [`Vzram::output`] (or
/// [`Vzram::ok`], [`Vzram::timed`], [`Vzram::spawn`]).
pub struct Vzram {
    cmd: Command,
    limit: Duration,
    /// The state directory of [`Vzram::state_apart`], kept until the end.
    state: Option<TempDir>,
}

impl Vzram {
    pub fn new(args: &[&str]) -> Vzram {
        let mut cmd = Command::new(vzram_bin());
        cmd.args(args);
        Vzram {
            cmd,
            limit: CLI_LIMIT,
            state: None,
        }
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Vzram {
        self.cmd.arg(arg);
        self
    }

    pub fn args<S: AsRef<OsStr>>(mut self, args: impl IntoIterator<Item = S>) -> Vzram {
        self.cmd.args(args);
        self
    }

    /// `--control PATH` after the arguments so far.
    pub fn control(self, path: &Path) -> Vzram {
        self.arg("--control").arg(path)
    }

    pub fn env(mut self, key: &str, val: impl AsRef<OsStr>) -> Vzram {
        self.cmd.env(key, val);
        self
    }

    pub fn env_remove(mut self, key: &str) -> Vzram {
        self.cmd.env_remove(key);
        self
    }

    /// Killed, and the test failed, if still running after `limit`.
    pub fn limit(mut self, limit: Duration) -> Vzram {
        self.limit = limit;
        self
    }

    /// Its state (`VZRAM_STATE_DIR`) and default control socket
    /// (`VZRAM_CONTROL`) in a fresh directory of its own: a daemon it
    /// wrongly starts touches nothing of another test's.
    pub fn state_apart(self) -> Vzram {
        let dir = TempDir::new("clistate");
        let mut v = self
            .env("VZRAM_STATE_DIR", dir.path())
            .env("VZRAM_CONTROL", dir.join("control.sock"));
        v.state = Some(dir);
        v
    }

    /// Started, its output read as it comes (a full pipe never stalls it).
    pub fn spawn(mut self) -> Running {
        let what = format!("{:?}", self.cmd);
        let mut child = self
            .cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("run {what}: {e}"));
        let out = drain(child.stdout.take());
        let err = drain(child.stderr.take());
        Running {
            child,
            what,
            start: Instant::now(),
            limit: self.limit,
            out,
            err,
            _state: self.state.take(),
        }
    }

    /// Its output and how long it ran.
    pub fn timed(self) -> (Output, Duration) {
        let r = self.spawn();
        let start = r.start;
        let o = r.output();
        (o, start.elapsed())
    }

    /// Its output, however it exited.
    pub fn output(self) -> Output {
        self.timed().0
    }

    /// Its stdout; it must succeed (else the test fails with its output).
    pub fn ok(self) -> String {
        let what = format!("{:?}", self.cmd);
        let o = self.output();
        assert!(o.status.success(), "{what}: {}\n{}", o.status, said(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
}

/// A [`Vzram`] started with [`Vzram::spawn`].
pub struct Running {
    child: Child,
    what: String,
    start: Instant,
    limit: Duration,
    out: Pipe,
    err: Pipe,
    _state: Option<TempDir>,
}

impl Running {
    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().expect("wait for vzram").is_none()
    }

    /// Its output once it exits within `limit`; None (and it is killed)
    /// if it is still running then.
    pub fn finish(mut self, limit: Duration) -> Option<Output> {
        self.finish_within(limit)
    }

    /// Its output once it exits; the test fails if it is still running
    /// after its [`Vzram::limit`].
    pub fn output(mut self) -> Output {
        let limit = self.limit;
        self.finish_within(limit).unwrap_or_else(|| {
            let o = self.collect(Some(Duration::from_secs(1)));
            panic!(
                "{} still running after {limit:?} (killed); stderr: {:?}",
                self.what,
                String::from_utf8_lossy(&o.stderr)
            )
        })
    }

    fn finish_within(&mut self, limit: Duration) -> Option<Output> {
        let deadline = Instant::now() + limit;
        while self.running() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(self.collect(None))
    }

    /// The output of the exited command; of a killed one, what it printed
    /// within `grace` (a process it started may hold its pipes open).
    fn collect(&mut self, grace: Option<Duration>) -> Output {
        let status = self.child.wait().expect("wait for vzram");
        Output {
            status,
            stdout: self.out.take(grace),
            stderr: self.err.take(grace),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One output pipe of a running command, read to its end on a thread.
struct Pipe {
    buf: Arc<Mutex<Vec<u8>>>,
    reader: Option<JoinHandle<()>>,
}

impl Pipe {
    /// What it read: all of it, or what came within `grace`.
    fn take(&mut self, grace: Option<Duration>) -> Vec<u8> {
        if let Some(h) = self.reader.take() {
            let until = grace.map(|g| Instant::now() + g);
            while !h.is_finished() && until.is_some_and(|u| Instant::now() < u) {
                std::thread::sleep(Duration::from_millis(10));
            }
            if until.is_none() || h.is_finished() {
                h.join().unwrap();
            }
        }
        std::mem::take(&mut self.buf.lock().unwrap())
    }
}

fn drain(pipe: Option<impl Read + Send + 'static>) -> Pipe {
    let buf = Arc::new(Mutex::new(Vec::new()));
    let reader = pipe.map(|mut p| {
        let buf = buf.clone();
        std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            loop {
                match p.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(n) => buf.lock().unwrap().extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        })
    });
    Pipe { buf, reader }
}

/// `vzram ARGS` with the [`CLI_LIMIT`]; its output.
pub fn vzram(args: &[&str]) -> Output {
    Vzram::new(args).output()
}

/// What a finished command printed, stdout then stderr, for messages.
pub fn said(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// What a finished command printed on stderr.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finished_command_gives_its_output() {
        let o = vzram(&["--version"]);
        assert!(o.status.success(), "{}", said(&o));
        assert!(String::from_utf8_lossy(&o.stdout).starts_with("vzram "));
        let o = vzram(&["stat", "--no-such-flag"]);
        assert_eq!(o.status.code(), Some(2), "{}", said(&o));
        assert!(stderr(&o).contains("--no-such-flag"), "{}", said(&o));
    }

    /// A `serve` that does not refuse runs on, its launcher holding its
    /// stderr open: killed after the limit, it fails the test (instead of
    /// hanging it on the pipe).
    #[test]
    fn a_command_still_running_after_its_limit_fails_the_test() {
        let dir = TempDir::new("cli-limit");
        let sock = dir.join("a.sock");
        let res = std::panic::catch_unwind(|| {
            Vzram::new(&["serve", "--size", "1M", "--socket"])
                .arg(&sock)
                .state_apart()
                .limit(Duration::from_secs(1))
                .output()
        });
        let msg = res.expect_err("a daemon that runs on was not stopped");
        let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("still running after 1s (killed)"), "{msg}");
    }
}
