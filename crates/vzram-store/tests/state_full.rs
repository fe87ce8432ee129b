//! A device whose state's file system fills up fails writes (StateFull,
//! which the block layer turns into IOERR) instead of faulting, keeps what
//! it stored, and takes writes again once space is freed. A backing file on
//! a full file system fails writebacks and spills the same way.
//!
//! Needs a small tmpfs of its own: mounted here when the test may mount
//! (root); otherwise it says so and checks nothing.

use std::path::{Path, PathBuf};

use vzram_store::{Codec, Context, DeviceConfig, Pool, PoolConfig, StateSpec, StoreError};

mod common;
use common::noise;

const TMPFS_BYTES: u64 = 1 << 20;

struct Mount(PathBuf);

impl Mount {
    fn tmpfs(dir: &Path, bytes: u64) -> Option<Mount> {
        std::fs::create_dir_all(dir).ok()?;
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let target = c(dir.to_str()?);
        let opts = c(&format!("size={bytes},mode=0700"));
        // SAFETY: mount(2) with NUL-terminated strings we own.
        let rc = unsafe {
            libc::mount(
                c("tmpfs").as_ptr(),
                target.as_ptr(),
                c("tmpfs").as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        (rc == 0).then(|| Mount(dir.to_path_buf()))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let p = std::ffi::CString::new(self.0.to_str().unwrap()).unwrap();
        // SAFETY: unmounting what we mounted.
        unsafe { libc::umount2(p.as_ptr(), libc::MNT_DETACH) };
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn a_full_state_file_system_fails_writes_and_loses_nothing() {
    fills_up_and_recovers(0, "compressed");
}

/// Staged pages are written through the arena file, not the mapping: a
/// full file system fails that write (ENOSPC), the page is compressed
/// instead, and that allocation fails the write as above. Never a SIGBUS.
#[test]
fn a_full_state_file_system_fails_staged_writes_and_loses_nothing() {
    fills_up_and_recovers(16 << 20, "staged");
}

fn fills_up_and_recovers(staging: u64, tag: &str) {
    let mut cx = Context::new(0);
    let dir = std::env::temp_dir().join(format!("vzram-full-{tag}-{}", std::process::id()));
    let Some(_mount) = Mount::tmpfs(&dir, TMPFS_BYTES) else {
        eprintln!("cannot mount a tmpfs here (not root?): nothing checked");
        let _ = std::fs::remove_dir(&dir);
        return;
    };
    let mut dc = DeviceConfig::new(64 << 20, Codec::Lz4);
    dc.shards = 1;
    dc.staging_bytes = staging;
    dc.state = Some(StateSpec {
        root: dir.clone(),
        name: "d".into(),
        ..StateSpec::default()
    });
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let dev = pool.create_device(dc.clone()).unwrap();
    // Incompressible pages, spread over many table pages, until it is full.
    let mut stored = Vec::new();
    let mut full = None;
    for i in 0..4096u64 {
        let slot = i * 37 % dev.num_slots();
        match dev.write_page(&mut cx, slot, &noise(i)) {
            Ok(()) => stored.push((slot, i)),
            Err(e) => {
                full = Some(e);
                break;
            }
        }
    }
    let e = full.expect("1 MiB of tmpfs never filled up");
    assert!(matches!(e, StoreError::StateFull), "{e}");
    if staging > 0 {
        assert!(dev.staged_bytes() > 0, "no page was staged");
    }
    assert!(stored.len() > 64, "only {} pages fit", stored.len());
    eprintln!("{} pages stored before: {e}", stored.len());
    // Everything stored reads back; nothing was charged for the failure.
    for &(slot, i) in &stored {
        let mut out = [0u8; 4096];
        dev.read_page(&mut cx, slot, &mut out).unwrap();
        assert_eq!(out, noise(i), "slot {slot}");
    }
    // Space freed, writes work again; and the state recovers.
    for &(slot, _) in &stored[..stored.len() / 2] {
        dev.discard(&mut cx, slot..slot + 1).unwrap();
    }
    dev.compact();
    let (slot, _) = stored[0];
    dev.write_page(&mut cx, slot, &noise(9999)).unwrap();
    let files = dev.state_files().unwrap().try_clone().unwrap();
    drop(dev);
    drop(files);
    let dev = pool.create_device(dc).unwrap();
    let mut out = [0u8; 4096];
    dev.read_page(&mut cx, slot, &mut out).unwrap();
    assert_eq!(out, noise(9999));
    for &(s, i) in &stored[stored.len() / 2..] {
        dev.read_page(&mut cx, s, &mut out).unwrap();
        assert_eq!(out, noise(i), "slot {s} after recovery");
    }
}

/// A backing file whose file system is full: a writeback fails with a clear
/// error and leaves every page in memory; a write that must spill fails and
/// keeps the slot's old page. Nothing is lost.
#[test]
fn a_backing_file_that_cannot_be_written_leaves_pages_in_memory() {
    let mut cx = Context::new(0);
    let dir = std::env::temp_dir().join(format!("vzram-bfull-{}", std::process::id()));
    let Some(mnt) = Mount::tmpfs(&dir, 64 << 10) else {
        eprintln!("SKIPPED: cannot mount a tmpfs here (not root)");
        return;
    };
    let path = mnt.0.join("backing");
    // Sparse: 1 MiB of blocks on a 64 KiB file system.
    std::fs::File::create(&path)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let mut dc = DeviceConfig::new(256 * 4096, Codec::Lz4);
    dc.shards = 1;
    dc.backing = Some(vzram_store::BackingSpec { path });
    let dev = pool.create_device(dc).unwrap();
    for s in 0..64 {
        dev.write_page(&mut cx, s, &noise(s)).unwrap();
    }
    let e = dev
        .writeback(vzram_store::Filter::default(), None)
        .unwrap_err();
    assert!(matches!(e, StoreError::Backing(_)), "{e}");
    assert!(e.to_string().contains("backing"), "{e}");
    let st = dev.stats();
    assert_eq!(st.backed_pages, dev.backing().unwrap().used());
    let mut out = [0u8; 4096];
    for s in 0..64 {
        dev.read_page(&mut cx, s, &mut out).unwrap();
        assert!(out == noise(s), "slot {s}");
    }
    // Now over a limit: the write has nowhere to go and keeps the old page.
    dev.set_mem_limit(st.mem_used_total);
    let mut failed = 0;
    for s in 0..64 {
        if let Err(e) = dev.write_page(&mut cx, s, &noise(1000 + s)) {
            assert!(
                matches!(e, StoreError::Backing(_) | StoreError::BackingFull),
                "{e}"
            );
            dev.read_page(&mut cx, s, &mut out).unwrap();
            assert!(out == noise(s), "a failed write changed slot {s}");
            failed += 1;
        } else {
            dev.read_page(&mut cx, s, &mut out).unwrap();
            assert!(out == noise(1000 + s), "slot {s}");
        }
    }
    assert!(failed > 0, "every write found room on a full file system");
}
