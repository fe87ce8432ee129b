//! A state dir that fills up (a small tmpfs, or /dev/shm filled by another
//! local user): writes that need room fail with an I/O error, and nothing
//! faults. Reads of sectors never written, a `/metrics` scrape and `stat`
//! all work, and the worker serving the device never dies of SIGBUS.

use std::path::Path;
use std::process::Command;

use vzram_tests::metrics::scrape;
use vzram_tests::*;

/// A tmpfs of `size` mounted at `dir`, unmounted on drop; None (with a
/// line saying why) where this test may not mount.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let o = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
                s(dir),
            ])
            .output()
            .ok()?;
        if !o.status.success() {
            // CI runs as root and sets this: there the test must run.
            assert!(
                std::env::var_os("VZRAM_REQUIRE_TMPFS").is_none(),
                "VZRAM_REQUIRE_TMPFS is set but mount failed: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            eprintln!(
                "skipped: cannot mount a tmpfs here ({})",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            return None;
        }
        Some(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_full_state_dir_fails_writes_and_never_faults() {
    let dir = TempDir::new("full");
    let mnt = dir.join("state");
    let Some(_fs) = Tmpfs::mount(&mnt, "6M") else {
        return;
    };
    let a = dir.join("a.sock");
    let mut d = Daemon::start(
        &dir,
        &[
            "--device",
            &format!("socket={},size=256M,queues=1", s(&a)),
            "--state-dir",
            s(&mnt),
            "--metrics",
            "127.0.0.1:0",
        ],
        &[&a],
    );
    let mut c = Client::connect(&a, 1).unwrap();
    // Writes spread over the first 64 MiB: some while there is room, then
    // the rest after another user has filled the tmpfs.
    let (mut ok, mut failed) = (Vec::new(), 0u64);
    let filler = mnt.join("filler");
    for i in 0..4096u64 {
        if i == 256 {
            let _ = Command::new("dd")
                .args(["if=/dev/zero", &format!("of={}", s(&filler)), "bs=64k"])
                .output();
        }
        let off = (i * 4) << 12;
        match c.q(0).write(off, &noise(i, 4096)) {
            Ok(()) => ok.push(i),
            Err(_) => failed += 1,
        }
    }
    assert!(
        failed > 0,
        "the state dir never filled: {} writes stored",
        ok.len()
    );
    // Never-written sectors (their table pages were never allocated),
    // all over the device, read as zeros.
    let mut rng = Rng::new(3);
    for _ in 0..2000 {
        let off = (64 << 20) + rng.below((192 << 20) / 4096) * 4096;
        let got = c
            .q(0)
            .read(off, 4096)
            .expect("a read of a never-written sector");
        assert!(got.iter().all(|&b| b == 0));
    }
    for &i in ok.iter().take(200) {
        assert_eq!(c.q(0).read((i * 4) << 12, 4096).unwrap(), noise(i, 4096));
    }
    let st = d.stat();
    let addr = st.0.metrics.clone().unwrap().parse().unwrap();
    let body = scrape(addr);
    assert!(body.contains("vzram_failed_writes"), "{body}");
    d.assert_alive();
    let w = &st.dev_at(&a).worker;
    assert_eq!(w.failures, 0, "the worker died: {:?}\n{}", w, d.log_text());
    assert!(st.dev_at(&a).stats.failed_writes > 0);
    assert!(
        d.log_text().contains("the state dir is full"),
        "{}",
        d.log_text()
    );
    eprintln!("{} writes stored, {failed} refused with IOERR; 2000 reads of never-written sectors gave zeros", ok.len());
    drop(c);
    let _ = std::fs::remove_file(&filler);
    d.terminate_cleanly();
}
