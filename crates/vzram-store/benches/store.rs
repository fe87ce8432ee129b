//! Store benchmark: write and read throughput of one thread through the
//! store, next to the raw codec on the same pages (the ceiling), plus memory
//! overhead. Not a test: run by hand and copy the table into BENCHMARKS.md.
//!
//! cargo bench -p vzram-store --bench store -- [--data FILE | --synthetic] [--copies N] [--reps N]
//!     [--cpu-time]           time with this thread's CPU time instead of the
//!                            wall clock: a busy neighbour's share is left out
//!     [--state DIR]          devices keep their state in files under DIR (tmpfs)
//!     [--recovery GIB:SIZE]  instead: store GIB GiB in a SIZE GiB device with
//!                            state under --state DIR, then time its recovery
//!     [--tier DIR [--hot PCT] [--recompress-algo zstd:L]]
//!                            instead: tiering. Memory per GiB stored with lz4
//!                            for every page, with the idle (100 - PCT)% moved
//!                            to the second codec, and with the second codec
//!                            for all; then the read latency of pages in memory
//!                            against pages written back to a file in DIR

use std::time::Instant;

use vzram_store::codec::{CodecState, MAX_COMPRESSED};
use vzram_store::device::same_filled;
use vzram_store::{
    BackingSpec, Codec, Context, DeviceConfig, Filter, Page, Pool, PoolConfig, StateSpec, PAGE_SIZE,
};

/// The clock the throughput figures use.
#[derive(Clone, Copy)]
struct Clock {
    /// This thread's CPU time (user and system) rather than wall time.
    cpu: bool,
}

impl Clock {
    fn now(self) -> f64 {
        let id = if self.cpu {
            libc::CLOCK_THREAD_CPUTIME_ID
        } else {
            libc::CLOCK_MONOTONIC
        };
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes only the timespec it is given.
        let rc = unsafe { libc::clock_gettime(id, &mut ts) };
        assert_eq!(rc, 0, "clock_gettime");
        ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
    }

    fn since(self, t0: f64) -> f64 {
        self.now() - t0
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// A deterministic mix resembling anonymous memory, for machines without
/// the captured corpus: zero pages, small-integer arrays, pointer-rich
/// structs, text, and random bytes.
fn synthetic(n: usize) -> Vec<Page> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let words = b"the of and to in is was for that with as on by def return self none import ";
    (0..n)
        .map(|i| {
            let mut p = [0u8; PAGE_SIZE];
            match i % 10 {
                0 | 1 => {}
                2 | 3 => {
                    for c in p.chunks_exact_mut(8) {
                        c.copy_from_slice(&(rnd() % 1000).to_le_bytes());
                    }
                }
                4..=6 => {
                    let base = 0x7f3a_0000_0000u64 + (rnd() % 4096) * 4096;
                    for (j, c) in p.chunks_exact_mut(8).enumerate() {
                        let v = match j % 4 {
                            0 => base + (rnd() % 64) * 32,
                            1 => rnd() % 256,
                            2 => 0,
                            _ => base + j as u64 * 16,
                        };
                        c.copy_from_slice(&v.to_le_bytes());
                    }
                }
                7 | 8 => {
                    let mut k = 0;
                    while k < PAGE_SIZE {
                        let w = (rnd() as usize) % (words.len() - 8);
                        let n = (4 + rnd() % 5) as usize;
                        let end = (k + n).min(PAGE_SIZE);
                        p[k..end].copy_from_slice(&words[w..w + end - k]);
                        k = end;
                    }
                }
                _ => p.iter_mut().for_each(|b| *b = rnd() as u8),
            }
            p
        })
        .collect()
}

fn load(path: &str) -> Vec<Page> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    bytes
        .chunks_exact(PAGE_SIZE)
        .map(|c| c.try_into().unwrap())
        .collect()
}

struct Row {
    codec: Codec,
    raw_c: f64,
    raw_d: f64,
    raw_ratio: f64,
    w: f64,
    ow: f64,
    r: f64,
    ratio: f64,
    mem_over_compr: f64,
    meta_per_slot: f64,
    same: u64,
    huge: u64,
}

