//! Device and host memory limits: the error, the old data kept, and the
//! accounting back to its baseline after discard.

use vzram_store::{Codec, Context, Device, DeviceConfig, Pool, PoolConfig, StoreError, PAGE_SIZE};

mod common;
use common::noise;

const P: u64 = PAGE_SIZE as u64;

/// Fills with incompressible pages until refused; checks the refusal and
/// that overwriting stored data is refused too without changing it.
/// Returns how many pages fit.
fn fill_until_refused(dev: &Device, base: u64, want: StoreError) -> u64 {
    let cx = &mut Context::new(0);
    let mut buf = [0u8; PAGE_SIZE];
    let mut n = 0;
    loop {
        match dev.write_page(cx, n, &noise(base + n)) {
            Ok(()) => n += 1,
            Err(e) => {
                assert_eq!(e, want);
                break;
            }
        }
        assert!(n < dev.num_slots(), "limit never reached");
    }
    assert!(n > 0, "nothing fit at all");
    assert_eq!(dev.write_page(cx, 0, &noise(base + 999_999)), Err(want));
    for s in 0..n {
        dev.read_page(cx, s, &mut buf).unwrap();
        assert!(buf == noise(base + s), "slot {s} changed");
    }
    n
}

#[test]
fn device_then_host_limit() {
    let pool = Pool::new(PoolConfig {
        host_mem_limit: 96 * P,
        arena_bytes: 1 << 30,
        ..PoolConfig::default()
    })
    .unwrap();
    let mut cfg = DeviceConfig::new(1024 * P, Codec::Lz4);
    cfg.mem_limit = 40 * P;
    let a = pool.create_device(cfg.clone()).unwrap();
    cfg.mem_limit = 0;
    let b = pool.create_device(cfg).unwrap();
    let cx = &mut Context::new(0);

    let n = fill_until_refused(&a, 0, StoreError::DeviceLimit);
    assert_eq!(n, 40, "incompressible pages take one page each");
    let sa = a.stats();
    assert_eq!(sa.mem_used_total, 40 * P);
    assert_eq!(sa.huge_pages, 40);
    assert_eq!(sa.failed_writes, 2);

    // `b` has no limit of its own; the pool's 96 pages stop it at 56.
    let n = fill_until_refused(&b, 10_000, StoreError::HostLimit);
    assert_eq!(n, 56);
    let ps = pool.stats();
    assert_eq!(ps.mem_used_total, 96 * P);
    assert_eq!(ps.mem_used_max, 96 * P);
    // Same-filled pages need no memory, so they still fit.
    b.write_page(cx, 500, &[0x11; PAGE_SIZE]).unwrap();

    // Discard returns the accounting to its baseline, and writes work again.
    a.discard(cx, 0..a.num_slots()).unwrap();
    b.discard(cx, 0..b.num_slots()).unwrap();
    for d in [&a, &b] {
        let s = d.stats();
        assert_eq!(
            (
                s.mem_used_total,
                s.orig_data_size,
                s.compr_data_size,
                s.huge_pages
            ),
            (0, 0, 0, 0)
        );
    }
    assert_eq!(pool.stats().mem_used_total, 0);
    assert_eq!(pool.stats().mem_used_max, 96 * P);
    b.write_page(cx, 0, &noise(7)).unwrap();

    // Limits change at runtime in both directions.
    pool.set_host_mem_limit(0);
    a.set_mem_limit(200 * P);
    assert_eq!(fill_until_refused(&a, 20_000, StoreError::DeviceLimit), 200);
    a.set_mem_limit(10 * P);
    assert_eq!(
        a.write_page(cx, 900, &noise(1)),
        Err(StoreError::DeviceLimit)
    );
}

#[test]
fn zeroing_the_last_bytes_frees_the_slot() {
    let pool = Pool::new(PoolConfig {
        arena_bytes: 1 << 30,
        ..Default::default()
    })
    .unwrap();
    let dev = pool
        .create_device(DeviceConfig::new(16 * P, Codec::Lz4))
        .unwrap();
    let cx = &mut Context::new(0);
    let mut page = noise(3);
    page[100..].fill(0);
    dev.write_page(cx, 1, &page).unwrap();
    assert_eq!(dev.stats().orig_data_size, P);
    dev.zero_partial(cx, 1, 0, 100).unwrap();
    let s = dev.stats();
    assert_eq!(
        (s.orig_data_size, s.same_pages, s.mem_used_total),
        (0, 0, 0)
    );
    // Zeroing part of an empty slot stores nothing either.
    dev.zero_partial(cx, 2, 512, 512).unwrap();
    assert_eq!(dev.stats().orig_data_size, 0);
}
