//! `vzram-bench codecs`: each lz4 and zstd implementation over the corpus, one
//! 4 KiB page per call on one thread, as the store calls them: what the codec
//! costs per page, and what another implementation would buy.

use crate::cli::CodecsArgs;
use crate::data::{Corpus, PAGE};
use crate::error::{bail, Result};
use crate::lz4c::{self, Lz4C, Reset};
use crate::report::JsonOut;
use crate::targets::codec::{max_out, Codec};
use crate::targets::Algo;
use serde::Serialize;
use std::hint::black_box;
use std::time::Instant;
use vzram_store::codec::{CodecState, LZ4_IMPLEMENTATION, MAX_COMPRESSED};
use vzram_store::Codec as StoreCodec;

/// One implementation at one setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subject {
    /// vzram-store's own codec functions: lz4_flex or libzstd, as a store
    /// queue calls them (lz4_flex is `#[inline]`, so where it is compiled in
    /// matters).
    Store(StoreCodec),
    /// The bench's codec target: lz4_flex compiled into the bench's loop
    /// (`codec@lz4`), or C liblz4 (`lz4-c`).
    Target(Algo),
    /// liblz4 with its state zeroed before every page (`LZ4_compress_fast_extState`).
    Lz4CFull,
}

impl Subject {
    fn parse(s: &str) -> Result<Subject> {
        Ok(match s {
            "lz4-c/full" => Subject::Lz4CFull,
            "lz4-c" => Subject::Target(Algo::Lz4C),
            "codec@lz4" => Subject::Target(Algo::Lz4),
            _ => Subject::Store(s.parse()?),
        })
    }

    fn name(self) -> String {
        match self {
            Subject::Store(c) => c.to_string(),
            Subject::Target(Algo::Lz4) => "codec@lz4".into(),
            Subject::Target(a) => a.to_string(),
            Subject::Lz4CFull => "lz4-c/full".into(),
        }
    }

    fn implementation(self) -> String {
        let flex = if cfg!(feature = "lz4-safe") {
            "lz4_flex (safe-encode, safe-decode)"
        } else {
            "lz4_flex"
        };
        match self {
            // vzram-store built with its `lz4-c` feature runs liblz4.
            Subject::Store(StoreCodec::Lz4) if LZ4_IMPLEMENTATION == "liblz4" => {
                format!("liblz4 {} in vzram-store (lz4-c)", lz4c::version())
            }
            Subject::Store(StoreCodec::Lz4) => format!("{flex} in vzram-store"),
            Subject::Store(StoreCodec::Zstd { .. }) => {
                format!(
                    "libzstd {} in vzram-store",
                    zstd::zstd_safe::version_string()
                )
            }
            Subject::Target(Algo::Lz4) => format!("{flex} in the codec target"),
            Subject::Target(Algo::Lz4C) => format!("liblz4 {}, fastReset", lz4c::version()),
            Subject::Target(Algo::Zstd(_)) => {
                format!(
                    "libzstd {} in the codec target",
                    zstd::zstd_safe::version_string()
                )
            }
            Subject::Lz4CFull => format!("liblz4 {}, full reset", lz4c::version()),
        }
    }

    fn runner(self) -> Result<Runner> {
        Ok(match self {
            Subject::Store(c) => Runner::Store(c, CodecState::default()),
            Subject::Target(a) => Runner::Target(Codec::new(a)?),
            Subject::Lz4CFull => Runner::Target(Codec::Lz4C(Lz4C::new(Reset::Full))),
        })
    }
}

enum Runner {
    Store(StoreCodec, CodecState),
    Target(Codec),
}

impl Runner {
    #[inline]
    fn compress(&mut self, page: &[u8], out: &mut [u8]) -> Result<usize> {
        match self {
            Runner::Store(c, st) => {
                let out = (&mut out[..MAX_COMPRESSED]).try_into().unwrap();
                c.compress(page.try_into().unwrap(), out, MAX_COMPRESSED, st)
                    .ok_or_else(|| format!("{c}: page does not compress into its bound").into())
            }
            Runner::Target(c) => c.compress(page, out),
        }
    }

    #[inline]
    fn decompress(&mut self, src: &[u8], page: &mut [u8]) -> Result<usize> {
        match self {
            Runner::Store(c, st) => match c.decompress(src, page.try_into().unwrap(), st) {
                true => Ok(PAGE),
                false => Err(format!("{c}: malformed page").into()),
            },
            Runner::Target(c) => c.decompress(src, page),
        }
    }
}

