//! The shared compressed pool: the size classes and one host-wide budget
//! for every device of the process. Each device's objects live in its own
//! arena (see [`heap::Heap`]), so each device's state can be its own files.

pub(crate) mod arena;
pub mod class;
pub(crate) mod heap;

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::device::{Device, DeviceConfig};
use crate::error::Result;
use crate::limits::Budget;
use crate::stats::PoolStats;

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
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            host_mem_limit: 0,
            arena_bytes: DEFAULT_ARENA_BYTES,
        }
    }
}

pub struct Pool {
    pub(crate) arena_cap: u64,
    pub(crate) host: Budget,
    pub(crate) classes: [class::Class; class::NUM_CLASSES],
    // Only stats and compaction walk this list; the I/O path never does.
    devices: Mutex<Vec<Weak<Device>>>,
}

impl Pool {
    pub fn new(cfg: PoolConfig) -> Result<Arc<Pool>> {
        let bytes = cfg.arena_bytes.min(crate::slot::MAX_ARENA_BYTES);
        Ok(Arc::new(Pool {
            arena_cap: bytes,
            host: Budget::new(cfg.host_mem_limit),
            classes: class::classes(),
            devices: Mutex::new(Vec::new()),
        }))
    }

    /// Creates a device that allocates from this pool.
    pub fn create_device(self: &Arc<Self>, cfg: DeviceConfig) -> Result<Arc<Device>> {
        let dev = Arc::new(Device::new(self.clone(), cfg)?);
        let mut list = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        list.retain(|d| d.strong_count() > 0);
        list.push(Arc::downgrade(&dev));
        Ok(dev)
    }

    /// Live devices, in creation order.
    pub fn devices(&self) -> Vec<Arc<Device>> {
        let list = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        list.iter().filter_map(Weak::upgrade).collect()
    }

    pub fn set_host_mem_limit(&self, bytes: u64) {
        self.host.set_limit(bytes);
    }

    pub fn host_mem_limit(&self) -> u64 {
        self.host.limit()
    }

    pub fn reset_mem_used_max(&self) {
        self.host.reset_max();
    }

    pub fn stats(&self) -> PoolStats {
        let mut s = PoolStats::default();
        for d in self.devices() {
            s.add(&d.stats());
        }
        s.mem_used_total = self.host.used();
        s.mem_used_max = self.host.max();
        s.mem_limit = self.host.limit();
        s
    }

    /// Compacts every device; returns pages given back.
    pub fn compact(&self) -> u64 {
        self.devices().iter().map(|d| d.compact()).sum()
    }

    /// Compacts the devices whose pool memory exceeds their compressed data
    /// by more than `ratio` (e.g. 0.10 = 10%) and by at least `min_bytes`.
    pub fn compact_fragmented(&self, ratio: f64, min_bytes: u64) -> u64 {
        let mut pages = 0;
        for d in self.devices() {
            let s = d.stats();
            let waste = s.mem_used_total.saturating_sub(s.compr_data_size);
            if waste >= min_bytes && waste as f64 > s.compr_data_size as f64 * ratio {
                pages += d.compact();
            }
        }
        pages
    }

    /// Starts a thread that runs [`Pool::compact_fragmented`] every
    /// `interval`. It stops by itself once the pool is dropped.
    pub fn spawn_auto_compaction(
        self: &Arc<Self>,
        interval: Duration,
        ratio: f64,
        min_bytes: u64,
    ) -> std::io::Result<()> {
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("vzram-compact".into())
            .spawn(move || loop {
                std::thread::sleep(interval);
                let Some(pool) = weak.upgrade() else { return };
                let pages = pool.compact_fragmented(ratio, min_bytes);
                if pages > 0 {
                    tracing::debug!(pages, "auto-compaction gave pages back");
                }
            })?;
        Ok(())
    }
}
