//! Model-based tests. Random operation sequences run against two devices
//! that share one pool (device and host limits) and against plain copies in
//! memory. Device 0 always has a small backing file, device 1 sometimes:
//! a write past a limit spills pages to it, and the tiering operations
//! (idle marks, the ager, writeback, recompression) move pages there or
//! shrink them. Besides each page's content the model knows where the page
//! is and what its slot word says (idle, age, tried, codec and length)
//! wherever the store's choices are predictable. A spill picks its victims
//! by a policy of its own, so after one, the pages it could have moved are
//! "in the pool or in the file" until a read or the counts tell which.
//! After every step the content, the limits and the statistics are checked
//! against the model. A concurrent variant checks that every slot ends
//! holding what its owner thread last wrote successfully, also while the
//! writers spill to a backing file and another thread tiers under them.
//! `PROPTEST_CASES` sets the number of sequences per codec.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use proptest::prelude::*;
use vzram_store::codec::{CodecState, MAX_COMPRESSED};
use vzram_store::device::DEFAULT_HUGE_THRESHOLD;
use vzram_store::encode_fill;
use vzram_store::pool::class::class_of;
use vzram_store::{
    BackingSpec, Codec, Context, Device, DeviceConfig, DeviceStats, Filter, Page, Pool, PoolConfig,
    StoreError, PAGE_SIZE,
};

mod common;
use common::xorshift;

const P: u64 = PAGE_SIZE as u64;
/// Different sizes, so a slot mixed up between the devices shows.
const SLOTS: [u64; 2] = [64, 40];
/// A write allocates at most one span, and a span has at most 8 pages.
const MAX_SPAN: u64 = 8 * P;

#[derive(Debug, Clone, Copy)]
enum Shape {
    Zero,
    /// One byte repeated: always stored as a fill.
    Byte,
    /// One 8-byte word repeated; only some words fit in a slot word.
    Word,
    /// Random prefix, then text: compresses to the prefix's size.
    Text,
    /// Incompressible: always stored raw ("huge").
    Noise,
    /// Low-entropy bytes: mid-sized objects.
    Sparse,
}

fn shape() -> impl Strategy<Value = Shape> {
    prop_oneof![
        1 => Just(Shape::Zero),
        2 => Just(Shape::Byte),
        2 => Just(Shape::Word),
        6 => Just(Shape::Text),
        2 => Just(Shape::Noise),
        2 => Just(Shape::Sparse),
    ]
}

/// A page of `shape`. The device is mixed into the seed and the text, so the
/// two devices do not hold equal pages by chance.
fn make_page(shape: Shape, dev: usize, seed: u64) -> Box<Page> {
    let mut p: Box<Page> = Box::new([0; PAGE_SIZE]);
    let mut x = (seed ^ (dev as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1;
    match shape {
        Shape::Zero => {}
        Shape::Byte => p.fill(seed as u8),
        Shape::Word => {
            // Even seeds: a small number (fits); odd: most likely does not fit.
            let v = if seed & 1 == 0 { seed >> 52 } else { x };
            for c in p.chunks_exact_mut(8) {
                c.copy_from_slice(&v.to_ne_bytes());
            }
        }
        Shape::Text => {
            // Mostly prefixes that compress (lz4, zstd:3) into classes of two
            // or three objects per span, so a few discards leave sparse
            // spans: work for compaction.
            let v = (seed >> 8) as usize;
            let noisy = [1860 + v % 20, 2580 + v % 20, 1870, v % 2500][seed as usize % 4];
            let text = if dev == 0 {
                b"device zero swaps gently. "
            } else {
                b"device one swaps roughly. "
            };
            for (i, b) in p.iter_mut().enumerate() {
                *b = if i < noisy {
                    xorshift(&mut x) as u8
                } else {
                    text[i % text.len()]
                };
            }
        }
        Shape::Noise => p.iter_mut().for_each(|b| *b = xorshift(&mut x) as u8),
        Shape::Sparse => {
            for (i, b) in p.iter_mut().enumerate() {
                *b = if i % 64 < 40 {
                    (xorshift(&mut x) % 4) as u8 + dev as u8
                } else {
                    0
                };
            }
        }
    }
    p
}

/// Whether the store keeps this page in the slot word, needing no memory.
fn kept_as_fill(p: &Page) -> bool {
    let v = u64::from_ne_bytes(p[..8].try_into().unwrap());
    p.chunks_exact(8)
        .all(|c| u64::from_ne_bytes(c.try_into().unwrap()) == v)
        && encode_fill(v).is_some()
}

/// Ager passes after which an idle page is cold (the store's `slot::MAX_AGE`).
const MAX_AGE: u8 = 3;

/// Where a stored page that needs an object is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loc {
    Pool,
    File,
    /// A spill, or a pass the model could not follow, may have moved it.
    Either,
}

/// How a page in the pool is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Enc {
    /// Written with the device's codec; worked out when needed.
    Fresh,
    /// Codec id and object length (PAGE_SIZE: stored raw, "huge").
    Known {
        codec: u8,
        len: u32,
    },
    Unknown,
}

/// What the model knows of a page that needs an object. The bits are what
/// its slot word says while it is in the pool; None: not known.
#[derive(Debug, Clone, Copy)]
struct Obj {
    loc: Loc,
    idle: Option<bool>,
    age: Option<u8>,
    tried: Option<bool>,
    enc: Enc,
}

impl Obj {
    fn fresh(loc: Loc) -> Obj {
        Obj {
            loc,
            idle: Some(false),
            age: Some(0),
            tried: Some(false),
            enc: Enc::Fresh,
        }
    }

    /// A read or write: the access bits go.
    fn touch(&mut self) {
        self.idle = Some(false);
        self.age = Some(0);
    }
}

/// No, cannot tell, yes: `min` is "and".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Tri {
    No,
    Maybe,
    Yes,
}

fn tri(b: Option<bool>) -> Tri {
    match b {
        Some(true) => Tri::Yes,
        Some(false) => Tri::No,
        None => Tri::Maybe,
    }
}

/// Whether a tiering pass with `f` takes the page (its encoding resolved).
fn takes(o: &Obj, f: Filter) -> Tri {
    if o.loc == Loc::File {
        return Tri::No;
    }
    let huge = || match o.enc {
        Enc::Known { len, .. } => Some(len as usize == PAGE_SIZE),
        Enc::Unknown => None,
        Enc::Fresh => unreachable!("encodings are resolved first"),
    };
    let mut t = Tri::Yes;
    if f.idle {
        t = t.min(tri(o.idle));
    }
    if f.cold {
        t = t.min(tri(o.age.map(|a| a >= MAX_AGE)));
    }
    if f.huge {
        t = t.min(tri(huge()));
    }
    if f.incompressible {
        t = t.min(tri(huge())).min(tri(o.tried));
    }
    if o.loc == Loc::Either {
        t = t.min(Tri::Maybe);
    }
    t
}

/// A backing file of its own for one device of one case, removed after.
struct BackingFile(PathBuf);

impl BackingFile {
    fn new(blocks: u64) -> BackingFile {
        static N: AtomicU64 = AtomicU64::new(0);
        // Not tmpfs: the store opens it with O_DIRECT, which tmpfs refuses.
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("model");
        std::fs::create_dir_all(&dir).unwrap();
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{}-{n}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        // A header block, then the page blocks.
        f.set_len((blocks + 1) * P).unwrap();
        BackingFile(path)
    }
}

