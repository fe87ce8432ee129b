//! Tiering: idle marks and ageing, writeback to the backing file, spills
//! when a memory limit is reached, and recompression with another codec.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use super::{Device, Filter, RecompressReport, Spilled, Tier, WritebackReport};
use crate::backing::AlignedPages;
use crate::codec::{Codec, CodecState, MAX_COMPRESSED};
use crate::error::{Result, StoreError};
use crate::pool::class::class_of;
use crate::pool::heap::{AllocError, Heap};
use crate::slot::{self, Slot, SlotGuard};
use crate::{Page, PAGE_SIZE};

/// Pages a writeback writes with one call.
const BATCH: usize = 32;
/// How long a writeback keeps coming back to slots it found locked.
const BUSY_PATIENCE: Duration = Duration::from_millis(50);
/// Bounds on the pages one spill moves out: enough to get below the low
/// watermark in one go, few enough that one guest write never waits long.
const SPILL_MIN: usize = 64;
const SPILL_MAX: usize = 1024;
/// Spill rounds a write tries before its page goes to the backing file itself.
const SPILL_ROUNDS: usize = 3;

/// Changes the bits of an unlocked object word with one compare-and-swap,
/// as a locked update would; a locked or changing word is left alone.
/// Returns whether the word changed.
fn set_bits(w: &AtomicU64, f: impl FnOnce(u64) -> u64) -> bool {
    let cur = w.load(Relaxed);
    if cur & slot::LOCK != 0 || !slot::is_object(cur) {
        return false;
    }
    let next = f(cur);
    next != cur && w.compare_exchange(cur, next, Relaxed, Relaxed).is_ok()
}

/// Whether the locked slot (whose word names the object copied to page `i`
/// of `objs`) still holds those bytes.
fn same_object(heap: &Heap, g: &SlotGuard<'_>, objs: &[u8], i: usize) -> bool {
    let cur = heap.bytes(g);
    *cur == objs[i * PAGE_SIZE..][..cur.len()]
}

impl Device {
    /// Marks every stored object idle (zram's `echo all > idle`). A read
    /// or write of the page clears the mark. Returns the pages marked.
    pub fn mark_idle(&self) -> u64 {
        self.mark_idle_counted().0
    }

    /// [`Device::mark_idle`], also counting the pages in memory idle after
    /// it: those marked before (by the ager, an earlier mark) and not used
    /// since count too. That is what `writeback --idle` then takes; the
    /// pages newly marked alone can be far fewer.
    pub fn mark_idle_counted(&self) -> (u64, u64) {
        let (mut marked, mut idle) = (0, 0);
        self.for_each_object(|_, w| {
            if set_bits(w, |cur| cur | slot::IDLE) {
                marked += 1;
            }
            let now = w.load(Relaxed);
            if slot::is_object(now) && now & slot::IDLE != 0 {
                idle += 1;
            }
        });
        (marked, idle)
    }

    /// One pass of the ager: pages not accessed since the last pass grow a
    /// step older, the rest are marked idle. Run every `idle_after / 3`, a
    /// page counts as cold ([`Filter::cold`]) once idle for `idle_after`.
    /// Returns the pages that are cold now.
    pub fn age(&self) -> u64 {
        let mut cold = 0;
        self.for_each_object(|_, w| {
            let mut now_cold = false;
            set_bits(w, |cur| {
                let next = if cur & slot::IDLE == 0 {
                    cur | slot::IDLE
                } else {
                    slot::with_age(cur, slot::age(cur).saturating_add(1))
                };
                now_cold = next & slot::IDLE != 0 && slot::age(next) >= slot::MAX_AGE;
                next
            });
            cold += u64::from(now_cold);
        });
        cold
    }

