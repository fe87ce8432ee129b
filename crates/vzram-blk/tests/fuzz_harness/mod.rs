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
//!   unknown types and flags UNSUPP;
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
//!   stays exact), and every page it read is a version that page had.
//!
//! Any violation panics with a message that says what differed.

#![allow(dead_code)]

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::hash::{DefaultHasher, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryMmap};
use vzram_blk::backend::{drain_queue, ChainError, ChainHook, QueueError, Scratch, SIGNAL_EVERY};
use vzram_blk::config::{MAX_DESCRIPTORS, MAX_DISCARD_SECTORS, MAX_DISCARD_SEG, SERIAL_LEN};
use vzram_blk::device::{BlkDevice, ExecError};
use vzram_blk::request::{Request, RequestType};
use vzram_store::{
    Codec, Context, Device, DeviceConfig, Page, Pool, PoolConfig, StoreError, PAGE_SIZE,
};

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

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;

const ST_OK: u8 = VIRTIO_BLK_S_OK as u8;
const ST_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const ST_UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;
/// Written where a status byte is due, before the chain runs: no status is 0xee.
const ST_POISON: u8 = 0xee;

const K64: u64 = 0x1_0000;
/// Guest memory layouts, chosen by the configuration byte: one region; two
/// with a gap; two adjacent regions (one contiguous range split in two
/// mappings); one region at the very top of the address space.
const LAYOUTS: [&[(u64, u64)]; 4] = [
    &[(0, 2 * K64)],
    &[(0, K64), (2 * K64, K64)],
    &[(0, K64), (K64, K64)],
    &[(0, K64), (0xffff_ffff_fffe_0000, K64)],
];

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
    /// Every combination, for running the built-in seeds in each.
    pub const ALL: [u8; 24] = {
        let mut all = [0u8; 24];
        let mut i = 0;
        while i < 24 {
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
}

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

fn zero(mem: &GuestMemoryMmap, start: u64, len: u64) {
    for off in (0..len).step_by(ZEROS.len()) {
        mem.write_slice(&ZEROS, GuestAddress(start + off))
            .expect("zero guest memory");
    }
}

/// Runs the input while a second thread drains a second queue of the same
/// device; then checks every page that thread read against the versions the
/// shadow went through.
fn run_with_reader(h: &mut Harness, data: &[u8]) {
    let rmem = CACHE
        .with(|c| c.borrow_mut().reader_mem.take())
        .unwrap_or_else(|| {
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), R_MEM as usize)])
                .expect("reader memory")
        });
    zero(&rmem, 0, R_MEM);
    let dev = Arc::clone(&h.rw);
    let pages = h.dev_size / PAGE;
    let event_idx = h.event_idx;
    let seed = {
        let mut x = DefaultHasher::new();
        x.write(data);
        x.finish()
    };
    let stop = AtomicBool::new(false);
    let (reads, done) = std::thread::scope(|s| {
        let reader = s.spawn(|| reader(&dev, &rmem, pages, seed, event_idx, &stop));
        {
            // Set even when the run panics, or the scope would wait forever.
            let _stop = StopOnDrop(&stop);
            h.run();
        }
        reader
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    });
    h.summary.second_queue += done;
    let versions = h
        .versions
        .as_ref()
        .expect("versions are kept with a reader");
    for &(slot, hash) in &reads {
        assert!(
            versions.contains(&(slot, hash)),
            "the second queue read a version of slot {slot} it never had"
        );
    }
    CACHE.with(|c| c.borrow_mut().reader_mem = Some(rmem));
}

struct StopOnDrop<'s>(&'s AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

static ZEROS: [u8; 0x1_0000] = [0; 0x1_0000];

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
}

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
}

/// A page's content as a u64 for the version sets: FxHash over words, much
/// cheaper than SipHash; nothing here is adversarial enough to need more.
fn page_hash(page: &[u8]) -> u64 {
    page.chunks_exact(8).fold(page.len() as u64, |h, w| {
        let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        (h.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95)
    })
}

// ---- the second queue -------------------------------------------------------

/// The reader's own guest memory (so the fuzzed chains cannot scribble on
/// its ring) and its layout.
const R_MEM: u64 = 0x40000;
const R_QSIZE: u16 = 32;
const R_BATCH: usize = 8;
const R_AVAIL: u64 = 0x1000;
const R_USED: u64 = 0x2000;
const R_HDR: u64 = 0x3000;
const R_STATUS: u64 = 0x3800;
const R_DATA: u64 = 0x10000;
/// Up to 4 pages per request.
const R_DATA_STRIDE: u64 = 0x4000;
/// Bounds: an input takes a few milliseconds, about as long as this many
/// rounds; more would only take CPU from the main thread.
const R_ROUNDS: usize = 64;
const R_RECORDS: usize = 1 << 14;

/// One request of the reader: type and, for IN, first slot and page count.
#[derive(Clone, Copy, Default)]
struct RReq {
    t: u32,
    slot: u64,
    pages: u64,
}

impl RReq {
    fn payload(&self) -> u32 {
        match self.t {
            VIRTIO_BLK_T_IN => (self.pages * PAGE) as u32,
            VIRTIO_BLK_T_GET_ID => SERIAL_LEN as u32,
            _ => 0,
        }
    }
}

/// Checks each chain of the reader's queue as it completes.
struct ReaderHook {
    batch: [RReq; R_BATCH],
    n: usize,
}

impl ChainHook for ReaderHook {
    fn ran(&mut self, head: u16, _req: &Request, result: &Result<u32, ChainError>, used: u32) {
        let i = self.n;
        self.n += 1;
        assert_eq!(usize::from(head), 3 * i, "second queue: completion order");
        let want = self.batch[i].payload();
        match result {
            Ok(n) if *n == want => {}
            other => panic!("second queue: request {i} ended {other:?}, expected Ok({want})"),
        }
        assert_eq!(used, want + 1, "second queue: used length");
    }
}

/// Drains a second queue of `dev` in rounds of `R_BATCH` requests (whole-page
/// IN, FLUSH, GET_ID) until `stop`; returns (slot, hash) of every page read
/// and the number of requests completed.
fn reader(
    dev: &BlkDevice,
    mem: &GuestMemoryMmap,
    pages: u64,
    seed: u64,
    event_idx: bool,
    stop: &AtomicBool,
) -> (Vec<(u64, u64)>, u64) {
    let mut queue = Queue::new(R_QSIZE).expect("queue");
    queue.set_desc_table_address(Some(0), Some(0));
    queue.set_avail_ring_address(Some(R_AVAIL as u32), Some(0));
    queue.set_used_ring_address(Some(R_USED as u32), Some(0));
    queue.set_event_idx(event_idx);
    queue.set_ready(true);
    assert!(queue.is_valid(mem), "reader queue layout");
    // The second queue: its own store context, on the other shard index.
    let mut scratch = Scratch::new(1);
    let mut x = seed | 1;
    let mut reads = Vec::new();
    let mut done = 0u64;
    let mut avail = 0u16;
    let mut page = vec![0u8; PAGE_SIZE];
    for round in 0..R_ROUNDS {
        // At least one round, so every such input reaches the second queue.
        if round > 0 && stop.load(Ordering::Relaxed) {
            break;
        }
        let mut hook = ReaderHook {
            batch: [RReq::default(); R_BATCH],
            n: 0,
        };
        for (i, r) in hook.batch.iter_mut().enumerate() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *r = match x % 8 {
                6 => RReq {
                    t: VIRTIO_BLK_T_FLUSH,
                    ..RReq::default()
                },
                7 => RReq {
                    t: VIRTIO_BLK_T_GET_ID,
                    ..RReq::default()
                },
                _ => {
                    let n = (x >> 8) % 4 + 1;
                    RReq {
                        t: VIRTIO_BLK_T_IN,
                        slot: (x >> 16) % (pages - n + 1),
                        pages: n,
                    }
                }
            };
            let (hdr, status) = (R_HDR + 16 * i as u64, R_STATUS + i as u64);
            let h = Harness::header_bytes(r.t, 0, r.slot * (PAGE / SECTOR));
            mem.write_slice(&h, GuestAddress(hdr)).expect("header");
            mem.write_obj(ST_POISON, GuestAddress(status))
                .expect("status");
            let d = 3 * i as u16;
            let mut descs = vec![Descriptor::new(hdr, 16, F_NEXT, d + 1)];
            if r.payload() > 0 {
                let data = R_DATA + R_DATA_STRIDE * i as u64;
                descs.push(Descriptor::new(data, r.payload(), F_NEXT | F_WRITE, d + 2));
            }
            descs.push(Descriptor::new(status, 1, F_WRITE, 0));
            for (k, desc) in descs.into_iter().enumerate() {
                mem.write_obj(desc, GuestAddress(16 * u64::from(d + k as u16)))
                    .expect("descriptor");
            }
            let slot = R_AVAIL + 4 + 2 * u64::from(avail % R_QSIZE);
            mem.write_obj(d, GuestAddress(slot)).expect("avail ring");
            avail = avail.wrapping_add(1);
        }
        mem.write_obj(avail, GuestAddress(R_AVAIL + 2))
            .expect("avail index");
        let r = drain_queue(
            &mut (&mut queue, || Ok(())),
            &mem,
            dev,
            event_idx,
            &mut scratch,
            &mut hook,
        );
        assert!(r.is_ok(), "second queue: drain failed: {r:?}");
        assert_eq!(hook.n, R_BATCH, "second queue: chains taken");
        done += R_BATCH as u64;
        let used: u16 = mem.read_obj(GuestAddress(R_USED + 2)).expect("used index");
        assert_eq!(used, avail, "second queue: used index");
        for (i, r) in hook.batch.iter().enumerate() {
            let st: u8 = mem
                .read_obj(GuestAddress(R_STATUS + i as u64))
                .expect("status");
            assert_eq!(st, ST_OK, "second queue: status of request {i}");
            for p in 0..r.pages {
                if reads.len() == R_RECORDS {
                    break;
                }
                let at = R_DATA + R_DATA_STRIDE * i as u64 + p * PAGE;
                mem.read_slice(&mut page, GuestAddress(at)).expect("data");
                reads.push((r.slot + p, page_hash(&page)));
            }
        }
    }
    (reads, done)
}

