//! A whole-page write in two halves, so the costly half can run on another
//! thread than the one that decides the order of writes.
//!
//! [`Device::prepare_write`] does what needs no slot lock: same-fill
//! detection, compression, allocating and filling the object (or spilling
//! when a limit is reached). [`Prepared::commit`] takes the slot's lock,
//! publishes the word and retires the old content. Whoever commits decides
//! which of two writes to one slot wins, so a caller that prepares on
//! several threads commits in its own request order. A [`Prepared`] that is
//! dropped uncommitted frees what it allocated: the slot never saw it.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::Device;
use crate::context::Context;
use crate::error::Result;
use crate::slot::Slot;
use crate::Page;

/// A page ready to become a slot's content; see the module documentation.
#[must_use = "an uncommitted write is dropped and its object freed"]
pub struct Prepared {
    dev: Arc<Device>,
    slot: u64,
    /// The slot word to publish: same-filled, an object this write owns, or
    /// a backing block it owns; 0 once committed.
    word: u64,
    shard: usize,
}

impl Device {
    /// The first half of [`Device::write_page`]: `data` encoded into a word
    /// for `slot` (compressed, its object allocated and filled), nothing
    /// published. On an error nothing was allocated and the slot is as it was.
    pub fn prepare_write(
        self: &Arc<Self>,
        ctx: &mut Context,
        slot: u64,
        data: &Page,
    ) -> Result<Prepared> {
        self.prepare(ctx, slot, data, true)
    }

    /// [`Device::prepare_write`] that compresses now, staging nothing: for
    /// a thread that is already off the request path (the compress pool).
    /// Staging there only adds a copy and a span per page: measured, 64K
    /// writes at 0.8x of compressing them at once.
    pub fn prepare_compressed(
        self: &Arc<Self>,
        ctx: &mut Context,
        slot: u64,
        data: &Page,
    ) -> Result<Prepared> {
        self.prepare(ctx, slot, data, false)
    }

    fn prepare(
        self: &Arc<Self>,
        ctx: &mut Context,
        slot: u64,
        data: &Page,
        stage: bool,
    ) -> Result<Prepared> {
        let sh = self.shard(ctx);
        let ctr = &self.counters()[sh];
        ctr.writes.fetch_add(1, Relaxed);
        let r = self
            .check(slot)
            .and_then(|()| self.table.mark(slot))
            .and_then(|()| self.encode(&mut ctx.work, data, sh, stage));
        match r {
            Ok(word) => Ok(Prepared {
                dev: self.clone(),
                slot,
                word,
                shard: sh,
            }),
            Err(e) => {
                ctr.failed_write(&e);
                Err(e)
            }
        }
    }

    /// Frees what a prepared word owns, without touching the counters: the
    /// word never was a slot's content.
    fn abandon(&self, word: u64) {
        if self.staged(word) {
            self.release_staging();
        }
        match Slot::decode(word) {
            Slot::Object { offset, .. } => self.heap.free(&self.pool, self.budget(), offset),
            Slot::Backed { block } => {
                if let Some(b) = &self.backing {
                    b.free(block);
                }
            }
            Slot::Empty | Slot::Same(_) => {}
        }
    }
}

impl Prepared {
    /// The slot this write is for.
    pub fn slot(&self) -> u64 {
        self.slot
    }

    /// The second half: makes the page the slot's content and frees the old.
    pub fn commit(mut self) {
        self.dev.publish_write(self.slot, self.word, self.shard);
        // The slot owns it now; 0 (an empty word) owns nothing to free.
        self.word = 0;
    }
}

impl Drop for Prepared {
    fn drop(&mut self) {
        self.dev.abandon(self.word);
    }
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("slot", &self.slot)
            .field("word", &format_args!("{:#x}", self.word))
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Codec;
    use crate::device::DeviceConfig;
    use crate::error::StoreError;
    use crate::pool::{PoolConfig, Shared};
    use crate::PAGE_SIZE;

    /// A device over what a pool shares (the pool's registry lives above it).
    fn setup() -> (Arc<Shared>, Arc<Device>) {
        let pool = PoolConfig {
            arena_bytes: 1 << 30,
            ..Default::default()
        };
        let pool = Arc::new(Shared::new(&pool, None).unwrap());
        let mut cfg = DeviceConfig::new(256 * PAGE_SIZE as u64, Codec::Lz4);
        cfg.shards = 2;
        let dev = Arc::new(Device::new(pool.clone(), cfg).unwrap());
        (pool, dev)
    }

