//! The backing file: 4 KiB blocks on host storage that written-back pages
//! move to (zram's `backing_dev`). Block 0 of the file holds a header naming
//! the device that owns it; page blocks follow. Which blocks are in use is
//! stored nowhere: each written-back slot word names its block, and the map
//! is rebuilt from the slot table, like everything else in the store.
//!
//! The file is opened with `O_DIRECT`, so pages moved out of memory do not
//! come straight back as page cache. A file system that refuses `O_DIRECT`
//! (tmpfs) gets buffered I/O with `POSIX_FADV_DONTNEED` after each write,
//! and [`Backing::direct`] says so.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use crate::error::{Result, StoreError};
use crate::mmap::Region;
use crate::PAGE_SIZE;

const MAGIC: [u8; 8] = *b"VZRAMBK\0";
const VERSION: u32 = 1;

/// Where a device's backing file is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackingSpec {
    pub path: PathBuf,
}

/// What block 0 says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BackingHeader {
    /// The owning device's state creation id (a random id for a device
    /// without state).
    pub owner: u64,
    /// Page blocks the file had when the owner claimed it.
    pub blocks: u64,
}

pub struct Backing {
    file: File,
    path: PathBuf,
    direct: bool,
    blocks: u64,
    /// The header found at open, if block 0 held one.
    found: Option<BackingHeader>,
    map: Mutex<BlockMap>,
    used: AtomicU64,
}

struct BlockMap {
    bits: Vec<u64>,
    /// Where the next search starts: allocations come out in runs, so a
    /// batch of pages is usually one contiguous write.
    hint: u64,
}

/// Page-aligned memory, as `O_DIRECT` needs for its buffers.
pub struct AlignedPages {
    region: Region,
    pages: usize,
}

impl AlignedPages {
    pub fn new(pages: usize) -> Result<AlignedPages> {
        Ok(AlignedPages {
            region: Region::reserve(pages * PAGE_SIZE)?,
            pages,
        })
    }

    pub fn pages(&self) -> usize {
        self.pages
    }

    pub fn bytes(&self, first: usize, n: usize) -> &[u8] {
        assert!(first + n <= self.pages);
        // SAFETY: inside the region, which this value owns; the shared borrow
        // of self rules out a mutable one.
        unsafe {
            std::slice::from_raw_parts(self.region.as_ptr().add(first * PAGE_SIZE), n * PAGE_SIZE)
        }
    }

    /// Every page, as one slice.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the whole region, which this value owns; the mutable
        // borrow of self makes this the only reference to it.
        unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr(), self.pages * PAGE_SIZE) }
    }

    pub fn page_mut(&mut self, i: usize) -> &mut crate::Page {
        assert!(i < self.pages);
        // SAFETY: page i lies inside the region, which this value owns, and
        // the mutable borrow of self makes this the only reference to it.
        unsafe {
            &mut *self
                .region
                .as_ptr()
                .add(i * PAGE_SIZE)
                .cast::<crate::Page>()
        }
    }
}

impl std::fmt::Debug for AlignedPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedPages({})", self.pages)
    }
}

/// How much of a block device `vzram backing init` reads to tell that
/// it is blank (a whole disk would take minutes).
pub const BLANK_SCAN_DEVICE: u64 = 64 << 20;

/// The process that holds `path` locked (`flock`), from /proc/locks.
fn lock_holder(path: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    let dev = m.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let id = format!("{major:02x}:{minor:02x}:{}", m.ino());
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"
        (f.len() >= 6 && f[1] == "FLOCK" && f[5] == id)
            .then(|| f[4].parse().ok())
            .flatten()
    })
}

fn err(path: &Path, what: impl std::fmt::Display) -> StoreError {
    StoreError::backing(format_args!("{}: {what}", path.display()), None)
}

/// `doing` on the file failed with `e`.
fn os_err(path: &Path, doing: impl std::fmt::Display, e: std::io::Error) -> StoreError {
    StoreError::backing(format_args!("{}: {doing}", path.display()), e)
}

impl Backing {
    /// Opens an existing file or block device for a device's pages and
    /// locks it, so no other device or daemon can use it at the same time.
    pub fn open(spec: &BackingSpec) -> Result<Backing> {
        Backing::open_checked(spec, true)
    }

