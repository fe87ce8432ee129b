//! A device's share of the pool: for every size class, a few independently
//! locked shards, each holding a list of spans with free room. Queue threads
//! map to different shards, so they do not meet on a lock; the lock is taken
//! once per object and never while compressing.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

use super::arena::{Arena, SpanHeader, EVACUATING, IN_AVAIL, NONE, NO_OBJ};
use super::class::{class_of, Class, BLOCK_BYTES, NUM_CLASSES};
use crate::error::StoreError;
use crate::limits::Budget;
use crate::pool::Shared as Pool;
use crate::slot::{Slot, SlotGuard};
use crate::PAGE_SIZE;

#[derive(Default)]
struct ShardState {
    /// Head of the list of spans that have free objects.
    avail: u32,
    /// Spans this shard owns, for statistics.
    spans: u32,
}

pub struct Heap {
    /// This device's objects: its own arena, so that its state can live in
    /// its own file and no other device's objects are within reach.
    arena: Arena,
    // shards[shard][class]: one shard's classes sit together, so two threads
    // on two shards never write the same cache lines.
    shards: Box<[Box<[Mutex<ShardState>]>]>,
    /// Emptied one-object, one-page spans kept populated and charged, for
    /// the next such span: while the device stages writes, each staged
    /// page is a span of its own that the background empties again, and
    /// making one (fallocate, populate) and punching it out (a TLB
    /// shootdown on every CPU of the process) cost several times what
    /// compressing the page does.
    spares: Mutex<Vec<u32>>,
    /// How many emptied spans may wait as spares ([`Heap::keep_spares`]).
    spare_limit: AtomicUsize,
    /// Spares taken for new spans so far, and as [`Heap::release_unused_spares`]
    /// last saw it.
    spares_taken: AtomicU64,
    spares_seen: AtomicU64,
}

/// Spares a device keeps at most, 4 MiB: a ring of 64K writes at QD8 to
/// 16 queues is 8 MiB, half of which the background is compressing while
/// the other half is staged (measured: with 64, 64K writes still made and
/// punched out a span per page).
pub const MAX_SPARES: usize = 1024;

/// An object just allocated, not yet named by any slot word: only its owner
/// can write it (hence no `Clone`).
pub struct NewObject {
    offset: u64,
    len: usize,
    /// In a span made just now without backing ([`Heap::alloc_page`]).
    unbacked: bool,
}

impl NewObject {
    /// Its place in the arena, for the slot word that will name it.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

/// Where an allocation went and which budget refused it.
pub enum AllocError {
    Device,
    Host,
    Arena,
    /// The file system holding the state is full.
    Space,
}

impl From<AllocError> for StoreError {
    fn from(e: AllocError) -> StoreError {
        match e {
            AllocError::Device => StoreError::DeviceLimit,
            AllocError::Host => StoreError::HostLimit,
            AllocError::Arena => StoreError::ArenaFull,
            AllocError::Space => StoreError::StateFull,
        }
    }
}

fn lock(m: &Mutex<ShardState>) -> MutexGuard<'_, ShardState> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Heap {
    pub fn new(shards: usize, arena: Arena) -> Heap {
        let shards = (0..shards.max(1))
            .map(|_| {
                (0..NUM_CLASSES)
                    .map(|_| {
                        Mutex::new(ShardState {
                            avail: NONE,
                            spans: 0,
                        })
                    })
                    .collect::<Vec<_>>()
                    .into_boxed_slice()
            })
            .collect::<Vec<_>>()
            .into_boxed_slice();
        Heap {
            arena,
            shards,
            spares: Mutex::new(Vec::new()),
            spare_limit: AtomicUsize::new(0),
            spares_taken: AtomicU64::new(0),
            spares_seen: AtomicU64::new(0),
        }
    }

    /// Keep up to `n` emptied one-page spans as spares (at most
    /// [`MAX_SPARES`]); 0 gives the spares back at once.
    pub fn keep_spares(&self, n: usize, pool: &Pool, budget: &Budget) {
        self.spare_limit.store(n.min(MAX_SPARES), Relaxed);
        if n == 0 {
            self.release_spares(pool, budget);
        }
    }