/// Reads the input as a stream; past its end every read yields zeros.
struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Input<'_> {
    fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }
    fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        for b in a.iter_mut() {
            *b = self.u8();
        }
        a
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let end = (self.pos + n).min(self.data.len());
        let v = self.data.get(self.pos..end).unwrap_or(&[]).to_vec();
        self.pos += n;
        v
    }
}

#[derive(Debug, Clone, Copy)]
struct Region {
    start: u64,
    len: u64,
}

impl Region {
    fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// A range of guest memory as the model sees it.
#[derive(Debug, Clone, Copy)]
struct Seg {
    addr: u64,
    len: u64,
}

#[derive(Debug)]
enum Effect {
    /// FLUSH: nothing changes but the status.
    Nothing,
    /// IN: the disk bytes at `start` land in the writable payload.
    Read {
        start: u64,
        segs: Vec<Seg>,
        len: u64,
    },
    /// GET_ID: the serial's first `n` bytes land in the writable payload.
    GetId { segs: Vec<Seg>, n: usize },
    /// OUT: `data` is written at `start`.
    Write { start: u64, data: Vec<u8> },
    /// DISCARD / WRITE_ZEROES: these byte ranges read as zeros.
    Zero(Vec<(u64, u64)>),
}

#[derive(Debug)]
enum Outcome {
    /// The chain is not a valid request: parse fails, IOERR.
    Malformed,
    /// Parsed, but the device says UNSUPP.
    Unsupp,
    /// Parsed, but the device says IOERR (range, read-only, segment length).
    IoErr,
    Ok(Effect),
}

#[derive(Debug)]
struct Parsed {
    kind: RequestType,
    sector: u64,
    readable_len: u64,
    writable_len: u64,
}

#[derive(Debug)]
enum Expect {
    /// No writable last byte in guest memory: nothing is written, used 0.
    NoStatus,
    Status {
        at: u64,
        parsed: Option<Parsed>,
        outcome: Outcome,
    },
}

struct Harness<'a> {
    inp: Input<'a>,
    regions: Vec<Region>,
    mem: &'a GuestMemoryMmap,
    /// Out while a drain runs.
    queue: Option<Queue>,
    scratch: Option<Scratch>,
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
    /// Between `popped` and `ran`: what the model expects of the chain.
    chain: Option<ChainCtx>,
}

/// One drain as the harness saw it.
#[derive(Default)]
struct DrainLog {
    chains: u32,
    /// Per chain: does its `add_used` succeed, and `used_event` after it ran.
    log: Vec<(bool, u16)>,
    /// The used element the last chain should get (head, length).
    pending: Option<(u16, u32)>,
    /// The avail index at the start; chains that change it may make the
    /// drain take several passes.
    avail0: u16,
    multi_pass: bool,
}

struct ChainCtx {
    descs: Vec<Descriptor>,
    expect: Expect,
    stats0: Option<vzram_store::DeviceStats>,
}

