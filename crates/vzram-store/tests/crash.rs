//! Crash test: a child process runs a random workload against a device whose
//! state lives in files, while threads of its own compact and tier (mark
//! idle, age, write back, recompress); the parent SIGKILLs it at a random
//! moment, recovers the device from its files, and checks every slot
//! against a model: each holds exactly what the finished operations left,
//! or, for the one operation under way, its new content. Nothing torn,
//! nothing lost, nothing from another slot. The next child goes on from the
//! recovered state, so recovery is tested after recovery.
//!
//! The device has a small memory limit and a backing file on a real file
//! system (O_DIRECT), the same file across kills: most writes spill pages
//! to it, the workload writes pages back and recompresses them itself, and
//! recovery must find every written-back page in the file it left it in.
//!
//! `VZRAM_CRASH_KILLS` sets the number of kills (default 25),
//! `VZRAM_CRASH_SEED` the seed; the seed is printed so a failure replays.

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vzram_store::{
    BackingSpec, Codec, Context, Device, DeviceConfig, Filter, Pool, PoolConfig, StateSpec,
    StoreError, PAGE_SIZE,
};

mod common;
use common::{mix, Rng};

const SLOTS: u64 = 384;
const OPS: usize = 20_000;
const CHILD_ENV: &str = "VZRAM_CRASH_CHILD";
const BACKING_ENV: &str = "VZRAM_CRASH_BACKING";
/// Pool memory the device may use: a fraction of what its pages need, so
/// most writes find the limit reached and spill.
const MEM_LIMIT: u64 = 32 * PAGE_SIZE as u64;
/// Raw staging budget: pages of whole-page writes stored raw at first.
const STAGING: u64 = 16 * PAGE_SIZE as u64;
/// Blocks of the backing file: fewer than the slots, so it fills at times.
const BACKING_BLOCKS: u64 = 224;
/// The exit status of a child whose tiering thread met an error it must not.
const TIER_FAILED: i32 = 3;

#[derive(Debug, Clone, Copy)]
enum Op {
    Write {
        slot: u64,
        seed: u64,
    },
    Partial {
        slot: u64,
        off: usize,
        len: usize,
        seed: u64,
    },
    Zero {
        slot: u64,
        off: usize,
        len: usize,
    },
    Discard {
        start: u64,
        len: u64,
    },
    // Tiering: no content changes, only where the pages are.
    MarkIdle,
    Age,
    Writeback {
        filter: u8,
        max: u64,
    },
    Recompress {
        filter: u8,
        level: i32,
    },
}

/// A tiering filter from four random bits.
fn filter(bits: u64) -> Filter {
    Filter {
        idle: bits & 1 != 0,
        cold: bits & 2 != 0,
        huge: bits & 4 != 0,
        incompressible: bits & 8 != 0,
    }
}

fn ops(seed: u64) -> Vec<Op> {
    let mut r = Rng(seed | 1);
    (0..OPS)
        .map(|_| {
            let slot = r.below(SLOTS);
            match r.below(40) {
                0..=23 => Op::Write {
                    slot,
                    seed: r.next_u64(),
                },
                24..=30 => {
                    let off = r.below(PAGE_SIZE as u64) as usize;
                    let len = 1 + r.below((PAGE_SIZE - off) as u64) as usize;
                    Op::Partial {
                        slot,
                        off,
                        len,
                        seed: r.next_u64(),
                    }
                }
                31..=33 => {
                    let off = r.below(PAGE_SIZE as u64) as usize;
                    let len = 1 + r.below((PAGE_SIZE - off) as u64) as usize;
                    Op::Zero { slot, off, len }
                }
                34..=36 => Op::Discard {
                    start: slot,
                    len: (1 + r.below(6)).min(SLOTS - slot),
                },
                37 => [Op::MarkIdle, Op::Age][r.below(2) as usize],
                38 => Op::Writeback {
                    filter: r.below(16) as u8,
                    max: 1 + r.below(64),
                },
                _ => Op::Recompress {
                    filter: r.below(16) as u8,
                    level: r.below(6) as i32,
                },
            }
        })
        .collect()
}

/// Page contents of several shapes (same-filled, compressible, raw), each
/// naming its slot so that a page in the wrong slot shows.
fn page(slot: u64, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    let mut p = vec![0u8; PAGE_SIZE];
    match seed % 4 {
        0 => p.fill(seed as u8),
        1 => {
            for (i, b) in p.iter_mut().enumerate() {
                *b = b"a swapped out page "[(i + seed as usize) % 19];
            }
        }
        2 => p.iter_mut().for_each(|b| *b = r.next_u64() as u8),
        _ => {
            let n = r.below(PAGE_SIZE as u64) as usize;
            p[..n].iter_mut().for_each(|b| *b = r.next_u64() as u8);
        }
    }
    if !seed.is_multiple_of(4) {
        p[..8].copy_from_slice(&slot.to_le_bytes());
    }
    p
}

