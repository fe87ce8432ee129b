//! Raw staging: a whole-page write stores the page as it is (a huge object
//! whose codec field is the other codec's, [`slot::staged_codec`]) while the device's staging
//! budget has room, and [`Device::compress_staged`] compresses staged pages
//! later, oldest first, on a thread that has nothing else to do. A staged
//! page is an ordinary stored object in every other respect: it reads as a
//! copy, is durable in the state files, counts against the memory limits
//! at full size, and recovery finds it again by its codec field.
//!
//! Which pages are staged is decided by their words alone. The FIFO of
//! slots is only a hint of where to look, in order: an entry whose slot no
//! longer holds a staged page (overwritten, discarded, written back,
//! recompressed) is skipped, and one whose staged page moved (compaction)
//! or was staged again is still taken, since what is compressed is what the
//! slot holds under its lock.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use super::{Device, Waker};
use crate::context::Context;
use crate::limits::Budget;
use crate::pool::class::{MAX_SPAN_PAGES, NUM_CLASSES};
use crate::pool::heap::AllocError;
use crate::slot::{self, Slot, SlotGuard};
use crate::PAGE_SIZE;

/// Pages compressed in the background since the last compaction before a
/// drained FIFO compacts: a trickle of staged writes must not scan the
/// table after each page. A burst's raw pages leave their spans as they
/// are compressed, but those that stay raw (incompressible) are left
/// scattered over them until compaction packs them.
const COMPACT_AFTER: u64 = 256;

/// Entries an empty FIFO keeps room for (24 bytes each): a burst's
/// worth more is given back once the burst is compressed.
const FIFO_KEEP: usize = 4096;

/// What one FIFO entry came to.
enum Outcome {
    /// The slot holds no staged page any more.
    Stale,
    /// Compressed, or kept raw as an ordinary huge page.
    Done,
    /// No memory for the compressed object: try again later.
    Later,
}

impl Device {
    /// Sets the staging budget in bytes (0 turns staging off; staged pages
    /// stay until compressed). Only a process that runs
    /// [`Device::compress_staged`] should turn it on.
    pub fn set_staging_budget(&self, bytes: u64) {
        self.staging.limit.store(bytes, Relaxed);
        self.keep_spares();
    }

    /// A page's worth of spare spans per page of the budget (up to
    /// `MAX_SPARES`): staged pages come and go one span each.
    pub(super) fn keep_spares(&self) {
        let pages = self.staging.limit.load(Relaxed) / PAGE_SIZE as u64;
        self.heap
            .keep_spares(pages as usize, &self.pool, self.budget());
    }

    /// Emptied one-page spans kept, charged, for the next staged pages.
    pub fn spare_spans(&self) -> usize {
        self.heap.spares()
    }

    /// Gives the spare spans back if none was taken since the last call
    /// (the burst they were kept for is over) and a memory limit is near
    /// (past 3/4 of the device's or the host's): there another device may
    /// be refused for the room they hold; away from the limits they cost
    /// nothing and save the next burst making its spans. The owner calls
    /// it every second or so. Returns the pages given back.
    pub fn release_unused_spares(&self) -> u64 {
        let near = self.near_limit();
        let spares = self
            .heap
            .release_unused_spares(&self.pool, self.budget(), near);
        self.counters()[0]
            .pages_compacted
            .fetch_add(spares, Relaxed);
        spares
    }

    pub fn staging_budget(&self) -> u64 {
        self.staging.limit.load(Relaxed)
    }

    /// Bytes of pages staged now.
    pub fn staged_bytes(&self) -> u64 {
        self.cells.staged_bytes.load(Relaxed)
    }

    /// Whether `word` is a page of this device waiting to be compressed.
    pub(super) fn staged(&self, word: u64) -> bool {
        slot::is_staged(word, self.codec.id())
    }

    /// Whether the FIFO holds slots for [`Device::compress_staged`].
    pub fn has_staged(&self) -> bool {
        self.staging.queued.load(Relaxed) > 0
    }

