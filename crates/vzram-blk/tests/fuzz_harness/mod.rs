//! Fuzz harness for the virtio-blk request path: descriptor chains over fake
//! guest memory → `drain_queue` (the queue threads' own loop: pop, parse,
//! execute, status byte, used ring, notifications) → the page store.
//!
//! Shared, through `#[path]`, by the cargo-fuzz target
//! (`fuzz/fuzz_targets/blk_request.rs`) and the corpus replay test
//! (`tests/fuzz_corpus.rs`), so a corpus file means the same thing to both.
//! Only the public API of `vzram-blk` and `vzram-store` is used.
//!
//! An input is a small program: two configuration bytes, then operations
//! that play the guest (write descriptors, headers, discard segments and
//! bytes anywhere in guest memory, build direct and indirect chains, publish
//! heads in the avail ring) or the host (switch to the read-only view, change
//! the memory limit, compact). The queue is drained by
//! `vzram_blk::drain_queue`, the function `BlkBackend` runs; a `ChainHook`
//! shows the harness each chain before and after it runs, and every one is
//! checked against an independent model written from the virtio spec and the
//! limits vzram advertises:
//!
//! * nothing panics;
//! * a chain whose last descriptor has no writable, in-memory last byte gets
//!   no status and a used length of 0; otherwise the status lands exactly on
//!   that byte (poisoned beforehand where the chain does not read it, so a
//!   status that is never written shows), and malformed chains get IOERR,
//!   unknown types and flags, and more discard segments than offered, UNSUPP;
//! * guest memory changes only where the request may write: the status byte,
//!   and for IN and GET_ID the device-writable payload, with exactly the
//!   expected bytes; and the used ring, with exactly the expected element
//!   (head, payload written + 1) and index;
//! * a drain ends as the ring says: an out-of-range head ends it with an
//!   error after that chain, a ring that claims work it cannot give (with
//!   EVENT_IDX) with `Unreadable`, anything else with Ok; the guest is
//!   notified exactly where the model says (every `SIGNAL_EVERY` completions
//!   and at the end; with EVENT_IDX only where `used_event` asks);
//! * a request that fails does not reach the store at all (its write and
//!   discard counters do not move), except when a memory limit is hit in the
//!   middle of a write: then a prefix of the request's page-sized pieces is
//!   applied and nothing else changes;
//! * the store always equals a shadow copy of the disk: unwritten space reads
//!   as zeros, successful writes and discards read back, compaction moves
//!   nothing visible;
//! * with a second queue: another thread drains a second queue of the same
//!   device at the same time, with reads only (so the first queue's model
//!   stays exact), and every page it read is a version that page had;
//! * chains complete in the order they were taken, one batch or not; a
//!   FLUSH completes after every chain taken before it, with what they
//!   wrote in the store; a read sees every write taken before it.
//!
//! With the pool mode the queues take chains in batches and a compress
//! pool prepares their whole-page writes of `POOL_MIN_PAGES` pages and
//! more (the backend's path with compress threads). A chain of a batch
//! runs after the others taken before it have run, so the model reads its
//! payload (OUT data, discard segments) from memory as it is then, and what
//! the queue reads when it takes the chain (descriptors, header, a pooled
//! write's pages) as it was then. Inputs may change a buffer while its
//! request is in flight, which a guest must not: to keep one right answer,
//! the model follows the queue's rule for which writes the pool takes.
//!
//! Any violation panics with a message that says what differed.
//!
//! The files, by job: `input.rs` reads an input and decodes its values;
//! `guest.rs` plays the guest (the operations); `memory.rs` is the fake
//! guest memory and its snapshots; `model.rs` says what a chain must do;
//! `drain.rs` runs the real drain and checks each chain and each drain;
//! `shadow.rs` checks the store against a copy of the disk; `reader.rs` is
//! the second queue; `seed.rs` writes inputs for the seed corpus.

#![allow(dead_code)]

mod drain;
mod guest;
mod input;
mod memory;
mod model;
mod reader;
pub mod seed;
mod shadow;

