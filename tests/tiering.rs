//! Tiering through the real daemon: a device with a backing file takes
//! far more than its memory limit and the daemon's memory stays under the
//! limit; `mark-idle` and `recompress` shrink an lz4 device; pages written
//! back survive `kill -9`; the ager writes back and recompresses on its
//! own; a device added at run time gets its backing file, and removing it
//! lets go; bad backing files stop the start with one line, exit 2.
//!
//! Backing files live under the target directory, on a real file system:
//! tmpfs refuses O_DIRECT, which the daemon then replaces with buffered
//! I/O (the stat says `direct_io: false`).

use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use vzram_tests::metrics::{metric, scrape};
use vzram_tests::*;

/// A directory for backing files, on the file system of the target
/// directory (not /dev/shm: O_DIRECT), removed on drop.
struct DiskDir(PathBuf);

impl DiskDir {
    fn new(tag: &str) -> DiskDir {
        let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("vz-tier-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        DiskDir(p)
    }

    /// A sparse file of `bytes`, as `truncate -s` makes one.
    fn file(&self, name: &str, bytes: u64) -> PathBuf {
        let p = self.0.join(name);
        std::fs::File::create(&p).unwrap().set_len(bytes).unwrap();
        p
    }
}

impl Drop for DiskDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Real anonymous memory (`../shared/data/anon-pages.bin`), when it is there.
fn corpus() -> Option<&'static [u8]> {
    static C: OnceLock<Option<Vec<u8>>> = OnceLock::new();
    C.get_or_init(|| {
        let mut v = std::fs::read(root().join("../shared/data/anon-pages.bin")).ok()?;
        v.truncate(v.len() / PAGE * PAGE);
        (!v.is_empty()).then_some(v)
    })
    .as_deref()
}

/// Text-like page, for when the corpus is missing: compressible, and
/// clearly more so by zstd than by lz4.
fn text(seed: u64) -> Vec<u8> {
    const WORDS: [&str; 16] = [
        "alpha ", "beta ", "gamma ", "delta ", "swap ", "page ", "guest ", "host ", "zram ",
        "vhost ", "queue ", "slot ", "pool ", "span ", "ring ", "memory ",
    ];
    let mut r = Rng::new(seed);
    let mut p = Vec::with_capacity(PAGE + 8);
    while p.len() < PAGE {
        p.extend_from_slice(WORDS[r.below(16) as usize].as_bytes());
    }
    p.truncate(PAGE);
    p
}

/// Page `i` of version `v`: one in eight incompressible, the rest real
/// memory pages (or text), each stamped with its index and version so no
/// two are alike and none is same-filled.
fn page(i: u64, v: u64) -> Vec<u8> {
    let mut p = if i % 8 == 7 {
        noise(mix(i ^ (v << 40)), PAGE)
    } else if let Some(c) = corpus() {
        let k = (mix(i ^ (v << 40)) % (c.len() / PAGE) as u64) as usize;
        c[k * PAGE..(k + 1) * PAGE].to_vec()
    } else {
        text(i ^ (v << 40))
    };
    p[..8].copy_from_slice(&i.to_le_bytes());
    p[8..16].copy_from_slice(&v.to_le_bytes());
    p
}

fn pages(first: u64, n: u64, v: u64) -> Vec<u8> {
    (first..first + n).flat_map(|i| page(i, v)).collect()
}

/// Writes pages `0..n` (version `v`) in chunks of `chunk` pages, each
/// read back right after; returns the first error, if any.
fn write_verified(c: &mut Client, n: u64, chunk: u64, v: u64) -> Result<(), String> {
    let mut i = 0;
    while i < n {
        let k = chunk.min(n - i);
        let data = pages(i, k, v);
        let off = i * PAGE as u64;
        c.q(0)
            .write(off, &data)
            .map_err(|e| format!("write of pages {i}..{}: {e}", i + k))?;
        let back = c
            .q(0)
            .read(off, data.len())
            .map_err(|e| format!("read of pages {i}..{}: {e}", i + k))?;
        if back != data {
            return Err(format!("pages {i}..{} read back differently", i + k));
        }
        i += k;
    }
    Ok(())
}