impl Drop for BackingFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[derive(Debug, Clone)]
enum Op {
    Write {
        dev: usize,
        slot: u64,
        shape: Shape,
        seed: u64,
    },
    Partial {
        dev: usize,
        slot: u64,
        offset: usize,
        len: usize,
        shape: Shape,
        seed: u64,
    },
    Zero {
        dev: usize,
        slot: u64,
        offset: usize,
        len: usize,
    },
    Discard {
        dev: usize,
        start: u64,
        end: u64,
    },
    /// Discards one slot in `stride`, one at a time, as a guest freeing
    /// scattered swap pages does: this is what leaves spans sparse.
    Thin {
        dev: usize,
        stride: u64,
        phase: u64,
    },
    Read {
        dev: usize,
        slot: u64,
    },
    DeviceLimit {
        dev: usize,
        pages: u64,
    },
    HostLimit {
        pages: u64,
    },
    /// One device, or the whole pool.
    Compact {
        dev: Option<usize>,
    },
    MarkIdle {
        dev: usize,
    },
    /// Ager passes in a row; reads in between would make pages young.
    Age {
        dev: usize,
        passes: u8,
    },
    Writeback {
        dev: usize,
        filter: Filter,
        max: Option<u64>,
    },
    Recompress {
        dev: usize,
        filter: Filter,
        codec: Codec,
    },
}

/// Byte ranges inside a page: sectors, arbitrary, the whole page, and some
/// that do not fit.
fn byte_range() -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![
        3 => (0..8usize, 1..=8usize).prop_map(|(s, n)| (s * 512, (n * 512).min(PAGE_SIZE - s * 512))),
        4 => (0..PAGE_SIZE, 0..=PAGE_SIZE).prop_map(|(o, l)| (o, l.min(PAGE_SIZE - o))),
        1 => Just((0, PAGE_SIZE)),
        1 => (0..=PAGE_SIZE, 0..=PAGE_SIZE),
    ]
}

/// Limits in pages: often none, often tight, sometimes roomy.
fn limit_pages() -> impl Strategy<Value = u64> {
    prop_oneof![2 => Just(0u64), 3 => 1..48u64, 1 => 48..160u64]
}

/// A device and a slot of it, sometimes just past its end.
fn dev_slot() -> impl Strategy<Value = (usize, u64)> {
    (0..2usize).prop_flat_map(|d| (Just(d), 0..SLOTS[d] + 2))
}

/// Every page, one condition, or any combination of them.
fn filter() -> impl Strategy<Value = Filter> {
    let f = |b: u8| Filter {
        idle: b & 1 != 0,
        cold: b & 2 != 0,
        huge: b & 4 != 0,
        incompressible: b & 8 != 0,
    };
    prop_oneof![
        1 => Just(Filter::default()),
        2 => (0..4u8).prop_map(move |i| f(1 << i)),
        2 => (0..16u8).prop_map(f),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (dev_slot(), shape(), any::<u64>())
            .prop_map(|((dev, slot), shape, seed)| Op::Write { dev, slot, shape, seed }),
        3 => (dev_slot(), byte_range(), shape(), any::<u64>()).prop_map(
            |((dev, slot), (offset, len), shape, seed)| Op::Partial { dev, slot, offset, len, shape, seed }
        ),
        3 => (dev_slot(), byte_range())
            .prop_map(|((dev, slot), (offset, len))| Op::Zero { dev, slot, offset, len }),
        2 => (0..2usize)
            .prop_flat_map(|d| (Just(d), 0..SLOTS[d] + 3, 0..SLOTS[d] + 3))
            .prop_map(|(dev, a, b)| {
                // Mostly short ranges; some reversed or past the end.
                let end = if b % 4 == 0 { b } else { (a + b % 5).min(SLOTS[dev] + 2) };
                Op::Discard { dev, start: a, end }
            }),
        1 => (0..2usize, 2..5u64, 0..5u64).prop_map(|(dev, stride, phase)| Op::Thin { dev, stride, phase }),
        3 => dev_slot().prop_map(|(dev, slot)| Op::Read { dev, slot }),
        1 => (0..2usize, limit_pages()).prop_map(|(dev, pages)| Op::DeviceLimit { dev, pages }),
        1 => limit_pages().prop_map(|pages| Op::HostLimit { pages }),
        2 => prop_oneof![Just(None), (0..2usize).prop_map(Some)].prop_map(|dev| Op::Compact { dev }),
        1 => (0..2usize).prop_map(|dev| Op::MarkIdle { dev }),
        2 => (0..2usize, 1..=4u8).prop_map(|(dev, passes)| Op::Age { dev, passes }),
        3 => (0..2usize, filter(), prop_oneof![Just(None), (0..24u64).prop_map(Some)])
            .prop_map(|(dev, filter, max)| Op::Writeback { dev, filter, max }),
        2 => (
            0..2usize,
            filter(),
            prop_oneof![Just(Codec::Lz4), (1..=5i32).prop_map(|level| Codec::Zstd { level })],
        )
            .prop_map(|(dev, filter, codec)| Op::Recompress { dev, filter, codec }),
    ]
}

/// Operation counts as the device reports them (zram's io_stat).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Io {
    reads: u64,
    failed_reads: u64,
    writes: u64,
    failed_writes: u64,
    discards: u64,
    backed_reads: u64,
}

/// What an operation may do to memory use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MemUse {
    Any,
    /// Refused, or not about memory: it changed nothing.
    Same,
    /// A write refused after a spill moved other pages out and then found
    /// the backing file full: use may only have dropped.
    NoMore,
}

struct Harness {
    pool: Arc<Pool>,
    devs: [Arc<Device>; 2],
    codec: Codec,
    /// Steps alternate between two contexts, so device 0 (two shards)
    /// frees objects from the other shard's spans too.
    cx: [Context; 2],
    /// What each slot must read as; None reads as zeros and holds nothing.
    pages: [Vec<Option<Box<Page>>>; 2],
    /// Where the pages that need an object are, and their slot words.
    objs: [Vec<Option<Obj>>; 2],
    /// Slots whose last whole write was noise: certainly stored raw.
    noise: [Vec<bool>; 2],
    io: [Io; 2],
    limits: [u64; 2],
    host_limit: u64,
    /// Highest use seen so far, per device and for the pool.
    max_seen: [u64; 3],
    compacted: u64,
    recompressed: [u64; 2],
    recompress_saved: [u64; 2],
    /// Where a writeback with a page limit starts: after the last page the
    /// last one took.
    wb_next: [u64; 2],
    /// For working out encodings as the store does.
    cs: CodecState,
    cbuf: Box<[u8; MAX_COMPRESSED]>,
    _files: Vec<BackingFile>,
}

/// Memory use: device 0, device 1, and the host budget.
type Usage = [u64; 3];

impl Harness {
    fn new(codec: Codec, limits: [u64; 2], host_limit: u64, backing: [Option<u64>; 2]) -> Harness {
        let pool = Pool::new(PoolConfig {
            host_mem_limit: host_limit * P,
            arena_bytes: 1 << 30,
        })
        .unwrap();
        let mut files = Vec::new();
        let mut mk = |d: usize, shards| {
            let mut cfg = DeviceConfig::new(SLOTS[d] * P, codec);
            cfg.mem_limit = limits[d] * P;
            cfg.shards = shards;
            if let Some(blocks) = backing[d] {
                let f = BackingFile::new(blocks);
                cfg.backing = Some(BackingSpec { path: f.0.clone() });
                files.push(f);
            }
            let dev = pool.create_device(cfg).unwrap();
            assert_eq!(dev.backing().map(|b| b.blocks()), backing[d]);
            dev
        };
        let devs = [mk(0, 2), mk(1, 1)];
        Harness {
            pages: SLOTS.map(|n| (0..n).map(|_| None).collect()),
            objs: SLOTS.map(|n| vec![None; n as usize]),
            noise: SLOTS.map(|n| vec![false; n as usize]),
            io: Default::default(),
            limits: limits.map(|l| l * P),
            host_limit: host_limit * P,
            max_seen: [0; 3],
            compacted: 0,
            recompressed: [0; 2],
            recompress_saved: [0; 2],
            wb_next: [0; 2],
            cs: CodecState::default(),
            cbuf: Box::new([0; MAX_COMPRESSED]),
            _files: files,
            codec,
            pool,
            devs,
            cx: [Context::new(0), Context::new(1)],
        }
    }

