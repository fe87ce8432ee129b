//! `vzram-bench codecs --checksums`: what a checksum per stored object
//! would cost (zram keeps none). Each page of the corpus is compressed
//! with the store's lz4 once; then, one thread, one object per call,
//! interleaved passes time lz4's decode and encode of each page against a
//! checksum over its object: CRC32C with the SSE4.2 `crc32` instruction
//! (one dependency chain, as a per-object check would run it) and CRC32
//! (crc32fast, PCLMULQDQ folding). A read would add the checksum to its
//! decode; a write to its encode.

use crate::data::{Corpus, PAGE};
use crate::error::{bail, Result};
use serde::Serialize;
use std::hint::black_box;
use std::time::Instant;
use vzram_store::codec::{CodecState, MAX_COMPRESSED};
use vzram_store::Codec as StoreCodec;

/// One checksum's figures; one JSON line each.
#[derive(Clone, Debug, Serialize)]
pub struct ChecksumRow {
    /// "checksum" (other records share --json files).
    pub record: String,
    pub checksum: String,
    pub implementation: String,
    pub data: String,
    pub pages: usize,
    pub repeat: u32,
    /// Mean bytes of an lz4 object (what is checksummed).
    pub object_bytes: f64,
    /// Medians over the passes, per page.
    pub checksum_ns: f64,
    pub lz4_decompress_ns: f64,
    pub lz4_compress_ns: f64,
    /// checksum_ns / lz4_decompress_ns: what a checked read adds.
    pub of_decompress: f64,
    pub of_compress: f64,
    pub checksum_ns_passes: Vec<f64>,
    pub unix_time: u64,
}

/// CRC32C (Castagnoli) with the SSE4.2 instruction, if this CPU has it.
pub fn crc32c(b: &[u8]) -> Option<u32> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("sse4.2") {
        // SAFETY: the CPU has SSE4.2 (checked above).
        return Some(unsafe { crc32c_sse42(b) });
    }
    let _ = b;
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(b: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut c = u64::from(u32::MAX);
    let words = b.chunks_exact(8);
    let tail = words.remainder();
    for w in words {
        c = _mm_crc32_u64(c, u64::from_le_bytes(w.try_into().unwrap()));
    }
    let mut c = c as u32;
    for &x in tail {
        c = _mm_crc32_u8(c, x);
    }
    !c
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// ns per page of `f` over every object.
fn pass(objs: &[Vec<u8>], mut f: impl FnMut(&[u8]) -> u32) -> f64 {
    let t = Instant::now();
    let mut acc = 0u32;
    for o in objs {
        acc ^= f(black_box(o));
    }
    black_box(acc);
    t.elapsed().as_nanos() as f64 / objs.len().max(1) as f64
}

pub fn measure(corpus: &Corpus, repeat: u32) -> Result<Vec<ChecksumRow>> {
    let repeat = repeat.max(1);
    let lz4 = StoreCodec::Lz4;
    let mut st = CodecState::default();
    let mut out = [0u8; MAX_COMPRESSED];
    let mut page = [0u8; PAGE];
    let mut objs = Vec::with_capacity(corpus.len());
    for i in 0..corpus.len() as u64 {
        let p: &[u8; PAGE] = corpus.page(i).try_into().unwrap();
        let Some(n) = lz4.compress(p, &mut out, MAX_COMPRESSED, &mut st) else {
            bail!("lz4: page {i} does not compress into its bound");
        };
        objs.push(out[..n].to_vec());
    }
    if crc32c(b"123456789").is_some_and(|c| c != 0xe306_9283) {
        bail!("crc32c: wrong check value");
    }
    let sums: [(&str, &str, fn(&[u8]) -> u32); 2] = [
        ("crc32c", "SSE4.2 crc32 instruction, 8 bytes a step", |b| {
            crc32c(b).unwrap_or(0)
        }),
        ("crc32", "crc32fast (PCLMULQDQ)", crc32fast::hash),
    ];
    let (mut dec, mut enc) = (Vec::new(), Vec::new());
    let mut sum = vec![Vec::new(); sums.len()];
    for rep in 0..repeat {
        eprintln!("checksums: pass {}/{repeat}", rep + 1);
        dec.push(pass(&objs, |o| {
            lz4.decompress(o, &mut page, &mut st);
            u32::from(page[0])
        }));
        enc.push({
            let t = Instant::now();
            for i in 0..corpus.len() as u64 {
                let p: &[u8; PAGE] = corpus.page(i).try_into().unwrap();
                black_box(lz4.compress(p, &mut out, MAX_COMPRESSED, &mut st));
            }
            t.elapsed().as_nanos() as f64 / corpus.len().max(1) as f64
        });
        for (i, (_, _, f)) in sums.iter().enumerate() {
            sum[i].push(pass(&objs, *f));
        }
    }
    let unix_time = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let object_bytes = objs.iter().map(Vec::len).sum::<usize>() as f64 / objs.len().max(1) as f64;
    let (d, e) = (median(&dec), median(&enc));
    Ok(sums
        .iter()
        .zip(sum)
        .filter(|((name, _, _), _)| *name != "crc32c" || crc32c(b"").is_some())
        .map(|((name, imp, _), passes)| {
            let c = median(&passes);
            ChecksumRow {
                record: "checksum".into(),
                checksum: name.to_string(),
                implementation: imp.to_string(),
                data: corpus.name.clone(),
                pages: corpus.len(),
                repeat,
                object_bytes,
                checksum_ns: c,
                lz4_decompress_ns: d,
                lz4_compress_ns: e,
                of_decompress: c / d,
                of_compress: c / e,
                checksum_ns_passes: passes,
                unix_time,
            }
        })
        .collect())
}

pub fn print_table(rows: &[ChecksumRow]) {
    println!(
        "\n| checksum over each lz4 object | implementation | mean object bytes | ns/page | \
         lz4 decode ns/page | + on a read | lz4 encode ns/page | + on a write |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.1}% | {:.0} | {:.1}% |",
            r.checksum,
            r.implementation,
            r.object_bytes,
            r.checksum_ns,
            r.lz4_decompress_ns,
            100.0 * r.of_decompress,
            r.lz4_compress_ns,
            100.0 * r.of_compress
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_are_right_and_measured() {
        if let Some(c) = crc32c(b"123456789") {
            assert_eq!(c, 0xe306_9283);
        }
        assert_eq!(crc32fast::hash(b"123456789"), 0xcbf4_3926);
        let rows = measure(&Corpus::synthetic(64, 5), 2).unwrap();
        assert!(rows.iter().any(|r| r.checksum == "crc32"));
        assert!(rows
            .iter()
            .all(|r| r.checksum_ns > 0.0 && r.lz4_decompress_ns > 0.0));
    }
}
