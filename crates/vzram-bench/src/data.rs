//! Page corpus: the content written to (and expected back from) the device.
//!
//! A write to byte offset `o` carries corpus page `(o / 4096) % len`, so the data is
//! realistic for the compressor, the same on every target, and checkable on read.
//! Every page the bench writes comes from here (density's marker pages too).

use crate::error::{bail, Context, Result};
use crate::rng::Rng;
use std::path::{Path, PathBuf};

pub const PAGE: usize = 4096;

/// Where the real anonymous-page corpus lives, relative to the repository root.
pub const DEFAULT_DATA: &str = "../shared/data/anon-pages.bin";

pub struct Corpus {
    pub name: String,
    bytes: Vec<u8>,
    pages: usize,
}

impl Corpus {
    pub fn from_bytes(name: String, bytes: Vec<u8>) -> Result<Self> {
        if bytes.is_empty() || !bytes.len().is_multiple_of(PAGE) {
            bail!(
                "corpus {name}: size {} is not a non-zero multiple of {PAGE}",
                bytes.len()
            );
        }
        let pages = bytes.len() / PAGE;
        Ok(Corpus { name, bytes, pages })
    }

    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).context(format!("reading {}", path.display()))?;
        Self::from_bytes(path.display().to_string(), bytes)
    }

    /// `--data FILE`, or `--synthetic`, or the real corpus when this checkout has it,
    /// else the synthetic mix (so the tool runs anywhere), saying so on stderr.
    pub fn resolve(data: Option<&Path>, synthetic: bool) -> Result<Self> {
        if synthetic {
            return Ok(Self::synthetic(16_384, 0x7a72_616d));
        }
        if let Some(p) = data {
            return Self::load(p);
        }
        for candidate in default_candidates() {
            if candidate.is_file() {
                return Self::load(&candidate);
            }
        }
        eprintln!("note: {DEFAULT_DATA} not found, using the built-in synthetic page mix");
        Ok(Self::synthetic(16_384, 0x7a72_616d))
    }

    pub fn len(&self) -> usize {
        self.pages
    }

    #[inline]
    pub fn page(&self, idx: u64) -> &[u8] {
        let i = (idx % self.pages as u64) as usize;
        &self.bytes[i * PAGE..(i + 1) * PAGE]
    }

    /// Fill `buf` with the content that belongs at byte `offset` of the device.
    #[inline]
    pub fn fill(&self, offset: u64, buf: &mut [u8]) {
        let first = offset / PAGE as u64;
        for (i, chunk) in buf.chunks_mut(PAGE).enumerate() {
            let n = chunk.len();
            chunk.copy_from_slice(&self.page(first + i as u64)[..n]);
        }
    }

    /// Number of 4 KiB pages in `buf` that differ from what belongs at `offset`.
    /// All-zero pages are accepted when `allow_zero` (never-written blocks).
    pub fn mismatches(&self, offset: u64, buf: &[u8], allow_zero: bool) -> u64 {
        let first = offset / PAGE as u64;
        let mut bad = 0;
        for (i, chunk) in buf.chunks(PAGE).enumerate() {
            let want = &self.page(first + i as u64)[..chunk.len()];
            if chunk != want && !(allow_zero && chunk.iter().all(|&b| b == 0)) {
                bad += 1;
            }
        }
        bad
    }

    /// A deterministic mix shaped like anonymous memory: zero pages, text, pointer-heavy
    /// struct arrays, half-used pages, and incompressible bytes. lz4 gets ~2.65x on it;
    /// the real corpus gets ~2.8x.
    pub fn synthetic(pages: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut bytes = vec![0u8; pages * PAGE];
        let words = vocabulary(&mut rng);
        for page in bytes.chunks_mut(PAGE) {
            match rng.below(100) {
                0..=9 => {} // zero page
                10..=34 => text_page(&mut rng, &words, page),
                35..=69 => struct_page(&mut rng, page),
                70..=91 => sparse_page(&mut rng, page),
                _ => random_page(&mut rng, page),
            }
        }
        Corpus {
            name: format!("synthetic(seed={seed:#x})"),
            bytes,
            pages,
        }
    }
}

fn default_candidates() -> Vec<PathBuf> {
    let mut v = vec![PathBuf::from(DEFAULT_DATA)];
    // Also relative to this crate's source tree, so it works from any cwd on the
    // machine that built it (crates/vzram-bench -> repo root -> ..).
    v.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(DEFAULT_DATA),
    );
    v
}

fn vocabulary(rng: &mut Rng) -> Vec<Vec<u8>> {
    const SYL: [&str; 24] = [
        "an", "re", "con", "ti", "ment", "ing", "er", "pro", "de", "ca", "tion", "lo", "st", "us",
        "ma", "el", "in", "or", "al", "se", "ne", "ur", "id", "ob",
    ];
    (0..400)
        .map(|_| {
            let n = 1 + rng.below(3) as usize;
            (0..n)
                .flat_map(|_| SYL[rng.below(SYL.len() as u64) as usize].bytes())
                .collect()
        })
        .collect()
}