fn apply(model: &mut [Vec<u8>], op: Op) {
    match op {
        Op::Write { slot, seed } => model[slot as usize] = page(slot, seed),
        Op::Partial {
            slot,
            off,
            len,
            seed,
        } => {
            let src = page(slot, seed);
            model[slot as usize][off..off + len].copy_from_slice(&src[..len]);
        }
        Op::Zero { slot, off, len } => model[slot as usize][off..off + len].fill(0),
        Op::Discard { start, len } => {
            for s in start..start + len {
                model[s as usize].fill(0);
            }
        }
        Op::MarkIdle | Op::Age | Op::Writeback { .. } | Op::Recompress { .. } => {}
    }
}

fn touched(op: Op) -> std::ops::Range<u64> {
    match op {
        Op::Write { slot, .. } | Op::Partial { slot, .. } | Op::Zero { slot, .. } => slot..slot + 1,
        Op::Discard { start, len } => start..start + len,
        Op::MarkIdle | Op::Age | Op::Writeback { .. } | Op::Recompress { .. } => 0..0,
    }
}

/// The codec a recompression uses: zstd levels 1 to 5, or lz4 (level 0),
/// which only tries pages stored raw.
fn recompress_codec(level: i32) -> Codec {
    match level {
        0 => Codec::Lz4,
        level => Codec::Zstd { level },
    }
}

/// Runs one op; false if the store refused it, leaving the content as it
/// was (a write that found memory and the backing file full).
fn run(dev: &Device, cx: &mut Context, op: Op) -> bool {
    let r = match op {
        Op::Write { slot, seed } => {
            dev.write_page(cx, slot, page(slot, seed)[..].try_into().unwrap())
        }
        Op::Partial {
            slot,
            off,
            len,
            seed,
        } => dev.write_partial(cx, slot, off, &page(slot, seed)[..len]),
        Op::Zero { slot, off, len } => dev.zero_partial(cx, slot, off, len),
        Op::Discard { start, len } => dev.discard(cx, start..start + len),
        Op::MarkIdle => {
            dev.mark_idle();
            Ok(())
        }
        Op::Age => {
            dev.age();
            Ok(())
        }
        Op::Writeback { filter: f, max } => dev.writeback(filter(f.into()), Some(max)).map(|_| ()),
        Op::Recompress { filter: f, level } => dev
            .recompress(filter(f.into()), recompress_codec(level))
            .map(|_| ()),
    };
    match r {
        Ok(()) => true,
        // The backing file is full: a write keeps its old content, a
        // writeback keeps the rest in memory.
        Err(StoreError::BackingFull) => false,
        // Recompression allocates before it frees: at the limit it stops.
        Err(StoreError::DeviceLimit) if matches!(op, Op::Recompress { .. }) => false,
        Err(e) => panic!("{op:?}: {e}"),
    }
}

fn open(root: &Path, backing: &Path) -> (std::sync::Arc<Pool>, std::sync::Arc<Device>) {
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let mut cfg = DeviceConfig::new(SLOTS * PAGE_SIZE as u64, Codec::Lz4);
    cfg.shards = 2;
    cfg.mem_limit = MEM_LIMIT;
    cfg.state = Some(StateSpec {
        root: root.to_path_buf(),
        name: "crash".into(),
        ..StateSpec::default()
    });
    cfg.backing = Some(BackingSpec {
        path: backing.to_path_buf(),
    });
    // Whole-page writes are staged raw, and compressed by a thread of the
    // child's: kills land while pages are staged and while they compress.
    cfg.staging_bytes = STAGING;
    let dev = pool.create_device(cfg).unwrap();
    (pool, dev)
}

