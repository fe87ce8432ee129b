//! End-to-end tests: the real `vzram` daemon serving a real Linux guest
//! (`contrib/guest/`) in QEMU over vhost-user-blk.
//!
//! Every test asserts on what the guest prints and on `vzram stat --json`.
//! They skip only when QEMU is absent and `VZRAM_E2E` is unset; with
//! `VZRAM_E2E` set, a missing QEMU is a failure. The tests take a global
//! lock, so only one of them boots guests at a time (TCG is CPU-heavy).
//! Each prints its wall time; see them with
//! `cargo test --test e2e -- --nocapture`.

use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use vzram_tests::guest::{Ctx, GuestOpts, GuestOutput};
use vzram_tests::{ensure, mib, Daemon, Stats, Summary, MIB};

/// Boot timeout for the short scenarios.
const BOOT: Duration = Duration::from_secs(120);
/// Boot timeout for swap under pressure (about 40 s on a 2-core TCG host).
const SWAP_BOOT: Duration = Duration::from_secs(300);

fn args(a: &[&dyn AsRef<std::ffi::OsStr>]) -> Vec<String> {
    a.iter()
        .map(|s| s.as_ref().to_string_lossy().into_owned())
        .collect()
}

/// The guest sees the size, queue count and 4 KiB blocks vzram advertises,
/// with discard; QEMUs with fewer queues work, one with more is refused.
#[test]
fn disk_info() {
    let Some(ctx) = Ctx::new("disk_info") else {
        return;
    };
    let sock = ctx.path("vda.sock");
    let mut d = ctx.daemon(
        &args(&[&"--socket", &sock, &"--size", &"768M", &"--queues", &"2"]),
        &[&sock],
    );

    let out = ctx.run_guest("info", &GuestOpts::new(&sock, "info").queues(2), BOOT);
    out.expect_ok();
    let disk = out.fields("DISK ");
    ensure!(disk.num("size_bytes") == 768 * MIB as i64, "{}", disk.line);
    // The guest has 2 CPUs, and virtio_blk uses at most one queue per CPU.
    ensure!(disk.num("queues") == 2, "{}", disk.line);
    ensure!(disk.num("lbs") == 4096, "logical block size: {}", disk.line);
    ensure!(
        disk.num("pbs") == 4096,
        "physical block size: {}",
        disk.line
    );
    ensure!(disk.num("discard_max") > 0, "{}", disk.line);
    ensure!(disk.num("write_zeroes_max") > 0, "{}", disk.line);
    ensure!(disk.num("ro") == 0, "{}", disk.line);

    let st = d.stat_cli();
    let dev = st.dev_at(&sock);
    eprintln!("  stat: {}", dev.summary());
    ensure!(dev.size_bytes == 768 * MIB, "device size in stats: {dev:?}");
    // The kernel reads the partition table when it probes the disk.
    ensure!(dev.stats.reads > 0, "no reads counted: {dev:?}");
    ensure!(
        dev.stats.orig_data_size == 0,
        "nothing was written: {dev:?}"
    );
    ensure!(st.pool().devices == 1, "{}", st);

    // A QEMU with fewer queues than the device offers works too...
    let raw = |tests: &str, q: u32| {
        GuestOpts::new(&sock, tests)
            .queues(q)
            .arg("vzram.raw_mib=16")
            .arg("vzram.seed=5")
    };
    let out = ctx.run_guest("one-queue", &raw("info,raw-write,raw-verify", 1), BOOT);
    out.expect_ok();
    let disk = out.fields("DISK ");
    ensure!(disk.num("queues") == 1, "{}", disk.line);
    ensure!(raw_verify(&out) == (true, 0), "one queue");

    // ...one that asks for more than it offers is refused, and the daemon
    // serves the next one as before.
    let out = ctx.run_guest(
        "too-many-queues",
        &GuestOpts::new(&sock, "info").queues(4),
        BOOT,
    );
    ensure!(
        out.done_rc().is_none() && !out.status.is_some_and(|s| s.success()),
        "QEMU with 4 queues on a 2-queue device should fail to start"
    );
    d.assert_alive();
    let out = ctx.run_guest("after-refusal", &raw("raw-verify", 2), BOOT);
    out.expect_ok();
    ensure!(raw_verify(&out) == (true, 0), "after a refused QEMU");
    let st = d.stat_cli();
    let dev = st.dev_at(&sock);
    ensure!(dev.connections >= 3, "{dev:?}");
    ensure!(
        dev.stats.failed_reads + dev.stats.failed_writes == 0,
        "{dev:?}"
    );
    d.shutdown();
}

