//! A soak over the real socket with data that says where it came from.
//!
//! Four queues, each with [`QD`] requests in flight, write and read single
//! pages of one device and discard runs of one to four, half of them in a
//! small hot set that every queue hits at once, so the same page is often
//! being written by several queues (and twice by one queue) at the same
//! moment. Every page written carries its sector, its writer and a unique
//! version, and a body derived from them in one of many shapes
//! (same-filled, incompressible, and compressible to every degree in
//! between, so most size classes are used): a page that is torn,
//! misplaced, stale or never written is recognised.
//!
//! Meanwhile a control thread compacts the device (`vzram compact` and the
//! control socket), squeezes and lifts the device and host memory limits
//! (`vzram set-limit` and the control socket) so that some writes fail, and
//! every other round the frontend drops its connection with requests in
//! flight and connects again. After every round, half the device is filled
//! with pages of one size and three in four are discarded again, and a
//! compaction runs with nothing else going on: it must give pages back,
//! which it can only do by moving objects (under load, evacuated spans
//! also empty by themselves). Then each page is read back.
//!
//! # What a read may return
//!
//! Every request gets a number from one global sequence when it is
//! submitted (before the device can see it) and when its completion is
//! seen (after the device finished it), so `a.done < b.submit` means `a`
//! really ended before `b` began. A read that began at `rs` and ended at
//! `rc` may return the content of a write or discard `W` unless
//!
//! - `W` failed (IOERR: a failed single-page write is not applied), or
//! - `W` was submitted after the read ended (`W.submit > rc`), or
//! - `W` is *fenced off*: some write `W2` with other content started after
//!   `W` ended (`W.done < W2.submit`) and was known applied before the read
//!   began (acknowledged, or seen by an earlier read, before `rs`). A read
//!   that returned `X` is such a fence too, at its own `rs`, for everything
//!   that ended before it began except `X`: once a reader saw `X`, what was
//!   overwritten by `X` never comes back.
//!
//! That is linearizability of each page as a register, checked one read at
//! a time. Writes whose connection was dropped before they completed have
//! an unknown outcome: they may or may not be applied, but they are over
//! (`done`) once the next connection is up, since the daemon serves one
//! connection of a device at a time and finishes the old one's requests
//! first. A stale request landing after the reconnect is caught.
//!
//! `VZRAM_SOAK_SECS` makes it run longer (default 8 s of load);
//! `VZRAM_SOAK_SEED` fixes the random choices (the interleaving is the
//! scheduler's).

use std::mem::MaybeUninit;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use blkio::{Completion, ReqFlags};
use vzram_tests::*;

/// Device pages (8 MiB).
const PAGES: u64 = 2048;
/// Pages that half of all requests go to, from every queue at once.
const HOT: u64 = 16;
const QUEUES: usize = 4;
/// Requests in flight per queue.
const QD: usize = 8;
/// Rounds of load (each followed by a full read-back), at least.
const MIN_ROUNDS: usize = 4;
/// Requests each queue completes per round, at least, however slow.
const MIN_OPS: u64 = 1500;
/// Seconds of load in all (`VZRAM_SOAK_SECS`), in rounds of [`ROUND`].
const DEFAULT_SECS: u64 = 8;
/// How long each round's load lasts (and then until every queue
/// completed [`MIN_OPS`]).
const ROUND: Duration = Duration::from_secs(2);
/// Completed requests between two control actions.
const CONTROL_STEP: u64 = 250;
const DEV: &str = "soak";
const NEVER: u64 = u64::MAX;
const IO_TIMEOUT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------
// Pages that identify themselves.

