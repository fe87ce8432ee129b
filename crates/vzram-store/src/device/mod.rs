//! A device: a fixed array of 4 KiB slots backed by the shared pool.
//!
//! Every operation on a slot holds that slot's lock bit and nothing wider.
//! Compression happens before the lock is taken, so a writer holds it only
//! to swap one word; readers hold it while decompressing, which is what stops
//! compaction or a writer from freeing the object under them.
//!
//! This file holds the device and what its jobs share. Each job is an
//! `impl Device` in a file of its own, which uses this one and never a
//! sibling: `io` (reads, writes, discards), `recover` (rebuilding from the
//! slot table), `tier` (idle marks, writeback, spills, recompression),
//! `compact`, `export` (migration), `prepare` (a write in two halves) and
//! `stage` (raw staging and the background compression of staged pages).

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use crate::backing::{AlignedPages, Backing, BackingSpec};
use crate::cells::{Cells, DeviceCells, MAX_SHARDS};
use crate::codec::{Codec, CodecState, MAX_COMPRESSED};
use crate::context::Context;
use crate::error::{Result, StoreError};
use crate::id::random_id;
use crate::limits::Budget;
use crate::migrate::record::DirtyLog;
use crate::pool::arena::Arena;
use crate::pool::class::{BLOCK_BYTES, NUM_CLASSES};
use crate::pool::heap::{Heap, NewObject};
use crate::pool::Shared;
use crate::slot::{self, Slot};
use crate::state::{self, StateFiles, StateSpec};
use crate::stats::{Counters, DeviceStats, Footprint};
use crate::table::SlotTable;
use crate::{Page, PAGE_SIZE};

mod compact;
mod export;
mod io;
mod prepare;
mod recover;
mod stage;
#[cfg(test)]
mod tests;
mod tier;

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
    /// Raw staging budget in bytes: whole-page writes store pages raw
    /// while staged pages take less, for [`Device::compress_staged`] to
    /// compress later. 0: off (every write compresses inline).
    pub staging_bytes: u64,
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
            staging_bytes: 0,
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
    /// Stored raw: the codec could not shrink them below the threshold
    /// (not staged pages, which the background has yet to try).
    pub huge: bool,
    /// Huge, and recompression could not shrink them either.
    pub incompressible: bool,
}

impl Filter {
    /// Whether the filter takes `word` on a device whose codec is `codec`.
    fn matches(self, word: u64, codec: u8) -> bool {
        let Slot::Object { huge, .. } = Slot::decode(word) else {
            return false;
        };
        // A staged page is raw only until the background compresses it:
        // not one the codec could not shrink.
        let huge = huge && !slot::is_staged(word, codec);
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

/// Called when a write stages a page into an empty FIFO.
pub type Waker = Box<dyn Fn() + Send + Sync>;

/// The device's staging state (the budget's use is in its cells).
struct Staging {
    /// Bytes of staged pages the device may hold; 0: staging is off.
    limit: AtomicU64,
    /// Staged slots, oldest first, with when they were staged.
    fifo: Mutex<VecDeque<(u64, Instant)>>,
    /// The FIFO's length, read without its lock.
    queued: AtomicUsize,
    /// Pages compressed since the last compaction.
    since_compact: AtomicU64,
    waker: OnceLock<Waker>,
}

impl Staging {
    fn new(limit: u64) -> Staging {
        Staging {
            limit: AtomicU64::new(limit),
            fifo: Mutex::new(VecDeque::new()),
            queued: AtomicUsize::new(0),
            since_compact: AtomicU64::new(0),
            waker: OnceLock::new(),
        }
    }
}

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
    staging: Staging,
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
    /// Staged pages (stored raw, to be compressed in the background).
    pub staged: u64,
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

/// Refuses a backing file that `st`'s device may not take; a state made
/// just now for it is deleted again, so the refusal leaves nothing behind.
pub fn check_claim_or_undo(b: &Backing, st: &StateFiles) -> Result<()> {
    let r = b.check_claim(st.header.creation_id, st.replaced);
    if r.is_err() && !st.existing {
        if let Err(e) = state::discard_held(st) {
            tracing::warn!(state = %st.dir.display(), "cannot delete the state made for a refused backing file: {e}");
        }
    }
    r
}

/// Opens (or makes) the state `cfg.state` names, laid out as a device of
/// the default pool would lay it out, for a process that hands the files
/// to the one that will serve the device (`Pool::attach_device`).
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
    Room(NewObject),
    Direct(u64),
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
        // The backing file first: one that is refused leaves no new state.
        let backing = cfg.backing.as_ref().map(Backing::open).transpose()?;
        let state = match &cfg.state {
            Some(spec) => Some(state::open(spec, cfg.size_bytes, arena_bytes, cfg.codec)?),
            None => None,
        };
        if let (Some(b), Some(st)) = (&backing, &state) {
            check_claim_or_undo(b, st)?;
        }
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
            staging: Staging::new(cfg.staging_bytes),
            dirty: DirtyLog::default(),
        };
        dev.keep_spares();
        match &state {
            Some(st) if st.existing => dev.recovery = Some(dev.recover(st)?),
            _ => {
                // New memory: whatever the cells said belongs to nothing.
                dev.cells.budget.reset_used();
                for c in &dev.cells.counters {
                    c.clear_gauges();
                }
                dev.cells.staged_bytes.store(0, Relaxed);
                dev.cells.charged_to.store(dev.pool.host_id, Relaxed);
            }
        }
        dev.budget().set_limit(cfg.mem_limit);
        if let Some(b) = &dev.backing {
            // Recovery checked that pages on it are this device's; from now
            // on the file says so too.
            let owner = state
                .as_ref()
                .map_or_else(random_id, |s| s.header.creation_id);
            b.claim(owner, state.as_ref().and_then(|s| s.replaced))?;
        }
        dev.state = state;
        Ok(dev)
    }

    /// The device's mappings of its state files, by file name (address,
    /// length), so that a SIGBUS on one can be put down to that file.
    pub fn state_mappings(&self) -> [(&'static str, *const u8, usize); 3] {
        let (t, tl) = self.table.mapping();
        let (a, al) = self.heap.arena().mapping();
        let (c, cl) = self.cells.mapping();
        [("table", t, tl), ("arena", a, al), ("stats", c, cl)]
    }

    #[inline]
    fn budget(&self) -> &Budget {
        &self.cells.budget
    }

    #[inline]
    fn counters(&self) -> &[Counters] {
        &self.cells.counters[..self.shards]
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

    /// The descriptor of the arena's state file, which staged pages are
    /// written through (pwrite) where the device keeps state.
    pub fn arena_fd(&self) -> Option<std::os::fd::RawFd> {
        self.heap.arena().file_fd()
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
            self.pool.host_staging().uncharge(self.staged_bytes());
        }
    }
}
