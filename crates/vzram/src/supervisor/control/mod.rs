//! The control socket's server: one reply line per request line (the
//! protocol is `proto::control`'s), over bounded connections.

use std::net::SocketAddr;
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::clients::{self, Frame, Limits, Protocol, Reply, Timeout};
use super::error::{Error, Result};
use super::reload::Reloads;
use super::served::Served;
use super::Supervisor;
use crate::proto::control::{Command, DeviceRef, ErrorKind, Head, ReplyLine, Request};

mod handle;
mod snapshot;

pub use snapshot::Sample;
#[cfg(test)]
pub use snapshot::{DeviceExtra, Snapshot};

/// Longest request line accepted; anything longer closes the connection.
const MAX_LINE: usize = 64 * 1024;
/// Control clients at once; past it the longest idle one gives way.
pub const MAX_CLIENTS: usize = 64;
/// A client that neither sends nor reads for this long is closed.
const IDLE: Duration = Duration::from_secs(30);
/// Threads answering requests that may wait (`stat` is answered at once).
const POOL: usize = 4;

pub struct Control {
    sup: Arc<Supervisor>,
    /// Where `/metrics` is served, as bound (a port 0 resolved).
    metrics: Option<SocketAddr>,
    /// What `reload` runs (None only in unit tests).
    reloads: Option<Arc<Reloads>>,
}

impl Control {
    pub fn new(sup: Arc<Supervisor>) -> Control {
        Control {
            sup,
            metrics: None,
            reloads: None,
        }
    }

    pub fn with_reloads(mut self, r: Arc<Reloads>) -> Control {
        self.reloads = Some(r);
        self
    }

    fn devices(&self) -> Vec<(usize, Arc<Served>)> {
        self.sup.devices()
    }

    pub fn with_metrics(mut self, addr: Option<SocketAddr>) -> Control {
        self.metrics = addr;
        self
    }

    /// The device a request names, with its index.
    fn find(&self, r: &DeviceRef) -> Result<(usize, Arc<Served>)> {
        let devices = self.devices();
        let by_index = |i: u64| devices.iter().find(|(j, _)| *j as u64 == i).cloned();
        let found = match r {
            DeviceRef::Index(i) => by_index(*i),
            DeviceRef::Name(n) => devices
                .iter()
                .find(|(_, d)| d.spec.name == *n)
                .cloned()
                .or_else(|| n.parse().ok().and_then(by_index)),
        };
        found.ok_or_else(|| {
            let asked = match r {
                DeviceRef::Index(i) => i.to_string(),
                DeviceRef::Name(n) => format!("{n:?}"),
            };
            let names: Vec<String> = devices
                .iter()
                .map(|(i, d)| format!("{} ({i})", d.spec.name))
                .collect();
            Error::NoSuchDevice {
                asked,
                known: if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                },
            }
        })
    }

    fn answer_request(&self, req: Request) -> Value {
        self.line(self.handle(req))
    }

    /// A handled request's reply line.
    fn line(&self, r: Result<Value>) -> Value {
        let line = match r {
            Ok(body) => serde_json::to_value(ReplyLine {
                head: Head::ok(),
                body,
            }),
            // The one place an error becomes text.
            Err(e) => return refusal(kind(&e), &e.to_string()),
        };
        line.unwrap_or_else(|e| {
            refusal(
                ErrorKind::Internal,
                &format!("cannot encode the reply: {e}"),
            )
        })
    }

    /// Runs `c`'s handler, its reply as the line's JSON.
    fn run<C: Command>(&self, c: C, f: impl FnOnce(&Self, C) -> Result<C::Reply>) -> Result<Value> {
        let reply = f(self, c)?;
        serde_json::to_value(reply)
            .map_err(|e| Error::Invalid(format!("cannot encode the reply: {e}")))
    }

    fn handle(&self, req: Request) -> Result<Value> {
        match req {
            Request::Stat(c) => self.run(c, Self::stat),
            Request::Reload(c) => self.run(c, Self::reload),
            Request::SetLimit(c) => self.run(c, Self::set_limit),
            Request::Compact(c) => self.run(c, Self::compact),
            Request::Add(c) => self.run(c, Self::add),
            Request::Forget(c) => self.run(c, Self::forget),
            Request::Remove(c) => self.run(c, Self::remove),
            Request::Reset(c) => self.run(c, Self::reset),
            Request::ResetMax(c) => self.run(c, Self::reset_max),
            Request::Migrate(c) => self.run(c, |s, c| s.migrate(&c, &|| false)),
            Request::CommitMigration(c) => self.run(c, Self::commit_migration),
            Request::CancelMigration(c) => self.run(c, Self::cancel_migration),
            Request::MarkIdle(c) => self.run(c, Self::mark_idle),
            Request::Recompress(c) => self.run(c, Self::recompress),
            Request::Writeback(c) => self.run(c, Self::writeback),
        }
    }
}

