//! Migration between two devices over a socket pair: everything arrives,
//! writes during pre-copy arrive, and a hostile or mismatched stream is
//! refused with the destination left empty.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vzram_store::migrate::{self, MigrateError, Progress, Verdict};
use vzram_store::{Codec, Context, Device, DeviceConfig, Pool, PoolConfig, PAGE_SIZE};

mod common;
use common::stream::{receive_on, send_on};

const SLOTS: u64 = 4096;

fn pool() -> Arc<Pool> {
    Pool::new(PoolConfig {
        host_mem_limit: 0,
        arena_bytes: 1 << 30,
        ..PoolConfig::default()
    })
    .unwrap()
}

fn device(pool: &Arc<Pool>, slots: u64, codec: Codec) -> Arc<Device> {
    let mut cfg = DeviceConfig::new(slots * PAGE_SIZE as u64, codec);
    cfg.shards = 2;
    pool.create_device(cfg).unwrap()
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x
}

/// Page `i` of version `v`: compressible, incompressible (huge), same-filled
/// or zero by turns.
fn page(i: u64, v: u64) -> [u8; PAGE_SIZE] {
    let mut p = [0u8; PAGE_SIZE];
    match (i + v) % 4 {
        0 => {
            for (j, c) in p.chunks_exact_mut(8).enumerate() {
                c.copy_from_slice(&(i * 7 + v + (j as u64 % 5)).to_le_bytes());
            }
        }
        1 => {
            for (j, c) in p.chunks_exact_mut(8).enumerate() {
                c.copy_from_slice(&mix(i << 32 ^ v << 20 ^ j as u64).to_le_bytes());
            }
        }
        2 => p.fill((i ^ v) as u8 | 1),
        _ => {}
    }
    p
}

fn read(dev: &Device, s: u64) -> [u8; PAGE_SIZE] {
    let mut b = [0u8; PAGE_SIZE];
    dev.read_page(&mut Context::new(0), s, &mut b).unwrap();
    b
}

fn same_content(a: &Device, b: &Device) {
    for s in 0..a.num_slots() {
        assert!(read(a, s) == read(b, s), "slot {s} differs");
    }
}

/// Runs a send from `src` and a receive into `dst` over a socket pair.
fn migrate(
    src: &Device,
    dst: &Device,
    quiet: &(dyn Fn() -> bool + Sync),
) -> (
    Result<migrate::SendReport, MigrateError>,
    Result<migrate::ReceiveReport, MigrateError>,
) {
    migrate_with(src, dst, quiet, &|| Verdict::Commit)
}

/// [`migrate`] with the source's verdict given.
fn migrate_with(
    src: &Device,
    dst: &Device,
    quiet: &(dyn Fn() -> bool + Sync),
    verdict: &dyn Fn() -> Verdict,
) -> (
    Result<migrate::SendReport, MigrateError>,
    Result<migrate::ReceiveReport, MigrateError>,
) {
    let (a, b) = UnixStream::pair().unwrap();
    std::thread::scope(|sc| {
        let rx = sc.spawn(|| receive_on(dst, &b, &b, &|_| {}, &|| {}, &|| {}));
        let tx = send_on(src, &a, quiet, verdict, &|| None, &|_: Progress| {});
        drop(a);
        (tx, rx.join().unwrap())
    })
}

#[test]
fn every_kind_of_page_arrives_as_it_was() {
    let pool = pool();
    let src = device(&pool, SLOTS, Codec::Zstd { level: 3 });
    let cx = &mut Context::new(0);
    for s in (0..SLOTS).step_by(3) {
        src.write_page(cx, s, &page(s, 1)).unwrap();
    }
    src.write_partial(cx, 1, 100, b"partial").unwrap();
    // A destination with other content and another codec: it is replaced.
    let dst = device(&pool, SLOTS, Codec::Lz4);
    dst.write_page(cx, 2, &page(2, 9)).unwrap();
    let (tx, rx) = migrate(&src, &dst, &|| true);
    let (tx, rx) = (tx.unwrap(), rx.unwrap());
    same_content(&src, &dst);
    let (s, d) = (src.stats(), dst.stats());
    assert_eq!(s.orig_data_size, d.orig_data_size);
    assert_eq!(s.same_pages, d.same_pages);
    assert_eq!(s.huge_pages, d.huge_pages);
    // Compressed pages kept their zstd bytes: the same compressed size.
    assert_eq!(s.compr_data_size, d.compr_data_size);
    assert_eq!(tx.pages, d.orig_data_size / PAGE_SIZE as u64);
    assert_eq!(rx.records, tx.records);
    assert_eq!(tx.passes, 2, "one full pass and one (empty) last delta");
}