    /// Gives every spare back to the OS and uncharges it; how many.
    pub fn release_spares(&self, pool: &Pool, budget: &Budget) -> u64 {
        let spares = std::mem::take(&mut *self.spares.lock().unwrap_or_else(|e| e.into_inner()));
        let one = one_page(pool);
        for &b in &spares {
            drop_span(&self.arena, pool, budget, b, one);
        }
        spares.len() as u64
    }

    /// Gives the spares back if `wanted` and none was taken since the last
    /// call (the device is not staging): spares sitting unused hold room
    /// another device may need. For a caller that ticks.
    pub fn release_unused_spares(&self, pool: &Pool, budget: &Budget, wanted: bool) -> u64 {
        let taken = self.spares_taken.load(Relaxed);
        if self.spares_seen.swap(taken, Relaxed) != taken || !wanted {
            return 0;
        }
        self.release_spares(pool, budget)
    }

    /// Keeps an emptied span as a spare; whether it did. The span's
    /// header is cleared as `Arena::free_block` clears it; its page and
    /// charge stay.
    fn keep_spare(&self, block: u32, c: Class) -> bool {
        if c.pages != 1 || c.capacity != 1 {
            return false;
        }
        let limit = self.spare_limit.load(Relaxed);
        if limit == 0 {
            return false;
        }
        let mut spares = self.spares.lock().unwrap_or_else(|e| e.into_inner());
        if spares.len() >= limit {
            return false;
        }
        self.arena.clear_header(block);
        spares.push(block);
        true
    }

