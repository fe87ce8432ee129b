//! Hostile vhost-user frontends against the real daemon (issue 6, parts 2
//! and 6): descriptor chains and ring set-up. The protocol itself is in
//! `hostile_protocol.rs`, guest memory tables in `hostile_memory.rs`,
//! isolation across devices in `hostile_isolation.rs`.
//!
//! Every test runs a daemon with two devices (`tests/support/hostile.rs`):
//! `victim`, driven by a raw frontend (tests/support/frontend) that sends
//! what no VMM should, and `other`, driven by the well-behaved blkio client
//! the whole time. Each hostile request must get IOERR or UNSUPP, or
//! complete with nothing written, or get its connection dropped; and
//! afterwards the daemon is alive, `other` still reads back every byte it
//! wrote and takes new writes, and `victim` serves a fresh, well-behaved
//! frontend with its data intact.

use std::time::Duration;

use vhost::vhost_user::VhostUserFrontend;
use vhost::{VhostBackend, VringConfigData};
use vzram_tests::frontend::*;
use vzram_tests::hostile::*;
use vzram_tests::*;

// ---------------------------------------------------------------------------
// Descriptor chains
// ---------------------------------------------------------------------------

#[test]
fn descriptors_outside_guest_memory_or_in_the_gap() {
    let mut fx = fixture("outside", "");
    let mut v = fx.raw();
    let low_end = LOW.0 + LOW.1 as u64;
    let high_end = HIGH.0 + HIGH.1 as u64;
    let before = sector_data(&mut v, 8, PAGE);

    // Data buffers that are not (all) guest RAM: IOERR, nothing written.
    for (what, addr, len) in [
        ("far away", FAR, 512u32),
        ("in the gap", GAP, 512),
        ("from the low region into the gap", low_end - 256, 512),
        ("from the high region past the end", high_end - 512, 1024),
        ("wrapping around 2^64", u64::MAX - 255, 512),
        ("just before the high region", HIGH.0 - 512, 1024),
    ] {
        let (st, used) = v.req(T_IN, 8, &[d(addr, len, F_WRITE)]);
        assert_eq!((st, used), (S_IOERR, 1), "IN into a buffer {what}");
        let (st, used) = v.req(T_OUT, 8, &[d(addr, len, 0)]);
        assert_eq!((st, used), (S_IOERR, 1), "OUT from a buffer {what}");
        assert_eq!(sector_data(&mut v, 8, PAGE), before, "{what}: disk changed");
    }
    // One good data descriptor and one bad: all or nothing.
    v.ram.write(DATA, &[0x11; 512]);
    let (st, _) = v.req(T_OUT, 8, &[d(DATA, 512, 0), d(GAP, 512, 0)]);
    assert_eq!(st, S_IOERR);
    assert_eq!(sector_data(&mut v, 8, PAGE), before);

    // The header outside guest RAM.
    for addr in [FAR, GAP, low_end - 8] {
        v.ram.write(STATUS, &[UNTOUCHED]);
        let u = v.run(&[d(addr, 16, 0), d(STATUS, 1, F_WRITE)]);
        assert_eq!(
            (v.ram.u8_at(STATUS), u.len),
            (S_IOERR, 1),
            "header at {addr:#x}"
        );
    }

    // The status byte outside guest RAM: nowhere to report, nothing done.
    v.ram.write(DATA, &noise(5, 512));
    v.header(HDR, T_OUT, 8);
    for addr in [FAR, GAP, high_end, u64::MAX] {
        let u = v.run(&[d(HDR, 16, 0), d(DATA, 512, 0), d(addr, 1, F_WRITE)]);
        assert_eq!(u.len, 0, "status at {addr:#x}: used length");
        assert_eq!(sector_data(&mut v, 8, PAGE), before, "status at {addr:#x}");
    }
    // A status descriptor that starts in RAM and ends outside it.
    let u = v.run(&[d(HDR, 16, 0), d(DATA, 512, 0), d(low_end - 4, 8, F_WRITE)]);
    assert_eq!(u.len, 0);
    // ... and one that starts in the gap and ends in RAM: the status byte
    // is in RAM, so the guest hears IOERR.
    v.ram.write(HIGH.0 + 3, &[UNTOUCHED]);
    let u = v.run(&[d(HDR, 16, 0), d(DATA, 512, 0), d(HIGH.0 - 4, 8, F_WRITE)]);
    assert_eq!((v.ram.u8_at(HIGH.0 + 3), u.len), (S_IOERR, 1));
    assert_eq!(sector_data(&mut v, 8, PAGE), before);

    // The ring still works.
    let data = noise(9, 2 * PAGE);
    assert_eq!(v.write(8, &data), S_OK);
    assert_eq!(sector_data(&mut v, 8, 2 * PAGE), data);
    drop(v);
    fx.check_victim();
}

