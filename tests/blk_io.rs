//! The real `vzram` daemon, driven over vhost-user-blk by the blkio crate
//! (driver `virtio-blk-vhost-user`), the way QEMU or cloud-hypervisor use it.

use vzram_tests::*;

const PAGE: u64 = 4096;
const EIO: i32 = -libc::EIO;

/// One device with `queues` queues and a client connected to all of them.
fn one_device(tag: &str, size: &str, queues: usize, extra: &[&str]) -> (TempDir, Daemon, Client) {
    let dir = TempDir::new(tag);
    let sock = dir.join("d.sock");
    let q = queues.to_string();
    let mut args = vec!["--socket", s(&sock), "--size", size, "--queues", &q];
    args.extend_from_slice(extra);
    let d = Daemon::start(&dir, &args, &[&sock]);
    let c =
        Client::connect(&sock, queues).unwrap_or_else(|e| panic!("connect: {e}\n{}", d.log_text()));
    (dir, d, c)
}

#[test]
fn capacity_queues_and_block_size_as_the_client_sees_them() {
    let (dir, d, c) = one_device("geom", "96M", 3, &[]);
    let b = &c.blkio;
    assert_eq!(c.capacity(), 96 * MIB);
    assert_eq!(b.get_i32("max-queues").unwrap(), 3);
    assert_eq!(
        b.get_i32("request-alignment").unwrap(),
        4096,
        "logical block size"
    );
    assert_eq!(
        b.get_i32("optimal-io-alignment").unwrap(),
        4096,
        "physical block size"
    );
    assert_eq!(b.get_i32("optimal-io-size").unwrap(), 4096);
    assert_eq!(b.get_i32("max-segments").unwrap(), 254);
    assert_eq!(b.get_i32("discard-alignment").unwrap(), 4096);
    assert!(
        b.get_u64("max-discard-len").unwrap() >= 64 * MIB,
        "discard limit must be real"
    );
    assert!(
        b.get_u64("max-write-zeroes-len").unwrap() >= 64 * MIB,
        "write-zeroes limit must be real"
    );
    assert!(b.get_bool("flush-needed").unwrap(), "FLUSH is offered");
    drop(c);

    // More queues than the device has is refused at start.
    let sock = dir.join("d.sock");
    assert!(Client::connect(&sock, 4).is_err());
    let mut c = Client::connect(&sock, 1).expect("fewer queues are fine");
    c.q(0).flush().unwrap();
    let st = d.stat();
    assert_eq!(st.devices()[0].queues, 3);
    assert_eq!(st.devices()[0].size_bytes, 96 * MIB);
}

#[test]
fn write_and_verify_across_all_queues_in_parallel() {
    let queues = 4;
    let (_dir, d, mut c) = one_device("par", "64M", queues, &[]);
    let region = 16 * MIB;
    std::thread::scope(|sc| {
        for (qi, q) in c.queues.iter_mut().enumerate() {
            sc.spawn(move || {
                let base = qi as u64 * region;
                let mut rng = Rng::new(qi as u64 + 1);
                let mut off = 0;
                // Requests of 4 KiB to 256 KiB until the region is full.
                while off < region {
                    let len = ((rng.below(64) + 1) * PAGE).min(region - off);
                    q.write(base + off, &pattern(qi as u64, base + off, len as usize))
                        .unwrap();
                    off += len;
                }
                for chunk in 0..region / MIB {
                    let at = base + chunk * MIB;
                    assert_eq!(
                        q.read(at, MIB as usize).unwrap(),
                        pattern(qi as u64, at, MIB as usize),
                        "queue {qi}"
                    );
                }
            });
        }
    });
    // Every queue reads what the others wrote.
    std::thread::scope(|sc| {
        for (qi, q) in c.queues.iter_mut().enumerate() {
            sc.spawn(move || {
                let other = (qi + 1) % queues;
                let base = other as u64 * region;
                for chunk in 0..region / MIB {
                    let at = base + chunk * MIB;
                    let got = q.read(at, MIB as usize).unwrap();
                    assert!(
                        got == pattern(other as u64, at, MIB as usize),
                        "queue {qi} reading {other}'s data at {at}"
                    );
                }
            });
        }
    });
    let st = d.stat();
    assert_eq!(st.sole().stats.orig_data_size, 64 * MIB);
    assert_eq!(
        st.sole().stats.failed_writes + st.sole().stats.failed_reads,
        0
    );
}

