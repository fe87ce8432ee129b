//! Kill during I/O: every page is old or new, never anything else.
//!
//! A device is filled with version 0 of every page; each page names its
//! sector and version and has a body derived from them (same-filled,
//! incompressible, or compressible to some degree), so a torn, zeroed or
//! misplaced page is recognised. Then, round after round, a writer
//! overwrites every page with the next version at QD [`QD`] on [`QUEUES`]
//! queues, in a random order, and something is SIGKILLed at a random point
//! while its requests are in flight. After reconnecting with a fresh
//! client, each page must be exactly the version it had before the round
//! or the new one, and every write the writer saw acknowledged must read as
//! new.
//!
//! The writer is a child process, the closest thing to a VMM that
//! crashes: this test binary run again with `VZRAM_KILL_WRITER` set, which
//! makes [`writer_process`] write and print `ack SECTOR` for every write as
//! it completes. What gets killed is a [`Victim`]: the writer now; the
//! daemon (restarted with the same command line) once the daemon keeps its
//! state across a restart.
//!
//! The kill point (after how many acknowledgements) and the write order
//! come from a seed, printed; `VZRAM_KILL_SEED` replays it (the timing is
//! the scheduler's). Rounds go on for 5 s (`VZRAM_KILL_SECS`).

use std::io::{BufRead, BufReader, Write};
use std::mem::MaybeUninit;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use blkio::{Completion, ReqFlags};
use vzram_tests::*;

/// Device pages (16 MiB).
const PAGES: u64 = 4096;
const QUEUES: usize = 4;
/// Requests in flight per queue.
const QD: usize = 32;
/// Rounds at least, and at least this many where the kill left both old
/// and new pages behind.
const MIN_ROUNDS: u64 = 5;
const MIN_MIXED_ROUNDS: u64 = 2;
/// Rounds go on for this long (`VZRAM_KILL_SECS`), given the minimums.
const DEFAULT_SECS: u64 = 5;
/// Rounds at most, however the kills fall.
const MAX_ROUNDS: u64 = 1000;
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// The writer role: set to the socket to write to.
const WRITER_ENV: &str = "VZRAM_KILL_WRITER";
const WRITER_TEST: &str = "writer_process";

/// Who is SIGKILLed in the middle of the writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Victim {
    /// The writer process (the VMM): the daemon and its data live on.
    Client,
    /// The daemon; then the writer too (it lost its backend), and the daemon
    /// is started again with the same command line.
    Daemon,
}

// ---------------------------------------------------------------------------
// Pages that identify themselves: (sector, version) and a body derived
// from them.

const MAGIC: u64 = 0x4b49_4c4c_5041_4745; // "KILLPAGE"
/// Same-filled pages: bit 54 set, sector (24 bits), version (24 bits).
const SAME_TAG: u64 = 1 << 54;

fn hash(sector: u64, version: u64) -> u64 {
    mix(sector ^ mix(version ^ 0x6b69_6c6c))
}

