//! Crash test: a child process runs a random workload against a device whose
//! state lives in files, while a thread of its own compacts; the parent
//! SIGKILLs it at a random moment, recovers the device from its files, and
//! checks every slot against a model: each holds exactly what the finished
//! operations left, or, for the one operation under way, its new content.
//! Nothing torn, nothing lost, nothing from another slot. The next child
//! goes on from the recovered state, so recovery is tested after recovery.
//!
//! `VZRAM_CRASH_KILLS` sets the number of kills (default 25),
//! `VZRAM_CRASH_SEED` the seed; the seed is printed so a failure replays.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vzram_store::{Codec, Context, Device, DeviceConfig, Pool, PoolConfig, StateSpec, PAGE_SIZE};

const SLOTS: u64 = 384;
const OPS: usize = 20_000;
const CHILD_ENV: &str = "VZRAM_CRASH_CHILD";

struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

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
}

fn ops(seed: u64) -> Vec<Op> {
    let mut r = Rng(seed | 1);
    (0..OPS)
        .map(|_| {
            let slot = r.below(SLOTS);
            match r.below(10) {
                0..=5 => Op::Write {
                    slot,
                    seed: r.next_u64(),
                },
                6 | 7 => {
                    let off = r.below(PAGE_SIZE as u64) as usize;
                    let len = 1 + r.below((PAGE_SIZE - off) as u64) as usize;
                    Op::Partial {
                        slot,
                        off,
                        len,
                        seed: r.next_u64(),
                    }
                }
                8 => {
                    let off = r.below(PAGE_SIZE as u64) as usize;
                    let len = 1 + r.below((PAGE_SIZE - off) as u64) as usize;
                    Op::Zero { slot, off, len }
                }
                _ => Op::Discard {
                    start: slot,
                    len: (1 + r.below(6)).min(SLOTS - slot),
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
    }
}

fn touched(op: Op) -> std::ops::Range<u64> {
    match op {
        Op::Write { slot, .. } | Op::Partial { slot, .. } | Op::Zero { slot, .. } => slot..slot + 1,
        Op::Discard { start, len } => start..start + len,
    }
}

fn run(dev: &Device, cx: &mut Context, op: Op) {
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
    };
    r.unwrap_or_else(|e| panic!("{op:?}: {e}"));
}

fn open(root: &Path) -> (std::sync::Arc<Pool>, std::sync::Arc<Device>) {
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let mut cfg = DeviceConfig::new(SLOTS * PAGE_SIZE as u64, Codec::Lz4);
    cfg.shards = 2;
    cfg.state = Some(StateSpec {
        root: root.to_path_buf(),
        name: "crash".into(),
        fresh: false,
    });
    let dev = pool.create_device(cfg).unwrap();
    (pool, dev)
}

/// The child: recover, then run the ops, printing the index of each one
/// done, with a thread compacting meanwhile, until killed.
#[test]
fn crash_child() {
    let Ok(arg) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (root, seed) = arg.split_once(':').unwrap();
    let (_pool, dev) = open(Path::new(root));
    let d2 = dev.clone();
    std::thread::spawn(move || loop {
        d2.compact();
        std::thread::yield_now();
    });
    let out = std::io::stdout();
    // Ops alternate between the device's two shards, as two queues would.
    let mut cx = [Context::new(0), Context::new(1)];
    for (i, op) in ops(seed.parse().unwrap()).into_iter().enumerate() {
        run(&dev, &mut cx[i % 2], op);
        use std::io::Write;
        // One line per op, flushed: the parent must know what finished.
        let mut o = out.lock();
        writeln!(o, "{i}").unwrap();
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
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(root.clone());
    let mut model = vec![vec![0u8; PAGE_SIZE]; SLOTS as usize];
    let mut rng = Rng(seed | 1);
    let exe = std::env::current_exe().unwrap();
    let (mut total_ops, mut unlocked, mut in_flight_new) = (0usize, 0u64, 0usize);
    let mut recover_us = Vec::new();
    for k in 0..kills {
        let child_seed = rng.next_u64();
        let list = ops(child_seed);
        // Kill after a random number of finished ops, sometimes at once
        // (during recovery or the first write).
        let kill_after = match rng.below(8) {
            0 => 0,
            _ => 1 + rng.below(3000) as usize,
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
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut done: Option<usize> = None;
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut lines = BufReader::new(stdout).lines();
        if kill_after == 0 {
            // A few milliseconds in: during recovery or the first ops.
            std::thread::sleep(Duration::from_micros(rng.below(20_000)));
        } else {
            for line in lines.by_ref() {
                let Ok(line) = line else { break };
                let Ok(i) = line.trim().parse::<usize>() else {
                    continue;
                };
                done = Some(i);
                if i + 1 >= kill_after || Instant::now() > deadline {
                    break;
                }
            }
        }
        // SAFETY: kill sends a signal to our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
        let status = child.wait().unwrap();
        // Everything it printed before dying finished.
        for line in lines {
            if let Ok(i) = line.unwrap_or_default().trim().parse::<usize>() {
                done = Some(i);
            }
        }
        if kill_after > 0 && done.is_none() {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
            panic!("kill {k}: the child did nothing ({status:?}):\n{err}");
        }
        let finished = done.map_or(0, |i| i + 1);
        total_ops += finished;
        for &op in &list[..finished] {
            apply(&mut model, op);
        }
        // The op that may have been under way.
        let mut newer = model.clone();
        let pending = list.get(finished).copied();
        if let Some(op) = pending {
            apply(&mut newer, op);
        }

        let (pool, dev) = open(&root);
        // Only the first child can die before its state is in place (from
        // then on the state exists): then this open made it, empty.
        match dev.recovery() {
            Some(rec) => {
                unlocked += rec.unlocked;
                recover_us.push(rec.micros);
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
        // The recovered heap works: write, compact and read back.
        let probe = page(0, 0xfeed ^ k as u64);
        dev.write_page(cx, 0, probe[..].try_into().unwrap())
            .unwrap();
        dev.compact();
        dev.read_page(cx, 0, &mut buf).unwrap();
        assert!(buf[..] == probe[..], "kill {k}: probe write lost");
        model[0] = probe;
        for s in 1..SLOTS {
            dev.read_page(cx, s, &mut buf).unwrap();
            assert!(
                buf[..] == model[s as usize][..],
                "kill {k}: slot {s} changed by compaction"
            );
        }
        drop(dev);
        drop(pool);
    }
    recover_us.sort_unstable();
    eprintln!(
        "{kills} kills, {total_ops} ops finished, {in_flight_new} cut-short ops found done, {unlocked} locked words unlocked, recovery median {} us",
        recover_us.get(recover_us.len() / 2).copied().unwrap_or(0)
    );
}