fn text_page(rng: &mut Rng, words: &[Vec<u8>], page: &mut [u8]) {
    // Strings on a heap: prose and JSON-ish records with recurring keys.
    let mut text: Vec<u8> = Vec::with_capacity(PAGE + 128);
    while text.len() < PAGE {
        if rng.percent(50) {
            let id = rng.below(100_000);
            let w = &words[rng.below(words.len() as u64) as usize];
            text.extend_from_slice(format!("{{\"id\": {id}, \"name\": \"").as_bytes());
            text.extend_from_slice(w);
            text.extend_from_slice(b"\", \"status\": \"ok\", \"refs\": [");
            text.extend_from_slice(rng.below(1000).to_string().as_bytes());
            text.extend_from_slice(b"]}\n");
        } else {
            for _ in 0..1 + rng.below(12) {
                // Zipf-ish: most words come from a small hot set.
                let w = if rng.percent(80) {
                    &words[rng.below(32) as usize]
                } else {
                    &words[rng.below(words.len() as u64) as usize]
                };
                text.extend_from_slice(w);
                text.push(b' ');
            }
            text.push(b'\n');
        }
    }
    page.copy_from_slice(&text[..PAGE]);
}

fn struct_page(rng: &mut Rng, page: &mut [u8]) {
    // Array of 64-byte objects: heap pointers sharing their high bits, a common vtable
    // pointer, small counters and flags, zero padding. Like a page of a C++/Python heap.
    let heap = 0x0000_7f00_0000_0000u64 | (rng.below(1 << 28) << 12);
    let vtable = 0x0000_5555_5555_0000u64 | (rng.below(1 << 12) << 4);
    let obj_size = [32usize, 48, 64, 96][rng.below(4) as usize];
    for obj in page.chunks_mut(obj_size) {
        let mut fields = [0u64; 12];
        fields[0] = vtable;
        fields[1] = 1 + rng.below(4); // refcount
        fields[2] = heap + rng.below(1 << 10) * 16; // next
        fields[3] = if rng.percent(50) {
            heap + rng.below(1 << 10) * 16
        } else {
            0
        };
        fields[4] = rng.below(256); // len / flags
        fields[5] = if rng.percent(50) {
            rng.next_u64() & 0xffff_ffff // hash, once computed
        } else {
            0
        };
        fields[6] = if rng.percent(30) {
            rng.below(1 << 20)
        } else {
            0
        };
        for (dst, f) in obj.chunks_mut(8).zip(fields) {
            let n = dst.len();
            dst.copy_from_slice(&f.to_le_bytes()[..n]);
        }
    }
}

fn sparse_page(rng: &mut Rng, page: &mut [u8]) {
    // A partly used page (stack, arena tail): random words up to a high-water mark.
    let used = (256 + rng.below(PAGE as u64 / 2)) as usize & !7;
    for w in page[..used].chunks_mut(8) {
        let v = if rng.percent(60) {
            rng.below(1 << 16)
        } else {
            rng.next_u64()
        };
        w.copy_from_slice(&v.to_le_bytes());
    }
}

fn random_page(rng: &mut Rng, page: &mut [u8]) {
    for w in page.chunks_mut(8) {
        w.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
}

/// A page whose content names its device, to check a read against.
pub fn device_page(device: usize) -> [u8; PAGE] {
    let mut p = [0u8; PAGE];
    for (i, w) in p.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&((device as u64) << 32 | i as u64).to_le_bytes());
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compression ratio of lz4 over the corpus, pages compressed one by one.
    pub fn lz4_ratio(c: &Corpus) -> f64 {
        let mut out = vec![0u8; lz4_flex::block::get_maximum_output_size(PAGE)];
        let mut stored = 0usize;
        for i in 0..c.len() {
            stored += lz4_flex::block::compress_into(c.page(i as u64), &mut out).unwrap();
        }
        (c.len() * PAGE) as f64 / stored as f64
    }

    #[test]
    fn synthetic_mix_is_deterministic_and_compresses_like_anon_memory() {
        let a = Corpus::synthetic(2048, 1);
        let b = Corpus::synthetic(2048, 1);
        assert_eq!(a.bytes, b.bytes);
        let zero = (0..a.len())
            .filter(|&i| a.page(i as u64).iter().all(|&x| x == 0))
            .count() as f64
            / a.len() as f64;
        assert!((0.05..0.15).contains(&zero), "zero pages {zero}");
        let r = lz4_ratio(&a);
        assert!((2.3..3.3).contains(&r), "lz4 ratio {r}");
    }

    #[test]
    fn fill_and_verify_wrap_around() {
        let c = Corpus::synthetic(4, 2);
        let mut buf = vec![0u8; 3 * PAGE];
        c.fill(3 * PAGE as u64, &mut buf); // pages 3, 0, 1
        assert_eq!(&buf[..PAGE], c.page(3));
        assert_eq!(&buf[PAGE..2 * PAGE], c.page(4));
        assert_eq!(c.mismatches(3 * PAGE as u64, &buf, false), 0);
        buf[PAGE + 5] ^= 1;
        assert_eq!(c.mismatches(3 * PAGE as u64, &buf, false), 1);
        assert_eq!(c.mismatches(0, &vec![0u8; PAGE], true), 0);
    }

    #[test]
    fn device_pages_differ_per_device() {
        assert_ne!(device_page(1), device_page(2));
        assert_eq!(&device_page(3)[8..16], &((3u64 << 32) | 1).to_le_bytes());
    }

    #[test]
    fn rejects_ragged_files() {
        assert!(Corpus::from_bytes("x".into(), vec![0; 100]).is_err());
        assert!(Corpus::from_bytes("x".into(), vec![]).is_err());
    }
}
