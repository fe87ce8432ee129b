//! The compress pool through the real daemon: batches of writes compressed
//! off the queue thread still complete, commit and read back in the order
//! the guest submitted them.

use blkio::ReqFlags;
use vzram_tests::*;

/// A daemon with one 16 MiB device; `threads` "" leaves
/// `--compress-threads` out (the default).
fn start(tag: &str, queues: usize, threads: &str) -> (TempDir, Daemon, Client) {
    let dir = TempDir::new(tag);
    let sock = dir.join("d.sock");
    let q = queues.to_string();
    // Staging off: these tests are about the pool's jobs, and a device
    // that stages stores multi-page writes on the queue thread while its
    // budget has room.
    let mut args = vec![
        "--socket",
        s(&sock),
        "--size",
        "16M",
        "--queues",
        &q,
        "--staging",
        "0",
    ];
    if !threads.is_empty() {
        args.extend(["--compress-threads", threads]);
    }
    let d = Daemon::start(&dir, &args, &[&sock]);
    let c =
        Client::connect(&sock, queues).unwrap_or_else(|e| panic!("connect: {e}\n{}", d.log_text()));
    (dir, d, c)
}

/// A page that compresses and names its (seed, slot).
fn page(seed: u64, slot: u64) -> Vec<u8> {
    pattern(seed, slot * PAGE as u64, PAGE)
}

