//! The store's model test, concurrent variant: every slot ends holding
//! what its owner thread last wrote successfully, also while the writers
//! spill to a backing file and another thread tiers under them (the
//! sequential model is `model.rs`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use vzram_store::{
    BackingSpec, Codec, Context, DeviceConfig, Filter, Page, Pool, PoolConfig, StoreError,
    PAGE_SIZE,
};

mod common;
use common::{xorshift, BackingFile};

const P: u64 = PAGE_SIZE as u64;

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
        ..PoolConfig::default()
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