    /// The tiering passes' memory, made on first use (most devices never
    /// tier).
    fn tier(&self) -> Result<std::sync::MutexGuard<'_, Option<Tier>>> {
        let mut t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
        if t.is_none() {
            *t = Some(Tier {
                pages: AlignedPages::new(BATCH)?,
                cbuf: Box::new([0; MAX_COMPRESSED]),
                codec: CodecState::default(),
                objs: vec![0; BATCH * PAGE_SIZE].into_boxed_slice(),
                hand: 0,
                next_writeback: 0,
                next_recompress: 0,
            });
        }
        Ok(t)
    }

    /// The slots of written table pages, starting at slot `from` and
    /// wrapping around: each once.
    fn touched_from(&self, from: u64) -> Vec<std::ops::Range<u64>> {
        let (mut head, mut tail) = (Vec::new(), Vec::new());
        for r in self.table.touched() {
            if r.end <= from {
                tail.push(r);
            } else if r.start >= from {
                head.push(r);
            } else {
                tail.push(r.start..from);
                head.push(from..r.end);
            }
        }
        head.append(&mut tail);
        head
    }

    /// Moves the stored pages `filter` takes to the backing file, at most
    /// `max_pages` of them, then compacts so their memory goes back.
    pub fn writeback(&self, filter: Filter, max_pages: Option<u64>) -> Result<WritebackReport> {
        if self.backing.is_none() {
            return Err(StoreError::InvalidConfig(
                "the device has no backing file".into(),
            ));
        }
        let before = self.budget().used();
        let mut t = self.tier()?;
        let tier = t.as_mut().expect("made above");
        let mut left = max_pages.unwrap_or(u64::MAX);
        let mut batch = Vec::with_capacity(BATCH);
        let mut busy = Vec::new();
        let mut moved = 0;
        let mut result = Ok(());
        let from = if max_pages.is_some() {
            tier.next_writeback
        } else {
            0
        };
        'scan: for slots in self.touched_from(from) {
            for s in slots {
                if left == 0 || result.is_err() {
                    break 'scan;
                }
                let word = self.table.word(s).load(Relaxed);
                if !filter.matches(word, self.codec.id()) {
                    continue;
                }
                batch.push(s);
                left -= 1;
                if left == 0 {
                    tier.next_writeback = s + 1;
                }
                if batch.len() == BATCH {
                    result = self
                        .write_batch(tier, &batch, &mut busy)
                        .map(|n| moved += n);
                    batch.clear();
                }
            }
        }
        if result.is_ok() && !batch.is_empty() {
            result = self
                .write_batch(tier, &batch, &mut busy)
                .map(|n| moved += n);
        }
        // A slot is locked only for a moment (a request on it, or the
        // background compressing it if it was staged), and a staged page
        // changes its word once compressed: slots the pass found so are
        // taken again (if the filter still takes them), so a writeback
        // right after a burst moves every page it matches, not all but a few.
        let until = Instant::now() + BUSY_PATIENCE;
        while result.is_ok() && !busy.is_empty() && Instant::now() < until {
            std::thread::sleep(Duration::from_micros(200));
            let again: Vec<u64> = std::mem::take(&mut busy)
                .into_iter()
                .filter(|&s| filter.matches(self.table.word(s).load(Relaxed), self.codec.id()))
                .collect();
            for chunk in again.chunks(BATCH) {
                result = self.write_batch(tier, chunk, &mut busy).map(|n| moved += n);
                if result.is_err() {
                    break;
                }
            }
        }
        drop(t);
        self.compact();
        result?;
        Ok(WritebackReport {
            pages: moved as u64,
            freed_bytes: before.saturating_sub(self.budget().used()),
        })
    }

    /// Writes the objects of `slots` to the backing file and points their
    /// words at the blocks. A slot that is locked, or changes while its
    /// page is being written, keeps its object and the block goes back:
    /// every slot holds its old content or the same content on disk, never
    /// a block that was not fully written. Returns the pages moved; the
    /// slots passed over because they were locked or changed are added to
    /// `busy`.
    fn write_batch(&self, tier: &mut Tier, slots: &[u64], busy: &mut Vec<u64>) -> Result<usize> {
        let b = self.backing.as_ref().expect("callers check");
        // Expand each page under its lock, without waiting for any: the
        // caller may hold a slot lock itself (a partial write that spills).
        let mut taken: Vec<(u64, u64)> = Vec::with_capacity(slots.len());
        for &s in slots {
            let w = self.table.word(s);
            let Some(g) = SlotGuard::try_lock(w) else {
                busy.push(s);
                continue;
            };
            if !slot::is_object(g.old()) {
                continue;
            }
            let i = taken.len();
            let page = tier.pages.page_mut(i);
            let mut none = None;
            if self.load(&mut tier.codec, &mut none, s, &g, page).is_err() {
                continue;
            }
            let obj = self.heap.bytes(&g);
            tier.objs[i * PAGE_SIZE..][..obj.len()].copy_from_slice(obj);
            taken.push((s, slot::content(g.old())));
        }
        if taken.is_empty() {
            return Ok(0);
        }
        let blocks = b.alloc(taken.len());
        if blocks.is_empty() {
            return Err(StoreError::BackingFull);
        }
        taken.truncate(blocks.len());
        // One write per run of consecutive blocks.
        let mut i = 0;
        while i < blocks.len() {
            let mut j = i + 1;
            while j < blocks.len() && blocks[j] == blocks[j - 1] + 1 {
                j += 1;
            }
            if let Err(e) = b.write(blocks[i], tier.pages.bytes(i, j - i)) {
                for &blk in &blocks {
                    b.free(blk);
                }
                tracing::warn!("writeback failed, pages stay in memory: {e}");
                return Err(e);
            }
            i = j;
        }
        let ctr = &self.counters()[0];
        ctr.backed_writes.fetch_add(blocks.len() as u64, Relaxed);
        let mut moved = 0;
        for (i, (&(s, seen), &blk)) in taken.iter().zip(&blocks).enumerate() {
            let g = SlotGuard::try_lock(self.table.word(s));
            match g {
                Some(g)
                    if slot::content(g.old()) == seen
                        && same_object(&self.heap, &g, &tier.objs, i) =>
                {
                    let old = g.old();
                    let new = Slot::Backed { block: blk }.encode().expect("blocks encode");
                    g.publish(new);
                    self.retire(old, new, 0);
                    moved += 1;
                }
                // Locked, or its page changed meanwhile (a staged page the
                // background compressed, a rewrite): looked at again.
                _ => {
                    busy.push(s);
                    b.free(blk);
                }
            }
        }
        Ok(moved)
    }

    /// Makes room for an object of `len` bytes when a limit refused it:
    /// writes back the coldest pages (idle longest first, then those the
    /// clock hand finds untouched since it last passed), compacts, and
    /// tries again. If that cannot make room, the page itself goes to the
    /// backing file. Fails only when the backing file is full too.
    pub(super) fn spill(&self, len: usize, shard: usize, data: &Page) -> Result<Spilled> {
        let mut t = self.tier()?;
        let tier = t.as_mut().expect("made above");
        for _ in 0..SPILL_ROUNDS {
            // Another writer may have made room while this one waited.
            match self.heap.alloc(&self.pool, self.budget(), len, shard) {
                Ok(obj) => return Ok(Spilled::Room(obj)),
                Err(AllocError::Device | AllocError::Host) => {}
                Err(e) => return Err(e.into()),
            }
            let victims = self.pick_victims(tier, self.spill_pages());
            if victims.is_empty() {
                break;
            }
            let mut moved = 0;
            // A locked victim is passed over: this writer may hold a slot
            // lock itself, and waiting for another could deadlock.
            let mut busy = Vec::new();
            for chunk in victims.chunks(BATCH) {
                match self.write_batch(tier, chunk, &mut busy) {
                    Ok(n) => moved += n,
                    Err(StoreError::BackingFull) => break,
                    Err(e) => return Err(e),
                }
            }
            self.cells.spills.fetch_add(1, Relaxed);
            // Compaction that is already running elsewhere will do; waiting
            // for it could deadlock with a slot this writer holds.
            self.compact_with(false);
            if moved == 0 {
                break;
            }
        }
        match self.heap.alloc(&self.pool, self.budget(), len, shard) {
            Ok(obj) => return Ok(Spilled::Room(obj)),
            Err(AllocError::Device | AllocError::Host) => {}
            Err(e) => return Err(e.into()),
        }
        // No room could be made: this page goes to disk itself.
        let b = self.backing.as_ref().expect("callers check");
        let Some(&blk) = b.alloc(1).first() else {
            return Err(StoreError::BackingFull);
        };
        tier.pages.page_mut(0).copy_from_slice(data);
        if let Err(e) = b.write(blk, tier.pages.bytes(0, 1)) {
            b.free(blk);
            return Err(e);
        }
        self.counters()[shard].backed_writes.fetch_add(1, Relaxed);
        Ok(Spilled::Direct(
            Slot::Backed { block: blk }.encode().expect("blocks encode"),
        ))
    }

    /// How many pages one spill moves: enough to bring the device down to
    /// 15/16 of its limit (or its share of the host's) at the current
    /// average object size.
    fn spill_pages(&self) -> usize {
        let st = self.cells.stats(self.size_bytes);
        let in_mem = st
            .orig_data_size
            .div_ceil(PAGE_SIZE as u64)
            .saturating_sub(st.same_pages + st.backed_pages)
            .max(1);
        let avg = (st.compr_data_size / in_mem).max(64);
        let limit = match self.budget().limit() {
            0 => st.mem_used_total,
            l => l,
        };
        let over = st.mem_used_total.saturating_sub(limit - limit / 16);
        ((over / avg) as usize).clamp(SPILL_MIN, SPILL_MAX)
    }

    /// Up to `n` stored objects, coldest first: idle with the highest age,
    /// then idle, then (second chance) pages the scan marks idle now.
    /// The scan starts where the last one stopped.
    fn pick_victims(&self, tier: &mut Tier, n: usize) -> Vec<u64> {
        const RANKS: usize = slot::MAX_AGE as usize + 2;
        let mut by_rank: [Vec<u64>; RANKS] = Default::default();
        let ranges: Vec<Range<u64>> = self.table.touched().collect();
        let hand = tier.hand;
        // From the hand to the end, then from the start up to the hand:
        // the hand's own table page is split between the two.
        let past = ranges.iter().map(|r| r.start.max(hand)..r.end);
        let behind = ranges.iter().map(|r| r.start..r.end.min(hand));
        let mut last = hand;
        'scan: for r in past.chain(behind) {
            for s in r {
                let w = self.table.word(s);
                let cur = w.load(Relaxed);
                if cur & slot::LOCK != 0 || !slot::is_object(cur) {
                    continue;
                }
                let rank = if cur & slot::IDLE == 0 {
                    // Second chance: untouched until the hand comes back, it
                    // ranks as idle then.
                    let _ = w.compare_exchange(cur, cur | slot::IDLE, Relaxed, Relaxed);
                    0
                } else {
                    1 + slot::age(cur) as usize
                };
                if by_rank[rank].len() < n {
                    by_rank[rank].push(s);
                }
                last = s + 1;
                if by_rank[RANKS - 1].len() >= n {
                    break 'scan;
                }
            }
        }
        tier.hand = if last >= self.table.len() { 0 } else { last };
        by_rank.into_iter().rev().flatten().take(n).collect()
    }

    /// Recompresses the stored objects `filter` takes with `codec`, keeping
    /// the result only where it needs a smaller object. Objects already in
    /// `codec` (and not huge), or that recompression failed to shrink
    /// before, are skipped. Compacts afterwards so the savings show.
    pub fn recompress(&self, filter: Filter, codec: Codec) -> Result<RecompressReport> {
        self.recompress_some(filter, codec, None)
    }

    /// [`Device::recompress`], trying at most `max_pages` pages: a caller
    /// that paces itself (a background pass) does a batch at a time. Pages
    /// a batch tried are skipped by the next (recompressed, or marked as
    /// not worth it), so batches make progress.
    pub fn recompress_some(
        &self,
        filter: Filter,
        codec: Codec,
        max_pages: Option<u64>,
    ) -> Result<RecompressReport> {
        let before = self.budget().used();
        let mut rep = RecompressReport::default();
        let mut t = self.tier()?;
        let tier = t.as_mut().expect("made above");
        let ctr = &self.counters()[0];
        let mut result = Ok(());
        let max = max_pages.unwrap_or(u64::MAX);
        let from = if max_pages.is_some() {
            tier.next_recompress
        } else {
            0
        };
        'scan: for slots in self.touched_from(from) {
            for s in slots {
                if rep.tried >= max {
                    break 'scan;
                }
                let w = self.table.word(s);
                let word = w.load(Relaxed);
                if !filter.matches(word, self.codec.id()) || word & slot::TRIED != 0 {
                    continue;
                }
                let Slot::Object {
                    len,
                    huge,
                    codec: id,
                    ..
                } = Slot::decode(word)
                else {
                    continue;
                };
                if !huge && id == codec.id() {
                    continue;
                }
                // Expand under the lock, compress without it.
                let Some(g) = SlotGuard::try_lock(w) else {
                    continue;
                };
                let seen = slot::content(g.old());
                if seen != slot::content(word) {
                    continue;
                }
                let page = tier.pages.page_mut(0);
                let mut none = None;
                if self.load(&mut tier.codec, &mut none, s, &g, page).is_err() {
                    continue;
                }
                let obj = self.heap.bytes(&g);
                tier.objs[..obj.len()].copy_from_slice(obj);
                drop(g);
                rep.tried += 1;
                tier.next_recompress = s + 1;
                let limit = if huge {
                    self.huge_threshold
                } else {
                    len as usize
                };
                let class_bytes = |n: usize| self.pool.classes[class_of(n)].size;
                let smaller = codec
                    .compress(
                        tier.pages.page_mut(0),
                        &mut tier.cbuf,
                        limit,
                        &mut tier.codec,
                    )
                    .filter(|&n| class_bytes(n) < class_bytes(len as usize));
                let Some(n) = smaller else {
                    // Not worth it: remember, so the next pass skips it.
                    if let Some(g) = SlotGuard::try_lock(w) {
                        if slot::content(g.old()) == seen
                            && same_object(&self.heap, &g, &tier.objs, 0)
                        {
                            let old = g.old();
                            g.publish(old | slot::TRIED);
                        }
                    }
                    continue;
                };
                let mut obj = match self.heap.alloc(&self.pool, self.budget(), n, 0) {
                    Ok(obj) => obj,
                    Err(e) => {
                        // A full pool: stop here, what is done stays done.
                        result = Err(StoreError::from(e));
                        break;
                    }
                };
                self.heap.write(&mut obj, &tier.cbuf[..n]);
                let new = Slot::Object {
                    offset: obj.offset(),
                    len: n as u32,
                    huge: false,
                    codec: codec.id(),
                }
                .encode()
                .expect("objects encode");
                match SlotGuard::try_lock(w) {
                    Some(g)
                        if slot::content(g.old()) == seen
                            && same_object(&self.heap, &g, &tier.objs, 0) =>
                    {
                        let old = g.old();
                        // Keep the page's idleness: recompressing is not an access.
                        g.publish(new | (old & slot::ACCESS));
                        self.retire(old, new, 0);
                        rep.pages += 1;
                        rep.saved_bytes += u64::from(len) - n as u64;
                    }
                    _ => self.heap.free(&self.pool, self.budget(), obj.offset()),
                }
            }
            if result.is_err() {
                break;
            }
        }
        drop(t);
        ctr.recompressed.fetch_add(rep.pages, Relaxed);
        ctr.recompress_saved.fetch_add(rep.saved_bytes, Relaxed);
        self.compact();
        rep.freed_bytes = before.saturating_sub(self.budget().used());
        result.map(|()| rep)
    }

    /// Where the next paced writeback batch starts; for the model test,
    /// after a pass it cannot follow page by page.
    #[doc(hidden)]
    pub fn writeback_cursor(&self) -> u64 {
        let t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
        t.as_ref().map_or(0, |t| t.next_writeback)
    }

    /// Where the next paced recompression batch starts (see
    /// [`Device::writeback_cursor`]).
    #[doc(hidden)]
    pub fn recompress_cursor(&self) -> u64 {
        let t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
        t.as_ref().map_or(0, |t| t.next_recompress)
    }
}
