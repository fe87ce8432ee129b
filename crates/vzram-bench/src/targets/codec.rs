//! The raw codec in-process on the same pages: the ceiling a compressed block device
//! can approach. "write" = compress a page, "read" = decompress one; one thread and
//! one reusable codec context per queue.

use super::target::Algo;
use crate::data::{Corpus, PAGE};
use crate::error::{Context, Result};
use crate::job::{Dir, JobSpec, OpGen};
use crate::lz4c::{self, Lz4C, Reset};
use crate::measure::{Phase, Totals, Window, WorkerStats};
use std::sync::Barrier;
use std::time::Instant;

pub enum Codec {
    /// lz4 with its match table kept between pages, as the store keeps it.
    Lz4(Box<lz4_flex::block::CompressTable>),
    /// C liblz4, its state kept likewise.
    Lz4C(Lz4C),
    Zstd(
        zstd::bulk::Compressor<'static>,
        zstd::bulk::Decompressor<'static>,
    ),
}

impl Codec {
    pub fn new(algo: Algo) -> Result<Codec> {
        Ok(match algo {
            Algo::Lz4 => Codec::Lz4(Box::default()),
            Algo::Lz4C => Codec::Lz4C(Lz4C::new(Reset::Fast)),
            Algo::Zstd(level) => Codec::Zstd(
                zstd::bulk::Compressor::new(level).context("zstd compressor")?,
                zstd::bulk::Decompressor::new().context("zstd decompressor")?,
            ),
        })
    }

    #[inline]
    pub fn compress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize> {
        match self {
            Codec::Lz4(table) => lz4_flex::block::compress_into_with_table(src, dst, table)
                .map_err(|e| format!("lz4: {e}").into()),
            Codec::Lz4C(c) => c
                .compress(src, dst)
                .ok_or_else(|| "lz4-c: output does not fit".into()),
            Codec::Zstd(c, _) => c.compress_to_buffer(src, dst).context("zstd compress"),
        }
    }

    #[inline]
    pub fn decompress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize> {
        match self {
            Codec::Lz4(_) => {
                lz4_flex::block::decompress_into(src, dst).map_err(|e| format!("lz4: {e}").into())
            }
            Codec::Lz4C(_) => {
                lz4c::decompress(src, dst).ok_or_else(|| "lz4-c: malformed page".into())
            }
            Codec::Zstd(_, d) => d.decompress_to_buffer(src, dst).context("zstd decompress"),
        }
    }
}

/// Room for any page compressed by any of them (liblz4's bound is lz4_flex's).
pub fn max_out() -> usize {
    lz4_flex::block::get_maximum_output_size(PAGE).max(zstd::zstd_safe::compress_bound(PAGE))
}

/// Every corpus page, compressed once up front (what reads decompress).
pub struct Compressed {
    pages: Vec<Vec<u8>>,
    /// Bytes an ideal store would keep: same-filled pages free, incompressible ones raw.
    pub ideal_bytes: u64,
    pub compressed_bytes: u64,
}

impl Compressed {
    pub fn new(corpus: &Corpus, algo: Algo) -> Result<Self> {
        let mut codec = Codec::new(algo)?;
        let mut buf = vec![0u8; max_out()];
        let mut pages = Vec::with_capacity(corpus.len());
        let (mut ideal, mut total) = (0u64, 0u64);
        for i in 0..corpus.len() as u64 {
            let page = corpus.page(i);
            let n = codec.compress(page, &mut buf)?;
            total += n as u64;
            let same_filled = page.chunks(8).all(|w| w == &page[..8]);
            ideal += if same_filled { 0 } else { n.min(PAGE) as u64 };
            pages.push(buf[..n].to_vec());
        }
        Ok(Compressed {
            pages,
            ideal_bytes: ideal,
            compressed_bytes: total,
        })
    }

    /// Original bytes per compressed byte over the corpus.
    pub fn ratio(&self) -> f64 {
        (self.pages.len() * PAGE) as f64 / self.compressed_bytes.max(1) as f64
    }

    /// Host bytes per guest byte for an ideal store of this corpus.
    pub fn ideal_per_byte(&self) -> f64 {
        self.ideal_bytes as f64 / (self.pages.len() * PAGE) as f64
    }
}

fn worker(
    corpus: &Corpus,
    comp: &Compressed,
    algo: Algo,
    job: &JobSpec,
    queue: u32,
    window: Window,
) -> Result<WorkerStats> {
    let mut codec = Codec::new(algo)?;
    let mut out = vec![0u8; max_out()];
    let mut page_buf = vec![0u8; PAGE];
    let mut gen = OpGen::for_job(job, queue, 0x5eed);
    let mut stats = WorkerStats::default();
    let mut phase = Phase::new(window);
    let npages = corpus.len() as u64;
    while phase.submitting() {
        let Some(op) = gen.next_op() else {
            phase.finish(Instant::now(), &mut stats);
            break;
        };
        let t = Instant::now();
        let first = op.offset / PAGE as u64;
        for p in first..first + (op.len / PAGE) as u64 {
            match op.dir {
                Dir::Write => {
                    std::hint::black_box(codec.compress(corpus.page(p), &mut out)?);
                }
                Dir::Read => {
                    let n = codec.decompress(&comp.pages[(p % npages) as usize], &mut page_buf)?;
                    std::hint::black_box(n);
                }
            }
        }
        let now = Instant::now();
        if phase.tick(now, &mut stats) {
            stats.ios += 1;
            stats.bytes += op.len as u64;
            match op.dir {
                Dir::Read => stats.reads += 1,
                Dir::Write => stats.writes += 1,
            }
            stats.hist.record(now.duration_since(t).as_nanos() as u64);
        }
    }
    Ok(stats)
}

/// Run `job` against the codec: one thread per queue, same window logic as the clients.
pub fn run(corpus: &Corpus, comp: &Compressed, algo: Algo, job: &JobSpec) -> Result<Totals> {
    let barrier = Barrier::new(job.queues as usize + 1);
    let window = std::sync::OnceLock::new();
    let mut totals = Totals::default();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..job.queues)
            .map(|q| {
                let (barrier, window) = (&barrier, &window);
                s.spawn(move || {
                    barrier.wait();
                    worker(corpus, comp, algo, job, q, *window.get().unwrap())
                })
            })
            .collect();
        let start = Instant::now();
        let w = Window::for_job(job, start);
        window.set(w).unwrap();
        barrier.wait();
        for h in handles {
            let st = h.join().map_err(|_| "codec worker panicked")??;
            totals.add(&st);
        }
        Ok(())
    })?;
    Ok(totals)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_every_codec() {
        let corpus = Corpus::synthetic(64, 3);
        for algo in [Algo::Lz4, Algo::Lz4C, Algo::Zstd(1)] {
            let comp = Compressed::new(&corpus, algo).unwrap();
            let mut c = Codec::new(algo).unwrap();
            let mut page = vec![0u8; PAGE];
            for i in 0..64 {
                let n = c.decompress(&comp.pages[i], &mut page).unwrap();
                assert_eq!(n, PAGE);
                assert_eq!(&page[..], corpus.page(i as u64));
            }
            assert!(comp.ratio() > 1.5, "{algo}: {}", comp.ratio());
            assert!(comp.ideal_per_byte() < 1.0);
        }
    }
}
