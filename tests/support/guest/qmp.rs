//! A QMP client, for QEMU's own migration.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::Value;

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

    /// Waits up to `limit` for QEMU's migration (outgoing, or incoming
    /// on a QEMU started with `-incoming`) to complete; returns its
    /// `query-migrate`. A failed or cancelled one panics.
    pub fn wait_migrated(&mut self, limit: Duration) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let info = self.execute("query-migrate", serde_json::json!({}));
            match info["status"].as_str() {
                Some("completed") => return info,
                Some("failed") | Some("cancelled") => panic!("QEMU's migration failed: {info}"),
                _ => {}
            }
            ensure!(
                Instant::now() < deadline,
                "QEMU's migration did not finish in {limit:?}: {info}"
            );
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Sends `quit`; Err says why not when QEMU had already closed the
    /// connection (a process that has exited cannot be asked to).
    pub fn quit(&mut self) -> Result<(), String> {
        let msg = serde_json::json!({ "execute": "quit" });
        writeln!(self.w, "{msg}").map_err(|e| format!("QMP write: {e}"))
    }
}
