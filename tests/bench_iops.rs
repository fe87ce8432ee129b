//! A quick IOPS measurement: 4 KiB random reads and writes at queue depth
//! 32 per queue, with 1 and 2 queues, through blkio. Not a benchmark suite
//! (that is `vzram-bench`); a sanity number for a change to the I/O path.
//!
//! ```text
//! cargo test --release --test bench_iops -- --ignored --nocapture
//! ```
//! Data: the pages of `../shared/data/anon-pages.bin` if present, else a
//! synthetic mix (a quarter zero pages, half text-like, a quarter random).

use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use blkio::{Completion, ReqFlags};
use vzram_tests::*;

const DEPTH: usize = 32;
const SPAN: u64 = 256 << 20;
const RUN: Duration = Duration::from_secs(2);
/// Runs per configuration; the median is reported (a 2-core host schedules
/// client and daemon threads unevenly from run to run).
const REPS: usize = 3;

fn data_pages() -> (Vec<u8>, &'static str) {
    let path = root().join("../shared/data/anon-pages.bin");
    if let Ok(mut d) = std::fs::read(&path) {
        d.truncate(d.len() / PAGE * PAGE);
        d.truncate(SPAN as usize);
        if !d.is_empty() {
            return (d, "anon-pages.bin");
        }
    }
    let pages = 4096;
    let mut d = Vec::with_capacity(pages * PAGE);
    for p in 0..pages as u64 {
        match p % 4 {
            0 => d.extend(std::iter::repeat_n(0u8, PAGE)),
            3 => d.extend(noise(p, PAGE)),
            _ => {
                d.extend((0..PAGE).map(|i| {
                    b"the quick brown fox jumps over the lazy dog; "[(i + p as usize) % 45]
                }))
            }
        }
    }
    (d, "synthetic mix")
}

struct Xs(u64);
impl Xs {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Runs QD32 on one queue for `RUN`; returns completed requests.
fn drive(q: &mut Queue, write: bool, data: &[u8], seed: u64) -> u64 {
    let mut rng = Xs(seed | 1);
    let pages = SPAN / PAGE as u64;
    let data_pages = (data.len() / PAGE) as u64;
    let base = q.buf_ptr();
    let submit = |q: &mut Queue, slot: usize, rng: &mut Xs| {
        let off = rng.next() % pages * PAGE as u64;
        // SAFETY: slot < DEPTH and DEPTH pages fit in the queue's buffer.
        let buf = unsafe { base.add(slot * PAGE) };
        if write {
            let src = (rng.next() % data_pages) as usize * PAGE;
            // SAFETY: as above; the source is a whole page of `data`.
            unsafe { std::ptr::copy_nonoverlapping(data[src..].as_ptr(), buf, PAGE) };
            q.raw().write(off, buf, PAGE, slot, ReqFlags::empty());
        } else {
            q.raw().read(off, buf, PAGE, slot, ReqFlags::empty());
        }
    };
    for slot in 0..DEPTH {
        submit(q, slot, &mut rng);
    }
    let mut done = 0u64;
    let mut inflight = DEPTH;
    let start = Instant::now();
    let mut comps = [const { MaybeUninit::<Completion>::uninit() }; DEPTH];
    while inflight > 0 {
        let mut t = Duration::from_secs(30);
        let n = q
            .raw()
            .do_io(&mut comps, 1, Some(&mut t), None)
            .expect("do_io");
        assert!(n > 0, "no completion in 30 s");
        let stop = start.elapsed() >= RUN;
        for c in &comps[..n] {
            // SAFETY: do_io filled the first n.
            let c = unsafe { c.assume_init_read() };
            assert_eq!(c.ret, 0, "request failed");
            done += 1;
            if stop {
                inflight -= 1;
            } else {
                submit(q, c.user_data, &mut rng);
            }
        }
    }
    done
}

#[test]
#[ignore = "measurement; run with --ignored --nocapture, preferably --release"]
fn iops_4k_random_qd32() {
    let (data, what) = data_pages();
    let dir = TempDir::new("iops");
    let sock = dir.join("d.sock");
    let d = Daemon::start(
        &dir,
        &[
            "--socket",
            sock.to_str().unwrap(),
            "--size",
            "1G",
            "--queues",
            "2",
        ],
        &[&sock],
    );
    let mut c = Client::connect(&sock, 2).unwrap();
    // Fill the span so reads decompress real pages.
    let chunk = QUEUE_BUF;
    for (i, at) in (0..SPAN).step_by(chunk).enumerate() {
        let src = (i * chunk) % data.len();
        let mut piece = data[src..].to_vec();
        while piece.len() < chunk {
            piece.extend_from_slice(&data[..(chunk - piece.len()).min(data.len())]);
        }
        c.q(0).write(at, &piece[..chunk]).unwrap();
    }
    let st = d.stat();
    let (orig, used) = (
        st.sole().stats.orig_data_size,
        st.sole().stats.mem_used_total,
    );
    println!(
        "data: {what}; {} MiB stored in {} MiB (ratio {:.2})",
        orig >> 20,
        used >> 20,
        orig as f64 / used as f64
    );
    for nq in [1usize, 2] {
        for write in [false, true] {
            let mut runs: Vec<f64> = (0..REPS)
                .map(|_| {
                    let t = Instant::now();
                    let total: u64 = std::thread::scope(|sc| {
                        let data = &data;
                        let handles: Vec<_> = c
                            .queues
                            .iter_mut()
                            .take(nq)
                            .enumerate()
                            .map(|(i, q)| sc.spawn(move || drive(q, write, data, 7 + i as u64)))
                            .collect();
                        handles.into_iter().map(|h| h.join().unwrap()).sum()
                    });
                    total as f64 / t.elapsed().as_secs_f64()
                })
                .collect();
            runs.sort_by(f64::total_cmp);
            println!(
                "4k rand{} QD{DEPTH} x {nq} queue(s): median {:>8.0} IOPS (runs: {})",
                if write { "write" } else { "read " },
                runs[REPS / 2],
                runs.iter()
                    .map(|r| format!("{r:.0}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
}