const MAGIC: u32 = 0x4b41_4f53; // "SOAK"
/// Same-filled pages: bit 54 set, then sector (16 bits), writer (7 bits)
/// and version (31 bits). Fits the store's 56-bit fill encoding.
const SAME_TAG: u64 = 1 << 54;
/// Writers from this id on are the fragmenter's, whose pages all have one
/// shape (so they share a size class or two): [`FRAG_RANDOM`] random chunks.
const FRAG_WRITER: u64 = 64;
const FRAG_RANDOM: u64 = 8;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Stamp {
    sector: u64,
    writer: u64,
    version: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Shape {
    /// One 8-byte value repeated: the store keeps only the value.
    Same,
    /// Header, then 64-byte chunks of which `n` in 64 are random and the
    /// rest one repeated word: compresses to anything from tiny to huge.
    Mixed(u64),
    /// Header, then exactly this many random 64-byte chunks and one word
    /// repeated: compresses to nearly the same size every time.
    Exact(u64),
    /// Header and noise: stored raw.
    Noise,
}

impl Stamp {
    fn hash(&self) -> u64 {
        mix(self.sector ^ mix(self.writer ^ mix(self.version)))
    }

    fn shape(&self) -> Shape {
        if self.writer >= FRAG_WRITER {
            return Shape::Exact(FRAG_RANDOM);
        }
        let h = self.hash();
        match h % 16 {
            0 => Shape::Same,
            1 => Shape::Noise,
            _ => Shape::Mixed((h >> 8) % 64),
        }
    }

    fn same_value(&self) -> u64 {
        SAME_TAG | (self.sector << 38) | (self.writer << 31) | self.version
    }

    fn from_same_value(v: u64) -> Option<Stamp> {
        (v >> 54 == 1).then_some(Stamp {
            sector: (v >> 38) & 0xffff,
            writer: (v >> 31) & 0x7f,
            version: v & 0x7fff_ffff,
        })
    }

    /// The page this stamp stands for.
    fn fill(&self, out: &mut [u8]) {
        assert!(self.sector < 1 << 16 && self.writer < 1 << 7 && self.version < 1 << 31);
        let out = &mut out[..PAGE];
        let shape = self.shape();
        if shape == Shape::Same {
            let v = self.same_value().to_le_bytes();
            out.chunks_exact_mut(8).for_each(|c| c.copy_from_slice(&v));
            return;
        }
        let mut rng = Rng::new(self.hash());
        let word = rng.next_u64().to_le_bytes();
        for (i, chunk) in out.chunks_exact_mut(64).enumerate() {
            let random = match shape {
                Shape::Mixed(n) => rng.below(64) < n,
                Shape::Exact(n) => (i as u64) < n,
                _ => true,
            };
            if random {
                chunk
                    .chunks_exact_mut(8)
                    .for_each(|c| c.copy_from_slice(&rng.next_u64().to_le_bytes()));
            } else {
                chunk
                    .chunks_exact_mut(8)
                    .for_each(|c| c.copy_from_slice(&word));
            }
        }
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&(self.sector as u32).to_le_bytes());
        out[8..16].copy_from_slice(&self.writer.to_le_bytes());
        out[16..24].copy_from_slice(&self.version.to_le_bytes());
    }

    fn page(&self) -> Vec<u8> {
        let mut v = vec![0; PAGE];
        self.fill(&mut v);
        v
    }
}

/// What a page read back looks like.
#[derive(Debug)]
enum Seen {
    Zero,
    /// A whole page of this stamp.
    Page(Stamp),
    /// It names this stamp but is not that page: torn or corrupt.
    Torn(Stamp),
    /// Nothing we write.
    Garbage,
}

fn word(p: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(p[i * 8..i * 8 + 8].try_into().unwrap())
}

fn decode(p: &[u8]) -> Seen {
    if p.iter().all(|&b| b == 0) {
        return Seen::Zero;
    }
    let first = word(p, 0);
    let claimed = if (0..PAGE / 8).all(|i| word(p, i) == first) {
        Stamp::from_same_value(first)
    } else if u32::from_le_bytes(p[0..4].try_into().unwrap()) == MAGIC {
        Some(Stamp {
            sector: u64::from(u32::from_le_bytes(p[4..8].try_into().unwrap())),
            writer: word(p, 1),
            version: word(p, 2),
        })
    } else {
        None
    };
    match claimed {
        None => Seen::Garbage,
        Some(s) if s.sector >= 1 << 16 || s.writer >= 1 << 7 || s.version >= 1 << 31 => {
            Seen::Garbage
        }
        Some(s) if s.page() == p => Seen::Page(s),
        Some(s) => Seen::Torn(s),
    }
}

// ---------------------------------------------------------------------------
// The history of every page.

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Val {
    Zero,
    Data(Stamp),
}

#[derive(Clone, Debug)]
struct Op {
    val: Val,
    submit: u64,
    /// When it was known to be over: acknowledged, failed, seen by a read,
    /// or its connection replaced. NEVER while in flight.
    done: u64,
    failed: bool,
    /// Its connection was dropped before it completed.
    unknown: bool,
    /// The first read that saw it ended here (NEVER: none).
    seen: u64,
}

/// By `at`, everything that ended before `s` and holds other content
/// than `keep` is overwritten for good.
#[derive(Clone, Copy, Debug)]
struct Fence {
    s: u64,
    at: u64,
    keep: Val,
}

struct PageLog {
    ops: Vec<Op>,
    fences: Vec<Fence>,
}

