//! Counters and budgets that several processes share: the host-wide budget
//! (one memory file per daemon) and each device's budget and statistics (the
//! `stats` file of its state). A worker process serving a device updates
//! them in place; the daemon that supervises it reads them without asking,
//! and a device's numbers outlive the worker that wrote them.
//!
//! Every field is an atomic integer, so any bytes are a valid value and a
//! process killed mid-update leaves at worst one stale number, which the
//! next recovery recomputes from the slot table.

use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::error::Result;
use crate::limits::Budget;
use crate::mmap::Region;
use crate::stats::{self, Counters, DeviceStats};

/// Most allocator shards (queues) a device counts separately.
pub const MAX_SHARDS: usize = 64;

/// Types whose every bit pattern is a valid value (atomic integers only),
/// and which may therefore live in memory another process writes.
///
/// # Safety
/// Implementors must be `#[repr(C)]` structs of atomic integers (or arrays
/// or structs of them), with no padding that matters and no pointers.
pub unsafe trait Plain: Sync {}

// SAFETY: three AtomicU64, repr(C).
unsafe impl Plain for Budget {}
// SAFETY: repr(C) of a Budget and AtomicU64s.
unsafe impl Plain for HostCells {}
// SAFETY: repr(C) of a Budget, AtomicU64s and an array of Counters (atomics).
unsafe impl Plain for DeviceCells {}

/// A `T` in a memory mapping: private and zeroed, or shared through a file
/// (a memfd or a state file) that other processes map too.
pub struct Cells<T: Plain> {
    region: Region,
    _t: PhantomData<T>,
}

impl<T: Plain> Cells<T> {
    /// Zeroed cells of this process alone.
    pub fn private() -> Result<Cells<T>> {
        Ok(Cells {
            region: Region::reserve(std::mem::size_of::<T>())?,
            _t: PhantomData,
        })
    }

    /// The cells kept in `file`, grown to hold them if it is shorter (new
    /// bytes read as zero).
    pub fn shared(file: &std::fs::File) -> Result<Cells<T>> {
        let need = std::mem::size_of::<T>() as u64;
        let len = file
            .metadata()
            .map_err(|e| crate::StoreError::Map(format!("stat of a counters file: {e}")))?
            .len();
        if len < need {
            file.set_len(need)
                .map_err(|e| crate::StoreError::Map(format!("growing a counters file: {e}")))?;
        }
        Ok(Cells {
            region: Region::map_file(file, need as usize)?,
            _t: PhantomData,
        })
    }
}

impl<T: Plain> Deref for Cells<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the region is at least size_of::<T>() bytes, page aligned
        // (so aligned for T), lives as long as self, and T is Plain: any
        // bytes are a valid T and all access is through atomics.
        unsafe { &*self.region.as_ptr().cast::<T>() }
    }
}

/// What every device of a daemon shares: the host budget.
#[repr(C)]
#[derive(Default)]
pub struct HostCells {
    pub(crate) budget: Budget,
    /// Random and fixed when the cells are made: tells whether a device's
    /// charge (`DeviceCells::charged_to`) is already in this budget.
    pub(crate) id: AtomicU64,
}

impl HostCells {
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Gives the cells their id if they have none yet (a fresh file).
    pub(crate) fn init_id(&self) -> u64 {
        let id = crate::state::random_id() | 1;
        match self.id.compare_exchange(0, id, Relaxed, Relaxed) {
            Ok(_) => id,
            Err(existing) => existing,
        }
    }

    pub fn id(&self) -> u64 {
        self.id.load(Relaxed)
    }
}

/// One device's budget and statistics.
#[repr(C)]
pub struct DeviceCells {
    pub(crate) budget: Budget,
    /// The `HostCells::id` whose budget holds this device's `budget.used`.
    pub(crate) charged_to: AtomicU64,
    /// Gauges only the serving process can measure, published by it.
    pub(crate) spans: AtomicU64,
    pub(crate) table_bytes: AtomicU64,
    /// Frontends the device's server has accepted (after their first
    /// message passed its checks); the serving layer counts them here so
    /// that a supervisor sees them without asking.
    pub connections: AtomicU64,
    pub(crate) counters: [Counters; MAX_SHARDS],
}

impl DeviceCells {
    /// The device's statistics as last published, for a process that does
    /// not map the device itself.
    pub fn stats(&self, size_bytes: u64) -> DeviceStats {
        let mut s = DeviceStats::default();
        stats::sum(&self.counters, &mut s);
        s.mem_used_total = self.budget.used();
        s.mem_used_max = self.budget.max();
        s.mem_limit = self.budget.limit();
        s.table_bytes = self.table_bytes.load(Relaxed);
        s.meta_bytes = s.table_bytes
            + self.spans.load(Relaxed)
                * std::mem::size_of::<crate::pool::arena::SpanHeader>() as u64;
        s.size_bytes = size_bytes;
        s
    }

    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Gives back this device's charge to the host budget it is in, for a
    /// device removed for good.
    pub fn release(&self, host: &HostCells) {
        if self.charged_to.load(Relaxed) == host.id() {
            host.budget.uncharge(self.budget.used());
            self.charged_to.store(0, Relaxed);
        }
    }
}
