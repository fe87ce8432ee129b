//! Dirty page logging (VHOST_F_LOG_ALL with LOG_SHMFD): while QEMU
//! migrates a VM it hands the backend a shared bitmap with SET_LOG_BASE,
//! one bit per 4 KiB page of guest address space, and copies again every
//! page whose bit the backend sets. Without it QEMU refuses to migrate.
//!
//! A raw frontend (tests/support/frontend) negotiates both, passes a memfd
//! log and checks that the daemon marks exactly the pages it writes: the
//! data of a read, status bytes and the used ring, never what it only
//! reads.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::VhostUserFrontend;
use vhost::{VhostBackend, VhostUserDirtyLogRegion};
use vzram_tests::frontend::*;
use vzram_tests::*;

const LOG_PAGE: u64 = 4096;
/// Enough bits for the standard RAM (24 MiB of guest addresses).
const LOG_BYTES: u64 = 4096;

/// The guest pages whose bits are set, emptying the log.
fn take_dirty(log: &File) -> Vec<u64> {
    let mut b = vec![0u8; LOG_BYTES as usize];
    log.read_exact_at(&mut b, 0).unwrap();
    log.write_all_at(&vec![0u8; LOG_BYTES as usize], 0).unwrap();
    let mut pages = Vec::new();
    for (i, byte) in b.iter().enumerate() {
        for bit in 0..8 {
            if byte & (1 << bit) != 0 {
                pages.push(i as u64 * 8 + bit);
            }
        }
    }
    pages
}

fn page(gpa: u64) -> u64 {
    gpa / LOG_PAGE
}

fn set_log_base(v: &mut RawDev, log: &File, size: u64) {
    // SET_LOG_BASE has a reply of its own; QEMU sends it without NEED_REPLY.
    v.fe.set_hdr_flags(VhostUserHeaderFlag::empty());
    let region = VhostUserDirtyLogRegion {
        mmap_size: size,
        mmap_offset: 0,
        mmap_handle: log.as_raw_fd(),
    };
    v.fe.set_log_base(0, Some(region)).expect("SET_LOG_BASE");
    v.fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
}

#[test]
fn the_daemon_logs_the_guest_pages_it_writes() {
    let dir = TempDir::new("dlog");
    let sock = dir.join("d.sock");
    let daemon = Daemon::start(
        &dir,
        &["--socket", sock.to_str().unwrap(), "--size", "16M"],
        &[&sock],
    );
    let mut v = RawDev::handshake_acking(
        &sock,
        Ram::standard(),
        false,
        VhostUserProtocolFeatures::LOG_SHMFD,
    );
    let table = v.ram.table();
    v.fe.set_mem_table(&table).expect("SET_MEM_TABLE");
    v.setup_vring(Setup::default());
    let data = pattern(0xd17, 0, 2 * LOG_PAGE as usize);
    assert_eq!(v.write(16, &data), S_OK);

    let log = memfd(LOG_BYTES);
    set_log_base(&mut v, &log, LOG_BYTES);
    assert_eq!(take_dirty(&log), Vec::<u64>::new(), "nothing written yet");

    // A read writes its two data pages, the status byte and the used ring.
    assert_eq!(v.read(16, data.len()), (S_OK, data.clone()));
    let mut want = vec![page(USED), page(STATUS), page(DATA), page(DATA) + 1];
    want.sort();
    assert_eq!(take_dirty(&log), want, "{}", daemon.log_text());

    // A write only reads its data: its pages stay clean.
    assert_eq!(v.write(16, &data), S_OK);
    assert_eq!(take_dirty(&log), vec![page(USED), page(STATUS)]);

    // A read into the low region: a page the device writes there too.
    v.ram.write(DATA_LO, &[0; 512]);
    let (st, _) = v.req(T_IN, 16, &[d(DATA_LO + 512, 512, F_WRITE)]);
    assert_eq!(st, S_OK);
    assert_eq!(
        take_dirty(&log),
        vec![page(USED), page(STATUS), page(DATA_LO)]
    );
    assert_eq!(v.ram.read(DATA_LO + 512, 512), data[..512]);
}