#[test]
fn buffers_across_adjacent_regions_are_fine() {
    // Two regions with no gap: a buffer across the seam is ordinary guest
    // memory and must work (the seam is where a sloppy check would go wrong).
    let mut fx = fixture("seam", "");
    let ram = Ram::new(&[(0, 4 << 20), (4 << 20, 4 << 20), (16 << 20, 8 << 20)]);
    let mut v = RawDev::connect_with(&fx.victim, ram, Setup::default());
    let seam = 4u64 << 20;
    let data = noise(31, 3 * PAGE);
    v.ram.write(seam - 5000, &data);
    let (st, _) = v.req(T_OUT, 64, &[d(seam - 5000, data.len() as u32, 0)]);
    assert_eq!(st, S_OK);
    v.ram.write(seam - 100, &[0; 3 * PAGE]);
    let (st, used) = v.req(T_IN, 64, &[d(seam - 100, data.len() as u32, F_WRITE)]);
    assert_eq!((st, used), (S_OK, data.len() as u32 + 1));
    assert_eq!(v.ram.read(seam - 100, data.len()), data);
    drop(v);
    fx.check_victim();
}

#[test]
fn overlapping_chains_and_buffers() {
    let mut fx = fixture("overlap", "");
    let mut v = fx.raw();

    // The same head twice in the avail ring: done twice, both OK.
    let data = noise(1, PAGE);
    v.ram.write(DATA, &data);
    v.header(HDR, T_OUT, 16);
    v.ram.write(STATUS, &[UNTOUCHED]);
    let head = v.chain(0, &[d(HDR, 16, 0), d(DATA, 4096, 0), d(STATUS, 1, F_WRITE)]);
    v.publish(head);
    v.publish(head);
    v.kick();
    for _ in 0..2 {
        assert_eq!(v.wait(), Used { id: 0, len: 1 });
    }
    assert_eq!(v.ram.u8_at(STATUS), S_OK);
    assert_eq!(sector_data(&mut v, 16, PAGE), data);

    // Two chains sharing their tail: A = [hdr, data, status], B starts at
    // A's data descriptor, so B's "header" is A's payload, whose type
    // (0xdeadbeef) is unknown. A is done (OK), then B (UNSUPP) overwrites
    // the shared status byte. Both are returned with one status byte.
    let mut data = noise(2, PAGE);
    data[0..4].copy_from_slice(&0xdead_beef_u32.to_le_bytes());
    v.ram.write(DATA, &data);
    v.header(HDR, T_OUT, 24);
    v.ram.write(STATUS, &[UNTOUCHED]);
    v.chain(0, &[d(HDR, 16, 0), d(DATA, 4096, 0), d(STATUS, 1, F_WRITE)]);
    v.publish(0);
    v.publish(1);
    v.kick();
    assert_eq!(v.wait(), Used { id: 0, len: 1 });
    assert_eq!(v.wait(), Used { id: 1, len: 1 });
    assert_eq!(v.ram.u8_at(STATUS), S_UNSUPP);
    assert_eq!(sector_data(&mut v, 24, PAGE), data);

    // A read whose buffer covers its own header: the header is read first,
    // then the data (sectors 16 and 17) lands over it.
    let (st, used) = v.req(T_IN, 16, &[d(HDR - 512, 1024, F_WRITE)]);
    assert_eq!((st, used), (S_OK, 1025));
    assert_eq!(v.ram.read(HDR - 512, 1024), {
        let mut want = noise(1, PAGE);
        want.truncate(1024);
        want
    });

    // A status byte inside the data buffer: data first, then the status.
    v.header(HDR, T_IN, 16);
    let u = v.run(&[
        d(HDR, 16, 0),
        d(DATA, 512, F_WRITE),
        d(DATA + 100, 1, F_WRITE),
    ]);
    assert_eq!(u.len, 513);
    let mut want = noise(1, 512);
    want[100] = S_OK;
    assert_eq!(v.ram.read(DATA, 512), want);

    // Header and data in one descriptor: the data is what follows the
    // header's 16 bytes.
    let mut blob = noise(3, 16 + 512);
    blob[0..4].copy_from_slice(&T_OUT.to_le_bytes());
    blob[4..8].fill(0);
    blob[8..16].copy_from_slice(&40u64.to_le_bytes());
    v.ram.write(DATA, &blob);
    v.ram.write(STATUS, &[UNTOUCHED]);
    let u = v.run(&[d(DATA, 16 + 512, 0), d(STATUS, 1, F_WRITE)]);
    assert_eq!((v.ram.u8_at(STATUS), u.len), (S_OK, 1));
    assert_eq!(sector_data(&mut v, 40, 512), blob[16..].to_vec());

    drop(v);
    fx.check_victim();
}