    /// Has `f` called whenever a write stages a page into an empty FIFO,
    /// so that a sleeping background thread wakes. Set once.
    pub fn set_staging_waker(&self, f: Waker) {
        let _ = self.staging.waker.set(f);
    }

    /// Takes room for one staged page from the budget; whether there was.
    /// The FIFO is bounded too, at twice the budget's pages: entries of
    /// pages overwritten while staged wait there until the background
    /// skips them.
    /// Near a memory limit (past 3/4 of the device's or the host's) writes
    /// compress inline: staged pages hold room their compressed form would
    /// give back, and a write must not be refused for it where it fits
    /// today.
    pub(super) fn reserve_staging(&self) -> bool {
        let Some(limit) = self.staging_limit(1) else {
            return false;
        };
        let page = PAGE_SIZE as u64;
        let mine = self
            .cells
            .staged_bytes
            .fetch_update(Relaxed, Relaxed, |b| {
                (b + page <= limit).then_some(b + page)
            })
            .is_ok();
        // The host's budget: many devices each within their own must
        // not hold raw pages past what the host's cores can drain.
        let host = self.pool.host_staging();
        if !mine || host.limit() == 0 || !host.try_charge(page) {
            if mine {
                self.cells.staged_bytes.fetch_sub(page, Relaxed);
            }
            return false;
        }
        true
    }

    /// Whether `pages` more pages would find room to stage now, in the
    /// device's budget and the host's, with no memory limit near: a
    /// multi-page write that would is cheaper stored raw on its queue
    /// thread than compressed by the pool. Only a hint: room is taken a
    /// page at a time as the pages are stored, and a page that finds none
    /// compresses.
    pub fn staging_room(&self, pages: u64) -> bool {
        let Some(limit) = self.staging_limit(pages) else {
            return false;
        };
        let bytes = pages * PAGE_SIZE as u64;
        let host = self.pool.host_staging();
        self.cells.staged_bytes.load(Relaxed) + bytes <= limit
            && host.used() + bytes <= host.limit()
    }

    /// How many bytes this device may hold staged, if `pages` more may be
    /// staged at all: staging on, the FIFO's bound not passed, no memory
    /// limit near, and a limited device's drainable share.
    fn staging_limit(&self, pages: u64) -> Option<u64> {
        let limit = self.staging.limit.load(Relaxed);
        if limit == 0
            || self.staging.queued.load(Relaxed) as u64 + pages > 2 * limit / PAGE_SIZE as u64
            || self.near_limit()
        {
            return None;
        }
        Some(
            limit
                .min(drainable(self.budget()))
                .min(drainable(self.pool.host())),
        )
    }

    /// Whether the device or the host is past 3/4 of its memory limit.
    pub(super) fn near_limit(&self) -> bool {
        let near = |b: &crate::limits::Budget| {
            let l = b.limit();
            l != 0 && b.used() + PAGE_SIZE as u64 > l - l / 4
        };
        near(self.budget()) || near(self.pool.host())
    }

    /// A whole-page write near a memory limit compresses a batch of staged
    /// pages first, while there is room for their compressed form: left to
    /// the background, a writer that outruns it would fill that room with
    /// its own pages and find the limit where inline compression had fit.
    pub(super) fn drain_near_limit(&self, shard: usize) {
        if self.has_staged() && self.near_limit() {
            self.compress_staged(&mut Context::new(shard), 8);
        }
    }

    /// Gives back a staged page's room: its word left the slot (or never
    /// reached it).
    /// The host's budget first: a process killed between the two leaves
    /// the host counting a page less (until the device's pages are
    /// compressed), never a page more that nothing would give back.
    pub(super) fn release_staging(&self) {
        let page = PAGE_SIZE as u64;
        let host = self.pool.host_staging();
        host.uncharge(page);
        let had = self
            .cells
            .staged_bytes
            .fetch_update(Relaxed, Relaxed, |b| b.checked_sub(page));
        if had.is_err() {
            host.force_charge(page);
        }
    }

    /// Queues `slot`, just staged, for the background.
    pub(super) fn enqueue_staged(&self, slot: u64) {
        let was = {
            let mut q = self.staging.fifo.lock().unwrap_or_else(|e| e.into_inner());
            q.push_back((slot, Instant::now()));
            self.staging.queued.fetch_add(1, Relaxed)
        };
        self.woken_if_was_empty(was);
    }

