//! Model-based test: random sequences of page operations against the store
//! and against a plain HashMap, for both codecs. Any divergence fails.

use std::collections::HashMap;

use proptest::prelude::*;
use vzram_store::{Codec, DeviceConfig, Pool, PoolConfig, StoreError, PAGE_SIZE};

const SLOTS: u64 = 48;

#[derive(Debug, Clone)]
enum Op {
    Write {
        slot: u64,
        kind: u8,
        seed: u32,
    },
    Partial {
        slot: u64,
        offset: usize,
        len: usize,
        seed: u32,
    },
    Read {
        slot: u64,
    },
    Discard {
        start: u64,
        len: u64,
    },
    ZeroPart {
        slot: u64,
        offset: usize,
        len: usize,
    },
    DeviceLimit {
        pages: u64,
    },
    HostLimit {
        pages: u64,
    },
    Compact,
}

/// Pages of several shapes: same-filled, compressible, incompressible.
fn page(kind: u8, seed: u32) -> Vec<u8> {
    let mut p = vec![0u8; PAGE_SIZE];
    let mut x = u64::from(seed) | 1;
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    match kind % 5 {
        0 => {}
        1 => p.iter_mut().for_each(|b| *b = seed as u8),
        2 => {
            for (i, b) in p.iter_mut().enumerate() {
                *b = b"swap me gently "[(i + seed as usize) % 15];
            }
        }
        3 => p.iter_mut().for_each(|b| *b = rnd() as u8),
        _ => {
            for (i, b) in p.iter_mut().enumerate() {
                *b = if i % 64 < 40 { (rnd() % 4) as u8 } else { 0 };
            }
        }
    }
    p
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..SLOTS + 2, any::<u8>(), any::<u32>()).prop_map(|(slot, kind, seed)| Op::Write { slot, kind, seed }),
        2 => (0..SLOTS, 0..PAGE_SIZE, 1..PAGE_SIZE, any::<u32>()).prop_map(|(slot, offset, len, seed)| Op::Partial { slot, offset, len: len.min(PAGE_SIZE - offset), seed }),
        4 => (0..SLOTS + 2).prop_map(|slot| Op::Read { slot }),
        2 => (0..SLOTS, 0..8u64).prop_map(|(start, len)| Op::Discard { start, len }),
        1 => (0..SLOTS, 0..PAGE_SIZE, 1..PAGE_SIZE).prop_map(|(slot, offset, len)| Op::ZeroPart { slot, offset, len: len.min(PAGE_SIZE - offset) }),
        1 => (0..40u64).prop_map(|pages| Op::DeviceLimit { pages }),
        1 => (0..40u64).prop_map(|pages| Op::HostLimit { pages }),
        1 => Just(Op::Compact),
    ]
}

fn run(codec: Codec, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let pool = Pool::new(PoolConfig {
        arena_bytes: 1 << 30,
        ..Default::default()
    })
    .unwrap();
    let dev = pool
        .create_device(DeviceConfig::new(SLOTS * PAGE_SIZE as u64, codec))
        .unwrap();
    let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
    let zero = vec![0u8; PAGE_SIZE];
    let mut buf = [0u8; PAGE_SIZE];
    for op in ops {
        match op {
            Op::Write { slot, kind, seed } => {
                let p = page(kind, seed);
                match dev.write_page(slot, p.as_slice().try_into().unwrap()) {
                    Ok(()) => {
                        model.insert(slot, p);
                    }
                    Err(StoreError::OutOfRange { .. }) => prop_assert!(slot >= SLOTS),
                    Err(StoreError::DeviceLimit | StoreError::HostLimit) => {}
                    Err(e) => return Err(TestCaseError::fail(format!("write: {e}"))),
                }
            }
            Op::Partial {
                slot,
                offset,
                len,
                seed,
            } => {
                let p = page(3, seed);
                match dev.write_partial(slot, offset, &p[..len]) {
                    Ok(()) => {
                        let e = model.entry(slot).or_insert_with(|| zero.clone());
                        e[offset..offset + len].copy_from_slice(&p[..len]);
                        // A partial write that leaves only zeros frees the slot.
                        if *e == zero {
                            model.remove(&slot);
                        }
                    }
                    Err(StoreError::DeviceLimit | StoreError::HostLimit) => {}
                    Err(e) => return Err(TestCaseError::fail(format!("partial: {e}"))),
                }
            }
            Op::ZeroPart { slot, offset, len } => match dev.zero_partial(slot, offset, len) {
                Ok(()) => {
                    let e = model.entry(slot).or_insert_with(|| zero.clone());
                    e[offset..offset + len].fill(0);
                    if *e == zero {
                        model.remove(&slot);
                    }
                }
                Err(StoreError::DeviceLimit | StoreError::HostLimit) => {}
                Err(e) => return Err(TestCaseError::fail(format!("zero: {e}"))),
            },
            Op::Read { slot } => match dev.read_page(slot, &mut buf) {
                Ok(()) => {
                    let want = model.get(&slot).unwrap_or(&zero);
                    prop_assert!(buf.as_slice() == want.as_slice(), "slot {} differs", slot);
                }
                Err(StoreError::OutOfRange { .. }) => prop_assert!(slot >= SLOTS),
                Err(e) => return Err(TestCaseError::fail(format!("read: {e}"))),
            },
            Op::Discard { start, len } => {
                let end = (start + len).min(SLOTS);
                dev.discard(start..end).unwrap();
                for s in start..end {
                    model.remove(&s);
                }
            }
            Op::DeviceLimit { pages } => dev.set_mem_limit(pages * PAGE_SIZE as u64),
            Op::HostLimit { pages } => pool.set_host_mem_limit(pages * PAGE_SIZE as u64),
            Op::Compact => {
                dev.compact();
            }
        }
        let s = dev.stats();
        let ps = pool.stats();
        prop_assert_eq!(
            s.mem_used_total,
            ps.mem_used_total,
            "one device owns the whole pool"
        );
    }
    // Everything the model holds is still there, byte for byte.
    for s in 0..SLOTS {
        dev.read_page(s, &mut buf).unwrap();
        prop_assert!(
            buf.as_slice() == model.get(&s).unwrap_or(&zero).as_slice(),
            "final slot {}",
            s
        );
    }
    let stored = model.values().count() as u64;
    prop_assert_eq!(dev.stats().orig_data_size, stored * PAGE_SIZE as u64);
    // Discarding everything returns the pool to empty.
    dev.discard(0..SLOTS).unwrap();
    let s = dev.stats();
    prop_assert_eq!(s.mem_used_total, 0);
    prop_assert_eq!(s.compr_data_size, 0);
    prop_assert_eq!(s.orig_data_size, 0);
    prop_assert_eq!(s.same_pages, 0);
    prop_assert_eq!(s.huge_pages, 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn lz4_matches_model(ops in prop::collection::vec(op(), 1..200)) {
        run(Codec::Lz4, ops)?;
    }

    #[test]
    fn zstd_matches_model(ops in prop::collection::vec(op(), 1..200)) {
        run(Codec::Zstd { level: 3 }, ops)?;
    }
}