    fn usage(&self) -> Usage {
        [
            self.devs[0].cells().budget().used(),
            self.devs[1].cells().budget().used(),
            self.pool.host_cells().budget().used(),
        ]
    }

    /// Free blocks of a device's backing file, if it has one.
    fn free_blocks(&self, dev: usize) -> Option<u64> {
        self.devs[dev].backing().map(|b| b.blocks() - b.used())
    }

    /// A new page in a slot; one that needs an object is at `loc`.
    fn set(&mut self, dev: usize, slot: u64, page: Option<Box<Page>>, noise: bool, loc: Loc) {
        let needs_object = page.as_deref().is_some_and(|p| !kept_as_fill(p));
        self.noise[dev][slot as usize] = noise && needs_object;
        self.objs[dev][slot as usize] = needs_object.then(|| Obj::fresh(loc));
        self.pages[dev][slot as usize] = page;
    }

    fn current(&self, dev: usize, slot: u64) -> Box<Page> {
        self.pages[dev][slot as usize]
            .clone()
            .unwrap_or_else(|| Box::new([0; PAGE_SIZE]))
    }

    /// Works out the encoding of freshly written pages, as the store did.
    fn resolve(&mut self, dev: usize) {
        for (o, p) in self.objs[dev].iter_mut().zip(&self.pages[dev]) {
            if let Some(o) = o.as_mut().filter(|o| o.enc == Enc::Fresh) {
                let page = p.as_deref().expect("objects hold pages");
                let len = self
                    .codec
                    .compress(page, &mut self.cbuf, DEFAULT_HUGE_THRESHOLD, &mut self.cs)
                    .unwrap_or(PAGE_SIZE);
                o.enc = Enc::Known {
                    codec: self.codec.id(),
                    len: len as u32,
                };
            }
        }
    }

    /// A spill scanned the device and wrote back pages of its choosing,
    /// marking the rest idle as it went (a second chance).
    fn spilled(&mut self, dev: usize) {
        for o in self.objs[dev].iter_mut().flatten() {
            if o.loc == Loc::Pool {
                o.loc = Loc::Either;
                if o.idle == Some(false) {
                    o.idle = None;
                }
            }
        }
    }

    /// Where the counts tell: with as many pages in the file as the model
    /// has there for sure, the undecided ones are all in the pool; with as
    /// many as it might have, all in the file.
    fn settle(&mut self) -> Result<(), TestCaseError> {
        for dev in 0..2 {
            let count = |l: Loc| {
                self.objs[dev]
                    .iter()
                    .flatten()
                    .filter(|o| o.loc == l)
                    .count() as u64
            };
            let (file, either) = (count(Loc::File), count(Loc::Either));
            if either == 0 {
                // check_stats compares the rest.
                continue;
            }
            let backed = self.devs[dev].stats().backed_pages;
            prop_assert!(
                (file..=file + either).contains(&backed),
                "device {dev}: {backed} pages in the file, the model has {file} and {either} undecided"
            );
            if backed == file || backed == file + either {
                let loc = if backed == file { Loc::Pool } else { Loc::File };
                for o in self.objs[dev].iter_mut().flatten() {
                    if o.loc == Loc::Either {
                        o.loc = loc;
                    }
                }
            }
        }
        Ok(())
    }

    fn read_check(&mut self, dev: usize, slot: u64) -> Result<(), TestCaseError> {
        let mut buf = [0xa5u8; PAGE_SIZE];
        let obj = self.objs[dev].get(slot as usize).copied().flatten();
        // Only needed to tell where an undecided page is: check_stats
        // compares the count of the others.
        let either = obj.is_some_and(|o| o.loc == Loc::Either);
        let backed_reads = if either {
            self.devs[dev].stats().backed_reads
        } else {
            0
        };
        let r = self.devs[dev].read_page(&mut self.cx[0], slot, &mut buf);
        self.io[dev].reads += 1;
        if slot >= SLOTS[dev] {
            self.io[dev].failed_reads += 1;
            prop_assert_eq!(
                r,
                Err(StoreError::OutOfRange {
                    slot,
                    slots: SLOTS[dev]
                })
            );
            return Ok(());
        }
        prop_assert_eq!(r, Ok(()));
        if let Some(mut o) = obj {
            // A page in the file is read from it; which of the two an
            // undecided page is shows here.
            let from_file = match o.loc {
                Loc::Pool => 0,
                Loc::File => 1,
                Loc::Either => {
                    let n = self.devs[dev].stats().backed_reads - backed_reads;
                    prop_assert!(n <= 1);
                    n
                }
            };
            self.io[dev].backed_reads += from_file;
            if from_file == 1 {
                o.loc = Loc::File;
            } else {
                o.loc = Loc::Pool;
                o.touch();
            }
            self.objs[dev][slot as usize] = Some(o);
        }
        let want = self.current(dev, slot);
        prop_assert!(buf == *want, "device {} slot {} differs", dev, slot);
        Ok(())
    }

    /// Reads every slot; `file`: those in the backing file too (each one
    /// a read from disk).
    fn read_all(&mut self, file: bool) -> Result<(), TestCaseError> {
        for (dev, &n) in SLOTS.iter().enumerate() {
            for slot in 0..n {
                let loc = self.objs[dev][slot as usize].map(|o| o.loc);
                if file || loc != Some(Loc::File) {
                    self.read_check(dev, slot)?;
                }
            }
        }
        Ok(())
    }

