//! A second frontend: the same guest under QEMU 10 (Debian's
//! bookworm-backports build, unpacked by `contrib/guest/qemu10.sh`, never
//! installed), which negotiates vhost-user differently from the release's
//! QEMU 7.2. `VZRAM_QEMU10` names the wrapper that script prints; `.ci/run`
//! sets it, and with `VZRAM_E2E` set a missing one is a failure.

use std::path::PathBuf;
use std::time::Duration;

use vzram_tests::guest::{Ctx, GuestOpts};
use vzram_tests::{ensure, MIB};

const SWAP_BOOT: Duration = Duration::from_secs(300);
const BOOT: Duration = Duration::from_secs(120);

/// The QEMU 10 wrapper, or None (skipped) where there is none and
/// `VZRAM_E2E` is unset.
fn qemu10() -> Option<PathBuf> {
    match std::env::var_os("VZRAM_QEMU10").map(PathBuf::from) {
        Some(p) if p.is_file() => Some(p),
        other => {
            assert!(
                std::env::var_os("VZRAM_E2E").is_none(),
                "VZRAM_E2E is set but VZRAM_QEMU10 ({other:?}) names no QEMU 10: run contrib/guest/qemu10.sh"
            );
            eprintln!("skipped: VZRAM_QEMU10 is unset (contrib/guest/qemu10.sh prints it)");
            None
        }
    }
}

/// A guest that swaps 1.5x its RAM under QEMU 10, is killed, and a second
/// QEMU 10 on the same socket reads every page back.
#[test]
fn a_guest_under_qemu_10_swaps_and_reconnects() {
    let Some(q) = qemu10() else { return };
    let v = std::process::Command::new(&q)
        .arg("--version")
        .output()
        .unwrap();
    let v = String::from_utf8_lossy(&v.stdout);
    assert!(
        v.contains("version 10."),
        "{} is not QEMU 10: {v}",
        q.display()
    );
    // This binary's one test: the guest harness takes its QEMU from here.
    std::env::set_var("QEMU", &q);
    let Some(ctx) = Ctx::new("qemu10_swap_and_reconnect") else {
        return;
    };
    let sock = ctx.path("q10.sock");
    let s = sock.to_string_lossy().into_owned();
    let mut d = ctx.daemon(
        &["--socket", &s, "--size", "1G", "--queues", "2"].map(String::from),
        &[&sock],
    );

    let opts = GuestOpts::new(&sock, "swap")
        .queues(2)
        .mem("256M")
        .arg("vzram.rounds=1");
    let out = ctx.run_guest("q10-swap", &opts, SWAP_BOOT);
    out.expect_ok();
    let p = out.fields("PRESSURE ");
    ensure!(p.num("mismatches") == 0, "{}", p.line);
    let st = d.stat_cli();
    let dev = st.dev_at(&sock);
    ensure!(
        dev.stats.writes > 0 && dev.stats.failed_writes == 0,
        "the guest did not swap to vzram under QEMU 10: {dev:?}"
    );

    // Raw pages, then QEMU 10 killed mid-I/O, then a new one reads them.
    let raw = |tests: &str| {
        GuestOpts::new(&sock, tests)
            .queues(2)
            .arg("vzram.seed=10")
            .arg("vzram.raw_mib=32")
            .arg("vzram.raw_offset_mib=512")
    };
    let g = ctx.boot("q10-write", &raw("raw-write,raw-write,raw-write"));
    g.wait_for("VZRAM-TIME test=raw-write", BOOT);
    std::thread::sleep(Duration::from_millis(500));
    g.kill();
    d.assert_alive();
    let out = ctx.run_guest("q10-verify", &raw("raw-verify"), BOOT);
    out.expect_ok();
    let v = out.fields("RAW verify ok");
    ensure!(
        v.num("mismatches") == 0 && v.num("pages") == (32 * MIB / 4096) as i64,
        "{}",
        v.line
    );
    ensure!(
        d.stat_cli().dev_at(&sock).connections == 3,
        "three QEMU 10 connections"
    );
    d.shutdown();
}
