//! Replays the checked-in fuzz corpus (`fuzz/corpus/blk_request/`) and the
//! built-in seeds through the fuzz harness, with all of its invariant
//! checks, on every `cargo test`. See `fuzz/README.md`.
//!
//! `VZRAM_WRITE_SEEDS=DIR cargo test -p vzram-blk --test fuzz_corpus` writes
//! the built-in seeds to DIR (how the corpus was started).

#[path = "fuzz_harness/mod.rs"]
mod fuzz_harness;

use std::path::{Path, PathBuf};

use fuzz_harness::mode::{BIG_DISK, EVENT_IDX, POOL, SECOND_QUEUE, ZSTD, ZSTD3};
use fuzz_harness::seed::{Seed, ADJACENT, B, GAP, ONE_REGION, TOP};
use fuzz_harness::{mode, run, run_with, Summary, BIG_DEV_SIZE, DEV_SECTORS};

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/blk_request")
}

fn corpus_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .expect("fuzz/corpus/blk_request is checked in")
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Replays one input; names the file if a check fails.
fn replay(name: &str, data: &[u8]) -> Summary {
    match std::panic::catch_unwind(|| run(data)) {
        Ok(s) => s,
        Err(e) => {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("fuzz input {name} failed: {msg}");
        }
    }
}

/// `data` with the pool mode off or on, the rest of its modes kept.
fn with_pool(data: &[u8], on: bool) -> Vec<u8> {
    let mut d = data.to_vec();
    // An input of one byte has mode 0.
    d.resize(d.len().max(2), 0);
    d[1] = d[1] & !POOL | if on { POOL } else { 0 };
    d
}

/// Each file twice: as the queue runs without a compress pool, and with
/// one (batches, pooled writes).
#[test]
fn replay_checked_in_corpus() {
    let files = corpus_files();
    assert!(files.len() >= 20, "corpus has only {} files", files.len());
    let mut total = Summary::default();
    for f in &files {
        let data = std::fs::read(f).expect("read corpus file");
        let name = f.display().to_string();
        total.add(&replay(&name, &with_pool(&data, false)));
        total.add(&replay(
            &format!("{name} with the pool"),
            &with_pool(&data, true),
        ));
    }
    // The corpus must keep reaching every kind of outcome, or it has rotted.
    let t = total;
    for (what, n) in [
        ("chains", t.chains),
        ("chains without a status byte", t.no_status),
        ("malformed chains", t.malformed),
        ("UNSUPP answers", t.unsupp),
        ("IOERR from the device", t.exec_ioerr),
        ("writes failed on a memory limit", t.limit_failures),
        ("successful reads", t.ok_reads),
        ("successful writes", t.ok_writes),
        ("successful discards/write-zeroes", t.ok_zero),
        ("successful flush/get-id", t.ok_other),
        ("indirect chains", t.indirect),
        ("chains on the read-only view", t.readonly_chains),
        ("chains on zstd", t.zstd),
        ("chains on the big disk", t.big_disk),
        ("chains with EVENT_IDX", t.event_idx),
        ("requests on a second queue", t.second_queue),
        ("notifications before the end of a drain", t.early_signals),
        ("drains ended by an out-of-range head", t.bad_head_drains),
        ("drains ended as unreadable", t.unreadable_drains),
        ("chains with the compress pool", t.pooled_chains),
        ("writes the pool took", t.pooled_writes),
    ] {
        assert!(n > 0, "the corpus reaches no {what}: {t:?}");
    }
}

/// Every seed in every mode (codec, disk size, EVENT_IDX, second queue,
/// pool).
#[test]
fn builtin_seeds_pass() {
    let mut pooled = Summary::default();
    for (name, mut data) in seeds() {
        replay(name, &data);
        for m in mode::ALL {
            data[1] = m;
            let s = replay(&format!("{name} in mode {m:#x}"), &data);
            if m & POOL != 0 {
                pooled.add(&s);
            }
        }
    }
    for (what, n) in [
        ("writes the pool took", pooled.pooled_writes),
        (
            "FLUSHes behind pooled writes in one batch",
            pooled.flush_behind_pooled,
        ),
        ("requests on a second queue", pooled.second_queue),
    ] {
        assert!(n > 0, "the seeds with the pool reach no {what}: {pooled:?}");
    }
}