    /// Judges the outcome of a write (whole, partial or zeroing) that would
    /// leave `new` in the slot, and applies it to the model if it succeeded.
    /// A limit error is only acceptable when that limit is set, the new
    /// content needs memory, and the largest span might not fit under it;
    /// with a backing file, never: the write spills, and fails only when
    /// the file is full too. `locked`: the write held the slot's lock
    /// while it spilled (a partial write), so its page could not move.
    /// Returns what the write may have done to memory use.
    #[allow(clippy::too_many_arguments)]
    fn judge_write(
        &mut self,
        dev: usize,
        slot: u64,
        r: Result<(), StoreError>,
        new: Option<Box<Page>>,
        noise: bool,
        before: Usage,
        sb: &DeviceStats,
        locked: bool,
    ) -> Result<MemUse, TestCaseError> {
        self.io[dev].writes += 1;
        if r.is_err() {
            self.io[dev].failed_writes += 1;
        }
        if slot >= SLOTS[dev] {
            prop_assert_eq!(
                r,
                Err(StoreError::OutOfRange {
                    slot,
                    slots: SLOTS[dev]
                })
            );
            return Ok(MemUse::Same);
        }
        let needs_memory = new.as_deref().is_some_and(|p| !kept_as_fill(p));
        let might_not_fit = |used: u64, limit: u64| limit != 0 && used + MAX_SPAN > limit;
        let over = might_not_fit(before[dev], self.limits[dev])
            || might_not_fit(before[2], self.host_limit);
        let backing = self.free_blocks(dev).is_some();
        let sa = self.devs[dev].stats();
        let spills = sa.spills - sb.spills;
        let to_file = sa.backed_writes - sb.backed_writes;
        if !backing {
            prop_assert_eq!((spills, to_file), (0, 0));
        }
        // What a spill could have moved: every page of the device in the
        // pool, but the one a partial write holds.
        let movable = self.objs[dev]
            .iter()
            .enumerate()
            .filter(|(s, o)| {
                o.is_some_and(|o| o.loc == Loc::Pool) && !(locked && *s as u64 == slot)
            })
            .count();
        if spills > 0 {
            prop_assert!(
                needs_memory && over,
                "device {dev} slot {slot}: a spill under the limits"
            );
            self.spilled(dev);
        }
        match r {
            Ok(()) => {
                let loc = if spills > 0 {
                    Loc::Either
                } else if to_file > 0 {
                    // No spill round ran, yet the page went to the file:
                    // only right when there was nothing to move out.
                    prop_assert_eq!(to_file, 1);
                    prop_assert!(needs_memory && over);
                    prop_assert!(
                        movable == 0,
                        "device {dev} slot {slot}: the page went to the backing file while {movable} \
                         pages in the pool were never considered for spilling"
                    );
                    Loc::File
                } else {
                    Loc::Pool
                };
                self.set(dev, slot, new, noise, loc);
                Ok(MemUse::Any)
            }
            Err(StoreError::BackingFull) => {
                prop_assert!(
                    backing && needs_memory && over,
                    "device {dev} slot {slot}: BackingFull, needs memory {needs_memory}, used {before:?}"
                );
                prop_assert_eq!(
                    self.free_blocks(dev),
                    Some(0),
                    "BackingFull with free blocks"
                );
                Ok(MemUse::NoMore)
            }
            Err(StoreError::DeviceLimit) => {
                prop_assert!(
                    !backing && needs_memory && might_not_fit(before[dev], self.limits[dev]),
                    "device {dev} slot {slot}: DeviceLimit with limit {} used {} needs memory {needs_memory} backing {backing}",
                    self.limits[dev],
                    before[dev]
                );
                Ok(MemUse::Same)
            }
            Err(StoreError::HostLimit) => {
                prop_assert!(
                    !backing && needs_memory && might_not_fit(before[2], self.host_limit),
                    "device {dev} slot {slot}: HostLimit with limit {} used {} needs memory {needs_memory} backing {backing}",
                    self.host_limit,
                    before[2]
                );
                Ok(MemUse::Same)
            }
            Err(e) => Err(TestCaseError::fail(format!(
                "device {dev} slot {slot}: {e}"
            ))),
        }
    }

    /// A read-modify-write loads the old page, from the file if it is there.
    fn loaded(&mut self, dev: usize, slot: u64, sb: &DeviceStats) -> Result<(), TestCaseError> {
        let from_file = self.devs[dev].stats().backed_reads - sb.backed_reads;
        let was = self.objs[dev]
            .get(slot as usize)
            .copied()
            .flatten()
            .map(|o| o.loc);
        match was {
            Some(Loc::File) => prop_assert_eq!(from_file, 1),
            Some(Loc::Either) => prop_assert!(from_file <= 1),
            _ => prop_assert_eq!(from_file, 0),
        }
        self.io[dev].backed_reads += from_file;
        Ok(())
    }

