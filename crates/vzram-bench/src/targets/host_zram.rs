//! A kernel zram device (lz4) exported by qemu-storage-daemon over vhost-user-blk:
//! what operators deploy instead of vzram. O_DIRECT (cache.direct=on), so the
//! host's page cache holds no second, uncompressed copy of the guest's data.
//!
//! The device is hot-added when the host can (`/sys/class/zram-control`), so it
//! is ours alone and no one else's configuration is touched; otherwise a free one
//! is taken. Either way it is reset, and a hot-added one removed, on drop. Paths
//! hang off a root ("/" but in tests) so the choice can be tested on a fake tree.

use super::qsd;
use super::target::{BlockTarget, Env, Memory, StatSizes};
use crate::error::{bail, Context, Result};
use crate::sys::{daemon_rss, proc_mem, Daemon};
use std::collections::HashSet;
use std::ffi::CString;
use std::fs;
use std::io::ErrorKind;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Bytes of zram's per-slot table entry (a handle and flags; `zram_table_entry`),
/// allocated for the whole disk when its size is set and not in `mm_stat`. More
/// with CONFIG_ZRAM_TRACK_ENTRY_ACTIVITY, so an estimate.
const TABLE_ENTRY_BYTES: u64 = 16;
const PAGE: u64 = 4096;

fn control(root: &Path) -> PathBuf {
    root.join("sys/class/zram-control")
}

fn sys_dir(root: &Path, index: u32) -> PathBuf {
    root.join(format!("sys/block/zram{index}"))
}

/// The zram devices under `root`'s /sys/block, by index.
fn devices(root: &Path) -> Vec<u32> {
    let mut v: Vec<u32> = fs::read_dir(root.join("sys/block"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("zram")?.parse().ok())
        .collect();
    v.sort_unstable();
    v
}

/// Device names ("zram0") that are swap or mounted: the first column of
/// /proc/swaps (after its header) and of /proc/mounts.
fn busy_names(root: &Path) -> HashSet<String> {
    let mut out = HashSet::new();
    for (file, skip) in [("proc/swaps", 1), ("proc/mounts", 0)] {
        let s = fs::read_to_string(root.join(file)).unwrap_or_default();
        for line in s.lines().skip(skip) {
            let Some(dev) = line.split_whitespace().next() else {
                continue;
            };
            if let Some(name) = Path::new(dev).file_name().and_then(|n| n.to_str()) {
                out.insert(name.to_string());
            }
        }
    }
    out
}

/// A device no one uses: no size set (so no swap, file system or data on it),
/// nothing an admin set up before sizing it (a backing device, a memory
/// limit: our reset would clear them), no holder (device-mapper, md), not in
/// /proc/swaps or /proc/mounts.
fn is_free(root: &Path, index: u32, busy: &HashSet<String>) -> bool {
    let dir = sys_dir(root, index);
    let read = |f: &str| fs::read_to_string(dir.join(f)).map(|s| s.trim().to_string());
    let no_size = read("disksize").is_ok_and(|s| s == "0");
    // Files a kernel without writeback or limits lacks count as unset.
    let no_backing = read("backing_dev").map_or(true, |s| s == "none");
    let no_limit = read("mem_limit").map_or(true, |s| s == "0");
    let held = fs::read_dir(dir.join("holders")).is_ok_and(|mut d| d.next().is_some());
    no_size && no_backing && no_limit && !held && !busy.contains(&format!("zram{index}"))
}

/// The free zram devices, lowest index first.
pub fn free_devices(root: &Path) -> Vec<u32> {
    let busy = busy_names(root);
    devices(root)
        .into_iter()
        .filter(|&i| is_free(root, i, &busy))
        .collect()
}

/// How a run gets its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pick {
    HotAdd,
    Existing(u32),
}

/// Hot-add when the host can, else the first free device.
fn pick(root: &Path) -> Option<Pick> {
    if control(root).join("hot_add").exists() {
        return Some(Pick::HotAdd);
    }
    free_devices(root).first().map(|&i| Pick::Existing(i))
}