    /// Background threads sleep once they see the FIFO empty, and only a
    /// FIFO that stops being empty wakes them: whatever makes it so calls
    /// this with the count it found.
    fn woken_if_was_empty(&self, was: usize) {
        if was == 0 {
            if let Some(w) = self.staging.waker.get() {
                w();
            }
        }
    }

    /// After recovery: the staged slots found, in slot order (when they
    /// were staged died with the process).
    pub(super) fn restore_staged(&self, slots: Vec<u64>) {
        let now = Instant::now();
        let mut q = self.staging.fifo.lock().unwrap_or_else(|e| e.into_inner());
        q.clear();
        q.extend(slots.into_iter().map(|s| (s, now)));
        self.staging.queued.store(q.len(), Relaxed);
        let bytes = q.len() as u64 * PAGE_SIZE as u64;
        self.cells.staged_bytes.store(bytes, Relaxed);
        // Memory in use already: charged whatever the host's budget says.
        self.pool.host_staging().force_charge(bytes);
    }

    /// Compresses up to `max_pages` staged pages, oldest first, with the
    /// device's codec, and publishes each where its slot still holds the
    /// same page. A page the codec cannot shrink below the huge threshold
    /// stays raw as an ordinary huge page. Compacts once the FIFO has
    /// drained after enough pages. Returns the FIFO entries dealt with
    /// (compressed, kept raw, or skipped as stale): 0 means nothing was
    /// queued, or memory for the compressed objects ran out (try later).
    pub fn compress_staged(&self, ctx: &mut Context, max_pages: usize) -> usize {
        let mut dealt = 0;
        while dealt < max_pages {
            let next = {
                let mut q = self.staging.fifo.lock().unwrap_or_else(|e| e.into_inner());
                let e = q.pop_front();
                if e.is_some() {
                    self.staging.queued.fetch_sub(1, Relaxed);
                }
                e
            };
            let Some((s, at)) = next else {
                break;
            };
            match self.compress_one(ctx, s, at) {
                Outcome::Stale | Outcome::Done => dealt += 1,
                Outcome::Later => {
                    // Taken out, the FIFO may have looked empty to a
                    // background thread that went to sleep on it then (a
                    // writer near a limit puts its page back here).
                    let was = {
                        let mut q = self.staging.fifo.lock().unwrap_or_else(|e| e.into_inner());
                        q.push_front((s, at));
                        self.staging.queued.fetch_add(1, Relaxed)
                    };
                    self.woken_if_was_empty(was);
                    break;
                }
            }
        }
        if !self.has_staged() {
            // A burst grows the FIFO to as many entries as it staged; kept,
            // that capacity is memory no page needs.
            let mut q = self.staging.fifo.lock().unwrap_or_else(|e| e.into_inner());
            if q.is_empty() && q.capacity() > FIFO_KEEP {
                q.shrink_to(FIFO_KEEP);
            }
        }
        if !self.has_staged() && self.staging.since_compact.load(Relaxed) >= COMPACT_AFTER {
            self.staging.since_compact.store(0, Relaxed);
            // Another compaction running will do; this thread must get
            // back to its queue's jobs.
            self.compact_with(false);
        }
        dealt
    }

    /// A write a memory limit refused: staged pages hold room their
    /// compressed form would give back, so this writer compresses them
    /// (oldest first) until `alloc` succeeds or none is left. Only for
    /// whole-page writes, which hold no slot lock. Returns the last try.
    pub(super) fn room_from_staged<T>(
        &self,
        shard: usize,
        alloc: impl Fn() -> Result<T, AllocError>,
    ) -> Result<T, AllocError> {
        let mut cx: Option<Context> = None;
        loop {
            if !self.has_staged() {
                // Spare spans hold room too.
                self.heap.release_spares(&self.pool, self.budget());
                return alloc();
            }
            let cx = cx.get_or_insert_with(|| Context::new(shard));
            if self.compress_staged(cx, 8) == 0 {
                // No room for the compressed pages either.
                self.compact_with(false);
                return alloc();
            }
            self.compact_with(false);
            match alloc() {
                Err(AllocError::Device | AllocError::Host) => {}
                r => return r,
            }
        }
    }

