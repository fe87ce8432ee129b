//! What the configuration makes the device *do*, seen from a frontend.
//!
//! The other tests mostly read the configuration back from the control
//! socket, which only proves it was parsed. Here every option is checked by
//! its effect over the real vhost-user socket: the codec by the compressed
//! size of the same data (and a byte-exact read back), the serial by GET_ID,
//! read-only by a write that reaches the daemon (through the raw frontend of
//! tests/support/frontend; blkio refuses such writes itself), the queue
//! count by what the device offers and serves, the memory limit by refused
//! writes, and SIGINT and SIGTERM each on their own.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use vhost::vhost_user::VhostUserFrontend;
use vzram_tests::frontend::{d as desc, Ram, RawDev, DATA, F_WRITE, S_IOERR, S_OK, T_GET_ID};
use vzram_tests::*;

const MIB: usize = 1 << 20;
/// virtio-blk feature bit: the device is read-only.
const VIRTIO_BLK_F_RO: u64 = 1 << 5;

/// `vzram stat --json --control PATH`, the way an operator reads it.
fn stat_json(d: &Daemon) -> Stats {
    let o = Vzram::new(&["stat", "--json"])
        .control(&d.control)
        .limit(Duration::from_secs(10))
        .output();
    assert!(
        o.status.success(),
        "vzram stat: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: Value = serde_json::from_slice(&o.stdout).expect("vzram stat --json prints JSON");
    Stats::parse(v)
}

/// The shared corpus of real anonymous memory pages, beside the repository
/// (`../shared/data/anon-pages.bin`), if it is there.
fn corpus_path() -> PathBuf {
    root().join("../shared/data/anon-pages.bin")
}

/// Text-like and structured pages: compressible, but not trivially (no
/// page is one repeated byte, none is a short repeated pattern), so that a
/// stronger codec stores them in clearly fewer bytes.
fn synthetic_pages(pages: usize) -> Vec<u8> {
    const WORDS: &[&str] = &[
        "alpha", "beta", "gamma", "delta", "swap", "page", "cache", "vm", "guest", "host", "zram",
        "pool", "slot", "queue", "virtio", "block", "status", "error", "ok", "user", "kernel",
        "memory", "limit", "device", "socket", "thread", "lock", "free", "used", "dirty", "clean",
        "mapped", "anon", "file", "shared", "private", "read", "write",
    ];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::with_capacity(pages * PAGE);
    for p in 0..pages {
        let mut page = Vec::with_capacity(PAGE + 128);
        if p % 2 == 0 {
            // Log-like text lines.
            while page.len() < PAGE {
                let r = next();
                let line = format!(
                    "{:08} {} {}={} {}:{} {:x}\n",
                    (p as u64) * 1000 + r % 997,
                    WORDS[(r >> 8) as usize % WORDS.len()],
                    WORDS[(r >> 16) as usize % WORDS.len()],
                    (r >> 24) % 100_000,
                    WORDS[(r >> 40) as usize % WORDS.len()],
                    (r >> 48) % 64,
                    r >> 52,
                );
                page.extend_from_slice(line.as_bytes());
            }
        } else {
            // Records: small counters, pointers into one region, flags.
            let mut ptr = 0x7f3a_1200_0000u64 + (next() % 4096) * 64;
            while page.len() < PAGE {
                let r = next();
                ptr += 16 * (r % 8);
                page.extend_from_slice(&ptr.to_le_bytes());
                page.extend_from_slice(&((r >> 8) as u32 % 300).to_le_bytes());
                page.extend_from_slice(&((r >> 32) as u16 & 0x0f0f).to_le_bytes());
                page.extend_from_slice(&[(r >> 48) as u8 & 3, 0]);
            }
        }
        page.truncate(PAGE);
        out.extend_from_slice(&page);
    }
    out
}

/// `pages` pages of data to compress: spread over the real corpus when it is
/// there, else synthetic.
fn compressible_pages(pages: usize) -> (Vec<u8>, &'static str) {
    if let Ok(all) = std::fs::read(corpus_path()) {
        let have = all.len() / PAGE;
        if have >= pages {
            // Every stride-th page, so all sources of the corpus are in.
            let stride = have / pages;
            let mut v = Vec::with_capacity(pages * PAGE);
            for i in 0..pages {
                let at = i * stride * PAGE;
                v.extend_from_slice(&all[at..at + PAGE]);
            }
            return (v, "shared corpus of anonymous pages");
        }
    }
    (synthetic_pages(pages), "synthetic text and records")
}

/// Writes `data` at 0 through queue `w` in 1 MiB requests, then reads it all
/// back through queue `r`.
fn write_then_read_back(c: &mut Client, w: usize, r: usize, data: &[u8], what: &str) {
    for (i, chunk) in data.chunks(MIB).enumerate() {
        c.q(w)
            .write((i * MIB) as u64, chunk)
            .unwrap_or_else(|e| panic!("{what}: write of MiB {i}: {e}"));
    }
    for (i, chunk) in data.chunks(MIB).enumerate() {
        let got = c
            .q(r)
            .read((i * MIB) as u64, chunk.len())
            .unwrap_or_else(|e| panic!("{what}: read of MiB {i}: {e}"));
        assert!(got == chunk, "{what}: MiB {i} reads back different bytes");
    }
}

/// The codec each device was given is the one that stores its pages: zstd
/// (from `--algo`, `--device ...,algo=` and the config file) stores the same
/// data in clearly fewer bytes than lz4, and every device reads it back
/// exactly, so zstd's decompression runs through the socket too.
#[test]
fn algo_decides_how_small_the_pages_are_stored() {
    let dir = TempDir::new("algo");
    let names = ["lz4", "lz4x", "zstd", "zstd3", "zfile"];
    let socks: Vec<PathBuf> = names
        .iter()
        .map(|n| dir.join(&format!("{n}.sock")))
        .collect();
    let cfg = dir.join("vzram.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[device]]\nname = \"zfile\"\nsocket = \"{}\"\nsize = \"16M\"\nqueues = 2\nalgo = \"zstd:3\"\n",
            s(&socks[4])
        ),
    )
    .unwrap();
    let lz4 = format!("socket={},size=16M,queues=2,name=lz4", s(&socks[0]));
    let lz4x = format!(
        "socket={},size=16M,queues=2,name=lz4x,algo=lz4",
        s(&socks[1])
    );
    let zstd3 = format!(
        "socket={},size=16M,queues=2,name=zstd3,algo=zstd:3",
        s(&socks[3])
    );
    let sock_refs: Vec<&Path> = socks.iter().map(PathBuf::as_path).collect();
    let d = Daemon::start(
        &dir,
        &[
            "--config",
            s(&cfg),
            "--device",
            &lz4,
            "--device",
            &lz4x,
            "--device",
            &zstd3,
            "--socket",
            s(&socks[2]),
            "--size",
            "16M",
            "--queues",
            "2",
            "--algo",
            "zstd",
            "--name",
            "zstd",
        ],
        &sock_refs,
    );

    let (data, source) = compressible_pages(2048);
    for (name, sock) in names.iter().zip(&socks) {
        let mut c = Client::connect(sock, 2)
            .unwrap_or_else(|e| panic!("{name}: connect: {e}\n{}", d.log_text()));
        write_then_read_back(&mut c, 0, 1, &data, name);
    }

    d.settled();
    let st = stat_json(&d);
    let size = |n: &str| st.counters(n).compr_data_size;
    let report: Vec<String> = names.iter().map(|n| format!("{n} {}", size(n))).collect();
    eprintln!(
        "{} KiB of {source}; compr_data_size: {}",
        data.len() / 1024,
        report.join(", ")
    );
    for n in names {
        assert_eq!(st.counters(n).orig_data_size, data.len() as u64, "{n}");
        assert_eq!(st.counters(n).failed_writes, 0, "{n}");
        assert_eq!(st.counters(n).failed_reads, 0, "{n}");
        assert!(size(n) > 0, "{n}: nothing was compressed ({source})");
    }
    // Same codec, same data, same bytes.
    assert_eq!(size("lz4"), size("lz4x"), "lz4 by default and by name");
    assert_eq!(size("zstd3"), size("zfile"), "zstd:3 by flag and by file");
    // zstd, at its default level or 3, is clearly smaller than lz4.
    for z in ["zstd", "zstd3", "zfile"] {
        assert!(
            size(z) * 10 <= size("lz4") * 9,
            "{z} stored {} bytes and lz4 {}: not 10% smaller, so {z} is not compressing with zstd ({source})",
            size(z),
            size("lz4")
        );
    }
}