/// Reads pages `0..n` and compares them with what `want(i)` says.
fn check(c: &mut Client, n: u64, chunk: u64, want: impl Fn(u64) -> Vec<u8>, what: &str) {
    let mut i = 0;
    while i < n {
        let k = chunk.min(n - i);
        let got = c
            .q(0)
            .read(i * PAGE as u64, (k as usize) * PAGE)
            .unwrap_or_else(|e| panic!("{what}: read of pages {i}..{}: {e}", i + k));
        for (j, p) in got.chunks(PAGE).enumerate() {
            let at = i + j as u64;
            assert!(p == want(at), "{what}: page {at} differs");
        }
        i += k;
    }
}

/// `vzram stat --json`: the device named `name`.
fn stat_dev(d: &Daemon, name: &str) -> DeviceStat {
    let v: Value = serde_json::from_str(&d.cli_ok(&["stat", "--json"])).unwrap();
    Stats::parse(v).dev(name).clone()
}

/// A device's backing file, which it must have.
fn backing_of(st: &DeviceStat) -> &BackingStat {
    st.tier
        .backing
        .as_ref()
        .unwrap_or_else(|| panic!("no backing file: {st:?}"))
}

/// The error line of a refused command; asserts exit 2 and that the error
/// is one line, the last (a daemon that fails at its second device has
/// logged the first one's set-up before it).
fn one_line_exit_2(o: &Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{what}: {err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{what}: {err}");
    assert_eq!(
        err.trim_end().lines().last(),
        Some(errors[0]),
        "{what}: {err}"
    );
    errors[0].to_string()
}

/// Starts `vzram serve ARGS`; a killed daemon's socket files are removed
/// first, so that waiting for them waits for the new one.
fn start(dir: &TempDir, sockets: &[&Path], args: &[&str]) -> Daemon {
    for p in sockets {
        let _ = std::fs::remove_file(p);
    }
    let _ = std::fs::remove_file(dir.join("control.sock"));
    Daemon::start(dir, args, sockets)
}

/// Waits until a device's worker is gone (its frontend left).
fn wait_idle(d: &Daemon, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.stat().worker(name).state != WorkerState::Idle {
        assert!(Instant::now() < deadline, "{:?}", d.stat().worker(name));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Inodes of the memfds this process maps: the blkio client's buffers,
/// which a worker maps as its guest's memory.
fn client_memfds() -> HashSet<String> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("/memfd:"))
        .filter_map(|l| l.split_whitespace().nth(4).map(str::to_string))
        .collect()
}

/// The daemon's own memory: the resident pages of every mapping of every
/// process it runs (supervisor, launcher, workers), anonymous, shared and
/// file-backed alike, except the guest's memory (the client's memfds).
fn own_rss(pid: u32, guest: &HashSet<String>) -> u64 {
    let mut total = 0;
    for p in process_tree(pid) {
        let Ok(smaps) = std::fs::read_to_string(format!("/proc/{p}/smaps")) else {
            continue;
        };
        let mut skip = false;
        for l in smaps.lines() {
            let first = l.split_whitespace().next().unwrap_or_default();
            if first.contains('-') && first.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
                let inode = l.split_whitespace().nth(4).unwrap_or_default();
                skip = l.contains("/memfd:") && guest.contains(inode);
            } else if let Some(kb) = l.strip_prefix("Rss:") {
                if !skip {
                    let kb: u64 = kb.trim().trim_end_matches("kB").trim().parse().unwrap();
                    total += kb * 1024;
                }
            }
        }
    }
    total
}

/// Bytes of `path` in the page cache (mincore over a mapping of it).
fn cached_bytes(path: &Path) -> u64 {
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: a read-only shared mapping of a file we opened; only its
    // residency is asked, nothing is read through it.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED);
    let mut vec = vec![0u8; len.div_ceil(PAGE)];
    // SAFETY: `vec` has one byte per page of the mapping.
    let rc = unsafe { libc::mincore(addr, len, vec.as_mut_ptr()) };
    // SAFETY: unmapping what we mapped above.
    unsafe { libc::munmap(addr, len) };
    assert_eq!(rc, 0);
    vec.iter().filter(|&&b| b & 1 != 0).count() as u64 * PAGE as u64
}