    /// Compressible, different per `i`.
    fn page(i: u64) -> Page {
        let mut p = [0u8; PAGE_SIZE];
        for (j, c) in p.chunks_exact_mut(8).enumerate() {
            c.copy_from_slice(&(i * 1000 + j as u64 % 5).to_le_bytes());
        }
        p
    }

    fn noise(seed: u64) -> Page {
        let mut p = [0u8; PAGE_SIZE];
        let mut x = seed | 1;
        for b in p.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        p
    }

    fn read(dev: &Device, slot: u64) -> Page {
        let mut out = [0u8; PAGE_SIZE];
        dev.read_page(&mut Context::new(0), slot, &mut out).unwrap();
        out
    }

    /// A migration tracks writes committed from a compress thread too: a
    /// write it missed would never reach the destination.
    #[test]
    fn a_committed_write_enters_the_migration_dirty_log() {
        let (_pool, dev) = setup();
        dev.dirty.start(dev.num_slots());
        let p = dev
            .prepare_write(&mut Context::new(0), 5, &page(5))
            .unwrap();
        assert_eq!(dev.dirty_slots(), 0, "nothing is written before the commit");
        p.commit();
        assert_eq!(dev.dirty_slots(), 1);
        assert_eq!(dev.dirty.take(), vec![5]);
        dev.dirty.stop();
    }

    /// Two writes to one slot prepared on two contexts: the later commit
    /// decides the content whatever the order of preparing, and the loser's
    /// object is freed.
    #[test]
    fn the_last_commit_wins_and_nothing_leaks() {
        let (pool, dev) = setup();
        let (a, b) = (&mut Context::new(0), &mut Context::new(1));
        let first = dev.prepare_write(a, 7, &page(1)).unwrap();
        let second = dev.prepare_write(b, 7, &page(2)).unwrap();
        let same = dev.prepare_write(b, 8, &[0x11; PAGE_SIZE]).unwrap();
        assert_eq!((first.slot(), same.slot()), (7, 8));
        // Nothing is visible before its commit.
        assert!(read(&dev, 7) == [0; PAGE_SIZE]);
        second.commit();
        first.commit();
        same.commit();
        assert!(read(&dev, 7) == page(1));
        assert!(read(&dev, 8) == [0x11; PAGE_SIZE]);
        let st = dev.stats();
        assert_eq!(
            (st.orig_data_size, st.same_pages),
            (2 * PAGE_SIZE as u64, 1)
        );
        dev.discard(a, 0..256).unwrap();
        assert_eq!(dev.stats().orig_data_size, 0);
        assert_eq!(pool.host().used(), 0, "an object was leaked");
    }

    /// Dropping prepared writes frees their objects and leaves the slots
    /// and counters as they were.
    #[test]
    fn an_uncommitted_write_frees_its_object() {
        let (pool, dev) = setup();
        let cx = &mut Context::new(0);
        dev.write_page(cx, 3, &page(3)).unwrap();
        let held = pool.host().used();
        let before = dev.stats();
        let dropped: Vec<Prepared> = (0..64)
            .map(|s| dev.prepare_write(cx, s, &noise(s + 1)).unwrap())
            .collect();
        assert!(pool.host().used() > held);
        drop(dropped);
        assert_eq!(pool.host().used(), held);
        let after = dev.stats();
        assert_eq!(
            (
                after.orig_data_size,
                after.compr_data_size,
                after.huge_pages
            ),
            (
                before.orig_data_size,
                before.compr_data_size,
                before.huge_pages
            )
        );
        assert!(read(&dev, 3) == page(3));
        assert!(read(&dev, 4) == [0; PAGE_SIZE]);
    }

    /// A prepare the memory limit refuses fails, counts as a failed write
    /// and leaves the slot's old content.
    #[test]
    fn a_refused_prepare_keeps_the_old_content() {
        let (_pool, dev) = setup();
        let cx = &mut Context::new(0);
        dev.write_page(cx, 5, &page(5)).unwrap();
        dev.set_mem_limit(1);
        // Raw pages need a span of their own class, which the limit refuses.
        let e = dev.prepare_write(cx, 5, &noise(9)).unwrap_err();
        assert!(matches!(e, StoreError::DeviceLimit), "{e}");
        assert_eq!(dev.stats().failed_writes, 1);
        assert!(read(&dev, 5) == page(5));
        // Out of range is refused before anything is allocated.
        assert!(dev.prepare_write(cx, 256, &page(1)).is_err());
    }
}
