//! The saves and pauses that are no migration, on a real guest swapping on
//! vzram A while `vzram migrate` senders aim its device at vzram B. Each
//! used to empty the source while the VM never left (issue 36): a
//! forgotten sender plus `virsh save` (what libvirt-guests does at host
//! shutdown: QEMU stops the rings and exits), and an early `--commit`
//! followed by a plain pause. One guest goes through them in turn, saved
//! to a file and restored by a new QEMU on the same socket on the way, and
//! finishes its pressure rounds with every page intact; B holds nothing.
//!
//! Like tests/e2e.rs: skipped only when QEMU is absent and `VZRAM_E2E` is
//! unset. Numbers: `cargo test --test e2e_migrate_save -- --nocapture`.

use std::process::{Child, Output};
use std::thread;
use std::time::{Duration, Instant};

use vzram_tests::guest::{swapping, wait_migration, Ctx, Guest, Hosts, Qmp};
use vzram_tests::{ensure, s, said, MigrationState, Summary, MIB};

const SWAP_BOOT: Duration = Duration::from_secs(300);

/// Enough that the guest still swaps after every scenario: it is saved in
/// its second pass (which, restored, reads back every page of the first)
/// and runs the last scenario in its third; each pass verifies the pages
/// the one before wrote.
const ROUNDS: u32 = 3;

/// The destination's copy is dropped and it waits for another stream.
fn destination_emptied(h: &mut Hosts, what: &str) {
    let m = wait_migration(
        &mut h.db,
        &h.sock_b,
        MigrationState::Failed,
        Duration::from_secs(30),
    );
    let held = h.db.stat_cli().dev_at(&h.sock_b).stats.orig_data_size;
    ensure!(
        held == 0,
        "{what}: the destination kept {held} bytes: {m:?}"
    );
}

/// The source still holds its pages and is not moving them.
fn source_whole(h: &mut Hosts, what: &str) {
    let a = h.da.stat_cli().dev_at(&h.sock_a).clone();
    ensure!(
        a.migration.state == MigrationState::SendFailed && a.stats.orig_data_size > 32 * MIB,
        "{what}: the source should keep every page: {} bytes, {:?}",
        a.stats.orig_data_size,
        a.migration
    );
}

/// A sender's end: it must fail, saying `why`.
fn failed_saying(sender: Child, why: &[&str], what: &str) -> String {
    let out: Output = sender.wait_with_output().expect("vzram migrate");
    let text = said(&out);
    ensure!(
        !out.status.success() && why.iter().any(|w| text.contains(w)),
        "{what}: vzram migrate ({}): {text}",
        out.status
    );
    text
}

fn running(q: &mut Qmp) -> bool {
    q.execute("query-status", serde_json::json!({}))["status"].as_str() == Some("running")
}

