//! End-to-end tiering: a real guest swapping through vzram with a backing
//! file, against Linux zram inside the same guest.
//!
//! Like tests/e2e.rs: they skip only when QEMU is absent and `VZRAM_E2E` is
//! unset. See the numbers with `cargo test --test e2e_tiering -- --nocapture`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use vzram_tests::guest::{Ctx, GuestOpts, GuestOutput};
use vzram_tests::{ensure, mib, Daemon, Summary, MIB};

/// Boot timeout for swap under pressure (about 40 s on a 2-core TCG host).
const SWAP_BOOT: Duration = Duration::from_secs(300);
const GUEST_MEM: &str = "256M";
/// The pressure both guests run: 1.5 x RAM, three passes (fill, rewrite,
/// verify), the same seed.
const ROUNDS: &str = "vzram.rounds=3";

/// A sparse backing file on the test directory's file system (not tmpfs,
/// so the daemon uses O_DIRECT).
fn backing_file(ctx: &Ctx, mib: u64) -> PathBuf {
    let p = ctx.path("backing");
    std::fs::File::create(&p)
        .and_then(|f| f.set_len(mib * MIB))
        .unwrap_or_else(|e| panic!("create {}: {e}", p.display()));
    p
}

fn serve(ctx: &Ctx, sock: &Path, extra: &[&str]) -> Daemon {
    let mut a: Vec<String> = vec![
        "--socket".into(),
        sock.display().to_string(),
        "--size".into(),
        "1G".into(),
        "--queues".into(),
        "2".into(),
        "--algo".into(),
        "lz4".into(),
    ];
    a.extend(extra.iter().map(|s| s.to_string()));
    ctx.daemon(&a, &[sock])
}

fn pressure_ok(out: &GuestOutput) {
    out.expect_ok();
    let p = out.fields("PRESSURE ");
    ensure!(p.num("mismatches") == 0, "{}", p.line);
    ensure!(p.num("rounds") >= 3, "{}", p.line);
    ensure!(
        !out.lines.iter().any(|l| l.contains("MISMATCH")),
        "page mismatches reported"
    );
    let swap = out.fields("SWAP pswpin");
    ensure!(
        swap.num("pswpout") > 0 && swap.num("pswpin") > 0,
        "the guest did not swap both ways: {}",
        swap.line
    );
}

/// The guest swaps four times the device's memory limit: a write that
/// finds the limit reached moves cold pages to the backing file and
/// succeeds. Zero mismatches, zero failed writes, the limit never passed.
#[test]
fn guest_swap_four_times_the_limit_spills_to_the_backing_file() {
    let Some(ctx) = Ctx::new("swap_spills") else {
        return;
    };
    const LIMIT_MIB: u64 = 16;
    let sock = ctx.path("swap.sock");
    let backing = backing_file(&ctx, 1024 + 1);
    let limit = format!("{LIMIT_MIB}M");
    let mut d = serve(
        &ctx,
        &sock,
        &[
            "--mem-limit",
            &limit,
            "--backing-file",
            backing.to_str().unwrap(),
        ],
    );
    let opts = GuestOpts::new(&sock, "swap")
        .queues(2)
        .mem(GUEST_MEM)
        .arg(ROUNDS);
    let out = ctx.run_guest("swap", &opts, SWAP_BOOT);
    pressure_ok(&out);
    let st = d.stat_cli();
    let dev = st.dev_at(&sock);
    eprintln!("  stat: {}", dev.summary());
    let stored = dev.stats.orig_data_size;
    ensure!(
        stored >= 4 * LIMIT_MIB * MIB,
        "swap use {:.1} MiB is not 4x the {LIMIT_MIB} MiB limit: {dev:?}",
        mib(stored),
    );
    ensure!(
        dev.stats.failed_writes == 0 && dev.stats.failed_reads == 0,
        "{dev:?}"
    );
    ensure!(
        dev.stats.spills > 0 && dev.stats.backed_pages > 0,
        "{dev:?}"
    );
    ensure!(
        dev.stats.mem_used_max <= LIMIT_MIB * MIB,
        "the pool passed its limit: {dev:?}"
    );
    eprintln!(
        "  spill: {:.1} MiB swapped through a {LIMIT_MIB} MiB limit; {} spills, {} pages on disk \
         ({} written, {} read back), mem_used_max {:.1} MiB",
        mib(stored),
        dev.stats.spills,
        dev.stats.backed_pages,
        dev.stats.backed_writes,
        dev.stats.backed_reads,
        mib(dev.stats.mem_used_max),
    );
    d.shutdown();
}

