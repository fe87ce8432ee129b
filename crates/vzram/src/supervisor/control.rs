//! The control socket's server: one reply line per request line (the
//! protocol is `proto::control`'s), over bounded connections.

use std::net::SocketAddr;
use std::os::unix::net::UnixListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use vzram_store::cells::Phase;
use vzram_store::PoolStats;

use super::clients::{self, Frame, Limits, Protocol, Reply, Timeout};
use super::error::{Error, Result};
use super::metrics::{DeviceSample, MigrationSample, Sample};
use super::orders::unexpected;
use super::reload::{Cause, Reloads};
use super::served::Served;
use super::Supervisor;
use crate::config::DeviceSpec;
use crate::proto::addr::Addr;
use crate::proto::control::{
    Added, BackingStat, Committed, Compacted, DeviceLimitSet, DeviceRef, DeviceStat, Done,
    Forgotten, Head, HostLimitSet, MarkedIdle, Migrated, MigrationStat, MigrationState,
    Recompressed, Removed, ReplyLine, Request, Reset, StatReply, TierStat, WrittenBack,
};
use crate::proto::order::{Answer, Order, TierFilter};

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

    /// Whole-pool numbers: every device's, read from the shared counters
    /// (no worker is asked), with the host budget.
    fn pool_stats(&self) -> PoolStats {
        let mut s = PoolStats::default();
        for (_, d) in self.devices() {
            s.add(&d.cells.stats(d.spec.size));
        }
        let host = self.sup.pool.host_cells().budget();
        s.mem_used_total = host.used();
        s.mem_used_max = host.max();
        s.mem_limit = host.limit();
        s
    }

    pub fn with_metrics(mut self, addr: Option<SocketAddr>) -> Control {
        self.metrics = addr;
        self
    }

    /// The numbers `stat` reports, for `/metrics`.
    pub fn sample(&self) -> Sample {
        Sample {
            pool: self.pool_stats(),
            devices: self
                .devices()
                .iter()
                .map(|(_, d)| DeviceSample {
                    name: d.spec.name.clone(),
                    connected: d.connected.load(Ordering::Relaxed),
                    stats: d.cells.stats(d.spec.size),
                    latency: d.cells.latencies(),
                    backing_blocks: d.backing.as_ref().map_or(0, |b| b.blocks),
                    restarts: super::served::Restart::ALL
                        .iter()
                        .map(|r| (r.name(), d.restarts[*r as usize].load(Ordering::Relaxed)))
                        .collect(),
                    refused_clients: d.refused_clients.load(Ordering::Relaxed),
                    migration: {
                        let m = &d.cells.migration;
                        MigrationSample {
                            state: m.state_name(),
                            bytes: m.bytes.load(Ordering::Relaxed),
                            records: m.records.load(Ordering::Relaxed),
                            pass: m.pass.load(Ordering::Relaxed),
                            dirty: m.dirty.load(Ordering::Relaxed),
                        }
                    },
                })
                .collect(),
            leftovers: self
                .sup
                .registry
                .leftovers()
                .iter()
                .map(|l| (l.name.clone(), l.bytes))
                .collect(),
            // The metrics thread fills it in (procstat).
            process: Default::default(),
        }
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
            Err(e) => return refusal(&e.to_string()),
        };
        line.unwrap_or_else(|e| refusal(&format!("cannot encode the reply: {e}")))
    }

    /// A typed reply as the line's JSON.
    fn reply(r: impl serde::Serialize) -> Result<Value> {
        serde_json::to_value(r).map_err(|e| Error::Invalid(format!("cannot encode the reply: {e}")))
    }

    fn handle(&self, req: Request) -> Result<Value> {
        match req {
            Request::Stat {} => Self::reply(self.stat()),
            Request::Reload {} => match &self.reloads {
                Some(r) => Self::reply(r.now(Cause::Control)?),
                None => Err(Error::Invalid("this daemon cannot reload".into())),
            },
            Request::SetLimit {
                device: Some(_),
                host: true,
                ..
            } => Err(Error::Invalid(
                "give either \"device\" or \"host\":true, not both".into(),
            )),
            Request::SetLimit {
                device: Some(r),
                bytes,
                ..
            } => {
                let (_, d) = self.find(&r)?;
                let warnings = self.sup.set_device_limit(&d, bytes)?;
                Self::reply(DeviceLimitSet {
                    device: d.spec.name.clone(),
                    mem_limit: bytes,
                    warnings,
                })
            }
            Request::SetLimit {
                device: None,
                host: true,
                bytes,
            } => {
                let warnings = self.sup.set_host_limit(bytes);
                Self::reply(HostLimitSet {
                    host_mem_limit: bytes,
                    warnings,
                })
            }
            Request::SetLimit {
                device: None,
                host: false,
                ..
            } => Err(Error::Invalid(
                "set-limit needs \"device\" or \"host\":true".into(),
            )),
            Request::Compact { device } => {
                let pages = match device {
                    Some(r) => self.sup.compact(&self.find(&r)?.1)?,
                    None => {
                        // One device that cannot be compacted does not stop
                        // the others.
                        let mut pages = 0;
                        for (_, d) in self.devices() {
                            match self.sup.compact(&d) {
                                Ok(n) => pages += n,
                                Err(e) => {
                                    tracing::warn!(device = %d.spec.name, "not compacted: {e}")
                                }
                            }
                        }
                        pages
                    }
                };
                tracing::info!(pages, "compacted");
                Self::reply(Compacted {
                    pages_compacted: pages,
                })
            }
            Request::Add { device } => {
                let spec = self.new_device(&device)?;
                let name = spec.name.clone();
                let (index, recovered) = self.sup.add(spec)?;
                let state = self
                    .sup
                    .device(index)
                    .map(|d| d.files.dir.clone())
                    .unwrap_or_default();
                Self::reply(Added {
                    device: name,
                    index,
                    recovered,
                    state,
                })
            }
            Request::Forget { name } => {
                let l = self.sup.forget(&name)?;
                Self::reply(Forgotten {
                    name: l.name,
                    dir: l.dir,
                    size_bytes: l.size_bytes,
                })
            }
            Request::Remove { device, force } => {
                let (i, d) = self.find(&device)?;
                let name = d.spec.name.clone();
                drop(d);
                let kept = self.sup.remove(i, force)?;
                Self::reply(Removed {
                    device: name,
                    removed: true,
                    kept,
                })
            }
            Request::Reset { device, force } => {
                let (_, d) = self.find(&device)?;
                let pages = self.sup.reset(&d, force)?;
                tracing::info!(device = %d.spec.name, pages, "reset: data dropped");
                Self::reply(Reset {
                    device: d.spec.name.clone(),
                    pages_dropped: pages,
                })
            }
            Request::ResetMax { device } => {
                match device {
                    Some(r) => self.find(&r)?.1.cells.budget().reset_max(),
                    None => {
                        for (_, d) in self.devices() {
                            d.cells.budget().reset_max();
                        }
                        self.sup.pool.reset_mem_used_max();
                    }
                }
                Self::reply(Done {})
            }
            Request::Migrate { device, to, keep } => self.migrate(&device, &to, keep, &|| false),
            Request::CommitMigration { device } => {
                let (_, d) = self.find(&device)?;
                self.sup.commit_migration(&d)?;
                tracing::info!(device = %d.spec.name, "migration commit asked by the operator");
                Self::reply(Committed {
                    device: d.spec.name.clone(),
                    state: migration_state(d.cells.migration.phase()),
                })
            }
            Request::CancelMigration { device } => {
                let (_, d) = self.find(&device)?;
                self.sup.cancel_migration(&d)?;
                tracing::warn!(device = %d.spec.name, "migration cancelled by the operator");
                Self::reply(Committed {
                    device: d.spec.name.clone(),
                    state: migration_state(d.cells.migration.phase()),
                })
            }
            Request::MarkIdle { device } => {
                let (_, d) = self.find(&device)?;
                let (pages, idle) = match self.sup.tier(&d, &Order::MarkIdle)? {
                    Answer::MarkedIdle { pages, idle } => (pages, idle),
                    a => return Err(unexpected(a)),
                };
                tracing::info!(device = %d.spec.name, pages, idle, "marked idle");
                Self::reply(MarkedIdle {
                    device: d.spec.name.clone(),
                    pages_marked: pages,
                    pages_idle: idle,
                })
            }
            Request::Recompress {
                device,
                idle,
                huge,
                algo,
            } => {
                let (_, d) = self.find(&device)?;
                let codec = algo.unwrap_or(d.spec.tier.recompress_algo);
                if codec == d.spec.algo {
                    return Err(Error::Invalid(format!(
                        "device {} already stores with {codec}; recompression needs another codec (such as zstd:3)",
                        d.spec.name
                    )));
                }
                let filter = TierFilter {
                    idle,
                    huge,
                    ..TierFilter::default()
                };
                let order = Order::Recompress {
                    filter,
                    algo: codec,
                };
                let Answer::Recompressed {
                    tried,
                    pages,
                    saved_bytes,
                    freed_bytes,
                } = self.sup.tier(&d, &order)?
                else {
                    return Err(Error::WorkerAnswer("not the one asked for".into()));
                };
                tracing::info!(device = %d.spec.name, algo = %codec, tried, pages, saved_bytes, freed_bytes, "recompressed");
                Self::reply(Recompressed {
                    device: d.spec.name.clone(),
                    algo: codec,
                    pages_tried: tried,
                    pages_recompressed: pages,
                    saved_bytes,
                    freed_bytes,
                })
            }
            Request::Writeback {
                device,
                idle,
                cold,
                huge,
                incompressible,
                max_pages,
            } => {
                let (_, d) = self.find(&device)?;
                let filter = TierFilter {
                    idle,
                    cold,
                    huge,
                    incompressible,
                };
                let Answer::WrittenBack { pages, freed_bytes } =
                    self.sup.tier(&d, &Order::Writeback { filter, max_pages })?
                else {
                    return Err(Error::WorkerAnswer("not the one asked for".into()));
                };
                tracing::info!(device = %d.spec.name, pages, freed_bytes, "wrote pages back");
                Self::reply(WrittenBack {
                    device: d.spec.name.clone(),
                    pages_written: pages,
                    freed_bytes,
                })
            }
        }
    }

    fn migrate(
        &self,
        device: &DeviceRef,
        to: &Addr,
        keep: bool,
        client_gone: &(dyn Fn() -> bool + Sync),
    ) -> Result<Value> {
        let (_, d) = self.find(device)?;
        if d.cells.migration.incoming() {
            return Err(Error::Incoming(d.spec.name.clone()));
        }
        let Answer::Sent {
            pages,
            bytes,
            records,
            passes,
            final_records,
            final_micros,
            total_micros,
        } = self.sup.migrate(&d, to, keep, client_gone)?
        else {
            return Err(Error::WorkerAnswer("not the one asked for".into()));
        };
        let secs = total_micros as f64 / 1e6;
        tracing::info!(device = %d.spec.name, to = %to, pages, bytes, passes, final_ms = final_micros as f64 / 1000.0, secs, "migrated");
        Self::reply(Migrated {
            device: d.spec.name.clone(),
            to: to.to_string(),
            pages,
            bytes,
            records,
            passes,
            final_records,
            final_ms: final_micros as f64 / 1000.0,
            seconds: secs,
            rate_mib_s: if secs > 0.0 {
                bytes as f64 / secs / (1 << 20) as f64
            } else {
                0.0
            },
            kept: keep,
        })
    }

    /// A device for `add`, from `--device` syntax, checked as the command
    /// line checks it (a name is made up if none is given).
    fn new_device(&self, text: &str) -> Result<DeviceSpec> {
        let draft =
            crate::config::parse_device_spec(text).map_err(|e| Error::Invalid(e.to_string()))?;
        let host = self.sup.pool.host_mem_limit();
        let cfg = crate::config::DaemonConfig::build(Some(host), None, None, vec![draft])
            .map_err(|e| Error::Invalid(e.to_string()))?;
        cfg.devices
            .into_iter()
            .next()
            .ok_or_else(|| Error::Invalid("no device".into()))
    }

    fn stat(&self) -> StatReply {
        let devices = self
            .devices()
            .iter()
            .map(|(i, d)| {
                let stats = d.cells.stats(d.spec.size);
                let t = &d.spec.tier;
                let tier = TierStat {
                    backing: d.backing.as_ref().map(|b| BackingStat {
                        path: b.path.clone(),
                        blocks: b.blocks,
                        // Each written-back page holds one block.
                        used_blocks: stats.backed_pages,
                        direct_io: b.direct,
                    }),
                    recompress_algo: t.recompress_algo,
                    idle_after_secs: t.idle_after.map(|d| d.as_secs()),
                    auto_writeback: t.auto_writeback,
                    auto_recompress: t.auto_recompress,
                };
                let m = &d.cells.migration;
                let migration = MigrationStat {
                    state: migration_state(m.phase()),
                    incoming: d.spec.incoming.as_ref().map(|a| a.to_string()),
                    error: d.migration.error(),
                    bytes: m.bytes.load(Ordering::Relaxed),
                    records: m.records.load(Ordering::Relaxed),
                    pass: m.pass.load(Ordering::Relaxed),
                    dirty_slots: m.dirty.load(Ordering::Relaxed),
                    final_ms: m.final_micros.load(Ordering::Relaxed) as f64 / 1000.0,
                    total_ms: m.total_micros.load(Ordering::Relaxed) as f64 / 1000.0,
                };
                DeviceStat {
                    index: *i,
                    name: d.spec.name.clone(),
                    socket: d.spec.socket.clone(),
                    size_bytes: d.spec.size,
                    queues: d.spec.queues,
                    algo: d.spec.algo,
                    readonly: d.spec.readonly,
                    serial: d.spec.serial.clone(),
                    connected: d.connected.load(Ordering::Relaxed),
                    state: d.state_dir().to_path_buf(),
                    state_bytes: d.state_bytes(),
                    state_damaged: d.stats_guard.as_ref().is_some_and(|g| g.hit()),
                    connections: d.cells.connections.load(Ordering::Relaxed),
                    worker: self.sup.worker_status(d),
                    stats,
                    tier,
                    migration,
                }
            })
            .collect();
        StatReply {
            pool: self.pool_stats(),
            devices,
            metrics: self.metrics.map(|a| a.to_string()),
            state_dir: self.sup.state_dir().to_path_buf(),
            leftovers: self
                .sup
                .registry
                .leftovers()
                .iter()
                .map(Into::into)
                .collect(),
        }
    }
}

