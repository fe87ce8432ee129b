//! Hostile vhost-user frontends against the real daemon (issue 6): guest
//! memory tables changed, shrunk and lied about, during I/O too.
//! The fixture and the checks after each hostile request are in
//! `tests/support/hostile.rs`; `hostile.rs` says what every test proves.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vhost::vhost_user::VhostUserFrontend;
use vhost::{VhostBackend, VhostUserMemoryRegionInfo};
use vmm_sys_util::eventfd::EventFd;
use vzram_tests::frontend::*;
use vzram_tests::hostile::*;
use vzram_tests::*;

#[test]
fn mem_tables_with_bad_regions() {
    let mut fx = fixture("memtable", "");
    let mut v = fx.raw();
    let data = noise(81, PAGE);
    assert_eq!(v.write(8, &data), S_OK);

    // Overlapping guest addresses, the same region twice, a region whose
    // guest range wraps around: refused, and the connection dropped.
    type Bend = fn(&mut Vec<VhostUserMemoryRegionInfo>);
    let cases: [(&str, Bend); 3] = [
        ("overlapping regions", |t| t[1].guest_phys_addr = 1 << 20),
        ("a region twice", |t| t[1] = t[0]),
        ("a wrapping region", |t| {
            t[1].guest_phys_addr = u64::MAX - 4096
        }),
    ];
    for (what, bend) in cases {
        // (The fds in a table belong to that connection's RAM.)
        let mut t = v.ram.table();
        bend(&mut t);
        let res = v.fe.set_mem_table(&t);
        assert_refused_msg(&mut v, res, what);
        drop(v);
        fx.check();
        v = fx.raw();
        assert_eq!(sector_data(&mut v, 8, PAGE), data);
    }
    // A region whose fd cannot be mapped at all (an eventfd): refused,
    // or the connection dropped; the daemon stays.
    let mut bad = v.ram.table();
    let efd = EventFd::new(0).unwrap();
    bad.push(VhostUserMemoryRegionInfo {
        guest_phys_addr: 1 << 30,
        memory_size: 1 << 20,
        userspace_addr: 1 << 44,
        mmap_offset: 0,
        mmap_handle: efd.as_raw_fd(),
    });
    let res = v.fe.set_mem_table(&bad);
    assert_refused_msg(&mut v, res, "an eventfd as guest RAM");
    drop(v);
    fx.check_victim();
    let v = fx.raw();
    // 32 regions of 4 KiB each, the most one message can carry: fine.
    let fd = v.ram.table()[0].mmap_handle;
    let many: Vec<VhostUserMemoryRegionInfo> = (0..32u64)
        .map(|i| VhostUserMemoryRegionInfo {
            guest_phys_addr: (64 << 20) + i * 0x2000,
            memory_size: 0x1000,
            userspace_addr: (1 << 44) + i * 0x2000,
            mmap_offset: 0,
            mmap_handle: fd,
        })
        .collect();
    v.fe.set_mem_table(&many).expect("32 regions");
    drop(v);
    fx.check_victim();
}