impl PageLog {
    fn new() -> PageLog {
        PageLog {
            ops: vec![Op {
                val: Val::Zero,
                submit: 0,
                done: 0,
                failed: false,
                unknown: false,
                seen: NEVER,
            }],
            fences: vec![Fence {
                s: 0,
                at: 0,
                keep: Val::Zero,
            }],
        }
    }

    /// The fence reaching furthest among those in place before `rs`, and
    /// the furthest of those keeping other content than that one.
    fn top_fences(&self, rs: u64) -> (Option<Fence>, Option<Fence>) {
        let best = |skip: Option<Val>| {
            self.fences
                .iter()
                .filter(|f| f.at < rs && Some(f.keep) != skip)
                .max_by_key(|f| f.s)
                .copied()
        };
        let f1 = best(None);
        (f1, f1.and_then(|f| best(Some(f.keep))))
    }

    fn fenced(op: &Op, f: (Option<Fence>, Option<Fence>)) -> Option<Fence> {
        let (f1, f2) = f;
        let f = if f1.is_some_and(|f1| f1.keep != op.val) {
            f1
        } else {
            f2
        };
        f.filter(|f| op.done < f.s)
    }

    /// Checks a read that began at `rs`, ended at `rc` and returned `p`,
    /// and records what it saw.
    fn check_read(&mut self, sector: u64, rs: u64, rc: u64, p: &[u8]) -> Result<(), String> {
        let val = match decode(p) {
            Seen::Zero => Val::Zero,
            Seen::Page(s) if s.sector == sector => Val::Data(s),
            Seen::Page(s) => return Err(format!("holds another sector's page: {s:?}")),
            Seen::Torn(s) => return Err(format!("torn or corrupt page claiming {s:?}")),
            Seen::Garbage => {
                return Err(format!("garbage, starting {:02x?}", &p[..32.min(p.len())]))
            }
        };
        let f = self.top_fences(rs);
        let ok: Vec<usize> = (0..self.ops.len())
            .filter(|&i| {
                let o = &self.ops[i];
                o.val == val && !o.failed && o.submit < rc && PageLog::fenced(o, f).is_none()
            })
            .collect();
        if ok.is_empty() {
            return Err(self.explain(val, rs, rc, f));
        }
        if let (Val::Data(_), &[i]) = (val, &ok[..]) {
            let o = &mut self.ops[i];
            o.done = o.done.min(rc);
            o.seen = o.seen.min(rc);
        }
        self.fences.push(Fence {
            s: rs,
            at: rc,
            keep: val,
        });
        Ok(())
    }

    fn explain(&self, val: Val, rs: u64, rc: u64, f: (Option<Fence>, Option<Fence>)) -> String {
        let mut why = format!("read [{rs}, {rc}] returned {val:?}, which it may not: ");
        let same: Vec<&Op> = self.ops.iter().filter(|o| o.val == val).collect();
        if same.is_empty() {
            why += "no such write was ever made to this sector (or it was pruned as overwritten)";
        }
        for o in same {
            if o.failed {
                why += &format!("a write that FAILED (IOERR) {o:?}; ");
            } else if o.submit >= rc {
                why += &format!("submitted only after the read ended {o:?}; ");
            } else if let Some(fence) = PageLog::fenced(o, f) {
                why +=
                    &format!("STALE: {o:?} was overwritten by {fence:?} before the read began; ");
            }
        }
        why += &format!("\nhistory: {:#?}", self.ops);
        why
    }

    /// Forgets what no later read may return (every request is over and
    /// every later read begins after every fence).
    fn prune(&mut self) {
        let f = self.top_fences(NEVER);
        self.ops
            .retain(|o| !o.failed && PageLog::fenced(o, f).is_none());
        self.fences = [f.0, f.1].into_iter().flatten().collect();
    }
}

// ---------------------------------------------------------------------------
// The load.

#[derive(Default)]
struct Counts {
    writes_ok: AtomicU64,
    writes_failed: AtomicU64,
    writes_unknown: AtomicU64,
    reads: AtomicU64,
    discards: AtomicU64,
}

struct Shared {
    seq: AtomicU64,
    version: AtomicU64,
    log: Mutex<Vec<PageLog>>,
    /// Ends the current phase.
    stop: AtomicBool,
    /// Queues that did their share of the current phase.
    ready: AtomicUsize,
    /// Ends the control thread.
    end: AtomicBool,
    /// Some thread panicked: everyone stops.
    failed: AtomicBool,
    /// Completed requests, to pace the control thread.
    progress: AtomicU64,
    /// Held by the control thread while it acts; taken to hold it off.
    gate: Mutex<()>,
    counts: Counts,
    seed: u64,
}