/// The checks can fail: a shadow copy corrupted after the first write is
/// caught on the next comparison.
#[test]
fn harness_detects_a_wrong_disk() {
    let (_, data) = seeds()
        .into_iter()
        .find(|(n, _)| *n == "write-read")
        .expect("seed");
    run_with(&data, false);
    let r = std::panic::catch_unwind(|| run_with(&data, true));
    assert!(r.is_err(), "a corrupted shadow went unnoticed");
}

#[test]
fn write_seeds_if_asked() {
    let Some(dir) = std::env::var_os("VZRAM_WRITE_SEEDS") else {
        return;
    };
    std::fs::create_dir_all(&dir).expect("seed dir");
    for (name, data) in seeds() {
        std::fs::write(Path::new(&dir).join(format!("seed-{name}")), data).expect("write seed");
    }
}

type D = (Vec<u8>, Vec<u8>, bool, bool);

fn d(addr: Vec<u8>, len: u32, write: bool) -> D {
    (addr, Seed::l_raw(len), write, false)
}

/// Hand-written starting points: one per interesting shape.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let a = Seed::a_first;
    let mut out = Vec::new();
    let mut add = |name: &'static str, s: &mut Seed| out.push((name, std::mem::take(&mut s.0)));

    // Write 8 sectors at 3, read them back, read an unwritten page, flush, get-id.
    add(
        "write-read",
        Seed::new(ONE_REGION, 4, false, false)
            .request(1, 3, 0, 2, false, 7, 9)
            .request(0, 3, 4, 3, false, 7, 0)
            .request(0, 64, 0, 1, false, 7, 0)
            .request(2, 0, 1, 1, false, 0, 0)
            .request(3, 0, 2, 1, false, 32, 0),
    );
    // Same through indirect tables, on the gap layout.
    add(
        "indirect-write-read",
        Seed::new(GAP, 3, false, false)
            .request(1, 8, 1, 4, true, 31, 3)
            .request(0, 7, 2, 2, true, 31, 0),
    );
    // Discard and write-zeroes over written data, partial pages included.
    add(
        "discard",
        Seed::new(ONE_REGION, 4, false, false)
            .request(1, 0, 0, 1, false, 31, 5)
            .dwz(4, 2, false, &[(1, 8, 0), (16, 4, 0)])
            .dwz(5, 3, true, &[(9, 3, 1)])
            .request(0, 0, 4, 1, false, 31, 0),
    );
    // Discard segments that are bad: flags, length, range, overflow.
    add(
        "discard-bad",
        Seed::new(GAP, 4, false, false)
            .request(1, 0, 0, 1, false, 15, 5)
            .dwz(4, 1, false, &[(0, 8, 1)])
            .dwz(5, 2, false, &[(0, 8, 2)])
            .dwz(4, 3, false, &[(0, 8, 0), (DEV_SECTORS, 8, 0)])
            .dwz(4, 4, false, &[(u64::MAX / 512, 8, 0)])
            .dwz(5, 5, false, &[(0, (1 << 21) + 1, 0)])
            .request(0, 0, 6, 1, false, 15, 0),
    );
    // Read-only view: writes and discards fail, reads and flush work.
    add(
        "readonly",
        Seed::new(ADJACENT, 4, false, false)
            .request(1, 0, 0, 1, false, 7, 1)
            .readonly()
            .request(1, 0, 1, 1, false, 7, 2)
            .dwz(4, 2, false, &[(0, 8, 0)])
            .request(0, 0, 3, 1, false, 7, 0)
            .request(2, 0, 4, 1, false, 0, 0),
    );
    // Sector overflow and out of range for IN and OUT.
    add(
        "sector-overflow",
        Seed::new(ONE_REGION, 3, false, false)
            .request(0, u64::MAX / 256, 0, 1, false, 0, 0)
            .request(1, u64::MAX / 512, 1, 1, false, 1, 0)
            .request(1, DEV_SECTORS - 1, 2, 1, false, 1, 0)
            .request(0, DEV_SECTORS, 3, 1, false, 0, 0),
    );
    // Descriptors outside memory, in the gap, straddling, wrapping.
    add(
        "outside-memory",
        Seed::new(GAP, 4, false, false)
            .header(&a(0x2000), 0, 0)
            .chain(
                0,
                &[
                    d(a(0x2000), 16, false),
                    d(Seed::a_raw(0x1_8000), 512, true),
                    d(a(0x2010), 1, true),
                ],
            )
            .chain(
                3,
                &[
                    d(a(0x2000), 16, false),
                    d(Seed::a_raw(0xff00), 512, true),
                    d(a(0x2010), 1, true),
                ],
            )
            .chain(
                6,
                &[
                    d(a(0x2000), 16, false),
                    d(Seed::a_raw(u64::MAX - 10), 512, true),
                    d(a(0x2010), 1, true),
                ],
            )
            .chain(
                9,
                &[d(a(0x2000), 16, false), d(Seed::a_raw(0x3_0000), 1, true)],
            )
            .chain(
                11,
                &[d(a(0x2000), 16, false), d(Seed::a_end_minus(0), 1, true)],
            ),
    );
    // Status byte missing, read-only, zero-length; empty and short headers.
    add(
        "status",
        Seed::new(ONE_REGION, 4, false, false)
            .header(&a(0x2000), 1, 0)
            .chain(
                0,
                &[
                    d(a(0x2000), 16, false),
                    d(a(0x4000), 512, false),
                    d(a(0x2010), 1, false),
                ],
            )
            .chain(3, &[d(a(0x2000), 16, false)])
            .chain(4, &[d(a(0x2000), 16, false), d(a(0x2010), 0, true)])
            .chain(6, &[d(a(0x2000), 8, false), d(a(0x2010), 1, true)])
            .chain(8, &[d(a(0x2010), 1, true)]),
    );
    // Header split over descriptors, status inside the data descriptor.
    add(
        "header-split",
        Seed::new(ADJACENT, 4, false, false)
            .header(&a(0xfff8), 0, 2)
            .chain(
                0,
                &[
                    d(a(0xfff8), 5, false),
                    d(a(0xfffd), 11, false),
                    d(a(0x4000), 513, true),
                ],
            ),
    );
    // Readable after writable, wrong directions, odd lengths, unknown types.
    add(
        "directions",
        Seed::new(ONE_REGION, 4, false, false)
            .header(&a(0x2000), 1, 0)
            .chain(
                0,
                &[
                    d(a(0x2000), 16, false),
                    d(a(0x4000), 512, true),
                    d(a(0x5000), 512, false),
                    d(a(0x2010), 1, true),
                ],
            )
            .chain(
                4,
                &[
                    d(a(0x2000), 16, false),
                    d(a(0x4000), 100, false),
                    d(a(0x2010), 1, true),
                ],
            )
            .header(&a(0x2100), 0xdead, 0)
            .chain(
                7,
                &[
                    d(a(0x2100), 16, false),
                    d(a(0x4000), 512, false),
                    d(a(0x2010), 1, true),
                ],
            )
            .header(&a(0x2200), 8, 0)
            .chain(
                10,
                &[
                    d(a(0x2200), 16, false),
                    d(a(0x4000), 20, false),
                    d(a(0x2010), 1, true),
                ],
            ),
    );
    // Too many descriptors through a long indirect table, and the limit exactly.
    add(
        "long-chain",
        Seed::new(ONE_REGION, 4, false, false)
            .header(&a(0x2000), 1, 0)
            .long_chain(
                258,
                &a(0x8000),
                0,
                &a(0x2000),
                (a(0x4000), Seed::l_raw(512), false),
                &a(0x2010),
            )
            .long_chain(
                256,
                &a(0x8000),
                1,
                &a(0x2000),
                (a(0x4000), Seed::l_raw(512), false),
                &a(0x2010),
            ),
    );
    // Bad indirect tables: zero length, not a multiple of 16, nested.
    add(
        "indirect-bad",
        Seed::new(GAP, 4, false, false)
            .header(&a(0x2000), 0, 0)
            .indirect(
                &a(0x8000),
                0,
                &[d(a(0x2000), 16, false), d(a(0x2010), 1, true)],
                0,
            )
            .indirect(
                &a(0x8000),
                1,
                &[d(a(0x2000), 16, false), d(a(0x2010), 1, true)],
                1,
            )
            .indirect(
                &a(0x8000),
                2,
                &[
                    d(a(0x2000), 16, false),
                    (a(0x8000), Seed::l_raw(32), false, true),
                ],
                3,
            ),
    );
    // Loops and bad heads in the main table.
    add(
        "loops",
        Seed::new(ONE_REGION, 3, false, false)
            .desc(0, &a(0x2000), &Seed::l_raw(16), 1, 1)
            .desc(1, &a(0x4000), &Seed::l_raw(512), 3, 0)
            .kick(&[0, 0x8000 | 200, 1]),
    );
    // A memory limit: incompressible writes until it fails, then discards.
    let mut lim = Seed::new(ONE_REGION, 4, false, true);
    for i in 0..8u64 {
        lim.request(1, i * 32, (i % 16) as u8, 1, false, 31, 0x80 | i as u8);
    }
    lim.dwz(4, 3, false, &[(0, 64, 0)])
        .compact()
        .limit(1)
        .request(1, 200, 5, 1, false, 31, 3);
    add("limit", &mut lim);
    // More chains in one drain than SIGNAL_EVERY: the guest publishes 100
    // entries (all head 0, a FLUSH) at once.
    add(
        "signal-every",
        Seed::new(ONE_REGION, 8, false, false)
            .request(2, 0, 0, 1, false, 0, 0)
            .bytes(&a(0x1002), &[101, 0])
            .process(),
    );
    // With EVENT_IDX, an avail index too far ahead: Unreadable.
    add(
        "unreadable",
        Seed::new(ONE_REGION, 4, false, false)
            .modes(EVENT_IDX)
            .request(2, 0, 0, 1, false, 0, 0)
            .bytes(&a(0x1002), &[0, 0x80])
            .process(),
    );
    // The big disk on zstd: I/O at its end, past it, and in the middle.
    let big = BIG_DEV_SIZE / 512;
    add(
        "big-disk",
        Seed::new(ONE_REGION, 4, false, false)
            .modes(BIG_DISK | ZSTD)
            .request(1, big - 32, 0, 2, false, 31, 7)
            .request(1, 5000, 2, 1, true, 15, 0x85)
            .request(0, big - 40, 4, 3, false, 31, 0)
            .dwz(4, 6, false, &[(big - 24, 8, 0), (5000, 8, 0)])
            .request(0, big - 64, 8, 1, false, 31, 0)
            .request(1, big - 1, 9, 1, false, 1, 0),
    );
    // A second queue reading while this one writes, overwrites, discards
    // and compacts.
    let mut sq = Seed::new(ONE_REGION, 4, false, false);
    sq.modes(SECOND_QUEUE | BIG_DISK | ZSTD3);
    for i in 0..12u64 {
        sq.request(1, i * 680, (i % 16) as u8, 1, false, 31, i as u8 * 9);
    }
    sq.dwz(5, 3, false, &[(0, 64, 1), (680 * 3, 16, 0)])
        .compact()
        .request(0, 680, 4, 2, false, 31, 0);
    for i in 0..6u64 {
        sq.request(1, i * 680 + 3, (i % 16) as u8, 2, true, 15, 0x80 | i as u8);
    }
    add("second-queue", &mut sq);
    // Batches: pooled writes, then a FLUSH, then a read of what they wrote;
    // a write of sectors and one of too few pages for the pool among them.
    add(
        "pool-batch",
        Seed::new(ONE_REGION, 5, false, false)
            .modes(POOL)
            .batch(&[
                B::write(0, 4, 0, 3),
                B::write(2, 8, 4, 0x85),
                B::flush(),
                B::read(0, 10, 0),
            ])
            .batch(&[
                B::write(16, 16, 0, 7).indirect(),
                B::write(20, 4, 12, 0x89),
                B::write_sectors(17, 3, 5, 2, 11),
                B::flush().indirect(),
                B::read(16, 8, 8).indirect(),
                B::write(40, 3, 1, 13),
                B::flush(),
                B::read(40, 3, 4),
            ]),
    );
    // A read in a batch fills the buffer that a write of sectors after it
    // reads when it runs, and a pooled write read when it was taken.
    add(
        "pool-batch-overlap",
        Seed::new(GAP, 5, false, false)
            .modes(POOL)
            .batch(&[B::write(5, 4, 0, 0x11)])
            .batch(&[
                B::read(5, 2, 3),
                B::write_sectors(30, 0, 16, 3, 21),
                B::write(40, 4, 3, 23),
                B::flush(),
                B::read(30, 2, 8),
                B::read(40, 4, 10),
            ]),
    );
    // The top-of-address-space layout, status at the very last byte.
    add(
        "top",
        Seed::new(TOP, 2, false, false)
            .header(&Seed::a_last(0), 0, 0)
            .chain(
                0,
                &[
                    d(Seed::a_last(0), 16, false),
                    d(Seed::a_last(0x1000), 512, true),
                    d(Seed::a_end_minus(1), 1, true),
                ],
            ),
    );
    out
}
