//! Recovery checks every slot word of the table completely: a device whose
//! table has one damaged word is refused at open, with an error naming that
//! slot, instead of being served and failing (or panicking) on a later read.
//! A word damaged while the device is open makes reads of that slot fail
//! with an error, not panic the queue thread.
//!
//! Each test stores pages, drops the device, rewrites one 8-byte word of
//! the `table` file (slot N at byte N * 8) and reopens.

use std::os::unix::fs::FileExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vzram_store::{
    Codec, Context, DeviceConfig, ExportBuf, Filter, Pool, PoolConfig, StateSpec, PAGE_SIZE,
};

mod common;
use common::{noise, varied};

// The slot word's layout (crates/vzram-store/src/slot.rs), restated: the
// test damages words the way a disk or a stray write would, bit by bit.
const SAME: u64 = 1 << 62;
const HUGE: u64 = 1 << 61;
const WRITTEN_BACK: u64 = 1 << 59;
const CODEC_SHIFT: u32 = 57;
const LEN_SHIFT: u32 = 44;
const LEN_MASK: u64 = (1 << 13) - 1;
const LOC_MASK: u64 = (1 << 41) - 1;

/// Slots 0..8 hold compressible pages (lz4 objects), 8 and 9 raw ones.
const COMPRESSED: u64 = 8;
const RAW: [u64; 2] = [8, 9];

struct Root(PathBuf);