#[test]
fn a_guest_saved_restored_and_paused_beside_forgotten_senders_keeps_every_page() {
    let Some(ctx) = Ctx::new("migrate-save") else {
        return;
    };
    let mut h = Hosts::start(&ctx);
    let to = h.to();
    let qmp_a = ctx.path("qmp-a.sock");
    let ga = ctx.boot("source", &swapping(&h.sock_a, &qmp_a, ROUNDS));
    ga.wait_for("PRESSURE-ROUND pass=0", SWAP_BOOT);
    let stored = h.da.stat_cli().dev_at(&h.sock_a).stats.orig_data_size;
    ensure!(stored > 32 * MIB, "the source holds only {stored} bytes");
    let mut qa = Qmp::connect(&qmp_a, Duration::from_secs(10));

    // a. Ctrl-C on a sender in pre-copy cancels its send.
    let t = Instant::now();
    let sender = h.migrate(&ctx, &["--to", &to]).spawn().expect("spawn");
    wait_migration(
        &mut h.da,
        &h.sock_a,
        MigrationState::Sending,
        Duration::from_secs(60),
    );
    wait_migration(
        &mut h.db,
        &h.sock_b,
        MigrationState::Receiving,
        Duration::from_secs(60),
    );
    // SAFETY: signalling our own child, not yet reaped.
    unsafe { libc::kill(sender.id() as libc::pid_t, libc::SIGINT) };
    // A client that outlives its Ctrl-C (as when it inherited SIGINT
    // ignored: see `Hosts::migrate`) fails here, saying how.
    let mut sender = sender;
    let deadline = Instant::now() + Duration::from_secs(30);
    while sender.try_wait().expect("try_wait").is_none() {
        if Instant::now() > deadline {
            let status = std::fs::read_to_string(format!("/proc/{}/status", sender.id()))
                .unwrap_or_default();
            let lines: Vec<&str> = status
                .lines()
                .filter(|l| l.starts_with("State") || l.starts_with("Sig") || l.starts_with("Shd"))
                .collect();
            let _ = sender.kill();
            panic!("the vzram migrate client lived 30 s past its SIGINT: {lines:?}");
        }
        thread::sleep(Duration::from_millis(50));
    }
    wait_migration(
        &mut h.da,
        &h.sock_a,
        MigrationState::SendFailed,
        Duration::from_secs(30),
    );
    destination_emptied(&mut h, "Ctrl-C on the sender");
    source_whole(&mut h, "Ctrl-C on the sender");
    eprintln!(
        "  Ctrl-C on a sender in pre-copy: cancelled in {:.1}s",
        t.elapsed().as_secs_f64()
    );

    // A forgotten sender, left running; then `virsh save`: stop (the
    // sender's last delta goes, and it waits for a verdict), QEMU's
    // migration to a file, quit.
    let t = Instant::now();
    let sender = h.migrate(&ctx, &["--to", &to]).spawn().expect("spawn");
    wait_migration(
        &mut h.da,
        &h.sock_a,
        MigrationState::Sending,
        Duration::from_secs(60),
    );
    qa.execute("stop", serde_json::json!({}));
    wait_migration(
        &mut h.da,
        &h.sock_a,
        MigrationState::Committing,
        Duration::from_secs(120),
    );
    let b = h.db.stat_cli().dev_at(&h.sock_b).clone();
    ensure!(
        b.migration.state == MigrationState::Prepared && b.stats.orig_data_size > 0,
        "the destination should hold every page and wait: {:?}",
        b.migration
    );
    let image = ctx.path("saved.img");
    qa.execute(
        "migrate-set-parameters",
        serde_json::json!({ "max-bandwidth": 1u64 << 30 }),
    );
    qa.execute(
        "migrate",
        serde_json::json!({ "uri": format!("exec:cat > {}", s(&image)) }),
    );
    let info = qa.wait_migrated(Duration::from_secs(120));
    ensure!(
        !ga.printed("PRESSURE "),
        "the guest had finished before its save: nothing was shown"
    );
    qa.quit().expect("QMP quit");
    let out = ga.wait(Duration::from_secs(60));
    ensure!(
        out.status.is_some_and(|s| s.success()),
        "the saved QEMU: {:?}",
        out.status
    );
    eprintln!(
        "  virsh save: {} MiB in {:.1}s",
        info["ram"]["transferred"].as_u64().unwrap_or(0) / MIB,
        t.elapsed().as_secs_f64()
    );

    // `virsh restore`: a new QEMU on the same socket takes the saved
    // state and goes on.
    let qmp_r = ctx.path("qmp-restored.sock");
    let gr: Guest = ctx.boot(
        "restored",
        &swapping(&h.sock_a, &qmp_r, ROUNDS)
            .qemu_arg("-S")
            .qemu_arg("-incoming")
            .qemu_arg(format!("exec:cat {}", s(&image))),
    );
    let mut qr = Qmp::connect(&qmp_r, Duration::from_secs(60));
    qr.wait_migrated(Duration::from_secs(120));
    qr.execute("cont", serde_json::json!({}));
    // The next pass reads back every page the guest wrote before its save.
    let pass = gr.wait_for("PRESSURE-ROUND pass=1", Duration::from_secs(180));
    ensure!(
        pass.contains(" mismatches=0 "),
        "the restored guest read pages that differ: {pass}"
    );
    let text = failed_saying(
        sender,
        &["did not start its rings", "started again"],
        "save and restore",
    );
    eprintln!(
        "  save and restore with a forgotten sender: {:.1}s; it said: {}",
        t.elapsed().as_secs_f64(),
        text.trim()
    );
    destination_emptied(&mut h, "save and restore");
    source_whole(&mut h, "save and restore");

    // b. An early `--commit` is refused; a plain pause then commits
    // nothing, and `cont` ends the send.
    let t = Instant::now();
    let sender = h.migrate(&ctx, &["--to", &to]).spawn().expect("spawn");
    wait_migration(
        &mut h.da,
        &h.sock_a,
        MigrationState::Sending,
        Duration::from_secs(60),
    );
    let out = h.migrate(&ctx, &["--commit"]).output().expect("--commit");
    let text = said(&out);
    ensure!(
        out.status.code() == Some(2) && text.contains("only after the last delta"),
        "--commit in pre-copy ({}): {text}",
        out.status
    );
    qr.execute("stop", serde_json::json!({}));
    wait_migration(
        &mut h.da,
        &h.sock_a,
        MigrationState::Committing,
        Duration::from_secs(120),
    );
    thread::sleep(Duration::from_secs(2));
    let m = h.a();
    ensure!(
        m.state == MigrationState::Committing,
        "a pause after an early --commit moved on: {m:?}"
    );
    qr.execute("cont", serde_json::json!({}));
    let text = failed_saying(sender, &["started again"], "early --commit, stop, cont");
    eprintln!(
        "  early --commit (refused: exit 2), stop, cont: {:.1}s; it said: {}",
        t.elapsed().as_secs_f64(),
        text.trim()
    );
    destination_emptied(&mut h, "early --commit, stop, cont");
    source_whole(&mut h, "early --commit, stop, cont");
    ensure!(running(&mut qr), "the restored guest does not run");
    ensure!(
        !gr.printed("PRESSURE "),
        "the guest had finished before the last scenario: nothing was shown"
    );

    // The guest finishes every round, every page verified.
    let out = gr.wait(SWAP_BOOT);
    out.expect_ok();
    let p = out.fields("PRESSURE ");
    ensure!(p.num("mismatches") == 0, "{}", p.line);
    ensure!(p.num("rounds") >= i64::from(ROUNDS), "{}", p.line);
    ensure!(
        !out.lines.iter().any(|l| l.contains("MISMATCH")),
        "page mismatches reported"
    );
    let st = h.da.stat_cli();
    let a = st.dev_at(&h.sock_a);
    eprintln!("  source stat: {}", a.summary());
    ensure!(a.stats.reads > 0 && a.stats.failed_reads == 0, "{a:?}");
    let Hosts { da, db, .. } = h;
    da.shutdown();
    db.shutdown();
}
