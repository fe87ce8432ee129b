//! Tiering: idle marking and the ager, recompression with a second codec,
//! writeback to a backing file, spilling past a memory limit, and all of it
//! surviving a restart of the state.

use std::path::{Path, PathBuf};

use vzram_store::{
    BackingSpec, Codec, Context, DeviceConfig, Filter, Pool, PoolConfig, StateSpec, StoreError,
};

mod common;
use common::noise;

const PAGE: usize = 4096;

/// A directory on a real file system (the backing file wants O_DIRECT, which
/// tmpfs refuses), removed at the end.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let p = base.join(format!("tiering-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }

    fn backing(&self, pages: u64) -> BackingSpec {
        let path = self.0.join("backing");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len((pages + 1) * PAGE as u64).unwrap();
        BackingSpec { path }
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Text-like pages: words from a small vocabulary. lz4 shrinks them some,
/// zstd's entropy coding a good deal more, like real process memory.
fn text(seed: u64) -> [u8; PAGE] {
    const WORDS: [&str; 16] = [
        "alpha ", "beta ", "gamma ", "delta ", "swap ", "page ", "guest ", "host ", "zram ",
        "vhost ", "queue ", "slot ", "pool ", "span ", "ring ", "memory ",
    ];
    let mut p = [0u8; PAGE];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut i = 0;
    while i < PAGE {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let w = WORDS[(x % 16) as usize].as_bytes();
        let n = w.len().min(PAGE - i);
        p[i..i + n].copy_from_slice(&w[..n]);
        i += n;
    }
    p
}

fn pool() -> std::sync::Arc<Pool> {
    Pool::new(PoolConfig::default()).unwrap()
}

fn config(pages: u64, codec: Codec, backing: Option<BackingSpec>) -> DeviceConfig {
    let mut dc = DeviceConfig::new(pages * PAGE as u64, codec);
    dc.shards = 1;
    dc.backing = backing;
    dc
}

fn state(root: &Path) -> Option<StateSpec> {
    Some(StateSpec {
        root: root.to_path_buf(),
        name: "d".into(),
        ..StateSpec::default()
    })
}

fn read(dev: &vzram_store::Device, cx: &mut Context, slot: u64) -> [u8; PAGE] {
    let mut out = [0u8; PAGE];
    dev.read_page(cx, slot, &mut out).unwrap();
    out
}

#[test]
fn idle_pages_go_to_the_backing_file_and_read_back() {
    let d = Dir::new("wb");
    let pool = pool();
    let dev = pool
        .create_device(config(256, Codec::Lz4, Some(d.backing(256))))
        .unwrap();
    let cx = &mut Context::new(0);
    for s in 0..200 {
        dev.write_page(cx, s, &text(s)).unwrap();
    }
    dev.write_page(cx, 200, &[7u8; PAGE]).unwrap(); // same-filled: never idle
    assert_eq!(dev.mark_idle(), 200);
    // Reads and writes are accesses: those pages are no longer idle.
    for s in 0..50 {
        assert!(read(&dev, cx, s) == text(s));
    }
    dev.write_page(cx, 50, &text(1050)).unwrap();
    let before = dev.stats();
    let rep = dev
        .writeback(
            Filter {
                idle: true,
                ..Default::default()
            },
            None,
        )
        .unwrap();
    assert_eq!(rep.pages, 149, "{rep:?}");
    let st = dev.stats();
    assert_eq!(st.backed_pages, 149);
    assert_eq!(st.backed_writes, 149);
    assert_eq!(dev.backing().unwrap().used(), 149);
    assert!(
        st.mem_used_total < before.mem_used_total,
        "writeback gave no memory back: {} -> {}",
        before.mem_used_total,
        st.mem_used_total
    );
    assert_eq!(st.orig_data_size, before.orig_data_size);
    // Everything reads back, from memory or from disk.
    for s in 0..200 {
        let want = if s == 50 { text(1050) } else { text(s) };
        assert!(read(&dev, cx, s) == want, "slot {s}");
    }
    assert!(read(&dev, cx, 200) == [7u8; PAGE]);
    assert_eq!(dev.stats().backed_reads, 149);
    // Overwrite, partial write and discard give blocks back.
    dev.write_page(cx, 60, &text(2060)).unwrap();
    dev.write_partial(cx, 61, 100, b"hello").unwrap();
    let mut want61 = text(61);
    want61[100..105].copy_from_slice(b"hello");
    dev.discard(cx, 62..64).unwrap();
    assert_eq!(dev.backing().unwrap().used(), 145);
    assert!(read(&dev, cx, 60) == text(2060));
    assert!(read(&dev, cx, 61) == want61);
    assert!(read(&dev, cx, 62) == [0u8; PAGE]);
    assert_eq!(dev.stats().backed_pages, 145);
}

#[test]
fn a_full_pool_spills_instead_of_failing() {
    let d = Dir::new("spill");
    let pool = pool();
    const PAGES: u64 = 8192; // 32 MiB of pages through a 2 MiB pool
    let mut dc = config(PAGES, Codec::Lz4, Some(d.backing(PAGES)));
    dc.mem_limit = 2 << 20;
    let dev = pool.create_device(dc).unwrap();
    let cx = &mut Context::new(0);
    for s in 0..PAGES {
        let p = if s % 5 == 0 { noise(s) } else { text(s) };
        dev.write_page(cx, s, &p)
            .unwrap_or_else(|e| panic!("write {s}: {e}"));
        assert!(dev.stats().mem_used_total <= 2 << 20);
    }
    // Rewrite a quarter in place: old blocks are freed, new pages spill.
    for s in (0..PAGES).step_by(4) {
        dev.write_page(cx, s, &text(s + 100_000)).unwrap();
    }
    let st = dev.stats();
    assert!(st.spills > 0 && st.backed_pages > 0, "{st:?}");
    assert_eq!(st.failed_writes, 0);
    assert!(st.mem_used_max <= 2 << 20, "{st:?}");
    for s in 0..PAGES {
        let want = if s % 4 == 0 {
            text(s + 100_000)
        } else if s % 5 == 0 {
            noise(s)
        } else {
            text(s)
        };
        assert!(read(&dev, cx, s) == want, "slot {s}");
    }
    assert_eq!(
        dev.backing().unwrap().used(),
        dev.stats().backed_pages,
        "blocks in use and written-back slots disagree"
    );
}

#[test]
fn when_the_backing_file_is_full_too_the_write_fails_and_keeps_the_old_page() {
    let d = Dir::new("full");
    let pool = pool();
    let mut dc = config(4096, Codec::Lz4, Some(d.backing(64)));
    dc.mem_limit = 256 << 10;
    let dev = pool.create_device(dc).unwrap();
    let cx = &mut Context::new(0);
    let mut failed_at = None;
    for s in 0..4096 {
        match dev.write_page(cx, s, &noise(s)) {
            Ok(()) => {}
            Err(e) => {
                assert_eq!(e, StoreError::BackingFull);
                failed_at = Some(s);
                break;
            }
        }
    }
    let s = failed_at.expect("64 blocks and 256 KiB cannot hold 16 MiB of noise");
    assert!(s > 64, "failed after only {s} pages");
    assert!(
        read(&dev, cx, s) == [0u8; PAGE],
        "a failed write changed its slot"
    );
    for t in 0..s {
        assert!(read(&dev, cx, t) == noise(t), "slot {t}");
    }
}

#[test]
fn recompression_with_zstd_shrinks_an_lz4_device() {
    let d = Dir::new("recomp");
    let pool = pool();
    let dev = pool
        .create_device(config(2048, Codec::Lz4, Some(d.backing(2048))))
        .unwrap();
    let cx = &mut Context::new(0);
    for s in 0..2048 {
        let p = if s % 8 == 0 { noise(s) } else { text(s) };
        dev.write_page(cx, s, &p).unwrap();
    }
    dev.mark_idle();
    // Touched pages are not idle and stay lz4.
    for s in 0..16 {
        read(&dev, cx, s);
    }
    let before = dev.stats();
    let zstd = Codec::Zstd { level: 3 };
    let idle = Filter {
        idle: true,
        ..Default::default()
    };
    let rep = dev.recompress(idle, zstd).unwrap();
    let after = dev.stats();
    assert!(rep.pages > 1500, "{rep:?}");
    assert!(
        after.mem_used_total < before.mem_used_total * 3 / 4,
        "mem_used_total {} -> {}",
        before.mem_used_total,
        after.mem_used_total
    );
    assert!(after.compr_data_size < before.compr_data_size);
    assert_eq!(after.pages_recompressed, rep.pages);
    assert_eq!(
        before.compr_data_size - after.compr_data_size,
        after.recompress_saved_bytes
    );
    for s in 0..2048 {
        let want = if s % 8 == 0 { noise(s) } else { text(s) };
        assert!(read(&dev, cx, s) == want, "slot {s}");
    }
    // Noise stays huge; a second pass tries only the two noise pages the
    // first skipped as not idle (slots 0 and 8), nothing it tried before.
    let again = dev
        .recompress(
            Filter {
                huge: true,
                ..Default::default()
            },
            zstd,
        )
        .unwrap();
    assert_eq!((again.tried, again.pages), (2, 0), "{again:?}");
    // ... and those pages now count as incompressible for writeback.
    let rep = dev
        .writeback(
            Filter {
                incompressible: true,
                ..Default::default()
            },
            None,
        )
        .unwrap();
    assert_eq!(rep.pages, 256);
    for s in (0..2048).step_by(8) {
        assert!(read(&dev, cx, s) == noise(s), "slot {s}");
    }
}

#[test]
fn the_ager_finds_cold_pages_and_access_makes_them_young() {
    let d = Dir::new("age");
    let pool = pool();
    let dev = pool
        .create_device(config(64, Codec::Lz4, Some(d.backing(64))))
        .unwrap();
    let cx = &mut Context::new(0);
    for s in 0..64 {
        dev.write_page(cx, s, &text(s)).unwrap();
    }
    assert_eq!(dev.age(), 0); // marked idle
    assert_eq!(dev.age(), 0); // age 1
    assert_eq!(dev.age(), 0); // age 2
    for s in 0..8 {
        read(&dev, cx, s);
    }
    assert_eq!(dev.age(), 56); // age 3: cold, but the 8 read are young again
    let cold = Filter {
        cold: true,
        ..Default::default()
    };
    assert_eq!(dev.writeback(cold, Some(40)).unwrap().pages, 40);
    assert_eq!(dev.writeback(cold, None).unwrap().pages, 16);
    for s in 0..64 {
        assert!(read(&dev, cx, s) == text(s));
    }
}

#[test]
fn written_back_pages_survive_a_restart_and_need_their_own_file() {
    let d = Dir::new("durable");
    let root = d.0.join("state");
    let spec = d.backing(512);
    let cx = &mut Context::new(0);
    let with = |backing: Option<BackingSpec>| {
        let mut dc = config(512, Codec::Lz4, backing);
        dc.state = state(&root);
        dc
    };
    {
        let pool = pool();
        let dev = pool.create_device(with(Some(spec.clone()))).unwrap();
        for s in 0..300 {
            dev.write_page(cx, s, &text(s)).unwrap();
        }
        dev.writeback(Filter::default(), Some(200)).unwrap();
        assert_eq!(dev.stats().backed_pages, 200);
    }
    // No backing file, or another one: refused, never served as zeros.
    let e = pool().create_device(with(None)).err().unwrap().to_string();
    assert!(e.contains("backing file") && e.contains("--fresh"), "{e}");
    let other = BackingSpec {
        path: d.0.join("other"),
    };
    std::fs::File::create(&other.path)
        .unwrap()
        .set_len(513 * PAGE as u64)
        .unwrap();
    let e = pool()
        .create_device(with(Some(other)))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not the backing file"), "{e}");
    // The right one: everything is there, the block map rebuilt.
    {
        let pool = pool();
        let dev = pool.create_device(with(Some(spec.clone()))).unwrap();
        assert_eq!(dev.recovery().unwrap().backed, 200);
        assert_eq!(dev.stats().backed_pages, 200);
        assert_eq!(dev.backing().unwrap().used(), 200);
        for s in 0..300 {
            assert!(read(&dev, cx, s) == text(s), "slot {s}");
        }
        // New writebacks do not land on recovered blocks.
        dev.writeback(Filter::default(), None).unwrap();
        for s in 0..300 {
            assert!(read(&dev, cx, s) == text(s), "slot {s}");
        }
    }
    // A resized file is refused while pages are on it.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&spec.path)
        .unwrap()
        .set_len(1025 * PAGE as u64)
        .unwrap();
    let e = pool()
        .create_device(with(Some(spec)))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("resized"), "{e}");
}

