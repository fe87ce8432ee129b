//! The per-device slot table: one atomic 64-bit word per 4 KiB slot, in a
//! lazily backed mapping. A 1 TiB device reserves 2 GiB of address space but
//! only the table pages that cover written slots cost RAM.

use std::sync::atomic::AtomicU64;

use crate::error::Result;
use crate::mmap::{Region, OS_PAGE};

pub struct SlotTable {
    words: Region,
    slots: u64,
}

impl SlotTable {
    pub fn new(slots: u64) -> Result<SlotTable> {
        let bytes = usize::try_from(slots.max(1) * 8).map_err(|_| {
            crate::StoreError::InvalidConfig(format!("{slots} slots do not fit in memory"))
        })?;
        Ok(SlotTable {
            words: Region::reserve(bytes)?,
            slots,
        })
    }

    #[inline]
    pub fn len(&self) -> u64 {
        self.slots
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.slots == 0
    }

    /// The word of `slot`; the caller has checked `slot < len()`.
    #[inline]
    pub fn word(&self, slot: u64) -> &AtomicU64 {
        assert!(slot < self.slots);
        // SAFETY: slot is in bounds, the mapping is 8-byte aligned (page
        // aligned) and zero-filled, and zero is a valid AtomicU64.
        unsafe { &*(self.words.as_ptr() as *const AtomicU64).add(slot as usize) }
    }

    /// Which pages of the table are backed by RAM right now (from mincore).
    /// If mincore fails every page counts as resident, which is only slower.
    pub fn resident_pages(&self) -> Vec<bool> {
        let pages = self.words.len() / OS_PAGE;
        let mut vec = vec![0u8; pages];
        // SAFETY: the region is one mapping of `len` bytes and `vec` has one
        // byte per page of it, as mincore requires.
        let rc = unsafe {
            libc::mincore(
                self.words.as_ptr().cast(),
                self.words.len(),
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return vec![true; pages];
        }
        vec.iter().map(|&b| b & 1 != 0).collect()
    }

    /// Bytes of the table backed by RAM right now.
    pub fn resident_bytes(&self) -> u64 {
        self.resident_pages().iter().filter(|&&r| r).count() as u64 * OS_PAGE as u64
    }
}