use std::cell::RefCell;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vzram_blk::device::BlkDevice;
use vzram_blk::pool::CompressPool;
use vzram_blk::queue::Scratch;
use vzram_store::{Codec, Context, Device, DeviceConfig, Pool, PoolConfig, PAGE_SIZE};

use drain::{ChainCtx, DrainLog};
use input::Input;
use memory::{zero, Region, LAYOUTS};
use reader::run_with_reader;
use shadow::page_hash;

/// Disk size: 64 slots, small enough to compare whole after every input.
pub const DEV_SIZE: u64 = 256 << 10;
/// The big disk (`mode::BIG_DISK`): 1024 slots, still cheap to compare whole
/// (unwritten slots read as zeros without decompressing).
pub const BIG_DEV_SIZE: u64 = 4 << 20;
pub const SECTOR: u64 = 512;
pub const DEV_SECTORS: u64 = DEV_SIZE / SECTOR;
const PAGE: u64 = PAGE_SIZE as u64;
/// Longer than GET_ID's 20 bytes on purpose: the device cuts it.
pub const SERIAL: &str = "vzram-fuzz-serial-0123456789";

/// Caps so one input stays fast.
const MAX_OPS: usize = 64;
const MAX_CHAINS: usize = 64;
/// Chains one drain may take before the harness, as the guest, stops
/// publishing (chains that rewrite the avail index could go on for long).
const DRAIN_CAP: u32 = 512;

/// Where the harness's own queue lives in guest memory (the guest may
/// overwrite it like anything else).
pub const DESC_TABLE: u64 = 0x0;
pub const AVAIL_RING: u64 = 0x1000;
pub const USED_RING: u64 = 0x1400;
/// Scratch areas the request macro uses.
pub const HDR_AT: u64 = 0x2000;
pub const STATUS_AT: u64 = 0x2010;
pub const SEGS_AT: u64 = 0x3000;
pub const DATA_AT: u64 = 0x4000;
pub const INDIRECT_AT: u64 = 0xc000;
/// The batch macro's headers, status bytes and indirect tables; its data
/// is the last 64 KiB of guest memory.
pub const BATCH_HDR_AT: u64 = 0x2100;
pub const BATCH_STATUS_AT: u64 = 0x2200;
pub const BATCH_TABLES_AT: u64 = 0xd000;
pub const BATCH_DATA_LEN: u64 = 0x1_0000;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;

const ST_OK: u8 = VIRTIO_BLK_S_OK as u8;
const ST_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const ST_UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;
/// Written where a status byte is due, before the chain runs: no status is 0xee.
const ST_POISON: u8 = 0xee;

/// The second configuration byte. An input of one byte, or whose second
/// byte is 0, runs as before these existed: lz4, small disk, no EVENT_IDX,
/// one queue.
pub mod mode {
    /// Bits 0-1: the codec (3 is lz4 too).
    pub const LZ4: u8 = 0;
    pub const ZSTD: u8 = 1;
    pub const ZSTD3: u8 = 2;
    pub const BIG_DISK: u8 = 1 << 2;
    pub const EVENT_IDX: u8 = 1 << 3;
    pub const SECOND_QUEUE: u8 = 1 << 4;
    /// The queues take batches, the compress pool (`POOL_THREADS`)
    /// prepares their big writes.
    pub const POOL: u8 = 1 << 5;
    /// Every combination, for running the built-in seeds in each.
    pub const ALL: [u8; 48] = {
        let mut all = [0u8; 48];
        let mut i = 0;
        while i < 48 {
            all[i] = (i % 3) as u8 | ((i / 3) as u8) << 2;
            i += 1;
        }
        all
    };
}