/// Samples [`own_rss`] every 50 ms until stopped; keeps the peak.
struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<Mutex<(u64, usize)>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(pid: u32, guest: HashSet<String>) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(Mutex::new((0, 0)));
        let (st, pk) = (stop.clone(), peak.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                let r = own_rss(pid, &guest);
                let mut p = pk.lock().unwrap();
                p.0 = p.0.max(r);
                p.1 += 1;
                drop(p);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Sampler {
            stop,
            peak,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> (u64, usize) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        *self.peak.lock().unwrap()
    }
}

/// What the daemon may use beyond its idle memory and the device's limit:
/// the queue threads' stacks and malloc arenas under load, slot-table
/// pages (8 bytes per written slot: 1 MiB for 512 MiB), the writeback
/// buffers (128 KiB per pass), the span directory, and a span being
/// filled while another is given back.
const SLACK: u64 = 8 * MIB;

#[test]
fn a_device_with_a_backing_file_takes_ten_times_its_limit() {
    const LIMIT: u64 = 48 * MIB;
    const TOTAL: u64 = 512 * MIB;
    const PAGES: u64 = TOTAL / PAGE as u64;
    let dir = TempDir::new("tier-big");
    let disk = DiskDir::new("big");
    // Room for every page raw, and the header block.
    let backing = disk.file("vm1.img", TOTAL + 64 * MIB);
    let sock = dir.join("v.sock");
    let d = start(
        &dir,
        &[&sock],
        &[
            "--socket",
            s(&sock),
            "--size",
            "512M",
            "--name",
            "vm1",
            "--queues",
            "1",
            "--mem-limit",
            "48M",
            "--backing-file",
            s(&backing),
        ],
    );
    let mut c = Client::connect(&sock, 1).unwrap();
    let guest = client_memfds();
    assert!(!guest.is_empty(), "the client maps no memfd");
    std::thread::sleep(Duration::from_millis(200));
    let idle = (0..5)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(20));
            own_rss(d.pid(), &guest)
        })
        .max()
        .unwrap();
    let sampler = Sampler::start(d.pid(), guest.clone());

    let t = Instant::now();
    write_verified(&mut c, PAGES, 256, 1).unwrap_or_else(|e| panic!("{e}\n{}", d.log_text()));
    let wrote = t.elapsed();
    let st = stat_dev(&d, "vm1");
    let t = Instant::now();
    check(&mut c, PAGES, 256, |i| page(i, 1), "after 512 MiB");
    let read = t.elapsed();
    let (peak, samples) = sampler.finish();

    eprintln!(
        "wrote 512 MiB in {wrote:.1?} (each chunk read back), read it all back in {read:.1?}: \
         spills {}, backed pages {} ({:.0} MiB), backed writes {}, backed reads {}, \
         mem_used_max {:.1} MiB (limit 48), failed writes {}",
        st.stats.spills,
        st.stats.backed_pages,
        (st.stats.backed_pages * PAGE as u64) as f64 / MIB as f64,
        st.stats.backed_writes,
        st.stats.backed_reads,
        st.stats.mem_used_max as f64 / MIB as f64,
        st.stats.failed_writes,
    );
    eprintln!(
        "daemon's own memory (all mappings but the guest's): idle {:.1} MiB, peak {:.1} MiB over {samples} samples; \
         cap {:.1} MiB = idle + limit 48 + slack {}",
        idle as f64 / MIB as f64,
        peak as f64 / MIB as f64,
        (idle + LIMIT + SLACK) as f64 / MIB as f64,
        SLACK / MIB
    );
    assert_eq!(st.stats.failed_writes, 0, "{st:?}");
    assert_eq!(st.stats.failed_reads, 0, "{st:?}");
    assert!(st.stats.spills > 0 && st.stats.backed_pages > 0, "{st:?}");
    assert!(st.stats.mem_used_max <= LIMIT, "{st:?}");
    assert_eq!(st.stats.orig_data_size, TOTAL, "{st:?}");
    // Most of it is on disk: the pool holds 48 MiB of compressed pages.
    assert!(st.stats.backed_pages > PAGES / 2, "{st:?}");
    let b = backing_of(&st);
    assert_eq!(b.path, backing, "{st:?}");
    assert_eq!(b.blocks, (TOTAL + 64 * MIB) / PAGE as u64 - 1, "{st:?}");
    assert_eq!(b.used_blocks, st.stats.backed_pages, "{st:?}");
    assert!(b.direct_io, "{st:?}");
    assert!(samples >= 20, "only {samples} samples");
    assert!(
        peak <= idle + LIMIT + SLACK,
        "the daemon's own memory peaked at {:.1} MiB, above idle {:.1} + limit 48 + slack {}",
        peak as f64 / MIB as f64,
        idle as f64 / MIB as f64,
        SLACK / MIB
    );
    // O_DIRECT: the pages moved out did not come back as page cache.
    let cached = cached_bytes(&backing);
    assert!(
        cached < 4 * MIB,
        "{:.1} MiB of the backing file in the page cache",
        cached as f64 / MIB as f64
    );
    let after = stat_dev(&d, "vm1");
    assert!(after.stats.backed_reads > 0, "{after:?}");
    assert_eq!(after.stats.failed_reads, 0, "{after:?}");

    let text = d.cli_ok(&["stat"]);
    assert!(text.contains("bd_stat"), "{text}");
    assert!(
        text.contains(&format!("backing file {}", backing.display())),
        "{text}"
    );
}