/// The child: recover, then run the ops, printing the index of each one
/// done (and whether the store refused it), with a thread compacting and
/// one tiering meanwhile, until killed.
#[test]
fn crash_child() {
    let Ok(arg) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (root, seed) = arg.split_once(':').unwrap();
    let seed: u64 = seed.parse().unwrap();
    let backing = PathBuf::from(std::env::var_os(BACKING_ENV).unwrap());
    let (_pool, dev) = open(Path::new(root), &backing);
    let d2 = dev.clone();
    std::thread::spawn(move || loop {
        d2.compact();
        std::thread::yield_now();
    });
    let d4 = dev.clone();
    std::thread::spawn(move || {
        let cx = &mut Context::new(1);
        loop {
            if d4.compress_staged(cx, 4) == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    });
    // Tiering beside the writes, as the daemon's control thread does it,
    // paced so that the writes still get most of the time.
    let d3 = dev.clone();
    std::thread::spawn(move || {
        let mut r = Rng(mix(seed));
        loop {
            let f = filter(r.next_u64());
            let res = match r.below(6) {
                0 => {
                    d3.mark_idle();
                    Ok(())
                }
                1 => {
                    d3.age();
                    Ok(())
                }
                2 | 3 => d3.writeback(f, Some(1 + r.below(48))).map(|_| ()),
                _ => d3
                    .recompress(f, recompress_codec(r.below(6) as i32))
                    .map(|_| ()),
            };
            match res {
                Ok(()) | Err(StoreError::BackingFull | StoreError::DeviceLimit) => {}
                Err(e) => {
                    // A panic would end only this thread.
                    eprintln!("tiering: {e}");
                    std::process::exit(TIER_FAILED);
                }
            }
            std::thread::sleep(Duration::from_micros(r.below(3000)));
        }
    });
    use std::io::Write;
    let out = std::io::stdout();
    // The test harness has printed "test crash_child ... " with no newline:
    // end that line, or the first op's would be glued to it.
    writeln!(out.lock()).unwrap();
    // Ops alternate between the device's two shards, as two queues would.
    let mut cx = [Context::new(0), Context::new(1)];
    for (i, op) in ops(seed).into_iter().enumerate() {
        let done = run(&dev, &mut cx[i % 2], op);
        // One line per op, flushed: the parent must know what finished.
        let mut o = out.lock();
        writeln!(o, "{} {i}", if done { "done" } else { "refused" }).unwrap();
        o.flush().unwrap();
    }
    // Ran out of ops before the kill: wait for it.
    std::thread::sleep(Duration::from_secs(60));
}

fn state_root() -> PathBuf {
    // tmpfs when there is one, as in production.
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    base.join(format!("vzram-crash-{}", std::process::id()))
}

/// The backing file's directory: a real file system, so O_DIRECT is used.
fn backing_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("crash-{}", std::process::id()))
}