/// Swap on vzram: 1.5x guest RAM, 2 rounds, every page verified; the daemon
/// stores the pages compressed (ratio printed for the closing note).
#[test]
fn swap_under_pressure() {
    let Some(ctx) = Ctx::new("swap_under_pressure") else {
        return;
    };
    let sock = ctx.path("swap.sock");
    let mut d = ctx.daemon(
        &args(&[
            &"--socket",
            &sock,
            &"--size",
            &"1G",
            &"--queues",
            &"2",
            &"--algo",
            &"lz4",
        ]),
        &[&sock],
    );

    let t = Instant::now();
    let opts = GuestOpts::new(&sock, "swap")
        .queues(2)
        .mem("256M")
        .arg("vzram.rounds=2");
    let out = ctx.run_guest("swap", &opts, SWAP_BOOT);
    let guest_secs = t.elapsed().as_secs_f64();
    out.expect_ok();
    let mem_kb = out.fields("GUEST ").num("mem_total_kb");
    let p = out.fields("PRESSURE ");
    ensure!(p.num("mismatches") == 0, "{}", p.line);
    ensure!(p.num("rounds") >= 2, "{}", p.line);
    ensure!(p.num("pages") > 0, "{}", p.line);
    // 1.5 x guest RAM (MiB rounded down).
    ensure!(
        p.num("mib") >= mem_kb * 3 / 2 / 1024,
        "pressure below 1.5x RAM ({mem_kb} KiB): {}",
        p.line
    );
    ensure!(
        !out.lines.iter().any(|l| l.contains("MISMATCH")),
        "page mismatches reported"
    );
    let swap = out.fields("SWAP pswpin");
    ensure!(
        swap.num("pswpout") > 0,
        "the guest never swapped out: {}",
        swap.line
    );
    ensure!(
        swap.num("pswpin") > 0,
        "the guest never swapped in: {}",
        swap.line
    );

    let st = d.stat_cli();
    let dev = st.dev_at(&sock);
    eprintln!("  stat: {}", dev.summary());
    let orig = dev.stats.orig_data_size;
    let compr = dev.stats.compr_data_size;
    let used = dev.stats.mem_used_total;
    ensure!(dev.stats.writes > 0, "{dev:?}");
    ensure!(dev.stats.reads > 0, "{dev:?}");
    ensure!(orig >= 32 * MIB, "too little stored: {dev:?}");
    ensure!(
        dev.stats.failed_writes == 0 && dev.stats.failed_reads == 0,
        "{dev:?}"
    );
    ensure!(compr > 0 && used > 0, "{dev:?}");
    let ratio = orig as f64 / compr as f64;
    let ratio_used = orig as f64 / used as f64;
    eprintln!(
        "  swap: {} MiB of pressure on {} KiB RAM, {} rounds, guest {guest_secs:.1}s (pressure {:.1}s); \
         stored {:.1} MiB in {:.1} MiB compressed, {:.1} MiB used: compression ratio {ratio:.2} \
         (orig/compr), {ratio_used:.2} (orig/mem_used_total)",
        p.num("mib"),
        mem_kb,
        p.num("rounds"),
        p.float("secs"),
        mib(orig),
        mib(compr),
        mib(used),
    );
    ensure!(ratio > 1.0, "compression ratio {ratio:.2} <= 1: {:?}", dev);
    ensure!(
        ratio_used > 1.0,
        "orig/mem_used_total {ratio_used:.2} <= 1: {:?}",
        dev
    );
    d.shutdown();
}

