//! Raw staging: whole-page writes stored raw while the staging budget has
//! room, compressed later by `Device::compress_staged`. Each test checks
//! what a user of the store would see: pages read back the same at every
//! step, the memory comes back, a full budget compresses inline, and a
//! device dropped with pages staged recovers them and their queue.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vzram_store::{Codec, Context, Device, DeviceConfig, Pool, PoolConfig, StateSpec, PAGE_SIZE};

mod common;
use common::{noise, varied};

const PAGES: u64 = 64;
const STAGE_ALL: u64 = 2 * PAGES * PAGE_SIZE as u64;

fn cfg(staging: u64) -> DeviceConfig {
    let mut c = DeviceConfig::new(256 * PAGE_SIZE as u64, Codec::Lz4);
    c.shards = 2;
    c.staging_bytes = staging;
    c
}

fn device(staging: u64) -> (Arc<Pool>, Arc<Device>) {
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let dev = pool.create_device(cfg(staging)).unwrap();
    (pool, dev)
}

fn read(dev: &Device, s: u64) -> vzram_store::Page {
    let mut out = [0u8; PAGE_SIZE];
    dev.read_page(&mut Context::new(0), s, &mut out).unwrap();
    out
}

fn check(dev: &Device, pages: &[(u64, vzram_store::Page)], when: &str) {
    for (s, p) in pages {
        assert!(read(dev, *s) == *p, "slot {s} reads back changed {when}");
    }
}

/// A page that compresses to about the size of the others (one size
/// class, so one span holds many): 300 bytes of noise, then a pattern.
fn one_class(i: u64) -> vzram_store::Page {
    let mut p = noise(i + 1000);
    for (j, b) in p.iter_mut().enumerate().skip(300) {
        *b = (j / 32) as u8;
    }
    p
}

fn drain(dev: &Device) -> usize {
    let cx = &mut Context::new(1);
    let mut n = 0;
    loop {
        let k = dev.compress_staged(cx, 16);
        if k == 0 {
            return n;
        }
        n += k;
    }
}

#[test]
fn a_staged_page_reads_back_and_compresses_in_the_background() {
    let (_pool, dev) = device(STAGE_ALL);
    let cx = &mut Context::new(0);
    let pages: Vec<_> = (0..PAGES).map(|s| (s, varied(s))).collect();
    for (s, p) in &pages {
        dev.write_page(cx, *s, p).unwrap();
    }
    let st = dev.stats();
    assert_eq!(st.staged_bytes, PAGES * PAGE_SIZE as u64, "{st:?}");
    assert_eq!(st.huge_pages, PAGES, "staged pages are stored raw");
    check(&dev, &pages, "while staged");
    assert_eq!(drain(&dev), PAGES as usize);
    let st = dev.stats();
    assert_eq!(
        (st.staged_bytes, st.huge_pages, st.staged_compressed),
        (0, 0, PAGES),
        "{st:?}"
    );
    assert!(st.compr_data_size < PAGES * PAGE_SIZE as u64 / 2, "{st:?}");
    assert!(st.staged_wait_max_micros <= st.staged_wait_micros);
    check(&dev, &pages, "after the background compressed them");
}

/// A page the codec cannot shrink ends as an ordinary huge page: it is
/// not tried again, and it reads back.
#[test]
fn an_incompressible_staged_page_becomes_an_ordinary_huge_page() {
    let (_pool, dev) = device(STAGE_ALL);
    let cx = &mut Context::new(0);
    let pages = [(3, noise(3)), (4, varied(4))];
    for (s, p) in &pages {
        dev.write_page(cx, *s, p).unwrap();
    }
    assert_eq!(drain(&dev), 2);
    let st = dev.stats();
    assert_eq!((st.staged_bytes, st.huge_pages), (0, 1), "{st:?}");
    assert!(!dev.has_staged());
    assert_eq!(drain(&dev), 0, "nothing is left to compress");
    check(&dev, &pages, "after the background");
}