    /// Spans kept as spares now.
    pub fn spares(&self) -> usize {
        self.spares.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn take_spare(&self) -> Option<u32> {
        // Without staging there are none: no lock on that path.
        if self.spare_limit.load(Relaxed) == 0 {
            return None;
        }
        let b = self.spares.lock().unwrap_or_else(|e| e.into_inner()).pop();
        if b.is_some() {
            self.spares_taken.fetch_add(1, Relaxed);
        }
        b
    }

    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// Fills a new object with `bytes` (exactly its length).
    pub fn write(&self, obj: &mut NewObject, bytes: &[u8]) {
        assert_eq!(bytes.len(), obj.len);
        // SAFETY: `obj` is a live allocation of `len` bytes inside the arena
        // (`ptr` checks the bounds), owned by the caller alone: nobody else
        // can reach it until a slot word names it. `bytes` is not in the arena.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.arena.ptr(obj.offset, obj.len),
                obj.len,
            )
        };
    }

    /// The bytes of the object the locked slot's word names.
    pub fn bytes<'g>(&self, guard: &'g SlotGuard<'_>) -> &'g [u8] {
        let Slot::Object { offset, len, .. } = Slot::decode(guard.old()) else {
            panic!("slot word {:#x} names no object", guard.old());
        };
        let len = len as usize;
        // SAFETY: a slot word names a live object of `len` bytes in this
        // arena (the store's invariant; `ptr` checks the bounds), and while
        // the guard holds the slot's lock nobody frees, moves or writes it.
        // The borrow ends with the guard's.
        unsafe { std::slice::from_raw_parts(self.arena.ptr(offset, len), len) }
    }

    /// Fills a new object with a copy of the locked slot's object (compaction).
    pub fn copy(&self, obj: &mut NewObject, guard: &SlotGuard<'_>) {
        let src = self.bytes(guard);
        assert_eq!(src.len(), obj.len);
        // SAFETY: as in `write`: `obj` is ours alone; `src` is pinned by the
        // guard and is another object, so the two never overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.arena.ptr(obj.offset, obj.len),
                obj.len,
            )
        };
    }

    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }

    /// Allocates an object for `len` bytes (1..=4096). A new span is
    /// charged to both budgets first; if either refuses, nothing changes.
    /// The object is the caller's alone until its word is published.
    pub fn alloc(
        &self,
        pool: &Pool,
        budget: &Budget,
        len: usize,
        shard: usize,
    ) -> std::result::Result<NewObject, AllocError> {
        self.alloc_with(pool, budget, len, shard, true)
    }

    /// Allocates a whole-page object (a staged page) whose span, if made
    /// now rather than taken from the spares, is left unbacked: fill it
    /// with [`Heap::write_page`], which backs it as it copies.
    pub fn alloc_page(
        &self,
        pool: &Pool,
        budget: &Budget,
        shard: usize,
    ) -> std::result::Result<NewObject, AllocError> {
        self.alloc_with(pool, budget, PAGE_SIZE, shard, false)
    }

    fn alloc_with(
        &self,
        pool: &Pool,
        budget: &Budget,
        len: usize,
        shard: usize,
        populate: bool,
    ) -> std::result::Result<NewObject, AllocError> {
        let class = class_of(len);
        let mut unbacked = false;
        let c = pool.classes[class];
        let arena = &self.arena;
        let mut st = lock(&self.shards[shard][class]);
        let block = if st.avail != NONE {
            st.avail
        } else {
            // A spare is populated and charged already.
            let spare = (c.pages == 1 && c.capacity == 1)
                .then(|| self.take_spare())
                .flatten();
            let block = match spare {
                Some(b) => b,
                None => {
                    unbacked = !populate;
                    match new_span(arena, pool, budget, c, populate) {
                        Ok(b) => b,
                        // Spare spans hold room in both budgets, and no
                        // write may be refused for it: whichever path it
                        // came by, and whatever its class.
                        Err(AllocError::Device | AllocError::Host)
                            if self.release_spares(pool, budget) > 0 =>
                        {
                            new_span(arena, pool, budget, c, populate)?
                        }
                        Err(e) => return Err(e),
                    }
                }
            };
            let h = arena.header(block);
            h.class.store(class as u16, Relaxed);
            h.shard.store(shard as u16, Relaxed);
            h.free_head.store(NO_OBJ, Relaxed);
            st.spans += 1;
            push(arena, &mut st, block);
            block
        };
        let h = arena.header(block);
        let base = u64::from(block) * BLOCK_BYTES as u64;
        let idx = match h.free_head.load(Relaxed) {
            NO_OBJ => {
                let i = h.bump.load(Relaxed);
                h.bump.store(i + 1, Relaxed);
                i
            }
            i => {
                h.free_head.store(
                    read_link(arena, base + u64::from(i) * u64::from(c.size)),
                    Relaxed,
                );
                i
            }
        };
        let live = h.live.load(Relaxed) + 1;
        h.live.store(live, Relaxed);
        if u32::from(live) == c.capacity {
            unlink(arena, &mut st, block);
        }
        Ok(NewObject {
            offset: base + u64::from(idx) * u64::from(c.size),
            len,
            unbacked,
        })
    }

    /// Fills a whole-page object from [`Heap::alloc_page`]. An unbacked one
    /// is written through the arena's file: the file system fails the
    /// write when it is full, where a store through the mapping would
    /// SIGBUS. On an error the object is gone: its span was made for it,
    /// and is dropped without a byte of it touched (freeing it the usual
    /// way would store a free-list link in the page that has no backing).
    pub fn write_page(
        &self,
        pool: &Pool,
        budget: &Budget,
        mut obj: NewObject,
        bytes: &[u8],
    ) -> std::io::Result<NewObject> {
        if !obj.unbacked {
            self.write(&mut obj, bytes);
            return Ok(obj);
        }
        assert_eq!(bytes.len(), obj.len);
        if let Err(e) = self.arena.write_unmapped(obj.offset, bytes) {
            let block = (obj.offset / BLOCK_BYTES as u64) as u32;
            let h = self.arena.header(block);
            let (class, shard) = (
                h.class.load(Relaxed) as usize,
                h.shard.load(Relaxed) as usize,
            );
            let c = pool.classes[class];
            let mut st = lock(&self.shards[shard][class]);
            // Full with its one object, so on no list: only counted.
            st.spans -= 1;
            drop(st);
            drop_span(&self.arena, pool, budget, block, c);
            return Err(e);
        }
        Ok(obj)
    }

    /// Frees the object at `offset`. A span left empty goes back to the OS,
    /// unless compaction is emptying it (compaction frees it itself).
    pub fn free(&self, pool: &Pool, budget: &Budget, offset: u64) {
        self.free_with(pool, budget, offset, false);
    }

    /// [`Heap::free`] of an object whose slot holds a page again (a staged
    /// page compressed, or a page overwritten): its span, emptied, may
    /// become a spare for the next staged page. A discard does not keep
    /// spares: its memory goes back, as the guest asked.
    pub fn free_replaced(&self, pool: &Pool, budget: &Budget, offset: u64) {
        self.free_with(pool, budget, offset, true);
    }

    fn free_with(&self, pool: &Pool, budget: &Budget, offset: u64, spare: bool) {
        let arena = &self.arena;
        let block = (offset / BLOCK_BYTES as u64) as u32;
        let h = arena.header(block);
        let class = h.class.load(Relaxed) as usize;
        let shard = h.shard.load(Relaxed) as usize;
        let c = pool.classes[class];
        let mut st = lock(&self.shards[shard][class]);
        let base = u64::from(block) * BLOCK_BYTES as u64;
        let idx = ((offset - base) / u64::from(c.size)) as u16;
        write_link(arena, offset, h.free_head.load(Relaxed));
        h.free_head.store(idx, Relaxed);
        let live = h.live.load(Relaxed) - 1;
        h.live.store(live, Relaxed);
        if h.flag(EVACUATING) {
            return;
        }
        if live == 0 {
            if h.flag(IN_AVAIL) {
                unlink(arena, &mut st, block);
            }
            st.spans -= 1;
            if !(spare && self.keep_spare(block, c)) {
                drop_span(arena, pool, budget, block, c);
            }
        } else if !h.flag(IN_AVAIL) {
            push(arena, &mut st, block);
        }
    }

    /// Rebuilds one span after a restart from the objects the slot table
    /// references (`live`: their indices, ascending). Everything else in the
    /// span is free; the free list is written into the free objects, as
    /// `free` would. Charges both budgets whatever their limits: the memory
    /// is already in use.
    pub fn restore_span(
        &self,
        pool: &Pool,
        budget: &Budget,
        block: u32,
        class: usize,
        live: &[u16],
    ) {
        let arena = &self.arena;
        let c = pool.classes[class];
        let shard = block as usize % self.shards.len();
        let mut st = lock(&self.shards[shard][class]);
        let h = arena.header(block);
        let bump = live.last().map_or(0, |&i| i + 1);
        h.class.store(class as u16, Relaxed);
        h.shard.store(shard as u16, Relaxed);
        h.live.store(live.len() as u16, Relaxed);
        h.bump.store(bump, Relaxed);
        h.flags.store(0, Relaxed);
        let base = u64::from(block) * BLOCK_BYTES as u64;
        let mut head = NO_OBJ;
        let mut next_live = live.iter().rev().peekable();
        for i in (0..bump).rev() {
            if next_live.peek() == Some(&&i) {
                next_live.next();
                continue;
            }
            write_link(arena, base + u64::from(i) * u64::from(c.size), head);
            head = i;
        }
        h.free_head.store(head, Relaxed);
        st.spans += 1;
        if (live.len() as u32) < c.capacity {
            push(arena, &mut st, block);
        }
        let bytes = u64::from(c.pages) * PAGE_SIZE as u64;
        budget.force_charge(bytes);
        pool.host().force_charge(bytes);
    }

    /// Picks spans worth emptying: in each class shard, the sparsest spans
    /// beyond what the live objects need. They leave the allocation lists and
    /// are returned as a set of blocks.
    pub fn plan_compaction(&self, pool: &Pool) -> HashSet<u32> {
        let arena = &self.arena;
        let mut out = HashSet::new();
        for shard in self.shards.iter() {
            for (class, m) in shard.iter().enumerate() {
                let mut st = lock(m);
                let mut spans = Vec::new();
                let mut b = st.avail;
                while b != NONE {
                    let h = arena.header(b);
                    spans.push((h.live.load(Relaxed), b));
                    b = h.next.load(Relaxed);
                }
                let cap = pool.classes[class].capacity as usize;
                let live: usize = spans.iter().map(|s| s.0 as usize).sum();
                let needed = live.div_ceil(cap);
                if spans.len() <= needed {
                    continue;
                }
                spans.sort_unstable();
                for &(_, b) in &spans[..spans.len() - needed] {
                    unlink(arena, &mut st, b);
                    arena.header(b).set_flag(EVACUATING, true);
                    out.insert(b);
                }
            }
        }
        out
    }

    /// Ends a compaction: spans it emptied go back to the OS, the rest
    /// (objects written while it ran) rejoin their lists. Returns pages freed.
    pub fn finish_compaction(&self, pool: &Pool, budget: &Budget, blocks: &HashSet<u32>) -> u64 {
        let arena = &self.arena;
        let mut freed = 0;
        for &b in blocks {
            let h = arena.header(b);
            let class = h.class.load(Relaxed) as usize;
            let c = pool.classes[class];
            let mut st = lock(&self.shards[h.shard.load(Relaxed) as usize][class]);
            h.set_flag(EVACUATING, false);
            if h.live.load(Relaxed) == 0 {
                st.spans -= 1;
                drop_span(arena, pool, budget, b, c);
                freed += u64::from(c.pages);
            } else {
                push(arena, &mut st, b);
            }
        }
        freed
    }

    /// Number of spans and pages currently held, per the shard lists.
    pub fn spans(&self) -> u64 {
        self.shards
            .iter()
            .flat_map(|s| s.iter())
            .map(|m| u64::from(lock(m).spans))
            .sum()
    }
}