/// Operation codes (the first byte of each operation, modulo `OP_COUNT`).
pub mod op {
    pub const DESC: u8 = 0;
    pub const DESC_AT: u8 = 1;
    pub const BYTES: u8 = 2;
    pub const HEADER: u8 = 3;
    pub const SEGMENTS: u8 = 4;
    pub const FILL: u8 = 5;
    pub const KICK: u8 = 6;
    pub const CHAIN: u8 = 7;
    pub const INDIRECT: u8 = 8;
    pub const REQUEST: u8 = 9;
    pub const READONLY: u8 = 10;
    pub const LIMIT: u8 = 11;
    pub const COMPACT: u8 = 12;
    pub const PROCESS: u8 = 13;
    pub const LONG_CHAIN: u8 = 14;
    pub const OP_COUNT: u8 = 15;
    /// Only the byte 15 itself (which `% OP_COUNT` made DESC before it
    /// came, and no checked-in input has), so old inputs keep their meaning.
    pub const BATCH: u8 = 15;
}

/// Threads of the pool mode's compress pool.
pub const POOL_THREADS: usize = 2;

/// What one input did; the replay test checks the corpus reaches each case.
#[derive(Debug, Default, Clone, Copy)]
pub struct Summary {
    pub chains: u64,
    pub no_status: u64,
    pub malformed: u64,
    pub unsupp: u64,
    pub exec_ioerr: u64,
    pub limit_failures: u64,
    pub ok_reads: u64,
    pub ok_writes: u64,
    pub ok_zero: u64,
    pub ok_other: u64,
    pub indirect: u64,
    pub readonly_chains: u64,
    /// Chains on a zstd device, on the big disk, with EVENT_IDX.
    pub zstd: u64,
    pub big_disk: u64,
    pub event_idx: u64,
    /// Requests the second queue's thread completed.
    pub second_queue: u64,
    /// Notifications sent before the end of a drain (`SIGNAL_EVERY`).
    pub early_signals: u64,
    /// Drains that ended on an out-of-range head, and on `Unreadable`.
    pub bad_head_drains: u64,
    pub unreadable_drains: u64,
    /// Chains run with the pool mode; writes the pool took; FLUSHes
    /// completed behind such writes in one batch.
    pub pooled_chains: u64,
    pub pooled_writes: u64,
    pub flush_behind_pooled: u64,
}

impl Summary {
    pub fn add(&mut self, o: &Summary) {
        self.chains += o.chains;
        self.no_status += o.no_status;
        self.malformed += o.malformed;
        self.unsupp += o.unsupp;
        self.exec_ioerr += o.exec_ioerr;
        self.limit_failures += o.limit_failures;
        self.ok_reads += o.ok_reads;
        self.ok_writes += o.ok_writes;
        self.ok_zero += o.ok_zero;
        self.ok_other += o.ok_other;
        self.indirect += o.indirect;
        self.readonly_chains += o.readonly_chains;
        self.zstd += o.zstd;
        self.big_disk += o.big_disk;
        self.event_idx += o.event_idx;
        self.second_queue += o.second_queue;
        self.early_signals += o.early_signals;
        self.bad_head_drains += o.bad_head_drains;
        self.unreadable_drains += o.unreadable_drains;
        self.pooled_chains += o.pooled_chains;
        self.pooled_writes += o.pooled_writes;
        self.flush_behind_pooled += o.flush_behind_pooled;
    }
}

/// Runs one fuzz input; panics on any invariant violation.
pub fn run(data: &[u8]) -> Summary {
    run_with(data, false)
}

/// `sabotage` corrupts the shadow copy after the first successful write, so
/// that a test can show the checks fire.
pub fn run_with(data: &[u8], sabotage: bool) -> Summary {
    let sel = usize::from(data.first().copied().unwrap_or(0) & 3);
    let modes = data.get(1).copied().unwrap_or(0);
    // Guest memory and buffers are reused between inputs (fresh mappings
    // cost more in page faults than the rest of a run); guest memory is
    // zeroed first, so every input still starts from the same state. The
    // store is created anew each time.
    let (mem, bufs) = CACHE.with(|c| {
        let mut c = c.borrow_mut();
        (c.mems[sel].take(), std::mem::take(&mut c.bufs))
    });
    let mem = mem.unwrap_or_else(|| {
        let ranges: Vec<(GuestAddress, usize)> = LAYOUTS[sel]
            .iter()
            .map(|&(start, len)| (GuestAddress(start), len as usize))
            .collect();
        GuestMemoryMmap::from_ranges(&ranges).expect("guest memory")
    });
    for &(start, len) in LAYOUTS[sel] {
        zero(&mem, start, len);
    }
    let mut h = Harness::new(data, &mem, bufs, sabotage);
    if modes & mode::SECOND_QUEUE != 0 {
        run_with_reader(&mut h, data);
    } else {
        h.run();
    }
    let summary = h.summary;
    let bufs = h.into_bufs();
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        c.mems[sel] = Some(mem);
        c.bufs = bufs;
    });
    summary
}