    fn step(&mut self, op: &Op, step: usize) -> Result<(), TestCaseError> {
        let before = self.usage();
        let dev = match *op {
            Op::Write { dev, .. }
            | Op::Partial { dev, .. }
            | Op::Zero { dev, .. }
            | Op::Writeback { dev, .. }
            | Op::Recompress { dev, .. } => Some(dev),
            _ => None,
        };
        // Counters of the device the operation may spill on or tier.
        let sb = dev.map(|d| self.devs[d].stats()).unwrap_or_default();
        // Slots whose content this step may have changed; read back on both devices.
        let mut touched = 0..0;
        // Slots of one device to read back.
        let mut check: Vec<(usize, u64)> = Vec::new();
        // Read every slot, but those in the file (compaction and discards
        // do not touch them).
        let mut read_everything = false;
        let mut mem = MemUse::Any;
        // Passes that compact on their own (tiering, spills).
        let mut compacts = false;
        match *op {
            Op::Write {
                dev,
                slot,
                shape,
                seed,
            } => {
                let p = make_page(shape, dev, seed);
                let r = self.devs[dev].write_page(&mut self.cx[step % 2], slot, &p);
                let noise = matches!(shape, Shape::Noise);
                mem = self.judge_write(dev, slot, r, Some(p), noise, before, &sb, false)?;
                touched = slot..slot + 1;
            }
            Op::Partial {
                dev,
                slot,
                offset,
                len,
                shape,
                seed,
            } => {
                let data = make_page(shape, dev, seed);
                let r = self.devs[dev].write_partial(
                    &mut self.cx[step % 2],
                    slot,
                    offset,
                    &data[..len],
                );
                if offset + len > PAGE_SIZE {
                    prop_assert_eq!(r, Err(StoreError::BadPageRange { offset, len }));
                    mem = MemUse::Same;
                } else {
                    let new = (slot < SLOTS[dev]).then(|| {
                        let mut p = self.current(dev, slot);
                        p[offset..offset + len].copy_from_slice(&data[..len]);
                        p
                    });
                    if slot < SLOTS[dev] {
                        self.loaded(dev, slot, &sb)?;
                    }
                    // A page left all zeros frees the slot.
                    let new = new.filter(|p| p.iter().any(|&b| b != 0));
                    mem = self.judge_write(dev, slot, r, new, false, before, &sb, true)?;
                }
                touched = slot..slot + 1;
            }
            Op::Zero {
                dev,
                slot,
                offset,
                len,
            } => {
                let r = self.devs[dev].zero_partial(&mut self.cx[step % 2], slot, offset, len);
                if offset + len > PAGE_SIZE {
                    prop_assert_eq!(r, Err(StoreError::BadPageRange { offset, len }));
                    mem = MemUse::Same;
                } else if len == PAGE_SIZE {
                    // A whole page is a discard.
                    if slot < SLOTS[dev] {
                        prop_assert_eq!(r, Ok(()));
                        self.set(dev, slot, None, false, Loc::Pool);
                        self.io[dev].discards += 1;
                    } else {
                        prop_assert!(matches!(r, Err(StoreError::OutOfRange { .. })), "{r:?}");
                        mem = MemUse::Same;
                    }
                } else {
                    let new = (slot < SLOTS[dev]).then(|| {
                        let mut p = self.current(dev, slot);
                        p[offset..offset + len].fill(0);
                        p
                    });
                    if slot < SLOTS[dev] {
                        self.loaded(dev, slot, &sb)?;
                    }
                    let new = new.filter(|p| p.iter().any(|&b| b != 0));
                    let noise = self.noise[dev].get(slot as usize) == Some(&true) && len == 0;
                    mem = self.judge_write(dev, slot, r, new, noise, before, &sb, true)?;
                }
                touched = slot..slot + 1;
            }
            Op::Discard { dev, start, end } => {
                let r = self.devs[dev].discard(&mut self.cx[step % 2], start..end);
                if start > end || end > SLOTS[dev] {
                    prop_assert!(
                        matches!(r, Err(StoreError::OutOfRange { .. })),
                        "discard {start}..{end} on {} slots: {r:?}",
                        SLOTS[dev]
                    );
                    mem = MemUse::Same;
                } else {
                    prop_assert_eq!(r, Ok(()));
                    for s in start..end {
                        self.set(dev, s, None, false, Loc::Pool);
                    }
                    self.io[dev].discards += end - start;
                }
                touched = start.min(end)..start.max(end);
            }
            Op::Thin { dev, stride, phase } => {
                for s in (phase % stride..SLOTS[dev]).step_by(stride as usize) {
                    let r = self.devs[dev].discard(&mut self.cx[step % 2], s..s + 1);
                    prop_assert_eq!(r, Ok(()));
                    self.set(dev, s, None, false, Loc::Pool);
                    self.io[dev].discards += 1;
                }
                read_everything = true;
            }
            Op::Read { dev, slot } => self.read_check(dev, slot)?,
            Op::DeviceLimit { dev, pages } => {
                self.devs[dev].set_mem_limit(pages * P);
                self.limits[dev] = pages * P;
                prop_assert_eq!(self.devs[dev].mem_limit(), pages * P);
            }
            Op::HostLimit { pages } => {
                self.pool.set_host_mem_limit(pages * P);
                self.host_limit = pages * P;
                prop_assert_eq!(self.pool.host_mem_limit(), pages * P);
            }
            Op::Compact { dev } => {
                let pages = match dev {
                    Some(d) => self.devs[d].compact(),
                    None => self.pool.compact(),
                };
                self.compacted += pages;
                let after = self.usage();
                // Alone, compaction moves objects into room that exists and
                // gives back exactly the pages it reports.
                prop_assert!(
                    (0..3).all(|i| after[i] <= before[i]),
                    "compaction grew memory use: {before:?} -> {after:?}"
                );
                prop_assert_eq!(before[2] - after[2], pages * P, "pages given back");
                read_everything = true;
            }
            Op::MarkIdle { dev } => {
                let n = self.devs[dev].mark_idle();
                let (mut lo, mut hi) = (0, 0);
                for o in self.objs[dev].iter_mut().flatten() {
                    if o.loc == Loc::File {
                        continue;
                    }
                    let newly = tri(o.idle.map(|i| !i)).min(if o.loc == Loc::Pool {
                        Tri::Yes
                    } else {
                        Tri::Maybe
                    });
                    lo += u64::from(newly == Tri::Yes);
                    hi += u64::from(newly != Tri::No);
                    o.idle = Some(true);
                }
                prop_assert!(
                    (lo..=hi).contains(&n),
                    "mark_idle marked {n}, not {lo}..={hi}"
                );
                mem = MemUse::Same;
            }
            Op::Age { dev, passes } => {
                for _ in 0..passes {
                    let n = self.devs[dev].age();
                    let (mut lo, mut hi) = (0, 0);
                    for o in self.objs[dev].iter_mut().flatten() {
                        if o.loc == Loc::File {
                            continue;
                        }
                        // Not idle: marked now. Idle: a pass older.
                        o.age = match o.idle {
                            Some(false) => o.age,
                            Some(true) => o.age.map(|a| (a + 1).min(MAX_AGE)),
                            None => None,
                        };
                        o.idle = Some(true);
                        let cold = tri(o.age.map(|a| a >= MAX_AGE)).min(if o.loc == Loc::Pool {
                            Tri::Yes
                        } else {
                            Tri::Maybe
                        });
                        lo += u64::from(cold == Tri::Yes);
                        hi += u64::from(cold != Tri::No);
                    }
                    prop_assert!(
                        (lo..=hi).contains(&n),
                        "age found {n} cold, not {lo}..={hi}"
                    );
                }
                mem = MemUse::Same;
            }
            Op::Writeback { dev, filter, max } => {
                check = self.writeback(dev, filter, max, &sb, before)?;
                if check.is_empty() && self.free_blocks(dev).is_none() {
                    mem = MemUse::Same;
                }
                compacts = true;
            }
            Op::Recompress { dev, filter, codec } => {
                self.recompress(dev, filter, codec, &sb, before)?;
                compacts = true;
            }
        }
        // A spill compacts too.
        compacts |= dev.is_some_and(|d| self.devs[d].stats().spills != sb.spills);
        match mem {
            MemUse::Any => {}
            MemUse::Same => prop_assert_eq!(self.usage(), before, "{:?} changed memory use", op),
            MemUse::NoMore => {
                let after = self.usage();
                prop_assert!(
                    (0..3).all(|i| after[i] <= before[i]),
                    "a refused {op:?} grew memory use: {before:?} -> {after:?}"
                );
            }
        }
        self.check_stats(before, compacts)?;
        if read_everything || step % 32 == 31 {
            // Pages in the file only every other time: each is a disk read.
            self.read_all(step % 64 == 63)?;
        } else {
            for slot in touched {
                for (dev, &slots) in SLOTS.iter().enumerate() {
                    if slot < slots {
                        self.read_check(dev, slot)?;
                    }
                }
            }
            for (dev, slot) in check {
                self.read_check(dev, slot)?;
            }
        }
        self.settle()
    }

    /// Runs a writeback and predicts it: the first pages the filter takes,
    /// in slot order, as many as `max` and the free blocks allow. Returns
    /// the slots to read back.
    fn writeback(
        &mut self,
        dev: usize,
        filter: Filter,
        max: Option<u64>,
        sb: &DeviceStats,
        before: Usage,
    ) -> Result<Vec<(usize, u64)>, TestCaseError> {
        if filter.huge || filter.incompressible {
            self.resolve(dev);
        }
        let takes: Vec<Tri> = self.objs[dev]
            .iter()
            .map(|o| o.map_or(Tri::No, |o| takes(&o, filter)))
            .collect();
        let free = self.free_blocks(dev);
        let r = self.devs[dev].writeback(filter, max);
        let Some(free) = free else {
            prop_assert!(matches!(r, Err(StoreError::InvalidConfig(_))), "{r:?}");
            return Ok(Vec::new());
        };
        let sa = self.devs[dev].stats();
        let moved = sa.backed_pages - sb.backed_pages;
        prop_assert_eq!(sa.backed_writes - sb.backed_writes, moved, "blocks written");
        let yes = takes.iter().filter(|&&t| t == Tri::Yes).count() as u64;
        let maybe = takes.iter().filter(|&&t| t == Tri::Maybe).count() as u64;
        let max = max.unwrap_or(u64::MAX);
        let (lo, hi) = (yes.min(max).min(free), (yes + maybe).min(max).min(free));
        prop_assert!(
            (lo..=hi).contains(&moved),
            "writeback of {filter:?} max {max} moved {moved}, not {lo}..={hi} ({free} blocks free)"
        );
        match r {
            Ok(rep) => {
                prop_assert_eq!(rep.pages, moved);
                prop_assert_eq!(rep.freed_bytes, before[dev] - sa.mem_used_total);
            }
            // The file filled before all the pages were in.
            Err(StoreError::BackingFull) => {
                prop_assert!(
                    (yes + maybe).min(max) > free && moved == free,
                    "{moved} moved, {free} free"
                );
            }
            Err(e) => return Err(TestCaseError::fail(format!("writeback: {e}"))),
        }
        // A pass with a page limit starts after the last page the last one
        // took and wraps around; one without starts at slot 0.
        let n = takes.len();
        let from = match max {
            u64::MAX => 0,
            _ => (self.wb_next[dev] as usize).min(n),
        };
        let exact = maybe == 0 && r.is_ok();
        let mut check = Vec::new();
        // The pass takes the first `max` pages in that order, and moves as
        // many of them as the file has room for.
        let (mut left, mut taken) = (moved, 0u64);
        let mut next = self.wb_next[dev];
        for s in (from..n).chain(0..from) {
            let o = self.objs[dev][s].as_mut();
            match (takes[s], o) {
                (Tri::Yes, Some(o)) if exact => {
                    taken += 1;
                    if taken == max {
                        next = s as u64 + 1;
                    }
                    // Past the pages the pass moved: still in the pool.
                    if left > 0 {
                        o.loc = Loc::File;
                        left -= 1;
                        check.push((dev, s as u64));
                    }
                }
                (Tri::Yes | Tri::Maybe, Some(o)) => {
                    o.loc = Loc::Either;
                    check.push((dev, s as u64));
                }
                _ => {}
            }
        }
        if max != u64::MAX {
            let cursor = self.devs[dev].writeback_cursor();
            if exact {
                prop_assert_eq!(cursor, next, "where the next limited writeback starts");
            }
            // After a pass it could not follow page by page, the model
            // takes the device's word for it, and predicts again from there.
            self.wb_next[dev] = cursor;
        }
        Ok(check)
    }