/// The algorithms of a `comp_algorithm` file: "[lzo-rle] lzo lz4" (the current
/// one in brackets).
fn algorithms(s: &str) -> Vec<&str> {
    s.split_whitespace()
        .map(|a| a.trim_start_matches('[').trim_end_matches(']'))
        .collect()
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The bracketed (current) algorithm of a `comp_algorithm` file.
fn current_algorithm(s: &str) -> Option<&str> {
    s.split_whitespace()
        .find_map(|a| a.strip_prefix('[')?.strip_suffix(']'))
}

/// Whether this process may write `path` (a read-only sysfs says no even to root).
fn writable(path: &Path) -> std::result::Result<(), String> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    let r = unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), libc::W_OK, libc::AT_EACCESS) };
    if r == 0 {
        Ok(())
    } else {
        Err(format!(
            "cannot write {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ))
    }
}

/// Why this host cannot run the target, if it cannot; checked before any run so
/// that the target is skipped, not failed. `/` and the real uid but in tests.
pub fn probe(root: &Path, euid: u32) -> std::result::Result<(), String> {
    if euid != 0 {
        return Err(format!("needs root to set up a zram device (euid {euid})"));
    }
    let all = devices(root);
    let path = match pick(root) {
        Some(Pick::HotAdd) => control(root).join("hot_remove"),
        Some(Pick::Existing(i)) => sys_dir(root, i).join("disksize"),
        None if all.is_empty() => {
            return Err("no zram on this host (no /sys/class/zram-control, no \
                        /sys/block/zram*; modprobe zram)"
                .into())
        }
        None => {
            return Err("every zram device is in use and there is no \
                        /sys/class/zram-control to add one"
                .into())
        }
    };
    writable(&path)?;
    // Algorithms are the module's, the same on every device.
    if let Some(&i) = all.first() {
        let s = fs::read_to_string(sys_dir(root, i).join("comp_algorithm")).unwrap_or_default();
        if !algorithms(&s).contains(&"lz4") {
            return Err(format!("zram offers no lz4 (comp_algorithm: {})", s.trim()));
        }
    }
    Ok(())
}

/// [`probe`] on this host.
pub fn probe_host() -> std::result::Result<(), String> {
    probe(Path::new("/"), euid())
}

/// A zram device's `mm_stat`: bytes, then page counts. `huge_pages` (5.x) and
/// `huge_pages_since` (6.x) are missing on older kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MmStat {
    pub orig_data_size: u64,
    pub compr_data_size: u64,
    pub mem_used_total: u64,
    pub mem_limit: u64,
    pub mem_used_max: u64,
    pub same_pages: u64,
    pub pages_compacted: u64,
    pub huge_pages: Option<u64>,
    pub huge_pages_since: Option<u64>,
}

pub fn parse_mm_stat(s: &str) -> Result<MmStat> {
    let v: Vec<u64> = s
        .split_whitespace()
        .map(|f| f.parse::<u64>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| format!("mm_stat {:?}: {e}", s.trim()))?;
    if v.len() < 7 {
        bail!("mm_stat {:?}: want at least 7 fields", s.trim());
    }
    Ok(MmStat {
        orig_data_size: v[0],
        compr_data_size: v[1],
        mem_used_total: v[2],
        mem_limit: v[3],
        mem_used_max: v[4],
        same_pages: v[5],
        pages_compacted: v[6],
        huge_pages: v.get(7).copied(),
        huge_pages_since: v.get(8).copied(),
    })
}

/// Write a sysfs attribute, retrying while the device is busy: udev opens it
/// (blkid) for a moment after each change event.
fn write_attr(path: &Path, value: &str, patience: Duration) -> Result<()> {
    let t0 = Instant::now();
    loop {
        match fs::write(path, value) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::ResourceBusy && t0.elapsed() < patience => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => bail!("writing {value:?} to {}: {e}", path.display()),
        }
    }
}

/// A zram device set up for one run.
pub struct ZramDev {
    root: PathBuf,
    index: u32,
    hot_added: bool,
    /// Its disksize is ours to reset: set by us, not by whoever else might share it.
    sized: bool,
    disksize: u64,
    /// An existing device's algorithm before we set lz4, to give back.
    prev_algo: Option<String>,
}