/// A command sent just as the frontend leaves reaches a worker on its way
/// out. It must not fail: the daemon asks again, and whoever holds the
/// device next (the supervisor, or a new worker) carries it out.
#[test]
fn a_command_racing_a_leaving_frontend_is_carried_out() {
    let dir = TempDir::new("tier-race");
    let sock = dir.join("v.sock");
    let d = start(
        &dir,
        &[&sock],
        &[
            "--socket",
            s(&sock),
            "--size",
            "16M",
            "--name",
            "vm1",
            "--queues",
            "1",
        ],
    );
    for round in 0..20u64 {
        let mut c = Client::connect(&sock, 1).unwrap();
        write_verified(&mut c, 64, 64, round).unwrap();
        drop(c);
        // No wait for the worker to go: that is the race.
        let out = d.cli_ok(&["mark-idle", "--device", "vm1"]);
        assert!(
            out.starts_with("device vm1: 64 pages marked idle; 64 pages idle in all"),
            "round {round}: {out}"
        );
    }
}

#[test]
fn mark_idle_and_recompress_shrink_an_lz4_device() {
    const PAGES: u64 = 8192; // 32 MiB
    let dir = TempDir::new("tier-recomp");
    let sock = dir.join("v.sock");
    let d = start(
        &dir,
        &[&sock],
        &[
            "--socket",
            s(&sock),
            "--size",
            "64M",
            "--name",
            "vm1",
            "--queues",
            "1",
        ],
    );
    let mut c = Client::connect(&sock, 1).unwrap();
    write_verified(&mut c, PAGES, 256, 1).unwrap();
    // Staged pages are compressed in the background, and recompression
    // passes over a page still staged: every page is an lz4 object first.
    d.settled();
    let before = stat_dev(&d, "vm1");
    assert_eq!(before.algo.to_string(), "lz4");
    assert_eq!(before.tier.recompress_algo.to_string(), "zstd:3");

    let out = d.cli_ok(&["mark-idle", "--device", "vm1"]);
    // Every page is an object (none is same-filled).
    assert!(
        out.starts_with(&format!(
            "device vm1: {PAGES} pages marked idle; {PAGES} pages idle in all"
        )),
        "{out}"
    );
    // The first 1024 are read again: no longer idle, they stay lz4.
    check(&mut c, 1024, 256, |i| page(i, 1), "after mark-idle");
    let out = d.cli_ok(&[
        "recompress",
        "--device",
        "vm1",
        "--idle",
        "--algo",
        "zstd:3",
    ]);
    let after = stat_dev(&d, "vm1");
    let (mb, ma) = (before.stats.mem_used_total, after.stats.mem_used_total);
    eprintln!(
        "{}mem_used_total {:.2} MiB -> {:.2} MiB, compr_data_size {:.2} -> {:.2} MiB, \
         pages_recompressed {}, recompress_saved_bytes {}",
        out,
        mb as f64 / MIB as f64,
        ma as f64 / MIB as f64,
        before.stats.compr_data_size as f64 / MIB as f64,
        after.stats.compr_data_size as f64 / MIB as f64,
        after.stats.pages_recompressed,
        after.stats.recompress_saved_bytes,
    );
    assert!(out.starts_with("device vm1: recompressed "), "{out}");
    let recompressed = after.stats.pages_recompressed;
    // The idle compressible pages: 7/8 of those not read again.
    assert!(recompressed > (PAGES - 1024) * 7 / 8 * 9 / 10, "{after:?}");
    assert!(recompressed <= PAGES - 1024, "{after:?}");
    assert!(ma < mb * 9 / 10, "mem_used_total {mb} -> {ma}");
    assert_eq!(
        before.stats.compr_data_size - after.stats.compr_data_size,
        after.stats.recompress_saved_bytes
    );
    check(&mut c, PAGES, 256, |i| page(i, 1), "after recompress");

    // A second run finds nothing left to try among the idle pages it did.
    let out = d.cli_ok(&["recompress", "--device", "vm1", "--idle"]);
    assert!(out.contains("recompressed 0 of 0 pages tried"), "{out}");

    // Refused: the device's own codec, an unknown codec, an unknown device.
    let o = d.vzram(&["recompress", "--device", "vm1", "--algo", "lz4"]);
    let e = one_line_exit_2(&o, "recompress with lz4");
    assert!(e.contains("another codec"), "{e}");
    let o = d.vzram(&["recompress", "--device", "vm1", "--algo", "gzip"]);
    let e = one_line_exit_2(&o, "recompress with gzip");
    assert!(e.contains("gzip"), "{e}");
    let o = d.vzram(&["mark-idle", "--device", "vm9"]);
    let e = one_line_exit_2(&o, "unknown device");
    assert!(
        e.contains("no device \"vm9\"") && e.contains("vm1 (0)"),
        "{e}"
    );
}