pub fn parse_list(s: &str) -> Result<Vec<Subject>> {
    let v: Vec<Subject> = s
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(Subject::parse)
        .collect::<Result<_>>()
        .map_err(|e| format!("--codecs: {}", e.0))?;
    if v.is_empty() {
        bail!("--codecs: empty");
    }
    Ok(v)
}

/// One implementation's figures; one JSON line each.
#[derive(Clone, Debug, Serialize)]
pub struct CodecRow {
    /// "codecs" (other records share --json files).
    pub record: String,
    pub codec: String,
    pub implementation: String,
    pub data: String,
    pub pages: usize,
    pub repeat: u32,
    /// Medians over the passes, per page.
    pub compress_ns: f64,
    pub decompress_ns: f64,
    /// Decimal megabytes of pages per second.
    pub compress_mb_s: f64,
    pub decompress_mb_s: f64,
    /// Corpus bytes / compressed bytes.
    pub ratio: f64,
    /// The store's lz4 time (row `lz4`) / this one's: above 1 is faster
    /// than the store's lz4. None when lz4 was not measured.
    pub compress_vs_lz4: Option<f64>,
    pub decompress_vs_lz4: Option<f64>,
    pub compress_ns_passes: Vec<f64>,
    pub decompress_ns_passes: Vec<f64>,
    pub load_1m: Option<f64>,
    pub unix_time: u64,
}

/// One implementation's pages, compressed once (what the timed decompressions read).
struct Prepared {
    codec: Runner,
    bytes: Vec<u8>,
    spans: Vec<(usize, usize)>,
}

impl Prepared {
    /// Compresses the corpus and checks that every page comes back.
    fn new(s: Subject, corpus: &Corpus) -> Result<Prepared> {
        let mut codec = s.runner()?;
        let mut out = vec![0u8; max_out()];
        let mut page = vec![0u8; PAGE];
        let mut bytes = Vec::new();
        let mut spans = Vec::with_capacity(corpus.len());
        for i in 0..corpus.len() as u64 {
            let n = codec.compress(corpus.page(i), &mut out)?;
            page.fill(0);
            if codec.decompress(&out[..n], &mut page)? != PAGE || page != corpus.page(i) {
                bail!("{}: page {i} does not come back", s.name());
            }
            spans.push((bytes.len(), n));
            bytes.extend_from_slice(&out[..n]);
        }
        Ok(Prepared {
            codec,
            bytes,
            spans,
        })
    }

    /// ns per page of one compression pass over the corpus.
    fn compress_pass(&mut self, corpus: &Corpus, out: &mut [u8]) -> Result<f64> {
        let t = Instant::now();
        let mut total = 0usize;
        for i in 0..corpus.len() as u64 {
            total += self.codec.compress(corpus.page(i), out)?;
        }
        let ns = t.elapsed().as_nanos() as f64;
        black_box(total);
        Ok(ns / corpus.len() as f64)
    }

    fn decompress_pass(&mut self, page: &mut [u8]) -> Result<f64> {
        let t = Instant::now();
        for &(o, n) in &self.spans {
            black_box(self.codec.decompress(&self.bytes[o..o + n], page)?);
        }
        let ns = t.elapsed().as_nanos() as f64;
        Ok(ns / self.spans.len() as f64)
    }
}

