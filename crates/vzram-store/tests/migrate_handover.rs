//! A receive handed on between owners of the device ([`Resume`]) reads on
//! from the same socket where the last one stopped: every page arrives
//! once, the stream's count and checksum still match, and the hand-over
//! may come among the records, while the stream is idle, or while the
//! verdict is open. An idle pre-copy keeps the stream alive.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vzram_store::migrate::{self, Progress, Received, Resume, Verdict};
use vzram_store::{Codec, Context, Device, DeviceConfig, Pool, PoolConfig, PAGE_SIZE};

mod common;
use common::stream::send_on;

const SLOTS: u64 = 4096;

fn device(pool: &Arc<Pool>) -> Arc<Device> {
    let mut cfg = DeviceConfig::new(SLOTS * PAGE_SIZE as u64, Codec::Lz4);
    cfg.shards = 2;
    pool.create_device(cfg).unwrap()
}

fn page(i: u64, v: u64) -> [u8; PAGE_SIZE] {
    let mut p = [0u8; PAGE_SIZE];
    for (j, c) in p.chunks_exact_mut(8).enumerate() {
        c.copy_from_slice(&(i * 31 + v * 7 + (j as u64 % 3)).to_le_bytes());
    }
    p
}

fn read(dev: &Device, s: u64) -> [u8; PAGE_SIZE] {
    let mut b = [0u8; PAGE_SIZE];
    dev.read_page(&mut Context::new(0), s, &mut b).unwrap();
    b
}

/// Receives into `dst` from `s`, handing the stream on whenever
/// `hand_on` says so and taking it up again at once, as the next owner
/// would; returns the report and how many times it changed hands.
fn receive_handing_on(
    dst: &Device,
    s: &UnixStream,
    hand_on: &dyn Fn() -> bool,
) -> (Result<migrate::ReceiveReport, migrate::MigrateError>, u32) {
    let hooks = migrate::ReceiveHooks {
        progress: &|_| {},
        prepared: &|| {},
        started: &|| false,
        commit: &|| {},
        patience: &|p| s.set_read_timeout(p).unwrap(),
    };
    let mut from: Option<Resume> = None;
    let mut handed = 0;
    loop {
        match migrate::receive_from(dst, s, s, &hooks, Some(hand_on), from) {
            Ok(Received::HandedOn(r)) => {
                handed += 1;
                from = Some(r);
            }
            Ok(Received::Done(rep)) => return (Ok(rep), handed),
            Err(e) => return (Err(e), handed),
        }
    }
}

/// Hands on at every `n`th ask.
fn every(n: u64) -> impl Fn() -> bool {
    let asked = AtomicU64::new(0);
    move || asked.fetch_add(1, Relaxed) % n == n - 1
}

#[test]
fn a_receive_handed_on_among_records_idle_and_in_the_verdict_loses_and_repeats_nothing() {
    let pool = Pool::new(PoolConfig {
        host_mem_limit: 0,
        arena_bytes: 1 << 30,
        ..PoolConfig::default()
    })
    .unwrap();
    let src = device(&pool);
    let dst = device(&pool);
    let cx = &mut Context::new(0);
    for i in 0..SLOTS {
        src.write_page(cx, i, &page(i, 1)).unwrap();
    }
    let (a, b) = UnixStream::pair().unwrap();
    let writing = AtomicBool::new(true);
    let t0 = Instant::now();
    // The verdict stays open a while: hand-overs come there too.
    let verdict = || {
        if t0.elapsed() < Duration::from_millis(1500) {
            Verdict::Wait
        } else {
            Verdict::Commit
        }
    };
    let hand_on = every(3);
    let (tx, (rx, handed)) = std::thread::scope(|sc| {
        let rx = sc.spawn(|| receive_handing_on(&dst, &b, &hand_on));
        // Writes during pre-copy, with pauses: the stream flows and idles.
        let w = sc.spawn(|| {
            let cx = &mut Context::new(1);
            for round in 0..5u64 {
                for i in (round..SLOTS).step_by(7) {
                    src.write_page(cx, i, &page(i, 2 + round)).unwrap();
                }
                std::thread::sleep(Duration::from_millis(150));
            }
            writing.store(false, Relaxed);
        });
        let tx = send_on(
            &src,
            &a,
            &|| !writing.load(Relaxed),
            &verdict,
            &|| None,
            &|_: Progress| {},
        );
        w.join().unwrap();
        drop(a);
        (tx, rx.join().unwrap())
    });
    let (tx, rx) = (tx.unwrap(), rx.unwrap());
    assert!(handed >= 10, "the stream changed hands {handed} times only");
    assert_eq!(rx.records, tx.records);
    assert_eq!(tx.pages, SLOTS);
    for i in 0..SLOTS {
        assert!(read(&src, i) == read(&dst, i), "slot {i} differs");
    }
}