/// Overwrites, discards and compaction while pages are staged: the queue's
/// stale entries are skipped, a staged page moved by compaction is still
/// compressed, and every byte of memory comes back.
#[test]
fn overwrites_and_discards_while_staged_leak_nothing() {
    let (pool, dev) = device(STAGE_ALL);
    let cx = &mut Context::new(0);
    let mut pages: Vec<_> = (0..PAGES).map(|s| (s, varied(s))).collect();
    for (s, p) in &pages {
        dev.write_page(cx, *s, p).unwrap();
    }
    // Every third page rewritten (staged again), every fifth discarded.
    for (s, p) in pages.iter_mut() {
        if *s % 3 == 0 {
            *p = varied(*s + 1000);
            dev.write_page(cx, *s, p).unwrap();
        } else if *s % 5 == 0 {
            *p = [0; PAGE_SIZE];
            dev.discard(cx, *s..*s + 1).unwrap();
        }
    }
    // Holes in the raw pages' spans: compaction moves staged pages.
    dev.compact();
    check(&dev, &pages, "after compaction while staged");
    drain(&dev);
    let st = dev.stats();
    assert_eq!((st.staged_bytes, st.huge_pages), (0, 0), "{st:?}");
    check(&dev, &pages, "after the background");
    dev.discard(cx, 0..256).unwrap();
    dev.compact();
    let st = dev.stats();
    assert_eq!(st.mem_used_total, 0, "memory leaked: {st:?}");
    assert_eq!(pool.stats().mem_used_total, 0);
}

/// With the budget full, a write compresses inline as without staging; a
/// prepared write dropped uncommitted gives its room back.
#[test]
fn a_full_staging_budget_compresses_inline() {
    let (_pool, dev) = device(4 * PAGE_SIZE as u64);
    let cx = &mut Context::new(0);
    let pages: Vec<_> = (0..10).map(|s| (s, varied(s))).collect();
    for (s, p) in &pages {
        dev.write_page(cx, *s, p).unwrap();
    }
    let st = dev.stats();
    assert_eq!((st.staged_bytes, st.huge_pages), (4 * PAGE_SIZE as u64, 4));
    check(&dev, &pages, "half staged");
    drain(&dev);
    let held = dev.prepare_write(cx, 20, &varied(20)).unwrap();
    assert_eq!(dev.staged_bytes(), PAGE_SIZE as u64);
    drop(held);
    assert_eq!(dev.staged_bytes(), 0, "an abandoned write kept its room");
    dev.prepare_write(cx, 20, &varied(20)).unwrap().commit();
    assert!(dev.has_staged());
    // Off: writes compress inline again.
    dev.set_staging_budget(0);
    dev.write_page(cx, 21, &varied(21)).unwrap();
    assert_eq!(dev.stats().huge_pages, 1, "only slot 20 is staged");
    assert!(read(&dev, 20) == varied(20) && read(&dev, 21) == varied(21));
}

/// The host's staging budget bounds all devices together, each within its
/// own: past it, writes compress inline on every device; what one device's
/// background compresses makes room for another's writes; 0 stages nothing.
#[test]
fn the_host_staging_budget_bounds_every_device_together() {
    let page = PAGE_SIZE as u64;
    let pool = Pool::new(PoolConfig {
        host_staging: 6 * page,
        ..PoolConfig::default()
    })
    .unwrap();
    let host = || pool.host_cells().staging().used();
    let a = pool.create_device(cfg(STAGE_ALL)).unwrap();
    let b = pool.create_device(cfg(STAGE_ALL)).unwrap();
    let cx = &mut Context::new(0);
    let pages: Vec<_> = (0..10).map(|s| (s, varied(s))).collect();
    for (s, p) in &pages {
        a.write_page(cx, *s, p).unwrap();
        b.write_page(cx, *s, &varied(*s + 100)).unwrap();
    }
    let staged = |d: &Device| d.staged_bytes() / page;
    assert_eq!((staged(&a), staged(&b)), (3, 3), "taking turns");
    assert_eq!(host(), 6 * page);
    assert_eq!(pool.stats().staged_bytes, 6 * page);
    assert_eq!(pool.stats().staging_limit, 6 * page);
    check(&a, &pages, "half staged");
    drain(&a);
    assert_eq!(host(), 3 * page);
    for s in 10..20 {
        b.write_page(cx, s, &varied(s + 100)).unwrap();
    }
    assert_eq!(staged(&b), 6, "a's room went to b");
    // Discarded and overwritten staged pages give the host its room back.
    b.discard(cx, 0..3).unwrap();
    assert_eq!(host(), 3 * page);
    b.write_page(cx, 10, &varied(1)).unwrap();
    assert_eq!(host(), 3 * page, "a staged page restaged");
    pool.set_host_staging(0);
    b.write_page(cx, 30, &varied(30)).unwrap();
    assert_eq!(staged(&b), 3, "staged with the host's staging off");
    drain(&b);
    assert_eq!(host(), 0);
    check(&a, &pages, "after the background");
    for s in 0..3 {
        assert!(read(&b, s) == [0; PAGE_SIZE]);
    }
    assert!(read(&b, 10) == varied(1) && read(&b, 30) == varied(30));
    // A device of no state dropped with pages staged: its memory and its
    // staged pages' room go with it.
    pool.set_host_staging(6 * page);
    a.write_page(cx, 50, &varied(50)).unwrap();
    assert_eq!((staged(&a), host()), (1, page));
    drop(a);
    assert_eq!(host(), 0, "a dropped device kept the host's staging");
}