#[test]
fn looping_chains_indirect_tables_and_bad_heads() {
    let mut fx = fixture("loops", "");
    let mut v = fx.raw(); // queue size 256
    let before = sector_data(&mut v, 0, PAGE);

    // A status descriptor whose next is itself: walked until the queue size
    // runs out, never a whole number of sectors: IOERR.
    v.header(HDR, T_IN, 0);
    v.ram.write(STATUS, &[UNTOUCHED]);
    v.set_desc(0, dn(HDR, 16, F_NEXT, 1));
    v.set_desc(1, dn(STATUS, 1, F_WRITE | F_NEXT, 1));
    v.publish(0);
    v.kick();
    let u = v.wait();
    assert_refused(
        u,
        v.ram.u8_at(STATUS),
        "a status descriptor looping on itself",
    );

    // A readable loop back to the header: no writable status at all.
    v.ram.write(DATA, &[7; 512]);
    v.header(HDR, T_OUT, 0);
    v.set_desc(0, dn(HDR, 16, F_NEXT, 1));
    v.set_desc(1, dn(DATA, 512, F_NEXT, 0));
    v.publish(0);
    v.kick();
    assert_eq!(v.wait(), Used { id: 0, len: 0 });
    assert_eq!(
        sector_data(&mut v, 0, PAGE),
        before,
        "a looping write landed"
    );

    // Readable, writable, readable ... (a loop through both directions).
    v.header(HDR, T_OUT, 0);
    v.ram.write(STATUS, &[UNTOUCHED]);
    v.set_desc(0, dn(HDR, 16, F_NEXT, 1));
    v.set_desc(1, dn(DATA, 512, F_NEXT, 2));
    v.set_desc(2, dn(STATUS, 1, F_WRITE | F_NEXT, 1));
    v.publish(0);
    v.kick();
    let u = v.wait();
    assert_refused(u, v.ram.u8_at(STATUS), "a loop through both directions");
    assert_eq!(sector_data(&mut v, 0, PAGE), before);

    // An indirect descriptor pointing at a table whose first entry is that
    // same indirect descriptor (nested indirection): an empty chain.
    let t = SCRATCH;
    v.indirect_table(t, &[d(t, 16, F_INDIRECT)]);
    v.set_desc(0, d(t, 16, F_INDIRECT));
    v.publish(0);
    v.kick();
    assert_eq!(v.wait(), Used { id: 0, len: 0 });

    // Nested indirection after a good header and data: cut there, so the
    // chain ends in a readable descriptor: nothing is done.
    v.header(HDR, T_OUT, 0);
    v.indirect_table(t, &[d(HDR, 16, 0), d(DATA, 512, 0), d(t, 48, F_INDIRECT)]);
    v.set_desc(0, d(t, 48, F_INDIRECT));
    v.publish(0);
    v.kick();
    assert_eq!(v.wait(), Used { id: 0, len: 0 });
    assert_eq!(sector_data(&mut v, 0, PAGE), before);

    // An indirect table that is not whole descriptors, or not in RAM.
    for desc in [
        d(t, 20, F_INDIRECT),
        d(FAR, 64, F_INDIRECT),
        d(GAP, 64, F_INDIRECT),
    ] {
        v.set_desc(0, desc);
        v.publish(0);
        v.kick();
        assert_eq!(v.wait(), Used { id: 0, len: 0 }, "{desc:?}");
    }

    // Chains longer than the queue (and than seg_max) through indirect
    // tables: 300 entries, and the largest table there can be (65535).
    for n in [300usize, 65535] {
        let mut descs = vec![d(HDR, 16, 0)];
        descs.extend((0..n - 2).map(|i| d(DATA + 512 * (i as u64 % 64), 512, 0)));
        descs.push(d(STATUS, 1, F_WRITE));
        v.header(HDR, T_OUT, 0);
        v.ram.write(STATUS, &[UNTOUCHED]);
        v.indirect_table(DATA_LO, &descs);
        v.set_desc(0, d(DATA_LO, 16 * n as u32, F_INDIRECT));
        v.publish(0);
        v.kick();
        let u = v.wait();
        assert_eq!((u.len, v.ram.u8_at(STATUS)), (1, S_IOERR), "{n} entries");
    }
    assert_eq!(sector_data(&mut v, 0, PAGE), before);

    // A head index past the queue: it cannot be returned. A good request
    // published with it is still served (at the latest on the next kick).
    v.header(HDR, T_FLUSH, 0);
    v.ram.write(STATUS, &[UNTOUCHED]);
    v.chain(3, &[d(HDR, 16, 0), d(STATUS, 1, F_WRITE)]);
    v.publish(0xffff);
    v.publish(3);
    v.kick();
    let u = match v.wait_for(QUIET) {
        Some(u) => u,
        None => {
            v.kick();
            v.wait()
        }
    };
    assert_eq!((u, v.ram.u8_at(STATUS)), (Used { id: 3, len: 1 }, S_OK));

    // An avail index more than a queue ahead: refused until it makes sense.
    let good = v.avail_idx();
    v.set_avail_idx(good.wrapping_add(1000));
    v.kick();
    assert!(
        v.quiet_for(QUIET),
        "a ring with a bogus avail index was served"
    );
    v.set_avail_idx(good);
    assert_eq!(v.write(0, &noise(4, PAGE)), S_OK);

    drop(v);
    fx.check_victim();
}