#[test]
fn recompression_in_batches_tries_each_page_once() {
    let d = Dir::new("recomp-batches");
    let pool = pool();
    let dev = pool
        .create_device(config(512, Codec::Lz4, Some(d.backing(64))))
        .unwrap();
    let cx = &mut Context::new(0);
    for s in 0..512 {
        let p = if s % 4 == 0 { noise(s) } else { text(s) };
        dev.write_page(cx, s, &p).unwrap();
    }
    let zstd = Codec::Zstd { level: 3 };
    let all = Filter::default();
    let (mut tried, mut pages, mut batches) = (0, 0, 0);
    loop {
        let rep = dev.recompress_some(all, zstd, Some(100)).unwrap();
        assert!(rep.tried <= 100, "{rep:?}");
        if rep.tried == 0 {
            break;
        }
        tried += rep.tried;
        pages += rep.pages;
        batches += 1;
        assert!(batches <= 6, "batches do not make progress");
    }
    // Every page once: text recompressed, noise marked as not worth it.
    assert_eq!((tried, pages, batches), (512, 384, 6));
    assert_eq!(dev.stats().pages_recompressed, 384);
    for s in 0..512 {
        let want = if s % 4 == 0 { noise(s) } else { text(s) };
        assert!(read(&dev, cx, s) == want, "slot {s}");
    }
}

