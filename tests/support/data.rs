//! Test data: deterministic patterns, incompressible noise, a seeded
//! random number generator, and the pages the tests write and check.

/// The page size the daemon stores (and the tests write) in.
pub const PAGE: usize = 4096;

pub const MIB: u64 = 1 << 20;

/// `bytes` in MiB, for messages.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

/// Deterministic test data: every 8 bytes name the (seed, byte offset), so a
/// misplaced sector is easy to see and never equals another's.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    let start = offset & !7;
    let mut pos = start;
    while pos < offset + len as u64 {
        v.extend_from_slice(&((seed << 48) ^ pos).to_le_bytes());
        pos += 8;
    }
    let skip = (offset - start) as usize;
    v[skip..skip + len].to_vec()
}

/// xorshift64*, seeded through [`mix`], so a test's choices replay from its seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(mix(seed) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// splitmix64's finaliser.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Incompressible data (xorshift), for tests that must fill memory.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Page `i` of version `v`: compressible, incompressible or same-filled by
/// turns, the first two stamped with their index and version. A
/// same-filled page holds `i ^ v` in every byte, so some are all zeroes.
pub fn versioned_page(i: u64, v: u64) -> Vec<u8> {
    page_of_three_kinds(i, v, (i as u8) ^ (v as u8))
}

/// [`versioned_page`] whose same-filled pages are never all zeroes (their
/// byte has its low bit set).
pub fn versioned_page_nonzero(i: u64, v: u64) -> Vec<u8> {
    page_of_three_kinds(i, v, (i as u8) ^ (v as u8) | 1)
}

fn page_of_three_kinds(i: u64, v: u64, same: u8) -> Vec<u8> {
    let mut p = match (i + v) % 3 {
        0 => pattern(i ^ v << 32, i * PAGE as u64, PAGE),
        1 => noise(i ^ v << 32, PAGE),
        _ => vec![same; PAGE],
    };
    if (i + v) % 3 != 2 {
        p[..8].copy_from_slice(&i.to_le_bytes());
        p[8..16].copy_from_slice(&v.to_le_bytes());
    }
    p
}

/// A number from the environment (a seed, a duration), if set; a value
/// that is not one fails the test.
pub fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(v.parse().unwrap_or_else(|e| panic!("{name}={v}: {e}")))
}