/// A chain cut short by virtio-queue (a loop that runs out of queue size,
/// a `next` past the table) must not be carried out as if it had ended
/// there, with its last descriptor taken as the status byte.
#[test]
fn truncated_chains_are_not_executed() {
    let mut fx = fixture("trunc", "");
    let mut v = RawDev::connect_with(
        &fx.victim,
        Ram::standard(),
        Setup {
            queue_size: 8,
            ..Setup::default()
        },
    );
    let disk = noise(12, PAGE);
    assert_eq!(v.write(0, &disk), S_OK);

    // hdr -> A(513, W) -> B(511, W) -> A -> ...: with 8 descriptors the walk
    // stops on A, and 4 * 513 + 3 * 511 - 1 = 7 sectors: a "valid" read.
    v.header(HDR, T_IN, 0);
    let (a, b) = (DATA, DATA + 0x1000);
    v.ram.write(a + 512, &[UNTOUCHED]);
    v.set_desc(0, dn(HDR, 16, F_NEXT, 1));
    v.set_desc(1, dn(a, 513, F_WRITE | F_NEXT, 2));
    v.set_desc(2, dn(b, 511, F_WRITE | F_NEXT, 1));
    v.publish(0);
    v.kick();
    let u = v.wait();
    assert_refused(u, v.ram.u8_at(a + 512), "a looping chain");

    // hdr -> W(513) whose next (5000) is past the table.
    v.ram.write(a + 512, &[UNTOUCHED]);
    v.set_desc(1, dn(a, 513, F_WRITE | F_NEXT, 5000));
    v.publish(0);
    v.kick();
    let u = v.wait();
    assert_refused(
        u,
        v.ram.u8_at(a + 512),
        "a chain whose next is past the table",
    );
    drop(v);
    fx.check_victim();
}

#[test]
fn zero_length_missing_and_read_only_status_descriptors() {
    let mut fx = fixture("status", "");
    let mut v = fx.raw();
    let before = sector_data(&mut v, 8, PAGE);
    let data = noise(21, 512);
    v.ram.write(DATA, &data);

    // No writable last byte: nothing is done, nothing is written.
    let cases: [(&str, Vec<Desc>); 5] = [
        (
            "read-only status",
            vec![d(HDR, 16, 0), d(DATA, 512, 0), d(STATUS, 1, 0)],
        ),
        (
            "zero-length status",
            vec![d(HDR, 16, 0), d(DATA, 512, 0), d(STATUS, 0, F_WRITE)],
        ),
        ("no status", vec![d(HDR, 16, 0), d(DATA, 512, 0)]),
        ("header only", vec![d(HDR, 16, 0)]),
        (
            "status then a readable descriptor",
            vec![
                d(HDR, 16, 0),
                d(DATA, 512, 0),
                d(STATUS, 1, F_WRITE),
                d(DATA, 512, 0),
            ],
        ),
    ];
    for (what, descs) in cases {
        v.header(HDR, T_OUT, 8);
        v.ram.write(STATUS, &[UNTOUCHED]);
        let u = v.run(&descs);
        assert_eq!(u.len, 0, "{what}: used length");
        assert_eq!(v.ram.u8_at(STATUS), UNTOUCHED, "{what}: status written");
        assert_eq!(sector_data(&mut v, 8, PAGE), before, "{what}: disk changed");
    }

    // Zero-length buffers in RAM are skipped.
    let (st, used) = v.req(
        T_IN,
        8,
        &[
            d(DATA, 0, F_WRITE),
            d(DATA, 512, F_WRITE),
            d(DATA + 512, 0, F_WRITE),
        ],
    );
    assert_eq!((st, used), (S_OK, 513));
    v.ram.write(DATA, &data);
    let (st, _) = v.req(T_OUT, 8, &[d(DATA, 0, 0), d(DATA, 512, 0), d(DATA, 0, 0)]);
    assert_eq!(st, S_OK);
    assert_eq!(sector_data(&mut v, 8, 512), data);
    // Zero-length buffers pointing nowhere touch nothing: skipped or IOERR.
    let other = noise(22, 512);
    v.ram.write(DATA, &other);
    let (st, _) = v.req(T_OUT, 8, &[d(GAP, 0, 0), d(DATA, 512, 0), d(FAR, 0, 0)]);
    assert!(st == S_OK || st == S_IOERR, "status {st}");
    let want = if st == S_OK { other } else { data.clone() };
    assert_eq!(sector_data(&mut v, 8, 512), want);
    v.ram.write(DATA, &[0xa5; 512]);
    let (st, _) = v.req(T_IN, 8, &[d(FAR, 0, F_WRITE), d(DATA, 512, F_WRITE)]);
    assert!(st == S_OK || st == S_IOERR, "status {st}");
    if st == S_OK {
        assert_eq!(v.ram.read(DATA, 512), want);
    }
    assert_eq!(v.write(8, &data), S_OK);

    // A zero-length header descriptor, then the header: fine.
    v.header(HDR, T_IN, 8);
    v.ram.write(STATUS, &[UNTOUCHED]);
    let u = v.run(&[
        d(HDR, 0, 0),
        d(HDR, 16, 0),
        d(DATA, 512, F_WRITE),
        d(STATUS, 1, F_WRITE),
    ]);
    assert_eq!((v.ram.u8_at(STATUS), u.len), (S_OK, 513));
    // Only zero-length readable descriptors: no header: IOERR.
    v.ram.write(STATUS, &[UNTOUCHED]);
    let u = v.run(&[d(HDR, 0, 0), d(HDR, 0, 0), d(STATUS, 1, F_WRITE)]);
    assert_eq!((v.ram.u8_at(STATUS), u.len), (S_IOERR, 1));
    // A short header (8 bytes).
    v.ram.write(STATUS, &[UNTOUCHED]);
    let u = v.run(&[d(HDR, 8, 0), d(STATUS, 1, F_WRITE)]);
    assert_eq!((v.ram.u8_at(STATUS), u.len), (S_IOERR, 1));
    // A writable header: no readable header at all: IOERR.
    v.header(HDR, T_OUT, 8);
    v.ram.write(STATUS, &[UNTOUCHED]);
    let u = v.run(&[d(HDR, 16, F_WRITE), d(STATUS, 1, F_WRITE)]);
    assert_eq!((v.ram.u8_at(STATUS), u.len), (S_IOERR, 1));

    // Payload in the wrong direction, and readable after writable.
    let bad: [(u32, Vec<Desc>); 4] = [
        (T_IN, vec![d(DATA, 512, 0)]),
        (T_OUT, vec![d(DATA, 512, F_WRITE)]),
        (T_OUT, vec![d(DATA, 512, 0), d(DATA, 512, F_WRITE)]),
        (T_IN, vec![d(DATA, 512, F_WRITE), d(DATA, 512, 0)]),
    ];
    for (t, payload) in bad {
        let (st, used) = v.req(t, 8, &payload);
        assert_eq!((st, used), (S_IOERR, 1), "type {t}, {payload:?}");
    }
    assert_eq!(sector_data(&mut v, 8, 512), data);
    drop(v);
    fx.check_victim();
}

