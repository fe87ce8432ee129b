//! A soak over the real socket with data that says where it came from.
//!
//! Four queues, each with [`QD`] requests in flight, write and read single
//! pages of one device and discard runs of one to four, half of them in a
//! small hot set that every queue hits at once, so the same page is often
//! being written by several queues (and twice by one queue) at the same
//! moment. Every page written carries its sector, its writer and a unique
//! version, and a body derived from them in one of many shapes
//! (same-filled, incompressible, and compressible to every degree in
//! between, so most size classes are used): a page that is torn,
//! misplaced, stale or never written is recognised.
//!
//! Meanwhile a control thread compacts the device (`vzram compact` and the
//! control socket), squeezes and lifts the device and host memory limits
//! (`vzram set-limit` and the control socket) so that some writes fail, and
//! every other round the frontend drops its connection with requests in
//! flight and connects again. After every round, half the device is filled
//! with pages of one size and three in four are discarded again, and a
//! compaction runs with nothing else going on: it must give pages back,
//! which it can only do by moving objects (under load, evacuated spans
//! also empty by themselves). Then each page is read back.
//!
//! # What a read may return
//!
//! Every request gets a number from one global sequence when it is
//! submitted (before the device can see it) and when its completion is
//! seen (after the device finished it), so `a.done < b.submit` means `a`
//! really ended before `b` began. A read that began at `rs` and ended at
//! `rc` may return the content of a write or discard `W` unless
//!
//! - `W` failed (IOERR: a failed single-page write is not applied), or
//! - `W` was submitted after the read ended (`W.submit > rc`), or
//! - `W` is *fenced off*: some write `W2` with other content started after
//!   `W` ended (`W.done < W2.submit`) and was known applied before the read
//!   began (acknowledged, or seen by an earlier read, before `rs`). A read
//!   that returned `X` is such a fence too, at its own `rs`, for everything
//!   that ended before it began except `X`: once a reader saw `X`, what was
//!   overwritten by `X` never comes back.
//!
//! That is linearizability of each page as a register, checked one read at
//! a time. Writes whose connection was dropped before they completed have
//! an unknown outcome: they may or may not be applied, but they are over
//! (`done`) once the next connection is up, since the daemon serves one
//! connection of a device at a time and finishes the old one's requests
//! first. A stale request landing after the reconnect is caught.
//!
//! `VZRAM_SOAK_SECS` makes it run longer (default 8 s of load);
//! `VZRAM_SOAK_SEED` fixes the random choices (the interleaving is the
//! scheduler's).

use std::mem::MaybeUninit;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use blkio::{Completion, ReqFlags};
use vzram_tests::*;

/// Device pages (8 MiB).
const PAGES: u64 = 2048;
/// Pages that half of all requests go to, from every queue at once.
const HOT: u64 = 16;
const QUEUES: usize = 4;
/// Requests in flight per queue.
const QD: usize = 8;
/// Rounds of load (each followed by a full read-back), at least.
const MIN_ROUNDS: usize = 4;
/// Requests each queue completes per round, at least, however slow.
const MIN_OPS: u64 = 1500;
/// Seconds of load in all (`VZRAM_SOAK_SECS`), in rounds of [`ROUND`].
const DEFAULT_SECS: u64 = 8;
/// How long each round's load lasts (and then until every queue
/// completed [`MIN_OPS`]).
const ROUND: Duration = Duration::from_secs(2);
/// Completed requests between two control actions.
const CONTROL_STEP: u64 = 250;
const DEV: &str = "soak";
const NEVER: u64 = u64::MAX;
const IO_TIMEOUT: Duration = Duration::from_secs(30);
// The pages and their history, and the load, live beside this file.
#[path = "soak/load.rs"]
mod load;
#[path = "soak/pages.rs"]
mod pages;

use load::*;
use pages::*;

// ---------------------------------------------------------------------------
// The control thread.

#[derive(Default, Debug)]
struct Control {
    compactions: u64,
    pages_compacted: u64,
    limit_changes: u64,
}

/// `compacted: N pages (...) given back`
fn cli_compacted(out: &str) -> u64 {
    out.strip_prefix("compacted: ")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected `vzram compact` output {out:?}"))
}

/// Three-quarters of what is in use now: new spans are refused until
/// discards and compaction free enough.
fn squeeze(used: u64) -> u64 {
    (used * 3 / 4 / 4096).max(1) * 4096
}