    /// Runs a recompression and predicts it page by page, compressing as
    /// the store does: the pages the filter takes, not tried before, raw or
    /// in another codec, are tried; those that `codec` puts in a smaller
    /// size class are recompressed, the rest marked tried. A limit stops
    /// the pass at the page that found no room.
    fn recompress(
        &mut self,
        dev: usize,
        filter: Filter,
        codec: Codec,
        sb: &DeviceStats,
        before: Usage,
    ) -> Result<(), TestCaseError> {
        self.resolve(dev);
        // (slot, length, what `codec` makes of it if smaller)
        let mut plan = Vec::new();
        let mut exact = true;
        let mut candidates = Vec::new();
        for s in 0..SLOTS[dev] as usize {
            let Some(o) = self.objs[dev][s] else {
                continue;
            };
            let mut t = takes(&o, filter).min(tri(o.tried.map(|t| !t)));
            let Enc::Known { codec: id, len } = o.enc else {
                if t != Tri::No {
                    exact = false;
                    candidates.push(s);
                }
                continue;
            };
            let huge = len as usize == PAGE_SIZE;
            if !huge && id == codec.id() {
                t = Tri::No;
            }
            match t {
                Tri::No => continue,
                Tri::Maybe => exact = false,
                Tri::Yes => {
                    let page = self.pages[dev][s].as_deref().expect("objects hold pages");
                    let limit = if huge {
                        DEFAULT_HUGE_THRESHOLD
                    } else {
                        len as usize
                    };
                    let n = codec
                        .compress(page, &mut self.cbuf, limit, &mut self.cs)
                        .filter(|&n| class_of(n) < class_of(len as usize));
                    plan.push((s, len, n));
                }
            }
            candidates.push(s);
        }
        let r = self.devs[dev].recompress(filter, codec);
        let sa = self.devs[dev].stats();
        let pages = sa.pages_recompressed - sb.pages_recompressed;
        let saved = sa.recompress_saved_bytes - sb.recompress_saved_bytes;
        self.recompressed[dev] += pages;
        self.recompress_saved[dev] += saved;
        prop_assert_eq!(
            sb.compr_data_size - sa.compr_data_size,
            saved,
            "compressed bytes saved"
        );
        match &r {
            Ok(rep) => {
                prop_assert_eq!((rep.pages, rep.saved_bytes), (pages, saved));
                prop_assert!(
                    rep.pages <= rep.tried && rep.tried <= candidates.len() as u64,
                    "{rep:?}"
                );
                prop_assert_eq!(
                    rep.freed_bytes,
                    before[dev].saturating_sub(sa.mem_used_total)
                );
            }
            Err(StoreError::DeviceLimit) => prop_assert!(self.limits[dev] != 0),
            Err(StoreError::HostLimit) => prop_assert!(self.host_limit != 0),
            Err(e) => return Err(TestCaseError::fail(format!("recompress: {e}"))),
        }
        if !exact {
            for s in candidates {
                let o = self.objs[dev][s].as_mut().unwrap();
                o.tried = None;
                o.enc = Enc::Unknown;
            }
            return Ok(());
        }
        if let Ok(rep) = &r {
            prop_assert_eq!(rep.tried, plan.len() as u64, "pages tried");
        }
        let (mut done, mut done_saved, mut stopped) = (0, 0, false);
        for &(s, len, n) in &plan {
            let o = self.objs[dev][s].as_mut().unwrap();
            match n {
                Some(_) if done == pages => {
                    // The page the pass found no room for.
                    stopped = true;
                    break;
                }
                Some(n) => {
                    done += 1;
                    done_saved += u64::from(len) - n as u64;
                    o.enc = Enc::Known {
                        codec: codec.id(),
                        len: n as u32,
                    };
                }
                None => o.tried = Some(true),
            }
        }
        prop_assert_eq!(done, pages, "pages recompressed");
        prop_assert_eq!(done_saved, saved);
        prop_assert_eq!(stopped, r.is_err(), "stopped early: {:?}", r);
        Ok(())
    }

    /// Statistics against the model, and limits against memory use.
    fn check_stats(&mut self, before: Usage, compacts: bool) -> Result<(), TestCaseError> {
        let ds = [self.devs[0].stats(), self.devs[1].stats()];
        let ps = self.pool.stats();
        for (dev, s) in ds.iter().enumerate() {
            let stored = self.pages[dev].iter().flatten().count() as u64;
            let objs = || self.objs[dev].iter().flatten();
            let needing = objs().count() as u64;
            let fills = stored - needing;
            let in_file = s.backed_pages;
            prop_assert_eq!(
                in_file,
                self.devs[dev].backing().map_or(0, |b| b.used()),
                "device {} written-back pages vs blocks in use",
                dev
            );
            prop_assert!(
                in_file <= needing,
                "device {dev}: {in_file} pages in the file of {needing}"
            );
            let objects = needing - in_file;
            let raw = (0..SLOTS[dev] as usize)
                .filter(|&i| {
                    self.noise[dev][i] && self.objs[dev][i].is_some_and(|o| o.loc == Loc::Pool)
                })
                .count() as u64;
            let used = s.mem_used_total;
            prop_assert_eq!(s.orig_data_size, stored * P, "device {} stored pages", dev);
            prop_assert_eq!(s.same_pages, fills, "device {} same pages", dev);
            prop_assert!(
                (raw..=objects).contains(&s.huge_pages),
                "device {dev}: {} huge pages, {raw} noise in the pool of {objects} objects",
                s.huge_pages
            );
            prop_assert!(
                (objects..=objects * P).contains(&s.compr_data_size),
                "device {dev}: compr {} for {objects} objects",
                s.compr_data_size
            );
            // Every object lives in a span, every span holds an object, and
            // spans are whole pages of at most MAX_SPAN.
            prop_assert!(used % P == 0 && used >= s.compr_data_size, "{s:?}");
            prop_assert!(used <= objects * MAX_SPAN, "device {dev} leaks: {s:?}");
            prop_assert_eq!(used == 0, objects == 0, "device {} used {}", dev, used);
            prop_assert_eq!(s.mem_limit, self.limits[dev]);
            self.max_seen[dev] = self.max_seen[dev].max(used);
            prop_assert!(s.mem_used_max >= self.max_seen[dev], "{s:?}");
            let io = Io {
                reads: s.reads,
                failed_reads: s.failed_reads,
                writes: s.writes,
                failed_writes: s.failed_writes,
                discards: s.discards,
                backed_reads: s.backed_reads,
            };
            prop_assert_eq!(&io, &self.io[dev], "device {} io counters", dev);
            prop_assert_eq!(
                (s.pages_recompressed, s.recompress_saved_bytes),
                (self.recompressed[dev], self.recompress_saved[dev])
            );
        }
        let devices_used = ds[0].mem_used_total + ds[1].mem_used_total;
        prop_assert_eq!(ps.mem_used_total, devices_used, "host budget vs devices");
        prop_assert_eq!(ps.mem_limit, self.host_limit);
        prop_assert_eq!(
            ps.orig_data_size,
            ds[0].orig_data_size + ds[1].orig_data_size
        );
        prop_assert_eq!(ps.backed_pages, ds[0].backed_pages + ds[1].backed_pages);
        if compacts {
            prop_assert!(ps.pages_compacted >= self.compacted);
            self.compacted = ps.pages_compacted;
        }
        prop_assert_eq!(ps.pages_compacted, self.compacted);
        self.max_seen[2] = self.max_seen[2].max(ps.mem_used_total);
        prop_assert!(ps.mem_used_max >= self.max_seen[2], "{ps:?}");
        // Use stays under each limit. Lowering a limit evicts nothing, so
        // use may sit above one; it must never grow while it does. The
        // device sum is checked on its own so a host budget that stopped
        // counting shows too.
        let after = [
            ds[0].mem_used_total,
            ds[1].mem_used_total,
            ps.mem_used_total,
        ];
        let limits = [self.limits[0], self.limits[1], self.host_limit];
        let before_devices = before[0] + before[1];
        for (i, name) in ["device 0", "device 1", "host"].iter().enumerate() {
            if limits[i] != 0 {
                prop_assert!(
                    after[i] <= limits[i].max(before[i]),
                    "{name} grew past its limit {}: {} -> {}",
                    limits[i],
                    before[i],
                    after[i]
                );
            }
        }
        if self.host_limit != 0 {
            prop_assert!(
                devices_used <= self.host_limit.max(before_devices),
                "devices grew past the host limit {}: {before_devices} -> {devices_used}",
                self.host_limit
            );
        }
        Ok(())
    }