/// What kind of refusal an error is: what the client's exit status
/// follows.
fn kind(e: &Error) -> ErrorKind {
    match e {
        Error::Invalid(_) => ErrorKind::BadRequest,
        Error::NoSuchDevice { .. } | Error::NoIndex(_) | Error::NoLeftover(_) => {
            ErrorKind::NotFound
        }
        Error::NameTaken(_)
        | Error::SocketTaken { .. }
        | Error::Served(_)
        | Error::NoBackingFile(_)
        | Error::Incoming(_)
        | Error::MigrationRunning(_)
        | Error::AlreadySent(_)
        | Error::NoTls { .. }
        | Error::NotCommitting(_)
        | Error::CommitTooEarly(_)
        | Error::NotSending(_) => ErrorKind::Conflict,
        Error::Connected { .. } => ErrorKind::InUse,
        Error::Busy(_) | Error::InUse(_) | Error::Receiving(_) => ErrorKind::Busy,
        Error::Failed { .. }
        | Error::Connect { .. }
        | Error::LauncherRefused(_)
        | Error::Start { .. }
        | Error::Store(_)
        | Error::Io(_) => ErrorKind::Failed,
        Error::WorkerStuck { .. }
        | Error::WorkerGone(_)
        | Error::WorkerSilent
        | Error::WorkerAnswer(_)
        | Error::LauncherSilent
        | Error::Launcher(_)
        | Error::LauncherAnswer(_)
        | Error::LauncherFds
        | Error::LauncherNoConnection
        | Error::Thread(_) => ErrorKind::Internal,
    }
}

/// One control request line, parsed.
pub enum Line {
    Blank,
    Bad(String),
    Req(Request),
}

/// A refusal's line, with the daemon's version as every reply has.
fn refusal(kind: ErrorKind, why: &str) -> Value {
    serde_json::to_value(Head::refused(kind, why)).unwrap_or_default()
}

fn line_of(v: &Value) -> Vec<u8> {
    let mut b = v.to_string().into_bytes();
    b.push(b'\n');
    b
}

impl Protocol for Control {
    type Req = Line;
    const NAME: &'static str = "control";

    fn frame(&self, buf: &[u8]) -> Frame {
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) if i < MAX_LINE => Frame::Request(i + 1),
            Some(_) => Frame::TooLong,
            None if buf.len() >= MAX_LINE => Frame::TooLong,
            None => Frame::Need,
        }
    }

    fn parse(&self, bytes: &[u8]) -> Line {
        let Ok(text) = std::str::from_utf8(bytes) else {
            return Line::Bad("bad request: not UTF-8".into());
        };
        let text = text.trim();
        if text.is_empty() {
            return Line::Blank;
        }
        match serde_json::from_str(text) {
            Ok(r) => Line::Req(r),
            Err(e) => Line::Bad(format!("bad request: {e}")),
        }
    }

    fn quick(&self, l: &Line) -> bool {
        // `stat` reads counters and short-held locks only, so an operator
        // can always see the daemon while `add`s and `migrate`s wait.
        matches!(l, Line::Blank | Line::Bad(_) | Line::Req(Request::Stat(_)))
    }

    fn long(&self, l: &Line) -> bool {
        matches!(l, Line::Req(Request::Migrate(_)))
    }

    fn answer_long(&self, l: Line, gone: &(dyn Fn() -> bool + Sync)) -> Reply {
        let bytes = match l {
            Line::Req(Request::Migrate(c)) => {
                line_of(&self.line(self.run(c, |s, c| s.migrate(&c, gone))))
            }
            l => return self.answer(l),
        };
        Reply {
            bytes,
            close: false,
        }
    }

    fn answer(&self, l: Line) -> Reply {
        let bytes = match l {
            Line::Blank => Vec::new(),
            Line::Bad(e) => line_of(&refusal(ErrorKind::BadRequest, &e)),
            Line::Req(r) => line_of(&self.answer_request(r)),
        };
        Reply {
            bytes,
            close: false,
        }
    }

    fn too_long(&self) -> Reply {
        Reply {
            bytes: line_of(&refusal(ErrorKind::BadRequest, "request line too long")),
            close: true,
        }
    }

    fn closing(&self, why: &str) -> Vec<u8> {
        line_of(&refusal(ErrorKind::Busy, why))
    }
}

/// How long an idle control client is kept; a debug build takes a
/// shorter time from the environment, for tests.
fn idle_timeout() -> Duration {
    #[cfg(debug_assertions)]
    if let Some(ms) = std::env::var("VZRAM_TEST_CONTROL_IDLE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return Duration::from_millis(ms);
    }
    IDLE
}

/// Serves the control socket for ever.
pub fn serve(listener: UnixListener, ctl: Arc<Control>) {
    let limits = Limits {
        max_clients: MAX_CLIENTS,
        timeout: Timeout::Idle(idle_timeout()),
        pool: POOL,
    };
    if let Err(e) = clients::serve(listener.into(), ctl, limits) {
        tracing::error!("control socket: {e}; no more control requests are answered");
    }
}

#[cfg(test)]
mod tests;
