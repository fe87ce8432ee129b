//! Compaction on a device with several allocator shards reaches its plan:
//! every (shard, class) ends with exactly the spans its live objects need,
//! with or without room under the device's memory limit.

use std::collections::HashMap;
use std::sync::{Arc, Barrier};

use vzram_store::codec::{CodecState, MAX_COMPRESSED};
use vzram_store::device::DEFAULT_HUGE_THRESHOLD;
use vzram_store::pool::class::{class_of, classes};
use vzram_store::{Codec, Context, Device, DeviceConfig, Pool, PoolConfig, PAGE_SIZE};

mod common;
use common::varied;

const P: u64 = PAGE_SIZE as u64;
const WRITERS: u64 = 4;
const PER_WRITER: u64 = 2048;
const N: u64 = WRITERS * PER_WRITER;

/// A page that compresses to a few bytes: a class no `varied(i)` uses.
fn probe(t: u64) -> [u8; PAGE_SIZE] {
    let mut p = [0u8; PAGE_SIZE];
    p[..8].copy_from_slice(&(t + 1).to_le_bytes());
    p
}

/// Size class the device stores `p` in.
fn class_for(p: &[u8; PAGE_SIZE]) -> usize {
    let mut out = [0u8; MAX_COMPRESSED];
    let len = Codec::Lz4
        .compress(
            p,
            &mut out,
            DEFAULT_HUGE_THRESHOLD,
            &mut CodecState::default(),
        )
        .unwrap_or(PAGE_SIZE);
    class_of(len)
}

fn span_bytes(class: usize) -> u64 {
    u64::from(classes()[class].pages) * P
}

/// A 4-shard device written by 4 threads, each with a context on a shard of
/// its own, each filling its own quarter; then every other page discarded.
/// Returns the device and the pool memory a perfect compaction leaves: for
/// every (shard, class), just enough spans for its live objects.
fn fragmented_four_shards() -> (Arc<Device>, u64) {
    let pool = Pool::new(PoolConfig {
        arena_bytes: 1 << 32,
        ..Default::default()
    })
    .unwrap();
    let mut cfg = DeviceConfig::new((N + WRITERS) * P, Codec::Lz4);
    cfg.shards = WRITERS as usize;
    let dev = pool.create_device(cfg).unwrap();

    let probed = Barrier::new(WRITERS as usize + 1);
    let checked = Barrier::new(WRITERS as usize + 1);
    std::thread::scope(|s| {
        for t in 0..WRITERS {
            let (dev, probed, checked) = (&dev, &probed, &checked);
            s.spawn(move || {
                let cx = &mut Context::new(t as usize);
                dev.write_page(cx, N + t, &probe(t)).unwrap();
                probed.wait();
                checked.wait();
                for i in t * PER_WRITER..(t + 1) * PER_WRITER {
                    dev.write_page(cx, i, &varied(i)).unwrap();
                }
            });
        }
        probed.wait();
        // One small object per writer: one span each only if every writer
        // has a shard of its own.
        assert_eq!(
            dev.stats().mem_used_total,
            WRITERS * span_bytes(class_for(&probe(0))),
            "the writers do not cover every shard"
        );
        checked.wait();
    });
    let cx = &mut Context::new(0);
    dev.discard(cx, N..N + WRITERS).unwrap();
    for i in (0..N).step_by(2) {
        dev.discard(cx, i..i + 1).unwrap();
    }

    let mut live: HashMap<(u64, usize), u64> = HashMap::new();
    for i in (1..N).step_by(2) {
        *live
            .entry((i / PER_WRITER, class_for(&varied(i))))
            .or_default() += 1;
    }
    let ideal = live
        .iter()
        .map(|(&(_, class), &n)| {
            n.div_ceil(u64::from(classes()[class].capacity)) * span_bytes(class)
        })
        .sum();
    (dev, ideal)
}

fn compact_and_check(dev: &Device, ideal: u64) {
    let before = dev.stats();
    assert!(
        before.mem_used_total as f64 > 1.5 * ideal as f64,
        "not fragmented: {} bytes used, {ideal} needed",
        before.mem_used_total
    );
    let pages = dev.compact();
    let after = dev.stats();
    eprintln!(
        "compacted {pages} pages: mem_used {} -> {}, plan {ideal}",
        before.mem_used_total, after.mem_used_total
    );
    assert_eq!(
        after.mem_used_total,
        ideal,
        "one pass freed {} of the {} pages the plan allows ({pages} given back)",
        (before.mem_used_total - after.mem_used_total) / P,
        (before.mem_used_total - ideal) / P
    );
    assert_eq!(pages * P, before.mem_used_total - after.mem_used_total);

    let cx = &mut Context::new(0);
    let mut buf = [0u8; PAGE_SIZE];
    for i in 0..N {
        dev.read_page(cx, i, &mut buf).unwrap();
        if i % 2 == 0 {
            assert!(buf.iter().all(|&b| b == 0), "discarded slot {i} not zero");
        } else {
            assert!(buf == varied(i), "slot {i} changed by compaction");
        }
    }
    assert_eq!(dev.compact(), 0, "a second pass found more to do");
}

#[test]
fn one_pass_reaches_the_plan_with_four_shards() {
    let (dev, ideal) = fragmented_four_shards();
    compact_and_check(&dev, ideal);
}

/// Moving an object within its own shard needs no new span, so a device at
/// its memory limit compacts just as far.
#[test]
fn one_pass_reaches_the_plan_at_the_memory_limit() {
    let (dev, ideal) = fragmented_four_shards();
    dev.set_mem_limit(dev.stats().mem_used_total);
    compact_and_check(&dev, ideal);
}
