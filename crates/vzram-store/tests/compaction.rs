//! Compaction gives memory back to the OS (RSS drops) and keeps every page.
//! Also: a span freed by one device and reused by another shows no old bytes.

use vzram_store::{Codec, Context, DeviceConfig, Pool, PoolConfig, PAGE_SIZE};

mod common;
use common::varied;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn compaction_drops_rss_and_keeps_data() {
    const N: u64 = 32 * 1024; // 128 MiB of pages
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let mut cfg = DeviceConfig::new(N * PAGE_SIZE as u64, Codec::Lz4);
    cfg.shards = 1;
    let dev = pool.create_device(cfg).unwrap();
    let cx = &mut Context::new(0);
    for i in 0..N {
        dev.write_page(cx, i, &varied(i)).unwrap();
    }
    dev.discard(cx, 0..0).unwrap();
    for i in (0..N).step_by(2) {
        dev.discard(cx, i..i + 1).unwrap();
    }
    let before = dev.stats();
    let rss_before = rss_bytes();
    // Half the objects are gone but almost no span emptied: that is the
    // fragmentation compaction exists for.
    assert!(
        before.mem_used_total as f64 > 1.6 * before.compr_data_size as f64,
        "{before:?}"
    );

    let pages = dev.compact();
    let after = dev.stats();
    let rss_after = rss_bytes();
    eprintln!(
        "compacted {pages} pages: mem_used {} -> {}, compr {} , rss {} -> {}",
        before.mem_used_total, after.mem_used_total, after.compr_data_size, rss_before, rss_after
    );
    assert!(pages > 0);
    assert_eq!(after.pages_compacted, pages);
    assert_eq!(
        before.mem_used_total - after.mem_used_total,
        pages * PAGE_SIZE as u64
    );
    assert!(
        (after.mem_used_total as f64) < 1.10 * after.compr_data_size as f64,
        "{after:?}"
    );
    // The kernel really got the memory back.
    let freed = pages * PAGE_SIZE as u64;
    assert!(
        rss_before - rss_after > freed * 8 / 10,
        "RSS fell {} of {freed}",
        rss_before - rss_after
    );

    let mut buf = [0u8; PAGE_SIZE];
    for i in 0..N {
        dev.read_page(cx, i, &mut buf).unwrap();
        if i % 2 == 0 {
            assert!(buf.iter().all(|&b| b == 0), "discarded slot {i} not zero");
        } else {
            assert!(buf == varied(i), "slot {i} changed by compaction");
        }
    }
    // A second pass finds nothing left worth moving.
    assert_eq!(dev.compact(), 0);
}

#[test]
fn isolation_across_devices_through_compaction() {
    let pool = Pool::new(PoolConfig {
        arena_bytes: 1 << 30,
        ..Default::default()
    })
    .unwrap();
    let mk = || {
        let mut cfg = DeviceConfig::new(4096 * PAGE_SIZE as u64, Codec::Lz4);
        cfg.shards = 1;
        pool.create_device(cfg).unwrap()
    };
    let (a, b) = (mk(), mk());
    let cx = &mut Context::new(0);
    for i in 0..4096 {
        a.write_page(cx, i, &varied(i)).unwrap();
    }
    for i in 0..4096 {
        if i % 3 != 0 {
            a.discard(cx, i..i + 1).unwrap();
        }
    }
    assert!(a.compact() > 0);
    a.discard(cx, 0..4096).unwrap();
    assert_eq!(a.stats().mem_used_total, 0);
    // `b` now gets the spans `a` gave up. Everything it has not written reads
    // as zeros, and what it writes is exactly what it reads.
    let mut buf = [0u8; PAGE_SIZE];
    for i in 0..4096 {
        b.read_page(cx, i, &mut buf).unwrap();
        assert!(buf.iter().all(|&x| x == 0));
    }
    for i in 0..4096 {
        b.write_page(cx, i, &varied(i + 1_000_000)).unwrap();
    }
    // Leave `b`'s spans (once `a`'s) half empty, so its compaction moves
    // objects between them.
    for i in (1..4096).step_by(2) {
        b.discard(cx, i..i + 1).unwrap();
    }
    let used = b.stats().mem_used_total;
    let freed = b.compact();
    assert!(freed > 0, "nothing to compact in {:?}", b.stats());
    assert_eq!(b.stats().pages_compacted, freed);
    assert_eq!(used - b.stats().mem_used_total, freed * PAGE_SIZE as u64);
    for i in 0..4096 {
        b.read_page(cx, i, &mut buf).unwrap();
        if i % 2 == 0 {
            assert!(buf == varied(i + 1_000_000), "slot {i} of b changed");
        } else {
            assert!(buf.iter().all(|&x| x == 0));
        }
        a.read_page(cx, i, &mut buf).unwrap();
        assert!(buf.iter().all(|&x| x == 0), "device a sees data at {i}");
    }
}