    /// Reads everything, then discards everything: the pool and the
    /// backing files must be empty.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        self.read_all(true)?;
        for (dev, &n) in SLOTS.iter().enumerate() {
            prop_assert_eq!(self.devs[dev].discard(&mut self.cx[0], 0..n), Ok(()));
            for s in 0..n {
                self.set(dev, s, None, false, Loc::Pool);
            }
            self.io[dev].discards += n;
        }
        let before = self.usage();
        self.check_stats(before, false)?;
        prop_assert_eq!(self.usage(), [0, 0, 0]);
        for d in &self.devs {
            let s = d.stats();
            prop_assert_eq!(
                (
                    s.compr_data_size,
                    s.same_pages,
                    s.huge_pages,
                    s.backed_pages
                ),
                (0, 0, 0, 0)
            );
        }
        self.read_all(true)
    }
}

fn run(
    codec: Codec,
    init: (u64, u64, u64),
    backing: [Option<u64>; 2],
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let mut h = Harness::new(codec, [init.0, init.1], init.2, backing);
    for (step, op) in ops.iter().enumerate() {
        h.step(op, step)?;
    }
    h.finish()
}

/// Backing files of a few blocks, so they fill up: device 0 always has
/// one, device 1 half the time.
fn backing() -> impl Strategy<Value = [Option<u64>; 2]> {
    let blocks = || prop_oneof![1..8u64, 8..32u64, 32..=64u64];
    (blocks(), prop_oneof![Just(None), blocks().prop_map(Some)]).prop_map(|(a, b)| [Some(a), b])
}

#[allow(clippy::type_complexity)]
fn case() -> impl Strategy<Value = ((u64, u64, u64), [Option<u64>; 2], Vec<Op>)> {
    (
        (limit_pages(), limit_pages(), limit_pages()),
        backing(),
        prop::collection::vec(op(), 1..300),
    )
}

proptest! {
    // No config override: ProptestConfig::default() reads PROPTEST_CASES.

    #[test]
    fn lz4_matches_model((init, backing, ops) in case()) {
        run(Codec::Lz4, init, backing, ops)?;
    }

    #[test]
    fn zstd_matches_model((init, backing, ops) in case()) {
        run(Codec::Zstd { level: 3 }, init, backing, ops)?;
    }
}

// The concurrent variant. Each writer thread owns the slots `s` with
// `s % WRITERS == t` on both devices and is the only one to change them, so
// it knows what each must read as; it reads other threads' slots too, where
// any whole page of that device and slot is fine. Beside them, one thread
// compacts and moves the limits. With tiering, device 0 has a backing file
// the writers spill to, and another thread marks, ages, writes back and
// recompresses under them.

const CSLOTS: u64 = 192;
const WRITERS: u64 = 3;
const OPS_PER_WRITER: u64 = 8000;
/// The host limit keeps memory nearly full, so most writes are refused. A
/// writer goes on past OPS_PER_WRITER until it stored this many and the
/// changer ran MIN_ROUNDS times, or until MAX_OPS, which only a broken
/// store or a very slow machine reaches.
const MIN_STORED: u64 = 800;
const MIN_ROUNDS: u64 = 100;
const MAX_OPS: u64 = 20 * OPS_PER_WRITER;
/// Host limits the changer cycles through; never 0, so use stays under the largest.
const HOST_LIMITS: [u64; 3] = [96 * P, 64 * P, 144 * P];
/// Device 0's backing file with tiering: half its slots, so it fills.
const CBLOCKS: u64 = CSLOTS / 2;

