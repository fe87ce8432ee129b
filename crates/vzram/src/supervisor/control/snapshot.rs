//! What `stat` and `/metrics` report, read once from the shared counters
//! (no worker is asked) into one [`Snapshot`]: the stat reply is its
//! `stat`, and the Prometheus text is rendered from the whole of it.

use std::sync::atomic::Ordering;

use vzram_store::cells::Phase;
use vzram_store::{LatencySnapshot, Op, PoolStats};

use super::Control;
use crate::proto::control::{
    BackingStat, DeviceStat, MigrationStat, MigrationState, StatReply, TierStat,
};
use crate::supervisor::procstat::ProcessSample;
use crate::supervisor::worker_slot::Restart;

/// The daemon's numbers at one moment: what `stat` replies, and beside
/// each of its devices what only `/metrics` shows.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub stat: StatReply,
    /// `extra[i]` is `stat.devices[i]`'s.
    pub extra: Vec<DeviceExtra>,
}

/// Everything one scrape of `/metrics` reports: the numbers `stat`
/// reports, and the supervisor's own `process_*` numbers.
#[derive(Debug)]
pub struct Sample {
    pub snapshot: Snapshot,
    pub process: ProcessSample,
}

/// What `/metrics` shows of a device beyond its [`DeviceStat`].
#[derive(Debug, Clone, Default)]
pub struct DeviceExtra {
    /// Request latencies by operation.
    pub latency: Vec<(Op, LatencySnapshot)>,
    /// Worker restarts by reason (`Restart::name`).
    pub restarts: Vec<(&'static str, u64)>,
}

impl Control {
    /// The one place the counters are read, for `stat` and `/metrics`.
    pub fn snapshot(&self) -> Snapshot {
        let devices = self.devices();
        let extra = devices
            .iter()
            .map(|(_, d)| DeviceExtra {
                latency: d.cells.latencies(),
                restarts: Restart::ALL
                    .iter()
                    .map(|r| (r.name(), d.worker.restarts(*r)))
                    .collect(),
            })
            .collect();
        Snapshot {
            stat: self.stat_of(&devices),
            extra,
        }
    }

    /// The numbers for `/metrics` (its thread adds the process's own).
    pub fn sample(&self) -> Sample {
        Sample {
            snapshot: self.snapshot(),
            process: Default::default(),
        }
    }

    fn stat_of(
        &self,
        devices: &[(usize, std::sync::Arc<crate::supervisor::served::Served>)],
    ) -> StatReply {
        let devices: Vec<DeviceStat> = devices
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
                // The owner marks a move failed before this process has
                // its reason: until then it is still under way.
                let state = match m.phase() {
                    Phase::Failed if d.migration.arriving() => MigrationState::Receiving,
                    Phase::SendFailed if d.migration.settling() => MigrationState::Sending,
                    p => migration_state(p),
                };
                let migration = MigrationStat {
                    state,
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
                    connected: d.worker.connected(),
                    state: d.state_dir().to_path_buf(),
                    state_bytes: d.state_bytes(),
                    state_damaged: d.stats_guard.as_ref().is_some_and(|g| g.hit()),
                    connections: d.cells.connections.load(Ordering::Relaxed),
                    worker: d.worker.status(),
                    stats,
                    tier,
                    migration,
                }
            })
            .collect();
        // The pool's totals are the devices' numbers read above, with the
        // host budget.
        let mut pool = PoolStats::default();
        for d in &devices {
            pool.add(&d.stats);
        }
        let host = self.sup.pool.host_cells().budget();
        pool.mem_used_total = host.used();
        pool.mem_used_max = host.max();
        pool.mem_limit = host.limit();
        let staging = self.sup.pool.host_cells().staging();
        pool.staging_limit = staging.limit();
        pool.staging_used = staging.used();
        StatReply {
            pool,
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
pub(super) fn migration_state(p: Phase) -> MigrationState {
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