/// Past 3/4 of the device's memory limit writes compress inline: staged
/// raw pages must not fill the room compressed pages would have fitted in.
#[test]
fn near_a_memory_limit_writes_compress_inline() {
    let (_pool, dev) = device(STAGE_ALL);
    let limit = 64 * PAGE_SIZE as u64;
    dev.set_mem_limit(limit);
    let cx = &mut Context::new(0);
    // 200 pages that compress to one size class: today they fit.
    let alike = |i: u64| {
        let mut p = [0u8; PAGE_SIZE];
        for (j, w) in p.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&(i * 1000 + j as u64 % 7).to_le_bytes());
        }
        p
    };
    let pages: Vec<_> = (0..200).map(|s| (s, alike(s))).collect();
    for (s, p) in &pages {
        dev.write_page(cx, *s, p)
            .unwrap_or_else(|e| panic!("slot {s}: {e}: {:?}", dev.stats()));
    }
    let st = dev.stats();
    assert!(st.mem_used_total <= limit, "{st:?}");
    // Staging was used, and stopped short of the limit.
    assert!(st.staged_bytes + st.staged_compressed > 0, "{st:?}");
    assert!(st.staged_bytes <= limit / 4 * 3, "{st:?}");
    check(&dev, &pages, "near the limit");
    drain(&dev);
    check(&dev, &pages, "after the background");
}

/// Spare spans are charged: near a memory limit a write of any path (here
/// the compress pool's, which never stages) must get their room rather
/// than be refused. Overwriting raw pages with compressible ones left a
/// spare per page, and the 32nd overwrite under this limit was refused.
#[test]
fn no_write_is_refused_for_room_that_spares_hold() {
    let (_pool, dev) = device(128 * PAGE_SIZE as u64);
    let cx = &mut Context::new(0);
    // Incompressible pages: a one-page span each, staged then kept raw.
    for s in 0..64 {
        dev.write_page(cx, s, &noise(s)).unwrap();
    }
    drain(&dev);
    let used = dev.stats().mem_used_total;
    dev.set_mem_limit(used + 8 * PAGE_SIZE as u64);
    for s in 0..32 {
        dev.prepare_compressed(cx, s, &one_class(s))
            .unwrap_or_else(|e| panic!("overwrite of slot {s}: {e}: {:?}", dev.stats()))
            .commit();
    }
    // New pages until the limit refuses one: then nothing is left to
    // give back, so a compaction makes no room for it either.
    let refused = (64..256)
        .find(|&s| match dev.prepare_compressed(cx, s, &one_class(s)) {
            Ok(p) => {
                p.commit();
                false
            }
            Err(_) => true,
        })
        .expect("the limit never refused a write");
    dev.compact();
    assert!(
        dev.prepare_compressed(cx, refused, &one_class(refused))
            .is_err(),
        "slot {refused} was refused while spare spans held room: {:?}",
        dev.stats()
    );
    for s in 0..32 {
        assert!(read(&dev, s) == one_class(s), "slot {s}");
    }
}