impl<'a> Harness<'a> {
    fn new(data: &'a [u8], mem: &'a GuestMemoryMmap, bufs: Bufs, sabotage: bool) -> Harness<'a> {
        let mut inp = Input { data, pos: 0 };
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
        })
        .expect("pool");
        let mut dcfg = DeviceConfig::new(dev_size, codec);
        dcfg.shards = 1;
        dcfg.mem_limit = if limited { 48 * 1024 } else { 0 };
        let store = pool.create_device(dcfg).expect("store device");
        let queues = if second_queue { 2 } else { 1 };
        let rw = Arc::new(BlkDevice::new(store.clone(), queues, false, SERIAL));
        let ro = Arc::new(BlkDevice::new(store.clone(), queues, true, SERIAL));
        let versions = second_queue.then(|| {
            let zero = page_hash(&[0; PAGE_SIZE]);
            (0..dev_size / PAGE).map(|slot| (slot, zero)).collect()
        });
        Harness {
            inp,
            regions,
            mem,
            queue: Some(queue),
            scratch: Some(bufs.scratch.unwrap_or_else(|| Scratch::new(0))),
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
            chain: None,
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

    // ---- decoding helpers -------------------------------------------------

    fn first(&self) -> Region {
        self.regions[0]
    }
    fn last(&self) -> Region {
        *self.regions.last().expect("a region")
    }

    /// A guest address: mostly inside memory, often at its edges, in the gap,
    /// past the end, or near 2^64.
    fn addr(&mut self) -> u64 {
        let (a, b) = (self.first(), self.last());
        match self.inp.u8() % 10 {
            0 | 1 => a.start + u64::from(self.inp.u16()) % a.len,
            2 => b.start + u64::from(self.inp.u16()) % b.len,
            3 => a.end() - u64::from(self.inp.u8()),
            4 => b.end() - u64::from(self.inp.u8()),
            5 => b.end().saturating_add(u64::from(self.inp.u16())),
            6 => a.end() + u64::from(self.inp.u16()),
            7 => u64::MAX - u64::from(self.inp.u16()),
            8 => self.inp.u64(),
            _ => b.start.wrapping_sub(1 + u64::from(self.inp.u8())),
        }
    }

    /// A descriptor length: 0, 1, header-sized, sector multiples, pages,
    /// odd sizes, and values near 2^32.
    fn len(&mut self) -> u32 {
        match self.inp.u8() % 10 {
            0 => 0,
            1 => 1,
            2 => 16,
            3 => 512 * (u32::from(self.inp.u8() % 16) + 1),
            4 => 4096 * (u32::from(self.inp.u8() % 4) + 1),
            5 => u32::from(self.inp.u8()),
            6 => u32::from(self.inp.u16()),
            7 => u32::MAX - u32::from(self.inp.u8()),
            8 => self.inp.u32(),
            _ => 17,
        }
    }

    /// A sector: inside the disk, at its end, past it, and at the edge of
    /// `sector * 512` overflowing u64.
    fn sector(&mut self) -> u64 {
        match self.inp.u8() % 9 {
            0 => u64::from(self.inp.u8()),
            1 => u64::from(self.inp.u16()),
            2 => (self.dev_size / SECTOR).saturating_sub(u64::from(self.inp.u8())),
            3 => self.dev_size / SECTOR + u64::from(self.inp.u8()),
            4 => self.inp.u64(),
            5 => (u64::MAX / SECTOR + 1).wrapping_sub(u64::from(self.inp.u8() % 4)),
            6 => u64::MAX - u64::from(self.inp.u8()),
            7 => u64::from(self.inp.u8()) * 8,
            _ => 1 << 55 | u64::from(self.inp.u8()),
        }
    }

    fn req_type(&mut self) -> u32 {
        match self.inp.u8() % 10 {
            0 => VIRTIO_BLK_T_IN,
            1 => VIRTIO_BLK_T_OUT,
            2 => VIRTIO_BLK_T_FLUSH,
            3 => VIRTIO_BLK_T_GET_ID,
            4 => VIRTIO_BLK_T_DISCARD,
            5 => VIRTIO_BLK_T_WRITE_ZEROES,
            6 => self.inp.u32(),
            7 => 2,  // SCSI_CMD
            8 => 14, // SECURE_ERASE, not offered
            _ => 0x8000_0000 | u32::from(self.inp.u8()),
        }
    }

    fn dwz_num(&mut self) -> u32 {
        match self.inp.u8() % 6 {
            0 => u32::from(self.inp.u8()),
            1 => 8 * u32::from(self.inp.u8()),
            2 => MAX_DISCARD_SECTORS,
            3 => MAX_DISCARD_SECTORS + 1,
            4 => self.inp.u32(),
            _ => u32::MAX,
        }
    }

    fn dwz_flags(&mut self) -> u32 {
        match self.inp.u8() % 4 {
            0 => 0,
            1 => VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
            2 => self.inp.u32(),
            _ => 2,
        }
    }

    /// Descriptor flags: mostly NEXT/WRITE/INDIRECT, sometimes any u16.
    fn flags(&mut self) -> u16 {
        let f = self.inp.u8();
        let mut flags = u16::from(f & 7);
        if f & 0x80 != 0 {
            flags |= self.inp.u16();
        }
        flags
    }

    /// A compact descriptor for the chain builders: NEXT is set by them.
    fn compact_desc(&mut self) -> (u64, u32, u16) {
        let addr = self.addr();
        let len = self.len();
        let f = self.inp.u8();
        let mut flags = 0;
        if f & 1 != 0 {
            flags |= F_WRITE;
        }
        if f & 0x40 != 0 {
            flags |= F_INDIRECT;
        }
        (addr, len, flags)
    }

    // ---- guest side -------------------------------------------------------

    fn write_desc(&self, at: u64, d: Descriptor) {
        let _ = self.mem.write_obj(d, GuestAddress(at));
    }

    fn write_bytes(&self, at: u64, b: &[u8]) {
        // Region by region, so a write straddling a hole (or the end of the
        // address space) still lands where there is memory.
        let (start, end) = (u128::from(at), u128::from(at) + b.len() as u128);
        for r in &self.regions {
            let s = start.max(u128::from(r.start));
            let e = end.min(u128::from(r.end()));
            if s < e {
                let part = &b[(s - start) as usize..(e - start) as usize];
                self.mem
                    .write_slice(part, GuestAddress(s as u64))
                    .expect("write inside a region");
            }
        }
    }

    fn header_bytes(t: u32, ioprio: u32, sector: u64) -> [u8; 16] {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&t.to_le_bytes());
        h[4..8].copy_from_slice(&ioprio.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        h
    }

    fn segment_bytes(sector: u64, num: u32, flags: u32) -> [u8; 16] {
        let mut s = [0u8; 16];
        s[0..8].copy_from_slice(&sector.to_le_bytes());
        s[8..12].copy_from_slice(&num.to_le_bytes());
        s[12..16].copy_from_slice(&flags.to_le_bytes());
        s
    }

    /// Publishes `head` in the avail ring, as the guest driver does.
    fn push_avail(&self, head: u16) {
        let idx: u16 = self.mem.read_obj(GuestAddress(AVAIL_RING + 2)).unwrap_or(0);
        let slot = AVAIL_RING + 4 + 2 * u64::from(idx % self.qsize);
        let _ = self.mem.write_obj(head, GuestAddress(slot));
        let _ = self
            .mem
            .write_obj(idx.wrapping_add(1), GuestAddress(AVAIL_RING + 2));
    }

    /// Writes a linked chain at consecutive table indices starting at `head`.
    fn write_chain_at_table(&self, table: u64, size: u16, head: u16, descs: &[(u64, u32, u16)]) {
        for (i, &(addr, len, flags)) in descs.iter().enumerate() {
            let idx = (usize::from(head) + i) % usize::from(size);
            let last = i + 1 == descs.len();
            let next = ((idx + 1) % usize::from(size)) as u16;
            let flags = if last {
                flags & !F_NEXT
            } else {
                flags | F_NEXT
            };
            self.write_desc(
                table.wrapping_add(16 * idx as u64),
                Descriptor::new(addr, len, flags, if last { 0 } else { next }),
            );
        }
    }

    fn op(&mut self) {
        let code = self.inp.u8() % op::OP_COUNT;
        match code {
            op::DESC => {
                let idx = self.inp.u16() % self.qsize;
                let (addr, len, flags, next) =
                    (self.addr(), self.len(), self.flags(), self.inp.u16());
                self.write_desc(
                    DESC_TABLE + 16 * u64::from(idx),
                    Descriptor::new(addr, len, flags, next),
                );
            }
            op::DESC_AT => {
                let at = self.addr();
                let (addr, len, flags, next) =
                    (self.addr(), self.len(), self.flags(), self.inp.u16());
                self.write_desc(at, Descriptor::new(addr, len, flags, next));
            }
            op::BYTES => {
                let at = self.addr();
                let n = usize::from(self.inp.u8());
                let b = self.inp.bytes(n);
                self.write_bytes(at, &b);
            }
            op::HEADER => {
                let at = self.addr();
                let (t, prio, sector) = (self.req_type(), u32::from(self.inp.u8()), self.sector());
                self.write_bytes(at, &Self::header_bytes(t, prio, sector));
            }
            op::SEGMENTS => {
                let at = self.addr();
                let n = match self.inp.u8() {
                    250..=255 => MAX_DISCARD_SEG as usize + 1,
                    240..=249 => MAX_DISCARD_SEG as usize,
                    x => usize::from(x % 8) + 1,
                };
                let mut buf = Vec::with_capacity(16 * n);
                // Beyond the eighth segment repeat the input's last one: the
                // fuzzer need not spell out 257 segments.
                let mut seg = [0u8; 16];
                for i in 0..n {
                    if i < 8 {
                        seg = Self::segment_bytes(self.sector(), self.dwz_num(), self.dwz_flags());
                    }
                    buf.extend_from_slice(&seg);
                }
                self.write_bytes(at, &buf);
            }
            op::FILL => {
                let at = self.addr();
                let (len, byte) = (usize::from(self.inp.u16()), self.inp.u8());
                self.write_bytes(at, &vec![byte; len]);
            }
            op::KICK => {
                let n = self.inp.u8() % 4 + 1;
                for _ in 0..n {
                    let head = self.inp.u16();
                    // Mostly valid heads; sometimes any index.
                    let head = if head & 0x8000 != 0 {
                        head & 0x7fff
                    } else {
                        head % self.qsize
                    };
                    self.push_avail(head);
                }
                self.process();
            }
            op::CHAIN => {
                let head = u16::from(self.inp.u8()) % self.qsize;
                let n = usize::from(self.inp.u8() % 8) + 1;
                let descs: Vec<_> = (0..n).map(|_| self.compact_desc()).collect();
                self.write_chain_at_table(DESC_TABLE, self.qsize, head, &descs);
                self.push_avail(head);
                self.process();
            }
            op::INDIRECT => {
                let table = self.addr();
                let head = u16::from(self.inp.u8()) % self.qsize;
                let n = usize::from(self.inp.u8() % 8) + 1;
                let descs: Vec<_> = (0..n).map(|_| self.compact_desc()).collect();
                let len = match self.inp.u8() % 6 {
                    0 => 0,
                    1 => 16 * n as u32 + 8,
                    2 => self.inp.u32(),
                    _ => 16 * n as u32,
                };
                self.write_chain_at_table(table, n as u16, 0, &descs);
                self.write_desc(
                    DESC_TABLE + 16 * u64::from(head),
                    Descriptor::new(table, len, F_INDIRECT, 0),
                );
                self.push_avail(head);
                self.process();
            }
            op::REQUEST => self.request_macro(),
            op::READONLY => self.readonly = !self.readonly,
            op::LIMIT => {
                let limit = match self.inp.u8() % 4 {
                    0 => 0,
                    1 => 16 * 1024,
                    2 => 64 * 1024,
                    _ => self.store.stats().mem_used_total + 4096,
                };
                self.store.set_mem_limit(limit);
            }
            op::COMPACT => {
                self.store.compact();
                self.verify_all("after compaction");
            }
            op::PROCESS => self.process(),
            _ => self.long_chain(),
        }
    }

    /// A well-formed request with fuzz-chosen type, sector, size and data:
    /// the fuzzer reaches successful I/O without finding the format first.
    fn request_macro(&mut self) {
        let kind = self.inp.u8() % 6;
        let sector = self.sector();
        let head = u16::from(self.inp.u8()) % self.qsize;
        let shape = self.inp.u8();
        let (split, indirect) = (usize::from(shape % 4) + 1, shape & 4 != 0);
        let t = [
            VIRTIO_BLK_T_IN,
            VIRTIO_BLK_T_OUT,
            VIRTIO_BLK_T_FLUSH,
            VIRTIO_BLK_T_GET_ID,
            VIRTIO_BLK_T_DISCARD,
            VIRTIO_BLK_T_WRITE_ZEROES,
        ][usize::from(kind)];
        self.write_bytes(HDR_AT, &Self::header_bytes(t, 0, sector));
        let mut descs = vec![(HDR_AT, 16u32, 0u16)];
        let (data_len, data_flags) = match t {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let len = 512 * (u32::from(self.inp.u8() % 32) + 1);
                let seed = self.inp.u8();
                if t == VIRTIO_BLK_T_OUT {
                    let data = payload(len as usize, seed);
                    self.write_bytes(DATA_AT, &data);
                }
                (len, if t == VIRTIO_BLK_T_IN { F_WRITE } else { 0 })
            }
            VIRTIO_BLK_T_GET_ID => (u32::from(self.inp.u8() % 32), F_WRITE),
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                let n = usize::from(self.inp.u8() % 4) + 1;
                let mut buf = Vec::new();
                for _ in 0..n {
                    buf.extend_from_slice(&Self::segment_bytes(
                        self.sector(),
                        self.dwz_num(),
                        self.dwz_flags(),
                    ));
                }
                self.write_bytes(SEGS_AT, &buf);
                (buf.len() as u32, 0)
            }
            _ => (0, 0),
        };
        let base = if t == VIRTIO_BLK_T_DISCARD || t == VIRTIO_BLK_T_WRITE_ZEROES {
            SEGS_AT
        } else {
            DATA_AT
        };
        // Split the payload into `split` descriptors of uneven sizes.
        let mut off = 0u32;
        for i in 0..split {
            let piece = if i + 1 == split {
                data_len - off
            } else {
                (data_len - off) / 2
            };
            if piece > 0 || (i == 0 && data_len == 0 && t == VIRTIO_BLK_T_GET_ID) {
                descs.push((base + u64::from(off), piece, data_flags));
            }
            off += piece;
        }
        descs.push((STATUS_AT, 1, F_WRITE));
        if indirect {
            self.write_chain_at_table(INDIRECT_AT, descs.len() as u16, 0, &descs);
            let len = 16 * descs.len() as u32;
            self.write_desc(
                DESC_TABLE + 16 * u64::from(head),
                Descriptor::new(INDIRECT_AT, len, F_INDIRECT, 0),
            );
        } else {
            self.write_chain_at_table(DESC_TABLE, self.qsize, head, &descs);
        }
        self.push_avail(head);
        self.process();
    }

    /// An indirect table of up to 300 descriptors: header, `n - 2` copies of
    /// one data descriptor, status. Reaches the descriptor-count limit and
    /// large scattered requests.
    fn long_chain(&mut self) {
        let n = usize::from(self.inp.u16() % 300) + 1;
        let table = self.addr();
        let head = u16::from(self.inp.u8()) % self.qsize;
        let hdr = (self.addr(), 16, 0);
        let data = self.compact_desc();
        let status = (self.addr(), 1, F_WRITE);
        let mut descs = vec![hdr];
        descs.extend(std::iter::repeat_n(data, n.saturating_sub(2)));
        if n > 1 {
            descs.push(status);
        }
        self.write_chain_at_table(table, descs.len() as u16, 0, &descs);
        let len = 16 * descs.len() as u32;
        self.write_desc(
            DESC_TABLE + 16 * u64::from(head),
            Descriptor::new(table, len, F_INDIRECT, 0),
        );
        self.push_avail(head);
        self.process();
    }

    // ---- device side: the queue thread's drain, watched ------------------

    fn into_bufs(self) -> Bufs {
        Bufs {
            shadow: self.shadow,
            cur: self.cur,
            next: self.next,
            scratch: self.scratch,
        }
    }

    fn used_event_at(&self) -> u64 {
        AVAIL_RING + 4 + 2 * u64::from(self.qsize)
    }

    fn avail_event_at(&self) -> u64 {
        USED_RING + 4 + 8 * u64::from(self.qsize)
    }

    /// A little-endian u16 from a snapshot (the rings are in the first region).
    fn snap_u16(snap: &[Vec<u8>], at: u64) -> u16 {
        let at = at as usize;
        u16::from_le_bytes([snap[0][at], snap[0][at + 1]])
    }

    /// Drains the queue with the backend's own `drain_queue`; the checks run
    /// in the hook (`popped`, `ran`) and in `end_drain`.
    fn process(&mut self) {
        if self.summary.chains >= MAX_CHAINS as u64 {
            return;
        }
        // The harness itself wrote to guest memory since the last time.
        let mut cur = std::mem::take(&mut self.cur);
        self.snapshot_into(&mut cur);
        self.cur = cur;
        self.drain = DrainLog {
            avail0: Self::snap_u16(&self.cur, AVAIL_RING + 2),
            ..DrainLog::default()
        };
        let used0 = self.next_used;
        let dev = Arc::clone(if self.readonly { &self.ro } else { &self.rw });
        let mut queue = self.queue.take().expect("queue");
        let mut scratch = self.scratch.take().expect("scratch");
        let mem = self.mem;
        let event_idx = self.event_idx;
        // The used index at each notification, as the model counts it.
        let used_idx = Cell::new(used0);
        let mut notes: Vec<u16> = Vec::new();
        let result = drain_queue(
            &mut (&mut queue, || {
                notes.push(used_idx.get());
                Ok(())
            }),
            &mem,
            &dev,
            event_idx,
            &mut scratch,
            &mut Watch {
                h: self,
                used_idx: &used_idx,
            },
        );
        self.end_drain(&queue, result, &notes, used0);
        self.queue = Some(queue);
        self.scratch = Some(scratch);
    }

    /// Everything the drain did after the last chain ran: its used element,
    /// notifications, EVENT_IDX's avail_event, and how it ended.
    fn end_drain(
        &mut self,
        queue: &Queue,
        result: Result<(), QueueError>,
        notes: &[u16],
        used0: u16,
    ) {
        let bad_head = self.drain.log.last().is_some_and(|&(ok, _)| !ok);
        self.apply_pending_used();
        let mut after = std::mem::take(&mut self.next);
        self.snapshot_into(&mut after);
        let avail = Self::snap_u16(&after, AVAIL_RING + 2);
        let mut want = std::mem::take(&mut self.cur);
        if self.event_idx {
            let at = self.avail_event_at();
            if !bad_head {
                // enable_notification, last thing before the drain ends.
                self.write_want(&mut want, at, &self.next_avail.to_le_bytes());
            } else if Self::snap_u16(&after, at) == self.next_avail {
                // An earlier pass may have ended with it.
                self.write_want(&mut want, at, &self.next_avail.to_le_bytes());
            }
        }
        let ctx = || format!("end of a drain of {} chains", self.drain.chains);
        self.assert_mem(&want, &after, &ctx);
        self.cur = want;
        self.next = after;

        assert_eq!(queue.next_avail(), self.next_avail, "next_avail: {}", ctx());
        assert_eq!(queue.next_used(), self.next_used, "next_used: {}", ctx());
        if bad_head {
            self.summary.bad_head_drains += 1;
            assert!(
                matches!(
                    result,
                    Err(QueueError::Ring(
                        virtio_queue::Error::InvalidDescriptorIndex
                    ))
                ),
                "drain after an out-of-range head ended {result:?}"
            );
        } else if self.event_idx && avail != self.next_avail {
            self.summary.unreadable_drains += 1;
            assert!(
                matches!(result, Err(QueueError::Unreadable)),
                "drain with EVENT_IDX left avail {avail} != next_avail {} and ended {result:?}",
                self.next_avail
            );
        } else {
            assert!(result.is_ok(), "drain ended {result:?}: {}", ctx());
        }

        // Notifications: a check after every SIGNAL_EVERY completions and at
        // the end (also when an add_used fails); with EVENT_IDX a check
        // notifies only when used_event lies in the stretch it covers (virtio
        // 1.2, 2.7.7.2, the kernel's vring_need_event). Several passes (chains
        // that moved the avail index) reset the count where we cannot see.
        if self.drain.multi_pass {
            return;
        }
        let mut want_notes = Vec::new();
        let (mut used, mut old, mut pending) = (used0, used0, 0u32);
        let mut check = |new: u16, used_event: u16, old: &mut u16| {
            let notify = !self.event_idx
                || new.wrapping_sub(used_event).wrapping_sub(1) < new.wrapping_sub(*old);
            *old = new;
            if notify {
                want_notes.push(new);
            }
        };
        for &(ok, used_event) in &self.drain.log {
            if !ok {
                break;
            }
            used = used.wrapping_add(1);
            pending += 1;
            if pending == SIGNAL_EVERY {
                check(used, used_event, &mut old);
                pending = 0;
            }
        }
        if pending > 0 {
            let used_event = self.drain.log.last().expect("a chain").1;
            check(used, used_event, &mut old);
        }
        assert_eq!(
            notes,
            &want_notes[..],
            "notifications (used index at each): {}",
            ctx()
        );
        self.summary.early_signals += notes.iter().filter(|&&n| n != used).count() as u64;
    }

    /// The used element `add_used` wrote for the chain that ran last.
    fn apply_pending_used(&mut self) {
        if let Some((head, len)) = self.drain.pending.take() {
            let slot = USED_RING + 4 + 8 * u64::from(self.next_used.wrapping_sub(1) % self.qsize);
            let mut elem = [0u8; 8];
            elem[..4].copy_from_slice(&u32::from(head).to_le_bytes());
            elem[4..].copy_from_slice(&len.to_le_bytes());
            let mut want = std::mem::take(&mut self.cur);
            self.write_want(&mut want, slot, &elem);
            self.write_want(&mut want, USED_RING + 2, &self.next_used.to_le_bytes());
            self.cur = want;
        }
    }

    /// A chain was popped: bring the expected memory up to date, run the
    /// model, poison the status byte.
    fn popped<M: GuestMemory>(&mut self, chain: &DescriptorChain<&M>) {
        self.summary.chains += 1;
        self.drain.chains += 1;
        self.apply_pending_used();
        if self.event_idx {
            // A pass that ended before this pop re-enabled notifications.
            let at = self.avail_event_at();
            let got: u16 = self.mem.read_obj(GuestAddress(at)).unwrap_or(0);
            if got == self.next_avail {
                let mut want = std::mem::take(&mut self.cur);
                self.write_want(&mut want, at, &got.to_le_bytes());
                self.cur = want;
            }
        }
        self.next_avail = self.next_avail.wrapping_add(1);

        let descs: Vec<Descriptor> = chain.clone().collect();
        let head_desc: Option<Descriptor> = self
            .mem
            .read_obj(GuestAddress(
                DESC_TABLE + 16 * u64::from(chain.head_index()),
            ))
            .ok();
        let table = head_desc
            .filter(|d| d.refers_to_indirect_table() && chain.head_index() < self.qsize)
            .map(|d| (d.addr().0, u64::from(d.len())));
        if table.is_some() {
            self.summary.indirect += 1;
        }
        if self.readonly {
            self.summary.readonly_chains += 1;
        }
        if self.event_idx {
            self.summary.event_idx += 1;
        }
        if self.dev_size == BIG_DEV_SIZE {
            self.summary.big_disk += 1;
        }
        if matches!(self.store.codec(), Codec::Zstd { .. }) {
            self.summary.zstd += 1;
        }
        let expect = self.model(&descs);
        if let Expect::Status { at, .. } = expect {
            if self.poison_ok(at, &descs, table) {
                let old: u8 = self.mem.read_obj(GuestAddress(at)).expect("status byte");
                let _ = self.mem.write_obj(ST_POISON, GuestAddress(at));
                // The byte may be in a table the chain is read from (an
                // indirect descriptor past the head): then leave it alone.
                let key = |d: &Descriptor| (d.addr().0, d.len(), d.flags(), d.next());
                if chain.clone().map(|d| key(&d)).eq(descs.iter().map(key)) {
                    let mut want = std::mem::take(&mut self.cur);
                    self.write_want(&mut want, at, &[ST_POISON]);
                    self.cur = want;
                } else {
                    let _ = self.mem.write_obj(old, GuestAddress(at));
                }
            }
        }
        // Counters only where the device runs and must not write: stats()
        // is too slow to take for every chain.
        let watch_store = matches!(
            expect,
            Expect::Status {
                outcome: Outcome::IoErr
                    | Outcome::Unsupp
                    | Outcome::Ok(Effect::Nothing | Effect::Read { .. } | Effect::GetId { .. }),
                ..
            }
        );
        let stats0 = watch_store.then(|| self.store.stats());
        self.chain = Some(ChainCtx {
            descs,
            expect,
            stats0,
        });
    }

    /// May the status byte at `at` be poisoned before the chain runs? Not
    /// where the rings, the descriptor table, the head's indirect table or
    /// the readable buffers are (`popped` also checks the chain still reads
    /// the same after).
    fn poison_ok(&self, at: u64, descs: &[Descriptor], table: Option<(u64, u64)>) -> bool {
        let q = u64::from(self.qsize);
        let mut read = vec![
            (DESC_TABLE, 16 * q),
            (AVAIL_RING, 6 + 2 * q),
            (USED_RING, 6 + 8 * q),
        ];
        read.extend(table);
        read.extend(
            descs
                .iter()
                .filter(|d| !d.is_write_only())
                .map(|d| (d.addr().0, u64::from(d.len()))),
        );
        !read.iter().any(|&(start, len)| {
            u128::from(start) <= u128::from(at)
                && u128::from(at) < u128::from(start) + u128::from(len)
        })
    }

    /// The chain ran: check status, payload, used length and the store
    /// against the model.
    fn ran(&mut self, head: u16, req: &Request, result: &Result<u32, ChainError>, used: u32) {
        let ChainCtx {
            descs,
            expect,
            stats0,
        } = self.chain.take().expect("ran without popped");
        let mut after = std::mem::take(&mut self.next);
        self.snapshot_into(&mut after);
        let store_touched = stats0.is_some_and(|s0| {
            let s1 = self.store.stats();
            s1.writes != s0.writes || s1.discards != s0.discards
        });
        let malformed = matches!(result, Err(ChainError::Malformed(_)));
        let mut want = std::mem::take(&mut self.cur);
        let ctx = || format!("chain {descs:x?} ended {result:?}");

        let want_used = match expect {
            Expect::NoStatus => {
                self.summary.no_status += 1;
                assert!(malformed, "chain without a status byte parsed: {}", ctx());
                assert_eq!(
                    req.status,
                    None,
                    "status set for a chain without one: {}",
                    ctx()
                );
                assert!(
                    !store_touched,
                    "chain without status reached the store: {}",
                    ctx()
                );
                0
            }
            Expect::Status {
                at,
                parsed,
                outcome,
            } => {
                assert_eq!(
                    req.status,
                    Some(GuestAddress(at)),
                    "status address: {}",
                    ctx()
                );
                self.check_parsed(req, parsed.as_ref(), malformed, &ctx);
                let (status, want_used) =
                    self.check_outcome(outcome, result, store_touched, &mut want, &ctx);
                self.write_want(&mut want, at, &[status]);
                want_used
            }
        };
        assert_eq!(used, want_used, "used length: {}", ctx());
        self.assert_mem(&want, &after, &ctx);

        // add_used comes next; it fails for a head outside the queue.
        let ok = head < self.qsize;
        let used_event = Self::snap_u16(&after, self.used_event_at());
        self.drain.log.push((ok, used_event));
        if ok {
            self.next_used = self.next_used.wrapping_add(1);
            self.drain.pending = Some((head, want_used));
        }
        if Self::snap_u16(&after, AVAIL_RING + 2) != self.drain.avail0 {
            self.drain.multi_pass = true;
        }
        if self.drain.chains >= DRAIN_CAP {
            // As the guest, stop publishing: the next pop finds nothing.
            let _ = self
                .mem
                .write_obj(self.next_avail, GuestAddress(AVAIL_RING + 2));
            self.write_want(&mut want, AVAIL_RING + 2, &self.next_avail.to_le_bytes());
            self.drain.avail0 = self.next_avail;
        }
        self.cur = want;
        self.next = after;
    }

    fn check_parsed(
        &self,
        req: &Request,
        want: Option<&Parsed>,
        malformed: bool,
        ctx: &dyn Fn() -> String,
    ) {
        match want {
            None => assert!(malformed, "parsed, model expected malformed: {}", ctx()),
            Some(p) => {
                assert!(!malformed, "malformed, model expected {p:?}: {}", ctx());
                assert_eq!(
                    (req.kind, req.sector, req.readable_len, req.writable_len),
                    (p.kind, p.sector, p.readable_len, p.writable_len),
                    "parsed request: {}",
                    ctx()
                );
                assert_eq!(
                    req.readable.iter().map(|s| u64::from(s.len)).sum::<u64>(),
                    req.readable_len
                );
                assert_eq!(
                    req.writable.iter().map(|s| u64::from(s.len)).sum::<u64>(),
                    req.writable_len
                );
            }
        }
    }

    /// Checks a chain that has a status byte; applies its expected payload
    /// to `want` and its effect to the shadow. Returns the expected status
    /// and used length.
    fn check_outcome(
        &mut self,
        outcome: Outcome,
        result: &Result<u32, ChainError>,
        store_touched: bool,
        want: &mut [Vec<u8>],
        ctx: &dyn Fn() -> String,
    ) -> (u8, u32) {
        let limit_hit = matches!(
            result,
            Err(ChainError::Exec(ExecError::Store(
                StoreError::DeviceLimit | StoreError::HostLimit
            )))
        );
        match outcome {
            Outcome::Ok(effect @ (Effect::Write { .. } | Effect::Zero(_))) if limit_hit => {
                assert!(self.limited(), "limit error without a limit: {}", ctx());
                self.summary.limit_failures += 1;
                self.check_partial(&effect, ctx);
                (ST_IOERR, 1)
            }
            Outcome::Ok(effect) => {
                let written = match result {
                    Ok(n) => *n,
                    Err(_) => panic!("model expected success: {}", ctx()),
                };
                let want_used = match effect {
                    Effect::Nothing => {
                        self.summary.ok_other += 1;
                        assert!(!store_touched, "FLUSH touched the store");
                        1
                    }
                    Effect::Read { start, segs, len } => {
                        self.summary.ok_reads += 1;
                        let data = self.shadow[start as usize..(start + len) as usize].to_vec();
                        self.write_stream(want, &segs, &data);
                        assert!(!store_touched, "IN touched the store");
                        len as u32 + 1
                    }
                    Effect::GetId { segs, n } => {
                        self.summary.ok_other += 1;
                        let mut serial = [0u8; SERIAL_LEN];
                        let s = SERIAL.as_bytes();
                        let k = s.len().min(SERIAL_LEN);
                        serial[..k].copy_from_slice(&s[..k]);
                        self.write_stream(want, &segs, &serial[..n]);
                        n as u32 + 1
                    }
                    effect @ Effect::Write { .. } => {
                        self.summary.ok_writes += 1;
                        let Effect::Write { start, ref data } = effect else {
                            unreachable!()
                        };
                        let (start, end) = (start, start + data.len() as u64);
                        let pieces = Self::pieces(&effect);
                        self.apply_pieces(&pieces);
                        if self.sabotage && start < end {
                            self.shadow[start as usize] ^= 0x5a;
                        }
                        self.verify_range(start, end, "after write");
                        1
                    }
                    effect @ Effect::Zero(_) => {
                        self.summary.ok_zero += 1;
                        let pieces = Self::pieces(&effect);
                        self.apply_pieces(&pieces);
                        let Effect::Zero(ranges) = &effect else {
                            unreachable!()
                        };
                        for &(s, e) in ranges {
                            self.verify_range(s, e, "after discard/write-zeroes");
                        }
                        1
                    }
                };
                assert_eq!(written + 1, want_used, "payload length: {}", ctx());
                (ST_OK, want_used)
            }
            other => {
                let want_status = match other {
                    Outcome::Malformed => {
                        self.summary.malformed += 1;
                        ST_IOERR
                    }
                    Outcome::Unsupp => {
                        self.summary.unsupp += 1;
                        ST_UNSUPP
                    }
                    _ => {
                        self.summary.exec_ioerr += 1;
                        ST_IOERR
                    }
                };
                let got_status = match result {
                    Ok(_) => ST_OK,
                    Err(ChainError::Malformed(_)) => ST_IOERR,
                    Err(ChainError::Exec(e)) => e.status(),
                };
                assert_eq!(
                    got_status,
                    want_status,
                    "status (model {other:?}): {}",
                    ctx()
                );
                assert!(
                    !store_touched,
                    "failed request reached the store ({other:?}): {}",
                    ctx()
                );
                (want_status, 1)
            }
        }
    }

    // ---- the model ------------------------------------------------------------

    /// Is `[addr, addr + len)` all guest memory? Computed here from the
    /// layout, not through vm-memory. Empty ranges are, anywhere.
    fn covered(&self, addr: u64, len: u64) -> bool {
        let mut cur = u128::from(addr);
        let end = cur + u128::from(len);
        while cur < end {
            match self
                .regions
                .iter()
                .find(|r| u128::from(r.start) <= cur && cur < u128::from(r.end()))
            {
                Some(r) => cur = u128::from(r.end()),
                None => return false,
            }
        }
        true
    }

    /// `len` bytes of the stream `segs`, after skipping `skip`.
    fn read_stream(&self, segs: &[Seg], mut skip: u64, len: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(len as usize);
        for s in segs {
            if out.len() as u64 == len {
                break;
            }
            if skip >= s.len {
                skip -= s.len;
                continue;
            }
            let n = (s.len - skip).min(len - out.len() as u64);
            let mut buf = vec![0u8; n as usize];
            self.mem
                .read_slice(&mut buf, GuestAddress(s.addr + skip))
                .expect("model reads inside memory");
            out.extend_from_slice(&buf);
            skip = 0;
        }
        assert_eq!(out.len() as u64, len, "model stream too short");
        out
    }

    fn model(&self, descs: &[Descriptor]) -> Expect {
        // The status byte: the last byte of the last descriptor, which must be
        // device-writable and in guest memory.
        let Some(last) = descs.last() else {
            return Expect::NoStatus;
        };
        // A chain that virtio-queue cut short (loop, bad next) still says
        // NEXT on its last descriptor: the parser refuses it, used 0.
        if last.has_next() {
            return Expect::NoStatus;
        }
        if !last.is_write_only() || last.len() == 0 {
            return Expect::NoStatus;
        }
        let Some(at) = last.addr().0.checked_add(u64::from(last.len()) - 1) else {
            return Expect::NoStatus;
        };
        if !self.covered(at, 1) {
            return Expect::NoStatus;
        }
        let done = |parsed, outcome| Expect::Status {
            at,
            parsed,
            outcome,
        };
        if descs.len() > MAX_DESCRIPTORS {
            return done(None, Outcome::Malformed);
        }
        let (mut readable, mut writable) = (Vec::new(), Vec::new());
        for d in descs {
            let seg = Seg {
                addr: d.addr().0,
                len: u64::from(d.len()),
            };
            if !self.covered(seg.addr, seg.len) {
                return done(None, Outcome::Malformed);
            }
            if d.is_write_only() {
                writable.push(seg);
            } else if !writable.is_empty() {
                return done(None, Outcome::Malformed);
            } else {
                readable.push(seg);
            }
        }
        let rlen: u64 = readable.iter().map(|s| s.len).sum();
        let wlen: u64 = writable.iter().map(|s| s.len).sum();
        if rlen < 16 {
            return done(None, Outcome::Malformed);
        }
        let hdr = self.read_stream(&readable, 0, 16);
        let t = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
        let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap());
        let (pr, pw) = (rlen - 16, wlen - 1);
        // The writable payload: everything writable but the status byte.
        let mut wsegs = writable;
        if let Some(s) = wsegs.last_mut() {
            s.len -= 1;
        }
        let kind = RequestType::from_raw(t);
        let parsed = || {
            Some(Parsed {
                kind,
                sector,
                readable_len: pr,
                writable_len: pw,
            })
        };
        match t {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let (data, other) = if t == VIRTIO_BLK_T_IN {
                    (pw, pr)
                } else {
                    (pr, pw)
                };
                let start = sector.checked_mul(SECTOR);
                let end = start.and_then(|s| s.checked_add(data));
                let (Some(start), Some(end)) = (start, end) else {
                    return done(None, Outcome::Malformed);
                };
                if other != 0 || data % SECTOR != 0 {
                    return done(None, Outcome::Malformed);
                }
                if (t == VIRTIO_BLK_T_OUT && self.readonly) || end > self.dev_size {
                    return done(parsed(), Outcome::IoErr);
                }
                let effect = if t == VIRTIO_BLK_T_IN {
                    Effect::Read {
                        start,
                        segs: wsegs,
                        len: data,
                    }
                } else {
                    Effect::Write {
                        start,
                        data: self.read_stream(&readable, 16, data),
                    }
                };
                done(parsed(), Outcome::Ok(effect))
            }
            VIRTIO_BLK_T_FLUSH => done(parsed(), Outcome::Ok(Effect::Nothing)),
            VIRTIO_BLK_T_GET_ID => {
                if pr != 0 {
                    return done(None, Outcome::Malformed);
                }
                let n = (pw as usize).min(SERIAL_LEN);
                done(parsed(), Outcome::Ok(Effect::GetId { segs: wsegs, n }))
            }
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                if pw != 0 || pr == 0 || pr % 16 != 0 || pr / 16 > u64::from(MAX_DISCARD_SEG) {
                    return done(None, Outcome::Malformed);
                }
                if self.readonly {
                    return done(parsed(), Outcome::IoErr);
                }
                let allowed = if t == VIRTIO_BLK_T_WRITE_ZEROES {
                    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
                } else {
                    0
                };
                let raw = self.read_stream(&readable, 16, pr);
                let mut ranges = Vec::new();
                // The first bad segment decides; nothing is applied unless all are good.
                for s in raw.chunks_exact(16) {
                    let sector = u64::from_le_bytes(s[0..8].try_into().unwrap());
                    let num = u32::from_le_bytes(s[8..12].try_into().unwrap());
                    let flags = u32::from_le_bytes(s[12..16].try_into().unwrap());
                    if flags & !allowed != 0 {
                        return done(parsed(), Outcome::Unsupp);
                    }
                    if num > MAX_DISCARD_SECTORS {
                        return done(parsed(), Outcome::IoErr);
                    }
                    let start = sector.checked_mul(SECTOR);
                    let end = start.and_then(|s| s.checked_add(u64::from(num) * SECTOR));
                    match (start, end) {
                        (Some(s), Some(e)) if e <= self.dev_size => ranges.push((s, e)),
                        _ => return done(parsed(), Outcome::IoErr),
                    }
                }
                done(parsed(), Outcome::Ok(Effect::Zero(ranges)))
            }
            _ => done(parsed(), Outcome::Unsupp),
        }
    }

    // ---- guest memory snapshots -------------------------------------------

    fn snapshot_into(&self, buf: &mut Vec<Vec<u8>>) {
        buf.resize_with(self.regions.len(), Vec::new);
        for (v, r) in buf.iter_mut().zip(&self.regions) {
            v.resize(r.len as usize, 0);
            self.mem
                .read_slice(v, GuestAddress(r.start))
                .expect("snapshot");
        }
    }

    /// Applies a write at guest address `addr` to a snapshot.
    fn write_want(&self, want: &mut [Vec<u8>], addr: u64, bytes: &[u8]) {
        let mut done = 0usize;
        while done < bytes.len() {
            let a = addr + done as u64;
            let (i, r) = self
                .regions
                .iter()
                .enumerate()
                .find(|(_, r)| r.start <= a && a < r.end())
                .expect("model writes inside memory");
            let off = (a - r.start) as usize;
            let n = (bytes.len() - done).min(r.len as usize - off);
            want[i][off..off + n].copy_from_slice(&bytes[done..done + n]);
            done += n;
        }
    }

    fn write_stream(&self, want: &mut [Vec<u8>], segs: &[Seg], data: &[u8]) {
        let mut done = 0usize;
        for s in segs {
            if done == data.len() {
                break;
            }
            let n = (s.len as usize).min(data.len() - done);
            self.write_want(want, s.addr, &data[done..done + n]);
            done += n;
        }
        assert_eq!(done, data.len(), "model payload longer than its buffers");
    }

    fn assert_mem(&self, want: &[Vec<u8>], got: &[Vec<u8>], ctx: &dyn Fn() -> String) {
        for (i, (w, g)) in want.iter().zip(got).enumerate() {
            if let Some(off) = first_diff(w, g) {
                panic!(
                    "guest memory at {:#x} is {:#04x}, expected {:#04x}: {}",
                    self.regions[i].start + off as u64,
                    g[off],
                    w[off],
                    ctx()
                );
            }
        }
    }

    // ---- the store against its shadow -----------------------------------------

    fn read_slot(&mut self, slot: u64) -> Page {
        let mut page = [0u8; PAGE_SIZE];
        self.store
            .read_page(&mut self.check_cx, slot, &mut page)
            .unwrap_or_else(|e| panic!("store read of slot {slot}: {e}"));
        page
    }

    fn verify_range(&mut self, start: u64, end: u64, what: &str) {
        if start >= end {
            return;
        }
        for slot in start / PAGE..end.div_ceil(PAGE) {
            let page = self.read_slot(slot);
            let s = (slot * PAGE) as usize;
            if let Some(off) = first_diff(&page, &self.shadow[s..s + PAGE_SIZE]) {
                panic!(
                    "{what}: disk byte {:#x} is {:#04x}, shadow says {:#04x}",
                    s + off,
                    page[off],
                    self.shadow[s + off]
                );
            }
        }
    }

    fn verify_all(&mut self, what: &str) {
        self.verify_range(0, self.dev_size, what);
    }

    /// How the device applies a write or discard: page-sized pieces, in
    /// order, each atomic; (start, end, data or None for zeros). A run of
    /// whole pages zeroed is one piece.
    fn pieces(effect: &Effect) -> Vec<(u64, u64, Option<&[u8]>)> {
        let mut pieces = Vec::new();
        match effect {
            Effect::Write { start, data } => {
                let mut pos = *start;
                let end = start + data.len() as u64;
                while pos < end {
                    let n = (PAGE - pos % PAGE).min(end - pos);
                    let d = &data[(pos - start) as usize..(pos - start + n) as usize];
                    pieces.push((pos, pos + n, Some(d)));
                    pos += n;
                }
            }
            Effect::Zero(ranges) => {
                for &(start, end) in ranges {
                    let mut pos = start;
                    while pos < end {
                        if pos % PAGE == 0 && end - pos >= PAGE {
                            let last = end / PAGE * PAGE;
                            pieces.push((pos, last, None));
                            pos = last;
                        } else {
                            let n = (PAGE - pos % PAGE).min(end - pos);
                            pieces.push((pos, pos + n, None));
                            pos += n;
                        }
                    }
                }
            }
            _ => unreachable!("only writes and discards have pieces"),
        }
        pieces
    }

    /// Applies pieces to the shadow, in order; with a second queue reading,
    /// records each version a page goes through.
    fn apply_pieces(&mut self, pieces: &[(u64, u64, Option<&[u8]>)]) {
        for &(s, e, d) in pieces {
            match d {
                Some(d) => self.shadow[s as usize..e as usize].copy_from_slice(d),
                None => self.shadow[s as usize..e as usize].fill(0),
            }
            if let Some(v) = self.versions.as_mut() {
                for slot in s / PAGE..e.div_ceil(PAGE) {
                    let p = (slot * PAGE) as usize;
                    v.insert((slot, page_hash(&self.shadow[p..p + PAGE_SIZE])));
                }
            }
        }
    }

    /// A write or discard failed on a memory limit half-way. The device
    /// applies a request in page-sized pieces, in order, each atomically, and
    /// stops at the first failure; so the disk must equal the shadow with some
    /// prefix of those pieces applied, and that prefix must be a strict one.
    fn check_partial(&mut self, effect: &Effect, ctx: &dyn Fn() -> String) {
        let pieces = Self::pieces(effect);
        let size = self.dev_size as usize;
        let mut disk = vec![0u8; size];
        for slot in 0..self.dev_size / PAGE {
            let p = self.read_slot(slot);
            disk[(slot * PAGE) as usize..((slot + 1) * PAGE) as usize].copy_from_slice(&p);
        }
        // First piece covering each sector (every piece is whole sectors).
        let mut first = vec![usize::MAX; (self.dev_size / SECTOR) as usize];
        for (i, &(s, e, _)) in pieces.iter().enumerate() {
            for sec in s / SECTOR..e / SECTOR {
                let f = &mut first[sec as usize];
                *f = (*f).min(i);
            }
        }
        let mut k = 0usize;
        for (sec, &f) in first.iter().enumerate() {
            let r = sec * SECTOR as usize..(sec + 1) * SECTOR as usize;
            if disk[r.clone()] != self.shadow[r] {
                assert_ne!(
                    f,
                    usize::MAX,
                    "failed request changed sector {sec} outside its range: {}",
                    ctx()
                );
                k = k.max(f + 1);
            }
        }
        assert!(
            k < pieces.len(),
            "request failed but all {} pieces were applied: {}",
            pieces.len(),
            ctx()
        );
        self.apply_pieces(&pieces[..k]);
        if let Some(off) = first_diff(&self.shadow, &disk) {
            panic!("after a failed write, disk byte {off:#x} matches no prefix of the request's pieces: {}", ctx());
        }
    }
}