fn new_span(
    arena: &Arena,
    pool: &Pool,
    budget: &Budget,
    c: Class,
    populate: bool,
) -> std::result::Result<u32, AllocError> {
    let bytes = u64::from(c.pages) * PAGE_SIZE as u64;
    if !budget.try_charge(bytes) {
        return Err(AllocError::Device);
    }
    if !pool.host().try_charge(bytes) {
        budget.uncharge(bytes);
        return Err(AllocError::Host);
    }
    let block = arena.alloc_block().map_err(|_| {
        budget.uncharge(bytes);
        pool.host().uncharge(bytes);
        AllocError::Arena
    })?;
    if !populate {
        return Ok(block);
    }
    if let Err(e) = arena.populate(block, c.pages as usize) {
        if crate::error::log_full_now() {
            tracing::warn!("the state dir is full: cannot allocate a span in the device's arena ({e}); writes fail with an I/O error until pages are freed or the state dir grows");
        }
        drop_span(arena, pool, budget, block, c);
        return Err(AllocError::Space);
    }
    Ok(block)
}

/// The class of one-object, one-page spans (whole 4 KiB objects).
fn one_page(pool: &Pool) -> Class {
    pool.classes[class_of(PAGE_SIZE)]
}

fn drop_span(arena: &Arena, pool: &Pool, budget: &Budget, block: u32, c: Class) {
    arena.free_block(block, c.pages as usize);
    let bytes = u64::from(c.pages) * PAGE_SIZE as u64;
    budget.uncharge(bytes);
    pool.host().uncharge(bytes);
}