/// GET_ID (virtio-blk request type 8) on a raw frontend: the 20 bytes the
/// guest sees as the disk's serial.
fn get_id(sock: &Path) -> Vec<u8> {
    let mut v = RawDev::connect(sock);
    v.ram.write(DATA, &[0xff; 64]);
    let (st, used) = v.req(T_GET_ID, 0, &[desc(DATA, 20, F_WRITE)]);
    assert_eq!((st, used), (S_OK, 21), "GET_ID on {}", sock.display());
    assert!(
        v.ram.read(DATA + 20, 44).iter().all(|&b| b == 0xff),
        "GET_ID wrote past 20 bytes"
    );
    v.ram.read(DATA, 20)
}

fn padded(serial: &str) -> Vec<u8> {
    let mut v = serial.as_bytes().to_vec();
    v.resize(20, 0);
    v
}

/// GET_ID returns the configured serial, NUL-padded to 20 bytes, not the
/// device's name; without a serial, `vzram-` and the name (what the udev
/// rule in contrib/udev matches).
#[test]
fn get_id_returns_the_serial() {
    let dir = TempDir::new("serial");
    let names = ["flag", "spec", "full", "file", "plain"];
    let socks: Vec<PathBuf> = names
        .iter()
        .map(|n| dir.join(&format!("{n}.sock")))
        .collect();
    let cfg = dir.join("vzram.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[device]]\nname = \"file\"\nsocket = \"{}\"\nsize = \"1M\"\nserial = \"from-the-file\"\n",
            s(&socks[3])
        ),
    )
    .unwrap();
    let spec = format!("socket={},size=1M,name=spec,serial=SPEC-0042", s(&socks[1]));
    // Exactly 20 bytes: no NUL at all.
    let full = format!(
        "socket={},size=1M,name=full,serial=ABCDEFGHIJ0123456789",
        s(&socks[2])
    );
    let plain = format!("socket={},size=1M,name=plain", s(&socks[4]));
    let sock_refs: Vec<&Path> = socks.iter().map(PathBuf::as_path).collect();
    let _d = Daemon::start(
        &dir,
        &[
            "--config",
            s(&cfg),
            "--device",
            &spec,
            "--device",
            &full,
            "--device",
            &plain,
            "--socket",
            s(&socks[0]),
            "--size",
            "1M",
            "--name",
            "flag",
            "--serial",
            "vm7-swap",
        ],
        &sock_refs,
    );
    for (name, sock, want) in [
        ("flag", &socks[0], "vm7-swap"),
        ("spec", &socks[1], "SPEC-0042"),
        ("full", &socks[2], "ABCDEFGHIJ0123456789"),
        ("file", &socks[3], "from-the-file"),
        ("plain", &socks[4], "vzram-plain"),
    ] {
        let got = get_id(sock);
        assert_eq!(
            got,
            padded(want),
            "device {name}: GET_ID gave {:?}, not the serial {want:?}",
            String::from_utf8_lossy(&got)
        );
    }
}

