//! What `stat` and `/metrics` report, read from the shared counters (no
//! worker is asked).

use std::sync::atomic::Ordering;

use vzram_store::cells::Phase;
use vzram_store::PoolStats;

use super::Control;
use crate::proto::control::{
    BackingStat, DeviceStat, MigrationStat, MigrationState, StatReply, TierStat,
};
use crate::supervisor::metrics::{DeviceSample, MigrationSample, Sample};

impl Control {
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
                    restarts: crate::supervisor::served::Restart::ALL
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
                .leftovers_mut()
                .iter()
                .map(|l| (l.name.clone(), l.bytes))
                .collect(),
            // The metrics thread fills it in (procstat).
            process: Default::default(),
        }
    }

    pub(super) fn stat_reply(&self) -> StatReply {
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
                    error: d
                        .migration_error
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .clone(),
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
            leftovers: self.sup.leftovers_mut().iter().map(Into::into).collect(),
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