impl Shared {
    fn seq(&self) -> u64 {
        self.seq.fetch_add(1, SeqCst)
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Vec<PageLog>> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Sets `failed` when the thread holding it panics, so the others stop.
struct PanicFlag<'a>(&'a AtomicBool);

impl Drop for PanicFlag<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, SeqCst);
        }
    }
}

#[derive(Clone, Debug)]
enum Req {
    Free,
    Write { page: u64, op: usize },
    Discard { first: u64, ops: Vec<usize> },
    Read { page: u64, rs: u64 },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Writes, reads and discards until told to stop; then wait for all.
    Load,
    /// The same, but stop with requests in flight (the connection drops).
    LoadThenDrop,
    /// Read back this queue's share of the pages, no other I/O running.
    Scan,
    /// Fill this queue's share of the upper half of the device with pages
    /// of one shape, no other I/O running...
    Fill,
    /// ...and discard three in four of them again: sparse spans.
    Punch,
}

struct Worker<'a> {
    q: &'a mut Queue,
    qi: usize,
    sh: &'a Shared,
    slots: Vec<Req>,
    inflight: usize,
    completed: u64,
}

impl Worker<'_> {
    fn buf(&mut self, slot: usize) -> *mut u8 {
        assert!((slot + 1) * PAGE <= QUEUE_BUF);
        // SAFETY: slot `slot` of this queue's own buffer, inside it (checked).
        unsafe { self.q.buf_ptr().add(slot * PAGE) }
    }

    fn slot_bytes(&mut self, slot: usize) -> &mut [u8] {
        let p = self.buf(slot);
        // SAFETY: as in `buf`; the slot is not in flight while we touch it.
        unsafe { std::slice::from_raw_parts_mut(p, PAGE) }
    }

    fn submit_read(&mut self, slot: usize, page: u64) {
        self.slot_bytes(slot).fill(0xa5);
        let rs = self.sh.seq();
        let buf = self.buf(slot);
        self.q
            .raw()
            .read(page * PAGE as u64, buf, PAGE, slot, ReqFlags::empty());
        self.slots[slot] = Req::Read { page, rs };
        self.inflight += 1;
    }

    fn submit_write(&mut self, slot: usize, page: u64, writer: u64) {
        let stamp = Stamp {
            sector: page,
            writer,
            version: self.sh.version.fetch_add(1, SeqCst),
        };
        stamp.fill(self.slot_bytes(slot));
        let op = {
            let mut log = self.sh.log();
            let pl = &mut log[page as usize];
            pl.ops.push(Op {
                val: Val::Data(stamp),
                submit: self.sh.seq(),
                done: NEVER,
                failed: false,
                unknown: false,
                seen: NEVER,
            });
            pl.ops.len() - 1
        };
        let buf = self.buf(slot);
        self.q
            .raw()
            .write(page * PAGE as u64, buf, PAGE, slot, ReqFlags::empty());
        self.slots[slot] = Req::Write { page, op };
        self.inflight += 1;
    }

    fn submit_discard(&mut self, slot: usize, first: u64, n: u64) {
        let ops = {
            let mut log = self.sh.log();
            let s = self.sh.seq();
            (first..first + n)
                .map(|p| {
                    let pl = &mut log[p as usize];
                    pl.ops.push(Op {
                        val: Val::Zero,
                        submit: s,
                        done: NEVER,
                        failed: false,
                        unknown: false,
                        seen: NEVER,
                    });
                    pl.ops.len() - 1
                })
                .collect()
        };
        self.q.raw().discard(
            first * PAGE as u64,
            n * PAGE as u64,
            slot,
            ReqFlags::empty(),
        );
        self.slots[slot] = Req::Discard { first, ops };
        self.inflight += 1;
    }

    fn submit_random(&mut self, slot: usize, rng: &mut Rng) {
        let page = if rng.below(2) == 0 {
            rng.below(HOT)
        } else {
            rng.below(PAGES)
        };
        match rng.below(20) {
            0..=12 => self.submit_write(slot, page, self.qi as u64),
            13..=17 => self.submit_read(slot, page),
            _ => {
                let n = (1 + rng.below(4)).min(PAGES - page);
                self.submit_discard(slot, page, n)
            }
        }
    }

    fn complete(&mut self, slot: usize, ret: i32) {
        let req = std::mem::replace(&mut self.slots[slot], Req::Free);
        self.inflight -= 1;
        self.completed += 1;
        self.sh.progress.fetch_add(1, SeqCst);
        let sh = self.sh;
        let seed = sh.seed;
        match req {
            Req::Free => panic!("completion for free slot {slot}"),
            Req::Read { page, rs } => {
                assert_eq!(ret, 0, "read of page {page} failed: {ret} (seed {seed})");
                let rc = sh.seq();
                let p = self.slot_bytes(slot).to_vec();
                let mut log = sh.log();
                if let Err(e) = log[page as usize].check_read(page, rs, rc, &p) {
                    sh.failed.store(true, SeqCst);
                    panic!("queue {}: page {page}: {e}\n(seed {seed})", self.qi);
                }
                sh.counts.reads.fetch_add(1, SeqCst);
            }
            Req::Write { page, op } => {
                let mut log = sh.log();
                let at = sh.seq();
                let pl = &mut log[page as usize];
                let o = &mut pl.ops[op];
                match ret {
                    0 => {
                        o.done = o.done.min(at);
                        let f = Fence {
                            s: o.submit,
                            at,
                            keep: o.val,
                        };
                        pl.fences.push(f);
                        sh.counts.writes_ok.fetch_add(1, SeqCst);
                    }
                    e if e == -libc::EIO => {
                        let o = o.clone();
                        assert!(
                            o.seen == NEVER,
                            "page {page}: a write failed (IOERR) but a read had already \
                             returned its data: {o:?} (seed {seed})"
                        );
                        let o = &mut pl.ops[op];
                        o.failed = true;
                        o.done = at;
                        sh.counts.writes_failed.fetch_add(1, SeqCst);
                    }
                    e => panic!("write of page {page}: status {e}, not OK or IOERR (seed {seed})"),
                }
            }
            Req::Discard { first, ops } => {
                assert_eq!(
                    ret, 0,
                    "discard at page {first} failed: {ret} (seed {seed})"
                );
                let mut log = sh.log();
                let at = sh.seq();
                for (i, op) in ops.into_iter().enumerate() {
                    let pl = &mut log[first as usize + i];
                    let o = &mut pl.ops[op];
                    o.done = o.done.min(at);
                    let f = Fence {
                        s: o.submit,
                        at,
                        keep: Val::Zero,
                    };
                    pl.fences.push(f);
                }
                sh.counts.discards.fetch_add(1, SeqCst);
            }
        }
    }

    /// Waits for at least `min` completions (0: takes what is there, and
    /// makes sure everything queued has reached the device).
    fn reap(&mut self, min: usize) {
        let mut done: [MaybeUninit<Completion>; QD] =
            std::array::from_fn(|_| MaybeUninit::uninit());
        let mut timeout = IO_TIMEOUT;
        let n = self
            .q
            .raw()
            .do_io(&mut done, min, Some(&mut timeout), None)
            .expect("blkio do_io");
        assert!(n >= min, "no completion within {IO_TIMEOUT:?}");
        for c in &done[..n] {
            // SAFETY: do_io filled in the first n completions.
            let c = unsafe { c.assume_init_read() };
            self.complete(c.user_data, c.ret);
        }
    }

    fn run(mut self, phase: Phase, rng: &mut Rng) -> Vec<Req> {
        let _flag = PanicFlag(&self.sh.failed);
        if let Phase::Scan | Phase::Fill | Phase::Punch = phase {
            let mine: Vec<u64> = match phase {
                Phase::Fill => (PAGES / 2..PAGES).collect(),
                Phase::Punch => (PAGES / 2..PAGES).filter(|p| p % 16 >= 4).collect(),
                _ => (0..PAGES).collect(),
            };
            let qi = self.qi;
            let mut next = mine.into_iter().filter(|p| *p as usize % QUEUES == qi);
            loop {
                while self.inflight < QD {
                    let Some(page) = next.next() else { break };
                    let slot = self.slots.iter().position(|r| matches!(r, Req::Free));
                    match phase {
                        Phase::Fill => {
                            let writer = FRAG_WRITER + self.qi as u64;
                            self.submit_write(slot.unwrap(), page, writer)
                        }
                        Phase::Punch => self.submit_discard(slot.unwrap(), page, 1),
                        _ => self.submit_read(slot.unwrap(), page),
                    }
                }
                if self.inflight == 0 {
                    return Vec::new();
                }
                self.reap(1);
            }
        }
        let mut counted = false;
        loop {
            if self.sh.stop.load(SeqCst) || self.sh.failed.load(SeqCst) {
                break;
            }
            for slot in 0..QD {
                if matches!(self.slots[slot], Req::Free) {
                    self.submit_random(slot, rng);
                }
            }
            self.reap(1);
            if !counted && self.completed >= MIN_OPS {
                counted = true;
                self.sh.ready.fetch_add(1, SeqCst);
            }
        }
        if phase == Phase::LoadThenDrop {
            // A full queue of new requests goes to the device (do_io kicks
            // it) and the connection drops before they are reaped.
            if !self.sh.failed.load(SeqCst) {
                for slot in 0..QD {
                    if matches!(self.slots[slot], Req::Free) {
                        self.submit_random(slot, rng);
                    }
                }
            }
            self.reap(0);
            return self
                .slots
                .into_iter()
                .filter(|r| !matches!(r, Req::Free))
                .collect();
        }
        while self.inflight > 0 {
            self.reap(1);
        }
        Vec::new()
    }
}