/// A `--readonly` device (flag, `--device` and config file alike) offers
/// VIRTIO_BLK_F_RO, answers a write that reaches it with IOERR and stores
/// nothing, and serves reads; the same write to a writable device in the
/// same daemon succeeds.
#[test]
fn readonly_refuses_writes_that_reach_the_daemon() {
    let dir = TempDir::new("ro");
    let names = ["flag", "spec", "file", "rw"];
    let socks: Vec<PathBuf> = names
        .iter()
        .map(|n| dir.join(&format!("{n}.sock")))
        .collect();
    let cfg = dir.join("vzram.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[device]]\nname = \"file\"\nsocket = \"{}\"\nsize = \"1M\"\nreadonly = true\n",
            s(&socks[2])
        ),
    )
    .unwrap();
    let spec = format!("socket={},size=1M,name=spec,readonly=true", s(&socks[1]));
    let rw = format!("socket={},size=1M,name=rw", s(&socks[3]));
    let sock_refs: Vec<&Path> = socks.iter().map(PathBuf::as_path).collect();
    let d = Daemon::start(
        &dir,
        &[
            "--config",
            s(&cfg),
            "--device",
            &spec,
            "--device",
            &rw,
            "--socket",
            s(&socks[0]),
            "--size",
            "1M",
            "--name",
            "flag",
            "--readonly",
        ],
        &sock_refs,
    );
    let data = pattern(7, 0, 2 * PAGE);
    for (name, sock) in names.iter().zip(&socks) {
        let readonly = *name != "rw";
        let mut v = RawDev::connect(sock);
        assert_eq!(
            v.features & VIRTIO_BLK_F_RO != 0,
            readonly,
            "{name}: VIRTIO_BLK_F_RO offered"
        );
        let want = if readonly { S_IOERR } else { S_OK };
        assert_eq!(v.write(0, &data), want, "{name}: write of two pages");
        assert_eq!(
            v.write(9, &data[..512]),
            want,
            "{name}: write of one sector"
        );
        let expect = if readonly {
            vec![0; 2 * PAGE]
        } else {
            let mut e = data.clone();
            e[9 * 512..10 * 512].copy_from_slice(&data[..512]);
            e
        };
        assert_eq!(
            v.read(0, 2 * PAGE),
            (S_OK, expect.clone()),
            "{name}: raw read"
        );
        drop(v);
        // A read-only blkio client reads the same.
        let mut c = Client::connect_with(sock, 1, true)
            .unwrap_or_else(|e| panic!("{name}: blkio connect: {e}\n{}", d.log_text()));
        assert_eq!(
            c.q(0).read(0, 2 * PAGE).unwrap(),
            expect,
            "{name}: blkio read"
        );
    }
    let st = stat_json(&d);
    for name in ["flag", "spec", "file"] {
        assert_eq!(st.counters(name).orig_data_size, 0, "{name}");
        assert_eq!(st.counters(name).writes, 0, "{name}");
    }
    assert_eq!(st.counters("rw").orig_data_size, 2 * PAGE as u64);
}