impl ZramDev {
    /// A device of `size` bytes compressing with lz4.
    pub fn setup(root: &Path, size: u64) -> Result<ZramDev> {
        let known = devices(root);
        let (index, hot_added) = match pick(root) {
            Some(Pick::HotAdd) => match fs::read_to_string(control(root).join("hot_add")) {
                Ok(s) => match s.trim().parse() {
                    Ok(i) => (i, true),
                    Err(e) => {
                        // Take back what the read added, found by name.
                        let before: HashSet<u32> = known.into_iter().collect();
                        for i in devices(root).into_iter().filter(|i| !before.contains(i)) {
                            let _ = fs::write(control(root).join("hot_remove"), i.to_string());
                        }
                        bail!("hot_add said {:?}: {e}", s.trim());
                    }
                },
                // Out of device numbers, say: a free one will do.
                Err(e) => match free_devices(root).first() {
                    Some(&i) => (i, false),
                    None => bail!("zram hot_add: {e}, and no free zram device"),
                },
            },
            Some(Pick::Existing(i)) => (i, false),
            None => bail!("no free zram device"),
        };
        let mut dev = ZramDev {
            root: root.to_path_buf(),
            index,
            hot_added,
            sized: false,
            disksize: 0,
            prev_algo: None,
        };
        let dir = sys_dir(root, index);
        if !hot_added {
            let s = fs::read_to_string(dir.join("comp_algorithm")).unwrap_or_default();
            dev.prev_algo = current_algorithm(&s).map(str::to_string);
        }
        // The algorithm can only be changed while the device has no size.
        write_attr(&dir.join("comp_algorithm"), "lz4", Duration::ZERO)?;
        write_attr(&dir.join("disksize"), &size.to_string(), Duration::ZERO)?;
        dev.sized = true;
        let set = fs::read_to_string(dir.join("disksize")).unwrap_or_default();
        dev.disksize = set.trim().parse().unwrap_or(size);
        // devtmpfs makes the node when the disk is added; give it a moment anyway.
        let t0 = Instant::now();
        while !dev.path().exists() {
            if t0.elapsed() > Duration::from_secs(2) {
                bail!("{} did not appear", dev.path().display());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(dev)
    }

    pub fn path(&self) -> PathBuf {
        self.root.join(format!("dev/zram{}", self.index))
    }

    pub fn mm_stat(&self) -> Result<MmStat> {
        let p = sys_dir(&self.root, self.index).join("mm_stat");
        parse_mm_stat(&fs::read_to_string(&p).context(format!("reading {}", p.display()))?)
    }

    /// zram's slot table: one entry per page of the disk.
    pub fn table_bytes(&self) -> u64 {
        self.disksize.div_ceil(PAGE) * TABLE_ENTRY_BYTES
    }

    /// Reset (frees the data) and remove what we added, or give back the
    /// algorithm we changed; says what could not be done.
    fn release(&mut self) -> Result<()> {
        let patience = Duration::from_secs(5);
        let dir = sys_dir(&self.root, self.index);
        let mut errs = Vec::new();
        if std::mem::take(&mut self.sized) {
            if let Err(e) = write_attr(&dir.join("reset"), "1", patience) {
                errs.push(e.0);
            }
        }
        if std::mem::take(&mut self.hot_added) {
            let index = self.index.to_string();
            if let Err(e) = write_attr(&control(&self.root).join("hot_remove"), &index, patience) {
                errs.push(e.0);
            }
        } else if let Some(a) = self.prev_algo.take() {
            // Older kernels keep the algorithm over a reset.
            let now = fs::read_to_string(dir.join("comp_algorithm")).unwrap_or_default();
            if current_algorithm(&now) != Some(a.as_str()) {
                if let Err(e) = write_attr(&dir.join("comp_algorithm"), &a, Duration::ZERO) {
                    errs.push(e.0);
                }
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            bail!("{}", errs.join("; "))
        }
    }
}

impl Drop for ZramDev {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            eprintln!("host-zram: WARNING: zram{} left set up: {e}", self.index);
        }
    }
}

pub struct HostZram {
    daemon: Daemon,
    socket: PathBuf,
    /// Dropped after the daemon has been stopped (it holds the device open).
    dev: ZramDev,
}

impl HostZram {
    pub fn start(env: &Env, queues: u32, size: u64, seq: usize) -> Result<HostZram> {
        let dev = ZramDev::setup(Path::new("/"), size)?;
        // discard=unmap: a guest's discards reach zram, the only way it frees pages.
        let blockdev = format!(
            "driver=host_device,filename={},aio=io_uring,cache.direct=on,discard=unmap",
            dev.path().display()
        );
        let (daemon, socket) = qsd::spawn(env, "host-zram", &blockdev, queues, seq)?;
        Ok(HostZram {
            daemon,
            socket,
            dev,
        })
    }
}

impl BlockTarget for HostZram {
    fn socket(&self) -> &Path {
        &self.socket
    }

    fn daemon(&mut self) -> &mut Daemon {
        &mut self.daemon
    }