#[test]
fn mem_table_replaced_during_io() {
    let mut fx = fixture("swap", "");
    let mut v = fx.raw();
    let table = v.ram.table();

    // 1. The same table sent again and again while I/O runs: every request
    //    is served and every byte lands.
    let fe = v.fe.clone();
    let t2 = table.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let swaps = Arc::new(AtomicU64::new(0));
    let swaps2 = swaps.clone();
    let spammer = std::thread::spawn(move || {
        while !stop2.load(Ordering::Relaxed) {
            fe.set_mem_table(&t2).expect("SET_MEM_TABLE again");
            swaps2.fetch_add(1, Ordering::Relaxed);
        }
    });
    // At least 150 write/read pairs, and until 50 tables have been swapped.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut i = 0u64;
    while i < 150 || swaps.load(Ordering::Relaxed) < 50 {
        assert!(Instant::now() < deadline, "too slow");
        let page = noise(1000 + i, PAGE);
        assert_eq!(v.write(8 * (i % 50), &page), S_OK, "write {i}");
        assert_eq!(v.read(8 * (i % 50), PAGE), (S_OK, page), "read {i}");
        i += 1;
    }
    stop.store(true, Ordering::Relaxed);
    spammer.join().unwrap();

    // 2. 32 writes in flight (data in the high region), then a table
    //    without the high region. Each write is done (OK) or refused
    //    (IOERR); none hangs; what was OK is on disk, the rest is not.
    let base = 4096u64; // sector
    for i in 0..32u64 {
        let page = noise(2000 + i, PAGE);
        v.ram.write(DATA + i * PAGE as u64, &page);
        v.header(HDR + 16 * i, T_OUT, base + 8 * i);
        v.ram.write(STATUS + i, &[UNTOUCHED]);
        let idx = 3 * i as u16;
        v.chain(
            idx,
            &[
                d(HDR + 16 * i, 16, 0),
                d(DATA + i * PAGE as u64, 4096, 0),
                d(STATUS + i, 1, F_WRITE),
            ],
        );
        v.publish(idx);
    }
    v.kick();
    v.fe.set_mem_table(&table[..1]).expect("a smaller table");
    let mut ok = Vec::new();
    for _ in 0..32 {
        let u = v.wait();
        let i = u64::from(u.id) / 3;
        match v.ram.u8_at(STATUS + i) {
            S_OK => ok.push(i),
            S_IOERR => {}
            st => panic!("write {i}: status {st}"),
        }
    }
    // Now data in the high region is no guest memory: IOERR.
    assert_eq!(v.write(0, &noise(3, PAGE)), S_IOERR);
    // Data in the low region still works.
    let low = noise(4, PAGE);
    v.ram.write(DATA_LO, &low);
    assert_eq!(v.req(T_OUT, 0, &[d(DATA_LO, 4096, 0)]).0, S_OK);
    // Back to the full table.
    v.fe.set_mem_table(&table).expect("the full table again");
    for i in 0..32u64 {
        let want = if ok.contains(&i) {
            noise(2000 + i, PAGE)
        } else {
            vec![0; PAGE]
        };
        assert_eq!(v.read(base + 8 * i, PAGE), (S_OK, want), "write {i}");
    }
    assert_eq!(v.read(0, PAGE), (S_OK, low));
    drop(v);
    fx.check_victim();
}