#[test]
fn writes_to_a_read_only_device_fail() {
    let mut fx = fixture("ro", ",readonly=true");
    let mut v = fx.raw();
    assert_ne!(v.features & (1 << 5), 0, "VIRTIO_BLK_F_RO is offered");
    assert_eq!(v.write(0, &noise(1, PAGE)), S_IOERR);
    assert_eq!(v.write(8, &noise(1, 512)), S_IOERR);
    assert_eq!(v.dwz(T_DISCARD, &[(0, 8, 0)]), S_IOERR);
    assert_eq!(v.dwz(T_WRITE_ZEROES, &[(0, 8, 0)]), S_IOERR);
    assert_eq!(v.dwz(T_WRITE_ZEROES, &[(0, 8, 1)]), S_IOERR);
    assert_eq!(v.read(0, 2 * PAGE), (S_OK, vec![0; 2 * PAGE]));
    assert_eq!(v.req(T_FLUSH, 0, &[]).0, S_OK);
    let (st, used) = v.req(T_GET_ID, 0, &[d(DATA, 20, F_WRITE)]);
    assert_eq!((st, used), (S_OK, 21));
    // The default serial: vzram- and the name.
    assert_eq!(&v.ram.read(DATA, 12), b"vzram-victim");
    let stats = fx.d.stat();
    assert_eq!(stats.counters("victim").writes, 0);
    assert_eq!(stats.counters("victim").orig_data_size, 0);
    drop(v);
    fx.check();
    let mut v = fx.raw();
    assert_eq!(v.read(0, PAGE), (S_OK, vec![0; PAGE]));
}