/// A log too short for the guest's memory, or one that runs past the end
/// of its file, is refused (the connection ends) and the daemon serves the
/// next frontend.
#[test]
fn a_bad_log_is_refused_and_the_device_still_serves() {
    let dir = TempDir::new("dlogbad");
    let sock = dir.join("d.sock");
    let _d = Daemon::start(
        &dir,
        &["--socket", sock.to_str().unwrap(), "--size", "16M"],
        &[&sock],
    );
    // 24 MiB of guest addresses need 768 bytes of log.
    for (file, size) in [(LOG_BYTES, 16), (16, LOG_BYTES)] {
        let v = RawDev::handshake_acking(
            &sock,
            Ram::standard(),
            false,
            VhostUserProtocolFeatures::LOG_SHMFD,
        );
        let table = v.ram.table();
        v.fe.set_mem_table(&table).expect("SET_MEM_TABLE");
        let log = memfd(file);
        v.fe.set_hdr_flags(VhostUserHeaderFlag::empty());
        let region = VhostUserDirtyLogRegion {
            mmap_size: size,
            mmap_offset: 0,
            mmap_handle: log.as_raw_fd(),
        };
        assert!(
            v.fe.set_log_base(0, Some(region)).is_err(),
            "a {size}-byte log in a {file}-byte file was taken"
        );
    }
    let mut v = RawDev::connect(&sock);
    let data = pattern(0xd18, 0, 4096);
    assert_eq!(v.write(8, &data), S_OK);
    assert_eq!(v.read(8, 4096), (S_OK, data));
}

/// A region added after SET_LOG_BASE logs to the same log (QEMU sends
/// SET_LOG_BASE again only when the log must grow); one the log does not
/// cover is refused, since its writes could not be logged.
#[test]
fn regions_added_later_are_logged_too() {
    let dir = TempDir::new("dlogadd");
    let sock = dir.join("d.sock");
    let daemon = Daemon::start(
        &dir,
        &["--socket", sock.to_str().unwrap(), "--size", "16M"],
        &[&sock],
    );
    // A 4096-byte log covers 128 MiB of guest addresses.
    const EXTRA: (u64, usize) = (64 * MIB, MIB as usize);
    const BEYOND: (u64, usize) = (256 * MIB, MIB as usize);
    let mut v = RawDev::handshake_acking(
        &sock,
        Ram::new(&[LOW, HIGH, EXTRA, BEYOND]),
        false,
        VhostUserProtocolFeatures::LOG_SHMFD,
    );
    let table = v.ram.table();
    v.fe.set_mem_table(&table[..2]).expect("SET_MEM_TABLE");
    v.setup_vring(Setup::default());
    let data = pattern(0xd19, 0, LOG_PAGE as usize);
    assert_eq!(v.write(24, &data), S_OK);
    let log = memfd(LOG_BYTES);
    set_log_base(&mut v, &log, LOG_BYTES);

    v.fe.add_mem_region(&table[2]).expect("ADD_MEM_REG");
    let (st, _) = v.req(T_IN, 24, &[d(EXTRA.0, 4096, F_WRITE)]);
    assert_eq!(st, S_OK);
    assert_eq!(v.ram.read(EXTRA.0, 4096), data);
    assert_eq!(
        take_dirty(&log),
        vec![page(USED), page(STATUS), page(EXTRA.0)],
        "{}",
        daemon.log_text()
    );

    assert!(
        v.fe.add_mem_region(&table[3]).is_err(),
        "a region past the end of the log was taken"
    );
    // A refused memory table ends the connection (vhost-user-backend stops
    // its handler on the error): the frontend may not go on with memory
    // whose writes could not be logged. A request sent meanwhile may or may
    // not be served, so none is: the data waits for the next frontend.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while daemon.stat().devices()[0].connected {
        assert!(
            std::time::Instant::now() < deadline,
            "the connection outlived its refused memory table"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    drop(v);
    let mut v = RawDev::handshake_acking(
        &sock,
        Ram::new(&[LOW, HIGH]),
        false,
        VhostUserProtocolFeatures::LOG_SHMFD,
    );
    let table = v.ram.table();
    v.fe.set_mem_table(&table).expect("SET_MEM_TABLE");
    v.setup_vring(Setup::default());
    set_log_base(&mut v, &log, LOG_BYTES);
    assert_eq!(v.read(24, 4096), (S_OK, data));
    assert_eq!(take_dirty(&log), vec![page(USED), page(STATUS), page(DATA)]);
}
