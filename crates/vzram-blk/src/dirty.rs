//! The dirty bitmap of guest memory regions: vhost-user-backend's
//! [`BitmapMmapRegion`], which also remembers the log it was pointed at.
//!
//! The crate points every region's bitmap at the frontend's log when
//! SET_LOG_BASE comes, but a memory table sent later (SET_MEM_TABLE,
//! ADD_MEM_REG) brings new regions whose bitmaps point nowhere: our writes
//! there would go unlogged, and QEMU, which sends SET_LOG_BASE again only
//! when the log must grow, would migrate stale pages. With the log at hand,
//! [`carry_log`] points the new regions at it before the queues see them.

use std::io;
use std::sync::{Arc, Mutex};

use vhost_user_backend::bitmap::{
    AtomicBitmapMmap, BitmapMmapRegion, BitmapReplace, MemRegionBitmap, MmapLogReg,
};
use vm_memory::bitmap::{Bitmap, BitmapSlice, WithBitmapSlice};
use vm_memory::mmap::NewBitmap;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// The log a region's bitmap points at, shared by the region and every
/// slice of it.
type LogSlot = Arc<Mutex<Option<Arc<MmapLogReg>>>>;

/// A region's dirty bitmap: marks go to [`BitmapMmapRegion`].
#[derive(Default, Debug, Clone)]
pub struct LogBitmap {
    marks: BitmapMmapRegion,
    log: LogSlot,
}

/// What SET_LOG_BASE installs in each region: its part of the log.
pub struct RegionLog {
    bitmap: AtomicBitmapMmap,
    log: Arc<MmapLogReg>,
}

impl MemRegionBitmap for RegionLog {
    fn new<R: GuestMemoryRegion>(region: &R, log: Arc<MmapLogReg>) -> io::Result<Self> {
        Ok(RegionLog {
            // Fails if the log does not cover the whole region.
            bitmap: AtomicBitmapMmap::new(region, log.clone())?,
            log,
        })
    }
}

impl BitmapReplace for LogBitmap {
    type InnerBitmap = RegionLog;

    fn replace(&self, inner: RegionLog) {
        *self.log.lock().unwrap_or_else(|e| e.into_inner()) = Some(inner.log);
        self.marks.replace(inner.bitmap);
    }
}

impl Bitmap for LogBitmap {
    fn mark_dirty(&self, offset: usize, len: usize) {
        self.marks.mark_dirty(offset, len)
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.marks.dirty_at(offset)
    }

    fn slice_at(&self, offset: usize) -> Self {
        LogBitmap {
            marks: self.marks.slice_at(offset),
            log: self.log.clone(),
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
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Points every region of `new` that logs nowhere at the log the regions
/// of `old` log to, if any. A region the log does not cover is an error:
/// its writes could not be logged.
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