fn bench(
    codec: Codec,
    pages: &[Page],
    copies: usize,
    reps: usize,
    threshold: usize,
    state: Option<&std::path::Path>,
    clock: Clock,
) -> Row {
    let mib = |secs: f64, n: usize| (n * PAGE_SIZE) as f64 / secs / 1e6;
    let mut cbuf = Box::new([0u8; MAX_COMPRESSED]);
    let mut out = Box::new([0u8; PAGE_SIZE]);
    // The ceiling reuses its zstd contexts as the store does with its own.
    let mut st = CodecState::default();
    let mut cx = Context::new(0);
    // Compress once up front for the decompression ceiling and the ratio.
    let comp: Vec<Vec<u8>> = pages
        .iter()
        .map(|p| {
            let n = codec
                .compress(p, &mut cbuf, MAX_COMPRESSED, &mut st)
                .unwrap_or(PAGE_SIZE);
            cbuf[..n].to_vec()
        })
        .collect();
    let raw_bytes: usize = comp.iter().map(|c| c.len().min(PAGE_SIZE)).sum();
    let n = pages.len() * copies;
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let (mut raw_c, mut raw_d, mut w, mut ow, mut r) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut last = None;
    // Ceiling and store run interleaved in every repetition, so a noisy
    // neighbour hits both sides of each ratio alike.
    for _ in 0..reps {
        let t = clock.now();
        for p in pages.iter().cycle().take(n) {
            std::hint::black_box(codec.compress(p, &mut cbuf, MAX_COMPRESSED, &mut st));
        }
        raw_c.push(mib(clock.since(t), n));
        let t = clock.now();
        for c in comp.iter().cycle().take(n) {
            assert!(codec.decompress(c, &mut out, &mut st));
        }
        raw_d.push(mib(clock.since(t), n));

        let mut cfg = DeviceConfig::new((n * PAGE_SIZE) as u64, codec);
        cfg.shards = 1;
        cfg.huge_threshold = threshold;
        cfg.state = state.map(|root| StateSpec {
            root: root.to_path_buf(),
            name: "bench".into(),
            existing: vzram_store::Existing::Discard,
            ..StateSpec::default()
        });
        let dev = pool.create_device(cfg).unwrap();
        let t = clock.now();
        for (i, p) in pages.iter().cycle().take(n).enumerate() {
            dev.write_page(&mut cx, i as u64, p).unwrap();
        }
        w.push(mib(clock.since(t), n));
        // Steady state: every slot rewritten with other content, so objects
        // are freed and reused rather than carved from fresh memory.
        let t = clock.now();
        for (i, p) in pages.iter().cycle().skip(1).take(n).enumerate() {
            dev.write_page(&mut cx, i as u64, p).unwrap();
        }
        ow.push(mib(clock.since(t), n));
        for (i, p) in pages.iter().cycle().take(n).enumerate() {
            dev.write_page(&mut cx, i as u64, p).unwrap();
        }
        let t = clock.now();
        for i in 0..n {
            dev.read_page(&mut cx, i as u64, &mut out).unwrap();
        }
        r.push(mib(clock.since(t), n));
        for (i, p) in pages.iter().enumerate() {
            dev.read_page(&mut cx, i as u64, &mut out).unwrap();
            assert!(*out == *p, "page {i} differs");
        }
        last = Some(dev.stats());
    }
    let s = last.unwrap();
    Row {
        codec,
        raw_c: median(raw_c),
        raw_d: median(raw_d),
        raw_ratio: (pages.len() * PAGE_SIZE) as f64 / raw_bytes as f64,
        w: median(w),
        ow: median(ow),
        r: median(r),
        ratio: s.orig_data_size as f64 / s.compr_data_size as f64,
        mem_over_compr: s.mem_used_total as f64 / s.compr_data_size as f64,
        meta_per_slot: s.meta_bytes as f64 / n as f64,
        same: s.same_pages,
        huge: s.huge_pages,
    }
}

