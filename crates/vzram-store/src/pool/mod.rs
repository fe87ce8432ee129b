//! The pool's memory machinery: size classes, each device's arena and heap,
//! and what all devices share ([`Shared`]: the classes and the host-wide
//! budget). Each device's objects live in its own arena, so each device's
//! state can be its own files. The registry of devices is the crate's `Pool`.

pub(crate) mod arena;
pub mod class;
pub(crate) mod heap;

use crate::cells::{Cells, HostCells};
use crate::error::Result;
use crate::limits::Budget;

/// Default cap on the address space one device's arena may reserve. It
/// costs nothing until used.
pub const DEFAULT_ARENA_BYTES: u64 = 1 << 40;

#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Host-wide cap on pool memory, in bytes; 0 = unlimited.
    pub host_mem_limit: u64,
    /// Most address space one device's arena may reserve (each reserves
    /// what its size can need, up to this).
    pub arena_bytes: u64,
    /// Host-wide cap on staged raw bytes, all devices together; 0: no
    /// device stages. Each device's own staging budget applies too.
    pub host_staging: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            host_mem_limit: 0,
            arena_bytes: DEFAULT_ARENA_BYTES,
            // A library user bounds staging per device.
            host_staging: u64::MAX,
        }
    }
}

/// What every device of a pool shares: the size classes and the host budget.
pub(crate) struct Shared {
    pub(crate) arena_cap: u64,
    /// The host budget, in memory other processes may share.
    pub(crate) cells: Cells<HostCells>,
    pub(crate) host_id: u64,
    pub(crate) classes: [class::Class; class::NUM_CLASSES],
}

impl Shared {
    /// With `host` the budget lives in that file (a memfd every worker of a
    /// daemon maps); its limit is set only if the file is new.
    pub(crate) fn new(cfg: &PoolConfig, host: Option<&std::fs::File>) -> Result<Shared> {
        let cells = match host {
            Some(f) => Cells::<HostCells>::shared(f)?,
            None => Cells::private()?,
        };
        let fresh = cells.id() == 0;
        let host_id = cells.init_id();
        if fresh {
            cells.budget.set_limit(cfg.host_mem_limit);
            cells.staging.set_limit(cfg.host_staging);
        }
        Ok(Shared {
            arena_cap: cfg.arena_bytes.min(crate::slot::MAX_ARENA_BYTES),
            cells,
            host_id,
            classes: class::classes(),
        })
    }

    #[inline]
    pub(crate) fn host(&self) -> &Budget {
        &self.cells.budget
    }

    #[inline]
    pub(crate) fn host_staging(&self) -> &Budget {
        &self.cells.staging
    }
}