#[test]
fn mem_slots_added_and_removed_during_io() {
    let mut fx = fixture("slots", "");
    let mut v = fx.raw();
    let table = v.ram.table();
    let data = noise(91, PAGE);
    assert_eq!(v.write(8, &data), S_OK);

    // The data region taken away: buffers there are no guest memory.
    v.fe.remove_mem_region(&table[1]).expect("REM_MEM_REG");
    assert_eq!(v.write(16, &noise(92, PAGE)), S_IOERR);
    v.fe.add_mem_region(&table[1]).expect("ADD_MEM_REG");
    assert_eq!(v.read(8, PAGE), (S_OK, data.clone()));
    assert_eq!(v.read(16, PAGE), (S_OK, vec![0; PAGE]));

    // Taken away under 32 writes in flight: each is done or refused.
    for i in 0..32u64 {
        let page = noise(3000 + i, PAGE);
        v.ram.write(DATA + i * PAGE as u64, &page);
        v.header(HDR + 16 * i, T_OUT, 4096 + 8 * i);
        v.ram.write(STATUS + i, &[UNTOUCHED]);
        let idx = 3 * i as u16;
        v.chain(
            idx,
            &[
                d(HDR + 16 * i, 16, 0),
                d(DATA + i * PAGE as u64, 4096, 0),
                d(STATUS + i, 1, F_WRITE),
            ],
        );
        v.publish(idx);
    }
    v.kick();
    v.fe.remove_mem_region(&table[1]).expect("REM_MEM_REG");
    let mut ok = Vec::new();
    for _ in 0..32 {
        let u = v.wait();
        let i = u64::from(u.id) / 3;
        match v.ram.u8_at(STATUS + i) {
            S_OK => ok.push(i),
            S_IOERR => {}
            st => panic!("write {i}: status {st}"),
        }
    }
    v.fe.add_mem_region(&table[1]).expect("ADD_MEM_REG");
    for i in 0..32u64 {
        let want = if ok.contains(&i) {
            noise(3000 + i, PAGE)
        } else {
            vec![0; PAGE]
        };
        assert_eq!(v.read(4096 + 8 * i, PAGE), (S_OK, want), "write {i}");
    }

    // Removing a region that is not there, adding one over another:
    // refused, connection dropped.
    let mut ghost = table[1];
    ghost.guest_phys_addr = 1 << 34;
    let res = v.fe.remove_mem_region(&ghost);
    assert_refused_msg(&mut v, res, "removing a region that is not there");
    drop(v);
    let mut v = fx.raw();
    let mut over = v.ram.table()[1];
    over.guest_phys_addr = HIGH.0 + 0x1000;
    let res = v.fe.add_mem_region(&over);
    assert_refused_msg(&mut v, res, "a region over another");
    drop(v);
    fx.check();

    // The region that holds the ring itself taken away, with requests
    // queued: the ring is not served any more; nothing breaks.
    let mut v = fx.raw();
    let table = v.ram.table();
    post_write(&mut v, 24, &noise(93, PAGE));
    let u = v.wait();
    assert_eq!((u.id, v.ram.u8_at(STATUS)), (0, S_OK), "write before");
    v.fe.remove_mem_region(&table[0]).expect("REM_MEM_REG");
    post_write(&mut v, 32, &noise(94, PAGE));
    assert!(
        v.quiet_for(QUIET),
        "a ring whose region was removed was served"
    );
    drop(v);
    fx.check_victim();
    let mut v = fx.raw();
    assert_eq!(v.read(24, PAGE), (S_OK, noise(93, PAGE)), "write before");
    assert_eq!(v.read(32, PAGE), (S_OK, vec![0; PAGE]), "write after");
}

/// Guest memory regions larger than the file behind them (a 1 MiB memfd
/// here) must be refused: otherwise one frontend could take nearly all of
/// the daemon's virtual address space with one SET_MEM_TABLE, and nothing
/// else in the daemon could map memory (thread stacks, allocations).
#[test]
fn huge_mem_regions_do_not_starve_other_devices() {
    let mut fx = fixture("hog", "");
    let file = memfd(1 << 20);
    let layout = |sizes: &[u64]| -> Vec<VhostUserMemoryRegionInfo> {
        let mut gpa = 1u64 << 30;
        sizes
            .iter()
            .map(|&size| {
                let r = VhostUserMemoryRegionInfo {
                    guest_phys_addr: gpa,
                    memory_size: size,
                    userspace_addr: gpa,
                    mmap_offset: 0,
                    mmap_handle: file.as_raw_fd(),
                };
                gpa += size;
                r
            })
            .collect()
    };
    // Every region larger than its file is refused, from 2 MiB to 64 TiB,
    // by SET_MEM_TABLE and by ADD_MEM_REG alike, and the connection dropped.
    for shift in 21..=46 {
        let mut v = RawDev::handshake(&fx.victim, Ram::new(&[(0, 4096)]));
        let res = v.fe.set_mem_table(&layout(&[1 << shift]));
        assert_refused_msg(&mut v, res, &format!("a 2^{shift} byte region"));
    }
    // A region the file does hold is accepted: the refusal is about size.
    let mut v = RawDev::handshake(&fx.victim, Ram::new(&[(0, 4096)]));
    v.fe.set_mem_table(&layout(&[1 << 20]))
        .expect("a region as large as its file");
    let res = v.fe.add_mem_region(&layout(&[1 << 20, 2 << 20])[1]);
    assert_refused_msg(&mut v, res, "ADD_MEM_REG of a region past its file");
    drop(v);
    // Everyone else does not notice.
    fx.check();
    fx.other.reconnect();
    fx.check();
    fx.check_victim();
}

