//! Fuzz harness for the virtio-blk request path: descriptor chains over fake
//! guest memory → `virtio_queue` → `Request::parse` → `BlkDevice::execute`
//! → the page store.
//!
//! Shared, through `#[path]`, by the cargo-fuzz target
//! (`fuzz/fuzz_targets/blk_request.rs`) and the corpus replay test
//! (`tests/fuzz_corpus.rs`), so a corpus file means the same thing to both.
//! Only the public API of `vzram-blk` and `vzram-store` is used.
//!
//! An input is a small program: a configuration byte, then operations that
//! play the guest (write descriptors, headers, discard segments and bytes
//! anywhere in guest memory, build direct and indirect chains, publish heads
//! in the avail ring) or the host (switch to the read-only view, change the
//! memory limit, compact). Every chain the queue pops is run the way the
//! queue thread runs it, and checked against an independent model written
//! from the virtio spec and the limits vzram advertises:
//!
//! * nothing panics;
//! * a chain whose last descriptor has no writable, in-memory last byte gets
//!   no status and a used length of 0; otherwise the status lands exactly on
//!   that byte, and malformed chains get IOERR, unknown types and flags UNSUPP;
//! * guest memory changes only where the request may write: the status byte,
//!   and for IN and GET_ID the device-writable payload, with exactly the
//!   expected bytes;
//! * the used length is the payload written plus the status byte;
//! * a request that fails does not reach the store at all (its write and
//!   discard counters do not move), except when a memory limit is hit in the
//!   middle of a write: then a prefix of the request's page-sized pieces is
//!   applied and nothing else changes;
//! * the store always equals a shadow copy of the disk: unwritten space reads
//!   as zeros, successful writes and discards read back, compaction moves
//!   nothing visible.
//!
//! Any violation panics with a message that says what differed.

#![allow(dead_code)]

use std::cell::RefCell;
use std::sync::Arc;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vzram_blk::config::{MAX_DESCRIPTORS, MAX_DISCARD_SECTORS, MAX_DISCARD_SEG, SERIAL_LEN};
use vzram_blk::device::{BlkDevice, ExecError};
use vzram_blk::request::{Request, RequestType};
use vzram_store::{Codec, Device, DeviceConfig, Page, Pool, PoolConfig, StoreError, PAGE_SIZE};

/// Disk size: 64 slots, small enough to compare whole after every input.
pub const DEV_SIZE: u64 = 256 << 10;
pub const SECTOR: u64 = 512;
pub const DEV_SECTORS: u64 = DEV_SIZE / SECTOR;
const PAGE: u64 = PAGE_SIZE as u64;
/// Longer than GET_ID's 20 bytes on purpose: the device cuts it.
pub const SERIAL: &str = "vzram-fuzz-serial-0123456789";

/// Caps so one input stays fast.
const MAX_OPS: usize = 64;
const MAX_CHAINS: usize = 64;

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
        for off in (0..len).step_by(ZEROS.len()) {
            mem.write_slice(&ZEROS, GuestAddress(start + off))
                .expect("zero guest memory");
        }
    }
    let mut h = Harness::new(data, &mem, bufs, sabotage);
    h.run();
    let summary = h.summary;
    let bufs = h.into_bufs();
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        c.mems[sel] = Some(mem);
        c.bufs = bufs;
    });
    summary
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
}

#[derive(Default)]
struct Cache {
    mems: [Option<GuestMemoryMmap>; 4],
    bufs: Bufs,
}

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
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
    queue: Queue,
    qsize: u16,
    store: Arc<Device>,
    rw: BlkDevice,
    ro: BlkDevice,
    readonly: bool,
    /// Some memory limit is set, so writes may fail half-way.
    host_limited: bool,
    shadow: Vec<u8>,
    req: Request,
    bounce: Box<Page>,
    sabotage: bool,
    summary: Summary,
    cur: Vec<Vec<u8>>,
    next: Vec<Vec<u8>>,
}