/// A hand-over asked for while records flow comes at the next record
/// boundary once what is buffered is used up, not when the stream next
/// idles (the source's whole first pass here).
#[test]
fn a_hand_over_among_flowing_records_comes_before_the_stream_idles() {
    let pool = Pool::new(PoolConfig {
        host_mem_limit: 0,
        arena_bytes: 1 << 30,
        ..PoolConfig::default()
    })
    .unwrap();
    let src = device(&pool);
    let dst = device(&pool);
    let cx = &mut Context::new(0);
    // Incompressible: the first pass is 16 MiB, many buffers' worth.
    for i in 0..SLOTS {
        let mut p = [0u8; PAGE_SIZE];
        let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        for c in p.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes());
        }
        src.write_page(cx, i, &p).unwrap();
    }
    let (a, b) = UnixStream::pair().unwrap();
    let first = AtomicU64::new(u64::MAX);
    let asked = AtomicU64::new(0);
    // The fourth ask: the first pass is flowing by then.
    let hand_on = || asked.fetch_add(1, Relaxed) == 3;
    let (tx, rx) = std::thread::scope(|sc| {
        let rx = sc.spawn(|| {
            let hooks = migrate::ReceiveHooks {
                progress: &|_| {},
                prepared: &|| {},
                started: &|| false,
                commit: &|| {},
                patience: &|p| b.set_read_timeout(p).unwrap(),
            };
            let mut from = None;
            loop {
                match migrate::receive_from(&dst, &b, &b, &hooks, Some(&hand_on), from)? {
                    Received::HandedOn(r) => {
                        first.fetch_min(r.records(), Relaxed);
                        from = Some(r);
                    }
                    Received::Done(rep) => return Ok::<_, migrate::MigrateError>(rep),
                }
            }
        });
        let tx = send_on(&src, &a, &|| true, &|| Verdict::Commit, &|| None, &|_| {});
        drop(a);
        (tx, rx.join().unwrap())
    });
    assert_eq!(tx.unwrap().pages, SLOTS);
    assert_eq!(rx.unwrap().pages, SLOTS);
    let at = first.load(Relaxed);
    assert!(at < SLOTS, "handed on after {at} records, not among them");
    for i in 0..SLOTS {
        assert!(read(&src, i) == read(&dst, i), "slot {i} differs");
    }
}

/// A guest that writes nothing during the pre-copy: the source still says
/// it is there (the destination's reads give up on a silent stream; here
/// after 3 s).
#[test]
fn an_idle_pre_copy_keeps_the_stream_alive() {
    let pool = Pool::new(PoolConfig {
        host_mem_limit: 0,
        arena_bytes: 1 << 30,
        ..PoolConfig::default()
    })
    .unwrap();
    let src = device(&pool);
    let dst = device(&pool);
    src.write_page(&mut Context::new(0), 5, &page(5, 1))
        .unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    b.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let t0 = Instant::now();
    let quiet = || t0.elapsed() > Duration::from_secs(7);
    let (tx, rx) = std::thread::scope(|sc| {
        let rx = sc.spawn(|| {
            let hooks = migrate::ReceiveHooks {
                progress: &|_| {},
                prepared: &|| {},
                started: &|| false,
                commit: &|| {},
                // Between verdict polls, the 3 s stall limit again.
                patience: &|p| {
                    b.set_read_timeout(p.or(Some(Duration::from_secs(3))))
                        .unwrap()
                },
            };
            migrate::receive(&dst, &b, &b, &hooks)
        });
        let tx = send_on(&src, &a, &quiet, &|| Verdict::Commit, &|| None, &|_| {});
        drop(a);
        (tx, rx.join().unwrap())
    });
    let rx = rx.unwrap_or_else(|e| panic!("the destination gave up: {e}"));
    assert_eq!(tx.unwrap().pages, 1);
    assert_eq!(rx.pages, 1);
    assert!(read(&dst, 5) == page(5, 1));
}