/// The shared cells' migration phase as `stat` names it.
fn migration_state(p: Phase) -> MigrationState {
    match p {
        Phase::None => MigrationState::None,
        Phase::Incoming => MigrationState::Incoming,
        Phase::Receiving => MigrationState::Receiving,
        Phase::Failed => MigrationState::Failed,
        Phase::Sending => MigrationState::Sending,
        Phase::Sent => MigrationState::Sent,
        Phase::SendFailed => MigrationState::SendFailed,
        Phase::Received => MigrationState::Received,
        Phase::Prepared => MigrationState::Prepared,
        Phase::Copied => MigrationState::Copied,
        Phase::Committing => MigrationState::Committing,
    }
}

/// One control request line, parsed.
pub enum Line {
    Blank,
    Bad(String),
    Req(Request),
}

/// A refusal's line, with the daemon's version as every reply has.
fn refusal(why: &str) -> Value {
    serde_json::to_value(Head::refused(why)).unwrap_or_default()
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
        matches!(l, Line::Blank | Line::Bad(_) | Line::Req(Request::Stat {}))
    }

    fn long(&self, l: &Line) -> bool {
        matches!(l, Line::Req(Request::Migrate { .. }))
    }

    fn answer_long(&self, l: Line, gone: &(dyn Fn() -> bool + Sync)) -> Reply {
        let bytes = match l {
            Line::Req(Request::Migrate { device, to, keep }) => {
                line_of(&self.line(self.migrate(&device, &to, keep, gone)))
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
            Line::Bad(e) => line_of(&refusal(&e)),
            Line::Req(r) => line_of(&self.answer_request(r)),
        };
        Reply {
            bytes,
            close: false,
        }
    }

    fn too_long(&self) -> Reply {
        Reply {
            bytes: self.closing("request line too long"),
            close: true,
        }
    }

    fn closing(&self, why: &str) -> Vec<u8> {
        line_of(&refusal(why))
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
mod tests {
    use super::super::WorkerEnv;
    use super::*;
    use crate::proto::worker_spec::{LogLevel, SeccompMode};
    use serde_json::json;
    use vzram_store::{Codec, DeviceConfig, Pool, PoolConfig, StateSpec};

    /// One request line as the socket's server answers it.
    fn handle_line(c: &Control, line: &str) -> Value {
        let r = c.answer(c.parse(line.as_bytes()));
        assert!(!r.close);
        serde_json::from_slice(&r.bytes).unwrap()
    }

    /// A supervisor over two devices with state in a temporary directory;
    /// no launcher (nothing connects here).
    fn control(root: &std::path::Path) -> Control {
        let host = tempfile_in(root, "host");
        let pool = Pool::with_host_file(
            PoolConfig {
                host_mem_limit: 0,
                arena_bytes: 1 << 28,
            },
            &host,
        )
        .unwrap();
        let devices = ["a", "b"]
            .iter()
            .map(|n| {
                let mut dc = DeviceConfig::new(1 << 20, Codec::Lz4);
                dc.state = Some(StateSpec {
                    root: root.to_path_buf(),
                    name: n.to_string(),
                    existing: vzram_store::Existing::Discard,
                    ..StateSpec::default()
                });
                let store = pool.create_device(dc).unwrap();
                let files = store.state_files().unwrap().try_clone().unwrap();
                let listener =
                    std::os::unix::net::UnixListener::bind(root.join(format!("{n}.sock"))).unwrap();
                let spec = crate::config::DeviceSpec {
                    name: n.to_string(),
                    named: true,
                    socket: root.join(format!("{n}.sock")),
                    size: 1 << 20,
                    queues: 1,
                    algo: Codec::Lz4,
                    mem_limit: 0,
                    serial: n.to_string(),
                    readonly: false,
                    discard_segments: 1,
                    state_dir: None,
                    on_state: crate::config::OnState::Unsaid,
                    adopt: false,
                    tier: crate::config::TierSpec::none(Codec::Lz4),
                    incoming: None,
                };
                Arc::new(Served::new(spec, listener, files, None).unwrap())
            })
            .collect();
        let (launcher, _) = crate::proto::wire::seqpacket_pair().unwrap();
        let sup = Supervisor::new(
            devices,
            pool,
            host,
            launcher,
            WorkerEnv {
                seccomp: SeccompMode::Off,
                log_level: LogLevel::Info,
                log_format: Default::default(),
                socket_mode: 0o600,
                state_dir: root.to_path_buf(),
                compress_threads: None,
                incoming_timeout: std::time::Duration::from_secs(3600),
                incoming_mode: 0o600,
                tls: None,
                poll_us: None,
            },
        )
        .unwrap();
        Control::new(Arc::new(sup))
    }

    fn tempfile_in(dir: &std::path::Path, name: &str) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join(name))
            .unwrap()
    }

    fn limit(c: &Control, i: usize) -> u64 {
        c.devices()[i].1.cells.budget().limit()
    }

    /// What the client sends is what the daemon reads, field for field.
    #[test]
    fn typed_requests_round_trip() {
        let cases = [
            (Request::Stat {}, r#"{"cmd":"stat"}"#),
            (
                Request::SetLimit {
                    device: None,
                    host: true,
                    bytes: 5,
                },
                r#"{"cmd":"set-limit","host":true,"bytes":5}"#,
            ),
            (
                Request::SetLimit {
                    device: Some(DeviceRef::named("vm1")),
                    host: false,
                    bytes: 5,
                },
                r#"{"cmd":"set-limit","device":"vm1","bytes":5}"#,
            ),
            (Request::Compact { device: None }, r#"{"cmd":"compact"}"#),
            (
                Request::ResetMax {
                    device: Some(DeviceRef::Index(2)),
                },
                r#"{"cmd":"reset-max","device":2}"#,
            ),
            (
                Request::Add {
                    device: "socket=/a,size=1M".into(),
                },
                r#"{"cmd":"add","device":"socket=/a,size=1M"}"#,
            ),
            (
                Request::MarkIdle {
                    device: DeviceRef::named("vm1"),
                },
                r#"{"cmd":"mark-idle","device":"vm1"}"#,
            ),
            (
                Request::Recompress {
                    device: DeviceRef::named("vm1"),
                    idle: true,
                    huge: false,
                    algo: Some(Codec::Zstd { level: 3 }),
                },
                r#"{"cmd":"recompress","device":"vm1","idle":true,"algo":"zstd:3"}"#,
            ),
            (
                Request::Writeback {
                    device: DeviceRef::Index(0),
                    idle: false,
                    cold: true,
                    huge: false,
                    incompressible: true,
                    max_pages: Some(10),
                },
                r#"{"cmd":"writeback","device":0,"cold":true,"incompressible":true,"max_pages":10}"#,
            ),
        ];
        for (req, wire) in cases {
            assert_eq!(serde_json::to_string(&req).unwrap(), wire);
            let back: Request = serde_json::from_str(wire).unwrap();
            assert_eq!(serde_json::to_string(&back).unwrap(), wire);
        }
    }

    #[test]
    fn requests() {
        let root = std::env::temp_dir().join(format!("vzram-control-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let c = control(&root);
        // Framing: a line at a time, each no longer than MAX_LINE.
        assert_eq!(c.frame(b"{\"cmd\":"), Frame::Need);
        assert_eq!(c.frame(b"{}\n{}\n"), Frame::Request(3));
        assert_eq!(c.frame(&vec![b' '; MAX_LINE]), Frame::TooLong);
        let mut long = vec![b' '; MAX_LINE];
        long.push(b'\n');
        assert_eq!(c.frame(&long), Frame::TooLong);
        assert!(matches!(c.parse(b"  \n"), Line::Blank));
        assert!(c.answer(c.parse(b"\n")).bytes.is_empty());
        assert!(matches!(c.parse(b"\xff\n"), Line::Bad(_)));
        // Only what never waits is answered on the loop.
        assert!(c.quick(&c.parse(b"{\"cmd\":\"stat\"}\n")));
        assert!(c.quick(&c.parse(b"nonsense\n")));
        assert!(!c.quick(&c.parse(b"{\"cmd\":\"compact\"}\n")));
        assert!(c.too_long().close);
        let s = handle_line(&c, r#"{"cmd":"stat"}"#);
        assert_eq!(s["ok"], true);
        // Every reply says which daemon answered, refusals and bad lines too.
        assert_eq!(s["version"], crate::proto::VERSION, "{s}");
        for bad in [r#"{"cmd":"remove","device":"nope"}"#, "nonsense"] {
            let r = handle_line(&c, bad);
            assert_eq!(
                (&r["ok"], &r["version"]),
                (&json!(false), &json!(crate::proto::VERSION)),
                "{r}"
            );
        }
        assert_eq!(s["devices"].as_array().unwrap().len(), 2);
        assert_eq!(s["devices"][1]["name"], "b");
        assert_eq!(s["pool"]["devices"], 2);

        let r = handle_line(&c, r#"{"cmd":"set-limit","device":"b","bytes":65536}"#);
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(limit(&c, 1), 65536);
        let r = handle_line(&c, r#"{"cmd":"set-limit","device":0,"bytes":4096}"#);
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(limit(&c, 0), 4096);
        let r = handle_line(&c, r#"{"cmd":"set-limit","device":"1","bytes":8192}"#);
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(limit(&c, 1), 8192);
        // Above the device's size (1 MiB): refused, the limit unchanged.
        let r = handle_line(&c, r#"{"cmd":"set-limit","device":"b","bytes":2097152}"#);
        assert!(
            r["error"].as_str().unwrap().contains("above its size"),
            "{r}"
        );
        assert_eq!(limit(&c, 1), 8192);
        let r = handle_line(&c, r#"{"cmd":"set-limit","host":true,"bytes":1048576}"#);
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(c.sup.pool.host_mem_limit(), 1 << 20);
        let r = handle_line(&c, r#"{"cmd":"compact"}"#);
        assert_eq!(r["ok"], true, "{r}");
        // Tiering on a device no worker serves: done here.
        let r = handle_line(&c, r#"{"cmd":"mark-idle","device":"a"}"#);
        assert_eq!(
            (&r["ok"], &r["pages_marked"]),
            (&json!(true), &json!(0)),
            "{r}"
        );
        let r = handle_line(&c, r#"{"cmd":"recompress","device":"a","idle":true}"#);
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["algo"], "zstd:3", "the default for an lz4 device: {r}");
        let r = handle_line(&c, r#"{"cmd":"recompress","device":"a","algo":"lz4"}"#);
        assert!(
            r["error"].as_str().unwrap().contains("another codec"),
            "{r}"
        );
        let r = handle_line(&c, r#"{"cmd":"recompress","device":"a","algo":"gzip"}"#);
        assert!(r["error"].as_str().unwrap().contains("gzip"), "{r}");
        let r = handle_line(&c, r#"{"cmd":"writeback","device":"b","idle":true}"#);
        assert_eq!(
            r["error"], "device b has no backing file (give it backing-file=PATH)",
            "{r}"
        );
        let s = handle_line(&c, r#"{"cmd":"stat"}"#);
        assert_eq!(s["devices"][0]["tier"]["backing"], Value::Null, "{s}");
        assert_eq!(s["devices"][0]["stats"]["backed_pages"], 0, "{s}");

        for bad in [
            "nonsense",
            r#"{"cmd":"reboot"}"#,
            r#"{"cmd":"set-limit","bytes":1}"#,
            r#"{"cmd":"set-limit","device":"zz","bytes":1}"#,
            r#"{"cmd":"set-limit","device":5,"bytes":1}"#,
            r#"{"cmd":"set-limit","device":"a","host":true,"bytes":1}"#,
            r#"{"cmd":"stat","extra":1}"#,
        ] {
            let r = handle_line(&c, bad);
            assert_eq!(r["ok"], false, "{bad} → {r}");
            assert!(r["error"].is_string());
        }
        let r = handle_line(&c, r#"{"cmd":"compact","device":"vm9"}"#);
        assert_eq!(
            r["error"],
            "no device \"vm9\"; devices (by name or index): a (0), b (1)"
        );
        let r = handle_line(&c, r#"{"cmd":"compact","device":7}"#);
        assert!(r["error"]
            .as_str()
            .unwrap()
            .starts_with("no device 7; devices (by name or index): a (0), b (1)"));
        drop(c);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