impl<'a> Harness<'a> {
    fn new(data: &'a [u8], mem: &'a GuestMemoryMmap, bufs: Bufs, sabotage: bool) -> Harness<'a> {
        let mut inp = Input { data, pos: 0 };
        // Configuration byte: bits 0-1 layout, 2-5 queue size, 6 read-only,
        // 7 limits (a device limit and a host limit).
        let cfg = inp.u8();
        let layout = LAYOUTS[usize::from(cfg & 3)];
        let regions: Vec<Region> = layout
            .iter()
            .map(|&(start, len)| Region { start, len })
            .collect();
        let qsize = 1u16 << (((cfg >> 2) & 0xf) % 9); // 1..=256
        let mut queue = Queue::new(256).expect("queue");
        queue.set_size(qsize);
        queue.set_desc_table_address(Some(DESC_TABLE as u32), Some(0));
        queue.set_avail_ring_address(Some(AVAIL_RING as u32), Some(0));
        queue.set_used_ring_address(Some(USED_RING as u32), Some(0));
        queue.set_ready(true);
        assert!(queue.is_valid(mem), "harness queue layout");

        let limited = cfg & 0x80 != 0;
        let host_limit = if limited { 96 * 1024 } else { 0 };
        let pool = Pool::new(PoolConfig {
            host_mem_limit: host_limit,
            arena_bytes: 64 << 20,
        })
        .expect("pool");
        let mut dcfg = DeviceConfig::new(DEV_SIZE, Codec::Lz4);
        dcfg.shards = 1;
        dcfg.mem_limit = if limited { 48 * 1024 } else { 0 };
        let store = pool.create_device(dcfg).expect("store device");
        let rw = BlkDevice::new(store.clone(), 1, false, SERIAL);
        let ro = BlkDevice::new(store.clone(), 1, true, SERIAL);
        Harness {
            inp,
            regions,
            mem,
            queue,
            qsize,
            store,
            rw,
            ro,
            readonly: cfg & 0x40 != 0,
            host_limited: limited,
            shadow: {
                let mut v = bufs.shadow;
                v.clear();
                v.resize(DEV_SIZE as usize, 0);
                v
            },
            cur: bufs.cur,
            next: bufs.next,
            req: Request::default(),
            bounce: Box::new([0; PAGE_SIZE]),
            sabotage,
            summary: Summary::default(),
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
            2 => DEV_SECTORS.saturating_sub(u64::from(self.inp.u8())),
            3 => DEV_SECTORS + u64::from(self.inp.u8()),
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

    // ---- device side: what the queue thread does, then the checks --------

    fn into_bufs(self) -> Bufs {
        Bufs {
            shadow: self.shadow,
            cur: self.cur,
            next: self.next,
        }
    }

    fn process(&mut self) {
        // The harness itself wrote to guest memory since the last time.
        let mut cur = std::mem::take(&mut self.cur);
        self.snapshot_into(&mut cur);
        self.cur = cur;
        while self.summary.chains < MAX_CHAINS as u64 {
            let Some(chain) = self.queue.pop_descriptor_chain(self.mem) else {
                break;
            };
            self.summary.chains += 1;
            let head = chain.head_index();
            let used = self.run_chain(chain);
            // As the queue thread does: a ring it cannot complete ends this round.
            let added = self.queue.add_used(self.mem, head, used);
            // Keep the expected memory in step with the used ring.
            let ring = USED_RING as usize..(USED_RING + 6 + 8 * u64::from(self.qsize)) as usize;
            self.mem
                .read_slice(
                    &mut self.cur[0][ring.clone()],
                    GuestAddress(ring.start as u64),
                )
                .expect("used ring");
            if added.is_err() {
                break;
            }
        }
    }

    /// Runs one chain exactly as `BlkBackend::handle_chain` does and checks
    /// the result against the model. Returns the used length.
    fn run_chain(&mut self, chain: DescriptorChain<&'a GuestMemoryMmap>) -> u32 {
        let descs: Vec<Descriptor> = chain.clone().collect();
        let head_desc: Option<Descriptor> = self
            .mem
            .read_obj(GuestAddress(
                DESC_TABLE + 16 * u64::from(chain.head_index()),
            ))
            .ok();
        if head_desc.is_some_and(|d| d.refers_to_indirect_table()) {
            self.summary.indirect += 1;
        }
        if self.readonly {
            self.summary.readonly_chains += 1;
        }
        let expect = self.model(&descs);
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

        // --- the queue thread's code path ---
        let dev = if self.readonly { &self.ro } else { &self.rw };
        let parsed = self.req.parse(chain);
        let exec = match parsed {
            Ok(()) => Some(dev.execute(self.mem, &self.req, &mut self.bounce)),
            Err(_) => None,
        };
        let (status, written) = match &exec {
            None => (ST_IOERR, 0),
            Some(Ok(n)) => (ST_OK, *n),
            Some(Err(e)) => (e.status(), 0),
        };
        let used = match self.req.status {
            Some(addr) if self.mem.write_obj(status, addr).is_ok() => written.saturating_add(1),
            _ => 0,
        };
        // --- checks ---
        let mut after = std::mem::take(&mut self.next);
        self.snapshot_into(&mut after);
        let store_touched = stats0.is_some_and(|s0| {
            let s1 = self.store.stats();
            s1.writes != s0.writes || s1.discards != s0.discards
        });
        let mut want = std::mem::take(&mut self.cur);
        let ctx = || format!("chain {descs:x?}");

        let (at, parsed_want, outcome) = match expect {
            Expect::NoStatus => {
                self.summary.no_status += 1;
                assert!(
                    parsed.is_err(),
                    "chain without a status byte parsed: {}",
                    ctx()
                );
                assert_eq!(
                    self.req.status,
                    None,
                    "status set for a chain without one: {}",
                    ctx()
                );
                assert_eq!(used, 0, "used length for a chain without status: {}", ctx());
                assert!(
                    !store_touched,
                    "chain without status reached the store: {}",
                    ctx()
                );
                self.assert_mem(&want, &after, &ctx);
                self.cur = want;
                self.next = after;
                return used;
            }
            Expect::Status {
                at,
                parsed,
                outcome,
            } => (at, parsed, outcome),
        };
        assert_eq!(
            self.req.status,
            Some(GuestAddress(at)),
            "status address: {}",
            ctx()
        );
        match (&parsed_want, &parsed) {
            (None, Err(_)) => {}
            (Some(p), Ok(())) => {
                let r = &self.req;
                assert_eq!(
                    (r.kind, r.sector, r.readable_len, r.writable_len),
                    (p.kind, p.sector, p.readable_len, p.writable_len),
                    "parsed request: {}",
                    ctx()
                );
                assert_eq!(
                    r.readable.iter().map(|s| u64::from(s.len)).sum::<u64>(),
                    r.readable_len
                );
                assert_eq!(
                    r.writable.iter().map(|s| u64::from(s.len)).sum::<u64>(),
                    r.writable_len
                );
            }
            (want_p, got) => panic!("parse result {got:?}, model expected {want_p:?}: {}", ctx()),
        }

        let limit_hit = matches!(
            exec,
            Some(Err(ExecError::Store(
                StoreError::DeviceLimit | StoreError::HostLimit
            )))
        );
        let want_status = match &outcome {
            Outcome::Malformed => ST_IOERR,
            Outcome::Unsupp => ST_UNSUPP,
            Outcome::IoErr => ST_IOERR,
            Outcome::Ok(_) => ST_OK,
        };
        let want_used;
        match outcome {
            Outcome::Ok(effect @ (Effect::Write { .. } | Effect::Zero(_))) if limit_hit => {
                assert!(self.limited(), "limit error without a limit: {exec:?}");
                self.summary.limit_failures += 1;
                assert_eq!(status, ST_IOERR);
                want_used = 1;
                self.check_partial(&effect, &ctx);
            }
            Outcome::Ok(effect) => {
                assert_eq!(status, ST_OK, "status (exec {exec:?}): {}", ctx());
                match effect {
                    Effect::Nothing => {
                        self.summary.ok_other += 1;
                        want_used = 1;
                        assert!(!store_touched, "FLUSH touched the store");
                    }
                    Effect::Read { start, segs, len } => {
                        self.summary.ok_reads += 1;
                        let data = self.shadow[start as usize..(start + len) as usize].to_vec();
                        self.write_stream(&mut want, &segs, &data);
                        want_used = len as u32 + 1;
                        assert!(!store_touched, "IN touched the store");
                    }
                    Effect::GetId { segs, n } => {
                        self.summary.ok_other += 1;
                        let mut serial = [0u8; SERIAL_LEN];
                        let s = SERIAL.as_bytes();
                        let k = s.len().min(SERIAL_LEN);
                        serial[..k].copy_from_slice(&s[..k]);
                        self.write_stream(&mut want, &segs, &serial[..n]);
                        want_used = n as u32 + 1;
                    }
                    Effect::Write { start, data } => {
                        self.summary.ok_writes += 1;
                        want_used = 1;
                        let s = start as usize;
                        self.shadow[s..s + data.len()].copy_from_slice(&data);
                        if self.sabotage && !data.is_empty() {
                            self.shadow[s] ^= 0x5a;
                        }
                        self.verify_range(start, start + data.len() as u64, "after write");
                    }
                    Effect::Zero(ranges) => {
                        self.summary.ok_zero += 1;
                        want_used = 1;
                        for &(s, e) in &ranges {
                            self.shadow[s as usize..e as usize].fill(0);
                        }
                        for &(s, e) in &ranges {
                            self.verify_range(s, e, "after discard/write-zeroes");
                        }
                    }
                }
            }
            other => {
                match other {
                    Outcome::Malformed => self.summary.malformed += 1,
                    Outcome::Unsupp => self.summary.unsupp += 1,
                    _ => self.summary.exec_ioerr += 1,
                }
                assert_eq!(
                    status,
                    want_status,
                    "status (exec {exec:?}, model {other:?}): {}",
                    ctx()
                );
                want_used = 1;
                assert!(
                    !store_touched,
                    "failed request reached the store ({other:?}): {}",
                    ctx()
                );
            }
        }
        assert_eq!(used, want_used, "used length: {}", ctx());
        self.write_want(&mut want, at, &[status]);
        self.assert_mem(&want, &after, &ctx);
        self.cur = want;
        self.next = after;
        used
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
                if (t == VIRTIO_BLK_T_OUT && self.readonly) || end > DEV_SIZE {
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
                        (Some(s), Some(e)) if e <= DEV_SIZE => ranges.push((s, e)),
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
            .read_page(slot, &mut page)
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
        self.verify_range(0, DEV_SIZE, what);
    }

    /// A write or discard failed on a memory limit half-way. The device
    /// applies a request in page-sized pieces, in order, each atomically, and
    /// stops at the first failure; so the disk must equal the shadow with some
    /// prefix of those pieces applied, and that prefix must be a strict one.
    fn check_partial(&mut self, effect: &Effect, ctx: &dyn Fn() -> String) {
        // (start, end, data or None for zeros)
        let mut pieces: Vec<(u64, u64, Option<&[u8]>)> = Vec::new();
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
            _ => unreachable!("only writes hit limits"),
        }
        let mut disk = vec![0u8; DEV_SIZE as usize];
        for slot in 0..DEV_SIZE / PAGE {
            let p = self.read_slot(slot);
            disk[(slot * PAGE) as usize..((slot + 1) * PAGE) as usize].copy_from_slice(&p);
        }
        // First piece covering each sector (every piece is whole sectors).
        let mut first = vec![usize::MAX; DEV_SECTORS as usize];
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
        let mut expect = self.shadow.clone();
        for &(s, e, d) in &pieces[..k] {
            match d {
                Some(d) => expect[s as usize..e as usize].copy_from_slice(d),
                None => expect[s as usize..e as usize].fill(0),
            }
        }
        if let Some(off) = first_diff(&expect, &disk) {
            panic!("after a failed write, disk byte {off:#x} matches no prefix of the request's pieces: {}", ctx());
        }
        self.shadow = disk;
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
        /// `qlog`: queue size 2^qlog (0..=8).
        pub fn new(layout: u8, qlog: u8, readonly: bool, limited: bool) -> Seed {
            Seed(vec![
                layout | qlog << 2 | u8::from(readonly) << 6 | u8::from(limited) << 7,
            ])
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
