//! The I/O paths: reads, whole and partial writes, discards, and the
//! encoding and retiring of slot words they share with the other jobs.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::{fill, footprint, same_filled, Device, Spilled};
use crate::backing::AlignedPages;
use crate::codec::{Codec, CodecState};
use crate::context::{Context, Work};
use crate::error::{Result, StoreError};
use crate::pool::heap::AllocError;
use crate::slot::{self, Slot, SlotGuard};
use crate::{Page, PAGE_SIZE};

impl Device {
    /// Reads a slot into `out`. Unwritten and discarded slots read as zeros.
    pub fn read_page(&self, ctx: &mut Context, slot: u64, out: &mut Page) -> Result<()> {
        let ctr = &self.counters()[self.shard(ctx)];
        ctr.reads.fetch_add(1, Relaxed);
        let r = self
            .check(slot)
            .and_then(|()| self.read_checked(&mut ctx.work, slot, out));
        if r.is_err() {
            ctr.failed_reads.fetch_add(1, Relaxed);
        }
        r
    }

    fn read_checked(&self, work: &mut Work, slot: u64, out: &mut Page) -> Result<()> {
        // A table page nothing was ever stored on holds zeros, and reading
        // it could fault a page into a full state tmpfs (SIGBUS).
        if !self.table.is_marked(slot) {
            out.fill(0);
            return Ok(());
        }
        let w = self.table.word(slot);
        // Empty and same-filled slots are answered from one atomic load:
        // there is no object that could move or be freed.
        let snap = w.load(std::sync::atomic::Ordering::Acquire);
        if snap & slot::LOCK == 0 {
            match Slot::decode(snap) {
                Slot::Empty => {
                    out.fill(0);
                    return Ok(());
                }
                Slot::Same(v) => {
                    fill(out, v);
                    return Ok(());
                }
                Slot::Object { .. } | Slot::Backed { .. } => {}
            }
        }
        let mut g = SlotGuard::lock(w);
        g.touch();
        self.load(&mut work.codec, &mut work.io, slot, &g, out)
    }

    /// Expands a slot word into a page; the caller holds the slot lock.
    /// `io` is a page-aligned buffer for backing-file reads, made on first use.
    pub(super) fn load(
        &self,
        codec: &mut CodecState,
        io: &mut Option<AlignedPages>,
        slot: u64,
        g: &SlotGuard<'_>,
        out: &mut Page,
    ) -> Result<()> {
        match Slot::decode(g.old()) {
            Slot::Empty => out.fill(0),
            Slot::Same(v) => fill(out, v),
            Slot::Object {
                huge, codec: id, ..
            } => {
                let src = self.object_bytes(slot, g)?;
                if huge {
                    *out = *<&Page>::try_from(src).map_err(|_| StoreError::Corrupt { slot })?;
                } else if !Codec::from_id(id).decompress(src, out, codec) {
                    return Err(StoreError::Corrupt { slot });
                }
            }
            Slot::Backed { block } => {
                let Some(b) = &self.backing else {
                    return Err(StoreError::Corrupt { slot });
                };
                let buf = match io {
                    Some(p) => p,
                    None => io.insert(AlignedPages::new(1)?),
                };
                b.read(block, buf.page_mut(0))?;
                out.copy_from_slice(buf.page_mut(0));
                self.counters()[0].backed_reads.fetch_add(1, Relaxed);
            }
        }
        Ok(())
    }

    /// The locked slot's object. A word that cannot name one is an error,
    /// never a panic: recovery checks every word, but the table is a shared
    /// mapping of a file, which a stray write could still damage.
    pub(super) fn object_bytes<'g>(&self, slot: u64, g: &'g SlotGuard<'_>) -> Result<&'g [u8]> {
        let Slot::Object {
            offset, len, huge, ..
        } = Slot::decode(g.old())
        else {
            return Err(StoreError::Corrupt { slot });
        };
        let len = len as usize;
        if len == 0
            || len > PAGE_SIZE
            || (huge && len != PAGE_SIZE)
            || offset + len as u64 > self.heap.arena().bytes()
        {
            return Err(StoreError::Corrupt { slot });
        }
        Ok(self.heap.bytes(g))
    }

    /// Stores a whole page. On any error the slot keeps its old content.
    pub fn write_page(&self, ctx: &mut Context, slot: u64, data: &Page) -> Result<()> {
        let sh = self.shard(ctx);
        let ctr = &self.counters()[sh];
        ctr.writes.fetch_add(1, Relaxed);
        let r = self
            .check(slot)
            .and_then(|()| self.table.mark(slot))
            .and_then(|()| self.encode(&mut ctx.work, data, sh, true))
            .map(|new| self.publish_write(slot, new, sh));
        if let Err(e) = &r {
            ctr.failed_write(e);
        }
        r
    }

