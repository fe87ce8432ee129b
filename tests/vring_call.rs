//! SET_VRING_CALL: like libvhost-user, the daemon signals a call fd once
//! when the frontend hands it over, "in case of I/O hang after
//! reconnecting". QEMU's vhost-user-blk qtest (`idx` case) waits for that
//! interrupt after it connects again; without it the test times out.
//!
//! A raw frontend (tests/support/frontend) sends the messages one at a
//! time, each acked (REPLY_ACK), so the daemon has handled SET_VRING_CALL
//! when the call returns and the eventfd can be read at once.

use std::path::Path;
use std::time::Duration;

use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vzram_tests::frontend::*;
use vzram_tests::*;

/// What the call eventfd holds now (0: nothing), emptying it.
fn taken(call: &EventFd) -> u64 {
    call.read().unwrap_or(0)
}

/// Owner, features, memory table and ring addresses, but no call or kick
/// fd yet.
fn before_call(sock: &Path) -> RawDev {
    let mut v = RawDev::handshake(sock, Ram::standard());
    let table = v.ram.table();
    v.fe.set_mem_table(&table).expect("SET_MEM_TABLE");
    v.queue_size = 256;
    v.fe.set_vring_num(0, 256).expect("SET_VRING_NUM");
    let cfg = v.vring_config(256);
    v.fe.set_vring_addr(0, &cfg).expect("SET_VRING_ADDR");
    v.fe.set_vring_base(0, 0).expect("SET_VRING_BASE");
    v
}

/// The rest of the set-up: kick fd and enable.
fn start(v: &mut RawDev) {
    v.fe.set_vring_kick(0, &v.kick).expect("SET_VRING_KICK");
    v.fe.set_vring_enable(0, true).expect("SET_VRING_ENABLE");
}

#[test]
fn set_vring_call_signals_the_new_fd_once() {
    let dir = TempDir::new("vcall");
    let sock = dir.join("d.sock");
    let d = Daemon::start(
        &dir,
        &["--socket", sock.to_str().unwrap(), "--size", "16M"],
        &[&sock],
    );

    // First connection: the call fd is signalled as soon as it is set,
    // before the ring has even started.
    let mut v = before_call(&sock);
    v.fe.set_vring_call(0, &v.call).expect("SET_VRING_CALL");
    assert_eq!(
        taken(&v.call),
        1,
        "SET_VRING_CALL did not signal the call fd once:\n{}",
        d.log_text()
    );
    start(&mut v);
    let page = pattern(0xca11, 0, 4096);
    assert_eq!(v.write(8, &page), S_OK);
    assert_eq!(v.read(8, 4096), (S_OK, page.clone()));
    // Once: with nothing completing, nothing more arrives.
    let _ = taken(&v.call);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(taken(&v.call), 0, "the call fd was signalled again");

    // QEMU replaces the call fd while the ring runs (masking and unmasking
    // the guest's interrupt): the new one is signalled too, the old one not.
    let next = EventFd::new(EFD_NONBLOCK).unwrap();
    v.fe.set_vring_call(0, &next).expect("SET_VRING_CALL again");
    assert_eq!(taken(&next), 1, "the replacement call fd was not signalled");
    assert_eq!(taken(&v.call), 0, "the old call fd was signalled");
    v.call = next;
    assert_eq!(v.read(8, 4096), (S_OK, page.clone()));

    // GET_VRING_BASE stops the ring and drops the call fd: no signal.
    let _ = taken(&v.call);
    v.fe.get_vring_base(0).expect("GET_VRING_BASE");
    assert_eq!(taken(&v.call), 0, "GET_VRING_BASE signalled the call fd");
    drop(v);

    // Reconnected (the qtest's `idx` case): the new connection's call fd
    // gets its interrupt before any request, and the data is there.
    let mut v = before_call(&sock);
    v.fe.set_vring_call(0, &v.call).expect("SET_VRING_CALL");
    assert_eq!(
        taken(&v.call),
        1,
        "no interrupt on the call fd after reconnecting"
    );
    start(&mut v);
    assert_eq!(v.read(8, 4096), (S_OK, page));
}