/// GET_QUEUE_NUM on a raw frontend (vhost-user's "how many queues").
fn queue_num(sock: &Path) -> u64 {
    let mut v = RawDev::handshake(sock, Ram::standard());
    v.fe.get_queue_num().expect("GET_QUEUE_NUM")
}

/// The device offers exactly the configured number of queues, every one
/// of them serves I/O, and one more is refused.
#[test]
fn queues_offers_and_serves_exactly_that_many() {
    let dir = TempDir::new("queues");
    let names = ["one", "three", "five", "file"];
    let counts = [1usize, 3, 5, 2];
    let socks: Vec<PathBuf> = names
        .iter()
        .map(|n| dir.join(&format!("{n}.sock")))
        .collect();
    let cfg = dir.join("vzram.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[device]]\nname = \"file\"\nsocket = \"{}\"\nsize = \"8M\"\nqueues = 2\n",
            s(&socks[3])
        ),
    )
    .unwrap();
    let one = format!("socket={},size=8M,name=one,queues=1", s(&socks[0]));
    let five = format!("socket={},size=8M,name=five,queues=5", s(&socks[2]));
    let sock_refs: Vec<&Path> = socks.iter().map(PathBuf::as_path).collect();
    let d = Daemon::start(
        &dir,
        &[
            "--config",
            s(&cfg),
            "--device",
            &one,
            "--device",
            &five,
            "--socket",
            s(&socks[1]),
            "--size",
            "8M",
            "--queues",
            "3",
            "--name",
            "three",
        ],
        &sock_refs,
    );
    for ((name, sock), n) in names.iter().zip(&socks).zip(counts) {
        assert_eq!(queue_num(sock), n as u64, "{name}: GET_QUEUE_NUM");
        let mut c = Client::connect(sock, n)
            .unwrap_or_else(|e| panic!("{name}: connect with {n} queues: {e}\n{}", d.log_text()));
        assert_eq!(
            c.blkio.get_i32("max-queues").unwrap(),
            n as i32,
            "{name}: num_queues in config space"
        );
        assert_eq!(c.queues.len(), n);
        // Each queue writes its own MiB, in parallel ...
        std::thread::scope(|sc| {
            for (qi, q) in c.queues.iter_mut().enumerate() {
                sc.spawn(move || {
                    let at = (qi * MIB) as u64;
                    q.write(at, &pattern(qi as u64, at, MIB))
                        .unwrap_or_else(|e| panic!("{name}: queue {qi} write: {e}"));
                });
            }
        });
        // ... and reads the next queue's.
        for qi in 0..n {
            let other = (qi + 1) % n;
            let at = (other * MIB) as u64;
            let got = c
                .q(qi)
                .read(at, MIB)
                .unwrap_or_else(|e| panic!("{name}: queue {qi} read: {e}"));
            assert!(
                got == pattern(other as u64, at, MIB),
                "{name}: queue {qi} reads wrong data for queue {other}"
            );
        }
        drop(c);
        assert!(
            Client::connect(sock, n + 1).is_err(),
            "{name}: {} queues accepted on a {n}-queue device",
            n + 1
        );
    }
    let st = stat_json(&d);
    for (name, n) in names.iter().zip(counts) {
        assert_eq!(st.counters(name).orig_data_size, (n * MIB) as u64, "{name}");
        assert_eq!(st.counters(name).failed_writes, 0, "{name}");
    }
}