#[test]
fn written_back_pages_survive_kill_9() {
    const PAGES: u64 = 4096; // 16 MiB
    let dir = TempDir::new("tier-kill");
    let disk = DiskDir::new("kill");
    let backing = disk.file("vm1.img", 32 * MIB);
    let sock = dir.join("v.sock");
    let args = [
        "--socket",
        s(&sock),
        "--size",
        "16M",
        "--name",
        "vm1",
        "--queues",
        "1",
        "--backing-file",
        s(&backing),
        "--metrics",
        "127.0.0.1:0",
    ];
    let mut d = start(&dir, &[&sock], &args);
    let mut c = Client::connect(&sock, 1).unwrap();
    write_verified(&mut c, PAGES, 256, 1).unwrap();

    // Through the worker: idle pages only, and those read since are not.
    d.cli_ok(&["mark-idle", "--device", "vm1"]);
    check(&mut c, 100, 100, |i| page(i, 1), "after mark-idle");
    let out = d.cli_ok(&["writeback", "--device", "vm1", "--idle"]);
    assert!(
        out.starts_with(&format!("device vm1: wrote {} pages ", PAGES - 100)),
        "{out}"
    );
    let st = stat_dev(&d, "vm1");
    assert_eq!(st.stats.backed_pages, PAGES - 100, "{st:?}");
    assert!(st.stats.mem_used_total < 2 * MIB, "{st:?}");
    let body = scrape(d.stat().0.metrics.unwrap().parse().unwrap());
    let label = "{vzram_device=\"vm1\"}";
    assert_eq!(
        metric(&body, &format!("vzram_backed_pages{label}")),
        PAGES - 100
    );
    assert_eq!(
        metric(&body, &format!("vzram_backing_write_bytes_total{label}")),
        st.stats.backed_writes * PAGE as u64
    );
    assert_eq!(
        metric(&body, &format!("vzram_backing_blocks{label}")),
        32 * MIB / PAGE as u64 - 1
    );
    for name in [
        "vzram_backing_read_bytes_total",
        "vzram_spills_total",
        "vzram_recompressed_pages_total",
        "vzram_recompress_saved_bytes_total",
    ] {
        metric(&body, &format!("{name}{label}"));
    }

    // Overwrite some written-back pages (their blocks go back), then,
    // with no frontend, the supervisor writes back 50 more itself.
    let fresh = pages(200, 10, 2);
    c.q(0).write(200 * PAGE as u64, &fresh).unwrap();
    drop(c);
    wait_idle(&d, "vm1");
    let out = d.cli_ok(&["writeback", "--device", "vm1", "--max-pages", "50"]);
    assert!(out.starts_with("device vm1: wrote 50 pages "), "{out}");
    let want = |i: u64| page(i, if (200..210).contains(&i) { 2 } else { 1 });
    let backed = stat_dev(&d, "vm1").stats.backed_pages;
    assert_eq!(backed, PAGES - 100 - 10 + 50);

    d.kill9();
    let d = start(&dir, &[&sock], &args);
    let mut c = Client::connect(&sock, 1).unwrap();
    check(&mut c, PAGES, 256, want, "after kill -9");
    let st = stat_dev(&d, "vm1");
    assert_eq!(st.stats.backed_pages, backed, "{st:?}");
    assert_eq!(backing_of(&st).used_blocks, backed, "{st:?}");
    assert!(st.stats.backed_reads >= backed, "{st:?}");
    assert!(
        d.log_text().contains("recovered the device from its state"),
        "{}",
        d.log_text()
    );
}