fn push(arena: &Arena, st: &mut ShardState, block: u32) {
    let h: &SpanHeader = arena.header(block);
    h.prev.store(NONE, Relaxed);
    h.next.store(st.avail, Relaxed);
    if st.avail != NONE {
        arena.header(st.avail).prev.store(block, Relaxed);
    }
    st.avail = block;
    h.set_flag(IN_AVAIL, true);
}

fn unlink(arena: &Arena, st: &mut ShardState, block: u32) {
    let h = arena.header(block);
    let (prev, next) = (h.prev.load(Relaxed), h.next.load(Relaxed));
    if prev == NONE {
        st.avail = next;
    } else {
        arena.header(prev).next.store(next, Relaxed);
    }
    if next != NONE {
        arena.header(next).prev.store(prev, Relaxed);
    }
    h.set_flag(IN_AVAIL, false);
}

// A free object's first two bytes hold the index of the next free object in
// its span: free lists cost no memory outside the span.
fn read_link(arena: &Arena, offset: u64) -> u16 {
    // SAFETY: the object lies inside the arena (`ptr` checks the bounds) and
    // is free, so only the shard lock holder touches it; unaligned read is fine.
    unsafe { (arena.ptr(offset, 2) as *const u16).read_unaligned() }
}

fn write_link(arena: &Arena, offset: u64, next: u16) {
    // SAFETY: as in `read_link`; the object was just freed by its slot owner.
    unsafe { (arena.ptr(offset, 2) as *mut u16).write_unaligned(next) }
}