/// ext2 (mounted by the ext4 driver) on a zstd device: files written, caches
/// dropped, checksums compared, in the same boot and in a second one.
#[test]
fn filesystem_roundtrip() {
    let Some(ctx) = Ctx::new("filesystem_roundtrip") else {
        return;
    };
    let sock = ctx.path("fs.sock");
    let mut d = ctx.daemon(
        &args(&[
            &"--socket",
            &sock,
            &"--size",
            &"512M",
            &"--queues",
            &"2",
            &"--algo",
            &"zstd:3",
        ]),
        &[&sock],
    );

    let opts = GuestOpts::new(&sock, "fs-write,fs-verify").queues(2);
    let out = ctx.run_guest("write", &opts, BOOT);
    out.expect_ok();
    let fs = out.fields("FS ok ");
    ensure!(fs.num("files") == 8, "{}", fs.line);
    let sums = out.fields("FS sums=").line.clone();
    let sums: Vec<&str> = sums.trim_start_matches("FS sums=").split(',').collect();
    ensure!(sums.len() == 8, "{sums:?}");
    // file0 is 4 MiB of zeros.
    ensure!(
        sums[0] == "b5cfa9d6c8febd618f91ac2843d50a1c",
        "md5 of file0 (zeros): {}",
        sums[0]
    );
    ensure!(
        out.fields("FS verify ").str("files") == "8" && out.line("FS verify ok").is_some(),
        "same-boot verify"
    );
    let st1 = d.stat_cli();
    let dev = st1.dev_at(&sock);
    eprintln!("  stat after write: {}", dev.summary());
    ensure!(dev.algo.to_string().starts_with("zstd"), "{dev:?}");
    ensure!(dev.stats.writes > 0 && dev.stats.reads > 0, "{dev:?}");
    // 7 files of 4 MiB of mixed data, plus one of zeros, plus metadata.
    ensure!(dev.stats.orig_data_size >= 28 * MIB, "{dev:?}");
    ensure!(
        dev.stats.same_pages > 0,
        "the zero file stored no same-filled pages: {dev:?}"
    );
    ensure!(
        dev.stats.failed_writes == 0 && dev.stats.failed_reads == 0,
        "{dev:?}"
    );

    // A second boot: the filesystem and its files are still there.
    let out = ctx.run_guest(
        "verify",
        &GuestOpts::new(&sock, "fs-verify").queues(2),
        BOOT,
    );
    out.expect_ok();
    ensure!(out.fields("FS verify ok").num("files") == 8, "second boot");
    let st2 = d.stat_cli();
    let dev2 = st2.dev_at(&sock);
    eprintln!("  stat after verify: {}", dev2.summary());
    ensure!(
        dev2.stats.reads > dev.stats.reads,
        "the second boot read nothing"
    );
    ensure!(dev2.stats.failed_reads == 0, "{dev2:?}");
    d.shutdown();
}

