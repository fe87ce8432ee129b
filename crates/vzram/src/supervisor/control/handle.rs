//! One handler per control request, each returning the reply its
//! [`Command`] names.

use super::snapshot::migration_state;
use super::Control;
use crate::config::DeviceSpec;
use crate::proto::control::{
    cmd, Added, Command, Committed, Compacted, DeviceLimitSet, Done, Forgotten, HostLimitSet,
    LimitSet, MarkedIdle, Migrated, NewDevice, Recompressed, Removed, Reset, WrittenBack,
};
use crate::proto::order::{self, TierFilter};
use crate::supervisor::error::{Error, Result};
use crate::supervisor::opening::Adding;
use crate::supervisor::reload::Cause;

/// What `C` replies, from its handler.
type Reply<C> = Result<<C as Command>::Reply>;

impl Control {
    pub(super) fn stat(&self, _: cmd::Stat) -> Reply<cmd::Stat> {
        Ok(self.snapshot().stat)
    }

    pub(super) fn reload(&self, _: cmd::Reload) -> Reply<cmd::Reload> {
        match &self.reloads {
            Some(r) => Ok(r.now(Cause::Control)?),
            None => Err(Error::Invalid("this daemon cannot reload".into())),
        }
    }

    pub(super) fn set_limit(&self, c: cmd::SetLimit) -> Reply<cmd::SetLimit> {
        match c {
            cmd::SetLimit {
                device: Some(_),
                host: true,
                ..
            } => Err(Error::Invalid(
                "give either \"device\" or \"host\":true, not both".into(),
            )),
            cmd::SetLimit {
                device: Some(r),
                bytes,
                ..
            } => {
                let (_, d) = self.find(&r)?;
                let warnings = self.sup.set_device_limit(&d, bytes)?;
                Ok(LimitSet::Device(DeviceLimitSet {
                    device: d.spec.name.clone(),
                    mem_limit: bytes,
                    warnings,
                }))
            }
            cmd::SetLimit {
                device: None,
                host: true,
                bytes,
            } => Ok(LimitSet::Host(HostLimitSet {
                host_mem_limit: bytes,
                warnings: self.sup.set_host_limit(bytes),
            })),
            cmd::SetLimit {
                device: None,
                host: false,
                ..
            } => Err(Error::Invalid(
                "set-limit needs \"device\" or \"host\":true".into(),
            )),
        }
    }

    pub(super) fn compact(&self, c: cmd::Compact) -> Reply<cmd::Compact> {
        let pages = match c.device {
            Some(r) => self.sup.compact(&self.find(&r)?.1)?,
            None => {
                // One device that cannot be compacted does not stop the
                // others.
                let mut pages = 0;
                for (_, d) in self.devices() {
                    match self.sup.compact(&d) {
                        Ok(n) => pages += n,
                        Err(e) => tracing::warn!(device = %d.spec.name, "not compacted: {e}"),
                    }
                }
                pages
            }
        };
        tracing::info!(pages, "compacted");
        Ok(Compacted {
            pages_compacted: pages,
        })
    }

    pub(super) fn add(&self, c: cmd::Add) -> Reply<cmd::Add> {
        let spec = self.new_device(*c.device)?;
        let name = spec.name.clone();
        let (index, recovered) = self.sup.add(spec, Adding::Requested)?;
        let state = self
            .sup
            .device(index)
            .map(|d| d.files.dir.clone())
            .unwrap_or_default();
        Ok(Added {
            device: name,
            index,
            recovered,
            state,
        })
    }

    pub(super) fn forget(&self, c: cmd::Forget) -> Reply<cmd::Forget> {
        let l = self.sup.forget(&c.name)?;
        Ok(Forgotten {
            name: l.name,
            dir: l.dir,
            size_bytes: l.size_bytes,
        })
    }

    pub(super) fn remove(&self, c: cmd::Remove) -> Reply<cmd::Remove> {
        let (i, d) = self.find(&c.device)?;
        let name = d.spec.name.clone();
        drop(d);
        let kept = self.sup.remove(i, c.force)?;
        Ok(Removed {
            device: name,
            removed: true,
            kept,
        })
    }

    pub(super) fn reset(&self, c: cmd::Reset) -> Reply<cmd::Reset> {
        let (_, d) = self.find(&c.device)?;
        let pages = self.sup.reset(&d, c.force)?;
        tracing::info!(device = %d.spec.name, pages, "reset: data dropped");
        Ok(Reset {
            device: d.spec.name.clone(),
            pages_dropped: pages,
        })
    }

    pub(super) fn reset_max(&self, c: cmd::ResetMax) -> Reply<cmd::ResetMax> {
        match c.device {
            Some(r) => self.find(&r)?.1.cells.budget().reset_max(),
            None => {
                for (_, d) in self.devices() {
                    d.cells.budget().reset_max();
                }
                self.sup.pool.reset_mem_used_max();
            }
        }
        Ok(Done {})
    }

