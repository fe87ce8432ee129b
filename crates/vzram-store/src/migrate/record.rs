//! What travels for one slot ([`Record`]), the buffers a device exports it
//! into, and the log of slots a migration must send again ([`DirtyLog`]).
//! The device uses these; the stream (`stream.rs`) uses the device.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::backing::AlignedPages;
use crate::error::StoreError;
use crate::{Page, PAGE_SIZE};

/// What one slot holds, as it travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record<'a> {
    Empty,
    Same(u64),
    /// A page compressed with codec `codec` (a slot word's codec id).
    Compressed {
        codec: u8,
        data: &'a [u8],
    },
    Raw(&'a Page),
}

/// The slots written or discarded since tracking started: one bit per slot,
/// made the first time a device is tracked. Writers pay one relaxed load
/// while tracking is off.
#[derive(Default)]
pub struct DirtyLog {
    on: AtomicBool,
    bits: OnceLock<Box<[AtomicU64]>>,
}

impl DirtyLog {
    /// Called after a slot's new word is published, so a pass that clears
    /// the bit and then reads the slot sees this write or sets it again.
    #[inline]
    pub(crate) fn mark(&self, slot: u64) {
        if self.on.load(Ordering::Relaxed) {
            self.mark_slow(slot);
        }
    }

    #[cold]
    fn mark_slow(&self, slot: u64) {
        if let Some(b) = self.bits.get() {
            b[(slot / 64) as usize].fetch_or(1 << (slot % 64), Ordering::SeqCst);
        }
    }

    pub(crate) fn start(&self, slots: u64) {
        let b = self
            .bits
            .get_or_init(|| (0..slots.div_ceil(64)).map(|_| AtomicU64::new(0)).collect());
        for w in b.iter() {
            w.store(0, Ordering::SeqCst);
        }
        self.on.store(true, Ordering::SeqCst);
    }

    pub(crate) fn stop(&self) {
        self.on.store(false, Ordering::SeqCst);
    }

    /// The slots marked since the last call, in order; their marks cleared.
    pub(crate) fn take(&self) -> Vec<u64> {
        let mut out = Vec::new();
        let Some(b) = self.bits.get() else {
            return out;
        };
        for (i, w) in b.iter().enumerate() {
            if w.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = w.swap(0, Ordering::SeqCst);
            while bits != 0 {
                out.push(i as u64 * 64 + u64::from(bits.trailing_zeros()));
                bits &= bits - 1;
            }
        }
        out
    }

    pub(crate) fn count(&self) -> u64 {
        self.bits.get().map_or(0, |b| {
            b.iter()
                .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
                .sum()
        })
    }
}

/// The buffers `Device::export` fills.
pub struct ExportBuf {
    pub(crate) page: Box<Page>,
    pub(crate) io: Option<AlignedPages>,
}

impl ExportBuf {
    pub fn new() -> Result<ExportBuf, StoreError> {
        Ok(ExportBuf {
            page: Box::new([0; PAGE_SIZE]),
            io: None,
        })
    }
}
