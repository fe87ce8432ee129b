//! Many threads hammer overlapping slots with self-verifying pages while
//! compaction runs beside them. Any torn, stale or lost page fails the test.
//! `VZRAM_STRESS_SECS` makes it run longer by hand.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vzram_store::{Codec, DeviceConfig, Pool, PoolConfig, PAGE_SIZE};

const SLOTS: u64 = 512;
const THREADS: u64 = 4;
const SHARED: u64 = SLOTS / 2;

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
    let deadline = Instant::now() + Duration::from_secs(secs);

    let compactor = {
        let (dev, stop) = (dev.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut pages = 0;
            while !stop.load(Ordering::Relaxed) {
                pages += dev.compact();
                std::thread::sleep(Duration::from_millis(1));
            }
            pages
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                // In the lower half, slots t, t+THREADS, ... are this thread's
                // own: it alone writes them and knows their latest version. The
                // upper half is written by everyone and checked for integrity.
                let mut mine = vec![None; SLOTS as usize];
                let mut x = t + 1;
                let mut version = 0u64;
                let mut buf = [0u8; PAGE_SIZE];
                let mut ops = 0u64;
                while Instant::now() < deadline {
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
                                dev.write_page(slot, &make(slot, t, version)).unwrap();
                                if own {
                                    mine[slot as usize] = Some(version);
                                }
                            }
                            3 if own || slot >= SHARED => {
                                dev.discard(slot..slot + 1).unwrap();
                                if own {
                                    mine[slot as usize] = None;
                                }
                            }
                            _ => {
                                dev.read_page(slot, &mut buf).unwrap();
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
    stop.store(true, Ordering::Relaxed);
    let compacted = compactor.join().unwrap();

    let mut buf = [0u8; PAGE_SIZE];
    for (t, (mine, _)) in results.iter().enumerate() {
        for slot in (t as u64..SHARED).step_by(THREADS as usize) {
            dev.read_page(slot, &mut buf).unwrap();
            assert_eq!(
                verify(slot, &buf),
                mine[slot as usize].map(|v| (t as u64, v)),
                "final slot {slot}"
            );
        }
    }
    let ops: u64 = results.iter().map(|r| r.1).sum();
    eprintln!("{codec}: {ops} ops, {compacted} pages compacted");
    assert!(ops > 10_000);
    dev.discard(0..SLOTS).unwrap();
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