/// A page naming its device, slot, writer and version, with a body derived
/// from them in one of a few shapes.
fn owned_page(dev: u64, slot: u64, writer: u64, version: u64) -> Box<Page> {
    let mut p: Box<Page> = Box::new([0; PAGE_SIZE]);
    let mut x =
        (dev << 62 ^ slot << 40 ^ writer << 32 ^ version).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let noisy = [PAGE_SIZE, PAGE_SIZE, 1870, 2590, 300][version as usize % 5];
    for (i, b) in p[32..].iter_mut().enumerate() {
        let r = xorshift(&mut x) as u8;
        *b = if i < noisy { r } else { b"owned "[i % 6] };
    }
    for (i, v) in [dev, slot, writer, version].into_iter().enumerate() {
        p[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    p
}

/// Checks that a page read from `dev`/`slot` is zeros or a whole page
/// written there; returns its (writer, version).
fn verify_owned(dev: u64, slot: u64, p: &Page) -> Option<(u64, u64)> {
    if p.iter().all(|&b| b == 0) {
        return None;
    }
    let f = |i: usize| u64::from_le_bytes(p[i * 8..i * 8 + 8].try_into().unwrap());
    let (d, s, w, v) = (f(0), f(1), f(2), f(3));
    assert_eq!(
        (d, s),
        (dev, slot),
        "device {dev} slot {slot} holds device {d} slot {s}'s page"
    );
    assert!(
        *owned_page(d, s, w, v) == *p,
        "torn page in device {dev} slot {slot}"
    );
    Some((w, v))
}

fn concurrent(codecs: [Codec; 2], tiering: bool) {
    let pool = Pool::new(PoolConfig {
        host_mem_limit: HOST_LIMITS[0],
        arena_bytes: 1 << 30,
    })
    .unwrap();
    let file = tiering.then(|| BackingFile::new(CBLOCKS));
    let devs: Vec<_> = codecs
        .iter()
        .enumerate()
        .map(|(d, &c)| {
            let mut cfg = DeviceConfig::new(CSLOTS * P, c);
            cfg.shards = 2;
            if d == 0 {
                cfg.backing = file.as_ref().map(|f| BackingSpec { path: f.0.clone() });
            }
            pool.create_device(cfg).unwrap()
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let tier = tiering.then(|| {
        let (devs, stop) = (devs.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut x, mut passes) = (0x7135u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let r = xorshift(&mut x);
                let f = |b: u64| Filter {
                    idle: b & 1 != 0,
                    cold: b & 2 != 0,
                    huge: b & 4 != 0,
                    incompressible: b & 8 != 0,
                };
                let dev = &devs[(r >> 4) as usize % 2];
                let res = match r % 8 {
                    0 => {
                        dev.mark_idle();
                        Ok(())
                    }
                    1 => {
                        dev.age();
                        Ok(())
                    }
                    2..=4 => devs[0]
                        .writeback(f(r >> 8), Some(1 + (r >> 16) % 48))
                        .map(|_| ()),
                    _ => {
                        let level = (r >> 16) % 6;
                        let codec = match level {
                            0 => Codec::Lz4,
                            l => Codec::Zstd { level: l as i32 },
                        };
                        dev.recompress(f(r >> 8), codec).map(|_| ())
                    }
                };
                match res {
                    Ok(()) => passes += 1,
                    // A full file or pool stops a pass; the pages stay.
                    Err(
                        StoreError::BackingFull | StoreError::DeviceLimit | StoreError::HostLimit,
                    ) => {}
                    Err(e) => panic!("tiering: {e}"),
                }
                std::thread::yield_now();
            }
            passes
        })
    });
    let rounds = Arc::new(AtomicU64::new(0));
    // Device 0's limit moves; device 1 never has one, so DeviceLimit on it is a bug.
    let changer = {
        let (pool, devs, stop, rounds) = (pool.clone(), devs.clone(), stop.clone(), rounds.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let i = rounds.load(Ordering::Relaxed) as usize;
                devs[0].set_mem_limit([0, 64 * P, 24 * P, 200 * P][i % 4]);
                pool.set_host_mem_limit(HOST_LIMITS[i % 3]);
                match i / 3 % 3 {
                    0 => pool.compact(),
                    n => devs[n - 1].compact(),
                };
                rounds.fetch_add(1, Ordering::Relaxed);
                std::thread::yield_now();
            }
        })
    };
    let writers: Vec<_> = (0..WRITERS)
        .map(|t| {
            let (devs, rounds) = (devs.clone(), rounds.clone());
            std::thread::spawn(move || {
                let cx = &mut Context::new(t as usize);
                let mut mine = vec![vec![None; CSLOTS as usize]; 2];
                let mut x = t + 1;
                let (mut version, mut stored) = (0u64, 0u64);
                let mut buf = [0u8; PAGE_SIZE];
                let mut ops = 0;
                let more = |ops, stored| {
                    ops < OPS_PER_WRITER
                        || stored < MIN_STORED
                        || rounds.load(Ordering::Relaxed) < MIN_ROUNDS
                };
                while ops < MAX_OPS && more(ops, stored) {
                    ops += 1;
                    let r = xorshift(&mut x);
                    let d = (r >> 8) as usize % 2;
                    let any = (r >> 16) % CSLOTS;
                    let own = any - any % WRITERS + t;
                    let own = if own < CSLOTS { own } else { t };
                    let dev = &devs[d];
                    match r % 10 {
                        0..=4 => {
                            version += 1;
                            match dev.write_page(cx, own, &owned_page(d as u64, own, t, version)) {
                                Ok(()) => {
                                    mine[d][own as usize] = Some(version);
                                    stored += 1;
                                }
                                // With a backing file the writes spill, and
                                // fail only once it is full too.
                                Err(StoreError::BackingFull) if d == 0 && tiering => {}
                                Err(StoreError::DeviceLimit) if d == 0 && !tiering => {}
                                Err(StoreError::HostLimit) if d == 1 || !tiering => {}
                                Err(e) => panic!("device {d} slot {own}: {e}"),
                            }
                        }
                        5 | 6 => {
                            let r = if r >> 40 & 1 == 0 {
                                dev.discard(cx, own..own + 1)
                            } else {
                                dev.zero_partial(cx, own, 0, PAGE_SIZE)
                            };
                            r.unwrap();
                            mine[d][own as usize] = None;
                        }
                        7 | 8 => {
                            dev.read_page(cx, own, &mut buf).unwrap();
                            let got = verify_owned(d as u64, own, &buf);
                            assert_eq!(
                                got,
                                mine[d][own as usize].map(|v| (t, v)),
                                "device {d} slot {own}"
                            );
                        }
                        _ => {
                            dev.read_page(cx, any, &mut buf).unwrap();
                            if let Some((w, _)) = verify_owned(d as u64, any, &buf) {
                                assert_eq!(
                                    w,
                                    any % WRITERS,
                                    "device {d} slot {any}: foreign writer"
                                );
                            }
                        }
                    }
                }
                (mine, stored)
            })
        })
        .collect();
    let results: Vec<_> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    changer.join().unwrap();
    let passes = tier.map(|t| t.join().unwrap());
    let rounds = rounds.load(Ordering::Relaxed);
    assert!(
        rounds >= MIN_ROUNDS,
        "only {rounds} compaction rounds ran beside the writers"
    );

    let cx = &mut Context::new(0);
    let mut buf = [0u8; PAGE_SIZE];
    let mut stored = [0u64; 2];
    for (t, (mine, writes)) in results.iter().enumerate() {
        assert!(
            *writes >= MIN_STORED,
            "writer {t}: only {writes} writes stored"
        );
        for d in 0..2 {
            for slot in (t as u64..CSLOTS).step_by(WRITERS as usize) {
                devs[d].read_page(cx, slot, &mut buf).unwrap();
                let want = mine[d][slot as usize];
                assert_eq!(
                    verify_owned(d as u64, slot, &buf),
                    want.map(|v| (t as u64, v)),
                    "final device {d} slot {slot}"
                );
                stored[d] += u64::from(want.is_some());
            }
        }
    }
    let ps = pool.stats();
    let ds = [devs[0].stats(), devs[1].stats()];
    eprintln!(
        "{codecs:?}: {rounds} compaction/limit rounds, {} pages compacted, host max {}; \
         tiering: {passes:?} passes, {} spills, {} pages written back, {} recompressed",
        ps.pages_compacted, ps.mem_used_max, ps.spills, ps.backed_writes, ps.pages_recompressed
    );
    assert_eq!(
        ds[0].backed_pages,
        devs[0].backing().map_or(0, |b| b.used()),
        "written-back pages vs blocks in use"
    );
    for (d, s) in ds.iter().enumerate() {
        assert_eq!(s.orig_data_size, stored[d] * P, "device {d}");
        assert_eq!(s.same_pages, 0);
    }
    let devices_used = ds[0].mem_used_total + ds[1].mem_used_total;
    assert_eq!(ps.mem_used_total, devices_used);
    // Checked on the devices' budgets too, in case the host one stopped counting.
    let most = *HOST_LIMITS.iter().max().unwrap();
    assert!(
        devices_used <= most,
        "devices use {devices_used} over a host limit of at most {most}"
    );
    assert!(
        ps.mem_used_max <= most,
        "host use reached {} over a limit of at most {most}",
        ps.mem_used_max
    );
    for d in &devs {
        d.discard(cx, 0..CSLOTS).unwrap();
    }
    assert_eq!(pool.stats().mem_used_total, 0);
    assert_eq!(devs[0].backing().map_or(0, |b| b.used()), 0);
}

#[test]
fn concurrent_owners_keep_their_pages_lz4_zstd() {
    concurrent([Codec::Lz4, Codec::Zstd { level: 1 }], false);
}

#[test]
fn concurrent_owners_keep_their_pages_zstd_lz4() {
    concurrent([Codec::Zstd { level: 1 }, Codec::Lz4], false);
}

#[test]
fn concurrent_owners_keep_their_pages_while_tiering() {
    concurrent([Codec::Lz4, Codec::Zstd { level: 1 }], true);
}