/// Memory per GiB stored, three ways in one run, then read latency from
/// memory and from the backing file. Pages are written as a guest swaps them
/// out; the last `hot`% written are read back (the guest touching them), the
/// rest stay idle.
fn tier(
    pages: &[Page],
    copies: usize,
    reps: usize,
    hot: u64,
    second: Codec,
    dir: &std::path::Path,
) {
    std::fs::create_dir_all(dir).unwrap();
    let n = pages.len() * copies;
    let gib = |bytes: u64| bytes as f64 / (n * PAGE_SIZE) as f64;
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let mut cx = Context::new(0);
    let mut out = Box::new([0u8; PAGE_SIZE]);
    let backing = dir.join("vzram-bench-backing");
    let device = |codec: Codec, with_backing: bool| {
        if with_backing {
            let f = std::fs::File::create(&backing).unwrap();
            f.set_len(((n + 1) * PAGE_SIZE) as u64).unwrap();
        }
        let mut cfg = DeviceConfig::new((n * PAGE_SIZE) as u64, codec);
        cfg.shards = 1;
        cfg.backing = with_backing.then(|| BackingSpec {
            path: backing.clone(),
        });
        pool.create_device(cfg).unwrap()
    };
    let fill = |dev: &vzram_store::Device, cx: &mut Context| {
        for (i, p) in pages.iter().cycle().take(n).enumerate() {
            dev.write_page(cx, i as u64, p).unwrap();
        }
    };
    println!(
        "data: {n} pages ({} MiB); hot = last {hot}% written; second codec {second}",
        (n * PAGE_SIZE) >> 20
    );
    println!();
    println!(
        "| layout | mem_used_total / stored bytes | compr / stored | recompress µs/page (wall) |"
    );
    println!("|---|---|---|---|");
    for codec in [Codec::Lz4, second] {
        let dev = device(codec, false);
        fill(&dev, &mut cx);
        let s = dev.stats();
        println!(
            "| {codec} for every page | {:.3} | {:.3} | |",
            gib(s.mem_used_total),
            gib(s.compr_data_size)
        );
    }
    let dev = device(Codec::Lz4, false);
    fill(&dev, &mut cx);
    dev.mark_idle();
    let hot_from = n as u64 * (100 - hot) / 100;
    for i in hot_from..n as u64 {
        dev.read_page(&mut cx, i, &mut out).unwrap();
    }
    let t = Instant::now();
    let rep = dev
        .recompress(
            Filter {
                idle: true,
                ..Default::default()
            },
            second,
        )
        .unwrap();
    let per_page = t.elapsed().as_secs_f64() * 1e6 / rep.tried.max(1) as f64;
    let s = dev.stats();
    println!(
        "| lz4 hot, {second} idle ({} of {} idle pages recompressed) | {:.3} | {:.3} | {per_page:.1} |",
        rep.pages,
        rep.tried,
        gib(s.mem_used_total),
        gib(s.compr_data_size)
    );
    for (i, p) in pages.iter().cycle().take(n).enumerate() {
        dev.read_page(&mut cx, i as u64, &mut out).unwrap();
        assert!(*out == *p, "page {i} differs after recompression");
    }
    drop(dev);

    // Read latency: the same pages from memory and from the backing file,
    // interleaved round by round, in a scattered order as swap-ins come.
    let dev = device(Codec::Lz4, true);
    fill(&dev, &mut cx);
    let half = n as u64 / 2;
    dev.writeback(Filter::default(), Some(half)).unwrap();
    let backed = dev.stats().backed_pages;
    let order: Vec<u64> = (0..n as u64).map(|i| (i * 7919) % n as u64).collect();
    let is_backed = |i: u64| i < half;
    let (mut mem_us, mut disk_us) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let (mut m, mut d) = (Vec::new(), Vec::new());
        for &i in &order {
            let t = Instant::now();
            dev.read_page(&mut cx, i, &mut out).unwrap();
            let us = t.elapsed().as_secs_f64() * 1e6;
            if is_backed(i) {
                d.push(us)
            } else {
                m.push(us)
            }
        }
        mem_us.push(median(m));
        disk_us.push(median(d));
    }
    let (m, d) = (median(mem_us), median(disk_us));
    println!();
    println!(
        "read latency, median over {reps} rounds of per-read medians: in memory (lz4) {m:.2} µs, \
         written back ({backed} pages, O_DIRECT {}) {d:.1} µs, ratio {:.0}×",
        dev.backing().unwrap().direct(),
        d / m
    );
    drop(dev);
    let _ = std::fs::remove_file(&backing);
}

