//! Model-based tests. Random operation sequences run against two devices
//! that share one pool (device and host limits) and against plain copies in
//! memory. After every step the content, the limits and the statistics are
//! checked against the copies. A concurrent variant checks that every slot
//! ends holding what its owner thread last wrote successfully.
//! `PROPTEST_CASES` sets the number of sequences per codec.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use proptest::prelude::*;
use vzram_store::encode_fill;
use vzram_store::{
    Codec, Context, Device, DeviceConfig, Page, Pool, PoolConfig, StoreError, PAGE_SIZE,
};

const P: u64 = PAGE_SIZE as u64;
/// Different sizes, so a slot mixed up between the devices shows.
const SLOTS: [u64; 2] = [64, 40];
/// A write allocates at most one span, and a span has at most 8 pages.
const MAX_SPAN: u64 = 8 * P;

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

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
}

struct Harness {
    pool: Arc<Pool>,
    devs: [Arc<Device>; 2],
    /// Steps alternate between two contexts, so device 0 (two shards)
    /// frees objects from the other shard's spans too.
    cx: [Context; 2],
    /// What each slot must read as; None reads as zeros and holds nothing.
    pages: [Vec<Option<Box<Page>>>; 2],
    /// Slots whose last whole write was noise: certainly stored raw.
    noise: [Vec<bool>; 2],
    io: [Io; 2],
    limits: [u64; 2],
    host_limit: u64,
    /// Highest use seen so far, per device and for the pool.
    max_seen: [u64; 3],
    compacted: u64,
}

/// Memory use: device 0, device 1, and the host budget.
type Usage = [u64; 3];

impl Harness {
    fn new(codec: Codec, limits: [u64; 2], host_limit: u64) -> Harness {
        let pool = Pool::new(PoolConfig {
            host_mem_limit: host_limit * P,
            arena_bytes: 1 << 30,
        })
        .unwrap();
        let mk = |d: usize, shards| {
            let mut cfg = DeviceConfig::new(SLOTS[d] * P, codec);
            cfg.mem_limit = limits[d] * P;
            cfg.shards = shards;
            pool.create_device(cfg).unwrap()
        };
        let devs = [mk(0, 2), mk(1, 1)];
        Harness {
            pages: SLOTS.map(|n| (0..n).map(|_| None).collect()),
            noise: SLOTS.map(|n| vec![false; n as usize]),
            io: Default::default(),
            limits: limits.map(|l| l * P),
            host_limit: host_limit * P,
            max_seen: [0; 3],
            compacted: 0,
            pool,
            devs,
            cx: [Context::new(0), Context::new(1)],
        }
    }

    fn usage(&self) -> Usage {
        [
            self.devs[0].stats().mem_used_total,
            self.devs[1].stats().mem_used_total,
            self.pool.stats().mem_used_total,
        ]
    }

    fn set(&mut self, dev: usize, slot: u64, page: Option<Box<Page>>, noise: bool) {
        self.noise[dev][slot as usize] = noise && page.is_some();
        self.pages[dev][slot as usize] = page;
    }

    fn current(&self, dev: usize, slot: u64) -> Box<Page> {
        self.pages[dev][slot as usize]
            .clone()
            .unwrap_or_else(|| Box::new([0; PAGE_SIZE]))
    }

    fn read_check(&mut self, dev: usize, slot: u64) -> Result<(), TestCaseError> {
        let mut buf = [0xa5u8; PAGE_SIZE];
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
        let want = self.current(dev, slot);
        prop_assert!(buf == *want, "device {} slot {} differs", dev, slot);
        Ok(())
    }

    fn read_all(&mut self) -> Result<(), TestCaseError> {
        for (dev, &n) in SLOTS.iter().enumerate() {
            for slot in 0..n {
                self.read_check(dev, slot)?;
            }
        }
        Ok(())
    }

