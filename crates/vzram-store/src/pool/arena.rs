//! The arena: one big reservation carved into fixed 32 KiB blocks, one span
//! per block, plus a directory holding each block's span header. A span uses
//! the first 1..=8 pages of its block; the rest of the block is never touched
//! and costs no memory. Fixed blocks make "which span owns this object" a
//! shift, with no per-page map.

use std::sync::atomic::{AtomicU16, AtomicU32, Ordering::Relaxed};
use std::sync::Mutex;

use super::class::BLOCK_BYTES;
use crate::error::{Result, StoreError};
use crate::mmap::Region;

pub const NONE: u32 = u32::MAX;
pub const NO_OBJ: u16 = u16::MAX;

/// Flags in [`SpanHeader::flags`].
pub const IN_AVAIL: u8 = 1;
pub const EVACUATING: u8 = 2;

/// Per-span state, 20 bytes in the directory. Fields are atomics only so
/// that shared references are sound; every write happens under the owning
/// class shard's mutex. `class` and `shard` never change while the span has
/// live objects, which is what lets `free` find the right mutex.
#[repr(C)]
pub struct SpanHeader {
    pub class: AtomicU16,
    pub shard: AtomicU16,
    pub live: AtomicU16,
    pub bump: AtomicU16,
    pub free_head: AtomicU16,
    pub flags: AtomicU16,
    pub prev: AtomicU32,
    pub next: AtomicU32,
}

impl SpanHeader {
    pub fn flag(&self, f: u8) -> bool {
        self.flags.load(Relaxed) & u16::from(f) != 0
    }

    pub fn set_flag(&self, f: u8, on: bool) {
        let v = self.flags.load(Relaxed);
        let v = if on {
            v | u16::from(f)
        } else {
            v & !u16::from(f)
        };
        self.flags.store(v, Relaxed);
    }
}

struct FreeBlocks {
    /// Blocks never handed out start here.
    next: u32,
    /// Blocks given back; their pages were already returned to the OS.
    free: Vec<u32>,
}

pub struct Arena {
    mem: Region,
    dir: Region,
    blocks: u32,
    // Taken only when a span is created or dropped (once per dozens of
    // objects), never per page.
    free: Mutex<FreeBlocks>,
}

impl Arena {
    /// Where the objects are mapped, and how long the mapping is.
    pub(crate) fn mapping(&self) -> (*const u8, usize) {
        (self.mem.as_ptr(), self.mem.len())
    }

    /// An arena in anonymous memory, or in `file` (shared, `bytes` long).
    pub fn new(bytes: u64, file: Option<&std::fs::File>) -> Result<Arena> {
        let blocks = (bytes / BLOCK_BYTES as u64).min(u64::from(NONE - 1));
        if blocks == 0 {
            return Err(StoreError::InvalidConfig(format!(
                "arena of {bytes} bytes is smaller than one {BLOCK_BYTES}-byte block"
            )));
        }
        let mem = match file {
            Some(f) => Region::map_file(f, blocks as usize * BLOCK_BYTES)?,
            None => Region::reserve(blocks as usize * BLOCK_BYTES)?,
        };
        let dir = Region::reserve(blocks as usize * std::mem::size_of::<SpanHeader>())?;
        Ok(Arena {
            mem,
            dir,
            blocks: blocks as u32,
            free: Mutex::new(FreeBlocks {
                next: 0,
                free: Vec::new(),
            }),
        })
    }

    pub fn bytes(&self) -> u64 {
        u64::from(self.blocks) * BLOCK_BYTES as u64
    }

    /// Asks the CPU to load the object at `offset` and its span's header
    /// into cache. Only a hint: an offset outside the arena is ignored, and
    /// one whose page is gone costs nothing (prefetches do not fault).
    pub fn prefetch(&self, offset: u64) {
        if offset >= self.bytes() {
            return;
        }
        let block = (offset / BLOCK_BYTES as u64) as usize;
        crate::mmap::prefetch(
            self.dir
                .as_ptr()
                .wrapping_add(block * std::mem::size_of::<SpanHeader>()),
        );
        crate::mmap::prefetch(self.mem.as_ptr().wrapping_add(offset as usize));
    }

