//! Destructive operator commands on a device a VM is using (issue 37):
//! `remove`, `reset` and `forget` are refused with one line naming the
//! frontend unless `--force`; a forced remove keeps the state, and no
//! reload serves the device again blank. Every command a refusal advises
//! is run as advised.

use std::path::Path;
use std::time::{Duration, Instant};

use vzram_tests::*;

const MIB: usize = 1 << 20;

/// A `[[device]]` table.
fn device(name: &str, socket: &Path, extra: &str) -> String {
    format!(
        "[[device]]\nname = \"{name}\"\nsocket = \"{}\"\nsize = \"16M\"\nqueues = 1\n{extra}\n",
        s(socket)
    )
}

fn hup_and_wait(d: &mut Daemon, needle: &str) {
    let before = d.log_text().matches(needle).count();
    // SAFETY: kill(2) on the daemon we started; no memory is involved.
    let rc = unsafe { libc::kill(d.pid() as i32, libc::SIGHUP) };
    assert_eq!(rc, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while d.log_text().matches(needle).count() <= before {
        d.assert_alive();
        assert!(
            Instant::now() < deadline,
            "no {needle:?}:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Names the device `vm1` in `vzram CMD vm1`, refused while connected:
/// the refusal names this process (the frontend) and advises one command.
fn refused_naming_us(d: &Daemon, line: &str) -> String {
    let o = run_hint(&d.control, line);
    assert_eq!(o.status.code(), Some(2), "{o:?}\n{}", d.log_text());
    let err = refusal(&o);
    let pid = format!("pid {}", std::process::id());
    assert!(
        err.contains(&pid),
        "`{line}` does not name the frontend ({pid}): {err}"
    );
    err
}

#[test]
fn remove_of_a_connected_device_is_refused_and_forced_keeps_its_pages_through_reloads() {
    let dir = TempDir::new("guard-remove");
    let sock = dir.join("vm1.sock");
    let cfg = dir.join("vzram.toml");
    std::fs::write(&cfg, device("vm1", &sock, "")).unwrap();
    let mut d = Daemon::start(&dir, &["--config", s(&cfg)], &[&sock]);
    let data = noise(37, MIB);
    let mut c = Client::connect(&sock, 1).unwrap();
    c.q(0).write(0, &data).unwrap();
    let state = d.stat().dev("vm1").state.clone();

    // forget and remove: refused, naming the frontend.
    let err = refused_naming_us(&d, "vzram forget vm1");
    assert_eq!(
        hints(&err),
        ["vzram remove vm1 --force", "vzram forget vm1"],
        "{err}"
    );
    let err = refused_naming_us(&d, "vzram remove vm1");
    assert!(state.exists() && sock.exists(), "{err}");
    assert_eq!(hints(&err), ["vzram remove vm1 --force"], "{err}");
    // The advised command cuts the VM off and keeps its state.
    let out = run_hint_ok(&d.control, &hints(&err)[0]);
    drop(c);
    assert!(state.exists(), "a forced remove deleted the state: {out}");
    let again = hints(&out);
    assert_eq!(again.len(), 2, "{out}");
    let st = d.stat();
    assert!(st.devices().is_empty(), "{st}");

    // The device is still in the file: a reload does not serve it again
    // blank, nor does fresh=true in the file discard it.
    hup_and_wait(&mut d, "reload done");
    assert!(d.stat().devices().is_empty(), "{}", d.log_text());
    std::fs::write(&cfg, device("vm1", &sock, "fresh = true")).unwrap();
    hup_and_wait(&mut d, "reload done");
    assert!(d.stat().devices().is_empty(), "{}", d.log_text());
    assert!(state.exists() && !sock.exists());

    // The command the remove printed serves the pages again.
    run_hint_ok(&d.control, &again[0]);
    let mut c = Client::connect(&sock, 1).unwrap();
    assert!(
        c.q(0).read(0, MIB).unwrap() == data,
        "the pages are not back"
    );
}

#[test]
fn reset_of_a_connected_device_is_refused_and_forced_cuts_it_off() {
    let dir = TempDir::new("guard-reset");
    let sock = dir.join("vm1.sock");
    let d = Daemon::start(
        &dir,
        &[
            "--device",
            &format!("socket={},size=16M,queues=1,name=vm1", s(&sock)),
        ],
        &[&sock],
    );
    let mut c = Client::connect(&sock, 1).unwrap();
    c.q(0).write(0, &noise(3, 2 * MIB)).unwrap();
    let err = refused_naming_us(&d, "vzram reset vm1");
    assert_eq!(hints(&err), ["vzram reset vm1 --force"], "{err}");
    assert_eq!(d.stat().counters("vm1").orig_data_size, 2 * MIB as u64);
    let out = run_hint_ok(&d.control, &hints(&err)[0]);
    assert!(out.contains("512 pages dropped"), "{out}");
    drop(c);
    let mut c = Client::connect(&sock, 1).unwrap();
    assert!(c.q(0).read(0, 2 * MIB).unwrap() == vec![0; 2 * MIB]);
}