/// Spares are kept only away from the memory limits: a device whose
/// staged pages are compressed while the host is past 3/4 of its limit
/// (another device's pages, here) gives their spans back, for the room
/// is wanted; away from it, they wait for the next staged pages.
#[test]
fn near_a_limit_the_background_keeps_no_spares() {
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let a = pool.create_device(cfg(STAGE_ALL)).unwrap();
    let b = pool.create_device(cfg(0)).unwrap();
    let cx = &mut Context::new(0);
    for round in 0..2u64 {
        for s in 0..PAGES {
            a.write_page(cx, s, &one_class(s + round * 100)).unwrap();
        }
        if round == 1 {
            // b's raw pages and the host's limit keep the host past 3/4
            // of it all along, with room for the compressed pages' spans.
            for s in 0..3 * PAGES {
                b.write_page(cx, s, &noise(s)).unwrap();
            }
            let used = pool.stats().mem_used_total;
            pool.set_host_mem_limit(used + 16 * PAGE_SIZE as u64);
        }
        assert_eq!(drain(&a), PAGES as usize);
        let spares = a.spare_spans();
        if round == 0 {
            assert!(spares > 0, "no spares kept away from the limit");
            a.compact();
        } else {
            assert_eq!(spares, 0, "spares kept near the host's limit");
        }
    }
    pool.set_host_mem_limit(0);
}

/// A multi-page write is staged by its queue thread only while every page
/// of it finds room: in the device's budget, in the host's, and away from
/// a memory limit. Past any of them it goes to the compress pool.
#[test]
fn staging_room_counts_every_budget() {
    let (pool, dev) = device(32 * PAGE_SIZE as u64);
    let cx = &mut Context::new(0);
    assert!(dev.staging_room(16));
    assert!(dev.staging_room(31), "the device's budget has 32 pages");
    assert!(!dev.staging_room(33), "more than the device's budget");
    for s in 0..16 {
        dev.write_page(cx, s, &varied(s)).unwrap();
    }
    assert_eq!(dev.staged_bytes(), 16 * PAGE_SIZE as u64);
    assert!(dev.staging_room(16));
    assert!(!dev.staging_room(17), "16 of the 32 pages are taken");
    // The host's budget binds as well.
    pool.set_host_staging(20 * PAGE_SIZE as u64);
    assert!(dev.staging_room(4));
    assert!(!dev.staging_room(5), "the host has room for 4 more");
    pool.set_host_staging(1 << 30);
    // Near a memory limit, none.
    dev.set_mem_limit(20 * PAGE_SIZE as u64);
    assert!(!dev.staging_room(1), "past 3/4 of the device's limit");
    dev.set_mem_limit(0);
    assert!(dev.staging_room(16));
    // Staging off: none.
    dev.set_staging_budget(0);
    assert!(!dev.staging_room(1));
    drain(&dev);
}

/// The background threads sleep once they find the FIFO empty, and a
/// FIFO that stops being empty wakes them. A writer near a memory limit
/// that takes the last staged page to compress it and finds no room puts
/// it back: the FIFO was empty meanwhile, so that must wake them too
/// (otherwise the page waits for a staged write into an empty FIFO, which
/// never comes while it is there: a soak's 1200 staged pages waited 30 s
/// for a pool thread asleep with them queued).
#[test]
fn a_staged_page_put_back_for_want_of_memory_wakes_the_background() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (_pool, dev) = device(STAGE_ALL);
    let wakes = Arc::new(AtomicUsize::new(0));
    let w = wakes.clone();
    dev.set_staging_waker(Box::new(move || {
        w.fetch_add(1, Ordering::SeqCst);
    }));
    let cx = &mut Context::new(0);
    let page = varied(1);
    dev.write_page(cx, 0, &page).unwrap();
    assert_eq!(dev.stats().staged_bytes, PAGE_SIZE as u64);
    assert_eq!(
        wakes.load(Ordering::SeqCst),
        1,
        "the first staged page wakes"
    );
    // No room for the compressed object: the page goes back.
    dev.set_mem_limit(dev.stats().mem_used_total);
    assert_eq!(dev.compress_staged(&mut Context::new(1), 8), 0);
    assert!(dev.has_staged());
    assert_eq!(
        wakes.load(Ordering::SeqCst),
        2,
        "the page put back into an empty FIFO wakes the background"
    );
    // Room again: the background takes it.
    dev.set_mem_limit(0);
    assert_eq!(drain(&dev), 1);
    assert_eq!(dev.stats().staged_bytes, 0);
    check(&dev, &[(0, page)], "after the background");
}

struct Root(PathBuf);