/// A request the guest publishes after SET_MEM_TABLE was acked must be
/// served with the new table, even while the queue thread is busy with
/// earlier ones (it once kept one snapshot per wake-up, which failed such
/// requests with IOERR, and now and then blkio's first write too).
#[test]
fn requests_after_a_mem_table_change_see_the_new_table() {
    let mut fx = fixture("stale", "");
    let extra = (64u64 << 20, 1usize << 20);
    let ram = Ram::new(&[LOW, HIGH, extra]);
    let mut v = RawDev::handshake(&fx.victim, ram);
    let table = v.ram.table();
    v.fe.set_mem_table(&table[..2]).expect("SET_MEM_TABLE");
    v.setup_vring(Setup {
        queue_size: 1024,
        ..Setup::default()
    });
    // Keep the queue thread busy: 600 writes of 1 MiB of noise, each one
    // descriptor (an indirect table of three).
    let n = 600u64;
    v.ram.write(DATA, &noise(5, 1 << 20));
    v.header(HDR, T_OUT, 8192);
    for i in 0..n {
        let t = SCRATCH + 64 * i;
        v.indirect_table(
            t,
            &[
                d(HDR, 16, 0),
                d(DATA, 1 << 20, 0),
                d(STATUS + i, 1, F_WRITE),
            ],
        );
        v.set_desc(i as u16, d(t, 48, F_INDIRECT));
        v.publish(i as u16);
    }
    v.kick();
    let first = v.wait();
    assert_eq!(first.len, 1);
    // Now add the third region, and once that is acked, use it.
    v.fe.set_mem_table(&table)
        .expect("SET_MEM_TABLE with a new region");
    let page = noise(6, PAGE);
    v.ram.write(extra.0, &page);
    v.header(HDR + 16, T_OUT, 4096);
    v.ram.write(STATUS + 1000, &[UNTOUCHED]);
    let head = v.chain(
        n as u16,
        &[
            d(HDR + 16, 16, 0),
            d(extra.0, PAGE as u32, 0),
            d(STATUS + 1000, 1, F_WRITE),
        ],
    );
    v.publish(head);
    v.kick();
    let mut still_busy = false;
    for _ in 1..n {
        v.wait();
        still_busy |= v.used_idx() != v.avail_idx();
    }
    assert_eq!(
        v.wait(),
        Used {
            id: u32::from(head),
            len: 1
        }
    );
    assert!(
        still_busy,
        "the queue thread was not busy; this proved nothing"
    );
    assert_eq!(
        v.ram.u8_at(STATUS + 1000),
        S_OK,
        "a request published after the new table was acked did not see it"
    );
    assert_eq!(v.read(4096, PAGE), (S_OK, page));
    drop(v);
    fx.check_victim();
}

/// A memory region larger than the file behind it must be refused: the
/// mapping succeeds past EOF, and the first access there would raise
/// SIGBUS, killing the daemon and every other guest's disk with it.
#[test]
fn mem_region_past_the_end_of_its_file() {
    let mut fx = fixture("sigbus", "");
    let mut v = RawDev::handshake(&fx.victim, Ram::standard());
    let mut table = v.ram.table();
    // Region 1 claims 64 MiB; its memfd has 8 MiB.
    table[1].memory_size = 64 << 20;
    let res = v.fe.set_mem_table(&table);
    assert_refused_msg(&mut v, res, "a region past the end of its file");
    drop(v);
    fx.check_victim();
}

/// The same with a file that shrinks after SET_MEM_TABLE: the worker serving
/// it dies of SIGBUS, the victim device on the same daemon notices nothing.
#[test]
fn mem_file_truncated_under_the_daemon() {
    let mut fx = fixture("shrink", "");
    let mut v = fx.raw();
    assert_eq!(v.write(0, &noise(1, PAGE)), S_OK);
    v.truncate_memory_and_kick();
    let _ = v.wait_for(Duration::from_secs(2));
    drop(v);
    fx.check_victim();
}