/// Memory given back: fstrim after deleting files, then swap with discard;
/// `vzram compact` then returns what the frees left fragmented. The guest
/// sets nothing by hand: its udevd applies contrib/udev/60-vzram.rules,
/// which marks the disk non-rotational by its serial (vzram-NAME), and only
/// then does swap discard freed clusters.
#[test]
fn discard_frees_memory() {
    let Some(ctx) = Ctx::new("discard_frees_memory") else {
        return;
    };
    let sock = ctx.path("trim.sock");
    let mut d = ctx.daemon(
        &args(&[&"--socket", &sock, &"--size", &"512M", &"--queues", &"2"]),
        &[&sock],
    );

    // 1) Files: 7 x 8 MiB of mixed data (file0 is zeros).
    let opts = GuestOpts::new(&sock, "fs-write")
        .queues(2)
        .arg("vzram.fs_files=8")
        .arg("vzram.fs_file_mib=8");
    ctx.run_guest("fs-write", &opts, BOOT).expect_ok();
    let full = d.stat_cli();
    let full = full.dev_at(&sock);
    eprintln!("  stat after fs-write: {}", full.summary());
    let x = full.stats.mem_used_total;
    ensure!(full.stats.orig_data_size >= 56 * MIB, "{full:?}");

    // 2) Delete them and fstrim.
    let out = ctx.run_guest("fs-trim", &GuestOpts::new(&sock, "fs-trim").queues(2), BOOT);
    out.expect_ok();
    ensure!(
        out.fields("TRIM done").num("bytes") > 0,
        "fstrim trimmed nothing"
    );
    let trimmed = d.stat_cli();
    let trimmed = trimmed.dev_at(&sock);
    eprintln!("  stat after fs-trim: {}", trimmed.summary());
    let y = trimmed.stats.mem_used_total;
    eprintln!(
        "  fstrim: mem_used_total {:.1} MiB -> {:.1} MiB",
        mib(x),
        mib(y)
    );
    ensure!(
        trimmed.stats.discards > full.stats.discards,
        "no discards counted"
    );
    ensure!(
        trimmed.stats.orig_data_size + 48 * MIB <= full.stats.orig_data_size,
        "orig_data_size did not fall by the deleted files: {:.1} -> {:.1} MiB",
        mib(full.stats.orig_data_size),
        mib(trimmed.stats.orig_data_size)
    );
    ensure!(
        y * 2 <= x,
        "mem_used_total did not fall substantially after fstrim: {:.1} -> {:.1} MiB",
        mib(x),
        mib(y)
    );

    // 3) Swap with discard: the memory swap used is given back as the
    //    guest frees its swap slots.
    let opts = GuestOpts::new(&sock, "swap")
        .queues(2)
        .arg("vzram.discard=1")
        .arg("vzram.rounds=2");
    let (mut peak_used, mut peak_orig, mut samples) = (0u64, 0u64, 0);
    let out =
        ctx.boot("swap-discard", &opts)
            .wait_polling(SWAP_BOOT, Duration::from_secs(2), || {
                let s = d.stat_cli();
                let c = s.dev_at(&sock);
                peak_used = peak_used.max(c.stats.mem_used_total);
                peak_orig = peak_orig.max(c.stats.orig_data_size);
                samples += 1;
            });
    out.expect_ok();
    ensure!(
        out.fields("PRESSURE ").num("mismatches") == 0,
        "swap with discard"
    );
    let udev = out.fields("UDEV ");
    ensure!(
        udev.num("running") == 1 && udev.str("serial").starts_with("vzram"),
        "udev in the guest: {}",
        udev.line
    );
    let start = out.fields("SWAP start");
    ensure!(
        start.num("rotational") == 0,
        "contrib/udev/60-vzram.rules did not mark the disk non-rotational: {}",
        start.line
    );
    let end = d.stat_cli();
    let end = end.dev_at(&sock);
    eprintln!("  stat after swap-discard: {}", end.summary());
    let z = end.stats.mem_used_total;
    eprintln!(
        "  swap discard: peak ({samples} samples) mem_used_total {:.1} MiB, orig_data_size {:.1} MiB \
         -> {:.1} MiB, {:.1} MiB at the end",
        mib(peak_used),
        mib(peak_orig),
        mib(z),
        mib(end.stats.orig_data_size),
    );
    ensure!(
        peak_used >= 32 * MIB,
        "swap barely used the device: peak {:.1} MiB",
        mib(peak_used)
    );
    ensure!(
        end.stats.discards > trimmed.stats.discards,
        "swap issued no discards"
    );
    ensure!(
        end.stats.orig_data_size * 2 <= peak_orig,
        "stored data did not fall with swap discard: {:.1} -> {:.1} MiB",
        mib(peak_orig),
        mib(end.stats.orig_data_size)
    );
    ensure!(
        z * 2 <= peak_used,
        "mem_used_total stayed high after swap discard: {:.1} -> {:.1} MiB",
        mib(peak_used),
        mib(z)
    );

    // 4) What the frees left fragmented, compaction gives back.
    let line = d.compact();
    let c = d.stat_cli();
    let c = c.dev_at(&sock);
    eprintln!("  {line}; stat after compact: {}", c.summary());
    let compacted = c.stats.mem_used_total;
    ensure!(compacted <= z, "compaction grew the pool");
    if z >= end.stats.compr_data_size + 4 * MIB {
        ensure!(
            compacted < z,
            "{:.1} MiB of waste and compaction gave nothing back",
            mib(z - end.stats.compr_data_size)
        );
    }
    d.shutdown();
}

