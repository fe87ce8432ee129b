//! Unit tests of the device's jobs that need its insides (the table's
//! residency, the object walk).

use super::*;
use crate::pool::PoolConfig;

const PER_PAGE: u64 = crate::table::SLOTS_PER_PAGE;

/// Makes mincore report table page `page` of `dev` as not resident while
/// its slots stay intact, as after the host swapped it out.
fn page_out(dev: &Device, page: u64) {
    dev.table.page_out(page as usize);
}

/// What a pool shares, without its registry (which lives above the device).
fn pool() -> Arc<Shared> {
    let cfg = PoolConfig {
        arena_bytes: 1 << 30,
        ..Default::default()
    };
    Arc::new(Shared::new(&cfg, None).unwrap())
}

fn create(pool: &Arc<Shared>, cfg: DeviceConfig) -> Result<Arc<Device>> {
    Device::new(pool.clone(), cfg).map(Arc::new)
}

/// A compressible page that differs per `i`.
fn page(i: u64) -> Page {
    let mut p = [0u8; PAGE_SIZE];
    for (j, c) in p.chunks_exact_mut(8).enumerate() {
        c.copy_from_slice(&(i * 1000 + j as u64 % 7).to_le_bytes());
    }
    p
}

/// Slots on 64 table pages, written three ways; returns them in order.
fn write_spread(dev: &Device) -> Vec<u64> {
    let cx = &mut Context::new(0);
    let mut written = Vec::new();
    for tp in 0..64 {
        let s = tp * PER_PAGE + (tp * 37) % PER_PAGE;
        match tp % 3 {
            0 => dev.write_page(cx, s, &page(s)).unwrap(),
            1 => dev.write_page(cx, s, &[0x5a; PAGE_SIZE]).unwrap(),
            _ => dev.write_partial(cx, s, 100, &[1, 2, 3]).unwrap(),
        }
        written.push(s);
    }
    written
}

fn device(pool: &Arc<Shared>, slots: u64) -> Arc<Device> {
    let mut cfg = DeviceConfig::new(slots * PAGE_SIZE as u64, Codec::Lz4);
    cfg.shards = 1;
    create(pool, cfg).unwrap()
}

#[test]
fn objects_on_paged_out_table_pages_are_still_found() {
    let pool = pool();
    let dev = device(&pool, 64 * PER_PAGE);
    let written = write_spread(&dev);
    // Written, then discarded: its page is marked but it is empty.
    let cx = &mut Context::new(0);
    dev.write_page(cx, 3, &page(3)).unwrap();
    dev.discard(cx, 3..4).unwrap();
    for tp in (0..64).step_by(2) {
        page_out(&dev, tp);
    }
    let mut seen = Vec::new();
    dev.for_each_object(|s, _| seen.push(s));
    assert_eq!(seen, written);
}

#[test]
fn drop_frees_objects_on_paged_out_table_pages() {
    let pool = pool();
    let dev = device(&pool, 64 * PER_PAGE);
    write_spread(&dev);
    for tp in 0..64 {
        page_out(&dev, tp);
    }
    let held = pool.host().used();
    assert!(held > 0);
    drop(dev);
    assert_eq!(
        pool.host().used(),
        0,
        "dropping the device leaked spans ({held} bytes were held)"
    );
}

#[test]
fn compaction_moves_objects_on_paged_out_table_pages() {
    const N: u64 = 4 * PER_PAGE;
    let pool = pool();
    let dev = device(&pool, N);
    let cx = &mut Context::new(0);
    for s in 0..N {
        dev.write_page(cx, s, &page(s)).unwrap();
    }
    for s in (0..N).step_by(2) {
        dev.discard(cx, s..s + 1).unwrap();
    }
    for tp in 0..N / PER_PAGE {
        page_out(&dev, tp);
    }
    let before = dev.stats().mem_used_total;
    let pages = dev.compact();
    let after = dev.stats();
    assert!(pages > 0, "compaction moved nothing");
    assert_eq!(before - after.mem_used_total, pages * PAGE_SIZE as u64);
    let mut buf = [0u8; PAGE_SIZE];
    for s in (1..N).step_by(2) {
        dev.read_page(cx, s, &mut buf).unwrap();
        assert!(buf == page(s), "slot {s} changed");
    }
}