    /// [`Backing::open`]; `check` false skips what block 0 holds (for
    /// [`Backing::init`], which overwrites it).
    fn open_checked(spec: &BackingSpec, check: bool) -> Result<Backing> {
        let path = spec.path.clone();
        // A state's own files are never pages for a backing file, whatever
        // lock their owner holds or does not hold right now.
        if let Some(dir) = std::fs::canonicalize(&path)
            .ok()
            .and_then(|p| crate::state::enclosing_state(&p))
        {
            return Err(err(
                &path,
                format!(
                    "is inside the state of a device ({}); left alone",
                    dir.display()
                ),
            ));
        }
        let open = |direct: bool| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(if direct { libc::O_DIRECT } else { 0 })
                .open(&path)
        };
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(
                    "{}: the file system refuses O_DIRECT; using buffered I/O and dropping \
                     written pages from the page cache",
                    path.display()
                );
                (
                    open(false).map_err(|e| StoreError::backing(path.display(), e))?,
                    false,
                )
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(err(
                    &path,
                    "does not exist (create it first, e.g. `fallocate -l 4G PATH`)",
                ))
            }
            Err(e) => return Err(StoreError::backing(path.display(), e)),
        };
        Backing::from_file_checked(file, path, direct, check)
    }

    /// A backing file already open (handed over by another process).
    pub fn from_file(file: File, path: PathBuf, direct: bool) -> Result<Backing> {
        Backing::from_file_checked(file, path, direct, true)
    }

    fn from_file_checked(file: File, path: PathBuf, direct: bool, check: bool) -> Result<Backing> {
        let meta = file
            .metadata()
            .map_err(|e| StoreError::backing(path.display(), e))?;
        use std::os::unix::fs::FileTypeExt;
        let ft = meta.file_type();
        if !ft.is_file() && !ft.is_block_device() {
            return Err(err(&path, "is neither a regular file nor a block device"));
        }
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                err(
                    &path,
                    "is in use by another device (two devices cannot share one backing file)",
                )
            } else {
                StoreError::backing(path.display(), e)
            });
        }
        let bytes = if ft.is_block_device() {
            use std::io::Seek;
            (&file)
                .seek(std::io::SeekFrom::End(0))
                .map_err(|e| StoreError::backing(path.display(), e))?
        } else {
            meta.len()
        };
        let blocks = (bytes / PAGE_SIZE as u64).saturating_sub(1);
        if blocks < 1 {
            return Err(err(
                &path,
                format!(
                    "is {bytes} bytes; it needs at least {} (a header block and a page)",
                    2 * PAGE_SIZE
                ),
            ));
        }
        let blocks = blocks.min(crate::slot::MAX_BLOCKS);
        let mut b = Backing {
            file,
            path,
            direct,
            blocks,
            found: None,
            map: Mutex::new(BlockMap {
                bits: vec![0; blocks.div_ceil(64) as usize],
                hint: 0,
            }),
            used: AtomicU64::new(0),
        };
        if check {
            b.found = b.read_header()?;
        }
        Ok(b)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes `path` a blank backing file that any device may claim (`vzram
    /// backing init`): its header block is zeroed, so whatever it held
    /// before (another device's pages) is given up on purpose. Refused
    /// while a device holds it, for a state's file, and, unless `force`,
    /// for a file that is neither blank (zeros or holes) nor a vzram
    /// backing file: a path typed wrong must not lose someone's data.
    pub fn init(path: &Path, force: bool) -> Result<u64> {
        let b = Backing::open_checked(
            &BackingSpec {
                path: path.to_path_buf(),
            },
            false,
        )
        .map_err(|e| match lock_holder(path) {
            Some(pid) => err(
                path,
                format!("is in use: process {pid} holds it (a device's backing file); remove that device first"),
            ),
            None => e,
        })?;
        let mut buf = AlignedPages::new(1)?;
        b.file
            .read_exact_at(buf.page_mut(0), 0)
            .map_err(|e| os_err(&b.path, "reading its header", e))?;
        let head = buf.page_mut(0);
        if crate::state::is_state_header(head) {
            return Err(err(
                &b.path,
                "holds a device state's header, not a backing file; left alone",
            ));
        }
        if head[0..8] != MAGIC && !force {
            if let Some(at) = b.first_data()? {
                return Err(err(
                    &b.path,
                    format!(
                        "is neither blank nor a vzram backing file (byte {at} is not zero); left alone: \
                         `vzram backing init {} --force` overwrites its first 4 KiB",
                        b.path.display()
                    ),
                ));
            }
        }
        b.release()?;
        Ok(b.blocks)
    }

    /// Where the first byte that is not zero is, if any: only the data
    /// of a regular file is read (its holes are zeros); a block device is
    /// read up to [`BLANK_SCAN_DEVICE`].
    fn first_data(&self) -> Result<Option<u64>> {
        use std::os::unix::fs::FileTypeExt;
        let meta = self
            .file
            .metadata()
            .map_err(|e| StoreError::backing(self.path.display(), e))?;
        let ranges = if meta.file_type().is_block_device() {
            let end = BLANK_SCAN_DEVICE.min((self.blocks + 1) * PAGE_SIZE as u64);
            std::iter::once(0..end).collect()
        } else {
            crate::state::data_ranges(&self.file)
        };
        const CHUNK: usize = 256;
        let mut buf = AlignedPages::new(CHUNK)?;
        for r in ranges {
            // O_DIRECT reads start on a page and are whole pages.
            let mut at = r.start / PAGE_SIZE as u64 * PAGE_SIZE as u64;
            while at < r.end {
                let n = self
                    .file
                    .read_at(buf.bytes_mut(), at)
                    .map_err(|e| os_err(&self.path, "reading it", e))?;
                if n == 0 {
                    break;
                }
                let got = &buf.bytes(0, CHUNK)[..n];
                if let Some(i) = got.iter().position(|&b| b != 0) {
                    return Ok(Some(at + i as u64));
                }
                at += n as u64;
            }
        }
        Ok(None)
    }

    /// Blanks the header block: the pages the file held are nobody's, and
    /// any device may take it (its owner was removed, or `init`).
    pub fn release(&self) -> Result<()> {
        let buf = AlignedPages::new(1)?;
        self.file
            .write_all_at(buf.bytes(0, 1), 0)
            .and_then(|()| self.file.sync_data())
            .map_err(|e| os_err(&self.path, "writing its header", e))
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Page blocks in the file.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Page blocks in use.
    pub fn used(&self) -> u64 {
        self.used.load(Relaxed)
    }

    fn read_header(&self) -> Result<Option<BackingHeader>> {
        let mut buf = AlignedPages::new(1)?;
        let page = buf.page_mut(0);
        self.file
            .read_exact_at(page, 0)
            .map_err(|e| os_err(&self.path, "reading its header", e))?;
        if crate::state::is_state_header(page) {
            return Err(err(
                &self.path,
                "holds a device state's header, not a backing file; left alone",
            ));
        }
        if page[0..8] != MAGIC {
            // A blank file is anyone's; data that is not vzram's is not.
            if page.iter().all(|&b| b == 0) {
                return Ok(None);
            }
            return Err(err(
                &self.path,
                format!(
                    "holds data that is not a vzram backing file (its first 4 KiB are not blank); \
                     left alone: `vzram backing init {} --force` gives it up on purpose",
                    self.path.display()
                ),
            ));
        }
        let u64_at = |i: usize| u64::from_le_bytes(page[i..i + 8].try_into().unwrap());
        let version = u32::from_le_bytes(page[8..12].try_into().unwrap());
        if version != VERSION {
            return Err(err(
                &self.path,
                format!(
                    "backing file format version {version}, this vzram reads version {VERSION}"
                ),
            ));
        }
        Ok(Some(BackingHeader {
            owner: u64_at(16),
            blocks: u64_at(24),
        }))
    }

    /// Whether the device `owner` (which replaced the state `replaced`,
    /// if any) may take this file: it is blank, or already its own or the
    /// replaced state's. Checked before anything is made or written.
    pub fn check_claim(&self, owner: u64, replaced: Option<u64>) -> Result<()> {
        match self.found {
            Some(h) if h.owner != owner && Some(h.owner) != replaced => Err(err(
                &self.path,
                format!(
                    "holds another device's written-back pages (its block 0 names the state with creation id {:016x}, \
                     this device's state is {owner:016x}); left alone: \
                     `vzram backing init {}` gives them up on purpose",
                    h.owner,
                    self.path.display()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Makes the file the device `owner`'s, unless it already is: only a
    /// blank file, or one that held the pages of `replaced` (the state this
    /// device discarded with --fresh). Another device's file is refused.
    pub(crate) fn claim(&self, owner: u64, replaced: Option<u64>) -> Result<()> {
        let want = BackingHeader {
            owner,
            blocks: self.blocks,
        };
        if self.found == Some(want) {
            return Ok(());
        }
        self.check_claim(owner, replaced)?;
        let mut buf = AlignedPages::new(1)?;
        let page = buf.page_mut(0);
        page[0..8].copy_from_slice(&MAGIC);
        page[8..12].copy_from_slice(&VERSION.to_le_bytes());
        page[12..16].copy_from_slice(&(PAGE_SIZE as u32).to_le_bytes());
        page[16..24].copy_from_slice(&owner.to_le_bytes());
        page[24..32].copy_from_slice(&self.blocks.to_le_bytes());
        self.file
            .write_all_at(buf.bytes(0, 1), 0)
            .and_then(|()| self.file.sync_data())
            .map_err(|e| os_err(&self.path, "writing its header", e))
    }

    /// Checks, during recovery, that written-back slots can trust this file:
    /// it must carry the owner's header and its size must not have changed.
    pub(crate) fn check_owner(&self, owner: u64) -> std::result::Result<(), String> {
        match self.found {
            Some(h) if h.owner == owner && h.blocks == self.blocks => Ok(()),
            Some(h) if h.owner == owner => Err(format!(
                "{} was resized: it had {} page blocks when pages were written to it, now {}",
                self.path.display(),
                h.blocks,
                self.blocks
            )),
            _ => Err(format!(
                "{} is not the backing file this device's pages were written to",
                self.path.display()
            )),
        }
    }

    /// Takes up to `n` free blocks, in ascending runs where it can.
    pub(crate) fn alloc(&self, n: usize) -> Vec<u64> {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::with_capacity(n);
        let total = self.blocks;
        let mut b = m.hint % total;
        let mut scanned = 0;
        while out.len() < n && scanned < total {
            let (w, bit) = ((b / 64) as usize, b % 64);
            if m.bits[w] == u64::MAX && bit == 0 && b + 64 <= total {
                b = (b + 64) % total;
                scanned += 64;
                continue;
            }
            if m.bits[w] & (1 << bit) == 0 {
                m.bits[w] |= 1 << bit;
                out.push(b);
            }
            b = (b + 1) % total;
            scanned += 1;
        }
        m.hint = b;
        self.used.fetch_add(out.len() as u64, Relaxed);
        out
    }

    /// Marks a block used during recovery; false if it already was (two
    /// slots naming one block: damaged state) or it is past the end.
    pub(crate) fn mark(&self, block: u64) -> bool {
        if block >= self.blocks {
            return false;
        }
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let (w, bit) = ((block / 64) as usize, block % 64);
        if m.bits[w] & (1 << bit) != 0 {
            return false;
        }
        m.bits[w] |= 1 << bit;
        self.used.fetch_add(1, Relaxed);
        true
    }

    pub(crate) fn free(&self, block: u64) {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let (w, bit) = ((block / 64) as usize, block % 64);
        debug_assert!(m.bits[w] & (1 << bit) != 0, "block {block} freed twice");
        if m.bits[w] & (1 << bit) != 0 {
            m.bits[w] &= !(1 << bit);
            self.used.fetch_sub(1, Relaxed);
        }
    }

    /// Forgets every block (a recovery that is about to rebuild the map).
    pub(crate) fn clear(&self) {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        m.bits.fill(0);
        m.hint = 0;
        self.used.store(0, Relaxed);
    }

    fn offset(block: u64) -> u64 {
        (block + 1) * PAGE_SIZE as u64
    }

    /// Writes consecutive pages to consecutive blocks starting at `first`.
    pub(crate) fn write(&self, first: u64, pages: &[u8]) -> Result<()> {
        debug_assert!(pages.len().is_multiple_of(PAGE_SIZE));
        let off = Backing::offset(first);
        self.file.write_all_at(pages, off).map_err(|e| {
            let doing = format!("write of {} bytes at {off}", pages.len());
            os_err(&self.path, doing, e)
        })?;
        if !self.direct {
            // SAFETY: advice on a descriptor we own; failure costs only cache.
            unsafe {
                libc::posix_fadvise(
                    self.file.as_raw_fd(),
                    off as i64,
                    pages.len() as i64,
                    libc::POSIX_FADV_DONTNEED,
                )
            };
        }
        Ok(())
    }

    /// Reads block `block` into `page` (page-aligned memory).
    pub(crate) fn read(&self, block: u64, page: &mut crate::Page) -> Result<()> {
        let off = Backing::offset(block);
        self.file
            .read_exact_at(page, off)
            .map_err(|e| os_err(&self.path, format_args!("read at {off}"), e))
    }
}

impl std::fmt::Debug for Backing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backing")
            .field("path", &self.path)
            .field("direct", &self.direct)
            .field("blocks", &self.blocks)
            .field("used", &self.used())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(blocks: u64) -> (tempdir::Dir, BackingSpec) {
        let d = tempdir::Dir::new();
        let path = d.0.join("backing");
        let f = File::create(&path).unwrap();
        f.set_len((blocks + 1) * PAGE_SIZE as u64).unwrap();
        (d, BackingSpec { path })
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                // Not tmpfs where we can help it, so O_DIRECT is exercised.
                let base = std::env::var_os("CARGO_TARGET_TMPDIR")
                    .map(std::path::PathBuf::from)
                    .unwrap_or_else(std::env::temp_dir);
                let p = base.join(format!(
                    "vzram-backing-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn blocks_round_trip_and_runs_are_contiguous() {
        let (_d, spec) = file(100);
        let b = Backing::open(&spec).unwrap();
        assert_eq!(b.blocks(), 100);
        let got = b.alloc(4);
        assert_eq!(got, vec![0, 1, 2, 3]);
        let mut buf = AlignedPages::new(4).unwrap();
        for i in 0..4 {
            buf.page_mut(i).fill(i as u8 + 1);
        }
        b.write(0, buf.bytes(0, 4)).unwrap();
        let mut one = AlignedPages::new(1).unwrap();
        b.read(2, one.page_mut(0)).unwrap();
        assert!(one.page_mut(0).iter().all(|&x| x == 3));
        b.free(1);
        assert_eq!(b.used(), 3);
        // Next-fit: the freed block comes back only after the rest.
        assert_eq!(b.alloc(96).len(), 96);
        assert_eq!(b.alloc(5), vec![1]);
        assert_eq!(b.alloc(1), Vec::<u64>::new());
    }

    #[test]
    fn two_devices_cannot_share_a_file() {
        let (_d, spec) = file(8);
        let _a = Backing::open(&spec).unwrap();
        let e = Backing::open(&spec).unwrap_err().to_string();
        assert!(e.contains("in use by another device"), "{e}");
    }

    #[test]
    fn too_small_or_missing_files_are_refused() {
        let (d, spec) = file(0);
        let e = Backing::open(&spec).unwrap_err().to_string();
        assert!(e.contains("needs at least"), "{e}");
        let missing = BackingSpec {
            path: d.0.join("nope"),
        };
        let e = Backing::open(&missing).unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
    }

    #[test]
    fn a_claimed_file_knows_its_owner_and_its_size() {
        let (_d, spec) = file(16);
        let b = Backing::open(&spec).unwrap();
        assert!(b.check_owner(7).is_err());
        b.claim(7, None).unwrap();
        drop(b);
        let b = Backing::open(&spec).unwrap();
        assert_eq!(b.check_owner(7), Ok(()));
        assert!(b
            .check_owner(8)
            .unwrap_err()
            .contains("not the backing file"));
        drop(b);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&spec.path)
            .unwrap()
            .set_len(33 * PAGE_SIZE as u64)
            .unwrap();
        let b = Backing::open(&spec).unwrap();
        assert!(b.check_owner(7).unwrap_err().contains("resized"));
    }

    #[test]
    fn only_blank_files_or_the_owners_own_are_claimed() {
        let (_d, spec) = file(16);
        let b = Backing::open(&spec).unwrap();
        b.claim(7, None).unwrap();
        drop(b);
        let b = Backing::open(&spec).unwrap();
        let e = b.claim(8, None).unwrap_err().to_string();
        assert!(e.contains("another device's"), "{e}");
        // A device that discarded state 7 (--fresh) takes its file back.
        b.claim(8, Some(7)).unwrap();
        drop(b);
        assert_eq!(Backing::init(&spec.path, false).unwrap(), 16);
        let b = Backing::open(&spec).unwrap();
        b.claim(9, None).unwrap();
        drop(b);
        // Data that is not vzram's, or a state's header, is left alone.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&spec.path)
            .unwrap()
            .write_all_at(b"#!/bin/sh\n", 0)
            .unwrap();
        let e = Backing::open(&spec).err().unwrap().to_string();
        assert!(e.contains("not a vzram backing file"), "{e}");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&spec.path)
            .unwrap()
            .write_all_at(b"VZRAMST\0", 0)
            .unwrap();
        let e = Backing::open(&spec).err().unwrap().to_string();
        assert!(e.contains("state's header"), "{e}");
        Backing::init(&spec.path, true).unwrap_err();
    }
}