/// Version `version` of sector `sector`.
fn page(sector: u64, version: u64) -> Vec<u8> {
    assert!(sector < 1 << 24 && version < 1 << 24);
    let h = hash(sector, version);
    let mut out = vec![0u8; PAGE];
    if h.is_multiple_of(8) {
        let v = (SAME_TAG | (sector << 24) | version).to_le_bytes();
        out.chunks_exact_mut(8).for_each(|c| c.copy_from_slice(&v));
        return out;
    }
    // 0..=64 random chunks of 64: from a few dozen bytes compressed to raw.
    let random = if h % 8 == 1 { 64 } else { (h >> 8) % 64 };
    let mut rng = Rng::new(h);
    let word = rng.next_u64().to_le_bytes();
    for chunk in out.chunks_exact_mut(64) {
        if rng.below(64) < random {
            chunk
                .chunks_exact_mut(8)
                .for_each(|c| c.copy_from_slice(&rng.next_u64().to_le_bytes()));
        } else {
            chunk
                .chunks_exact_mut(8)
                .for_each(|c| c.copy_from_slice(&word));
        }
    }
    out[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    out[8..16].copy_from_slice(&sector.to_le_bytes());
    out[16..24].copy_from_slice(&version.to_le_bytes());
    out
}

/// The (sector, version) a page read back is a whole copy of, or why not.
fn identify(p: &[u8]) -> Result<(u64, u64), String> {
    let w = |i: usize| u64::from_le_bytes(p[i * 8..i * 8 + 8].try_into().unwrap());
    if p.iter().all(|&b| b == 0) {
        return Err("all zeros".into());
    }
    let claimed = if (0..PAGE / 8).all(|i| w(i) == w(0)) {
        (w(0) >> 54 == 1).then(|| ((w(0) >> 24) & 0xff_ffff, w(0) & 0xff_ffff))
    } else {
        (w(0) == MAGIC).then(|| (w(1), w(2)))
    };
    match claimed {
        Some((s, v)) if s < 1 << 24 && v < 1 << 24 && page(s, v) == p => Ok((s, v)),
        Some((s, v)) => Err(format!("torn: claims sector {s} version {v} but differs")),
        None => Err(format!("garbage, starting {:02x?}", &p[..32])),
    }
}

// ---------------------------------------------------------------------------
// Writing and reading.

/// Writes `version` of every page in `pages` through every queue of `c`,
/// [`QD`] requests in flight on each; calls `ack` with each batch of pages
/// whose writes completed. Any failure panics.
fn write_pages(c: &mut Client, pages: &[u64], version: u64, ack: &(dyn Fn(&[u64]) + Sync)) {
    std::thread::scope(|s| {
        for (qi, q) in c.queues.iter_mut().enumerate() {
            let mine: Vec<u64> = pages.iter().copied().skip(qi).step_by(QUEUES).collect();
            s.spawn(move || {
                let base = q.buf_ptr();
                let mut todo = mine.into_iter();
                let mut free: Vec<usize> = (0..QD).collect();
                let mut sector_of = [0u64; QD];
                let mut done: [MaybeUninit<Completion>; QD] =
                    std::array::from_fn(|_| MaybeUninit::uninit());
                let mut batch = Vec::with_capacity(QD);
                loop {
                    while let Some(&slot) = free.last() {
                        let Some(sector) = todo.next() else { break };
                        free.pop();
                        assert!((slot + 1) * PAGE <= QUEUE_BUF);
                        // SAFETY: slot `slot` of this queue's buffer (checked
                        // to be inside it) is ours until its request completes.
                        let buf = unsafe { base.add(slot * PAGE) };
                        let data = page(sector, version);
                        // SAFETY: as above; `data` is one page, as is the slot.
                        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf, PAGE) };
                        sector_of[slot] = sector;
                        q.raw()
                            .write(sector * PAGE as u64, buf, PAGE, slot, ReqFlags::empty());
                    }
                    if free.len() == QD {
                        return;
                    }
                    let mut timeout = IO_TIMEOUT;
                    let n = q
                        .raw()
                        .do_io(&mut done, 1, Some(&mut timeout), None)
                        .expect("do_io");
                    assert!(n > 0, "no completion within {IO_TIMEOUT:?}");
                    batch.clear();
                    for c in &done[..n] {
                        // SAFETY: do_io filled in the first n completions.
                        let c = unsafe { c.assume_init_read() };
                        let sector = sector_of[c.user_data];
                        assert_eq!(c.ret, 0, "write of sector {sector} failed");
                        batch.push(sector);
                        free.push(c.user_data);
                    }
                    ack(&batch);
                }
            });
        }
    });
}

/// Reads every page: (sector, version) of each, or why it is neither.
fn read_all(c: &mut Client) -> Vec<Result<(u64, u64), String>> {
    const CHUNK: usize = 64 * PAGE;
    let q = c.q(0);
    let mut out = Vec::with_capacity(PAGES as usize);
    for at in (0..PAGES as usize * PAGE).step_by(CHUNK) {
        let data = q
            .read(at as u64, CHUNK)
            .unwrap_or_else(|e| panic!("read at {at}: {e}"));
        out.extend(data.chunks(PAGE).map(identify));
    }
    out
}

