//! The dirty bitmap of guest memory regions, which SET_LOG_BASE points at
//! the frontend's log (one bit per 4 KiB page of guest address space).
//!
//! vhost-user-backend's own `BitmapMmapRegion` would do, but for two
//! things. It takes a lock on every write to guest memory, logging or not;
//! ours looks at a flag first, so a device that is not migrating pays one
//! load. And it forgets the log: a memory table sent after SET_LOG_BASE
//! (SET_MEM_TABLE, ADD_MEM_REG) brings regions whose bitmaps point nowhere,
//! and QEMU sends SET_LOG_BASE again only when the log must grow, so our
//! writes there would go unlogged and QEMU would migrate stale pages. With
//! the log at hand, [`carry_log`] points new regions at it before the queue
//! threads see them.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use vhost_user_backend::bitmap::{AtomicBitmapMmap, BitmapReplace, MemRegionBitmap, MmapLogReg};
use vm_memory::bitmap::{Bitmap, BitmapSlice, WithBitmapSlice};
use vm_memory::mmap::NewBitmap;
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// Bytes of guest memory per bit of the log (VHOST_LOG_PAGE).
const LOG_PAGE: u64 = 0x1000;

/// A region's part of the log.
#[derive(Debug)]
pub struct RegionLog {
    log: Arc<MmapLogReg>,
    /// Guest addresses of the region's first and last bytes.
    first: u64,
    last: u64,
}

impl MemRegionBitmap for RegionLog {
    fn new<R: GuestMemoryRegion>(region: &R, log: Arc<MmapLogReg>) -> io::Result<Self> {
        // Only to check that the log covers the whole region (its length
        // is not public): then no bit of the region is out of its bounds.
        AtomicBitmapMmap::new(region, log.clone())?;
        let first = region.start_addr().raw_value();
        let last = first
            .checked_add(region.len().saturating_sub(1))
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidData))?;
        Ok(RegionLog { log, first, last })
    }
}

impl RegionLog {
    /// Guest pages of `len` bytes at `offset` into the region, clipped to
    /// it; None if none of them is in it.
    fn pages(&self, offset: usize, len: usize) -> Option<std::ops::RangeInclusive<u64>> {
        let start = self.first.checked_add(offset as u64)?;
        if len == 0 || start > self.last {
            return None;
        }
        let end = start.saturating_add(len as u64 - 1).min(self.last);
        Some(start / LOG_PAGE..=end / LOG_PAGE)
    }

    fn bit(&self, page: u64) -> (&std::sync::atomic::AtomicU8, u8) {
        (&self.log[(page / 8) as usize], 1 << (page % 8))
    }
}

/// One region's log, shared by the region's bitmap and every slice of it.
#[derive(Debug, Default)]
struct Slot {
    /// Whether `log` is set; looked at on every write without the lock.
    active: AtomicBool,
    log: RwLock<Option<RegionLog>>,
}

/// A region's dirty bitmap, or a slice of it `base` bytes in.
#[derive(Debug, Default, Clone)]
pub struct LogBitmap {
    slot: Arc<Slot>,
    base: usize,
}

impl BitmapReplace for LogBitmap {
    type InnerBitmap = RegionLog;

    fn replace(&self, log: RegionLog) {
        *self.slot.log.write().unwrap_or_else(|e| e.into_inner()) = Some(log);
        self.slot.active.store(true, Ordering::Release);
    }
}

impl Bitmap for LogBitmap {
    fn mark_dirty(&self, offset: usize, len: usize) {
        if !self.slot.active.load(Ordering::Acquire) {
            return;
        }
        let guard = self.slot.log.read().unwrap_or_else(|e| e.into_inner());
        if let Some(log) = guard.as_ref() {
            for page in log
                .pages(self.base.saturating_add(offset), len)
                .into_iter()
                .flatten()
            {
                let (byte, bit) = log.bit(page);
                byte.fetch_or(bit, Ordering::Relaxed);
            }
        }
    }

    fn dirty_at(&self, offset: usize) -> bool {
        let guard = self.slot.log.read().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().is_some_and(|log| {
            log.pages(self.base.saturating_add(offset), 1)
                .is_some_and(|pages| {
                    let (byte, bit) = log.bit(*pages.start());
                    byte.load(Ordering::Relaxed) & bit != 0
                })
        })
    }

    fn slice_at(&self, offset: usize) -> Self {
        LogBitmap {
            slot: self.slot.clone(),
            base: self.base.saturating_add(offset),
        }
    }
}

impl BitmapSlice for LogBitmap {}

impl WithBitmapSlice<'_> for LogBitmap {
    type S = Self;
}

impl NewBitmap for LogBitmap {
    fn with_len(_len: usize) -> Self {
        Self::default()
    }
}

impl LogBitmap {
    fn current(&self) -> Option<Arc<MmapLogReg>> {
        let guard = self.slot.log.read().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().map(|l| l.log.clone())
    }
}

/// Points every region of `new` that logs nowhere at the log the regions
/// of `old` log to, if any. A region the log does not cover is an error:
/// our writes there could not be logged.
pub fn carry_log(
    old: &GuestMemoryMmap<LogBitmap>,
    new: &GuestMemoryMmap<LogBitmap>,
) -> io::Result<()> {
    let Some(log) = old.iter().find_map(|r| r.bitmap().current()) else {
        return Ok(());
    };
    // All first, so that a failure leaves every region as it was.
    let mut logs = Vec::new();
    for r in new.iter().filter(|r| r.bitmap().current().is_none()) {
        let inner = RegionLog::new(r, log.clone()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the dirty log does not cover the region at {:#x} ({e})",
                    r.start_addr().0
                ),
            )
        })?;
        logs.push((r, inner));
    }
    for (r, inner) in logs {
        r.bitmap().replace(inner);
    }
    Ok(())
}
