//! A device: a fixed array of 4 KiB slots backed by the shared pool.
//!
//! Every operation on a slot holds that slot's lock bit and nothing wider.
//! Compression happens before the lock is taken, so a writer holds it only
//! to swap one word; readers hold it while decompressing, which is what stops
//! compaction or a writer from freeing the object under them.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use crate::backing::{AlignedPages, Backing, BackingSpec};
use crate::cells::{Cells, DeviceCells, MAX_SHARDS};
use crate::codec::{Codec, CodecState, MAX_COMPRESSED};
use crate::context::{Context, Work};
use crate::error::{Result, StoreError};
use crate::limits::Budget;
use crate::migrate::{DirtyLog, ExportBuf, Record};
use crate::pool::arena::Arena;
use crate::pool::class::{class_of, BLOCK_BYTES, NUM_CLASSES};
use crate::pool::heap::{AllocError, Heap};
use crate::pool::Shared;
use crate::slot::{self, Slot, SlotGuard};
use crate::state::{self, StateFiles, StateSpec};
use crate::stats::{Counters, DeviceStats, Footprint};
use crate::table::SlotTable;
use crate::{Page, PAGE_SIZE};

mod prepare;
pub use prepare::Prepared;

/// Default size below which a compressed page is kept compressed; above it
/// the raw page is stored ("huge"), since decompressing would buy little.
pub const DEFAULT_HUGE_THRESHOLD: usize = PAGE_SIZE * 3 / 4;

#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// Capacity in bytes; a multiple of 4096.
    pub size_bytes: u64,
    pub codec: Codec,
    /// Per-device cap on pool memory, in bytes; 0 = unlimited.
    pub mem_limit: u64,
    /// Compressed pages of this many bytes or more are stored raw.
    pub huge_threshold: usize,
    /// Allocator shards: about one per thread that writes to the device
    /// (its queue count). 0 picks the number of CPUs.
    pub shards: usize,
    /// Keep the device's state in files there, so it outlives the process;
    /// None keeps it in anonymous memory.
    pub state: Option<StateSpec>,
    /// A file or block device that written-back pages move to, and that a
    /// write spills to when a memory limit is reached.
    pub backing: Option<BackingSpec>,
}

impl DeviceConfig {
    pub fn new(size_bytes: u64, codec: Codec) -> DeviceConfig {
        DeviceConfig {
            size_bytes,
            codec,
            mem_limit: 0,
            huge_threshold: DEFAULT_HUGE_THRESHOLD,
            shards: 0,
            state: None,
            backing: None,
        }
    }
}

/// Which stored pages a tiering pass (writeback, recompression) takes; every
/// condition set must hold. All false: every page in the pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Filter {
    /// Marked idle and not accessed since.
    pub idle: bool,
    /// Idle for at least [`slot::MAX_AGE`] ager passes (`--idle-after`).
    pub cold: bool,
    /// Stored raw: the codec could not shrink them below the threshold.
    pub huge: bool,
    /// Huge, and recompression could not shrink them either.
    pub incompressible: bool,
}

impl Filter {
    fn matches(self, word: u64) -> bool {
        let Slot::Object { huge, .. } = Slot::decode(word) else {
            return false;
        };
        (!self.idle || word & slot::IDLE != 0)
            && (!self.cold || slot::age(word) >= slot::MAX_AGE)
            && (!self.huge || huge)
            && (!self.incompressible || (huge && word & slot::TRIED != 0))
    }
}

/// What a writeback pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct WritebackReport {
    /// Pages moved to the backing file.
    pub pages: u64,
    /// Pool memory given back afterwards (bytes).
    pub freed_bytes: u64,
}

/// What a recompression pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RecompressReport {
    /// Pages that matched and were tried.
    pub tried: u64,
    /// Pages the second codec stored smaller.
    pub pages: u64,
    /// Compressed bytes saved (object sizes, before and after).
    pub saved_bytes: u64,
    /// Pool memory given back afterwards (bytes).
    pub freed_bytes: u64,
}

/// Pages a writeback writes with one call.
const BATCH: usize = 32;
/// Bounds on the pages one spill moves out: enough to get below the low
/// watermark in one go, few enough that one guest write never waits long.
const SPILL_MIN: usize = 64;
const SPILL_MAX: usize = 1024;
/// Spill rounds a write tries before its page goes to the backing file itself.
const SPILL_ROUNDS: usize = 3;

/// The tiering passes' working memory; one pass at a time holds it.
struct Tier {
    pages: AlignedPages,
    cbuf: Box<[u8; MAX_COMPRESSED]>,
    codec: CodecState,
    /// Copies of the objects the pages in `pages` were read from, one per
    /// PAGE_SIZE. A pass that let go of a slot must compare these when it
    /// comes back, not just the word: a rewrite whose new object got the
    /// old one's room has the very same word.
    objs: Box<[u8]>,
    /// Where the next spill scan starts (a clock hand over the slots).
    hand: u64,
    /// Where the next batch of a paced writeback or recompression starts:
    /// just after the last slot the last one took (a slot it took but then
    /// had to skip, locked or with the file full, waits for the next lap).
    /// Starting every batch from slot 0 made a background pass over a large
    /// device quadratic (each batch rescanned every slot the batches before
    /// it had already dealt with).
    next_writeback: u64,
    next_recompress: u64,
}