#[test]
fn the_ager_writes_back_and_recompresses_cold_pages_by_itself() {
    const PAGES: u64 = 2048; // 8 MiB each
    let dir = TempDir::new("tier-auto");
    let disk = DiskDir::new("auto");
    let backing = disk.file("wb.img", 16 * MIB);
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let d = start(
        &dir,
        &[&a, &b],
        &[
            "--device",
            &format!(
                "socket={},size=16M,name=wb,queues=1,backing-file={},idle-after=3s,auto-writeback=true",
                s(&a),
                s(&backing)
            ),
            "--device",
            &format!(
                "socket={},size=16M,name=rc,queues=1,idle-after=3s,auto-recompress=true",
                s(&b)
            ),
        ],
    );
    let mut ca = Client::connect(&a, 1).unwrap();
    let mut cb = Client::connect(&b, 1).unwrap();
    write_verified(&mut ca, PAGES, 256, 1).unwrap();
    write_verified(&mut cb, PAGES, 256, 1).unwrap();
    let t = Instant::now();
    // The ager runs every second; a page is cold after four passes.
    let deadline = t + Duration::from_secs(30);
    let mut slowest = Duration::ZERO;
    let (wb, rc) = loop {
        // Page 0 of `wb` stays in use: read every 300 ms, never cold.
        let r = Instant::now();
        assert_eq!(ca.q(0).read(0, PAGE).unwrap(), page(0, 1));
        slowest = slowest.max(r.elapsed());
        let (wb, rc) = (stat_dev(&d, "wb"), stat_dev(&d, "rc"));
        if wb.stats.backed_pages >= PAGES - 1 - 16 && rc.stats.pages_recompressed > PAGES / 2 {
            break (wb, rc);
        }
        assert!(
            Instant::now() < deadline,
            "after 30 s: wb {wb:?}\nrc {rc:?}\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    eprintln!(
        "after {:.1?}: wb backed_pages {} (mem_used_total {} KiB), rc pages_recompressed {}, saved {} KiB; \
         slowest read of the page in use meanwhile {slowest:.1?}",
        t.elapsed(),
        wb.stats.backed_pages,
        wb.stats.mem_used_total / 1024,
        rc.stats.pages_recompressed,
        rc.stats.recompress_saved_bytes / 1024
    );
    assert!(
        t.elapsed() >= Duration::from_secs(3),
        "cold before idle-after"
    );
    assert!(
        slowest < Duration::from_millis(500),
        "a read waited {slowest:?} behind the background passes"
    );
    assert!(
        wb.stats.backed_pages < PAGES,
        "the page in use was written back"
    );
    assert_eq!(wb.tier.idle_after_secs, Some(3));
    assert!(rc.tier.auto_recompress, "{rc:?}");
    check(&mut ca, PAGES, 256, |i| page(i, 1), "wb");
    check(&mut cb, PAGES, 256, |i| page(i, 1), "rc");
}

#[test]
fn an_added_device_gets_its_backing_file_and_remove_lets_go() {
    let dir = TempDir::new("tier-add");
    let disk = DiskDir::new("add");
    let backing = disk.file("vmb.img", 16 * MIB);
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let d = start(
        &dir,
        &[&a],
        &[
            "--device",
            &format!(
                "socket={},size=16M,name=vma,queues=1,backing-file={}",
                s(&a),
                s(&backing)
            ),
        ],
    );
    // The file is vma's: a device added with it is refused.
    let spec = format!(
        "socket={},size=16M,name=vmb,queues=1,backing-file={}",
        s(&b),
        s(&backing)
    );
    let o = d.vzram(&["add", "--device", &spec]);
    let e = one_line_exit_2(&o, "add with a taken file");
    assert!(
        e.contains(s(&backing)) && e.contains("in use by another device"),
        "{e}"
    );
    assert!(!b.exists(), "the refused device's socket stayed");
    let o = d.vzram(&[
        "add",
        "--device",
        &format!(
            "socket={},size=16M,name=vmb,backing-file={}/nope.img",
            s(&b),
            disk.0.display()
        ),
    ]);
    let e = one_line_exit_2(&o, "add with a missing file");
    assert!(
        e.contains("nope.img") && e.contains("does not exist"),
        "{e}"
    );

    // Once vma is removed, its file is free: vmb takes it and uses it.
    d.cli_ok(&["remove", "--device", "vma"]);
    assert!(backing.exists(), "remove deleted the backing file");
    d.cli_ok(&["add", "--device", &spec]);
    let mut c = Client::connect(&b, 1).unwrap();
    write_verified(&mut c, 1024, 256, 3).unwrap();
    let out = d.cli_ok(&["writeback", "--device", "vmb"]);
    assert!(out.starts_with("device vmb: wrote 1024 pages "), "{out}");
    check(&mut c, 1024, 256, |i| page(i, 3), "vmb after writeback");
    let st = stat_dev(&d, "vmb");
    assert_eq!(backing_of(&st).path, backing);
    assert_eq!(st.stats.backed_reads, 1024, "{st:?}");
}

#[test]
fn bad_backing_files_stop_the_start_with_one_line() {
    let dir = TempDir::new("tier-bad");
    let disk = DiskDir::new("bad");
    let sock = dir.join("v.sock");
    let small = disk.file("small.img", 4096);
    let good = disk.file("good.img", MIB);
    let missing = disk.0.join("missing.img");
    let base = ["--socket", s(&sock), "--size", "16M", "--name", "vm1"];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter()
            .chain(extra)
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
    };
    let run = |args: Vec<String>| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        serve_refused(&dir, &refs)
    };

    let e = one_line_exit_2(&run(with(&["--backing-file", s(&missing)])), "missing file");
    assert!(
        e.starts_with("error: device vm1: backing file") && e.contains(s(&missing)),
        "{e}"
    );
    let e = one_line_exit_2(&run(with(&["--backing-file", s(&small)])), "small file");
    assert!(e.contains(s(&small)) && e.contains("needs at least"), "{e}");
    assert!(!sock.exists(), "a refused start left its socket");

    // Two devices, one file: by the same path, and by another path to it.
    let other = dir.join("w.sock");
    let two = |second: &Path| {
        vec![
            "--device".to_string(),
            format!(
                "socket={},size=1M,name=a,backing-file={}",
                s(&sock),
                s(&good)
            ),
            "--device".to_string(),
            format!(
                "socket={},size=1M,name=b,backing-file={}",
                s(&other),
                s(second)
            ),
        ]
    };
    let e = one_line_exit_2(&run(two(&good)), "same path twice");
    assert!(
        e.contains(&format!("backing file {}", s(&good))) && e.contains("devices a and b"),
        "{e}"
    );
    let link = disk.0.join("link.img");
    std::os::unix::fs::symlink(&good, &link).unwrap();
    let e = one_line_exit_2(&run(two(&link)), "same file, another path");
    assert!(
        e.contains(s(&link)) && e.contains("in use by another device"),
        "{e}"
    );

    // Automatic tiering without what it needs.
    let e = one_line_exit_2(&run(with(&["--auto-writeback"])), "auto-writeback alone");
    assert!(e.contains("backing-file"), "{e}");
    let e = one_line_exit_2(
        &run(with(&["--backing-file", s(&good), "--auto-writeback"])),
        "auto-writeback without idle-after",
    );
    assert!(e.contains("idle-after"), "{e}");
    let e = one_line_exit_2(&run(with(&["--idle-after", "10"])), "a bare number");
    assert!(e.contains("10"), "{e}");

    // A device without a backing file: writeback is refused, the daemon
    // stays up.
    let d = start(&dir, &[&sock], &base);
    let o = d.vzram(&["writeback", "--device", "vm1"]);
    let e = one_line_exit_2(&o, "writeback without a backing file");
    assert!(e.contains("vm1 has no backing file"), "{e}");
    assert_eq!(d.stat().devices()[0].tier.backing, None);
}