#[test]
fn sector_overflow_out_of_range_and_odd_lengths() {
    let mut fx = fixture("range", "");
    let mut v = fx.raw();
    let last = SECTORS - 1;
    let tail = noise(41, 512);
    assert_eq!(v.write(last, &tail), S_OK);
    let head = sector_data(&mut v, 0, PAGE);

    for (what, sector, len) in [
        ("sector * 512 overflows", u64::MAX / 512 + 1, 512u32),
        ("sector u64::MAX", u64::MAX, 512),
        ("offset + length overflows", u64::MAX / 512, 1024),
        ("one past the end", SECTORS, 512),
        ("far past the end", SECTORS * 1000, 512),
        ("straddling the end", last, 1024),
        ("straddling the end by a page", SECTORS - 4, 4096),
    ] {
        v.ram.write(DATA, &[0xcc; 4096]);
        let (st, used) = v.req(T_IN, sector, &[d(DATA, len, F_WRITE)]);
        assert_eq!((st, used), (S_IOERR, 1), "IN: {what}");
        let (st, used) = v.req(T_OUT, sector, &[d(DATA, len, 0)]);
        assert_eq!((st, used), (S_IOERR, 1), "OUT: {what}");
    }
    assert_eq!(
        sector_data(&mut v, last, 512),
        tail,
        "the last sector changed"
    );

    for (what, payload) in [
        ("511 bytes", vec![d(DATA, 511, 0)]),
        ("100 bytes", vec![d(DATA, 100, 0)]),
        ("512 + 1 bytes", vec![d(DATA, 512, 0), d(DATA + 4096, 1, 0)]),
        ("4095 bytes", vec![d(DATA, 4095, 0)]),
    ] {
        v.ram.write(DATA, &[0xcc; 4096]);
        let (st, used) = v.req(T_OUT, 0, &payload);
        assert_eq!((st, used), (S_IOERR, 1), "OUT of {what}");
        let wpayload: Vec<Desc> = payload.iter().map(|x| d(x.addr, x.len, F_WRITE)).collect();
        let (st, used) = v.req(T_IN, 0, &wpayload);
        assert_eq!((st, used), (S_IOERR, 1), "IN of {what}");
    }
    assert_eq!(sector_data(&mut v, 0, PAGE), head);
    // The exact end is fine.
    assert_eq!(v.write(last, &[3; 512]), S_OK);
    assert_eq!(v.read(last, 512), (S_OK, vec![3; 512]));
    drop(v);
    fx.check_victim();
}

#[test]
fn unknown_types_get_id_and_flush() {
    let mut fx = fixture("types", "");
    let mut v = fx.raw();
    for t in [2u32, 3, 5, 7, 9, 10, 12, 14, 15, 16, 0xdead, u32::MAX] {
        let (st, used) = v.req(t, 0, &[]);
        assert_eq!((st, used), (S_UNSUPP, 1), "type {t:#x}");
        let (st, _) = v.req(t, u64::MAX, &[d(DATA, 512, 0)]);
        assert_eq!(st, S_UNSUPP, "type {t:#x} with readable payload");
        let (st, _) = v.req(t, 0, &[d(DATA, 4096, F_WRITE)]);
        assert_eq!(st, S_UNSUPP, "type {t:#x} with writable payload");
    }

    // GET_ID with the full 20 bytes.
    v.ram.write(DATA, &[0xff; 64]);
    let (st, used) = v.req(T_GET_ID, 0, &[d(DATA, 20, F_WRITE)]);
    assert_eq!((st, used), (S_OK, 21));
    let mut want = b"vzram-victim".to_vec();
    want.resize(20, 0);
    assert_eq!(v.ram.read(DATA, 20), want);
    // Too short a buffer: never written past, whatever the status.
    for n in [0u32, 1, 5, 19] {
        v.ram.write(DATA, &[0xff; 64]);
        let payload = if n == 0 {
            vec![]
        } else {
            vec![d(DATA, n, F_WRITE)]
        };
        let (st, used) = v.req(T_GET_ID, 0, &payload);
        assert!(st == S_OK || st == S_IOERR, "GET_ID into {n} bytes: {st}");
        assert!(used <= n + 1, "GET_ID into {n} bytes claims {used}");
        assert!(
            v.ram
                .read(DATA + u64::from(n), 64 - n as usize)
                .iter()
                .all(|&b| b == 0xff),
            "GET_ID wrote past a {n}-byte buffer"
        );
        if st == S_OK {
            assert_eq!(v.ram.read(DATA, n as usize), want[..n as usize].to_vec());
        }
    }
    // GET_ID with readable payload.
    let (st, _) = v.req(T_GET_ID, 0, &[d(DATA, 20, 0)]);
    assert_eq!(st, S_IOERR);
    // FLUSH with junk around it.
    assert_eq!(v.req(T_FLUSH, u64::MAX, &[d(DATA, 7, 0)]).0, S_OK);
    drop(v);
    fx.check_victim();
}