#[test]
fn unaligned_and_sub_page_io_match_an_in_memory_model() {
    let (_dir, _d, mut c) = one_device("unal", "4M", 2, &[]);
    let span = 2 * MIB as usize;
    let mut model = vec![0u8; span];
    let mut rng = Rng::new(42);
    for i in 0..400u64 {
        let sectors = rng.below(24) + 1;
        let sector = rng.below(span as u64 / 512 - sectors);
        let (off, len) = (sector * 512, (sectors * 512) as usize);
        let q = c.q((i % 2) as usize);
        match rng.below(10) {
            0..=4 => {
                let data = pattern(i + 100, off, len);
                q.write(off, &data).unwrap();
                model[off as usize..off as usize + len].copy_from_slice(&data);
            }
            5..=6 if len >= 1024 => {
                // Scattered over three descriptors, split at odd sectors.
                let data = pattern(i + 100, off, len);
                let a = 512 * (1 + rng.below(len as u64 / 512 - 1)) as usize;
                let b = a + (len - a) / 1024 * 512;
                q.writev(off, &[&data[..a], &data[a..b], &data[b..]])
                    .unwrap();
                model[off as usize..off as usize + len].copy_from_slice(&data);
            }
            _ => {
                let got = q.read(off, len).unwrap();
                assert!(
                    got == model[off as usize..off as usize + len],
                    "op {i}: read {len} bytes at {off} differs"
                );
            }
        }
    }
    // 512-byte writes at odd sectors, and writes spanning page boundaries.
    for (sector, sectors) in [(1u64, 1u64), (7, 2), (15, 3), (4087, 2), (23, 17), (3, 1)] {
        let (off, len) = (sector * 512, (sectors * 512) as usize);
        let data = pattern(sector, off, len);
        c.q(0).write(off, &data).unwrap();
        model[off as usize..off as usize + len].copy_from_slice(&data);
    }
    for chunk in 0..span / MIB as usize {
        let at = chunk * MIB as usize;
        assert!(
            c.q(1).read(at as u64, MIB as usize).unwrap() == model[at..at + MIB as usize],
            "final compare, MiB {chunk}"
        );
    }
    // The rest of the disk was never written.
    assert!(c
        .q(0)
        .read(span as u64, MIB as usize)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
}

#[test]
fn queues_writing_sectors_of_the_same_pages_do_not_lose_each_others_bytes() {
    let queues = 4;
    let (_dir, _d, mut c) = one_device("rmw", "8M", queues, &[]);
    let pages = 256u64;
    std::thread::scope(|sc| {
        for (qi, q) in c.queues.iter_mut().enumerate() {
            sc.spawn(move || {
                // Queue qi owns sectors qi and qi+4 of every page.
                for p in 0..pages {
                    for s in [qi as u64, qi as u64 + 4] {
                        let off = p * PAGE + s * 512;
                        q.write(off, &pattern(7, off, 512)).unwrap();
                    }
                }
            });
        }
    });
    let len = (pages * PAGE) as usize;
    assert!(
        c.q(0).read(0, len).unwrap() == pattern(7, 0, len),
        "a read-modify-write lost a sector"
    );
}

#[test]
fn discard_and_write_zeroes_read_back_zeros_and_free_memory() {
    let (_dir, d, mut c) = one_device("dwz", "64M", 2, &[]);
    let total = 32 * MIB;
    for chunk in 0..total / (4 * MIB) {
        let at = chunk * 4 * MIB;
        c.q(0).write(at, &pattern(3, at, 4 * MIB as usize)).unwrap();
    }
    // Staged pages compressed: memory is what it stays.
    let before = d.settled();
    assert_eq!(before.sole().stats.orig_data_size, total);

    // Discard 24 MiB in the middle: zeros, and 6144 fewer pages stored.
    c.q(1).discard(4 * MIB, 24 * MIB).unwrap();
    assert!(c
        .q(0)
        .read(4 * MIB, 4 * MIB as usize)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    assert!(c
        .q(0)
        .read(24 * MIB, 4 * MIB as usize)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    assert_eq!(
        c.q(0).read(0, 4 * MIB as usize).unwrap(),
        pattern(3, 0, 4 * MIB as usize)
    );
    let after = d.settled();
    assert_eq!(after.sole().stats.orig_data_size, 8 * MIB);
    assert!(after.sole().stats.discards >= 6144);
    let (used_before, used_after) = (
        before.sole().stats.mem_used_total,
        after.sole().stats.mem_used_total,
    );
    assert!(
        used_after < used_before / 2,
        "memory not freed: {used_before} -> {used_after}"
    );
    assert!(after.pool().mem_used_total < before.pool().mem_used_total);

    // Write-zeroes over an unaligned range inside the remaining data.
    let (zoff, zlen) = (29 * MIB + 3 * 512, MIB + 5 * 512);
    c.q(1).write_zeroes(zoff, zlen).unwrap();
    let mut model = pattern(3, 28 * MIB, 4 * MIB as usize);
    let rel = (zoff - 28 * MIB) as usize;
    model[rel..rel + zlen as usize].fill(0);
    assert!(
        c.q(0).read(28 * MIB, 4 * MIB as usize).unwrap() == model,
        "write-zeroes touched the wrong bytes"
    );
    let z = d.stat();
    assert!(z.sole().stats.orig_data_size < 8 * MIB);

    // A discard of a partial page zeroes just that part.
    c.q(0).discard(512, 1024).unwrap();
    let mut head = pattern(3, 0, PAGE as usize);
    head[512..1536].fill(0);
    assert_eq!(c.q(1).read(0, PAGE as usize).unwrap(), head);

    // Compaction via the control socket runs and leaves data alone.
    let _: Compacted = d.request(json!({"cmd": "compact"}));
    assert_eq!(c.q(1).read(0, PAGE as usize).unwrap(), head);
}

#[test]
fn out_of_range_requests_get_errors_and_change_nothing() {
    let (_dir, d, mut c) = one_device("oor", "16M", 1, &[]);
    let end = 16 * MIB;
    let last = pattern(9, end - PAGE, PAGE as usize);
    let q = c.q(0);
    q.write(end - PAGE, &last).unwrap();
    assert_eq!(q.read(end, 512), Err(EIO));
    assert_eq!(q.read(end - 512, 1024), Err(EIO));
    assert_eq!(q.write(end - PAGE, &[1; 8192]), Err(EIO));
    assert_eq!(q.write(1 << 50, &[1; 4096]), Err(EIO));
    assert_eq!(q.discard(end - PAGE, 2 * PAGE), Err(EIO));
    assert_eq!(q.write_zeroes(end, PAGE), Err(EIO));
    // Nothing was changed by the failed requests.
    assert_eq!(q.read(end - PAGE, PAGE as usize).unwrap(), last);
    assert_eq!(q.read(end - 512, 512).unwrap(), last[PAGE as usize - 512..]);
    let st = d.stat();
    assert_eq!(st.sole().stats.orig_data_size, PAGE);
    // The guest's own mistakes are the guest's to hear of, not the log's.
    assert!(!d.log_text().contains("request failed"), "{}", d.log_text());
}

#[test]
fn read_only_device() {
    let dir = TempDir::new("ro");
    let sock = dir.join("ro.sock");
    let d = Daemon::start(
        &dir,
        &[
            "--socket",
            s(&sock),
            "--size",
            "8M",
            "--readonly",
            "--queues",
            "1",
        ],
        &[&sock],
    );
    // What the daemon advertises: blkio reads VIRTIO_BLK_F_RO from the
    // features the daemon offers, refuses a read-write start and reports
    // the device as read-only.
    assert!(
        Client::connect(&sock, 1).is_err(),
        "a read-write start succeeded: VIRTIO_BLK_F_RO was not offered"
    );
    let mut c = Client::connect_with(&sock, 1, true).unwrap();
    assert!(c.blkio.get_bool("read-only").unwrap());
    // Writes are not tried here: blkio refuses them itself on a read-only
    // device, so they would never reach the daemon. A write, discard and
    // write-zeroes that do reach it are in tests/hostile.rs
    // (`writes_to_a_read_only_device_fail`) and tests/config_behaviour.rs
    // (`readonly_refuses_writes_that_reach_the_daemon`).
    let q = c.q(0);
    assert!(q.read(0, 8192).unwrap().iter().all(|&b| b == 0));
    q.flush().unwrap();
    let st = d.stat();
    assert!(
        st.sole().stats.reads >= 1,
        "the read did not reach the daemon"
    );
    assert_eq!(st.sole().stats.orig_data_size, 0);
    assert!(st.devices()[0].readonly, "{st}");
}

#[test]
fn two_devices_under_a_host_limit_stay_isolated_and_hit_the_limit() {
    let dir = TempDir::new("host");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let spec_a = format!("socket={},size=64M,queues=2,name=a", s(&a));
    let spec_b = format!("socket={},size=64M,queues=1,name=b,algo=zstd", s(&b));
    let d = Daemon::start(
        &dir,
        &[
            "--device",
            &spec_a,
            "--device",
            &spec_b,
            "--host-mem-limit",
            "6M",
        ],
        &[&a, &b],
    );
    let mut ca = Client::connect(&a, 2).unwrap();
    let mut cb = Client::connect(&b, 1).unwrap();

    // B gets 1 MiB of incompressible data first.
    let b_data = noise(1, MIB as usize);
    cb.q(0).write(0, &b_data).unwrap();
    // Same offsets on A hold different data: the devices are separate disks.
    let a_first = noise(2, PAGE as usize);
    ca.q(0).write(0, &a_first).unwrap();
    assert_eq!(cb.q(0).read(0, MIB as usize).unwrap(), b_data);

    // Fill A with incompressible pages until the host limit refuses.
    let mut failed_at = None;
    for p in 1..16 * MIB / PAGE {
        match ca
            .q((p % 2) as usize)
            .write(p * PAGE, &noise(p + 10, PAGE as usize))
        {
            Ok(()) => {}
            Err(e) => {
                assert_eq!(e, EIO, "a write over the limit gets IOERR");
                failed_at = Some(p);
                break;
            }
        }
    }
    let p = failed_at.expect("the 6 MiB host limit was never hit by 16 MiB of writes");
    assert!(
        p * PAGE > 3 * MIB && p * PAGE < 7 * MIB,
        "limit hit after {} KiB",
        p * PAGE / 1024
    );
    // The failed page keeps its old content (never written: zeros), and so
    // does an overwrite that fails.
    assert!(ca
        .q(0)
        .read(p * PAGE, PAGE as usize)
        .unwrap()
        .iter()
        .all(|&x| x == 0));
    if ca.q(0).write(0, &noise(99, PAGE as usize)).is_err() {
        assert_eq!(
            ca.q(0).read(0, PAGE as usize).unwrap(),
            a_first,
            "a failed overwrite changed data"
        );
    }
    // Everything written before is intact, on both devices.
    for q in 1..p {
        assert_eq!(
            ca.q(1).read(q * PAGE, PAGE as usize).unwrap(),
            noise(q + 10, PAGE as usize),
            "A page {q}"
        );
    }
    assert_eq!(cb.q(0).read(0, MIB as usize).unwrap(), b_data);

    // The operator hears of a write the host refused (the guest only sees
    // EIO), once a second however many fail.
    assert!(
        d.wait_log("request failed: host memory limit reached"),
        "no warning of the refused write:\n{}",
        d.log_text()
    );
    let st = d.stat();
    assert!(st.counters("a").failed_writes >= 1);
    assert_eq!(st.counters("b").failed_writes, 0);
    assert!(st.pool().mem_used_total <= 6 * MIB);
    assert_eq!(st.pool().mem_limit, 6 * MIB);

    // Freeing A lets B write again; raising the limit lets A write again.
    ca.q(0).discard(0, 16 * MIB).unwrap();
    cb.q(0).write(MIB, &noise(3, MIB as usize)).unwrap();
    let r: HostLimitSet = d.request(json!({"cmd": "set-limit", "host": true, "bytes": 0}));
    assert_eq!(r.host_mem_limit, 0, "{r:?}");
    for p in 0..8 * MIB / PAGE {
        ca.q(0)
            .write(p * PAGE, &noise(p + 500, PAGE as usize))
            .unwrap();
    }
}

#[test]
fn device_memory_limit_and_set_limit() {
    let dir = TempDir::new("devlim");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let spec_a = format!("socket={},size=32M,queues=1,name=a,mem-limit=1M", s(&a));
    let spec_b = format!("socket={},size=32M,queues=1,name=b", s(&b));
    let d = Daemon::start(&dir, &["--device", &spec_a, "--device", &spec_b], &[&a, &b]);
    let mut ca = Client::connect(&a, 1).unwrap();
    let mut cb = Client::connect(&b, 1).unwrap();
    let fill = |c: &mut Client, seed: u64, pages: u64| -> Option<u64> {
        (0..pages).find(|&p| {
            c.q(0)
                .write(p * PAGE, &noise(seed + p, PAGE as usize))
                .is_err()
        })
    };
    let hit = fill(&mut ca, 0, 1024).expect("a 1 MiB device limit was not hit by 4 MiB");
    assert!(hit * PAGE <= MIB);
    // B has no limit of its own.
    assert_eq!(fill(&mut cb, 7, 1024), None);
    let st = d.stat();
    assert_eq!(st.counters("a").mem_limit, MIB);
    assert!(st.counters("a").mem_used_total <= MIB);

    let r: DeviceLimitSet =
        d.request(json!({"cmd": "set-limit", "device": "a", "bytes": 16 * MIB}));
    assert_eq!((r.device.as_str(), r.mem_limit), ("a", 16 * MIB), "{r:?}");
    assert_eq!(fill(&mut ca, 0, 1024), None, "raised limit still refuses");
    assert_eq!(d.stat().counters("a").mem_limit, 16 * MIB);
}

#[test]
fn reconnect_keeps_the_data() {
    let dir = TempDir::new("recon");
    let sock = dir.join("d.sock");
    let d = Daemon::start(
        &dir,
        &["--socket", s(&sock), "--size", "32M", "--queues", "2"],
        &[&sock],
    );
    for round in 0..3u64 {
        let mut c = Client::connect(&sock, 2)
            .unwrap_or_else(|e| panic!("round {round}: {e}\n{}", d.log_text()));
        // Everything from the earlier rounds is still there.
        for r in 0..round {
            let at = r * 4 * MIB;
            assert!(
                c.q(0).read(at, MIB as usize).unwrap() == pattern(r, at, MIB as usize),
                "round {round}: data of round {r} lost"
            );
        }
        let at = round * 4 * MIB;
        c.q(1).write(at, &pattern(round, at, MIB as usize)).unwrap();
        // Dropping the client closes the vhost-user connection, as a QEMU exit would.
        drop(c);
    }
    // Wait until the daemon has seen the last disconnect.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while d.stat().devices()[0].connected {
        assert!(
            std::time::Instant::now() < deadline,
            "disconnect not noticed"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let st = d.stat();
    assert_eq!(st.devices()[0].connections, 3);
    assert_eq!(st.sole().stats.orig_data_size, 3 * MIB);
    let log = d.log_text();
    assert!(log.contains("frontend disconnected"), "{log}");
}
