//! Compaction: objects move out of sparse spans, emptied spans go back to
//! the OS.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::Device;
use crate::pool::class::BLOCK_BYTES;
use crate::slot::{self, Slot, SlotGuard};

impl Device {
    /// Moves objects out of sparse spans and gives emptied spans back to the
    /// OS. Runs beside I/O: each move holds only the moved slot's lock.
    /// Returns the number of pages given back.
    ///
    /// Compaction needs no context of its own: it copies objects without
    /// decoding them, and allocates in each object's own shard. Its one
    /// count per pass goes to shard 0's counters.
    pub fn compact(&self) -> u64 {
        self.compact_with(true)
    }

    /// `wait`: wait for another compaction to finish, and for each slot to
    /// be free to move. Without it a busy compaction or slot is skipped:
    /// for a writer that holds a slot lock of its own.
    pub(super) fn compact_with(&self, wait: bool) -> u64 {
        // Spare spans of a staging burst are memory to give back too.
        let spares = self.heap.release_spares(&self.pool, self.budget());
        self.counters()[0]
            .pages_compacted
            .fetch_add(spares, Relaxed);
        spares + self.compact_spans(wait)
    }

    fn compact_spans(&self, wait: bool) -> u64 {
        let _one_at_a_time = if wait {
            self.compacting.lock().unwrap_or_else(|e| e.into_inner())
        } else {
            match self.compacting.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return 0,
            }
        };
        let blocks = self.heap.plan_compaction(&self.pool);
        if blocks.is_empty() {
            return 0;
        }
        self.for_each_object(|s, w| self.relocate(s, w, &blocks, wait));
        let pages = self
            .heap
            .finish_compaction(&self.pool, self.budget(), &blocks);
        self.counters()[0].pages_compacted.fetch_add(pages, Relaxed);
        pages
    }

    fn relocate(&self, slot: u64, w: &AtomicU64, blocks: &HashSet<u32>, wait: bool) {
        let in_set = |word: u64| match Slot::decode(word) {
            Slot::Object { offset, len, .. } => blocks
                .contains(&((offset / BLOCK_BYTES as u64) as u32))
                .then_some((offset, len)),
            _ => None,
        };
        if in_set(w.load(Relaxed)).is_none() {
            return;
        }
        let g = if wait {
            SlotGuard::lock(w)
        } else {
            match SlotGuard::try_lock(w) {
                Some(g) => g,
                None => return,
            }
        };
        let cur = g.old();
        let Some((offset, len)) = in_set(cur) else {
            return;
        };
        let len = len as usize;
        // The plan left room for this object in its own span's shard, and
        // only there: another shard may have none and need a new span. The
        // slot lock keeps the object live, so its span's shard cannot change.
        let block = (offset / BLOCK_BYTES as u64) as u32;
        let shard = usize::from(self.heap.arena().header(block).shard.load(Relaxed));
        let Ok(mut obj) = self.heap.alloc(&self.pool, self.budget(), len, shard) else {
            // Over a limit: leave this one where it is.
            return;
        };
        self.heap.copy(&mut obj, &g);
        let Slot::Object { huge, codec, .. } = Slot::decode(cur) else {
            unreachable!()
        };
        let new = Slot::Object {
            offset: obj.offset(),
            len: len as u32,
            huge,
            codec,
        }
        .encode()
        .expect("objects encode")
            | (cur & (slot::ACCESS | slot::TRIED));
        // No mark needed: for_each_object found this slot on a marked page.
        g.publish(new);
        self.heap.free(&self.pool, self.budget(), offset);
        tracing::trace!(slot, "moved during compaction");
    }
}