#[test]
fn discard_and_write_zeroes_with_absurd_segments() {
    let mut fx = fixture("discard", "");
    let mut v = fx.raw();
    let data = noise(51, 4 * PAGE);
    assert_eq!(v.write(0, &data), S_OK);

    for (what, t, segs) in [
        ("UNMAP on a discard", T_DISCARD, vec![(0u64, 8u32, 1u32)]),
        ("unknown discard flag", T_DISCARD, vec![(0, 8, 0x8000_0000)]),
        ("unknown write-zeroes flag", T_WRITE_ZEROES, vec![(0, 8, 2)]),
        ("all flags", T_WRITE_ZEROES, vec![(0, 8, u32::MAX)]),
    ] {
        assert_eq!(v.dwz(t, &segs), S_UNSUPP, "{what}");
    }
    for (what, t, segs) in [
        ("u32::MAX sectors", T_DISCARD, vec![(0u64, u32::MAX, 0u32)]),
        ("sector u64::MAX", T_DISCARD, vec![(u64::MAX, 1, 0)]),
        (
            "sector * 512 overflows",
            T_WRITE_ZEROES,
            vec![(u64::MAX / 512 + 1, 8, 0)],
        ),
        ("end overflows", T_DISCARD, vec![(u64::MAX / 512, 8, 0)]),
        ("past the end", T_DISCARD, vec![(SECTORS, 8, 0)]),
        (
            "straddling the end",
            T_WRITE_ZEROES,
            vec![(SECTORS - 4, 8, 0)],
        ),
        (
            "one good, one bad",
            T_DISCARD,
            vec![(0, 8, 0), (SECTORS, 8, 0)],
        ),
        (
            "one good, one too long",
            T_WRITE_ZEROES,
            vec![(0, 8, 0), (0, 1 << 22, 0)],
        ),
    ] {
        assert_eq!(v.dwz(t, &segs), S_IOERR, "{what}");
    }
    // Segment counts: 257 and 4096 (over max_discard_seg: UNSUPP, as QEMU
    // answers), none, and a length that is not whole segments.
    for n in [257usize, 4096] {
        let segs = vec![(0u64, 1u32, 0u32); n];
        assert_eq!(v.dwz(T_DISCARD, &segs), S_UNSUPP, "{n} segments");
        assert_eq!(v.dwz(T_WRITE_ZEROES, &segs), S_UNSUPP, "{n} segments");
    }
    assert_eq!(v.req(T_DISCARD, 0, &[]).0, S_IOERR, "no segments");
    assert_eq!(
        v.req(T_DISCARD, 0, &[d(SCRATCH, 20, 0)]).0,
        S_IOERR,
        "20 bytes of segments"
    );
    assert_eq!(
        v.req(T_WRITE_ZEROES, 0, &[d(SCRATCH, 16, F_WRITE)]).0,
        S_IOERR,
        "writable segments"
    );
    assert_eq!(
        v.req(T_DISCARD, 0, &[d(GAP, 16, 0)]).0,
        S_IOERR,
        "segments outside RAM"
    );
    assert_eq!(
        sector_data(&mut v, 0, 4 * PAGE),
        data,
        "a failed discard changed data"
    );

    // Exactly the limit (256 segments) works, and zero-length segments too.
    let mut segs = vec![(0u64, 0u32, 0u32); 255];
    segs.push((8, 8, 0));
    assert_eq!(v.dwz(T_DISCARD, &segs), S_OK);
    assert_eq!(v.dwz(T_WRITE_ZEROES, &[(17, 3, 1)]), S_OK);
    let mut want = data.clone();
    want[PAGE..2 * PAGE].fill(0);
    want[17 * 512..20 * 512].fill(0);
    assert_eq!(sector_data(&mut v, 0, 4 * PAGE), want);
    drop(v);
    fx.check_victim();
}

// ---------------------------------------------------------------------------
// Ring set-up out of order
// ---------------------------------------------------------------------------