    #[inline]
    pub fn header(&self, block: u32) -> &SpanHeader {
        assert!(block < self.blocks);
        // SAFETY: the directory holds `blocks` zero-initialised headers and
        // all-zero bytes are a valid SpanHeader (plain atomics).
        unsafe { &*(self.dir.as_ptr() as *const SpanHeader).add(block as usize) }
    }

    /// Pointer to byte `offset` of the arena; `offset + len` must not pass the end.
    #[inline]
    pub fn ptr(&self, offset: u64, len: usize) -> *mut u8 {
        assert!(offset as usize + len <= self.mem.len());
        // SAFETY: bounds checked just above.
        unsafe { self.mem.as_ptr().add(offset as usize) }
    }

    /// After recovery: blocks below `next` that are not in use are free.
    /// Their pages, and every page from `next` on, are released here, in
    /// case a crash left bytes in them.
    pub fn restore(&self, next: u32, in_use: impl Fn(u32) -> bool) {
        let mut f = self.free.lock().unwrap_or_else(|e| e.into_inner());
        f.next = next;
        f.free = (0..next).rev().filter(|&b| !in_use(b)).collect();
        // One call per run of free blocks: punching holes is cheap, calls are not.
        let mut run: Option<(u32, u32)> = None;
        for &b in f.free.iter().rev().chain(std::iter::once(&u32::MAX)) {
            match run {
                Some((start, end)) if b == end => run = Some((start, end + 1)),
                _ => {
                    if let Some((start, end)) = run {
                        self.mem.release(
                            start as usize * BLOCK_BYTES,
                            (end - start) as usize * BLOCK_BYTES,
                        );
                    }
                    run = (b != u32::MAX).then(|| (b, b + 1));
                }
            }
        }
        // Past the last span in use: spans a killed process had made and
        // not used yet, and the spare spans it kept (`Heap::keep_spares`).
        self.mem.release(
            next as usize * BLOCK_BYTES,
            (self.blocks - next) as usize * BLOCK_BYTES,
        );
    }

    pub fn alloc_block(&self) -> Result<u32> {
        let mut f = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = f.free.pop() {
            return Ok(b);
        }
        if f.next >= self.blocks {
            return Err(StoreError::ArenaFull);
        }
        f.next += 1;
        Ok(f.next - 1)
    }

    /// Backs a new span's pages in one call: cheaper than taking a fault on
    /// each page as objects fill it.
    pub fn populate(&self, block: u32, pages: usize) -> std::io::Result<()> {
        self.mem
            .populate(block as usize * BLOCK_BYTES, pages * crate::PAGE_SIZE)
    }

    /// The descriptor [`Arena::write_unmapped`] writes through (the
    /// arena's state file), if any: a sandbox must let it be written.
    pub fn file_fd(&self) -> Option<std::os::fd::RawFd> {
        self.mem.file_fd()
    }

    /// Stores a new object's bytes through the file ([`Region::write_unmapped`]):
    /// for a span made without [`Arena::populate`].
    pub fn write_unmapped(&self, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
        self.mem.write_unmapped(offset as usize, bytes)
    }

    /// Clears a block's header: no class, no objects, on no list.
    pub fn clear_header(&self, block: u32) {
        let h = self.header(block);
        for a in [&h.class, &h.shard, &h.live, &h.bump, &h.free_head, &h.flags] {
            a.store(0, Relaxed);
        }
        h.prev.store(0, Relaxed);
        h.next.store(0, Relaxed);
    }

    /// Returns a block's first `pages` pages to the OS and the block to the
    /// free list. The next owner sees zeros, never old bytes.
    pub fn free_block(&self, block: u32, pages: usize) {
        self.mem
            .release(block as usize * BLOCK_BYTES, pages * crate::PAGE_SIZE);
        self.clear_header(block);
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free
            .push(block);
    }
}