/// QEMU killed (SIGKILL) while up and again in the middle of writes; new
/// QEMUs on the same socket of the same daemon read the data back.
#[test]
fn reconnect_keeps_data() {
    let Some(ctx) = Ctx::new("reconnect_keeps_data") else {
        return;
    };
    let sock = ctx.path("rc.sock");
    let mut d = ctx.daemon(
        &args(&[&"--socket", &sock, &"--size", &"512M", &"--queues", &"2"]),
        &[&sock],
    );
    let pid = d.pid();
    let raw = |tests: &str| {
        GuestOpts::new(&sock, tests)
            .queues(2)
            .arg("vzram.seed=7")
            .arg("vzram.raw_mib=64")
            .arg("vzram.raw_offset_mib=16")
    };

    // 1) Write, then hold; kill QEMU while the guest is up.
    let g = ctx.boot("write-hold", &raw("raw-write,hold"));
    g.wait_for("HOLD ready", BOOT);
    let written = d.stat_cli();
    let written = written.dev_at(&sock);
    eprintln!("  stat after raw-write: {}", written.summary());
    ensure!(written.stats.orig_data_size >= 40 * MIB, "{written:?}");
    let out = g.kill();
    ensure!(
        out.line("RAW written pages=16384").is_some(),
        "raw-write did not finish"
    );
    thread::sleep(Duration::from_millis(300));
    d.assert_alive();

    // 2) A new QEMU on the same socket reads it all back, then rewrites the
    //    same data and is killed in the middle of that (in-flight requests).
    let g = ctx.boot(
        "verify-rewrite",
        &raw("raw-verify,raw-write,raw-write,raw-write,raw-write"),
    );
    g.wait_for("VZRAM-TIME test=raw-verify", BOOT);
    thread::sleep(Duration::from_millis(800));
    let out = g.kill();
    let v = out.fields("RAW verify ");
    ensure!(
        v.line.starts_with("RAW verify ok") && v.num("mismatches") == 0,
        "after reconnect: {}",
        v.line
    );
    ensure!(v.num("pages") == 16384, "{}", v.line);
    thread::sleep(Duration::from_millis(300));
    d.assert_alive();

    // 3) And once more, after a kill during I/O.
    let out = ctx.run_guest("verify", &raw("raw-verify"), BOOT);
    out.expect_ok();
    let v = out.fields("RAW verify ok");
    ensure!(
        v.num("mismatches") == 0 && v.num("pages") == 16384,
        "{}",
        v.line
    );

    let end = d.stat_cli();
    let end = end.dev_at(&sock);
    eprintln!("  stat at the end: {}", end.summary());
    ensure!(
        end.stats.reads > written.stats.reads,
        "the new connections read nothing"
    );
    ensure!(end.stats.failed_reads == 0, "{end:?}");
    ensure!(
        end.stats.orig_data_size == written.stats.orig_data_size,
        "the data changed size: {:.1} -> {:.1} MiB",
        mib(written.stats.orig_data_size),
        mib(end.stats.orig_data_size)
    );
    ensure!(d.pid() == pid, "daemon replaced");
    // Three QEMUs connected, one after the other, to the same daemon.
    ensure!(end.connections == 3, "connections: {end:?}");
    d.shutdown();
}

/// Guest lines for one raw check: `RAW verify ok|FAIL` with its mismatches.
fn raw_verify(out: &GuestOutput) -> (bool, i64) {
    let v = out.fields("RAW verify ");
    (v.line.starts_with("RAW verify ok"), v.num("mismatches"))
}