/// Host memory per swapped byte, same guest and pressure: Linux zram in the
/// guest (lz4; its pool is guest RAM, i.e. host RAM) against vzram with lz4,
/// then with idle pages recompressed with zstd, then with incompressible
/// pages written back as well. The last must hold at most 0.7 x zram's.
#[test]
fn tiering_holds_less_host_memory_per_swapped_byte_than_in_guest_zram() {
    let Some(ctx) = Ctx::new("tier_vs_zram") else {
        return;
    };
    let sock = ctx.path("swap.sock");
    let backing = backing_file(&ctx, 1024 + 1);
    let mut d = serve(&ctx, &sock, &["--backing-file", backing.to_str().unwrap()]);

    // zram in the guest (the vzram disk is attached but unused).
    let opts = GuestOpts::new(&sock, "zram-swap")
        .queues(2)
        .mem(GUEST_MEM)
        .arg(ROUNDS);
    let out = ctx.run_guest("zram", &opts, SWAP_BOOT);
    pressure_ok(&out);
    // zram gives slots back as the guest frees them: take its pool when it
    // held the most.
    let (z_orig, z_used) = out
        .lines
        .iter()
        .filter(|l| l.starts_with("ZRAM-SAMPLE "))
        .map(|l| {
            let num = |k: &str| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(k))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or_else(|| panic!("no {k} in {l}"))
            };
            (num("orig_data_size="), num("mem_used_total="))
        })
        .max()
        .expect("no ZRAM-SAMPLE lines");
    ensure!(
        z_orig > 16 * MIB && z_used > 0,
        "zram held only {z_orig} bytes"
    );
    let zram = z_used as f64 / z_orig as f64;

    // The same on vzram.
    let opts = GuestOpts::new(&sock, "swap")
        .queues(2)
        .mem(GUEST_MEM)
        .arg(ROUNDS);
    let out = ctx.run_guest("vzram", &opts, SWAP_BOOT);
    pressure_ok(&out);
    let name = "swap".to_string(); // the default name: the socket's, swap.sock
    let per_byte = |d: &mut Daemon| {
        let st = d.stat_cli();
        let dev = st.dev_at(&sock);
        ensure!(dev.stats.failed_writes == 0, "{dev:?}");
        (
            dev.stats.mem_used_total as f64 / dev.stats.orig_data_size as f64,
            dev.stats.orig_data_size,
        )
    };
    let (lz4, stored) = per_byte(&mut d);
    // After the run every stored page is idle.
    d.cli(&["mark-idle", "--device", &name]);
    d.cli(&[
        "recompress",
        "--device",
        &name,
        "--idle",
        "--algo",
        "zstd:3",
    ]);
    let (zstd, _) = per_byte(&mut d);
    d.cli(&["writeback", "--device", &name, "--incompressible"]);
    let (tiered, _) = per_byte(&mut d);
    eprintln!(
        "  host bytes per swapped byte (pool memory / stored):\n  \
         | zram in the guest, lz4 | {zram:.3} | 1.00 |\n  \
         | vzram, lz4 | {lz4:.3} | {:.2} |\n  \
         | vzram, idle recompressed with zstd:3 | {zstd:.3} | {:.2} |\n  \
         | vzram, and incompressible pages written back | {tiered:.3} | {:.2} |\n  \
         (zram {:.1} MiB stored at its peak; vzram {:.1} MiB stored, measured after the run, \
         when every stored page is idle)",
        lz4 / zram,
        zstd / zram,
        tiered / zram,
        mib(z_orig),
        mib(stored),
    );
    ensure!(
        tiered <= 0.7 * zram,
        "vzram with tiering holds {tiered:.3} host bytes per swapped byte, zram {zram:.3}"
    );
    ensure!(
        zstd < lz4,
        "recompression saved nothing: {lz4:.3} -> {zstd:.3}"
    );
    d.shutdown();
}