/// A device with `--mem-limit` refuses writes with IOERR once its pool
/// memory reaches the limit, keeps what it stored, and never uses more;
/// a device without a limit in the same daemon takes the same writes.
#[test]
fn mem_limit_refuses_writes_past_it() {
    const LIMIT: u64 = 1 << 20;
    let dir = TempDir::new("limit");
    let names = ["flag", "spec", "free"];
    let socks: Vec<PathBuf> = names
        .iter()
        .map(|n| dir.join(&format!("{n}.sock")))
        .collect();
    let spec = format!(
        "socket={},size=8M,name=spec,queues=1,mem-limit=1M",
        s(&socks[1])
    );
    let free = format!("socket={},size=8M,name=free,queues=1", s(&socks[2]));
    let sock_refs: Vec<&Path> = socks.iter().map(PathBuf::as_path).collect();
    let d = Daemon::start(
        &dir,
        &[
            "--device",
            &spec,
            "--device",
            &free,
            "--socket",
            s(&socks[0]),
            "--size",
            "8M",
            "--queues",
            "1",
            "--mem-limit",
            "1M",
            "--name",
            "flag",
        ],
        &sock_refs,
    );
    // Incompressible pages, 2 MiB of them: twice the limit.
    let pages = 2 * LIMIT as usize / PAGE;
    for (name, sock) in names.iter().zip(&socks) {
        let limited = *name != "free";
        let mut c = Client::connect(sock, 1).unwrap();
        let mut stored = Vec::new();
        let mut refused = 0;
        for p in 0..pages {
            let data = noise(p as u64 + 1, PAGE);
            match c.q(0).write((p * PAGE) as u64, &data) {
                Ok(()) => {
                    assert!(
                        refused == 0,
                        "{name}: page {p} stored after a refusal, with nothing freed"
                    );
                    stored.push(p);
                }
                Err(e) => {
                    assert_eq!(e, -libc::EIO, "{name}: page {p}");
                    refused += 1;
                }
            }
        }
        let st = stat_json(&d);
        let used = st.counters(name).mem_used_total;
        let max = st.counters(name).mem_used_max;
        eprintln!(
            "{name}: {} pages stored, {refused} refused; mem_used_total {used}, mem_used_max {max}",
            stored.len()
        );
        if limited {
            assert!(
                refused > 0,
                "{name}: {pages} pages of noise fit in {LIMIT} bytes"
            );
            assert!(
                stored.len() * PAGE >= LIMIT as usize / 2,
                "{name}: only {} pages stored before the first refusal",
                stored.len()
            );
            assert!(
                used <= LIMIT && max <= LIMIT,
                "{name}: used {used}, max {max}, limit {LIMIT}"
            );
            assert_eq!(st.counters(name).mem_limit, LIMIT, "{name}");
            assert_eq!(st.counters(name).failed_writes, refused, "{name}");
        } else {
            assert_eq!(refused, 0, "{name}: writes refused without a limit");
            assert!(used > LIMIT, "{name}: used {used}");
        }
        // What was stored reads back; what was refused is still zeroes.
        for p in 0..pages {
            let want = if stored.contains(&p) {
                noise(p as u64 + 1, PAGE)
            } else {
                vec![0; PAGE]
            };
            assert!(
                c.q(0).read((p * PAGE) as u64, PAGE).unwrap() == want,
                "{name}: page {p} reads back wrong"
            );
        }
    }
}