    /// Asks the CPU to start loading slot `slot`'s word, so that a request
    /// on it a little later (its lock, its publish) does not wait on
    /// memory: random slots are cache misses. Changes nothing; a slot past
    /// the end is ignored.
    pub fn prefetch_slot(&self, slot: u64) {
        if slot < self.table.len() {
            crate::mmap::prefetch((self.table.word(slot) as *const AtomicU64).cast());
        }
    }

    /// Reads slot `slot`'s word (call [`Device::prefetch_slot`] well before)
    /// and asks the CPU to load what a read or overwrite of the slot will
    /// touch: its object and the object's span header. Changes nothing; the
    /// word may change meanwhile, which costs only a wasted prefetch.
    pub fn prefetch_object(&self, slot: u64) {
        if slot >= self.table.len() || !self.table.is_marked(slot) {
            return;
        }
        if let Slot::Object { offset, .. } = Slot::decode(self.table.word(slot).load(Relaxed)) {
            self.heap.arena().prefetch(offset);
        }
    }

    /// Makes `new` (an encoded whole page, never 0) the slot's content: the
    /// one place a whole-page write lands, whether encoded here or on a
    /// compress thread (`Prepared::commit`). A migration's dirty log hears
    /// of it after the word is out, so a pass that reads the slot later
    /// sees the new page.
    pub(super) fn publish_write(&self, slot: u64, new: u64, shard: usize) {
        let g = SlotGuard::lock(self.table.word(slot));
        let old = g.old();
        g.publish(new);
        self.dirty.mark(slot);
        // An overwrite: the slot holds a page again, so the old page's
        // span may wait for the next staged page (a swap device rewrites
        // the same slots over and over; making a span costs more than
        // compressing a page).
        self.retire_with(old, new, shard, true);
        if self.staged(new) {
            self.enqueue_staged(slot);
        }
    }

    /// Read-modify-write of part of a page, under the slot lock: `f` sees the
    /// current content and changes it in place.
    pub fn modify_page(
        &self,
        ctx: &mut Context,
        slot: u64,
        f: impl FnOnce(&mut Page),
    ) -> Result<()> {
        let sh = self.shard(ctx);
        let ctr = &self.counters()[sh];
        ctr.writes.fetch_add(1, Relaxed);
        let r = self.check(slot).and_then(|()| {
            let Context { page, work, .. } = ctx;
            let page = &mut **page;
            // The lock writes the word: its table page must be allocated.
            self.table.mark(slot)?;
            let g = SlotGuard::lock(self.table.word(slot));
            let old = g.old();
            self.load(&mut work.codec, &mut work.io, slot, &g, page)?;
            f(page);
            // A partial write or zeroing that leaves nothing but zeros
            // frees the slot, as a discard would. On an error the guard
            // leaves the slot as it was.
            let new = match same_filled(page) {
                Some(0) => 0,
                _ => {
                    self.table.mark(slot)?;
                    // Partial writes compress inline: staging them would
                    // make each one a full page's copy twice.
                    self.encode(work, page, sh, false)?
                }
            };
            g.publish(new);
            self.dirty.mark(slot);
            self.retire(old, new, sh);
            Ok(())
        });
        if let Err(e) = &r {
            ctr.failed_write(e);
        }
        r
    }

    /// Writes `data` at byte `offset` of a slot, keeping the rest of the page.
    pub fn write_partial(
        &self,
        ctx: &mut Context,
        slot: u64,
        offset: usize,
        data: &[u8],
    ) -> Result<()> {
        let end = offset.checked_add(data.len()).filter(|&e| e <= PAGE_SIZE);
        let Some(end) = end else {
            return Err(StoreError::BadPageRange {
                offset,
                len: data.len(),
            });
        };
        self.modify_page(ctx, slot, |p| p[offset..end].copy_from_slice(data))
    }

    /// Zeroes `len` bytes at `offset` of a slot; a whole page is discarded.
    pub fn zero_partial(
        &self,
        ctx: &mut Context,
        slot: u64,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        let end = offset.checked_add(len).filter(|&e| e <= PAGE_SIZE);
        let Some(end) = end else {
            return Err(StoreError::BadPageRange { offset, len });
        };
        if len == PAGE_SIZE {
            return self.discard(ctx, slot..slot + 1);
        }
        self.modify_page(ctx, slot, |p| p[offset..end].fill(0))
    }