/// Two guests on one daemon (lz4 and zstd devices) under a host-wide limit:
/// isolation, concurrent use, and the limit enforced as write errors for the
/// guest that overfills, with everything written before left intact.
#[test]
fn two_vms_host_limit() {
    let Some(ctx) = Ctx::new("two_vms_host_limit") else {
        return;
    };
    let (a, b) = (ctx.path("a.sock"), ctx.path("b.sock"));
    let limit = 48 * MIB;
    let dev = |s: &Path, q: u32, algo: &str| {
        format!("socket={},size=256M,queues={q},algo={algo}", s.display())
    };
    let mut d = ctx.daemon(
        &args(&[
            &"--device",
            &dev(&a, 1, "lz4"),
            &"--device",
            &dev(&b, 2, "zstd"),
            &"--host-mem-limit",
            &"48M",
        ]),
        &[&a, &b],
    );
    let raw = |s: &Path, q: u32, tests: &str, seed: u32| {
        GuestOpts::new(s, tests)
            .queues(q)
            .arg(format!("vzram.seed={seed}"))
            .arg("vzram.raw_mib=32")
    };
    let check_limit = |st: &Stats, when: &str| {
        let pool = st.pool();
        eprintln!("  pool {when}: {}", pool.summary());
        ensure!(pool.mem_limit == limit, "host limit in stats: {pool:?}");
        ensure!(
            pool.mem_used_total <= limit,
            "{when}: pool uses {:.1} MiB over the {:.1} MiB host limit",
            mib(pool.mem_used_total),
            mib(limit)
        );
        ensure!(pool.devices == 2, "{pool:?}");
    };

    // 1) Both VMs at once, each writing and verifying its own seed at the
    //    same offsets.
    let ga = ctx.boot("A-write", &raw(&a, 1, "raw-write,raw-verify", 11));
    let gb = ctx.boot("B-write", &raw(&b, 2, "raw-write,raw-verify", 22));
    let (oa, ob) = (ga.wait(BOOT), gb.wait(BOOT));
    oa.expect_ok();
    ob.expect_ok();
    ensure!(raw_verify(&oa) == (true, 0), "A");
    ensure!(raw_verify(&ob) == (true, 0), "B");
    let st = d.stat_cli();
    check_limit(&st, "after both wrote");
    for s in [&a, &b] {
        let c = st.dev_at(s);
        eprintln!("  {}: {}", s.display(), c.summary());
        ensure!(c.stats.orig_data_size >= 16 * MIB, "{c:?}");
        ensure!(c.stats.failed_writes == 0, "{c:?}");
    }
    ensure!(st.dev_at(&a).algo.to_string() == "lz4", "{}", st);
    ensure!(st.dev_at(&b).algo.to_string().starts_with("zstd"), "{}", st);

    // 2) Neither sees the other's data: each disk fails a check with the
    //    other VM's seed.
    let ga = ctx.boot("A-sees-B?", &raw(&a, 1, "raw-verify", 22));
    let gb = ctx.boot("B-sees-A?", &raw(&b, 2, "raw-verify", 11));
    let (oa, ob) = (ga.wait(BOOT), gb.wait(BOOT));
    for (o, who) in [(&oa, "A with B's seed"), (&ob, "B with A's seed")] {
        ensure!(
            o.done_rc() == Some(1),
            "{who}: the verify should have failed"
        );
        let (ok, bad) = raw_verify(o);
        ensure!(!ok && bad > 4096, "{who}: only {bad} mismatching pages");
    }

    // 3) B writes far more than the host limit allows: its writes fail,
    //    the pool stays under the limit, and A keeps working meanwhile.
    let gb = ctx.boot(
        "B-overfill",
        &GuestOpts::new(&b, "raw-write")
            .queues(2)
            .arg("vzram.seed=33")
            .arg("vzram.raw_mib=192")
            .arg("vzram.raw_offset_mib=32"),
    );
    let ga = ctx.boot("A-verify", &raw(&a, 1, "raw-verify", 11));
    let (ob, oa) = (gb.wait(BOOT), ga.wait(BOOT));
    oa.expect_ok();
    ensure!(raw_verify(&oa) == (true, 0), "A after B hit the limit");
    ensure!(
        ob.done_rc() == Some(1),
        "B's 192 MiB write should hit the 48 MiB host limit"
    );
    ensure!(
        ob.line("RAW error=write").is_some(),
        "B: no write error reported"
    );
    let st = d.stat_cli();
    check_limit(&st, "after B hit the limit");
    ensure!(st.dev_at(&b).stats.failed_writes > 0, "{:?}", st.dev_at(&b));
    ensure!(
        st.dev_at(&a).stats.failed_writes == 0,
        "{:?}",
        st.dev_at(&a)
    );

    // 4) B's own data from before is intact.
    let ob = ctx.run_guest("B-verify", &raw(&b, 2, "raw-verify", 22), BOOT);
    ob.expect_ok();
    ensure!(
        raw_verify(&ob) == (true, 0),
        "B's data after its failed writes"
    );
    check_limit(&d.stat_cli(), "at the end");
    d.shutdown();
}

/// How the daemon goes away in the middle of a guest's swapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    /// SIGKILL: a crash, the OOM killer; nothing is cleaned up.
    Kill,
    /// SIGTERM, then the same command line again: an upgrade.
    Term,
    /// SIGKILL of the worker process serving the guest; the daemon stays.
    Worker,
}

/// How long the daemon stays away (the one deliberate sleep). The guest's
/// disk I/O waits meanwhile: virtio-blk has no timeout handler, so blk-mq
/// only re-arms its 30 s timer, and nothing fails; QEMU tries the socket
/// again every second (`reconnect=1`).
const OUTAGE: Duration = Duration::from_millis(1500);

/// Guest RAM and swap pressure for the restart tests: 1.5 x the RAM QEMU
/// gives the guest (1.8 x its MemTotal), over three rounds; 50-80 s
/// each under TCG on two cores.
const RESTART_MEM_MIB: i64 = 192;
const RESTART_PRESSURE_MIB: i64 = RESTART_MEM_MIB * 3 / 2;
const RESTART_ROUNDS: i64 = 3;