/// Waits, without reaping it, for the daemon to exit; its exit code, or
/// None if it is still running after `within`.
fn exit_code_within(pid: u32, within: Duration) -> Option<i32> {
    let deadline = Instant::now() + within;
    loop {
        // SAFETY: siginfo_t is plain data; all zeroes is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child, WNOWAIT leaving it to be reaped
        // by the Daemon; info is a valid out pointer.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        assert_eq!(rc, 0, "waitid: {}", std::io::Error::last_os_error());
        // SAFETY: waitid filled in info (si_pid stays 0 while it runs).
        let (who, status) = unsafe { (info.si_pid(), info.si_status()) };
        if who != 0 {
            assert_eq!(info.si_code, libc::CLD_EXITED, "killed, not exited");
            return Some(status);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGINT alone stops the daemon, and so does SIGTERM alone: exit 0, every
/// socket removed, even with a frontend connected.
#[test]
fn sigint_and_sigterm_each_stop_the_daemon() {
    for (sig, sig_name) in [(libc::SIGINT, "SIGINT"), (libc::SIGTERM, "SIGTERM")] {
        let dir = TempDir::new("sig");
        let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
        let a_spec = format!("socket={},size=1M", s(&a));
        let b_spec = format!("socket={},size=1M", s(&b));
        let mut d = Daemon::start(&dir, &["--device", &a_spec, "--device", &b_spec], &[&a, &b]);
        let mut c = Client::connect(&a, 1).unwrap();
        c.q(0).write(0, &[7; PAGE]).unwrap();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(d.pid() as libc::pid_t, sig) };
        let code = exit_code_within(d.pid(), Duration::from_secs(10));
        assert_eq!(
            code,
            Some(0),
            "{sig_name} alone: exit code (None: still running after 10 s)\n{}",
            d.log_text()
        );
        for p in [&a, &b, &d.control] {
            assert!(!p.exists(), "{sig_name}: {} left behind", p.display());
        }
        // It has exited already: this only reaps it.
        assert_eq!(d.terminate().code(), Some(0));
        drop(c);
    }
}

/// `--discard-segments` (`discard-segments=` in a spec) is what the config
/// space offers as `max_discard_seg` and `max_write_zeroes_seg`, and a
/// request with more segments gets UNSUPP and changes nothing, as from
/// qemu-storage-daemon (which offers 1); the default offers 256.
#[test]
fn discard_segments_is_offered_and_more_are_unsupp() {
    use vhost::vhost_user::message::VhostUserConfigFlags;
    use vzram_tests::frontend::{S_UNSUPP, T_DISCARD, T_IN, T_OUT, T_WRITE_ZEROES};
    let dir = TempDir::new("dwz-segs");
    let (all, one) = (dir.join("all.sock"), dir.join("one.sock"));
    let spec = format!("socket={},size=8M,name=one,discard-segments=1", s(&one));
    let _d = Daemon::start(
        &dir,
        &["--socket", s(&all), "--size", "8M", "--device", &spec],
        &[&all, &one],
    );
    let page = |b: u8| vec![b; PAGE];
    for (sock, offered) in [(&all, 256u32), (&one, 1)] {
        let mut v = RawDev::connect(sock);
        // max_discard_seg at 40, max_write_zeroes_seg at 52 (virtio 1.2, 5.2.4).
        let (_, cfg) =
            v.fe.get_config(0, 60, VhostUserConfigFlags::empty(), &[0; 60])
                .expect("GET_CONFIG");
        let at = |off: usize| u32::from_le_bytes(cfg[off..off + 4].try_into().unwrap());
        assert_eq!((at(40), at(52)), (offered, offered), "{}", sock.display());
        v.ram.write(DATA, &[page(7), page(8)].concat());
        assert_eq!(v.req(T_OUT, 0, &[desc(DATA, 2 * PAGE as u32, 0)]).0, S_OK);
        let two = [(0u64, 8u32, 0u32), (8, 8, 0)];
        let want = if offered == 1 { S_UNSUPP } else { S_OK };
        for t in [T_DISCARD, T_WRITE_ZEROES] {
            assert_eq!(v.dwz(t, &two), want, "type {t} on {}", sock.display());
        }
        v.ram.write(DATA, &[0xee; 2 * PAGE]);
        let (st, _) = v.req(T_IN, 0, &[desc(DATA, 2 * PAGE as u32, F_WRITE)]);
        assert_eq!(st, S_OK);
        let kept = v.ram.read(DATA, 2 * PAGE) == [page(7), page(8)].concat();
        assert_eq!(kept, offered == 1, "pages kept on {}", sock.display());
        // One segment is always fine.
        assert_eq!(v.dwz(T_DISCARD, &[(0, 8, 0)]), S_OK);
    }
}