#[test]
fn writes_during_pre_copy_arrive() {
    let pool = pool();
    let src = device(&pool, SLOTS, Codec::Lz4);
    let cx = &mut Context::new(0);
    for s in 0..SLOTS {
        src.write_page(cx, s, &page(s, 1)).unwrap();
    }
    let dst = device(&pool, SLOTS, Codec::Lz4);
    let stop = AtomicBool::new(false);
    let (a, b) = UnixStream::pair().unwrap();
    let (tx, rx, rounds) = std::thread::scope(|sc| {
        let rx = sc.spawn(|| receive_on(&dst, &b, &b, &|_| {}, &|| {}, &|| {}));
        let writer = sc.spawn(|| {
            let cx = &mut Context::new(1);
            let mut round = 2;
            while !stop.load(Ordering::SeqCst) {
                for s in (round % 7..SLOTS).step_by(7) {
                    src.write_page(cx, s, &page(s, round)).unwrap();
                }
                // Discards travel too.
                src.discard(cx, round..round + 1).unwrap();
                round += 1;
            }
            round
        });
        let passes = std::cell::Cell::new(0);
        let quiet = || {
            // Quiet once the writer has run a while and has stopped.
            if passes.get() >= 5 {
                stop.store(true, Ordering::SeqCst);
                while !writer.is_finished() {
                    std::thread::yield_now();
                }
                return true;
            }
            passes.set(passes.get() + 1);
            std::thread::sleep(std::time::Duration::from_millis(5));
            false
        };
        let tx = send_on(&src, &a, &quiet, &|| Verdict::Commit, &|| None, &|_| {});
        let rounds = writer.join().unwrap();
        (tx, rx.join().unwrap(), rounds)
    });
    let tx = tx.unwrap();
    rx.unwrap();
    assert!(rounds > 2, "the writer never ran");
    assert!(tx.passes > 2, "no delta pass: {tx:?}");
    same_content(&src, &dst);
}

#[test]
fn a_size_mismatch_is_refused_on_both_ends_and_changes_nothing() {
    let pool = pool();
    let src = device(&pool, SLOTS, Codec::Lz4);
    let cx = &mut Context::new(0);
    src.write_page(cx, 0, &page(0, 1)).unwrap();
    let dst = device(&pool, SLOTS * 2, Codec::Lz4);
    dst.write_page(cx, 5, &page(5, 2)).unwrap();
    let (tx, rx) = migrate(&src, &dst, &|| true);
    let tx = tx.unwrap_err().to_string();
    let rx = rx.unwrap_err().to_string();
    assert!(
        tx.contains("sizes must match") && tx.contains("refused"),
        "{tx}"
    );
    assert!(rx.contains("sizes must match"), "{rx}");
    assert!(read(&dst, 5) == page(5, 2));
    assert_eq!(dst.stats().orig_data_size, PAGE_SIZE as u64);
}

/// A valid stream from a real device, as bytes, for tampering with.
fn stream_of(src: &Device) -> Vec<u8> {
    let (a, b) = UnixStream::pair().unwrap();
    std::thread::scope(|sc| {
        // A destination stand-in: accepts, then refuses to confirm (so the
        // sender returns), and records everything sent.
        let rec = sc.spawn(move || {
            use std::io::Read;
            let mut r = b"A".to_vec();
            r.push(b'X');
            r.extend_from_slice(&4u16.to_le_bytes());
            r.extend_from_slice(b"stop");
            (&b).write_all(&r).unwrap();
            let mut all = Vec::new();
            (&b).read_to_end(&mut all).unwrap();
            all
        });
        let r = send_on(src, &a, &|| true, &|| Verdict::Commit, &|| None, &|_| {});
        assert!(r.unwrap_err().to_string().contains("stop"));
        a.shutdown(std::net::Shutdown::Write).unwrap();
        rec.join().unwrap()
    })
}