/// Paced recompression resumes where its last batch stopped, as writeback
/// does: not back at the start (rewritten slots there are untried again),
/// and reaches those slots on its next lap.
#[test]
fn recompress_in_batches_resumes_where_it_stopped() {
    let d = Dir::new("rc-batches");
    let pool = pool();
    let dev = pool
        .create_device(config(128, Codec::Lz4, Some(d.backing(16))))
        .unwrap();
    let cx = &mut Context::new(0);
    for s in 0..100 {
        dev.write_page(cx, s, &text(s)).unwrap();
    }
    let zstd = Codec::Zstd { level: 3 };
    let all = Filter::default();
    assert_eq!(dev.recompress_some(all, zstd, Some(10)).unwrap().tried, 10);
    assert_eq!(dev.recompress_cursor(), 10);
    // Slots 0..5 are rewritten with lz4, untried again, behind the cursor.
    for s in 0..5 {
        dev.write_page(cx, s, &text(1000 + s)).unwrap();
    }
    assert_eq!(dev.recompress_some(all, zstd, Some(10)).unwrap().tried, 10);
    assert_eq!(
        dev.recompress_cursor(),
        20,
        "the second batch went back to the rewritten slots"
    );
    // Batches until one finds nothing: the lap wraps and takes 0..5 too.
    let mut batches = 0;
    while dev.recompress_some(all, zstd, Some(10)).unwrap().tried > 0 {
        batches += 1;
        assert!(batches <= 12, "no end to the batches");
    }
    // Every page tried once, and the five rewritten ones again.
    assert_eq!(dev.stats().pages_recompressed, 105);
    for s in 0..100 {
        let want = if s < 5 { text(1000 + s) } else { text(s) };
        assert!(read(&dev, cx, s) == want, "slot {s}");
    }
}