    pub(super) fn commit_migration(&self, c: cmd::CommitMigration) -> Reply<cmd::CommitMigration> {
        let (_, d) = self.find(&c.device)?;
        self.sup.commit_migration(&d)?;
        tracing::info!(device = %d.spec.name, "migration commit asked by the operator");
        Ok(Committed {
            device: d.spec.name.clone(),
            state: migration_state(d.cells.migration.phase()),
        })
    }

    pub(super) fn cancel_migration(&self, c: cmd::CancelMigration) -> Reply<cmd::CancelMigration> {
        let (_, d) = self.find(&c.device)?;
        self.sup.cancel_migration(&d)?;
        tracing::warn!(device = %d.spec.name, "migration cancelled by the operator");
        Ok(Committed {
            device: d.spec.name.clone(),
            state: migration_state(d.cells.migration.phase()),
        })
    }

    pub(super) fn mark_idle(&self, c: cmd::MarkIdle) -> Reply<cmd::MarkIdle> {
        let (_, d) = self.find(&c.device)?;
        let order::MarkedIdle { pages, idle } = self.sup.tier(&d, &order::MarkIdle)?;
        tracing::info!(device = %d.spec.name, pages, idle, "marked idle");
        Ok(MarkedIdle {
            device: d.spec.name.clone(),
            pages_marked: pages,
            pages_idle: idle,
        })
    }

    pub(super) fn recompress(&self, c: cmd::Recompress) -> Reply<cmd::Recompress> {
        let (_, d) = self.find(&c.device)?;
        let codec = c.algo.unwrap_or(d.spec.tier.recompress_algo);
        if codec == d.spec.algo {
            return Err(Error::Invalid(format!(
                "device {} already stores with {codec}; recompression needs another codec (such as zstd:3)",
                d.spec.name
            )));
        }
        let filter = TierFilter {
            idle: c.idle,
            huge: c.huge,
            ..TierFilter::default()
        };
        let order = order::Recompress {
            filter,
            algo: codec,
        };
        let order::Recompressed {
            tried,
            pages,
            saved_bytes,
            freed_bytes,
        } = self.sup.tier(&d, &order)?;
        tracing::info!(device = %d.spec.name, algo = %codec, tried, pages, saved_bytes, freed_bytes, "recompressed");
        Ok(Recompressed {
            device: d.spec.name.clone(),
            algo: codec,
            pages_tried: tried,
            pages_recompressed: pages,
            saved_bytes,
            freed_bytes,
        })
    }

    pub(super) fn writeback(&self, c: cmd::Writeback) -> Reply<cmd::Writeback> {
        let (_, d) = self.find(&c.device)?;
        let filter = TierFilter {
            idle: c.idle,
            cold: c.cold,
            huge: c.huge,
            incompressible: c.incompressible,
        };
        let order = order::Writeback {
            filter,
            max_pages: c.max_pages,
        };
        let order::WrittenBack { pages, freed_bytes } = self.sup.tier(&d, &order)?;
        tracing::info!(device = %d.spec.name, pages, freed_bytes, "wrote pages back");
        Ok(WrittenBack {
            device: d.spec.name.clone(),
            pages_written: pages,
            freed_bytes,
        })
    }

    /// Sends a device away; `client_gone` says whether the client that
    /// asked has hung up (the migration is then called off).
    pub(super) fn migrate(
        &self,
        c: &cmd::Migrate,
        client_gone: &(dyn Fn() -> bool + Sync),
    ) -> Reply<cmd::Migrate> {
        let (to, keep) = (&c.to, c.keep);
        let (_, d) = self.find(&c.device)?;
        if d.cells.migration.incoming() {
            return Err(Error::Incoming(d.spec.name.clone()));
        }
        let order::Sent {
            pages,
            bytes,
            records,
            passes,
            final_records,
            final_micros,
            total_micros,
        } = self.sup.migrate(&d, to, keep, client_gone)?;
        let secs = total_micros as f64 / 1e6;
        tracing::info!(device = %d.spec.name, to = %to, pages, bytes, passes, final_ms = final_micros as f64 / 1000.0, secs, "migrated");
        Ok(Migrated {
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

    /// A device for `add`, checked as the command line checks one (a
    /// name is made up if none is given), and against the daemon's own
    /// control socket.
    fn new_device(&self, device: NewDevice) -> Result<DeviceSpec> {
        let invalid = |e: crate::config::ConfigError| Error::Invalid(e.to_string());
        let draft = crate::config::DeviceDraft::from(device);
        let spec = DeviceSpec::check(0, draft, &mut Default::default()).map_err(invalid)?;
        spec.check_beside(self.sup.control()).map_err(invalid)?;
        Ok(spec)
    }
}