#[test]
fn kicks_before_the_ring_is_enabled_or_has_addresses() {
    let mut fx = fixture("kick", "");

    // Not enabled: a kick does nothing until SET_VRING_ENABLE.
    let mut v = RawDev::connect_with(
        &fx.victim,
        Ram::standard(),
        Setup {
            enable: false,
            ..Setup::default()
        },
    );
    let data = noise(61, PAGE);
    post_write(&mut v, 16, &data);
    assert!(v.quiet_for(QUIET), "a ring that is not enabled was served");
    assert_eq!(v.ram.u8_at(STATUS), UNTOUCHED);
    v.fe.set_vring_enable(0, true).expect("enable");
    v.kick();
    assert_eq!(v.wait(), Used { id: 0, len: 1 });
    assert_eq!(v.ram.u8_at(STATUS), S_OK);
    assert_eq!(sector_data(&mut v, 16, PAGE), data);

    // Disabled again: kicks are ignored again.
    v.fe.set_vring_enable(0, false).expect("disable");
    post_write(&mut v, 24, &noise(62, PAGE));
    assert!(v.quiet_for(QUIET), "a disabled ring was served");
    drop(v);
    fx.check();

    // Kicks before SET_VRING_ADDR (ring enabled, addresses never given):
    // nothing happens; once the addresses come, the request is served.
    let mut v = RawDev::connect_with(
        &fx.victim,
        Ram::standard(),
        Setup {
            set_addr: false,
            ..Setup::default()
        },
    );
    // Junk where a ring at guest address 0 would be.
    v.ram.write(0, &[0xff; 0x1000]);
    let data = noise(63, PAGE);
    post_write(&mut v, 32, &data);
    for _ in 0..3 {
        v.kick();
    }
    assert!(v.quiet_for(QUIET), "a ring without addresses was served");
    assert_eq!(v.ram.u8_at(STATUS), UNTOUCHED);
    let cfg = v.vring_config(v.queue_size);
    v.fe.set_vring_addr(0, &cfg).expect("SET_VRING_ADDR");
    v.kick();
    assert_eq!(v.wait(), Used { id: 0, len: 1 });
    assert_eq!(v.ram.u8_at(STATUS), S_OK);
    assert_eq!(sector_data(&mut v, 32, PAGE), data);
    drop(v);
    fx.check();

    // Kicks before SET_MEM_TABLE: no guest memory at all.
    let mut v = RawDev::handshake(&fx.victim, Ram::standard());
    v.queue_size = 256;
    v.fe.set_vring_num(0, 256).unwrap();
    v.fe.set_vring_call(0, &v.call).unwrap();
    v.fe.set_vring_kick(0, &v.kick).unwrap();
    v.fe.set_vring_enable(0, true).unwrap();
    for _ in 0..3 {
        v.kick();
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(v.quiet_for(QUIET));
    // Ring addresses without any memory table: refused.
    let res = v.fe.set_vring_addr(0, &v.vring_config(256));
    assert_refused_msg(&mut v, res, "SET_VRING_ADDR before SET_MEM_TABLE");
    drop(v);
    fx.check_victim();
}

/// A device with guest RAM and a queue size, but no ring addresses yet.
fn before_vring_addr(fx: &Fx) -> RawDev {
    let mut v = RawDev::handshake(&fx.victim, Ram::standard());
    let table = v.ram.table();
    v.fe.set_mem_table(&table).unwrap();
    v.queue_size = 256;
    v.fe.set_vring_num(0, 256).unwrap();
    v
}

#[test]
fn garbage_ring_addresses() {
    let mut fx = fixture("ringaddr", "");
    let low_end = LOW.0 + LOW.1 as u64;

    // Addresses that are no guest memory at all, or misaligned: refused.
    type Bend = fn(&mut VringConfigData);
    let cases: [(&str, Bend); 5] = [
        ("desc not in RAM", |c| c.desc_table_addr = 0x10),
        ("avail not in RAM", |c| c.avail_ring_addr = u64::MAX - 1),
        ("used not in RAM", |c| c.used_ring_addr = 0x20),
        ("misaligned desc", |c| c.desc_table_addr += 1),
        ("misaligned used", |c| c.used_ring_addr += 2),
    ];
    for (what, bend) in cases {
        let mut v = before_vring_addr(&fx);
        let mut cfg = v.vring_config(256);
        bend(&mut cfg);
        let res = v.fe.set_vring_addr(0, &cfg);
        assert_refused_msg(&mut v, res, what);
        drop(v);
        fx.alive();
    }
    // Queue sizes of zero and past the maximum.
    for n in [0u16, 4096] {
        let mut v = before_vring_addr(&fx);
        let res = v.fe.set_vring_num(0, n);
        assert_refused_msg(&mut v, res, &format!("queue size {n}"));
    }
    // A queue index the device does not have.
    let mut v = before_vring_addr(&fx);
    let res = v.fe.set_vring_num(0, 256);
    assert!(res.is_ok());
    v.send_raw(&raw_msg(
        code::SET_VRING_NUM,
        1 | 8,
        8,
        &[7, 0, 0, 0, 0, 1, 0, 0],
    ));
    assert!(matches!(
        fate(&mut v.raw, Duration::from_secs(3)),
        Fate::Dropped(_)
    ));
    drop(v);
    fx.check();

    // Rings that start in guest memory and run off its end: only the start
    // is translated, so this is accepted, but such a ring is never served.
    let mut v = before_vring_addr(&fx);
    let mut edge = v.vring_config(256);
    edge.desc_table_addr = v.ram.host_addr(low_end - 16);
    edge.avail_ring_addr = v.ram.host_addr(low_end - 2);
    v.fe.set_vring_addr(0, &edge)
        .expect("a ring that starts in RAM is accepted");
    v.fe.set_vring_base(0, 0).unwrap();
    v.fe.set_vring_call(0, &v.call).unwrap();
    v.fe.set_vring_kick(0, &v.kick).unwrap();
    v.fe.set_vring_enable(0, true).unwrap();
    v.ram.write(low_end - 2, &[0xff, 0xff]);
    for _ in 0..3 {
        v.kick();
    }
    assert!(v.quiet_for(QUIET), "a ring off the end of RAM was served");
    // The used ring at the very end, the avail ring fine: requests are
    // taken, but their completions cannot be written.
    drop(v);
    let mut v = before_vring_addr(&fx);
    let mut edge = v.vring_config(256);
    edge.used_ring_addr = v.ram.host_addr(low_end - 4);
    v.fe.set_vring_addr(0, &edge)
        .expect("a used ring that starts in RAM is accepted");
    v.fe.set_vring_base(0, 0).unwrap();
    v.fe.set_vring_call(0, &v.call).unwrap();
    v.fe.set_vring_kick(0, &v.kick).unwrap();
    v.fe.set_vring_enable(0, true).unwrap();
    post_write(&mut v, 8, &noise(8, PAGE));
    assert!(v.quiet_for(QUIET), "a completion past the end of RAM");
    drop(v);
    fx.check_victim();
}
