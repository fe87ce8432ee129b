//! Page generators and random numbers the store's integration tests share. Each test binary
//! uses some of them, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use vzram_store::{Page, PAGE_SIZE};

pub mod stream;

/// One xorshift64 step.
pub fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// An incompressible page (random bytes), stored raw.
pub fn noise(seed: u64) -> Page {
    let mut p = [0u8; PAGE_SIZE];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for b in p.iter_mut() {
        *b = xorshift(&mut x) as u8;
    }
    p
}

/// A compressible page whose compressed size varies with `i`, so many
/// size classes get spans; its first 8 bytes are `i`.
pub fn varied(i: u64) -> Page {
    let mut p = [0u8; PAGE_SIZE];
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let noisy = 200 + (i % 13) as usize * 150;
    for (j, b) in p.iter_mut().enumerate() {
        let r = xorshift(&mut x);
        *b = if j < noisy { r as u8 } else { (j / 32) as u8 };
    }
    p[..8].copy_from_slice(&i.to_le_bytes());
    p
}

/// xorshift64 as a generator.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        xorshift(&mut self.0)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// splitmix64's finalizer: unrelated seeds from neighbouring values. A
/// value an xorshift gave would start another xorshift one step along the
/// first one's own sequence, so successive children would run nearly the
/// same ops.
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A backing file of its own for one device of one case, removed after.
pub struct BackingFile(pub PathBuf);

impl BackingFile {
    pub fn new(blocks: u64) -> BackingFile {
        static N: AtomicU64 = AtomicU64::new(0);
        // Not tmpfs: the store opens it with O_DIRECT, which tmpfs refuses.
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("model");
        std::fs::create_dir_all(&dir).unwrap();
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{}-{n}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        // A header block, then the page blocks.
        f.set_len((blocks + 1) * PAGE_SIZE as u64).unwrap();
        BackingFile(path)
    }
}

impl Drop for BackingFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