/// Whether the file system of `path` takes O_DIRECT.
fn takes_o_direct(path: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(_) => true,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => false,
        Err(e) => panic!("{}: {e}", path.display()),
    }
}

#[test]
fn a_tmpfs_backing_file_works_with_or_without_direct_io() {
    // tmpfs refused O_DIRECT before Linux 6.6: then buffered I/O, shown as
    // such in the stat; either way every page comes back.
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("no /dev/shm; skipped");
        return;
    }
    let dir = TempDir::new("tier-shm");
    let file = shm.join(format!("vz-tier-shm-{}.img", std::process::id()));
    std::fs::File::create(&file)
        .unwrap()
        .set_len(8 * MIB)
        .unwrap();
    struct Remove<'a>(&'a Path);
    impl Drop for Remove<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(self.0);
        }
    }
    let _remove = Remove(&file);
    let sock = dir.join("v.sock");
    let d = start(
        &dir,
        &[&sock],
        &[
            "--socket",
            s(&sock),
            "--size",
            "8M",
            "--name",
            "vm1",
            "--queues",
            "1",
            "--backing-file",
            s(&file),
        ],
    );
    let mut c = Client::connect(&sock, 1).unwrap();
    write_verified(&mut c, 512, 128, 4).unwrap();
    let out = d.cli_ok(&["writeback", "--device", "vm1"]);
    assert!(out.starts_with("device vm1: wrote 512 pages "), "{out}");
    check(&mut c, 512, 128, |i| page(i, 4), "from tmpfs");
    let st = stat_dev(&d, "vm1");
    let direct = takes_o_direct(&file);
    eprintln!("/dev/shm takes O_DIRECT: {direct}");
    assert_eq!(backing_of(&st).direct_io, direct, "{st:?}");
    assert_eq!(st.stats.backed_reads, 512, "{st:?}");
    assert_eq!(
        d.log_text().contains("refuses O_DIRECT"),
        !direct,
        "{}",
        d.log_text()
    );
    let text = d.cli_ok(&["stat"]);
    let row = text
        .lines()
        .skip_while(|l| !l.starts_with("bd_stat"))
        .find(|l| l.starts_with("vm1 "))
        .unwrap_or_else(|| panic!("{text}"));
    assert_eq!(
        row.split_whitespace().take(4).collect::<Vec<_>>(),
        ["vm1", "2047", "512", if direct { "yes" } else { "no" }],
        "{text}"
    );
}