impl Drop for Root {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn with_state(root: &Path) -> DeviceConfig {
    let mut c = cfg(STAGE_ALL);
    c.state = Some(StateSpec {
        root: root.to_path_buf(),
        name: "d".into(),
        ..StateSpec::default()
    });
    c
}

/// A device dropped (as a killed process leaves its state files) with half
/// its pages still staged recovers every page, finds the staged ones again
/// and compresses them afterwards.
#[test]
fn recovery_keeps_staged_pages_and_their_queue() {
    let root = Root(std::env::temp_dir().join(format!("vzram-staging-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&root.0);
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let dev = pool.create_device(with_state(&root.0)).unwrap();
    let cx = &mut Context::new(0);
    let pages: Vec<_> = (0..PAGES)
        .map(|s| (s, if s % 7 == 0 { noise(s) } else { varied(s) }))
        .collect();
    for (s, p) in &pages {
        dev.write_page(cx, *s, p).unwrap();
    }
    let done = dev.compress_staged(&mut Context::new(1), PAGES as usize / 2);
    assert_eq!(done, PAGES as usize / 2);
    let left = dev.staged_bytes();
    assert!(left > 0);
    drop(dev);

    let host = || pool.host_cells().staging().used();
    assert_eq!(host(), left, "the dropped device's staged pages");

    let dev = pool.create_device(with_state(&root.0)).unwrap();
    let rec = dev.recovery().expect("recovered");
    assert_eq!(rec.staged * PAGE_SIZE as u64, left, "{rec:?}");
    assert_eq!(dev.staged_bytes(), left);
    assert_eq!(host(), left, "recovery charged the host's staging twice");
    assert!(
        dev.has_staged(),
        "the queue of staged slots was not rebuilt"
    );
    check(&dev, &pages, "after recovery");
    drain(&dev);
    let st = dev.stats();
    assert_eq!(st.staged_bytes, 0, "{st:?}");
    assert_eq!(host(), 0);
    assert_eq!(st.huge_pages, PAGES.div_ceil(7), "{st:?}");
    check(&dev, &pages, "after the background, recovered");
    drop(dev);

    let dev = pool.create_device(with_state(&root.0)).unwrap();
    assert_eq!(dev.recovery().unwrap().staged, 0);
    check(&dev, &pages, "after the second recovery");
}

/// The spans staged pages leave are kept as spares for the next staged
/// pages (none made, none punched out), charged while kept, and given
/// back by compaction: nothing is left once every page is gone.
#[test]
fn spare_spans_are_reused_charged_and_given_back() {
    let (pool, dev) = device(STAGE_ALL);
    let cx = &mut Context::new(0);
    // Pages that compress to objects of one class: their spans take a
    // page or two, against the staged pages' one each.
    let page = |s: u64| {
        let mut p = [0u8; PAGE_SIZE];
        for (i, b) in p.iter_mut().enumerate() {
            *b = (i % 251) as u8 ^ s as u8;
        }
        p
    };
    let pages: Vec<_> = (0..PAGES).map(|s| (s, page(s))).collect();
    for (s, p) in &pages {
        dev.write_page(cx, *s, p).unwrap();
    }
    let staged = dev.stats().mem_used_total;
    assert!(staged >= PAGES * PAGE_SIZE as u64);
    assert_eq!(drain(&dev), PAGES as usize);
    // Fewer than COMPACT_AFTER pages: the spares stay, charged.
    let kept = dev.stats().mem_used_total;
    assert!(
        kept >= staged,
        "the raw pages' spans were given back, not kept: {staged} -> {kept}"
    );
    // The next burst takes them: memory does not grow by a span per page.
    for (s, p) in &pages {
        dev.write_page(cx, *s, p).unwrap();
    }
    let again = dev.stats().mem_used_total;
    assert!(
        again <= kept,
        "staging again made new spans: {kept} -> {again}"
    );
    check(&dev, &pages, "staged over spares");
    assert_eq!(drain(&dev), PAGES as usize);
    check(&dev, &pages, "compressed again");
    dev.discard(cx, 0..PAGES).unwrap();
    dev.compact();
    assert_eq!(dev.stats().mem_used_total, 0, "spares leaked");
    assert_eq!(pool.stats().mem_used_total, 0);
}

/// A swap device rewrites the same slots over and over: a staged page
/// overwritten while staged leaves its span as a spare for the next one,
/// so rewriting every page makes one span, not one a page. A discard
/// keeps none: its memory goes back.
#[test]
fn an_overwrite_keeps_the_span_a_discard_gives_back() {
    let (pool, dev) = device(STAGE_ALL);
    let cx = &mut Context::new(0);
    let span = PAGE_SIZE as u64;
    for s in 0..PAGES {
        dev.write_page(cx, s, &varied(s)).unwrap();
    }
    let staged = dev.stats().mem_used_total;
    assert_eq!(staged, PAGES * span, "a span a staged page");
    // The first overwrite makes a span and leaves the old one spare;
    // every later one takes the spare the one before left.
    for round in 1..=3 {
        let pages: Vec<_> = (0..PAGES).map(|s| (s, varied(s + round * 1000))).collect();
        for (s, p) in &pages {
            dev.write_page(cx, *s, p).unwrap();
        }
        assert_eq!(
            dev.stats().mem_used_total,
            staged + span,
            "round {round}: no spare waits: each overwrite gave its span back and made a new one"
        );
        check(&dev, &pages, "overwritten while staged");
    }
    // A discard gives back the discarded pages' spans; only the one spare
    // left by the overwrites stays, until compaction.
    dev.discard(cx, 0..PAGES).unwrap();
    assert_eq!(dev.stats().mem_used_total, span, "a discard kept spares");
    dev.compact();
    assert_eq!(dev.stats().mem_used_total, 0, "spares leaked");
    assert_eq!(pool.stats().mem_used_total, 0);
}

/// A write a memory limit refuses, with nothing staged but spares held,
/// gets the spares' room: they are charged, so without giving them back
/// the device would refuse a write it has room for.
#[test]
fn a_refused_write_takes_the_room_of_the_spares() {
    let (_pool, dev) = device(STAGE_ALL);
    let cx = &mut Context::new(0);
    for s in 0..PAGES {
        dev.write_page(cx, s, &varied(s)).unwrap();
    }
    assert_eq!(drain(&dev), PAGES as usize);
    let used = dev.stats().mem_used_total;
    assert!(used >= PAGES * PAGE_SIZE as u64, "no spares were kept");
    // Room for 2 more pages: past 3/4 of it, so nothing stages. The new
    // pages compress to objects of other classes than a raw page's, so
    // they cannot take the spares' spans: only their room.
    let limit = used + 2 * PAGE_SIZE as u64;
    dev.set_mem_limit(limit);
    let more: Vec<_> = (PAGES..PAGES + 8).map(|s| (s, varied(s))).collect();
    for (s, p) in &more {
        dev.write_page(cx, *s, p)
            .unwrap_or_else(|e| panic!("slot {s}: {e}: {:?}", dev.stats()));
    }
    let st = dev.stats();
    assert!(st.mem_used_total <= limit, "{st:?}");
    check(&dev, &more, "past the spares");
    let first: Vec<_> = (0..PAGES).map(|s| (s, varied(s))).collect();
    check(&dev, &first, "after the spares went");
}

/// Staging never makes a device at its memory limit refuse a write that
/// the same device without staging takes: raw pages must leave room for
/// the spans their compressed forms need. Pages of many sizes, so that
/// their objects need spans of many classes.
#[test]
fn staging_fills_a_limited_device_as_far_as_inline_compression() {
    for limit_pages in [48u64, 96, 200, 400] {
        let fill = |staging: u64| {
            let pool = Pool::new(PoolConfig::default()).unwrap();
            let mut c = DeviceConfig::new(2048 * PAGE_SIZE as u64, Codec::Lz4);
            c.shards = 2;
            c.staging_bytes = staging;
            c.mem_limit = limit_pages * PAGE_SIZE as u64;
            let dev = pool.create_device(c).unwrap();
            let cx = &mut Context::new(0);
            let mut n = 0;
            while n < 2048 && dev.write_page(cx, n, &varied(n * 7)).is_ok() {
                n += 1;
                if n % 64 == 0 {
                    // The background's turn (on the writer's shard: other
                    // shards' partly used spans are another matter).
                    dev.compress_staged(cx, 16);
                }
            }
            let st = dev.stats();
            assert!(
                st.mem_used_total <= limit_pages * PAGE_SIZE as u64,
                "{st:?}"
            );
            (n, st.staged_compressed)
        };
        let (inline, _) = fill(0);
        let (staged, compressed) = fill(STAGE_ALL);
        assert!(compressed > 0, "limit {limit_pages}: nothing was staged");
        assert!(
            staged >= inline,
            "limit {limit_pages} pages: {staged} pages fit with staging, {inline} without"
        );
    }
}

/// Spare spans a killed process left (populated, named by no slot) are
/// given back by recovery, also those past the last span in use.
#[test]
fn recovery_gives_back_the_spares_a_kill_left() {
    let root = Root(std::env::temp_dir().join(format!("vzram-spares-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&root.0);
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let dev = pool.create_device(with_state(&root.0)).unwrap();
    let cx = &mut Context::new(0);
    // Staged, a span each; compressed, their spans become spares (fewer
    // than COMPACT_AFTER: no compaction gives them back).
    for s in 0..PAGES {
        dev.write_page(cx, s, &varied(s)).unwrap();
    }
    assert_eq!(drain(&dev), PAGES as usize);
    // Nothing in use is left, so every spare lies past the last span.
    dev.discard(cx, 0..PAGES).unwrap();
    drop(dev);
    let arena = root.0.join("d").join("arena");
    let held = |what: &str| {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&arena).unwrap_or_else(|e| panic!("{what}: {e}"));
        m.blocks() * 512
    };
    assert!(
        held("before") >= PAGES * PAGE_SIZE as u64,
        "no spares were kept"
    );

    let dev = pool.create_device(with_state(&root.0)).unwrap();
    assert_eq!(dev.stats().mem_used_total, 0);
    // Slack: a disk file system counts the blocks of a sparse file's
    // extent tree too (two pages on ext4 here); the spares were 64.
    assert!(
        held("after recovery") <= 4 * PAGE_SIZE as u64,
        "recovery left {} bytes of spares in the arena",
        held("after recovery")
    );
}

/// Spares a burst left are given back, near a memory limit, once a tick
/// passes with none taken: one device's idle spares must not make the
/// host's limit refuse another device's write. Away from the limits, and
/// while staged pages take them, they stay.
#[test]
fn idle_spares_near_a_limit_go_back_for_other_devices() {
    let page = PAGE_SIZE as u64;
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let a = pool.create_device(cfg(STAGE_ALL)).unwrap();
    let b = pool.create_device(cfg(0)).unwrap();
    let cx = &mut Context::new(0);
    let pages: Vec<_> = (0..PAGES).map(|s| (s, varied(s))).collect();
    for (s, p) in &pages {
        a.write_page(cx, *s, p).unwrap();
    }
    assert_eq!(drain(&a), PAGES as usize);
    let spares = a.spare_spans() as u64;
    assert!(spares > 8, "the burst left {spares} spares");
    // Away from any limit they stay: they cost nothing there.
    assert_eq!(a.release_unused_spares(), 0);
    assert_eq!(a.spare_spans() as u64, spares);
    // A stages again, taking some, and compresses.
    for (s, p) in &pages[..4] {
        a.write_page(cx, *s, p).unwrap();
    }
    assert_eq!(drain(&a), 4);
    // B fills the host up to its limit: the spares' room is all that is
    // left, and B (which stages nothing, holds no spares) is refused.
    pool.set_host_mem_limit(pool.stats().mem_used_total + 4 * page);
    let refused = (0..256)
        .find(|&s| b.write_page(cx, s, &noise(s)).is_err())
        .expect("the host's limit never refused b");
    assert!(b.write_page(cx, refused, &noise(refused)).is_err());
    // Near the limit now: a tick after one in which spares were taken keeps
    // them (the burst may go on)...
    assert_eq!(a.release_unused_spares(), 0, "spares taken this tick went");
    // ...and the next, with none taken, gives them back: b gets their room.
    let before = pool.stats().mem_used_total;
    let given = a.release_unused_spares();
    assert_eq!(given, spares, "{:?}", a.stats());
    assert_eq!(a.spare_spans(), 0);
    assert_eq!(pool.stats().mem_used_total, before - given * page);
    b.write_page(cx, refused, &noise(refused))
        .unwrap_or_else(|e| panic!("b still refused: {e}: {:?}", pool.stats()));
    check(&a, &pages, "after its spares went");
    assert!(read(&b, refused) == noise(refused));
}