pub struct Device {
    pool: Arc<Shared>,
    table: SlotTable,
    heap: Heap,
    codec: Codec,
    huge_threshold: usize,
    /// Budget and counters: in the state's `stats` file when the device has
    /// state, so they outlive the process and its supervisor reads them.
    cells: Cells<DeviceCells>,
    shards: usize,
    compacting: Mutex<()>,
    size_bytes: u64,
    /// The state files (held open and locked), when the device has them.
    state: Option<StateFiles>,
    recovery: Option<Recovery>,
    backing: Option<Backing>,
    tier: Mutex<Option<Tier>>,
    /// Slots written or discarded while a migration tracks them.
    pub(crate) dirty: DirtyLog,
}

/// What recovering a device from its state found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovery {
    /// Slots holding a page (objects and same-filled).
    pub slots: u64,
    /// Spans rebuilt from the objects the slots reference.
    pub spans: u64,
    /// Slot words found locked (a write or move cut short): unlocked, with
    /// the content they had.
    pub unlocked: u64,
    /// Slots whose page is in the backing file.
    pub backed: u64,
    pub micros: u64,
}

/// Returns the fill value if the page is one 8-byte value repeated.
#[inline]
pub fn same_filled(page: &Page) -> Option<u64> {
    let first = u64::from_ne_bytes(page[..8].try_into().unwrap());
    // Compare the last word first: most pages that are not same-filled fail here.
    let last = u64::from_ne_bytes(page[PAGE_SIZE - 8..].try_into().unwrap());
    if first != last {
        return None;
    }
    page.chunks_exact(8)
        .all(|c| u64::from_ne_bytes(c.try_into().unwrap()) == first)
        .then_some(first)
}

fn fill(page: &mut Page, v: u64) {
    let bytes = v.to_ne_bytes();
    for c in page.chunks_exact_mut(8) {
        c.copy_from_slice(&bytes);
    }
}

/// Opens (or makes) the state `cfg.state` names, laid out as a device of
/// the default pool would lay it out, for a process that hands the files
/// to the one that will serve the device ([`crate::Pool::attach_device`]).
pub fn open_state(cfg: &DeviceConfig) -> Result<StateFiles> {
    validate(cfg)?;
    let Some(spec) = &cfg.state else {
        return Err(StoreError::InvalidConfig("no state directory given".into()));
    };
    let shared = Shared::new(&crate::PoolConfig::default(), None)?;
    let (_, arena_bytes) = geometry(&shared, cfg);
    state::open(spec, cfg.size_bytes, arena_bytes, cfg.codec)
}

fn validate(cfg: &DeviceConfig) -> Result<()> {
    if cfg.size_bytes == 0 || !cfg.size_bytes.is_multiple_of(PAGE_SIZE as u64) {
        return Err(StoreError::InvalidConfig(format!(
            "device size {} is not a positive multiple of {PAGE_SIZE}",
            cfg.size_bytes
        )));
    }
    if !(1..=PAGE_SIZE).contains(&cfg.huge_threshold) {
        return Err(StoreError::InvalidConfig(format!(
            "huge threshold {} is outside 1..={PAGE_SIZE}",
            cfg.huge_threshold
        )));
    }
    Ok(())
}