    fn memory(&mut self) -> Result<Memory> {
        let proc = proc_mem(self.daemon.pid())?;
        let tree = daemon_rss(self.daemon.pid())?;
        let mm = self.dev.mm_stat()?;
        // The compressed pages and allocator overhead, plus the slot table.
        let extra = mm.mem_used_total + self.dev.table_bytes();
        Ok(Memory {
            host_bytes: tree.own() + extra,
            proc,
            extra_bytes: extra,
            tree,
            details: serde_json::json!({
                "device": self.dev.path(),
                "hot_added": self.dev.hot_added,
                "disksize": self.dev.disksize,
                "mem_used_total": mm.mem_used_total,
                "compr_data_size": mm.compr_data_size,
                "orig_data_size": mm.orig_data_size,
                "table_bytes_est": self.dev.table_bytes(),
                "mm_stat": mm,
            }),
            stat_sizes: Some(StatSizes {
                mem_used_total: mm.mem_used_total,
                compr_data_size: mm.compr_data_size,
                orig_data_size: mm.orig_data_size,
            }),
        })
    }
}

impl Drop for HostZram {
    fn drop(&mut self) {
        // Before `dev` is dropped: a device held open cannot be reset.
        let _ = self.daemon.stop();
        let _ = fs::remove_file(&self.socket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake root: /sys/block/zramN with `disksize` and `comp_algorithm`,
    /// optionally zram-control, /proc/swaps and /proc/mounts.
    struct Fake(PathBuf);

    impl Fake {
        fn new(tag: &str) -> Fake {
            let p =
                std::env::temp_dir().join(format!("vzram-bench-zram-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(p.join("sys/block")).unwrap();
            fs::create_dir_all(p.join("proc")).unwrap();
            fs::create_dir_all(p.join("dev")).unwrap();
            Fake(p)
        }

        fn zram(&self, index: u32, disksize: u64) -> &Fake {
            let d = sys_dir(&self.0, index);
            fs::create_dir_all(d.join("holders")).unwrap();
            fs::write(d.join("disksize"), format!("{disksize}\n")).unwrap();
            fs::write(d.join("comp_algorithm"), "[lzo-rle] lzo lz4 \n").unwrap();
            fs::write(self.0.join(format!("dev/zram{index}")), "").unwrap();
            self
        }

        fn control(&self, next: u32) -> &Fake {
            fs::create_dir_all(control(&self.0)).unwrap();
            fs::write(control(&self.0).join("hot_add"), format!("{next}\n")).unwrap();
            fs::write(control(&self.0).join("hot_remove"), "").unwrap();
            self
        }

        fn file(&self, path: &str, text: &str) -> &Fake {
            fs::write(self.0.join(path), text).unwrap();
            self
        }

        fn read(&self, path: &str) -> String {
            fs::read_to_string(self.0.join(path)).unwrap_or_default()
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn parses_mm_stat() {
        let s =
            "  8388608  2906311  3178496        0  3178496      112        0       37        0\n";
        let m = parse_mm_stat(s).unwrap();
        assert_eq!(
            (m.orig_data_size, m.compr_data_size, m.mem_used_total),
            (8388608, 2906311, 3178496)
        );
        assert_eq!(
            (m.mem_limit, m.mem_used_max, m.same_pages),
            (0, 3178496, 112)
        );
        assert_eq!(
            (m.pages_compacted, m.huge_pages, m.huge_pages_since),
            (0, Some(37), Some(0))
        );
        // An older kernel's seven fields.
        let m = parse_mm_stat("1 2 3 4 5 6 7").unwrap();
        assert_eq!((m.pages_compacted, m.huge_pages), (7, None));
        assert!(parse_mm_stat("1 2 3").is_err());
        assert!(parse_mm_stat("1 2 x 4 5 6 7").is_err());
        assert!(parse_mm_stat("").is_err());
    }

    #[test]
    fn reads_algorithms() {
        assert_eq!(
            algorithms("[lzo-rle] lzo lz4 \n"),
            ["lzo-rle", "lzo", "lz4"]
        );
        assert_eq!(current_algorithm("lzo-rle lzo [lz4]\n"), Some("lz4"));
        assert_eq!(current_algorithm("lzo lz4"), None);
    }

    #[test]
    fn only_unused_devices_are_free() {
        let f = Fake::new("free");
        // 0: has a size; 1: swap; 2: mounted; 3: held by device-mapper; 4 and 6: free.
        f.zram(0, 1 << 30);
        for i in 1..=4 {
            f.zram(i, 0);
        }
        f.zram(6, 0);
        f.file(
            "proc/swaps",
            "Filename\tType\tSize\tUsed\tPriority\n/dev/zram1  partition\t1024\t0\t100\n",
        );
        f.file(
            "proc/mounts",
            "/dev/zram2 /mnt ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n",
        );
        fs::write(sys_dir(&f.0, 3).join("holders/dm-0"), "").unwrap();
        assert_eq!(free_devices(&f.0), [4, 6]);
        // Set up by an admin but not yet sized: a backing device, a limit.
        f.zram(8, 0);
        fs::write(sys_dir(&f.0, 8).join("backing_dev"), "/dev/sdb1\n").unwrap();
        f.zram(9, 0);
        fs::write(sys_dir(&f.0, 9).join("mem_limit"), "1073741824\n").unwrap();
        f.zram(10, 0);
        fs::write(sys_dir(&f.0, 10).join("backing_dev"), "none\n").unwrap();
        fs::write(sys_dir(&f.0, 10).join("mem_limit"), "0\n").unwrap();
        assert_eq!(free_devices(&f.0), [4, 6, 10]);
        // Without zram-control, the lowest free one; with it, a new one.
        assert_eq!(pick(&f.0), Some(Pick::Existing(4)));
        f.control(7);
        assert_eq!(pick(&f.0), Some(Pick::HotAdd));
    }

    #[test]
    fn probe_says_why_not() {
        let f = Fake::new("probe");
        let e = probe(&f.0, 0).unwrap_err();
        assert!(e.contains("no zram on this host"), "{e}");
        f.zram(0, 1 << 30);
        let e = probe(&f.0, 0).unwrap_err();
        assert!(e.contains("every zram device is in use"), "{e}");
        f.zram(1, 0);
        assert_eq!(probe(&f.0, 0), Ok(()));
        let e = probe(&f.0, 1000).unwrap_err();
        assert!(e.contains("needs root"), "{e}");
        f.file("sys/block/zram0/comp_algorithm", "[lzo-rle] lzo\n");
        let e = probe(&f.0, 0).unwrap_err();
        assert!(e.contains("no lz4"), "{e}");
        // Hot-adding needs no free device.
        let g = Fake::new("probe-control");
        g.control(0);
        assert_eq!(probe(&g.0, 0), Ok(()));
    }

    #[test]
    fn hot_added_device_is_set_up_then_reset_and_removed() {
        let f = Fake::new("hot");
        f.zram(0, 1 << 30).control(5).zram(5, 0);
        let dev = ZramDev::setup(&f.0, 64 << 20).unwrap();
        assert_eq!((dev.index, dev.hot_added, dev.sized), (5, true, true));
        assert_eq!(f.read("sys/block/zram5/comp_algorithm"), "lz4");
        assert_eq!(
            f.read("sys/block/zram5/disksize"),
            (64u64 << 20).to_string()
        );
        assert_eq!(dev.table_bytes(), (64 << 20) / 4096 * 16);
        f.file("sys/block/zram5/mm_stat", "10 4 8192 0 8192 0 0 0 0\n");
        assert_eq!(dev.mm_stat().unwrap().mem_used_total, 8192);
        drop(dev);
        assert_eq!(f.read("sys/block/zram5/reset"), "1");
        assert_eq!(f.read("sys/class/zram-control/hot_remove"), "5");
        // The device in use was not touched.
        assert_eq!(
            f.read("sys/block/zram0/disksize"),
            format!("{}\n", 1u64 << 30)
        );
        assert!(!sys_dir(&f.0, 0).join("reset").exists());
    }

    #[test]
    fn existing_device_gets_its_algorithm_back() {
        let f = Fake::new("existing");
        f.zram(0, 1 << 30).zram(1, 0);
        let dev = ZramDev::setup(&f.0, 1 << 20).unwrap();
        assert_eq!((dev.index, dev.hot_added), (1, false));
        drop(dev);
        assert_eq!(f.read("sys/block/zram1/reset"), "1");
        // The fake's reset keeps "lz4": it is set back.
        assert_eq!(f.read("sys/block/zram1/comp_algorithm"), "lzo-rle");
    }

    #[test]
    fn a_size_we_could_not_set_is_not_reset() {
        let f = Fake::new("busy");
        f.control(2).zram(2, 0);
        // A write that fails: someone else's device, say.
        let disksize = sys_dir(&f.0, 2).join("disksize");
        fs::remove_file(&disksize).unwrap();
        fs::create_dir(&disksize).unwrap();
        assert!(ZramDev::setup(&f.0, 1 << 20).is_err());
        assert!(!sys_dir(&f.0, 2).join("reset").exists());
        // What we added is removed all the same.
        assert_eq!(f.read("sys/class/zram-control/hot_remove"), "2");
    }
}