/// Every [`CONTROL_STEP`] completed requests, the next action of a cycle:
/// compact, squeeze the device limit, compact, lift it, squeeze the host
/// limit, compact, lift it.
fn control_thread(ctl: &Path, sh: &Shared) -> Control {
    let _flag = PanicFlag(&sh.failed);
    let c = ctl.to_str().unwrap();
    let mut r = Control::default();
    let mut last = 0;
    let mut step = 0u64;
    while !sh.end.load(SeqCst) && !sh.failed.load(SeqCst) {
        let now = sh.progress.load(SeqCst);
        if now < last + CONTROL_STEP {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        last = now;
        let _acting = sh.gate.lock().unwrap_or_else(|e| e.into_inner());
        match step % 7 {
            0 | 5 => {
                r.pages_compacted += cli_compacted(&Vzram::new(&["compact", "--control", c]).ok());
                r.compactions += 1;
            }
            2 => {
                let v: Compacted = request_at(ctl, json!({"cmd": "compact", "device": DEV}));
                r.pages_compacted += v.pages_compacted;
                r.compactions += 1;
            }
            1 => {
                let st = Stats(request_at(ctl, json!({"cmd": "stat"})));
                // What the pool holds can pass the device's size (size
                // classes, fragmentation), and a device limit above its
                // size is refused: at most the size.
                let lim = squeeze(st.devices()[0].stats.mem_used_total)
                    .min(PAGES * PAGE as u64)
                    .to_string();
                Vzram::new(&["set-limit", "--control", c, "--device", DEV, &lim]).ok();
                r.limit_changes += 1;
            }
            3 => {
                Vzram::new(&["set-limit", "--control", c, "--device", DEV, "0"]).ok();
                r.limit_changes += 1;
            }
            4 => {
                let st = Stats(request_at(ctl, json!({"cmd": "stat"})));
                let lim = squeeze(st.pool().mem_used_total);
                let v: HostLimitSet =
                    request_at(ctl, json!({"cmd": "set-limit", "host": true, "bytes": lim}));
                assert_eq!(v.host_mem_limit, lim, "{v:?}");
                r.limit_changes += 1;
            }
            _ => {
                Vzram::new(&["set-limit", "--control", c, "--host", "0"]).ok();
                r.limit_changes += 1;
            }
        }
        step += 1;
    }
    r
}

/// With the control thread held off and the limits lifted, fills half the
/// device with pages of one shape, discards three in four of them, and
/// compacts while nothing else runs: no page is freed during the
/// compaction, so whatever it gives back it gained by moving objects. The
/// fill's pages may be staged raw (a span each, nothing to move): they are
/// compressed first, and a compaction before the discard gives back the
/// spans they leave. The worker's own compaction after compressing them
/// may still run during the discard and take the gain: what every
/// compaction since the discard gave back is counted.
fn quiet_compaction(c: &mut Client, d: &Daemon, sh: &Shared, rngs: &mut [Rng]) -> u64 {
    let _quiet = sh.gate.lock().unwrap_or_else(|e| e.into_inner());
    let _: DeviceLimitSet = d.request(json!({"cmd": "set-limit", "device": DEV, "bytes": 0}));
    let _: HostLimitSet = d.request(json!({"cmd": "set-limit", "host": true, "bytes": 0}));
    phase(c, sh, rngs, Phase::Fill, Duration::ZERO);
    d.settled();
    let _: Compacted = d.request(json!({"cmd": "compact", "device": DEV}));
    let before = d.stat().counters(DEV).pages_compacted;
    phase(c, sh, rngs, Phase::Punch, Duration::ZERO);
    let _: Compacted = d.request(json!({"cmd": "compact", "device": DEV}));
    d.stat().counters(DEV).pages_compacted - before
}

#[test]
fn versioned_pages_survive_overlapping_writers_compaction_limits_and_reconnects() {
    let secs = env_u64("VZRAM_SOAK_SECS").unwrap_or(DEFAULT_SECS);
    let seed = env_u64("VZRAM_SOAK_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    eprintln!("soak: seed {seed}, {secs} s of load (VZRAM_SOAK_SEED, VZRAM_SOAK_SECS)");
    let dir = TempDir::new("soak");
    let sock = dir.join("d.sock");
    let size = (PAGES * PAGE as u64).to_string();
    let d = Daemon::start(
        &dir,
        &[
            "--socket",
            sock.to_str().unwrap(),
            "--size",
            &size,
            "--queues",
            &QUEUES.to_string(),
            "--name",
            DEV,
        ],
        &[&sock],
    );
    let sh = Shared {
        seq: AtomicU64::new(1),
        version: AtomicU64::new(1),
        log: Mutex::new((0..PAGES).map(|_| PageLog::new()).collect()),
        stop: AtomicBool::new(false),
        ready: AtomicUsize::new(0),
        end: AtomicBool::new(false),
        failed: AtomicBool::new(false),
        progress: AtomicU64::new(0),
        gate: Mutex::new(()),
        counts: Counts::default(),
        seed,
    };
    let mut rngs: Vec<Rng> = (0..QUEUES as u64)
        .map(|i| Rng::new(seed ^ mix(i)))
        .collect();
    let mut client = Some(Client::connect_retrying(&sock, QUEUES, &d));
    let start = Instant::now();
    let mut rounds = 0;
    let mut reconnects = 0;
    let mut quiet = Vec::new();
    let ctl = std::thread::scope(|s| {
        let ctl = s.spawn(|| control_thread(&d.control, &sh));
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| loop {
            assert!(!sh.failed.load(SeqCst), "the control thread failed");
            let drop_it = rounds % 2 == 1;
            let p = if drop_it {
                Phase::LoadThenDrop
            } else {
                Phase::Load
            };
            let left = phase(client.as_mut().unwrap(), &sh, &mut rngs, p, ROUND);
            if drop_it {
                eprintln!(
                    "round {rounds}: reconnecting with {} requests in flight",
                    left.len()
                );
                client = Some(reconnect(client.take().unwrap(), left, &sock, &d, &sh));
                reconnects += 1;
            }
            let c = client.as_mut().unwrap();
            quiet.push(quiet_compaction(c, &d, &sh, &mut rngs));
            // The read-back sees what the compaction moved.
            phase(c, &sh, &mut rngs, Phase::Scan, ROUND);
            sh.log().iter_mut().for_each(PageLog::prune);
            rounds += 1;
            eprintln!(
                "round {rounds} checked at {:.1} s: {} writes ok, {} failed, {} unknown, {} reads, \
                 {} discards; quiet compaction gave back {} pages",
                start.elapsed().as_secs_f64(),
                sh.counts.writes_ok.load(SeqCst),
                sh.counts.writes_failed.load(SeqCst),
                sh.counts.writes_unknown.load(SeqCst),
                sh.counts.reads.load(SeqCst),
                sh.counts.discards.load(SeqCst),
                quiet.last().unwrap(),
            );
            if rounds >= MIN_ROUNDS && start.elapsed() >= Duration::from_secs(secs) {
                break;
            }
        }));
        sh.end.store(true, SeqCst);
        let ctl = ctl.join();
        if ctl.is_err() || run.is_err() {
            eprintln!("daemon log:\n{}", d.log_text());
        }
        // The control thread's own panic says more than "it failed".
        let ctl = ctl.unwrap_or_else(|e| std::panic::resume_unwind(e));
        if let Err(e) = run {
            std::panic::resume_unwind(e);
        }
        ctl
    });
    // Limits off, one last compaction, a fresh connection, a last read-back.
    let c = d.control.to_str().unwrap();
    Vzram::new(&["set-limit", "--control", c, "--device", DEV, "0"]).ok();
    Vzram::new(&["set-limit", "--control", c, "--host", "0"]).ok();
    let last = cli_compacted(&Vzram::new(&["compact", "--control", c]).ok());
    let mut client = reconnect(client.take().unwrap(), Vec::new(), &sock, &d, &sh);
    phase(&mut client, &sh, &mut rngs, Phase::Scan, ROUND);
    drop(client);

    let st = Stats::parse(
        serde_json::from_str(&Vzram::new(&["stat", "--json", "--control", c]).ok())
            .expect("stat --json"),
    );
    let dev = &st.devices()[0].stats;
    let counts = &sh.counts;
    let (ok, failed, unknown) = (
        counts.writes_ok.load(SeqCst),
        counts.writes_failed.load(SeqCst),
        counts.writes_unknown.load(SeqCst),
    );
    eprintln!(
        "soak done in {:.1} s: {rounds} rounds, {reconnects} reconnects; writes {ok} ok, {failed} \
         IOERR, {unknown} page ops in flight at a disconnect; {} reads, {} discards; {ctl:?}, \
         quiet compactions {quiet:?}, {last} pages in the last one; device: pages_compacted {}, failed_writes {}, \
         same_pages {}, huge_pages {}, orig {} KiB, compr {} KiB",
        start.elapsed().as_secs_f64(),
        counts.reads.load(SeqCst),
        counts.discards.load(SeqCst),
        dev.pages_compacted,
        dev.failed_writes,
        dev.same_pages,
        dev.huge_pages,
        dev.orig_data_size / 1024,
        dev.compr_data_size / 1024,
    );
    assert!(
        reconnects >= 2 && unknown > 0,
        "no reconnect with requests in flight"
    );
    assert!(ctl.limit_changes >= 4, "limits hardly changed: {ctl:?}");
    assert!(failed > 0, "squeezed limits never made a write fail");
    // The daemon counts the failures we saw, and perhaps some of those
    // whose completion was lost with a connection, nothing else.
    assert!(
        dev.failed_writes >= failed && dev.failed_writes <= failed + unknown,
        "daemon failed_writes {} but clients saw {failed} (and {unknown} unknown)",
        dev.failed_writes
    );
    assert!(
        ctl.pages_compacted > 0,
        "{} compactions under load gave nothing back from a fragmented heap",
        ctl.compactions
    );
    // Under load, spans also empty by themselves while being evacuated;
    // only the quiet compactions show that objects were moved.
    assert!(
        quiet.iter().all(|&n| n > 0),
        "a compaction with nothing else running moved nothing out of freshly \
         fragmented spans: {quiet:?} pages given back"
    );
    assert!(
        dev.pages_compacted >= ctl.pages_compacted + last + quiet.iter().sum::<u64>(),
        "stat pages_compacted {} < {} reported by the compactions",
        dev.pages_compacted,
        ctl.pages_compacted + last + quiet.iter().sum::<u64>()
    );
    assert!(dev.same_pages > 0 && dev.huge_pages > 0, "{dev:?}");
}