/// Not a test of its own: the writer process of the tests in this file
/// (a no-op unless `VZRAM_KILL_WRITER` names a socket). Writes version
/// `VZRAM_KILL_VERSION` of every page in the order `VZRAM_KILL_ORDER`
/// seeds and prints `ack SECTOR` for each acknowledged write, then `done`,
/// then waits to be killed.
#[test]
fn writer_process() {
    let Some(sock) = std::env::var_os(WRITER_ENV) else {
        return;
    };
    let num = |k: &str| -> u64 { std::env::var(k).unwrap().parse().unwrap() };
    let version = num("VZRAM_KILL_VERSION");
    let mut order: Vec<u64> = (0..PAGES).collect();
    let mut rng = Rng::new(num("VZRAM_KILL_ORDER"));
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut c = Client::connect(Path::new(&sock), QUEUES).expect("writer: connect");
    let out = std::io::stdout();
    write_pages(&mut c, &order, version, &|batch| {
        let mut o = out.lock();
        for s in batch {
            writeln!(o, "ack {s}").unwrap();
        }
        o.flush().unwrap();
    });
    writeln!(out.lock(), "done").unwrap();
    out.lock().flush().unwrap();
    // Hold the connection until killed: stdin stays open as long as the
    // test wants this process alive.
    let _ = std::io::stdin().read_line(&mut String::new());
}

/// What one round left behind.
#[derive(Debug, Default)]
struct Round {
    acked: u64,
    new: u64,
    /// New, but the writer did not live to report it.
    new_unacked: u64,
    old: u64,
    writer_done: bool,
}