/// Threads of the device's worker named `vzram-compress-*`, once there
/// are `want` (a new thread names itself when it first runs), or what there
/// are after 5 s.
fn compress_threads(d: &Daemon, want: usize) -> usize {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let n = d.compress_tasks().len();
        if n == want || std::time::Instant::now() > until {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Submits `writes` (first slot, seed, pages) and then `reads` of single
/// slots in one go, in that order, each from its own part of the queue's
/// buffer; waits for all. Returns what each read got. Page `k` of a write
/// holds `page(seed, first + k)`.
fn batch(q: &mut Queue, writes: &[(u64, u64, usize)], reads: &[u64]) -> Vec<Vec<u8>> {
    let base = q.buf_ptr();
    let mut at_page = 0;
    for (i, &(slot, seed, pages)) in writes.iter().enumerate() {
        for k in 0..pages {
            let b = (at_page + k) * PAGE;
            q.buf()[b..b + PAGE].copy_from_slice(&page(seed, slot + k as u64));
        }
        // SAFETY: inside the queue's slice of the buffer (the copies checked it).
        let at = unsafe { base.add(at_page * PAGE) };
        q.raw()
            .write(slot * PAGE as u64, at, pages * PAGE, i, ReqFlags::empty());
        at_page += pages;
    }
    let rbase = at_page * PAGE;
    for (j, &slot) in reads.iter().enumerate() {
        q.buf()[rbase + j * PAGE..rbase + (j + 1) * PAGE].fill(0xa5);
        // SAFETY: as above.
        let at = unsafe { base.add(rbase + j * PAGE) };
        q.raw().read(
            slot * PAGE as u64,
            at,
            PAGE,
            writes.len() + j,
            ReqFlags::empty(),
        );
    }
    let mut seen = vec![false; writes.len() + reads.len()];
    for _ in 0..seen.len() {
        let (id, ret) = q.wait_one();
        assert_eq!(ret, 0, "request {id} failed");
        assert!(!seen[id], "request {id} completed twice");
        seen[id] = true;
    }
    (0..reads.len())
        .map(|j| q.buf()[rbase + j * PAGE..rbase + (j + 1) * PAGE].to_vec())
        .collect()
}

/// Pages of a write: mostly big enough for the pool, some single pages
/// that run on the queue thread between them.
fn pages_of(rng: &mut Rng) -> usize {
    [1, 4, 5, 8, 16][rng.below(5) as usize]
}

/// QD32 random writes of 1 to 16 pages on two queues at once, ranges
/// drawn with overlaps, each queue reading back its region as it goes and
/// all of it at the end: the last write submitted to a slot is what it
/// holds.
#[test]
fn qd32_random_writes_on_two_queues_read_back_the_last_submitted() {
    let (_dir, d, mut c) = start("qd32", 2, "2");
    assert_eq!(compress_threads(&d, 2.min(num_cpus())), 2.min(num_cpus()));
    let sleeps = d.pool_sleeps();
    let pooled = d.stat().sole().stats.pool_pages;
    const SLOTS: u64 = 512; // per queue
    std::thread::scope(|sc| {
        for (qi, q) in c.queues.iter_mut().enumerate() {
            sc.spawn(move || {
                let first = qi as u64 * SLOTS;
                let mut model = vec![None::<(u64, u64)>; SLOTS as usize];
                let mut rng = Rng::new(qi as u64 + 7);
                for round in 0..100u64 {
                    let writes: Vec<(u64, u64, usize)> = (0..32)
                        .map(|i| {
                            let n = pages_of(&mut rng);
                            let at = first + rng.below(SLOTS - n as u64 + 1);
                            (at, round * 64 + i + 1, n)
                        })
                        .collect();
                    let check: Vec<u64> = (0..4).map(|_| first + rng.below(SLOTS)).collect();
                    for &(at, seed, n) in &writes {
                        for k in 0..n as u64 {
                            model[(at + k - first) as usize] = Some((seed, at + k));
                        }
                    }
                    let got = batch(q, &writes, &check);
                    for (slot, g) in check.iter().zip(got) {
                        let want = match model[(slot - first) as usize] {
                            Some((seed, s)) => page(seed, s),
                            None => vec![0; PAGE],
                        };
                        assert!(g == want, "queue {qi} round {round} slot {slot}");
                    }
                }
                for (k, m) in model.iter().enumerate() {
                    let slot = first + k as u64;
                    let got = q.read(slot * PAGE as u64, PAGE).unwrap();
                    let want = m.map_or(vec![0; PAGE], |(seed, s)| page(seed, s));
                    assert!(got == want, "queue {qi} slot {slot} at the end");
                }
            });
        }
    });
    let st = d.stat();
    assert_eq!(
        st.sole().stats.failed_writes + st.sole().stats.failed_reads,
        0
    );
    assert!(d.pool_sleeps() > sleeps, "the pool threads never woke");
    assert!(
        d.stat().sole().stats.pool_pages > pooled,
        "the pool threads compressed none of the pages"
    );
}

/// Many overlapping writes to a few slots in one submission, single pages
/// and pooled multi-page ones, with reads after them: the pool may finish
/// them in any order, but each read sees the writes submitted before it
/// and each slot ends with the last one. Same with the pool off
/// (compression on the queue thread).
#[test]
fn overwrites_in_one_batch_keep_the_submission_order() {
    for threads in ["2", "0"] {
        let (_dir, d, mut c) = start(&format!("order{threads}"), 1, threads);
        let expect_threads = if threads == "0" { 0 } else { 2.min(num_cpus()) };
        assert_eq!(compress_threads(&d, expect_threads), expect_threads);
        let sleeps = d.pool_sleeps();
        let q = c.q(0);
        let mut rng = Rng::new(3);
        for round in 0..60u64 {
            // 48 writes over slots 0..20: each slot is written many times.
            let writes: Vec<(u64, u64, usize)> = (0..48)
                .map(|i| {
                    let n = pages_of(&mut rng).min(8);
                    (rng.below(21 - n as u64), round * 100 + i + 1, n)
                })
                .collect();
            let slots: Vec<u64> = (0..20).collect();
            let got = batch(q, &writes, &slots);
            for (slot, g) in got.iter().enumerate() {
                let slot = slot as u64;
                let want = match writes
                    .iter()
                    .rev()
                    .find(|w| (w.0..w.0 + w.2 as u64).contains(&slot))
                {
                    Some(w) => page(w.1, slot),
                    // Not written this round: what the rounds before left.
                    None => continue,
                };
                assert!(
                    *g == want,
                    "threads {threads} round {round}: slot {slot} does not hold its last write"
                );
            }
        }
        // A read submitted between two writes of a slot sees the first.
        let got = batch(q, &[(9, 1, 4)], &[9]);
        assert!(got[0] == page(1, 9));
        let st = d.stat();
        assert_eq!(st.sole().stats.failed_writes, 0, "threads {threads}");
        if threads != "0" {
            assert!(d.pool_sleeps() > sleeps, "the pool threads never woke");
        }
    }
}

/// With nothing to do, the pool's threads sleep and the queue thread stops
/// polling its ring (`--poll-us`, on by default): the worker uses (almost)
/// no CPU while idle after a burst of writes.
#[test]
fn an_idle_pool_does_not_spin() {
    let (_dir, d, mut c) = start("idle", 1, "2");
    let q = c.q(0);
    let writes: Vec<(u64, u64, usize)> = (0..16).map(|i| (i * 8, i + 1, 8)).collect();
    batch(q, &writes, &[]);
    let pid = d.sole_worker_pid();
    let ticks = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<u64> = after
            .split_whitespace()
            .map(|x| x.parse().unwrap_or(0))
            .collect();
        // utime and stime: fields 14 and 15, i.e. 11 and 12 after the name.
        f[11] + f[12]
    };
    let before = ticks();
    std::thread::sleep(std::time::Duration::from_secs(2));
    let used = ticks() - before;
    // A spinning thread would use ~200 ticks in 2 s; a sleeping pool, ~0.
    assert!(used < 20, "the idle worker used {used} ticks in 2 s");
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Without `--compress-threads` a worker has a pool: a thread per core but
/// one (the queue thread's), 1 to 4, and multi-page writes go to it.
#[test]
fn the_default_pool_leaves_a_core_to_the_queue_thread_and_has_one_to_four() {
    let (_dir, d, mut c) = start("default", 1, "");
    let want = num_cpus().saturating_sub(1).clamp(1, 4);
    assert_eq!(compress_threads(&d, want), want);
    let sleeps = d.pool_sleeps();
    let writes: Vec<(u64, u64, usize)> = (0..64).map(|i| (i * 16 % 4000, i + 1, 16)).collect();
    batch(c.q(0), &writes, &[]);
    assert!(d.pool_sleeps() > sleeps, "the pool threads never woke");
}