/// Buffers a run needs, kept between runs.
#[derive(Default)]
struct Bufs {
    shadow: Vec<u8>,
    /// Guest memory as the checks expect it now, one vector per region.
    cur: Vec<Vec<u8>>,
    /// Guest memory as it is after a request.
    next: Vec<Vec<u8>>,
    scratch: Option<Scratch>,
}

#[derive(Default)]
struct Cache {
    mems: [Option<GuestMemoryMmap>; 4],
    reader_mem: Option<GuestMemoryMmap>,
    bufs: Bufs,
    /// Belongs to no device: kept, so its threads start once.
    pool: Option<Arc<CompressPool>>,
}

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
}

struct Harness<'a> {
    inp: Input<'a>,
    regions: Vec<Region>,
    mem: &'a GuestMemoryMmap,
    /// Out while a drain runs.
    queue: Option<Queue>,
    scratch: Option<Scratch>,
    /// With the pool mode: the pool, and the cached scratch (made for no
    /// store), kept for the next input.
    pool: Option<Arc<CompressPool>>,
    spare_scratch: Option<Scratch>,
    /// The checks' own store context: they read the store while the
    /// queue's scratch is out in a drain.
    check_cx: Context,
    qsize: u16,
    event_idx: bool,
    dev_size: u64,
    store: Arc<Device>,
    rw: Arc<BlkDevice>,
    ro: Arc<BlkDevice>,
    readonly: bool,
    /// Some memory limit is set, so writes may fail half-way.
    host_limited: bool,
    shadow: Vec<u8>,
    /// With a second queue: every (slot, page hash) the disk has held.
    versions: Option<HashSet<(u64, u64)>>,
    sabotage: bool,
    summary: Summary,
    cur: Vec<Vec<u8>>,
    next: Vec<Vec<u8>>,
    /// The ring indices as the model counts them.
    next_avail: u16,
    next_used: u16,
    drain: DrainLog,
    /// Chains taken and not yet run, in the order taken: what the model
    /// expects of each.
    chains: VecDeque<ChainCtx>,
    /// A chain was taken since the last one ran: the batch goes on.
    taking: bool,
    /// Pages of the batch's writes the pool takes, and how many of those
    /// writes have completed.
    batch_pages: usize,
    batch_pooled_done: u64,
    /// Byte ranges written or zeroed since the last FLUSH.
    unflushed: Vec<(u64, u64)>,
}

impl<'a> Harness<'a> {
    fn new(data: &'a [u8], mem: &'a GuestMemoryMmap, bufs: Bufs, sabotage: bool) -> Harness<'a> {
        let mut inp = Input::new(data);
        // Configuration byte: bits 0-1 layout, 2-5 queue size, 6 read-only,
        // 7 limits (a device limit and a host limit). Then the `mode` byte.
        let cfg = inp.u8();
        let modes = inp.u8();
        let layout = LAYOUTS[usize::from(cfg & 3)];
        let regions: Vec<Region> = layout
            .iter()
            .map(|&(start, len)| Region { start, len })
            .collect();
        let qsize = 1u16 << (((cfg >> 2) & 0xf) % 9); // 1..=256
        let event_idx = modes & mode::EVENT_IDX != 0;
        let mut queue = Queue::new(256).expect("queue");
        queue.set_size(qsize);
        queue.set_desc_table_address(Some(DESC_TABLE as u32), Some(0));
        queue.set_avail_ring_address(Some(AVAIL_RING as u32), Some(0));
        queue.set_used_ring_address(Some(USED_RING as u32), Some(0));
        queue.set_event_idx(event_idx);
        queue.set_ready(true);
        assert!(queue.is_valid(mem), "harness queue layout");