/// Random bytes masked with `mask`, which lz4 cannot shrink enough:
/// stored raw, so every seed gets the same slot word when it gets the
/// same room. zstd's entropy coder halves pages of random nibbles.
fn raw_page(seed: u64, mask: u8) -> Page {
    let mut p = [0u8; PAGE_SIZE];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for b in p.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8 & mask;
    }
    p
}

/// One writer keeps rewriting slot 0 while `pass` runs over and over
/// in another thread, until the passes moved `pages` pages; every
/// write must read back. Returns the pages the passes moved. (Before
/// the passes compared bytes, a write was lost within a dozen pages.)
fn rewrites_beside(dev: &Arc<Device>, mask: u8, pages: u64, pass: fn(&Device) -> u64) -> u64 {
    use std::sync::atomic::AtomicBool;
    let stop = Arc::new(AtomicBool::new(false));
    let moved = Arc::new(AtomicU64::new(0));
    let bg = {
        let (dev, stop, moved) = (dev.clone(), stop.clone(), moved.clone());
        std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                moved.fetch_add(pass(&dev), Relaxed);
            }
        })
    };
    let cx = &mut Context::new(0);
    let mut buf = [0u8; PAGE_SIZE];
    let mut lost = None;
    let mut next = raw_page(0, mask);
    for i in 0..100_000 {
        if moved.load(Relaxed) >= pages {
            break;
        }
        let page = next;
        dev.write_page(cx, 0, &page).unwrap();
        // Made here, between the write and the read, so that a pass
        // putting its page back is most likely caught.
        next = raw_page(i + 1, mask);
        dev.read_page(cx, 0, &mut buf).unwrap();
        if buf != page {
            lost = Some(i);
            break;
        }
    }
    stop.store(true, Relaxed);
    bg.join().unwrap();
    let n = moved.load(Relaxed);
    assert_eq!(
        lost, None,
        "write lost to a concurrent pass ({n} pages moved)"
    );
    n
}