fn kill_during_io(victim: Victim) {
    let seed = env_u64("VZRAM_KILL_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    eprintln!("kill {victim:?} during I/O: seed {seed} (VZRAM_KILL_SEED replays it)");
    let mut rng = Rng::new(seed);
    let dir = TempDir::new("kill");
    let sock = dir.join("d.sock");
    let size = (PAGES * PAGE as u64).to_string();
    let queues = QUEUES.to_string();
    let args = [
        "--socket",
        sock.to_str().unwrap(),
        "--size",
        &size,
        "--queues",
        &queues,
    ];
    let mut daemon = Some(Daemon::start(&dir, &args, &[&sock]));
    let log_of = |daemon: &Option<Daemon>| -> String {
        daemon.as_ref().map(Daemon::log_text).unwrap_or_default()
    };

    // Version 0 everywhere.
    let mut c = Client::connect_retrying(&sock, QUEUES, daemon.as_ref().unwrap());
    let all: Vec<u64> = (0..PAGES).collect();
    write_pages(&mut c, &all, 0, &|_| {});
    let mut have = vec![0u64; PAGES as usize];
    for (sector, got) in read_all(&mut c).into_iter().enumerate() {
        assert_eq!(
            got,
            Ok((sector as u64, 0)),
            "sector {sector} after the fill"
        );
    }
    drop(c);

    let secs = Duration::from_secs(env_u64("VZRAM_KILL_SECS").unwrap_or(DEFAULT_SECS));
    let start = Instant::now();
    let mut mixed_rounds = 0;
    let mut version = 0;
    while version < MIN_ROUNDS || mixed_rounds < MIN_MIXED_ROUNDS || start.elapsed() < secs {
        if version == MAX_ROUNDS {
            assert!(
                mixed_rounds >= MIN_MIXED_ROUNDS,
                "in {MAX_ROUNDS} rounds only {mixed_rounds} kills left old and new pages behind"
            );
            break;
        }
        version += 1;
        // Kill once this many writes were acknowledged (at least one, so
        // the writer got going; at most 90 %, so some are left to do).
        let kill_after = 1 + rng.below(PAGES * 9 / 10);
        let order_seed = rng.next_u64();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([WRITER_TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(WRITER_ENV, &sock)
            .env("VZRAM_KILL_VERSION", version.to_string())
            .env("VZRAM_KILL_ORDER", order_seed.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the writer");
        let pid = child.id();
        let sigkill = |pid: u32| {
            // SAFETY: kill only sends a signal, to our own child process.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        };
        let mut acked = vec![false; PAGES as usize];
        let mut r = Round::default();
        let mut killed = false;
        let mut kill = |daemon: &mut Option<Daemon>| {
            if !killed {
                killed = true;
                if victim == Victim::Daemon {
                    // Dropping it SIGKILLs it and reaps it.
                    drop(daemon.take());
                }
                sigkill(pid);
            }
        };
        for line in BufReader::new(child.stdout.take().unwrap()).lines() {
            let line = line.expect("writer output");
            if let Some(s) = line.strip_prefix("ack ") {
                let s: u64 = s.parse().expect("ack SECTOR");
                assert!(!acked[s as usize], "sector {s} acknowledged twice");
                acked[s as usize] = true;
                r.acked += 1;
                if r.acked >= kill_after {
                    kill(&mut daemon);
                }
            } else if line == "done" {
                r.writer_done = true;
                kill(&mut daemon);
            }
        }
        // EOF: the writer is gone, by our hand or not.
        let status = child.wait().expect("wait for the writer");
        assert!(
            killed,
            "the writer exited by itself ({status}) after {} acks\n{}",
            r.acked,
            log_of(&daemon)
        );
        if victim == Victim::Daemon {
            daemon = Some(Daemon::start(&dir, &args, &[&sock]));
        }

        let dm = daemon.as_ref().unwrap();
        let mut c = Client::connect_retrying(&sock, QUEUES, dm);
        let got = read_all(&mut c);
        drop(c);
        let mut bad = Vec::new();
        for (sector, g) in got.into_iter().enumerate() {
            let (old, s) = (have[sector], sector as u64);
            match g {
                Ok((gs, v)) if gs == s && v == version => {
                    r.new += 1;
                    r.new_unacked += u64::from(!acked[sector]);
                    have[sector] = v;
                }
                Ok((gs, v)) if gs == s && v == old && !acked[sector] => r.old += 1,
                Ok((gs, v)) if gs == s && v == old => bad.push(format!(
                    "sector {s}: acknowledged write of version {version} lost (reads {v})"
                )),
                Ok((gs, v)) if gs == s => bad.push(format!(
                    "sector {s}: version {v}, neither old ({old}) nor new ({version})"
                )),
                Ok((gs, v)) => bad.push(format!(
                    "sector {s}: holds sector {gs}'s page (version {v})"
                )),
                Err(e) => bad.push(format!(
                    "sector {s} (old {old}, new {version}, acked {}): {e}",
                    acked[sector]
                )),
            }
        }
        eprintln!(
            "round {version}: killed {victim:?} after {kill_after} acks{}: {} acknowledged, \
             {} new ({} of them not acknowledged), {} old",
            if r.writer_done {
                " (writer had finished)"
            } else {
                ""
            },
            r.acked,
            r.new,
            r.new_unacked,
            r.old
        );
        assert!(
            bad.is_empty(),
            "seed {seed}, round {version} ({victim:?} killed after {} acks): {} bad pages:\n{}\n{}",
            r.acked,
            bad.len(),
            bad.iter().take(20).cloned().collect::<Vec<_>>().join("\n"),
            log_of(&daemon)
        );
        if r.old > 0 && r.new > 0 {
            mixed_rounds += 1;
        }
    }
    eprintln!(
        "{version} rounds in {:.1} s, {mixed_rounds} of them killed with old and new pages left",
        start.elapsed().as_secs_f64()
    );
    // Every page is stored once, whatever died how often.
    let st = daemon.as_ref().unwrap().stat();
    assert_eq!(
        st.sole().stats.orig_data_size,
        PAGES * PAGE as u64,
        "{}",
        st
    );
    assert_eq!(st.sole().stats.failed_writes, 0, "{}", st);
}

#[test]
fn killing_the_client_mid_write_leaves_each_page_old_or_new() {
    kill_during_io(Victim::Client);
}

#[test]
fn killing_the_daemon_mid_write_leaves_each_page_old_or_new() {
    kill_during_io(Victim::Daemon);
}