#[test]
fn killed_at_random_points_every_slot_is_old_or_new() {
    let kills: usize = std::env::var("VZRAM_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(25);
    let seed: u64 = std::env::var("VZRAM_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("VZRAM_CRASH_SEED={seed} VZRAM_CRASH_KILLS={kills}");
    let root = state_root();
    let _ = std::fs::remove_dir_all(&root);
    struct Cleanup(Vec<PathBuf>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            for p in &self.0 {
                let _ = std::fs::remove_dir_all(p);
            }
        }
    }
    let bdir = backing_dir();
    let _ = std::fs::remove_dir_all(&bdir);
    let _cleanup = Cleanup(vec![root.clone(), bdir.clone()]);
    std::fs::create_dir_all(&bdir).unwrap();
    let backing = bdir.join("backing");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len((BACKING_BLOCKS + 1) * PAGE_SIZE as u64)
        .unwrap();
    let mut model = vec![vec![0u8; PAGE_SIZE]; SLOTS as usize];
    let mut rng = Rng(seed | 1);
    let exe = std::env::current_exe().unwrap();
    let (mut total_ops, mut unlocked, mut in_flight_new) = (0usize, 0u64, 0usize);
    let mut staged_found = 0u64;
    let (mut refused_total, mut max_backed) = (0usize, 0u64);
    let mut recover_us = Vec::new();
    for k in 0..kills {
        let child_seed = mix(rng.next_u64());
        let list = ops(child_seed);
        // Kill after a random number of finished ops, sometimes at once
        // (during recovery or the first write).
        let kill_after = match rng.below(8) {
            0 => 0,
            _ => 1 + rng.below(600) as usize,
        };
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "crash_child",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD_ENV, format!("{}:{child_seed}", root.display()))
            .env(BACKING_ENV, &backing)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut done: Option<usize> = None;
        // Ops the store refused: they left their slots as they were.
        let mut refused = std::collections::HashSet::new();
        let mut note = |line: &str, done: &mut Option<usize>| {
            let (outcome, i) = line.trim().split_once(' ').unwrap_or_default();
            let Ok(i) = i.parse::<usize>() else {
                return;
            };
            match outcome {
                "done" => {}
                "refused" => {
                    refused.insert(i);
                }
                _ => return,
            }
            *done = Some(i);
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut lines = BufReader::new(stdout).lines();
        if kill_after == 0 {
            // A few milliseconds in: during recovery or the first ops.
            std::thread::sleep(Duration::from_micros(rng.below(20_000)));
        } else {
            for line in lines.by_ref() {
                let Ok(line) = line else { break };
                note(&line, &mut done);
                if done.is_some_and(|i| i + 1 >= kill_after) || Instant::now() > deadline {
                    break;
                }
            }
        }
        // SAFETY: kill sends a signal to our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
        let status = child.wait().unwrap();
        // Everything it printed before dying finished.
        for line in lines {
            note(&line.unwrap_or_default(), &mut done);
        }
        // Only our kill may end it: a child that died of its own (an op
        // or a tiering pass failed) did not run the workload it claims.
        if status.signal() != Some(libc::SIGKILL) || (kill_after > 0 && done.is_none()) {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
            panic!("kill {k} (seed {seed}): the child ended on its own or did nothing ({status:?}):\n{err}");
        }
        let finished = done.map_or(0, |i| i + 1);
        total_ops += finished;
        refused_total += refused.len();
        for (i, &op) in list[..finished].iter().enumerate() {
            if !refused.contains(&i) {
                apply(&mut model, op);
            }
        }
        // The op that may have been under way.
        let mut newer = model.clone();
        let pending = list.get(finished).copied();
        if let Some(op) = pending {
            apply(&mut newer, op);
        }

        let (pool, dev) = open(&root, &backing);
        // Only the first child can die before its state is in place (from
        // then on the state exists): then this open made it, empty.
        match dev.recovery() {
            Some(rec) => {
                unlocked += rec.unlocked;
                recover_us.push(rec.micros);
                assert_eq!(
                    rec.backed,
                    dev.backing().unwrap().used(),
                    "kill {k}: written-back slots vs blocks in use"
                );
                assert_eq!(
                    rec.staged * PAGE_SIZE as u64,
                    dev.staged_bytes(),
                    "kill {k}: staged slots vs staged bytes"
                );
                staged_found += rec.staged;
            }
            None => assert!(
                k == 0 && finished == 0,
                "kill {k}: no state to recover after {finished} ops"
            ),
        }
        let cx = &mut Context::new(0);
        let mut buf = [0u8; PAGE_SIZE];
        let mut took_new = false;
        let mut seen = Vec::with_capacity(SLOTS as usize);
        for s in 0..SLOTS {
            dev.read_page(cx, s, &mut buf)
                .unwrap_or_else(|e| panic!("kill {k} seed {seed}: slot {s}: {e}"));
            seen.push(buf.to_vec());
            let (old, new) = (&model[s as usize], &newer[s as usize]);
            if buf[..] == old[..] {
                continue;
            }
            let in_op = pending.is_some_and(|op| touched(op).contains(&s));
            assert!(
                in_op && buf[..] == new[..],
                "kill {k} (seed {seed}, {finished} ops done, pending {pending:?}): slot {s} is neither its old nor its new content"
            );
            took_new = true;
        }
        // A discard cut short leaves some of its slots old and some new:
        // from here on each slot is what it was found to be.
        if took_new {
            in_flight_new += 1;
        }
        model = seen;
        // The rebuilt bookkeeping agrees with the slots.
        let st = dev.stats();
        let stored = model.iter().filter(|p| p.iter().any(|&b| b != 0)).count() as u64;
        assert!(
            st.orig_data_size / PAGE_SIZE as u64 >= stored,
            "kill {k}: {stored} non-zero pages but stats say {st:?}"
        );
        assert_eq!(st.mem_used_total, pool.stats().mem_used_total);
        let used = dev.backing().unwrap().used();
        assert_eq!(st.backed_pages, used, "kill {k}: {st:?}");
        max_backed = max_backed.max(used);
        // The recovered heap and block map work: write, write back (not
        // over a recovered block), compact and read back.
        let probe = page(0, 0xfeed ^ k as u64);
        match dev.write_page(cx, 0, probe[..].try_into().unwrap()) {
            Ok(()) => model[0] = probe,
            // Memory and the backing file full: slot 0 stays as it was.
            Err(StoreError::BackingFull) => {}
            Err(e) => panic!("kill {k}: probe write: {e}"),
        }
        match dev.writeback(Filter::default(), Some(8)) {
            Ok(_) | Err(StoreError::BackingFull) => {}
            Err(e) => panic!("kill {k}: writeback after recovery: {e}"),
        }
        dev.compact();
        for s in 0..SLOTS {
            dev.read_page(cx, s, &mut buf).unwrap();
            assert!(
                buf[..] == model[s as usize][..],
                "kill {k}: slot {s} changed by writeback or compaction after recovery"
            );
        }
        assert_eq!(dev.stats().backed_pages, dev.backing().unwrap().used());
        drop(dev);
        drop(pool);
    }
    recover_us.sort_unstable();
    eprintln!("{staged_found} staged pages found by recoveries");
    eprintln!(
        "{kills} kills, {total_ops} ops finished ({refused_total} refused: limit reached and backing file full), {in_flight_new} cut-short ops found done, {unlocked} locked words unlocked, up to {max_backed} pages in the backing file after a kill, recovery median {} us",
        recover_us.get(recover_us.len() / 2).copied().unwrap_or(0)
    );
}
