//! The pool as its users see it: devices created in it share one host-wide
//! memory budget, and it can report on and compact them all.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::backing::Backing;
use crate::cells::HostCells;
use crate::device::{Device, DeviceConfig};
use crate::error::Result;
use crate::pool::{PoolConfig, Shared};
use crate::state::StateFiles;
use crate::stats::PoolStats;

/// A pool of devices: the host budget they share, and the registry that
/// stats and compaction walk.
pub struct Pool {
    pub(crate) shared: Arc<Shared>,
    // Only stats and compaction walk this list; the I/O path never does.
    devices: Mutex<Vec<Weak<Device>>>,
}

impl Pool {
    pub fn new(cfg: PoolConfig) -> Result<Arc<Pool>> {
        Ok(Arc::new(Pool {
            shared: Arc::new(Shared::new(&cfg, None)?),
            devices: Mutex::new(Vec::new()),
        }))
    }

    /// A pool whose host budget lives in `file`, shared with every other
    /// process that maps it (the worker processes of one daemon). The
    /// limit in `cfg` applies only if the file is new.
    pub fn with_host_file(cfg: PoolConfig, file: &std::fs::File) -> Result<Arc<Pool>> {
        Ok(Arc::new(Pool {
            shared: Arc::new(Shared::new(&cfg, Some(file))?),
            devices: Mutex::new(Vec::new()),
        }))
    }

    /// Serves a device from a state another process opened and handed over
    /// (see [`StateFiles::from_files`]); it is recovered from its slot table.
    pub fn attach_device(
        self: &Arc<Self>,
        cfg: DeviceConfig,
        mut files: StateFiles,
        backing: Option<Backing>,
    ) -> Result<Arc<Device>> {
        // Whoever opened it, a handed-over state may hold data by now.
        files.existing = true;
        let dev = Device::with_state(self.shared.clone(), cfg, Some(files), backing)?;
        Ok(self.register(dev))
    }

    /// The host budget's cells.
    pub fn host_cells(&self) -> &HostCells {
        &self.shared.cells
    }

    /// Creates a device that allocates from this pool.
    pub fn create_device(self: &Arc<Self>, cfg: DeviceConfig) -> Result<Arc<Device>> {
        let dev = Device::new(self.shared.clone(), cfg)?;
        Ok(self.register(dev))
    }

    fn register(&self, dev: Device) -> Arc<Device> {
        let dev = Arc::new(dev);
        let mut list = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        list.retain(|d| d.strong_count() > 0);
        list.push(Arc::downgrade(&dev));
        dev
    }

    /// Live devices, in creation order.
    pub fn devices(&self) -> Vec<Arc<Device>> {
        let list = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        list.iter().filter_map(Weak::upgrade).collect()
    }

    pub fn set_host_mem_limit(&self, bytes: u64) {
        self.shared.host().set_limit(bytes);
    }

    pub fn host_mem_limit(&self) -> u64 {
        self.shared.host().limit()
    }

    /// Sets the host-wide staging budget (0: no device stages; pages
    /// staged stay until compressed).
    pub fn set_host_staging(&self, bytes: u64) {
        self.shared.host_staging().set_limit(bytes);
    }

    pub fn host_staging(&self) -> u64 {
        self.shared.host_staging().limit()
    }

    pub fn reset_mem_used_max(&self) {
        self.shared.host().reset_max();
    }

    pub fn stats(&self) -> PoolStats {
        let mut s = PoolStats::default();
        for d in self.devices() {
            s.add(&d.stats());
        }
        s.mem_used_total = self.shared.host().used();
        s.mem_used_max = self.shared.host().max();
        s.mem_limit = self.shared.host().limit();
        s.staging_limit = self.shared.host_staging().limit();
        s.staging_used = self.shared.host_staging().used();
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