/// One phase on every queue at once; returns the requests left in flight.
fn phase(
    c: &mut Client,
    sh: &Shared,
    rngs: &mut [Rng],
    phase: Phase,
    length: Duration,
) -> Vec<Req> {
    sh.stop.store(false, SeqCst);
    sh.ready.store(0, SeqCst);
    let start = Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = c
            .queues
            .iter_mut()
            .zip(rngs.iter_mut())
            .enumerate()
            .map(|(qi, (q, rng))| {
                let w = Worker {
                    q,
                    qi,
                    sh,
                    slots: vec![Req::Free; QD],
                    inflight: 0,
                    completed: 0,
                };
                s.spawn(move || w.run(phase, rng))
            })
            .collect();
        if let Phase::Load | Phase::LoadThenDrop = phase {
            // Until every queue did its share and the time is up (or a
            // queue failed): polls, since it is a condition on the others.
            while !sh.failed.load(SeqCst)
                && (sh.ready.load(SeqCst) < QUEUES || start.elapsed() < length)
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            sh.stop.store(true, SeqCst);
        }
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// Drops the connection with `left` in flight and connects again; their
/// outcome is unknown, but settled once the new connection is up.
fn reconnect(c: Client, left: Vec<Req>, sock: &Path, d: &Daemon, sh: &Shared) -> Client {
    drop(c);
    let c = Client::connect_retrying(sock, QUEUES, d);
    let at = sh.seq();
    let mut log = sh.log();
    for r in left {
        let ops: Vec<(u64, usize)> = match r {
            Req::Write { page, op } => vec![(page, op)],
            Req::Discard { first, ops } => ops
                .into_iter()
                .enumerate()
                .map(|(i, op)| (first + i as u64, op))
                .collect(),
            _ => continue,
        };
        for (page, op) in ops {
            let o = &mut log[page as usize].ops[op];
            o.done = o.done.min(at);
            o.unknown = true;
            sh.counts.writes_unknown.fetch_add(1, SeqCst);
        }
    }
    c
}

// ---------------------------------------------------------------------------
// The control thread.

#[derive(Default, Debug)]
struct Control {
    compactions: u64,
    pages_compacted: u64,
    limit_changes: u64,
}

fn vzram(args: &[&str]) -> String {
    let o = Command::new(vzram_bin())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run vzram {args:?}: {e}"));
    assert!(
        o.status.success(),
        "vzram {args:?}: {}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// `compacted: N pages (...) given back`
fn cli_compacted(out: &str) -> u64 {
    out.strip_prefix("compacted: ")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected `vzram compact` output {out:?}"))
}

/// Three-quarters of what is in use now: new spans are refused until
/// discards and compaction free enough.
fn squeeze(used: u64) -> u64 {
    (used * 3 / 4 / 4096).max(1) * 4096
}

/// Every [`CONTROL_STEP`] completed requests, the next action of a cycle:
/// compact, squeeze the device limit, compact, lift it, squeeze the host
/// limit, compact, lift it.
fn control_thread(ctl: &Path, sh: &Shared) -> Control {
    let _flag = PanicFlag(&sh.failed);
    let c = ctl.to_str().unwrap();
    let mut r = Control::default();
    let mut last = 0;
    let mut step = 0u64;
    while !sh.end.load(SeqCst) && !sh.failed.load(SeqCst) {
        let now = sh.progress.load(SeqCst);
        if now < last + CONTROL_STEP {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        last = now;
        let _acting = sh.gate.lock().unwrap_or_else(|e| e.into_inner());
        match step % 7 {
            0 | 5 => {
                r.pages_compacted += cli_compacted(&vzram(&["compact", "--control", c]));
                r.compactions += 1;
            }
            2 => {
                let v: Compacted = request_at(ctl, json!({"cmd": "compact", "device": DEV}));
                r.pages_compacted += v.pages_compacted;
                r.compactions += 1;
            }
            1 => {
                let st = Stats(request_at(ctl, json!({"cmd": "stat"})));
                // What the pool holds can pass the device's size (size
                // classes, fragmentation), and a device limit above its
                // size is refused: at most the size.
                let lim = squeeze(st.devices()[0].stats.mem_used_total)
                    .min(PAGES * PAGE as u64)
                    .to_string();
                vzram(&["set-limit", "--control", c, "--device", DEV, &lim]);
                r.limit_changes += 1;
            }
            3 => {
                vzram(&["set-limit", "--control", c, "--device", DEV, "0"]);
                r.limit_changes += 1;
            }
            4 => {
                let st = Stats(request_at(ctl, json!({"cmd": "stat"})));
                let lim = squeeze(st.pool().mem_used_total);
                let v: HostLimitSet =
                    request_at(ctl, json!({"cmd": "set-limit", "host": true, "bytes": lim}));
                assert_eq!(v.host_mem_limit, lim, "{v:?}");
                r.limit_changes += 1;
            }
            _ => {
                vzram(&["set-limit", "--control", c, "--host", "0"]);
                r.limit_changes += 1;
            }
        }
        step += 1;
    }
    r
}

/// With the control thread held off and the limits lifted, fills half the
/// device with pages of one shape, discards three in four of them, and
/// compacts while nothing else runs: no page is freed during the
/// compaction, so whatever it gives back it gained by moving objects.
fn quiet_compaction(c: &mut Client, ctl: &Path, sh: &Shared, rngs: &mut [Rng]) -> u64 {
    let _quiet = sh.gate.lock().unwrap_or_else(|e| e.into_inner());
    let _: DeviceLimitSet = request_at(ctl, json!({"cmd": "set-limit", "device": DEV, "bytes": 0}));
    let _: HostLimitSet = request_at(ctl, json!({"cmd": "set-limit", "host": true, "bytes": 0}));
    phase(c, sh, rngs, Phase::Fill, Duration::ZERO);
    phase(c, sh, rngs, Phase::Punch, Duration::ZERO);
    let r: Compacted = request_at(ctl, json!({"cmd": "compact", "device": DEV}));
    r.pages_compacted
}

#[test]
fn versioned_pages_survive_overlapping_writers_compaction_limits_and_reconnects() {
    let secs = env_u64("VZRAM_SOAK_SECS").unwrap_or(DEFAULT_SECS);
    let seed = env_u64("VZRAM_SOAK_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    eprintln!("soak: seed {seed}, {secs} s of load (VZRAM_SOAK_SEED, VZRAM_SOAK_SECS)");
    let dir = TempDir::new("soak");
    let sock = dir.join("d.sock");
    let size = (PAGES * PAGE as u64).to_string();
    let d = Daemon::start(
        &dir,
        &[
            "--socket",
            sock.to_str().unwrap(),
            "--size",
            &size,
            "--queues",
            &QUEUES.to_string(),
            "--name",
            DEV,
        ],
        &[&sock],
    );
    let sh = Shared {
        seq: AtomicU64::new(1),
        version: AtomicU64::new(1),
        log: Mutex::new((0..PAGES).map(|_| PageLog::new()).collect()),
        stop: AtomicBool::new(false),
        ready: AtomicUsize::new(0),
        end: AtomicBool::new(false),
        failed: AtomicBool::new(false),
        progress: AtomicU64::new(0),
        gate: Mutex::new(()),
        counts: Counts::default(),
        seed,
    };
    let mut rngs: Vec<Rng> = (0..QUEUES as u64)
        .map(|i| Rng::new(seed ^ mix(i)))
        .collect();
    let mut client = Some(Client::connect_retrying(&sock, QUEUES, &d));
    let start = Instant::now();
    let mut rounds = 0;
    let mut reconnects = 0;
    let mut quiet = Vec::new();
    let ctl = std::thread::scope(|s| {
        let ctl = s.spawn(|| control_thread(&d.control, &sh));
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| loop {
            assert!(!sh.failed.load(SeqCst), "the control thread failed");
            let drop_it = rounds % 2 == 1;
            let p = if drop_it {
                Phase::LoadThenDrop
            } else {
                Phase::Load
            };
            let left = phase(client.as_mut().unwrap(), &sh, &mut rngs, p, ROUND);
            if drop_it {
                eprintln!(
                    "round {rounds}: reconnecting with {} requests in flight",
                    left.len()
                );
                client = Some(reconnect(client.take().unwrap(), left, &sock, &d, &sh));
                reconnects += 1;
            }
            let c = client.as_mut().unwrap();
            quiet.push(quiet_compaction(c, &d.control, &sh, &mut rngs));
            // The read-back sees what the compaction moved.
            phase(c, &sh, &mut rngs, Phase::Scan, ROUND);
            sh.log().iter_mut().for_each(PageLog::prune);
            rounds += 1;
            eprintln!(
                "round {rounds} checked at {:.1} s: {} writes ok, {} failed, {} unknown, {} reads, \
                 {} discards; quiet compaction gave back {} pages",
                start.elapsed().as_secs_f64(),
                sh.counts.writes_ok.load(SeqCst),
                sh.counts.writes_failed.load(SeqCst),
                sh.counts.writes_unknown.load(SeqCst),
                sh.counts.reads.load(SeqCst),
                sh.counts.discards.load(SeqCst),
                quiet.last().unwrap(),
            );
            if rounds >= MIN_ROUNDS && start.elapsed() >= Duration::from_secs(secs) {
                break;
            }
        }));
        sh.end.store(true, SeqCst);
        let ctl = ctl.join();
        if ctl.is_err() || run.is_err() {
            eprintln!("daemon log:\n{}", d.log_text());
        }
        // The control thread's own panic says more than "it failed".
        let ctl = ctl.unwrap_or_else(|e| std::panic::resume_unwind(e));
        if let Err(e) = run {
            std::panic::resume_unwind(e);
        }
        ctl
    });
    // Limits off, one last compaction, a fresh connection, a last read-back.
    let c = d.control.to_str().unwrap();
    vzram(&["set-limit", "--control", c, "--device", DEV, "0"]);
    vzram(&["set-limit", "--control", c, "--host", "0"]);
    let last = cli_compacted(&vzram(&["compact", "--control", c]));
    let mut client = reconnect(client.take().unwrap(), Vec::new(), &sock, &d, &sh);
    phase(&mut client, &sh, &mut rngs, Phase::Scan, ROUND);
    drop(client);

    let st = Stats::parse(
        serde_json::from_str(&vzram(&["stat", "--json", "--control", c])).expect("stat --json"),
    );
    let dev = &st.devices()[0].stats;
    let counts = &sh.counts;
    let (ok, failed, unknown) = (
        counts.writes_ok.load(SeqCst),
        counts.writes_failed.load(SeqCst),
        counts.writes_unknown.load(SeqCst),
    );
    eprintln!(
        "soak done in {:.1} s: {rounds} rounds, {reconnects} reconnects; writes {ok} ok, {failed} \
         IOERR, {unknown} page ops in flight at a disconnect; {} reads, {} discards; {ctl:?}, \
         quiet compactions {quiet:?}, {last} pages in the last one; device: pages_compacted {}, failed_writes {}, \
         same_pages {}, huge_pages {}, orig {} KiB, compr {} KiB",
        start.elapsed().as_secs_f64(),
        counts.reads.load(SeqCst),
        counts.discards.load(SeqCst),
        dev.pages_compacted,
        dev.failed_writes,
        dev.same_pages,
        dev.huge_pages,
        dev.orig_data_size / 1024,
        dev.compr_data_size / 1024,
    );
    assert!(
        reconnects >= 2 && unknown > 0,
        "no reconnect with requests in flight"
    );
    assert!(ctl.limit_changes >= 4, "limits hardly changed: {ctl:?}");
    assert!(failed > 0, "squeezed limits never made a write fail");
    // The daemon counts the failures we saw, and perhaps some of those
    // whose completion was lost with a connection, nothing else.
    assert!(
        dev.failed_writes >= failed && dev.failed_writes <= failed + unknown,
        "daemon failed_writes {} but clients saw {failed} (and {unknown} unknown)",
        dev.failed_writes
    );
    assert!(
        ctl.pages_compacted > 0,
        "{} compactions under load gave nothing back from a fragmented heap",
        ctl.compactions
    );
    // Under load, spans also empty by themselves while being evacuated;
    // only the quiet compactions show that objects were moved.
    assert!(
        quiet.iter().all(|&n| n > 0),
        "a compaction with nothing else running moved nothing out of freshly \
         fragmented spans: {quiet:?} pages given back"
    );
    assert!(
        dev.pages_compacted >= ctl.pages_compacted + last + quiet.iter().sum::<u64>(),
        "stat pages_compacted {} < {} reported by the compactions",
        dev.pages_compacted,
        ctl.pages_compacted + last + quiet.iter().sum::<u64>()
    );
    assert!(dev.same_pages > 0 && dev.huge_pages > 0, "{dev:?}");
}