    fn compress_one(&self, ctx: &mut Context, s: u64, at: Instant) -> Outcome {
        let w = self.table.word(s);
        if !self.staged(w.load(Relaxed)) {
            return Outcome::Stale;
        }
        let Context { page, work, .. } = ctx;
        let page = &mut **page;
        // Copy under the lock, compress without it.
        {
            let g = SlotGuard::lock(w);
            if !self.staged(g.old()) {
                return Outcome::Stale;
            }
            let Ok(raw) = self.object_bytes(s, &g) else {
                return Outcome::Stale;
            };
            page.copy_from_slice(raw);
        }
        let shard = ctx.shard % self.heap.num_shards();
        let compressed =
            self.codec
                .compress(page, &mut work.cbuf, self.huge_threshold, &mut work.codec);
        let Some(n) = compressed else {
            // Stays raw, as an inline write would have stored it.
            let g = SlotGuard::lock(w);
            let old = g.old();
            if !self.staged(old) || self.object_bytes(s, &g).ok() != Some(&page[..]) {
                return Outcome::Stale;
            }
            let Slot::Object { offset, len, .. } = Slot::decode(old) else {
                return Outcome::Stale;
            };
            let new = Slot::Object {
                offset,
                len,
                huge: true,
                codec: self.codec.id(),
            }
            .encode()
            .expect("objects encode");
            g.publish(new | (old & (slot::ACCESS | slot::TRIED)));
            self.release_staging();
            self.count_waited(at);
            return Outcome::Done;
        };
        let mut obj = match self.heap.alloc(&self.pool, self.budget(), n, shard) {
            Ok(obj) => obj,
            Err(_) => return Outcome::Later,
        };
        self.heap.write(&mut obj, &work.cbuf[..n]);
        let new = Slot::Object {
            offset: obj.offset(),
            len: n as u32,
            huge: false,
            codec: self.codec.id(),
        }
        .encode()
        .expect("objects encode");
        let g = SlotGuard::lock(w);
        let old = g.old();
        // The same page still (a rewrite of the same bytes, or a move by
        // compaction, is the same page): compare the bytes, not the word.
        if !self.staged(old) || self.object_bytes(s, &g).ok() != Some(&page[..]) {
            drop(g);
            self.heap.free(&self.pool, self.budget(), obj.offset());
            return Outcome::Stale;
        }
        // Not an access: the page keeps its idleness.
        g.publish(new | (old & slot::ACCESS));
        // Not a write either: a migration already has (or will send) the
        // page, whose content did not change. Its raw span may stay as a
        // spare for the next staged page (`retire_with`).
        self.retire_with(old, new, shard, true);
        self.count_waited(at);
        self.staging.since_compact.fetch_add(1, Relaxed);
        Outcome::Done
    }

    fn count_waited(&self, at: Instant) {
        let us = at.elapsed().as_micros() as u64;
        let c = &self.cells;
        c.staged_compressed.fetch_add(1, Relaxed);
        c.staged_wait_micros.fetch_add(us, Relaxed);
        c.staged_wait_max_micros.fetch_max(us, Relaxed);
    }
}

/// Raw bytes that may be staged under `b`'s limit. Staging stops at 3/4 of
/// the limit, and the last quarter must hold the spans the staged pages'
/// compressed forms need before their raw pages go: up to a new span per
/// class. A small limit allows only a few staged pages (measured: 65
/// pages fit in 96 with 57 of them staged, 153 without staging). The host
/// limit bounds each device's staged pages alike: a rough bound.
fn drainable(b: &Budget) -> u64 {
    let l = b.limit();
    let span = ((MAX_SPAN_PAGES - 1) * PAGE_SIZE) as u64;
    if l == 0 || l / 4 / span >= NUM_CLASSES as u64 {
        return u64::MAX;
    }
    l / 4 / span * PAGE_SIZE as u64
}