impl Root {
    fn new(tag: &str) -> Root {
        let p = std::env::temp_dir().join(format!("vzram-rc-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        Root(p)
    }

    fn table(&self) -> PathBuf {
        self.0.join("d/table")
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn cfg(root: &Path) -> DeviceConfig {
    let mut c = DeviceConfig::new(64 * PAGE_SIZE as u64, Codec::Lz4);
    c.shards = 1;
    c.state = Some(StateSpec {
        root: root.to_path_buf(),
        name: "d".into(),
        ..StateSpec::default()
    });
    c
}

fn page(s: u64) -> vzram_store::Page {
    if RAW.contains(&s) {
        noise(s)
    } else {
        varied(s)
    }
}

/// A device with state, its pages written and the device dropped.
fn stored(tag: &str) -> (Arc<Pool>, Root) {
    let root = Root::new(tag);
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let dev = pool.create_device(cfg(&root.0)).unwrap();
    let cx = &mut Context::new(0);
    for s in 0..COMPRESSED + RAW.len() as u64 {
        dev.write_page(cx, s, &page(s)).unwrap();
    }
    drop(dev);
    (pool, root)
}

fn word(root: &Root, slot: u64) -> u64 {
    let mut b = [0u8; 8];
    std::fs::File::open(root.table())
        .unwrap()
        .read_exact_at(&mut b, slot * 8)
        .unwrap();
    u64::from_ne_bytes(b)
}

fn plant(root: &Root, slot: u64, w: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(root.table())
        .unwrap()
        .write_all_at(&w.to_ne_bytes(), slot * 8)
        .unwrap();
}

/// Reopens and returns the error's text; an open that succeeds fails the test.
fn refused(pool: &Arc<Pool>, root: &Root) -> String {
    match pool.create_device(cfg(&root.0)) {
        Ok(dev) => panic!("open succeeded (recovery: {:?})", dev.recovery()),
        Err(e) => e.to_string(),
    }
}

fn names_slot(msg: &str, slot: u64) {
    assert!(
        msg.contains(&format!("slot {slot} "))
            && msg.contains("d/table")
            && msg.ends_with("the state is damaged (start with `--fresh d` (or fresh=true on the device) to discard it)"),
        "{msg}"
    );
}

#[test]
fn intact_state_recovers_with_both_codecs() {
    // The guard against checks too strict: objects recompressed with zstd
    // on an lz4 device recover and read back.
    let (pool, root) = stored("intact");
    let dev = pool.create_device(cfg(&root.0)).unwrap();
    let rep = dev.recompress(Filter::default(), Codec::Zstd { level: 3 });
    assert!(rep.unwrap().pages > 0);
    drop(dev);
    let dev = pool.create_device(cfg(&root.0)).unwrap();
    assert_eq!(dev.recovery().unwrap().slots, COMPRESSED + RAW.len() as u64);
    let cx = &mut Context::new(0);
    let mut out = [0u8; PAGE_SIZE];
    for s in 0..COMPRESSED + RAW.len() as u64 {
        dev.read_page(cx, s, &mut out).unwrap();
        assert!(out == page(s), "slot {s}");
    }
}

#[test]
fn huge_bit_on_a_compressed_object_is_refused() {
    let (pool, root) = stored("huge-bit");
    let w = word(&root, 3);
    assert_eq!(w & HUGE, 0);
    plant(&root, 3, w | HUGE);
    names_slot(&refused(&pool, &root), 3);
}

#[test]
fn a_raw_page_without_its_huge_bit_is_refused() {
    // A whole page that is not huge would go to the codec as compressed
    // bytes: the writer never makes one.
    let (pool, root) = stored("huge-clear");
    let w = word(&root, RAW[0]);
    assert_ne!(w & HUGE, 0);
    plant(&root, RAW[0], w & !HUGE);
    names_slot(&refused(&pool, &root), RAW[0]);
}

#[test]
fn an_unknown_codec_is_refused() {
    let (pool, root) = stored("codec");
    let w = word(&root, 6);
    plant(&root, 6, (w & !(3 << CODEC_SHIFT)) | (3 << CODEC_SHIFT));
    names_slot(&refused(&pool, &root), 6);
}

#[test]
fn two_slots_sharing_an_object_name_the_second() {
    let (pool, root) = stored("shared");
    plant(&root, 5, word(&root, 2));
    let msg = refused(&pool, &root);
    names_slot(&msg, 5);
    assert!(msg.contains("slot 2") && !msg.contains("slot 0"), "{msg}");
}

#[test]
fn an_offset_outside_the_arena_is_refused() {
    let (pool, root) = stored("offset");
    let w = word(&root, 4);
    plant(&root, 4, w | LOC_MASK);
    names_slot(&refused(&pool, &root), 4);
}

#[test]
fn stray_bits_in_a_same_filled_word_are_refused() {
    let (pool, root) = stored("same-bits");
    // Slot 20 was never written: make it a zero-filled page with a stray
    // WRITTEN_BACK bit, which the decoder would ignore.
    plant(&root, 20, SAME | WRITTEN_BACK);
    names_slot(&refused(&pool, &root), 20);
}

#[test]
fn stray_bits_in_a_written_back_word_are_refused() {
    // No backing file either: the stray length bits are what is named.
    let (pool, root) = stored("wb-bits");
    plant(&root, 21, WRITTEN_BACK | (5 << LEN_SHIFT));
    names_slot(&refused(&pool, &root), 21);
}

#[test]
fn a_length_field_past_a_page_is_refused() {
    let (pool, root) = stored("len");
    let w = word(&root, 1);
    plant(
        &root,
        1,
        (w & !(LEN_MASK << LEN_SHIFT)) | (LEN_MASK << LEN_SHIFT),
    );
    names_slot(&refused(&pool, &root), 1);
}

/// Damages `slot`'s word while the device is served (the table is a shared
/// mapping of the file): its reads and exports fail, nothing panics, and
/// the other slots still serve.
fn damaged_while_open(tag: &str, slot: u64, damage: impl Fn(u64) -> u64) {
    let (pool, root) = stored(tag);
    let dev = pool.create_device(cfg(&root.0)).unwrap();
    let w = word(&root, slot);
    plant(&root, slot, damage(w));
    let cx = &mut Context::new(0);
    let mut out = [0u8; PAGE_SIZE];
    match catch_unwind(AssertUnwindSafe(|| dev.read_page(cx, slot, &mut out))) {
        Ok(r) => assert!(r.is_err(), "the read succeeded"),
        Err(p) => panic!("the read panicked: {}", panic_text(&p)),
    }
    let mut buf = ExportBuf::new().unwrap();
    match catch_unwind(AssertUnwindSafe(|| dev.export(&mut buf, slot).is_err())) {
        Ok(failed) => assert!(failed, "the export succeeded"),
        Err(p) => panic!("the export panicked: {}", panic_text(&p)),
    }
    dev.read_page(cx, 2, &mut out).unwrap();
    assert!(out == page(2));
    // Whole again before the device goes, so nothing frees a bad word.
    plant(&root, slot, w);
}

#[test]
fn a_huge_bit_planted_while_open_fails_reads_without_a_panic() {
    damaged_while_open("live-huge", 3, |w| w | HUGE);
}

#[test]
fn an_offset_planted_while_open_fails_reads_without_a_panic() {
    damaged_while_open("live-offset", 4, |w| w | LOC_MASK);
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}