    /// Frees a range of slots; they read as zeros afterwards.
    pub fn discard(&self, ctx: &mut Context, slots: Range<u64>) -> Result<()> {
        if slots.start > slots.end || slots.end > self.table.len() {
            return Err(StoreError::OutOfRange {
                slot: slots.end.saturating_sub(1),
                slots: self.table.len(),
            });
        }
        let sh = self.shard(ctx);
        self.counters()[sh]
            .discards
            .fetch_add(slots.end - slots.start, Relaxed);
        for s in slots {
            if !self.table.is_marked(s) {
                continue;
            }
            let w = self.table.word(s);
            if w.load(Relaxed) == 0 {
                continue;
            }
            let g = SlotGuard::lock(w);
            let old = g.old();
            g.publish(0);
            self.dirty.mark(s);
            self.retire(old, 0, sh);
        }
        Ok(())
    }

    /// Turns a page into the word that will represent it, allocating and
    /// filling an object if it needs one. `stage`: the page may be stored
    /// raw, staged, if the staging budget has room; otherwise (or if the
    /// raw page does not fit the memory limits) it is compressed here.
    pub(super) fn encode(
        &self,
        work: &mut Work,
        data: &Page,
        shard: usize,
        stage: bool,
    ) -> Result<u64> {
        if let Some(w) = same_filled(data).and_then(|v| Slot::Same(v).encode()) {
            return Ok(w);
        }
        if stage && self.reserve_staging() {
            match self.heap.alloc_page(&self.pool, self.budget(), shard) {
                Ok(obj) => match self.heap.write_page(&self.pool, self.budget(), obj, data) {
                    Ok(obj) => {
                        let word = Slot::Object {
                            offset: obj.offset(),
                            len: PAGE_SIZE as u32,
                            huge: true,
                            codec: slot::staged_codec(self.codec.id()),
                        };
                        return Ok(word.encode().expect("objects always encode"));
                    }
                    Err(e) => {
                        if crate::error::log_full_now() {
                            tracing::warn!("the state dir is full: cannot store a page in the device's arena ({e}); writes fail with an I/O error until pages are freed or the state dir grows");
                        }
                        self.release_staging();
                    }
                },
                // A compressed object may still fit.
                Err(_) => self.release_staging(),
            }
        } else if stage {
            self.drain_near_limit(shard);
        }
        let Work { cbuf, codec, .. } = work;
        let (src, huge): (&[u8], bool) =
            match self.codec.compress(data, cbuf, self.huge_threshold, codec) {
                Some(n) => (&cbuf[..n], false),
                None => (&data[..], true),
            };
        let alloc = || self.heap.alloc(&self.pool, self.budget(), src.len(), shard);
        let mut first = alloc();
        if stage && matches!(first, Err(AllocError::Device | AllocError::Host)) {
            first = self.room_from_staged(shard, alloc);
        }
        let mut obj = match first {
            Ok(obj) => obj,
            Err(AllocError::Device | AllocError::Host) if self.backing.is_some() => {
                match self.spill(src.len(), shard, data)? {
                    Spilled::Room(obj) => obj,
                    Spilled::Direct(word) => return Ok(word),
                }
            }
            Err(e) => return Err(e.into()),
        };
        self.heap.write(&mut obj, src);
        let word = Slot::Object {
            offset: obj.offset(),
            len: src.len() as u32,
            huge,
            codec: self.codec.id(),
        };
        Ok(word.encode().expect("objects always encode"))
    }

    /// Accounts for a slot going from `old` to `new` and frees the old object.
    pub(super) fn retire(&self, old: u64, new: u64, shard: usize) {
        self.retire_with(old, new, shard, false);
    }

    /// [`Device::retire`]; `spare`: `new` is a page again (not a discard),
    /// so the old object's span may wait for the next staged page, if it
    /// is a whole page's span and no memory limit is near (the room is
    /// wanted there, by this device's writes or another's). Only then are
    /// the limits read: not on every write.
    pub(super) fn retire_with(&self, old: u64, new: u64, shard: usize, spare: bool) {
        if self.staged(old) {
            self.release_staging();
        }
        match Slot::decode(old) {
            Slot::Object { offset, len, .. }
                if spare && len as usize == PAGE_SIZE && !self.near_limit() =>
            {
                self.heap.free_replaced(&self.pool, self.budget(), offset)
            }
            Slot::Object { offset, .. } => self.heap.free(&self.pool, self.budget(), offset),
            Slot::Backed { block } => {
                if let Some(b) = &self.backing {
                    b.free(block);
                }
            }
            _ => {}
        }
        self.counters()[shard].apply(footprint(old), footprint(new));
    }
}