/// `repeat` passes of each implementation, interleaved (A B C A B C...) so
/// that a noisy neighbour hits them alike.
pub fn measure(corpus: &Corpus, subjects: &[Subject], repeat: u32) -> Result<Vec<CodecRow>> {
    let repeat = repeat.max(1);
    let load_1m = crate::sys::load_1m();
    let mut prepared = subjects
        .iter()
        .map(|&s| Prepared::new(s, corpus))
        .collect::<Result<Vec<_>>>()?;
    let mut out = vec![0u8; max_out()];
    let mut page = vec![0u8; PAGE];
    let mut comp = vec![Vec::new(); subjects.len()];
    let mut decomp = vec![Vec::new(); subjects.len()];
    for rep in 0..repeat {
        eprintln!("codecs: pass {}/{repeat}", rep + 1);
        for (i, p) in prepared.iter_mut().enumerate() {
            comp[i].push(p.compress_pass(corpus, &mut out)?);
            decomp[i].push(p.decompress_pass(&mut page)?);
        }
    }
    let unix_time = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut rows: Vec<CodecRow> = subjects
        .iter()
        .zip(&prepared)
        .enumerate()
        .map(|(i, (s, p))| {
            let (c, d) = (median(&comp[i]), median(&decomp[i]));
            CodecRow {
                record: "codecs".into(),
                codec: s.name(),
                implementation: s.implementation(),
                data: corpus.name.clone(),
                pages: corpus.len(),
                repeat,
                compress_ns: c,
                decompress_ns: d,
                compress_mb_s: PAGE as f64 * 1e3 / c,
                decompress_mb_s: PAGE as f64 * 1e3 / d,
                ratio: (corpus.len() * PAGE) as f64 / p.bytes.len().max(1) as f64,
                compress_vs_lz4: None,
                decompress_vs_lz4: None,
                compress_ns_passes: comp[i].clone(),
                decompress_ns_passes: decomp[i].clone(),
                load_1m,
                unix_time,
            }
        })
        .collect();
    if let Some(base) = rows.iter().find(|r| r.codec == "lz4").cloned() {
        for r in &mut rows {
            r.compress_vs_lz4 = Some(base.compress_ns / r.compress_ns);
            r.decompress_vs_lz4 = Some(base.decompress_ns / r.decompress_ns);
        }
    }
    Ok(rows)
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

pub fn run(args: &CodecsArgs) -> Result<()> {
    let subjects = parse_list(&args.codecs)?;
    let corpus = Corpus::resolve(args.data.as_deref(), args.synthetic)?;
    let mut json = args.json.as_deref().map(JsonOut::open).transpose()?;
    let rows = measure(&corpus, &subjects, args.repeat)?;
    if let Some(j) = json.as_mut() {
        for r in &rows {
            j.write(r)?;
        }
    }
    println!(
        "Data: {} ({} pages); one thread, one page per call; median of {} passes over the \
         corpus per implementation, interleaved; load {}; {} CPUs.\n",
        corpus.name,
        corpus.len(),
        args.repeat.max(1),
        rows.first()
            .and_then(|r| r.load_1m)
            .map_or("?".into(), |l| format!("{l:.1}")),
        crate::sys::nproc()
    );
    print_table(&rows);
    if args.checksums {
        let sums = crate::checksum::measure(&corpus, args.repeat)?;
        if let Some(j) = json.as_mut() {
            for r in &sums {
                j.write(r)?;
            }
        }
        crate::checksum::print_table(&sums);
    }
    Ok(())
}

pub fn print_table(rows: &[CodecRow]) {
    let x = |v: Option<f64>| v.map_or("–".into(), |v| format!("{v:.2}×"));
    println!(
        "| codec | implementation | compress ns/page | MB/s | speed vs store lz4 | \
         decompress ns/page | MB/s | speed vs store lz4 | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {:.0} | {:.0} | {} | {:.0} | {:.0} | {} | {:.2} |",
            r.codec,
            r.implementation,
            r.compress_ns,
            r.compress_mb_s,
            x(r.compress_vs_lz4),
            r.decompress_ns,
            r.decompress_mb_s,
            x(r.decompress_vs_lz4),
            r.ratio
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_implementation_is_measured() {
        let corpus = Corpus::synthetic(64, 5);
        let subjects = parse_list("lz4, lz4-c,lz4-c/full,zstd:-1,zstd:3,codec@lz4").unwrap();
        let rows = measure(&corpus, &subjects, 2).unwrap();
        let names: Vec<&str> = rows.iter().map(|r| r.codec.as_str()).collect();
        let want = [
            "lz4",
            "lz4-c",
            "lz4-c/full",
            "zstd:-1",
            "zstd:3",
            "codec@lz4",
        ];
        assert_eq!(names, want);
        for r in &rows {
            assert_eq!((r.pages, r.compress_ns_passes.len()), (64, 2));
            assert!(r.compress_ns > 0.0 && r.decompress_ns > 0.0, "{r:?}");
            assert!(r.ratio > 1.5, "{r:?}");
            let line = serde_json::to_value(r).unwrap();
            assert_eq!(line["record"], "codecs");
        }
        assert_eq!(rows[0].compress_vs_lz4, Some(1.0));
        // zstd:3 packs tighter than lz4 on this mix; lz4 is lz4 wherever compiled.
        assert!(rows[4].ratio > rows[0].ratio);
        assert_eq!(rows[5].ratio, rows[0].ratio);
        // Without lz4 there is nothing to compare with.
        let rows = measure(&corpus, &parse_list("zstd:1").unwrap(), 1).unwrap();
        assert_eq!(rows[0].decompress_vs_lz4, None);
    }

    #[test]
    fn bad_lists_are_refused() {
        for s in [
            "",
            " , ",
            "lz5",
            "zstd:99",
            "zstd:0",
            "lz4-c/fast",
            "codec@zstd",
        ] {
            assert!(parse_list(s).is_err(), "{s:?}");
        }
    }
}
