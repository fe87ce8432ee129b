//! Many threads hammer overlapping slots with self-verifying pages while
//! compaction runs beside them. Any torn, stale or lost page fails the test.
//! `VZRAM_STRESS_SECS` makes it run longer by hand.
//!
//! The writers stop once they have run the minimum time, done the minimum
//! number of operations and seen compaction give pages back, whichever
//! comes last: a slow or loaded machine makes the test longer, not weaker.
//! Only MAX_SECS, far beyond what any of these needs, ends it early.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vzram_store::{Codec, Context, DeviceConfig, Pool, PoolConfig, PAGE_SIZE};

const SLOTS: u64 = 512;
const THREADS: u64 = 4;
const SHARED: u64 = SLOTS / 2;
const MIN_OPS_PER_THREAD: u64 = 2_500;
const MAX_SECS: u64 = 60;

/// A page that names its slot, writer and version, with a body derived from
/// them, in one of a few shapes so objects land in many size classes.
fn make(slot: u64, writer: u64, version: u64) -> [u8; PAGE_SIZE] {
    let mut p = [0u8; PAGE_SIZE];
    let seed = slot.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ writer << 48 ^ version;
    let mut x = seed | 1;
    let shape = version % 4;
    for (i, b) in p[24..].iter_mut().enumerate() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = match shape {
            0 => x as u8,
            1 => (x % 3) as u8,
            2 => b"abcdefgh"[(i / 64 + (x % 2) as usize) % 8],
            _ => {
                if i < (x as usize % 3000) {
                    0
                } else {
                    x as u8
                }
            }
        };
    }
    p[..8].copy_from_slice(&slot.to_le_bytes());
    p[8..16].copy_from_slice(&writer.to_le_bytes());
    p[16..24].copy_from_slice(&version.to_le_bytes());
    p
}

/// Checks a page is whole; returns (writer, version) or None for zeros.
fn verify(slot: u64, p: &[u8; PAGE_SIZE]) -> Option<(u64, u64)> {
    if p.iter().all(|&b| b == 0) {
        return None;
    }
    let f = |r: std::ops::Range<usize>| u64::from_le_bytes(p[r].try_into().unwrap());
    let (s, w, v) = (f(0..8), f(8..16), f(16..24));
    assert_eq!(s, slot, "page of slot {s} found in slot {slot}");
    assert!(
        make(s, w, v) == *p,
        "torn page in slot {slot} (writer {w} version {v})"
    );
    Some((w, v))
}

fn hammer(codec: Codec) {
    let secs = std::env::var("VZRAM_STRESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let pool = Pool::new(PoolConfig {
        arena_bytes: 1 << 32,
        ..Default::default()
    })
    .unwrap();
    let mut cfg = DeviceConfig::new(SLOTS * PAGE_SIZE as u64, codec);
    cfg.shards = 2;
    let dev = pool.create_device(cfg).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let compacted = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let (min_time, max_time) = (Duration::from_secs(secs), Duration::from_secs(MAX_SECS));

    let compactor = {
        let (dev, stop, compacted) = (dev.clone(), stop.clone(), compacted.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                compacted.fetch_add(dev.compact(), Ordering::Relaxed);
                std::thread::yield_now();
            }
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (dev, compacted) = (dev.clone(), compacted.clone());
            std::thread::spawn(move || {
                // In the lower half, slots t, t+THREADS, ... are this thread's
                // own: it alone writes them and knows their latest version. The
                // upper half is written by everyone and checked for integrity.
                let cx = &mut Context::new(t as usize);
                let mut mine = vec![None; SLOTS as usize];
                let mut x = t + 1;
                let mut version = 0u64;
                let mut buf = [0u8; PAGE_SIZE];
                let mut ops = 0u64;
                let done = |ops| {
                    let elapsed = start.elapsed();
                    elapsed >= max_time
                        || (elapsed >= min_time
                            && ops >= MIN_OPS_PER_THREAD
                            && compacted.load(Ordering::Relaxed) > 0)
                };
                while !done(ops) {
                    for _ in 0..256 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let mut slot = x % SLOTS;
                        let writing = (x >> 32) % 8 <= 3;
                        if writing && slot < SHARED && slot % THREADS != t {
                            slot = slot - slot % THREADS + t;
                        }
                        let own = slot < SHARED && slot % THREADS == t;
                        match (x >> 32) % 8 {
                            0..=2 => {
                                version += 1;
                                dev.write_page(cx, slot, &make(slot, t, version)).unwrap();
                                if own {
                                    mine[slot as usize] = Some(version);
                                }
                            }
                            3 if own || slot >= SHARED => {
                                dev.discard(cx, slot..slot + 1).unwrap();
                                if own {
                                    mine[slot as usize] = None;
                                }
                            }
                            _ => {
                                dev.read_page(cx, slot, &mut buf).unwrap();
                                let got = verify(slot, &buf);
                                if own {
                                    assert_eq!(
                                        got,
                                        mine[slot as usize].map(|v| (t, v)),
                                        "slot {slot} lost an update"
                                    );
                                }
                            }
                        }
                        ops += 1;
                    }
                }
                (mine, ops)
            })
        })
        .collect();
    let results: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let compacted_while_writing = compacted.load(Ordering::Relaxed);
    let secs_run = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    compactor.join().unwrap();

    let cx = &mut Context::new(0);
    let mut buf = [0u8; PAGE_SIZE];
    for (t, (mine, _)) in results.iter().enumerate() {
        for slot in (t as u64..SHARED).step_by(THREADS as usize) {
            dev.read_page(cx, slot, &mut buf).unwrap();
            assert_eq!(
                verify(slot, &buf),
                mine[slot as usize].map(|v| (t as u64, v)),
                "final slot {slot}"
            );
        }
    }
    let ops: Vec<u64> = results.iter().map(|r| r.1).collect();
    eprintln!(
        "{codec}: {ops:?} ops in {secs_run:.1} s, {compacted_while_writing} pages compacted while writing"
    );
    assert!(
        ops.iter().all(|&n| n >= MIN_OPS_PER_THREAD),
        "writers did {ops:?} ops in {MAX_SECS} s"
    );
    assert!(
        compacted_while_writing > 0,
        "compaction gave nothing back in {MAX_SECS} s of writes"
    );
    assert_eq!(
        dev.stats().pages_compacted,
        compacted.load(Ordering::Relaxed)
    );
    dev.discard(cx, 0..SLOTS).unwrap();
    assert_eq!(dev.stats().mem_used_total, 0);
}

#[test]
fn concurrent_lz4_with_compaction() {
    hammer(Codec::Lz4);
}

#[test]
fn concurrent_zstd_with_compaction() {
    hammer(Codec::Zstd { level: 1 });
}