/// A guest swaps 1.5x its RAM to vzram; after the fill, while it swaps in
/// and out, the daemon is stopped (`stop`) and the same command line is
/// started again. QEMU reconnects and resubmits what was in flight; the
/// restarted daemon recovers every page from its state, and the guest
/// verifies every page of every round: no mismatch, no I/O error.
fn restart_mid_swap(name: &'static str, stop: Stop) {
    let Some(ctx) = Ctx::new(name) else {
        return;
    };
    let sock = ctx.path("swap.sock");
    let mut d = ctx.daemon(
        &args(&[&"--socket", &sock, &"--size", &"1G", &"--queues", &"2"]),
        &[&sock],
    );
    let opts = GuestOpts::new(&sock, "swap")
        .queues(2)
        .mem(&format!("{RESTART_MEM_MIB}M"))
        .arg(format!("vzram.rounds={RESTART_ROUNDS}"))
        .arg(format!("vzram.mib={RESTART_PRESSURE_MIB}"))
        .reconnect(1);
    let g = ctx.boot("swap", &opts);

    // 1) The fill is done: most of the guest's pages now live only in the
    //    daemon. Wait until the next pass swaps them back in and others out.
    g.wait_for("PRESSURE-ROUND pass=0", SWAP_BOOT);
    let io = |d: &mut Daemon| {
        let s = d.stat_cli();
        let c = s.dev_at(&sock);
        (c.stats.reads, c.stats.writes, c.stats.orig_data_size)
    };
    let (r0, w0, _) = io(&mut d);
    let deadline = Instant::now() + Duration::from_secs(120);
    let (r1, w1, stored) = loop {
        let (r, w, o) = io(&mut d);
        if r >= r0 + 2000 && w >= w0 + 2000 {
            break (r, w, o);
        }
        ensure!(
            Instant::now() < deadline && !g.printed("PRESSURE rounds="),
            "the guest did not swap both ways after the fill: reads {r0} -> {r}, writes {w0} -> {w}"
        );
        thread::sleep(Duration::from_millis(100));
    };
    ensure!(
        !g.printed("PRESSURE-ROUND pass=1"),
        "the guest finished the pass before the daemon could be stopped"
    );
    eprintln!(
        "  {:.1}s: swapping after the fill (reads {r0} -> {r1}, writes {w0} -> {w1}, {:.1} MiB \
         stored); {stop:?} the daemon",
        ctx.elapsed(),
        mib(stored)
    );

    // 2) The daemon (or only the guest's worker) goes away in the middle of
    //    that and comes back.
    let t = Instant::now();
    let mut d2 = match stop {
        Stop::Kill | Stop::Term => {
            if let Stop::Kill = stop {
                d.kill9();
            } else {
                d.terminate_cleanly();
            }
            thread::sleep(OUTAGE);
            let d2 = ctx.restart(&mut d);
            eprintln!("  restarted after {:.1}s", t.elapsed().as_secs_f64());
            d2
        }
        Stop::Worker => {
            let s = d.stat_cli();
            let pid = s
                .dev_at(&sock)
                .worker
                .pid
                .unwrap_or_else(|| panic!("no worker pid: {s}"));
            // SAFETY: signalling the worker process the daemon reported.
            let rc = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            ensure!(rc == 0, "cannot kill worker {pid}");
            d
        }
    };
    // Connections the daemon serving the rest will have counted.
    let connections = if let Stop::Worker = stop { 2 } else { 1 };
    // What it found, before QEMU is back (checked once the guest is done,
    // so that a daemon that lost the data fails on what the guest saw).
    let at_restart = d2.stat_cli();
    let io_at_restart = {
        let c = at_restart.dev_at(&sock);
        c.stats.reads + c.stats.writes
    };

    // 3) QEMU comes back on its own and the guest carries on.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = d2.stat_cli();
        let c = s.dev_at(&sock);
        if c.connections >= connections && c.stats.reads + c.stats.writes > io_at_restart {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "QEMU did not reconnect and resume I/O within 30s of the restart: {c:?}"
        );
        thread::sleep(Duration::from_millis(100));
    }
    let resumed = t.elapsed().as_secs_f64();
    let first = d2.stat_cli();
    let first = first.dev_at(&sock);
    eprintln!(
        "  guest I/O resumed {resumed:.1}s after the stop: {}",
        first.summary()
    );
    let (w_resumed, r_resumed) = (first.stats.writes, first.stats.reads);

    let out = g.wait(SWAP_BOOT);
    // The pages first: a daemon that came back blank fails here, and the
    // guest may not live to say more (its own swapped-out pages are lost).
    if out.line("PRESSURE rounds=").is_some() {
        let p = out.fields("PRESSURE rounds=");
        ensure!(p.num("mismatches") == 0, "{}", p.line);
    }
    out.expect_ok();
    let p = out.fields("PRESSURE rounds=");
    ensure!(p.num("rounds") == RESTART_ROUNDS, "{}", p.line);
    ensure!(p.num("mib") >= RESTART_PRESSURE_MIB, "{}", p.line);
    ensure!(
        !out.lines.iter().any(|l| l.contains("MISMATCH")),
        "page mismatches reported"
    );
    let errors: Vec<&String> = out
        .lines
        .iter()
        .filter(|l| l.contains("I/O error") || l.contains("error on swap-device"))
        .collect();
    ensure!(errors.is_empty(), "the guest saw I/O errors: {errors:?}");
    let swap = out.fields("SWAP pswpin");
    ensure!(swap.num("pswpin") > 0, "{}", swap.line);

    // 4) The restarted daemon recovered the device from its state, with
    //    what the first one had stored.
    let log = d2.log_text();
    // The last recovery: the worker that served the reconnected guest.
    let recovered = log
        .lines()
        .rev()
        .find(|l| l.contains("recovered the device from its state"));
    ensure!(
        recovered.is_some(),
        "the restarted daemon did not recover the device; its log:\n{log}"
    );
    let line = recovered.unwrap_or_default().to_string();
    eprintln!("  {line}");
    let pages: u64 = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("pages="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no pages= in {line:?}"));
    // Swap without discard frees nothing, and the guest wrote little
    // between the sample and the stop: all of it is back.
    ensure!(
        pages * 4096 >= stored / 2,
        "{:.1} MiB stored before the stop, {:.1} MiB recovered",
        mib(stored),
        mib(pages * 4096)
    );
    let dev = at_restart.dev_at(&sock);
    if !matches!(stop, Stop::Worker) && dev.stats.writes + dev.stats.discards == 0 {
        ensure!(
            dev.stats.orig_data_size == pages * 4096,
            "recovered {pages} pages, stat says {:?}",
            dev
        );
    }

    // 5) The restarted daemon served the rest of the run: the rounds after
    //    the stop read the recovered pages and wrote new ones.
    let end = d2.stat_cli();
    let end = end.dev_at(&sock);
    eprintln!("  stat at the end: {}", end.summary());
    ensure!(
        end.stats.writes > w_resumed + 1000 && end.stats.reads > r_resumed + 1000,
        "little I/O after the restart: writes {w_resumed} -> {}, reads {r_resumed} -> {}",
        end.stats.writes,
        end.stats.reads
    );
    ensure!(
        end.stats.failed_reads + end.stats.failed_writes == 0,
        "{end:?}"
    );
    ensure!(end.connections == connections, "connections: {end:?}");
    let log = d2.log_text();
    ensure!(
        log.contains("frontend connected"),
        "no frontend in the restarted daemon's log:\n{log}"
    );
    eprintln!(
        "  {stop:?} mid-swap: {} MiB of pressure, {} rounds, guest {:.1}s, outage {resumed:.1}s",
        p.num("mib"),
        p.num("rounds"),
        out.secs
    );
    d2.shutdown();
}

/// SIGKILL in the middle of swap, then the same command line: the guest
/// stalls, QEMU reconnects, and every page reads back.
#[test]
fn daemon_killed_mid_swap_and_restarted() {
    restart_mid_swap("daemon_killed_mid_swap_and_restarted", Stop::Kill);
}

/// SIGTERM in the middle of swap, then the same command line (an upgrade).
#[test]
fn daemon_upgraded_with_sigterm_mid_swap() {
    restart_mid_swap("daemon_upgraded_with_sigterm_mid_swap", Stop::Term);
}

/// SIGKILL of the guest's worker process in the middle of swap: the daemon
/// serves QEMU's reconnection with a new worker, and every page reads back.
#[test]
fn worker_killed_mid_swap() {
    restart_mid_swap("worker_killed_mid_swap", Stop::Worker);
}