        let codec = match modes & 3 {
            mode::ZSTD => Codec::Zstd {
                level: Codec::DEFAULT_ZSTD_LEVEL,
            },
            mode::ZSTD3 => Codec::Zstd { level: 3 },
            _ => Codec::Lz4,
        };
        let dev_size = if modes & mode::BIG_DISK != 0 {
            BIG_DEV_SIZE
        } else {
            DEV_SIZE
        };
        let second_queue = modes & mode::SECOND_QUEUE != 0;
        let limited = cfg & 0x80 != 0;
        let host_limit = if limited { 96 * 1024 } else { 0 };
        let pool = Pool::new(PoolConfig {
            host_mem_limit: host_limit,
            arena_bytes: 64 << 20,
            ..PoolConfig::default()
        })
        .expect("pool");
        let mut dcfg = DeviceConfig::new(dev_size, codec);
        dcfg.shards = 1;
        dcfg.mem_limit = if limited { 48 * 1024 } else { 0 };
        let store = pool.create_device(dcfg).expect("store device");
        let queues = if second_queue { 2 } else { 1 };
        let compress = (modes & mode::POOL != 0).then(|| {
            CACHE.with(|c| {
                let mut c = c.borrow_mut();
                let p = c.pool.get_or_insert_with(|| {
                    CompressPool::new(POOL_THREADS, 1).expect("compress pool")
                });
                Arc::clone(p)
            })
        });
        let rw = Arc::new(BlkDevice::new(store.clone(), queues, false, SERIAL));
        let ro = Arc::new(BlkDevice::new(store.clone(), queues, true, SERIAL));
        let versions = second_queue.then(|| {
            let zero = page_hash(&[0; PAGE_SIZE]);
            (0..dev_size / PAGE).map(|slot| (slot, zero)).collect()
        });
        let (scratch, spare_scratch) = match &compress {
            Some(p) => (
                Scratch::with_pool(0, p.clone(), store.clone()),
                bufs.scratch,
            ),
            None => (bufs.scratch.unwrap_or_else(|| Scratch::new(0)), None),
        };
        Harness {
            inp,
            regions,
            mem,
            queue: Some(queue),
            scratch: Some(scratch),
            pool: compress,
            spare_scratch,
            check_cx: Context::new(0),
            qsize,
            event_idx,
            dev_size,
            store,
            rw,
            ro,
            readonly: cfg & 0x40 != 0,
            host_limited: limited,
            shadow: {
                let mut v = bufs.shadow;
                v.clear();
                v.resize(dev_size as usize, 0);
                v
            },
            versions,
            cur: bufs.cur,
            next: bufs.next,
            sabotage,
            summary: Summary::default(),
            next_avail: 0,
            next_used: 0,
            drain: DrainLog::default(),
            chains: VecDeque::new(),
            taking: false,
            batch_pages: 0,
            batch_pooled_done: 0,
            unflushed: Vec::new(),
        }
    }

    fn run(&mut self) {
        for _ in 0..MAX_OPS {
            if self.inp.is_empty() || self.summary.chains >= MAX_CHAINS as u64 {
                break;
            }
            self.op();
        }
        // Whatever is still pending in the ring.
        self.process();
        self.verify_all("end of input");
    }

    fn limited(&self) -> bool {
        self.host_limited || self.store.mem_limit() != 0
    }

    fn into_bufs(self) -> Bufs {
        Bufs {
            shadow: self.shadow,
            cur: self.cur,
            next: self.next,
            scratch: match self.pool {
                Some(_) => self.spare_scratch,
                None => self.scratch,
            },
        }
    }
}