    /// Judges the outcome of a write (whole, partial or zeroing) that would
    /// leave `new` in the slot, and applies it to the model if it succeeded.
    /// A limit error is only acceptable when that limit is set, the new
    /// content needs memory, and the largest span might not fit under it.
    /// Returns whether the write was refused.
    fn judge_write(
        &mut self,
        dev: usize,
        slot: u64,
        r: Result<(), StoreError>,
        new: Option<Box<Page>>,
        noise: bool,
        before: Usage,
    ) -> Result<bool, TestCaseError> {
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
            return Ok(true);
        }
        let refused = r.is_err();
        let needs_memory = new.as_deref().is_some_and(|p| !kept_as_fill(p));
        let might_not_fit = |used: u64, limit: u64| limit != 0 && used + MAX_SPAN > limit;
        match r {
            Ok(()) => self.set(dev, slot, new, noise),
            Err(StoreError::DeviceLimit) => prop_assert!(
                needs_memory && might_not_fit(before[dev], self.limits[dev]),
                "device {dev} slot {slot}: DeviceLimit with limit {} used {} needs memory {needs_memory}",
                self.limits[dev],
                before[dev]
            ),
            Err(StoreError::HostLimit) => prop_assert!(
                needs_memory && might_not_fit(before[2], self.host_limit),
                "device {dev} slot {slot}: HostLimit with limit {} used {} needs memory {needs_memory}",
                self.host_limit,
                before[2]
            ),
            Err(e) => prop_assert!(false, "device {dev} slot {slot}: {e}"),
        }
        Ok(refused)
    }

    fn step(&mut self, op: &Op, step: usize) -> Result<(), TestCaseError> {
        let before = self.usage();
        // Slots whose content this step may have changed; read back on both devices.
        let mut touched = 0..0;
        let mut read_everything = false;
        // Set when the store must have refused the operation and changed nothing.
        let mut refused = false;
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
                refused = self.judge_write(dev, slot, r, Some(p), noise, before)?;
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
                    refused = true;
                } else {
                    let new = (slot < SLOTS[dev]).then(|| {
                        let mut p = self.current(dev, slot);
                        p[offset..offset + len].copy_from_slice(&data[..len]);
                        p
                    });
                    // A page left all zeros frees the slot.
                    let new = new.filter(|p| p.iter().any(|&b| b != 0));
                    refused = self.judge_write(dev, slot, r, new, false, before)?;
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
                    refused = true;
                } else if len == PAGE_SIZE {
                    // A whole page is a discard.
                    if slot < SLOTS[dev] {
                        prop_assert_eq!(r, Ok(()));
                        self.set(dev, slot, None, false);
                        self.io[dev].discards += 1;
                    } else {
                        prop_assert!(matches!(r, Err(StoreError::OutOfRange { .. })), "{r:?}");
                        refused = true;
                    }
                } else {
                    let new = (slot < SLOTS[dev]).then(|| {
                        let mut p = self.current(dev, slot);
                        p[offset..offset + len].fill(0);
                        p
                    });
                    let new = new.filter(|p| p.iter().any(|&b| b != 0));
                    let noise = self.noise[dev].get(slot as usize) == Some(&true) && len == 0;
                    refused = self.judge_write(dev, slot, r, new, noise, before)?;
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
                    refused = true;
                } else {
                    prop_assert_eq!(r, Ok(()));
                    for s in start..end {
                        self.set(dev, s, None, false);
                    }
                    self.io[dev].discards += end - start;
                }
                touched = start.min(end)..start.max(end);
            }
            Op::Thin { dev, stride, phase } => {
                for s in (phase % stride..SLOTS[dev]).step_by(stride as usize) {
                    let r = self.devs[dev].discard(&mut self.cx[step % 2], s..s + 1);
                    prop_assert_eq!(r, Ok(()));
                    self.set(dev, s, None, false);
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
        }
        if refused {
            prop_assert_eq!(
                self.usage(),
                before,
                "a refused {:?} changed memory use",
                op
            );
        }
        self.check_stats(before)?;
        if read_everything || step % 32 == 31 {
            self.read_all()?;
        } else {
            for slot in touched {
                for (dev, &slots) in SLOTS.iter().enumerate() {
                    if slot < slots {
                        self.read_check(dev, slot)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Statistics against the model, and limits against memory use.
    fn check_stats(&mut self, before: Usage) -> Result<(), TestCaseError> {
        let ds = [self.devs[0].stats(), self.devs[1].stats()];
        let ps = self.pool.stats();
        for (dev, s) in ds.iter().enumerate() {
            let stored = self.pages[dev].iter().flatten().count() as u64;
            let fills = self.pages[dev]
                .iter()
                .flatten()
                .filter(|p| kept_as_fill(p))
                .count() as u64;
            let objects = stored - fills;
            let raw = self.noise[dev].iter().filter(|&&n| n).count() as u64;
            let used = s.mem_used_total;
            prop_assert_eq!(s.orig_data_size, stored * P, "device {} stored pages", dev);
            prop_assert_eq!(s.same_pages, fills, "device {} same pages", dev);
            prop_assert!(
                (raw..=objects).contains(&s.huge_pages),
                "device {dev}: {} huge pages, {raw} noise of {objects} objects",
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
            };
            prop_assert_eq!(&io, &self.io[dev], "device {} io counters", dev);
        }
        let devices_used = ds[0].mem_used_total + ds[1].mem_used_total;
        prop_assert_eq!(ps.mem_used_total, devices_used, "host budget vs devices");
        prop_assert_eq!(ps.mem_limit, self.host_limit);
        prop_assert_eq!(
            ps.orig_data_size,
            ds[0].orig_data_size + ds[1].orig_data_size
        );
        prop_assert_eq!(ps.pages_compacted, self.compacted);
        self.max_seen[2] = self.max_seen[2].max(ps.mem_used_total);
        prop_assert!(ps.mem_used_max >= self.max_seen[2], "{ps:?}");
        // Lowering a limit evicts nothing, so use may sit above a limit; it
        // must never grow while it does. The device sum is checked on its own
        // so a host budget that stopped counting shows too.
        let after = [
            ds[0].mem_used_total,
            ds[1].mem_used_total,
            ps.mem_used_total,
        ];
        let limits = [self.limits[0], self.limits[1], self.host_limit];
        let before_devices = before[0] + before[1];
        for (i, name) in ["device 0", "device 1", "host"].iter().enumerate() {
            if limits[i] != 0 && after[i] > limits[i] {
                prop_assert!(
                    after[i] <= before[i],
                    "{name} grew past its limit {}: {} -> {}",
                    limits[i],
                    before[i],
                    after[i]
                );
            }
        }
        if self.host_limit != 0 && devices_used > self.host_limit {
            prop_assert!(
                devices_used <= before_devices,
                "devices grew past the host limit {}: {before_devices} -> {devices_used}",
                self.host_limit
            );
        }
        Ok(())
    }

    /// Reads everything, then discards everything: the pool must be empty.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        self.read_all()?;
        for (dev, &n) in SLOTS.iter().enumerate() {
            prop_assert_eq!(self.devs[dev].discard(&mut self.cx[0], 0..n), Ok(()));
            for s in 0..n {
                self.set(dev, s, None, false);
            }
            self.io[dev].discards += n;
        }
        let before = self.usage();
        self.check_stats(before)?;
        prop_assert_eq!(self.usage(), [0, 0, 0]);
        for s in [self.devs[0].stats(), self.devs[1].stats()] {
            prop_assert_eq!((s.compr_data_size, s.same_pages, s.huge_pages), (0, 0, 0));
        }
        self.read_all()
    }
}

fn run(codec: Codec, init: (u64, u64, u64), ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut h = Harness::new(codec, [init.0, init.1], init.2);
    for (step, op) in ops.iter().enumerate() {
        h.step(op, step)?;
    }
    h.finish()
}

fn case() -> impl Strategy<Value = ((u64, u64, u64), Vec<Op>)> {
    (
        (limit_pages(), limit_pages(), limit_pages()),
        prop::collection::vec(op(), 1..300),
    )
}

proptest! {
    // No config override: ProptestConfig::default() reads PROPTEST_CASES.

    #[test]
    fn lz4_matches_model((init, ops) in case()) {
        run(Codec::Lz4, init, ops)?;
    }

    #[test]
    fn zstd_matches_model((init, ops) in case()) {
        run(Codec::Zstd { level: 3 }, init, ops)?;
    }
}

// The concurrent variant. Each writer thread owns the slots `s` with
// `s % WRITERS == t` on both devices and is the only one to change them, so
// it knows what each must read as; it reads other threads' slots too, where
// any whole page of that device and slot is fine. Beside them, one thread
// compacts and moves the limits.

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

fn concurrent(codecs: [Codec; 2]) {
    let pool = Pool::new(PoolConfig {
        host_mem_limit: HOST_LIMITS[0],
        arena_bytes: 1 << 30,
    })
    .unwrap();
    let devs: Vec<_> = codecs
        .iter()
        .map(|&c| {
            let mut cfg = DeviceConfig::new(CSLOTS * P, c);
            cfg.shards = 2;
            pool.create_device(cfg).unwrap()
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
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
                                Err(StoreError::DeviceLimit) if d == 0 => {}
                                Err(StoreError::HostLimit) => {}
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
        "{codecs:?}: {rounds} compaction/limit rounds, {} pages compacted, host max {}",
        ps.pages_compacted, ps.mem_used_max
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
}

#[test]
fn concurrent_owners_keep_their_pages_lz4_zstd() {
    concurrent([Codec::Lz4, Codec::Zstd { level: 1 }]);
}

#[test]
fn concurrent_owners_keep_their_pages_zstd_lz4() {
    concurrent([Codec::Zstd { level: 1 }, Codec::Lz4]);
}