/// The drain's view of the harness: `drain_queue` calls it around each chain.
struct Watch<'h, 'a> {
    h: &'h mut Harness<'a>,
    /// The used index the model expects once the chain's `add_used` is done;
    /// the notify callback reads it.
    used_idx: &'h Cell<u16>,
}

impl ChainHook for Watch<'_, '_> {
    fn popped<M: GuestMemory>(&mut self, chain: &DescriptorChain<&M>) {
        self.h.popped(chain);
    }

    fn ran(&mut self, head: u16, req: &Request, result: &Result<u32, ChainError>, used: u32) {
        self.h.ran(head, req, result, used);
        self.used_idx.set(self.h.next_used);
    }
}

/// Where two equally long buffers first differ. Compares with `==` (memcmp)
/// first: a byte loop is slow under coverage instrumentation.
fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    if a == b {
        return None;
    }
    Some(
        a.iter()
            .zip(b)
            .position(|(x, y)| x != y)
            .unwrap_or(a.len().min(b.len())),
    )
}

/// Data the request macro writes: compressible for seeds below 0x80,
/// incompressible (xorshift) above, to reach the memory limits.
pub fn payload(len: usize, seed: u8) -> Vec<u8> {
    if seed & 0x80 == 0 {
        return (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
            .collect();
    }
    let mut x = 0x9e37_79b9u32 ^ u32::from(seed) << 8;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// Encodes inputs for the seed corpus with the same operation codes.
pub mod seed {
    use super::op;

    /// Layouts (configuration byte bits 0-1).
    pub const ONE_REGION: u8 = 0;
    pub const GAP: u8 = 1;
    pub const ADJACENT: u8 = 2;
    pub const TOP: u8 = 3;

    pub struct Seed(pub Vec<u8>);

    impl Seed {
        /// `qlog`: queue size 2^qlog (0..=8); modes 0 (see `modes`).
        pub fn new(layout: u8, qlog: u8, readonly: bool, limited: bool) -> Seed {
            Seed(vec![
                layout | qlog << 2 | u8::from(readonly) << 6 | u8::from(limited) << 7,
                0,
            ])
        }
        /// Sets the second configuration byte (`super::mode`).
        pub fn modes(&mut self, m: u8) -> &mut Seed {
            self.0[1] = m;
            self
        }
        fn push(&mut self, b: &[u8]) -> &mut Seed {
            self.0.extend_from_slice(b);
            self
        }
        /// Address encodings (see `Harness::addr`).
        pub fn a_first(off: u16) -> Vec<u8> {
            let mut v = vec![0];
            v.extend_from_slice(&off.to_le_bytes());
            v
        }
        pub fn a_raw(a: u64) -> Vec<u8> {
            let mut v = vec![8];
            v.extend_from_slice(&a.to_le_bytes());
            v
        }
        pub fn a_last(off: u16) -> Vec<u8> {
            let mut v = vec![2];
            v.extend_from_slice(&off.to_le_bytes());
            v
        }
        pub fn a_end_minus(n: u8) -> Vec<u8> {
            vec![4, n]
        }
        /// Length encodings (see `Harness::len`).
        pub fn l_raw(l: u32) -> Vec<u8> {
            let mut v = vec![8];
            v.extend_from_slice(&l.to_le_bytes());
            v
        }
        /// Sector encodings (see `Harness::sector`).
        pub fn s_raw(s: u64) -> Vec<u8> {
            let mut v = vec![4];
            v.extend_from_slice(&s.to_le_bytes());
            v
        }
        pub fn n_raw(n: u32) -> Vec<u8> {
            let mut v = vec![4];
            v.extend_from_slice(&n.to_le_bytes());
            v
        }
        pub fn f_raw(f: u32) -> Vec<u8> {
            let mut v = vec![2];
            v.extend_from_slice(&f.to_le_bytes());
            v
        }

        /// Well-formed request: kind 0 IN, 1 OUT, 2 FLUSH, 3 GET_ID, 4 DISCARD,
        /// 5 WRITE_ZEROES; `size` is sectors-1 for IN/OUT, bytes for GET_ID,
        /// segments-1 for DISCARD/WRITE_ZEROES (then `segs` follow).
        #[allow(clippy::too_many_arguments)]
        pub fn request(
            &mut self,
            kind: u8,
            sector: u64,
            head: u8,
            split: u8,
            indirect: bool,
            size: u8,
            seed: u8,
        ) -> &mut Seed {
            self.push(&[op::REQUEST, kind]);
            self.push(&Self::s_raw(sector));
            self.push(&[head, (split - 1) | u8::from(indirect) << 2]);
            match kind {
                0 | 1 => self.push(&[size, seed]),
                3 => self.push(&[size]),
                _ => self,
            }
        }
        /// For DISCARD/WRITE_ZEROES requests: count then segments.
        pub fn dwz(
            &mut self,
            kind: u8,
            head: u8,
            indirect: bool,
            segs: &[(u64, u32, u32)],
        ) -> &mut Seed {
            self.push(&[op::REQUEST, kind]);
            self.push(&Self::s_raw(0));
            self.push(&[head, u8::from(indirect) << 2]);
            self.push(&[segs.len() as u8 - 1]);
            for &(s, n, f) in segs {
                self.push(&Self::s_raw(s));
                self.push(&Self::n_raw(n));
                self.push(&Self::f_raw(f));
            }
            self
        }
        pub fn header(&mut self, at: &[u8], t: u32, sector: u64) -> &mut Seed {
            self.push(&[op::HEADER])
                .push(at)
                .push(&[6])
                .push(&t.to_le_bytes())
                .push(&[0]);
            self.push(&Self::s_raw(sector))
        }
        /// A linked chain in the main table from `head`; `descs` are
        /// (address encoding, length encoding, write?, indirect?).
        pub fn chain(&mut self, head: u8, descs: &[(Vec<u8>, Vec<u8>, bool, bool)]) -> &mut Seed {
            self.push(&[op::CHAIN, head, descs.len() as u8 - 1]);
            for (a, l, w, i) in descs {
                self.push(a)
                    .push(l)
                    .push(&[u8::from(*w) | u8::from(*i) << 6]);
            }
            self
        }
        pub fn indirect(
            &mut self,
            table: &[u8],
            head: u8,
            descs: &[(Vec<u8>, Vec<u8>, bool, bool)],
            len_sel: u8,
        ) -> &mut Seed {
            self.push(&[op::INDIRECT])
                .push(table)
                .push(&[head, descs.len() as u8 - 1]);
            for (a, l, w, i) in descs {
                self.push(a)
                    .push(l)
                    .push(&[u8::from(*w) | u8::from(*i) << 6]);
            }
            self.push(&[len_sel])
        }
        pub fn desc(
            &mut self,
            idx: u16,
            addr: &[u8],
            len: &[u8],
            flags: u8,
            next: u16,
        ) -> &mut Seed {
            self.push(&[op::DESC])
                .push(&idx.to_le_bytes())
                .push(addr)
                .push(len)
                .push(&[flags])
                .push(&next.to_le_bytes())
        }
        pub fn kick(&mut self, heads: &[u16]) -> &mut Seed {
            self.push(&[op::KICK, heads.len() as u8 - 1]);
            for h in heads {
                self.push(&h.to_le_bytes());
            }
            self
        }
        pub fn long_chain(
            &mut self,
            n: u16,
            table: &[u8],
            head: u8,
            hdr: &[u8],
            data: (Vec<u8>, Vec<u8>, bool),
            status: &[u8],
        ) -> &mut Seed {
            self.push(&[op::LONG_CHAIN])
                .push(&(n - 1).to_le_bytes())
                .push(table)
                .push(&[head])
                .push(hdr);
            self.push(&data.0)
                .push(&data.1)
                .push(&[u8::from(data.2)])
                .push(status)
        }
        pub fn bytes(&mut self, at: &[u8], b: &[u8]) -> &mut Seed {
            self.push(&[op::BYTES])
                .push(at)
                .push(&[b.len() as u8])
                .push(b)
        }
        pub fn readonly(&mut self) -> &mut Seed {
            self.push(&[op::READONLY])
        }
        pub fn limit(&mut self, sel: u8) -> &mut Seed {
            self.push(&[op::LIMIT, sel])
        }
        pub fn compact(&mut self) -> &mut Seed {
            self.push(&[op::COMPACT])
        }
        pub fn process(&mut self) -> &mut Seed {
            self.push(&[op::PROCESS])
        }
    }
}