/// Allocator shards, and the arena's size: room for every slot to hold an
/// object in a span of its own, plus one partly used span per class and
/// shard, so the arena never runs out before the memory limits do (address
/// space only).
fn geometry(pool: &Shared, cfg: &DeviceConfig) -> (usize, u64) {
    let shards = match cfg.shards {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
    .min(MAX_SHARDS);
    let arena = (cfg.size_bytes * (BLOCK_BYTES / PAGE_SIZE) as u64
        + (NUM_CLASSES * shards * BLOCK_BYTES) as u64)
        .min(pool.arena_cap);
    (shards, arena)
}

/// What a spill made: room for the object, or the page went to the
/// backing file itself (its slot word).
enum Spilled {
    Room(crate::pool::heap::NewObject),
    Direct(u64),
}

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

fn footprint(word: u64) -> Footprint {
    match Slot::decode(word) {
        Slot::Empty => Footprint::default(),
        Slot::Same(_) => Footprint {
            stored: 1,
            same: 1,
            ..Default::default()
        },
        Slot::Object { len, huge, .. } => Footprint {
            stored: 1,
            compr: i64::from(len),
            huge: i64::from(huge),
            ..Default::default()
        },
        Slot::Backed { .. } => Footprint {
            stored: 1,
            backed: 1,
            ..Default::default()
        },
    }
}

impl Device {
    pub(crate) fn new(pool: Arc<Shared>, cfg: DeviceConfig) -> Result<Device> {
        validate(&cfg)?;
        let (_, arena_bytes) = geometry(&pool, &cfg);
        let state = match &cfg.state {
            Some(spec) => Some(state::open(spec, cfg.size_bytes, arena_bytes, cfg.codec)?),
            None => None,
        };
        let backing = cfg.backing.as_ref().map(Backing::open).transpose()?;
        Device::with_state(pool, cfg, state, backing)
    }

    /// A device over `state` (opened here or handed over by another
    /// process), recovered from its slot table if the state existed.
    pub(crate) fn with_state(
        pool: Arc<Shared>,
        cfg: DeviceConfig,
        state: Option<StateFiles>,
        backing: Option<Backing>,
    ) -> Result<Device> {
        validate(&cfg)?;
        let (shards, arena_bytes) = geometry(&pool, &cfg);
        let slots = cfg.size_bytes / PAGE_SIZE as u64;
        let arena_bytes = state.as_ref().map_or(arena_bytes, |s| s.header.arena_bytes);
        let cells = match &state {
            Some(st) => Cells::<DeviceCells>::shared(&st.stats)?,
            None => Cells::private()?,
        };
        let mut dev = Device {
            table: SlotTable::new(slots, state.as_ref().map(|s| &s.table))?,
            heap: Heap::new(
                shards,
                Arena::new(arena_bytes, state.as_ref().map(|s| &s.arena))?,
            ),
            codec: cfg.codec,
            huge_threshold: cfg.huge_threshold,
            cells,
            shards,
            compacting: Mutex::new(()),
            size_bytes: cfg.size_bytes,
            pool,
            state: None,
            recovery: None,
            backing,
            tier: Mutex::new(None),
            dirty: DirtyLog::default(),
        };
        match &state {
            Some(st) if st.existing => dev.recovery = Some(dev.recover(st)?),
            _ => {
                // New memory: whatever the cells said belongs to nothing.
                dev.cells.budget.reset_used();
                for c in &dev.cells.counters {
                    c.clear_gauges();
                }
                dev.cells.charged_to.store(dev.pool.host_id, Relaxed);
            }
        }
        dev.budget().set_limit(cfg.mem_limit);
        if let Some(b) = &dev.backing {
            // Recovery checked that pages on it are this device's; from now
            // on the file says so too.
            let owner = state
                .as_ref()
                .map_or_else(state::random_id, |s| s.header.creation_id);
            b.claim(owner)?;
        }
        dev.state = state;
        Ok(dev)
    }

    #[inline]
    fn budget(&self) -> &Budget {
        &self.cells.budget
    }

    #[inline]
    fn counters(&self) -> &[Counters] {
        &self.cells.counters[..self.shards]
    }

    /// Rebuilds everything but the slot table from the slot table: spans,
    /// free lists, budgets and gauges. An object no slot references is free.
    /// A locked word (a writer or a move cut short) keeps the content it
    /// had: its new object, if any, was never published, so it is free.
    fn recover(&self, st: &StateFiles) -> Result<Recovery> {
        let t0 = std::time::Instant::now();
        // The budget and gauges are recomputed below. The host budget holds
        // the old charge only if it is the one this device was charged to
        // (a worker restarted under the same daemon), not a new daemon's.
        let cells = &self.cells;
        if cells.charged_to.load(Relaxed) == self.pool.host_id {
            self.pool.host().uncharge(cells.budget.used());
        }
        cells.budget.reset_used();
        cells.charged_to.store(self.pool.host_id, Relaxed);
        for c in &cells.counters {
            c.clear_gauges();
        }
        let corrupt = |slot: u64, what: &str| {
            StoreError::State(format!(
                "{}: slot {slot} {what}; the state is damaged (start with --fresh to discard it)",
                st.dir.join("table").display()
            ))
        };
        // block -> (class, indices of live objects)
        let mut spans: HashMap<u32, (usize, Vec<u16>)> = HashMap::new();
        let mut rec = Recovery {
            slots: 0,
            spans: 0,
            unlocked: 0,
            backed: 0,
            micros: 0,
        };
        if let Some(b) = &self.backing {
            b.clear();
        }
        let mut owner_checked = false;
        let ctr = &self.counters()[0];
        for range in state::data_ranges(&st.table) {
            let first = range.start / 8;
            let end = range.end.div_ceil(8).min(self.table.len());
            for s in first..end {
                let w = self.table.word(s);
                let mut word = w.load(Relaxed);
                if word & slot::LOCK != 0 {
                    word &= !slot::LOCK;
                    w.store(word, Relaxed);
                    rec.unlocked += 1;
                }
                if word == 0 {
                    continue;
                }
                self.table.mark(s)?;
                rec.slots += 1;
                ctr.apply(Footprint::default(), footprint(word));
                if let Slot::Backed { block } = Slot::decode(word) {
                    let Some(b) = &self.backing else {
                        return Err(StoreError::State(format!(
                            "{}: slot {s} is in a backing file, but the device has none                              (give it its --backing-file, or start with --fresh to discard the state)",
                            st.dir.join("table").display()
                        )));
                    };
                    if !owner_checked {
                        b.check_owner(st.header.creation_id).map_err(|e| {
                            StoreError::State(format!(
                                "{}: {e} (start with --fresh to discard the state)",
                                st.dir.display()
                            ))
                        })?;
                        owner_checked = true;
                    }
                    if !b.mark(block) {
                        return Err(corrupt(
                            s,
                            "names a backing block outside the file or another slot's",
                        ));
                    }
                    rec.backed += 1;
                    continue;
                }
                let Slot::Object { offset, len, .. } = Slot::decode(word) else {
                    continue;
                };
                if len == 0 || len as usize > PAGE_SIZE {
                    return Err(corrupt(s, "has an object of impossible length"));
                }
                let class = class_of(len as usize);
                let c = self.pool.classes[class];
                let block = offset / BLOCK_BYTES as u64;
                let rel = offset % BLOCK_BYTES as u64;
                if offset + u64::from(len) > self.heap.arena().bytes()
                    || !rel.is_multiple_of(u64::from(c.size))
                    || rel / u64::from(c.size) >= u64::from(c.capacity)
                {
                    return Err(corrupt(s, "points outside any object"));
                }
                let e = spans.entry(block as u32).or_insert((class, Vec::new()));
                if e.0 != class {
                    return Err(corrupt(s, "shares a span with objects of another size"));
                }
                e.1.push((rel / u64::from(c.size)) as u16);
            }
        }
        let mut next = 0;
        for (&block, (class, live)) in spans.iter_mut() {
            live.sort_unstable();
            if live.windows(2).any(|w| w[0] == w[1]) {
                return Err(corrupt(0, "shares its object with another slot"));
            }
            self.heap
                .restore_span(&self.pool, self.budget(), block, *class, live);
            next = next.max(block + 1);
        }
        self.heap.arena().restore(next, |b| spans.contains_key(&b));
        rec.spans = spans.len() as u64;
        rec.micros = t0.elapsed().as_micros() as u64;
        Ok(rec)
    }

    /// Where the device keeps its state, if it keeps any.
    pub fn state_dir(&self) -> Option<&std::path::Path> {
        self.state.as_ref().map(|s| s.dir.as_path())
    }

    /// Memory the state files hold (their allocated blocks), if any.
    pub fn state_bytes(&self) -> Option<u64> {
        self.state.as_ref().map(StateFiles::bytes)
    }

    /// The device's shared budget and counters.
    pub fn cells(&self) -> &DeviceCells {
        &self.cells
    }

    /// The state's files, for handing the device to another process.
    pub fn state_files(&self) -> Option<&StateFiles> {
        self.state.as_ref()
    }

    /// The backing file, if the device has one.
    pub fn backing(&self) -> Option<&Backing> {
        self.backing.as_ref()
    }

    /// What recovery found, if the device was recovered from its state.
    pub fn recovery(&self) -> Option<Recovery> {
        self.recovery
    }

    pub fn num_slots(&self) -> u64 {
        self.table.len()
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    pub fn codec(&self) -> Codec {
        self.codec
    }

    pub fn set_mem_limit(&self, bytes: u64) {
        self.budget().set_limit(bytes);
    }

    pub fn mem_limit(&self) -> u64 {
        self.budget().limit()
    }

    pub fn reset_mem_used_max(&self) {
        self.budget().reset_max();
    }

    #[inline]
    fn shard(&self, ctx: &Context) -> usize {
        ctx.shard % self.heap.num_shards()
    }

    #[inline]
    fn check(&self, slot: u64) -> Result<()> {
        if slot < self.table.len() {
            Ok(())
        } else {
            Err(StoreError::OutOfRange {
                slot,
                slots: self.table.len(),
            })
        }
    }

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
    fn load(
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
                let src = self.heap.bytes(g);
                if huge {
                    out.copy_from_slice(src);
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

    /// Stores a whole page. On any error the slot keeps its old content.
    pub fn write_page(&self, ctx: &mut Context, slot: u64, data: &Page) -> Result<()> {
        let sh = self.shard(ctx);
        let ctr = &self.counters()[sh];
        ctr.writes.fetch_add(1, Relaxed);
        let r = self
            .check(slot)
            .and_then(|()| self.table.mark(slot))
            .and_then(|()| self.encode(&mut ctx.work, data, sh))
            .map(|new| self.publish_write(slot, new, sh));
        if let Err(e) = &r {
            ctr.failed_write(e);
        }
        r
    }

    /// Makes `new` (an encoded whole page, never 0) the slot's content: the
    /// one place a whole-page write lands, whether encoded here or on a
    /// compress thread ([`Prepared::commit`]). A migration's dirty log hears
    /// of it after the word is out, so a pass that reads the slot later
    /// sees the new page.
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
        if slot >= self.table.len() {
            return;
        }
        if let Slot::Object { offset, .. } = Slot::decode(self.table.word(slot).load(Relaxed)) {
            self.heap.arena().prefetch(offset);
        }
    }

    fn publish_write(&self, slot: u64, new: u64, shard: usize) {
        let g = SlotGuard::lock(self.table.word(slot));
        let old = g.old();
        g.publish(new);
        self.dirty.mark(slot);
        self.retire(old, new, shard);
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
                    self.encode(work, page, sh)?
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
    /// filling an object if it needs one.
    fn encode(&self, work: &mut Work, data: &Page, shard: usize) -> Result<u64> {
        if let Some(w) = same_filled(data).and_then(|v| Slot::Same(v).encode()) {
            return Ok(w);
        }
        let Work { cbuf, codec, .. } = work;
        let (src, huge): (&[u8], bool) =
            match self.codec.compress(data, cbuf, self.huge_threshold, codec) {
                Some(n) => (&cbuf[..n], false),
                None => (&data[..], true),
            };
        let mut obj = match self.heap.alloc(&self.pool, self.budget(), src.len(), shard) {
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
    fn retire(&self, old: u64, new: u64, shard: usize) {
        match Slot::decode(old) {
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

    /// Marks every stored object idle (zram's `echo all > idle`). A read
    /// or write of the page clears the mark. Returns the pages marked.
    pub fn mark_idle(&self) -> u64 {
        let mut n = 0;
        self.for_each_object(|_, w| {
            if set_bits(w, |cur| cur | slot::IDLE) {
                n += 1;
            }
        });
        n
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
                if !filter.matches(word) {
                    continue;
                }
                batch.push(s);
                left -= 1;
                if left == 0 {
                    tier.next_writeback = s + 1;
                }
                if batch.len() == BATCH {
                    result = self.write_batch(tier, &batch).map(|n| moved += n);
                    batch.clear();
                }
            }
        }
        if result.is_ok() && !batch.is_empty() {
            result = self.write_batch(tier, &batch).map(|n| moved += n);
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
    /// a block that was not fully written. Returns the pages moved.
    fn write_batch(&self, tier: &mut Tier, slots: &[u64]) -> Result<usize> {
        let b = self.backing.as_ref().expect("callers check");
        // Expand each page under its lock, without waiting for any: the
        // caller may hold a slot lock itself (a partial write that spills).
        let mut taken: Vec<(u64, u64)> = Vec::with_capacity(slots.len());
        for &s in slots {
            let w = self.table.word(s);
            let Some(g) = SlotGuard::try_lock(w) else {
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
                _ => b.free(blk),
            }
        }
        Ok(moved)
    }

    /// Makes room for an object of `len` bytes when a limit refused it:
    /// writes back the coldest pages (idle longest first, then those the
    /// clock hand finds untouched since it last passed), compacts, and
    /// tries again. If that cannot make room, the page itself goes to the
    /// backing file. Fails only when the backing file is full too.
    fn spill(&self, len: usize, shard: usize, data: &Page) -> Result<Spilled> {
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
            for chunk in victims.chunks(BATCH) {
                match self.write_batch(tier, chunk) {
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
                if !filter.matches(word) || word & slot::TRIED != 0 {
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
    fn compact_with(&self, wait: bool) -> u64 {
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

    /// Calls `f` for every slot with a non-zero word. Only table pages that
    /// were ever written are read, and whether they are resident does not
    /// matter: a page the host swapped out still holds its slots.
    fn for_each_object(&self, mut f: impl FnMut(u64, &AtomicU64)) {
        for slots in self.table.touched() {
            for s in slots {
                let w = self.table.word(s);
                if w.load(Relaxed) != 0 {
                    f(s, w);
                }
            }
        }
    }

    /// The slot ranges that may hold something (every table page ever
    /// written); slots outside them are empty.
    pub fn stored_ranges(&self) -> Vec<Range<u64>> {
        self.table.touched().collect()
    }

    /// Reads what `slot` holds for a migration, as it is stored: the
    /// compressed bytes of an object (not expanded), the raw page of a huge
    /// or written-back one. Not an access: idle marks stay.
    pub fn export<'b>(&self, buf: &'b mut ExportBuf, slot: u64) -> Result<Record<'b>> {
        self.check(slot)?;
        let w = self.table.word(slot);
        let snap = w.load(std::sync::atomic::Ordering::Acquire);
        if snap & slot::LOCK == 0 {
            match Slot::decode(snap) {
                Slot::Empty => return Ok(Record::Empty),
                Slot::Same(v) => return Ok(Record::Same(v)),
                _ => {}
            }
        }
        let g = SlotGuard::lock(w);
        Ok(match Slot::decode(g.old()) {
            Slot::Empty => Record::Empty,
            Slot::Same(v) => Record::Same(v),
            Slot::Object {
                len, huge, codec, ..
            } => {
                let src = self.heap.bytes(&g);
                let n = len as usize;
                buf.page[..n].copy_from_slice(&src[..n]);
                drop(g);
                if huge {
                    Record::Raw(&buf.page)
                } else {
                    Record::Compressed {
                        codec,
                        data: &buf.page[..n],
                    }
                }
            }
            Slot::Backed { block } => {
                let Some(b) = &self.backing else {
                    return Err(StoreError::Corrupt { slot });
                };
                let io = match &mut buf.io {
                    Some(p) => p,
                    None => buf.io.insert(AlignedPages::new(1)?),
                };
                b.read(block, io.page_mut(0))?;
                drop(g);
                buf.page.copy_from_slice(io.page_mut(0));
                Record::Raw(&buf.page)
            }
        })
    }

    /// Stores a migrated record in `slot`. Compressed bytes are stored as
    /// they came, once checked: a known codec, a length below a page, and
    /// they expand to exactly one page. On any error the slot keeps its
    /// old content.
    pub fn import(&self, ctx: &mut Context, slot: u64, rec: Record<'_>) -> Result<()> {
        self.check(slot)?;
        let sh = self.shard(ctx);
        match rec {
            Record::Empty => self.discard(ctx, slot..slot + 1),
            Record::Same(v) => {
                if let Some(word) = Slot::Same(v).encode() {
                    self.table.mark(slot)?;
                    self.put_word(slot, word, sh);
                    Ok(())
                } else {
                    let mut page = [0u8; PAGE_SIZE];
                    fill(&mut page, v);
                    self.write_page(ctx, slot, &page)
                }
            }
            Record::Raw(page) => self.write_page(ctx, slot, page),
            Record::Compressed { codec, data } => {
                if codec > 1 {
                    return Err(StoreError::BadRecord(format!(
                        "slot {slot}: unknown codec id {codec}"
                    )));
                }
                if data.is_empty() || data.len() >= PAGE_SIZE {
                    return Err(StoreError::BadRecord(format!(
                        "slot {slot}: a compressed page of {} bytes",
                        data.len()
                    )));
                }
                let Context { page, work, .. } = ctx;
                if !Codec::from_id(codec).decompress(data, page, &mut work.codec) {
                    return Err(StoreError::BadRecord(format!(
                        "slot {slot}: the compressed page does not expand to exactly {PAGE_SIZE} bytes"
                    )));
                }
                self.table.mark(slot)?;
                let mut obj = match self.heap.alloc(&self.pool, self.budget(), data.len(), sh) {
                    Ok(obj) => obj,
                    Err(AllocError::Device | AllocError::Host) if self.backing.is_some() => {
                        match self.spill(data.len(), sh, page)? {
                            Spilled::Room(obj) => obj,
                            Spilled::Direct(word) => {
                                self.put_word(slot, word, sh);
                                return Ok(());
                            }
                        }
                    }
                    Err(e) => return Err(e.into()),
                };
                self.heap.write(&mut obj, data);
                let word = Slot::Object {
                    offset: obj.offset(),
                    len: data.len() as u32,
                    huge: false,
                    codec,
                }
                .encode()
                .expect("objects always encode");
                self.put_word(slot, word, sh);
                Ok(())
            }
        }
    }

    /// Publishes `word` (marked already) in `slot` and retires the old one.
    fn put_word(&self, slot: u64, word: u64, shard: usize) {
        let g = SlotGuard::lock(self.table.word(slot));
        let old = g.old();
        g.publish(word);
        self.dirty.mark(slot);
        self.retire(old, word, shard);
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

    /// Slots written or discarded since the last pass of a migration.
    pub fn dirty_slots(&self) -> u64 {
        self.dirty.count()
    }

    /// Current statistics. Also publishes the gauges only this process can
    /// measure (resident table, spans) to the shared cells.
    pub fn stats(&self) -> DeviceStats {
        self.cells
            .table_bytes
            .store(self.table.resident_bytes(), Relaxed);
        self.cells.spans.store(self.heap.spans(), Relaxed);
        self.cells.stats(self.size_bytes)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // Memory of its own goes with the device, and so does its charge.
        // A state keeps its memory (the files) and so its charge, which the
        // next recovery under the same host budget takes back over.
        if self.state.is_none() {
            self.pool.host().uncharge(self.budget().used());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolConfig;
    use crate::Pool;

    const PER_PAGE: u64 = crate::table::SLOTS_PER_PAGE;

    /// Makes mincore report table page `page` of `dev` as not resident while
    /// its slots stay intact, as after the host swapped it out.
    fn page_out(dev: &Device, page: u64) {
        dev.table.page_out(page as usize);
    }

    fn pool() -> Arc<Pool> {
        Pool::new(PoolConfig {
            arena_bytes: 1 << 30,
            ..Default::default()
        })
        .unwrap()
    }

    /// A compressible page that differs per `i`.
    fn page(i: u64) -> Page {
        let mut p = [0u8; PAGE_SIZE];
        for (j, c) in p.chunks_exact_mut(8).enumerate() {
            c.copy_from_slice(&(i * 1000 + j as u64 % 7).to_le_bytes());
        }
        p
    }

    /// Slots on 64 table pages, written three ways; returns them in order.
    fn write_spread(dev: &Device) -> Vec<u64> {
        let cx = &mut Context::new(0);
        let mut written = Vec::new();
        for tp in 0..64 {
            let s = tp * PER_PAGE + (tp * 37) % PER_PAGE;
            match tp % 3 {
                0 => dev.write_page(cx, s, &page(s)).unwrap(),
                1 => dev.write_page(cx, s, &[0x5a; PAGE_SIZE]).unwrap(),
                _ => dev.write_partial(cx, s, 100, &[1, 2, 3]).unwrap(),
            }
            written.push(s);
        }
        written
    }

    fn device(pool: &Arc<Pool>, slots: u64) -> Arc<Device> {
        let mut cfg = DeviceConfig::new(slots * PAGE_SIZE as u64, Codec::Lz4);
        cfg.shards = 1;
        pool.create_device(cfg).unwrap()
    }

    #[test]
    fn objects_on_paged_out_table_pages_are_still_found() {
        let pool = pool();
        let dev = device(&pool, 64 * PER_PAGE);
        let written = write_spread(&dev);
        // Written, then discarded: its page is marked but it is empty.
        let cx = &mut Context::new(0);
        dev.write_page(cx, 3, &page(3)).unwrap();
        dev.discard(cx, 3..4).unwrap();
        for tp in (0..64).step_by(2) {
            page_out(&dev, tp);
        }
        let mut seen = Vec::new();
        dev.for_each_object(|s, _| seen.push(s));
        assert_eq!(seen, written);
    }

    #[test]
    fn drop_frees_objects_on_paged_out_table_pages() {
        let pool = pool();
        let dev = device(&pool, 64 * PER_PAGE);
        write_spread(&dev);
        for tp in 0..64 {
            page_out(&dev, tp);
        }
        let held = pool.shared.host().used();
        assert!(held > 0);
        drop(dev);
        assert_eq!(
            pool.shared.host().used(),
            0,
            "dropping the device leaked spans ({held} bytes were held)"
        );
    }

    #[test]
    fn compaction_moves_objects_on_paged_out_table_pages() {
        const N: u64 = 4 * PER_PAGE;
        let pool = pool();
        let dev = device(&pool, N);
        let cx = &mut Context::new(0);
        for s in 0..N {
            dev.write_page(cx, s, &page(s)).unwrap();
        }
        for s in (0..N).step_by(2) {
            dev.discard(cx, s..s + 1).unwrap();
        }
        for tp in 0..N / PER_PAGE {
            page_out(&dev, tp);
        }
        let before = dev.stats().mem_used_total;
        let pages = dev.compact();
        let after = dev.stats();
        assert!(pages > 0, "compaction moved nothing");
        assert_eq!(before - after.mem_used_total, pages * PAGE_SIZE as u64);
        let mut buf = [0u8; PAGE_SIZE];
        for s in (1..N).step_by(2) {
            dev.read_page(cx, s, &mut buf).unwrap();
            assert!(buf == page(s), "slot {s} changed");
        }
    }

    /// Random bytes masked with `mask`, which lz4 cannot shrink enough:
    /// stored raw, so every seed gets the same slot word when it gets the
    /// same room. zstd's entropy coder halves pages of random nibbles.
    fn raw_page(seed: u64, mask: u8) -> Page {
        let mut p = [0u8; PAGE_SIZE];
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        for b in p.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8 & mask;
        }
        p
    }

    /// One writer keeps rewriting slot 0 while `pass` runs over and over
    /// in another thread, until the passes moved `pages` pages; every
    /// write must read back. Returns the pages the passes moved. (Before
    /// the passes compared bytes, a write was lost within a dozen pages.)
    fn rewrites_beside(dev: &Arc<Device>, mask: u8, pages: u64, pass: fn(&Device) -> u64) -> u64 {
        use std::sync::atomic::AtomicBool;
        let stop = Arc::new(AtomicBool::new(false));
        let moved = Arc::new(AtomicU64::new(0));
        let bg = {
            let (dev, stop, moved) = (dev.clone(), stop.clone(), moved.clone());
            std::thread::spawn(move || {
                while !stop.load(Relaxed) {
                    moved.fetch_add(pass(&dev), Relaxed);
                }
            })
        };
        let cx = &mut Context::new(0);
        let mut buf = [0u8; PAGE_SIZE];
        let mut lost = None;
        let mut next = raw_page(0, mask);
        for i in 0..100_000 {
            if moved.load(Relaxed) >= pages {
                break;
            }
            let page = next;
            dev.write_page(cx, 0, &page).unwrap();
            // Made here, between the write and the read, so that a pass
            // putting its page back is most likely caught.
            next = raw_page(i + 1, mask);
            dev.read_page(cx, 0, &mut buf).unwrap();
            if buf != page {
                lost = Some(i);
                break;
            }
        }
        stop.store(true, Relaxed);
        bg.join().unwrap();
        let n = moved.load(Relaxed);
        assert_eq!(
            lost, None,
            "write lost to a concurrent pass ({n} pages moved)"
        );
        n
    }

    /// A pass that looked at a page, let go of its lock, and came back to
    /// find the same slot word took it for the page it had read. But the
    /// word is the same for a rewrite whose new object got the old one's
    /// room: the pass then put the old page back over the new one.
    #[test]
    fn writeback_never_puts_back_a_page_overwritten_meanwhile() {
        let (dir, cfg) = backed_cfg("wb-aba", 0);
        let pool = pool();
        let dev = pool.create_device(cfg).unwrap();
        let n = rewrites_beside(&dev, 0xff, 100, |d| {
            d.writeback(Filter::default(), None).unwrap().pages
        });
        assert!(n > 0, "nothing was written back");
        drop(dev);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn recompression_never_puts_back_a_page_overwritten_meanwhile() {
        let pool = pool();
        let dev = device(&pool, 64);
        let n = rewrites_beside(&dev, 0x0f, 100, |d| {
            d.recompress(Filter::default(), Codec::Zstd { level: 5 })
                .unwrap()
                .pages
        });
        assert!(n > 0, "nothing was recompressed");
    }

    /// The spill's clock hand goes round: slots before it are scanned
    /// after those past it. It used to scan only from the hand to the end
    /// of the table (of the hand's table page, on a bigger device), so once
    /// the pages there were gone every spill found nothing to move, and
    /// each new page went to the backing file while older ones kept the
    /// memory.
    #[test]
    fn spills_scan_the_slots_behind_the_hand_too() {
        // Raw pages: one object per one-page span, so each write needs a
        // page of its own and the limit holds one.
        let (dir, cfg) = backed_cfg("hand", PAGE_SIZE as u64);
        let pool = pool();
        let dev = pool.create_device(cfg).unwrap();
        let cx = &mut Context::new(0);
        let mut buf = [0u8; PAGE_SIZE];
        // Each write spills the one page in memory, which is behind the
        // hand from the third on.
        for (i, s) in [10, 20, 5, 3, 1].into_iter().enumerate() {
            dev.write_page(cx, s, &raw_page(s, 0xff)).unwrap();
            let st = dev.stats();
            assert_eq!(st.spills, i as u64, "write {i} (slot {s})");
            assert_eq!(st.backed_pages, i as u64);
            // The newest page stays in memory.
            dev.read_page(cx, s, &mut buf).unwrap();
            assert!(buf == raw_page(s, 0xff));
            assert_eq!(dev.stats().backed_reads, 0, "slot {s} went to the file");
        }
        drop(dev);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A 64-slot lz4 device with a 64-block backing file in a fresh
    /// directory (removed by the caller) and memory limit `mem_limit`.
    fn backed_cfg(tag: &str, mem_limit: u64) -> (std::path::PathBuf, DeviceConfig) {
        let dir = std::env::temp_dir().join(format!("vzram-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("backing");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(65 * PAGE_SIZE as u64)
            .unwrap();
        let mut cfg = DeviceConfig::new(64 * PAGE_SIZE as u64, Codec::Lz4);
        cfg.shards = 1;
        cfg.mem_limit = mem_limit;
        cfg.backing = Some(BackingSpec { path });
        (dir, cfg)
    }

    fn state_cfg(root: &std::path::Path) -> DeviceConfig {
        let mut cfg = DeviceConfig::new(64 * PAGE_SIZE as u64, Codec::Lz4);
        cfg.state = Some(StateSpec {
            root: root.to_path_buf(),
            name: "d".into(),
            fresh: false,
        });
        cfg
    }

    /// A slot word that points at no object (a damaged table) stops the
    /// recovery with an error naming the file; the device is not served.
    #[test]
    fn a_damaged_slot_table_is_refused_not_served() {
        use std::os::unix::fs::FileExt;
        let root = std::env::temp_dir().join(format!("vzram-damaged-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let pool = pool();
        let cx = &mut Context::new(0);
        let dev = pool.create_device(state_cfg(&root)).unwrap();
        for s in 0..8 {
            dev.write_page(cx, s, &page(s)).unwrap();
        }
        drop(dev);
        // Recovered intact first.
        let dev = pool.create_device(state_cfg(&root)).unwrap();
        assert_eq!(dev.recovery().unwrap().slots, 8);
        let mut buf = [0u8; PAGE_SIZE];
        dev.read_page(cx, 5, &mut buf).unwrap();
        assert!(buf == page(5));
        drop(dev);
        // Slot 3 now names an object in the middle of another one.
        let bad = Slot::Object {
            offset: 16 * 3 + 1024,
            len: 100,
            huge: false,
            codec: 0,
        }
        .encode()
        .unwrap()
            | 8; // not a multiple of any class size
        let table = std::fs::OpenOptions::new()
            .write(true)
            .open(root.join("d/table"))
            .unwrap();
        table.write_all_at(&bad.to_ne_bytes(), 3 * 8).unwrap();
        let e = pool.create_device(state_cfg(&root)).err().unwrap();
        let msg = e.to_string();
        assert!(
            msg.contains("slot 3") && msg.contains("d/table") && msg.contains("--fresh"),
            "{msg}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