/// A pass that looked at a page, let go of its lock, and came back to
/// find the same slot word took it for the page it had read. But the
/// word is the same for a rewrite whose new object got the old one's
/// room: the pass then put the old page back over the new one.
#[test]
fn writeback_never_puts_back_a_page_overwritten_meanwhile() {
    let (dir, cfg) = backed_cfg("wb-aba", 0);
    let pool = pool();
    let dev = create(&pool, cfg).unwrap();
    let n = rewrites_beside(&dev, 0xff, 100, |d| {
        d.writeback(Filter::default(), None).unwrap().pages
    });
    assert!(n > 0, "nothing was written back");
    drop(dev);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A slot locked for a moment when the pass reaches it (a request on it,
/// or the background compressing it) is taken once let go: a writeback
/// right after a burst of staged pages moved all of them but a few.
#[test]
fn writeback_takes_a_slot_it_found_locked_once_let_go() {
    let (dir, cfg) = backed_cfg("wb-busy", 0);
    let pool = pool();
    let dev = create(&pool, cfg).unwrap();
    let cx = &mut Context::new(0);
    for i in 0..64 {
        dev.write_page(cx, i, &page(i)).unwrap();
    }
    let (held, wait) = std::sync::mpsc::channel();
    let holder = {
        let dev = dev.clone();
        std::thread::spawn(move || {
            let g = crate::slot::SlotGuard::lock(dev.table.word(7));
            held.send(()).unwrap();
            // Let go once the pass has written its first batch (slot 7's),
            // not after a set time: a busy machine may run the pass late.
            while dev.counters()[0].backed_writes.load(Relaxed) == 0 {
                std::hint::spin_loop();
            }
            drop(g);
        })
    };
    wait.recv().unwrap();
    let n = dev.writeback(Filter::default(), None).unwrap().pages;
    holder.join().unwrap();
    assert_eq!(n, 64, "the slot locked at first was left in memory");
    let mut out = [0u8; PAGE_SIZE];
    dev.read_page(cx, 7, &mut out).unwrap();
    assert_eq!(out, page(7));
    drop(dev);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn recompression_never_puts_back_a_page_overwritten_meanwhile() {
    let pool = pool();
    let dev = device(&pool, 64);
    let n = rewrites_beside(&dev, 0x0f, 100, |d| {
        d.recompress(Filter::default(), Codec::Zstd { level: 5 })
            .unwrap()
            .pages
    });
    assert!(n > 0, "nothing was recompressed");
}

/// The spill's clock hand goes round: slots before it are scanned
/// after those past it. It used to scan only from the hand to the end
/// of the table (of the hand's table page, on a bigger device), so once
/// the pages there were gone every spill found nothing to move, and
/// each new page went to the backing file while older ones kept the
/// memory.
#[test]
fn spills_scan_the_slots_behind_the_hand_too() {
    // Raw pages: one object per one-page span, so each write needs a
    // page of its own and the limit holds one.
    let (dir, cfg) = backed_cfg("hand", PAGE_SIZE as u64);
    let pool = pool();
    let dev = create(&pool, cfg).unwrap();
    let cx = &mut Context::new(0);
    let mut buf = [0u8; PAGE_SIZE];
    // Each write spills the one page in memory, which is behind the
    // hand from the third on.
    for (i, s) in [10, 20, 5, 3, 1].into_iter().enumerate() {
        dev.write_page(cx, s, &raw_page(s, 0xff)).unwrap();
        let st = dev.stats();
        assert_eq!(st.spills, i as u64, "write {i} (slot {s})");
        assert_eq!(st.backed_pages, i as u64);
        // The newest page stays in memory.
        dev.read_page(cx, s, &mut buf).unwrap();
        assert!(buf == raw_page(s, 0xff));
        assert_eq!(dev.stats().backed_reads, 0, "slot {s} went to the file");
    }
    drop(dev);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A 64-slot lz4 device with a 64-block backing file in a fresh
/// directory (removed by the caller) and memory limit `mem_limit`.
fn backed_cfg(tag: &str, mem_limit: u64) -> (std::path::PathBuf, DeviceConfig) {
    let dir = std::env::temp_dir().join(format!("vzram-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("backing");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(65 * PAGE_SIZE as u64)
        .unwrap();
    let mut cfg = DeviceConfig::new(64 * PAGE_SIZE as u64, Codec::Lz4);
    cfg.shards = 1;
    cfg.mem_limit = mem_limit;
    cfg.backing = Some(BackingSpec { path });
    (dir, cfg)
}

fn state_cfg(root: &std::path::Path) -> DeviceConfig {
    let mut cfg = DeviceConfig::new(64 * PAGE_SIZE as u64, Codec::Lz4);
    cfg.state = Some(StateSpec {
        root: root.to_path_buf(),
        name: "d".into(),
        ..StateSpec::default()
    });
    cfg
}

/// A slot word that points at no object (a damaged table) stops the
/// recovery with an error naming the file; the device is not served.
#[test]
fn a_damaged_slot_table_is_refused_not_served() {
    use std::os::unix::fs::FileExt;
    let root = std::env::temp_dir().join(format!("vzram-damaged-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let pool = pool();
    let cx = &mut Context::new(0);
    let dev = create(&pool, state_cfg(&root)).unwrap();
    for s in 0..8 {
        dev.write_page(cx, s, &page(s)).unwrap();
    }
    drop(dev);
    // Recovered intact first.
    let dev = create(&pool, state_cfg(&root)).unwrap();
    assert_eq!(dev.recovery().unwrap().slots, 8);
    let mut buf = [0u8; PAGE_SIZE];
    dev.read_page(cx, 5, &mut buf).unwrap();
    assert!(buf == page(5));
    drop(dev);
    // Slot 3 now names an object in the middle of another one.
    let bad = Slot::Object {
        offset: 16 * 3 + 1024,
        len: 100,
        huge: false,
        codec: 0,
    }
    .encode()
    .unwrap()
        | 8; // not a multiple of any class size
    let table = std::fs::OpenOptions::new()
        .write(true)
        .open(root.join("d/table"))
        .unwrap();
    table.write_all_at(&bad.to_ne_bytes(), 3 * 8).unwrap();
    let e = create(&pool, state_cfg(&root)).err().unwrap();
    let msg = e.to_string();
    assert!(
        msg.contains("slot 3") && msg.contains("d/table") && msg.contains("--fresh"),
        "{msg}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// A slot word naming an object that is aligned to its class's size and
/// inside the block, but past the objects the span holds, is refused too:
/// alignment alone would let it through (it names the span's tail, or
/// pages of the block no span uses).
#[test]
fn an_object_past_its_span_is_refused_not_served() {
    use std::os::unix::fs::FileExt;
    let root = std::env::temp_dir().join(format!("vzram-past-span-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let pool = pool();
    let cx = &mut Context::new(0);
    let dev = create(&pool, state_cfg(&root)).unwrap();
    for s in 0..8 {
        dev.write_page(cx, s, &page(s)).unwrap();
    }
    // Stored raw: the class of whole pages, one object per one-page span.
    dev.write_page(cx, 3, &raw_page(3, 0xff)).unwrap();
    let Slot::Object {
        offset,
        len,
        huge,
        codec,
    } = Slot::decode(dev.table.word(3).load(Relaxed))
    else {
        panic!("slot 3 holds no object");
    };
    assert!(huge);
    drop(dev);
    let c = pool.classes[crate::pool::class::class_of(len as usize)];
    let block = offset - offset % BLOCK_BYTES as u64;
    let past = block + u64::from(c.capacity) * u64::from(c.size);
    // Only the capacity check stands in the way: aligned, same block.
    assert!(past.is_multiple_of(u64::from(c.size)) && past < block + BLOCK_BYTES as u64);
    let bad = Slot::Object {
        offset: past,
        len,
        huge,
        codec,
    }
    .encode()
    .unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(root.join("d/table"))
        .unwrap()
        .write_all_at(&bad.to_ne_bytes(), 3 * 8)
        .unwrap();
    let msg = match create(&pool, state_cfg(&root)) {
        Ok(dev) => panic!(
            "recovered a slot naming object {} of a {}-object span: {:?}",
            c.capacity,
            c.capacity,
            dev.recovery()
        ),
        Err(e) => e.to_string(),
    };
    assert!(
        msg.contains("slot 3") && msg.contains("outside any object") && msg.contains("--fresh"),
        "{msg}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// `--huge` tiering passes take pages the codec could not shrink, not
/// staged pages that the background has yet to compress.
#[test]
fn the_huge_filter_skips_staged_pages() {
    let pool = pool();
    let mut cfg = DeviceConfig::new(64 * PAGE_SIZE as u64, Codec::Lz4);
    cfg.staging_bytes = 1 << 20;
    let dev = create(&pool, cfg).unwrap();
    let cx = &mut Context::new(0);
    dev.write_page(cx, 1, &page(1)).unwrap();
    let huge = Filter {
        huge: true,
        ..Filter::default()
    };
    let word = |s: u64| dev.table.word(s).load(Relaxed);
    assert!(dev.staged(word(1)));
    assert!(!huge.matches(word(1), 0));
    assert!(Filter::default().matches(word(1), 0));
    let mut noise = [0u8; PAGE_SIZE];
    let mut x = 0x1234_5678_9abc_def1u64;
    for b in noise.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    dev.write_page(cx, 2, &noise).unwrap();
    while dev.compress_staged(cx, 8) > 0 {}
    // Compressed, and kept raw as an ordinary huge page.
    assert!(!huge.matches(word(1), 0));
    assert!(huge.matches(word(2), 0) && !dev.staged(word(2)));
}