/// Paced writeback resumes where its last batch stopped: it does not go
/// back over the slots before (that made a background pass quadratic),
/// and reaches pages there that became eligible again on its next lap.
#[test]
fn writeback_in_batches_resumes_where_it_stopped() {
    let d = Dir::new("wb-batches");
    let pool = pool();
    let dev = pool
        .create_device(config(128, Codec::Lz4, Some(d.backing(128))))
        .unwrap();
    let cx = &mut Context::new(0);
    for s in 0..100 {
        dev.write_page(cx, s, &noise(s)).unwrap();
    }
    let huge = Filter {
        huge: true,
        ..Default::default()
    };
    assert_eq!(dev.writeback(huge, Some(10)).unwrap().pages, 10);
    // Slots 0..5 come back into memory, huge again, behind the cursor.
    for s in 0..5 {
        dev.write_page(cx, s, &noise(1000 + s)).unwrap();
    }
    assert_eq!(dev.writeback(huge, Some(10)).unwrap().pages, 10);
    let on_disk = |dev: &vzram_store::Device, cx: &mut Context, s: u64| {
        let before = dev.stats().backed_reads;
        read(dev, cx, s);
        dev.stats().backed_reads > before
    };
    for s in 0..5 {
        assert!(
            !on_disk(&dev, cx, s),
            "slot {s}: the second batch went back"
        );
    }
    for s in 10..20 {
        assert!(
            on_disk(&dev, cx, s),
            "slot {s}: the second batch skipped it"
        );
    }
    // Batches until one finds nothing: the lap wraps and takes 0..5 too.
    let mut batches = 0;
    while dev.writeback(huge, Some(10)).unwrap().pages > 0 {
        batches += 1;
        assert!(batches <= 10, "no end to the batches");
    }
    assert_eq!(dev.stats().backed_pages, 100);
    for s in 0..100 {
        let want = if s < 5 { noise(1000 + s) } else { noise(s) };
        assert!(read(&dev, cx, s) == want, "slot {s}");
    }
}