/// Stores `gib` GiB of `pages` (cycled, each copy as written by a guest) in a
/// `size_gib` GiB device with state under `root`, drops it as a crash would
/// leave it (no cleanup runs for the files), and times opening it again.
fn recovery(pages: &[Page], gib: u64, size_gib: u64, root: &std::path::Path, reps: usize) {
    let n = (gib << 30) / PAGE_SIZE as u64;
    let spec = |fresh: bool| StateSpec {
        root: root.to_path_buf(),
        name: "recovery".into(),
        existing: if fresh {
            vzram_store::Existing::Discard
        } else {
            vzram_store::Existing::Recover
        },
        ..StateSpec::default()
    };
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let mut cfg = DeviceConfig::new(size_gib << 30, Codec::Lz4);
    cfg.state = Some(spec(true));
    let dev = pool.create_device(cfg.clone()).unwrap();
    let mut cx = Context::new(0);
    let t = Instant::now();
    // Spread over the device as swap is: every fourth slot of a 16 GiB
    // device for 4 GiB.
    let stride = (size_gib / gib).max(1);
    for (i, p) in pages.iter().cycle().take(n as usize).enumerate() {
        dev.write_page(&mut cx, i as u64 * stride, p).unwrap();
    }
    let fill = t.elapsed().as_secs_f64();
    let before = dev.stats();
    drop(dev);
    let mut times = Vec::new();
    for _ in 0..reps {
        cfg.state = Some(spec(false));
        let t = Instant::now();
        let dev = pool.create_device(cfg.clone()).unwrap();
        times.push(t.elapsed().as_secs_f64());
        let rec = dev.recovery().unwrap();
        let after = dev.stats();
        assert_eq!(after.orig_data_size, before.orig_data_size);
        assert_eq!(after.compr_data_size, before.compr_data_size);
        println!(
            "recovered {} slots, {} spans, mem_used {:.0} MiB, in {:.3} s (recover() {:.3} s)",
            rec.slots,
            rec.spans,
            after.mem_used_total as f64 / (1u64 << 20) as f64,
            t.elapsed().as_secs_f64(),
            rec.micros as f64 / 1e6
        );
    }
    println!(
        "| {size_gib} GiB device holding {gib} GiB ({} pages, compr {:.0} MiB) | fill {fill:.1} s | recovery median {:.3} s of {reps} |",
        n,
        before.compr_data_size as f64 / (1u64 << 20) as f64,
        median(times)
    );
    let _ = std::fs::remove_dir_all(root.join("recovery"));
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let default_data = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/data/anon-pages.bin"
    );
    let (pages, source) = if args.iter().any(|a| a == "--synthetic") {
        (synthetic(16384), "synthetic mix".to_string())
    } else {
        let path = arg("--data").unwrap_or_else(|| default_data.to_string());
        if std::path::Path::new(&path).exists() {
            (load(&path), path)
        } else {
            eprintln!("{path} not found; using the synthetic mix");
            (synthetic(16384), "synthetic mix".to_string())
        }
    };
    let copies: usize = arg("--copies").map_or(4, |s| s.parse().unwrap());
    let reps: usize = arg("--reps").map_or(5, |s| s.parse().unwrap());
    let threshold: usize = arg("--huge-threshold")
        .map_or(vzram_store::device::DEFAULT_HUGE_THRESHOLD, |s| {
            s.parse().unwrap()
        });
    let state = arg("--state").map(std::path::PathBuf::from);
    let clock = Clock {
        cpu: args.iter().any(|a| a == "--cpu-time"),
    };
    if let Some(dir) = arg("--tier") {
        let hot: u64 = arg("--hot").map_or(20, |s| s.parse().unwrap());
        let second: Codec =
            arg("--recompress-algo").map_or(Codec::Zstd { level: 3 }, |s| s.parse().unwrap());
        tier(
            &pages,
            copies,
            reps,
            hot,
            second,
            std::path::Path::new(&dir),
        );
        return;
    }
    if let Some(spec) = arg("--recovery") {
        let (gib, size) = spec.split_once(':').expect("--recovery GIB:SIZE_GIB");
        let root = state.expect("--recovery needs --state DIR");
        recovery(
            &pages,
            gib.parse().unwrap(),
            size.parse().unwrap(),
            &root,
            reps,
        );
        return;
    }
    let zero = pages.iter().filter(|p| same_filled(p).is_some()).count();
    println!(
        "data: {source}: {} pages ({} same-filled); device = {copies} copies; median of {reps}; 1 thread; state {}; {}",
        pages.len(),
        zero,
        state
            .as_ref()
            .map_or("in anonymous memory".to_string(), |p| format!("in files under {}", p.display())),
        if clock.cpu { "MB/s per CPU second of the thread" } else { "MB/s of wall time" }
    );
    println!();
    println!("| codec | raw compress MB/s | store write MB/s | write/raw | store overwrite MB/s | overwrite/raw | raw decompress MB/s | store read MB/s | read/raw | raw ratio | store ratio | mem_used/compr | meta B/slot | same | huge |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let codecs = match arg("--algo") {
        Some(a) => vec![a.parse().unwrap()],
        None => vec![Codec::Lz4, Codec::Zstd { level: 1 }],
    };
    for codec in codecs {
        let r = bench(
            codec,
            &pages,
            copies,
            reps,
            threshold,
            state.as_deref(),
            clock,
        );
        println!(
            "| {} | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.3} | {:.2} | {} | {} |",
            r.codec,
            r.raw_c,
            r.w,
            r.w / r.raw_c,
            r.ow,
            r.ow / r.raw_c,
            r.raw_d,
            r.r,
            r.r / r.raw_d,
            r.raw_ratio,
            r.ratio,
            r.mem_over_compr,
            r.meta_per_slot,
            r.same,
            r.huge
        );
    }
    if let Some(root) = &state {
        let _ = std::fs::remove_dir_all(root.join("bench"));
    }
}