fn receive_bytes(dst: &Device, bytes: &[u8]) -> Result<migrate::ReceiveReport, MigrateError> {
    let (a, b) = UnixStream::pair().unwrap();
    std::thread::scope(|sc| {
        let w = sc.spawn(move || {
            // The stream, then the source's commit.
            let _ = (&a).write_all(bytes);
            let _ = (&a).write_all(b"C");
            let _ = a.shutdown(std::net::Shutdown::Write);
            // Keep reading replies so the receiver never blocks on them.
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut &a, &mut sink);
        });
        let r = receive_on(dst, &b, &b, &|_| {}, &|| {}, &|| {});
        drop(b);
        w.join().unwrap();
        r
    })
}

#[test]
fn a_hostile_stream_is_refused_and_leaves_the_destination_empty() {
    let pool = pool();
    let src = device(&pool, SLOTS, Codec::Lz4);
    let cx = &mut Context::new(0);
    for s in 0..64 {
        src.write_page(cx, s, &page(s, 1)).unwrap();
    }
    let good = stream_of(&src);
    let dst = device(&pool, SLOTS, Codec::Lz4);
    // The untouched stream is fine.
    receive_bytes(&dst, &good).unwrap();
    same_content(&src, &dst);

    let header = 48;
    let first_record = header + 5; // after the first pass marker
    let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
    // One flipped byte in a page: the checksum catches it.
    let mut flipped = good.clone();
    let mid = good.len() / 2;
    flipped[mid] ^= 0x40;
    cases.push(("flipped", flipped, ""));
    cases.push(("truncated", good[..good.len() - 100].to_vec(), "ended"));
    cases.push(("no final marker", good[..good.len() - 17].to_vec(), "ended"));
    let mut slot = good.clone();
    slot[first_record + 1..first_record + 9].copy_from_slice(&(SLOTS + 5).to_le_bytes());
    cases.push(("slot out of range", slot, "past the end"));
    let mut magic = good.clone();
    magic[0] = b'X';
    cases.push(("bad magic", magic, "magic"));
    let mut version = good.clone();
    version[8] = 9;
    cases.push(("bad version", version, "version 9"));
    let mut tag = good.clone();
    tag[first_record] = b'Z';
    cases.push(("unknown record", tag, "unknown record type"));
    // A compressed record whose bytes do not expand to a page, with a
    // correct checksum: refused by the store's own check.
    let mut forged = good[..header].to_vec();
    forged.extend_from_slice(b"P");
    forged.extend_from_slice(&1u32.to_le_bytes());
    forged.extend_from_slice(b"C");
    forged.extend_from_slice(&3u64.to_le_bytes());
    forged.push(0);
    forged.extend_from_slice(&10u16.to_le_bytes());
    forged.extend_from_slice(&[0x10, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    forged.extend_from_slice(b"F");
    forged.extend_from_slice(&1u64.to_le_bytes());
    let crc = crc32(&forged);
    forged.extend_from_slice(&crc.to_le_bytes());
    cases.push(("garbage compressed page", forged, "expand"));
    let mut codec = good[..header].to_vec();
    codec.extend_from_slice(b"C");
    codec.extend_from_slice(&3u64.to_le_bytes());
    codec.push(3);
    codec.extend_from_slice(&10u16.to_le_bytes());
    cases.push(("unknown codec", codec, "unknown codec"));

    for (what, bytes, says) in cases {
        let e = receive_bytes(&dst, &bytes).expect_err(what).to_string();
        assert!(e.contains(says), "{what}: {e}");
        assert_eq!(
            dst.stats().orig_data_size,
            0,
            "{what}: the device kept pages"
        );
        for s in 0..64 {
            assert!(read(&dst, s) == [0u8; PAGE_SIZE], "{what}: slot {s}");
        }
    }
}

/// crc32 (IEEE), bit by bit: independent of the crate the stream uses.
fn crc32(b: &[u8]) -> u32 {
    let mut c = !0u32;
    for &x in b {
        c ^= u32::from(x);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xedb8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

#[test]
fn dirty_tracking_sees_writes_and_discards_only_while_on() {
    let pool = pool();
    let dev = device(&pool, SLOTS, Codec::Lz4);
    let cx = &mut Context::new(0);
    dev.write_page(cx, 1, &page(1, 1)).unwrap();
    assert_eq!(dev.dirty_slots(), 0, "not tracking yet");
    let (a, b) = UnixStream::pair().unwrap();
    let seen = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|sc| {
        let rx = sc.spawn(|| {
            let dst = device(&pool, SLOTS, Codec::Lz4);
            receive_on(&dst, &b, &b, &|_| {}, &|| {}, &|| {}).map(|_| dst)
        });
        let n = std::cell::Cell::new(0);
        let quiet = || {
            n.set(n.get() + 1);
            match n.get() {
                1 => {
                    let cx = &mut Context::new(0);
                    dev.write_page(cx, 7, &page(7, 2)).unwrap();
                    dev.write_partial(cx, 9, 3, b"x").unwrap();
                    dev.discard(cx, 1..2).unwrap();
                    seen.lock().unwrap().push(dev.dirty_slots());
                    false
                }
                _ => true,
            }
        };
        send_on(&dev, &a, &quiet, &|| Verdict::Commit, &|| None, &|_| {}).unwrap();
        let dst = rx.join().unwrap().unwrap();
        same_content(&dev, &dst);
    });
    assert_eq!(*seen.lock().unwrap(), [3]);
}

/// A record for slot == slots, one past the end, is refused by the stream's
/// parser itself, not left to the store's range check: of each kind, with
/// the rest of the stream (checksum, count) valid. The same record for the
/// last slot is stored.
#[test]
fn a_record_one_past_the_end_is_refused_by_the_parser() {
    let pool = pool();
    let dst = device(&pool, SLOTS, Codec::Lz4);
    let last = SLOTS - 1;
    // Versions of `page` that make a compressed, a raw and a same-filled
    // record for the last slot.
    for (v, tag) in [(1, b'C'), (2, b'R'), (3, b'S')] {
        let src = device(&pool, SLOTS, Codec::Lz4);
        src.write_page(&mut Context::new(0), last, &page(last, v))
            .unwrap();
        let good = stream_of(&src);
        let rec = 48 + 5; // the header, the first pass marker
        assert_eq!(good[rec], tag, "version {v} made another record");
        assert_eq!(good[rec + 1..rec + 9], last.to_le_bytes());
        receive_bytes(&dst, &good).unwrap();
        assert!(read(&dst, last) == page(last, v), "{}", tag as char);
        let mut past = good.clone();
        past[rec + 1..rec + 9].copy_from_slice(&SLOTS.to_le_bytes());
        let n = past.len() - 4;
        let crc = crc32(&past[..n]);
        past[n..].copy_from_slice(&crc.to_le_bytes());
        expect_past_the_end(&dst, &past, tag);
    }
    // An empty record travels only in later passes: built by hand.
    let header = stream_of(&device(&pool, SLOTS, Codec::Lz4))[..48].to_vec();
    for (slot, ok) in [(last, true), (SLOTS, false)] {
        let mut s = header.clone();
        s.extend_from_slice(b"P");
        s.extend_from_slice(&1u32.to_le_bytes());
        s.extend_from_slice(b"E");
        s.extend_from_slice(&slot.to_le_bytes());
        s.extend_from_slice(b"F");
        s.extend_from_slice(&1u64.to_le_bytes());
        let crc = crc32(&s);
        s.extend_from_slice(&crc.to_le_bytes());
        if ok {
            receive_bytes(&dst, &s).unwrap();
        } else {
            expect_past_the_end(&dst, &s, b'E');
        }
    }
}

fn expect_past_the_end(dst: &Device, stream: &[u8], tag: u8) {
    let tag = tag as char;
    match receive_bytes(dst, stream) {
        // The parser's own error, naming the slot and the device's size.
        Err(MigrateError::Bad(m)) => assert!(
            m.contains(&format!(
                "slot {SLOTS} is past the end of the device ({SLOTS} slots)"
            )),
            "{tag}: {m}"
        ),
        Err(e) => panic!("{tag}: a record for slot {SLOTS} got past the parser: {e:?}"),
        Ok(r) => panic!("{tag}: a record for slot {SLOTS} was taken: {r:?}"),
    }
    assert_eq!(
        dst.stats().orig_data_size,
        0,
        "{tag}: the device kept pages"
    );
}

fn written(pool: &Arc<Pool>, n: u64) -> Arc<Device> {
    let src = device(pool, SLOTS, Codec::Lz4);
    let cx = &mut Context::new(0);
    for i in 0..n {
        src.write_page(cx, i, &page(i, 1)).unwrap();
    }
    src
}

/// Nothing is committed until the source says so: while it waits (longer
/// than a keepalive period) the destination holds every page, ungated by
/// nobody; an abort then empties it, and the source still has every page.
#[test]
fn an_aborted_move_leaves_the_destination_empty_and_the_source_whole() {
    let pool = pool();
    let src = written(&pool, 64);
    let dst = device(&pool, SLOTS, Codec::Lz4);
    let t0 = std::time::Instant::now();
    let verdict = || {
        if t0.elapsed() < std::time::Duration::from_millis(2500) {
            Verdict::Wait
        } else {
            Verdict::Abort("the VM runs here again".into())
        }
    };
    let (tx, rx) = migrate_with(&src, &dst, &|| true, &verdict);
    let tx = tx.unwrap_err().to_string();
    let rx = rx.unwrap_err().to_string();
    assert!(
        tx.contains("aborted") && tx.contains("runs here again"),
        "{tx}"
    );
    assert!(
        rx.contains("by the source") && rx.contains("runs here again"),
        "{rx}"
    );
    assert_eq!(dst.stats().orig_data_size, 0, "the destination kept pages");
    assert_eq!(src.stats().orig_data_size, 64 * PAGE_SIZE as u64);
    // A later move of the same device goes through.
    let (tx, rx) = migrate(&src, &dst, &|| true);
    assert_eq!(tx.unwrap().pages, 64);
    assert_eq!(rx.unwrap().pages, 64);
    same_content(&src, &dst);
}

/// A source that goes away after the last delta, before any verdict, has
/// not committed: the destination empties itself.
#[test]
fn a_source_that_leaves_before_its_commit_leaves_the_destination_empty() {
    let pool = pool();
    let src = written(&pool, 32);
    let dst = device(&pool, SLOTS, Codec::Lz4);
    let mut bytes = stream_of(&src);
    // stream_of's stand-in refused to confirm; replay its stream without
    // the commit `receive_bytes` adds, by cutting the connection after it.
    let (a, b) = UnixStream::pair().unwrap();
    let r = std::thread::scope(|sc| {
        let w = sc.spawn(move || {
            (&a).write_all(&bytes).unwrap();
            let mut k = [0u8; 21];
            std::io::Read::read_exact(&mut &a, &mut [0u8; 1]).unwrap();
            std::io::Read::read_exact(&mut &a, &mut k).unwrap();
            bytes.clear();
            // Prepared: every page is there. The source leaves.
            drop(a);
            k
        });
        let r = receive_on(&dst, &b, &b, &|_| {}, &|| {}, &|| {});
        (r, w.join().unwrap())
    });
    let (r, k) = r;
    assert_eq!(k[0], b'K', "no prepared reply");
    assert_eq!(u64::from_le_bytes(k[1..9].try_into().unwrap()), 32);
    let e = r.unwrap_err().to_string();
    assert!(e.contains("went away before it committed"), "{e}");
    assert_eq!(dst.stats().orig_data_size, 0);
}

/// A destination whose confirmation does not carry the record count and
/// checksum that were sent is told to abort, and the send fails: the
/// source drops nothing on a confirmation it cannot check.
#[test]
fn a_confirmation_with_the_wrong_count_or_checksum_commits_nothing() {
    let pool = pool();
    let src = written(&pool, 16);
    for lie in 0..3u8 {
        let (a, b) = UnixStream::pair().unwrap();
        let told = std::thread::scope(|sc| {
            let fake = sc.spawn(move || {
                use std::io::Read;
                (&b).write_all(b"A").unwrap();
                // Read up to the final marker's end: header, pass, records.
                let mut all = Vec::new();
                let mut buf = [0u8; 65536];
                let (records, crc) = loop {
                    let n = (&b).read(&mut buf).unwrap();
                    assert!(n > 0, "the stream ended early");
                    all.extend_from_slice(&buf[..n]);
                    // 16 raw-or-compressed records end with 'F' count crc.
                    if all.len() > 13 && all[all.len() - 13] == b'F' {
                        let t = all.len() - 12;
                        let records = u64::from_le_bytes(all[t..t + 8].try_into().unwrap());
                        let crc = u32::from_le_bytes(all[t + 8..].try_into().unwrap());
                        if records == 16 {
                            break (records, crc);
                        }
                    }
                };
                let (records, crc) = match lie {
                    0 => (0, crc),
                    1 => (records, crc ^ 1),
                    _ => (records + 1, crc),
                };
                let mut k = vec![b'K'];
                k.extend_from_slice(&16u64.to_le_bytes());
                k.extend_from_slice(&records.to_le_bytes());
                k.extend_from_slice(&crc.to_le_bytes());
                (&b).write_all(&k).unwrap();
                let mut rest = Vec::new();
                let _ = (&b).read_to_end(&mut rest);
                rest
            });
            let r = send_on(&src, &a, &|| true, &|| Verdict::Commit, &|| None, &|_| {});
            drop(a);
            (r, fake.join().unwrap())
        });
        let (r, rest) = told;
        let e = r.unwrap_err().to_string();
        assert!(e.contains("the destination confirmed"), "lie {lie}: {e}");
        assert_eq!(rest.first(), Some(&b'B'), "lie {lie}: no abort sent");
        assert_eq!(src.stats().orig_data_size, 16 * PAGE_SIZE as u64);
    }
}

/// A cancel while the guest still runs here (its VMM's own migration was
/// called off in pre-copy) ends the stream at once: the destination drops
/// what it took, the source keeps every page, both say "aborted".
#[test]
fn a_cancel_during_pre_copy_aborts_both_ends_and_the_source_keeps_everything() {
    let pool = pool();
    let src = device(&pool, SLOTS, Codec::Lz4);
    let cx = &mut Context::new(0);
    for s in 0..SLOTS {
        src.write_page(cx, s, &page(s, 1)).unwrap();
    }
    let before: Vec<_> = (0..SLOTS).map(|s| read(&src, s)).collect();
    let dst = device(&pool, SLOTS, Codec::Lz4);
    let passes = std::sync::atomic::AtomicU32::new(0);
    let (a, b) = UnixStream::pair().unwrap();
    let (tx, rx) = std::thread::scope(|sc| {
        let rx = sc.spawn(|| {
            receive_on(&dst, &b, &b, &|_| {}, &|| panic!("prepared"), &|| {
                panic!("committed")
            })
        });
        // Never quiet: the guest runs; the cancel comes after a few
        // (empty) passes over dirty slots.
        let cancelled = || {
            (passes.fetch_add(1, Ordering::Relaxed) >= 5)
                .then(|| "cancelled by the operator".into())
        };
        let tx = send_on(
            &src,
            &a,
            &|| false,
            &|| panic!("no verdict is asked before the last delta"),
            &cancelled,
            &|_| {},
        );
        drop(a);
        (tx, rx.join().unwrap())
    });
    match tx {
        Err(MigrateError::Aborted(why)) => assert!(why.contains("cancelled"), "{why}"),
        r => panic!("the source: {r:?}"),
    }
    match rx {
        Err(MigrateError::Aborted(why)) => assert!(why.contains("cancelled"), "{why}"),
        r => panic!("the destination: {r:?}"),
    }
    assert_eq!(dst.stats().orig_data_size, 0, "the destination dropped it");
    for s in 0..SLOTS {
        assert!(read(&src, s) == before[s as usize], "slot {s} changed");
    }
}
