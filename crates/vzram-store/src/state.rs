//! A device's state as files, so that it outlives the process: a header
//! saying what the device is, the slot table and the arena. The table and
//! the arena are mapped shared; every store the daemon makes is in the file
//! at once, and after a crash the slot table alone says what is stored
//! (see `Device::recover`).
//!
//! ```text
//! <root>/<name>/header   magic, version, sizes, codec, name, creation id
//! <root>/<name>/table    8 bytes per slot (sparse)
//! <root>/<name>/arena    the device's objects (sparse)
//! <root>/<name>/stats    its budget and counters, shared with the supervisor
//! ```
//!
//! The files belong on tmpfs (`/dev/shm`, `$RUNTIME_DIRECTORY`): there their
//! pages are the memory the pool uses, not a copy of it. A state is made in a
//! hidden directory and renamed into place, so a crash never leaves a half
//! made one under the device's name. The header is locked (`flock`) while a
//! process serves the device.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Result, StoreError};
use crate::Codec;

const MAGIC: [u8; 8] = *b"VZRAMST\0";
/// Bumped when the layout of the files changes incompatibly. Version 2
/// added written-back slots and access bits to the slot word; a version 1
/// state is read as is and marked version 2, so an older vzram refuses it.
pub const VERSION: u32 = 2;
const OLDEST_VERSION: u32 = 1;
const HEADER_LEN: usize = 128;
const NAME_LEN: usize = 64;
const CODEC_LEN: usize = 16;

/// Where a device keeps its state, and whether to start over.
#[derive(Debug, Clone)]
pub struct StateSpec {
    /// Directory holding one subdirectory per device.
    pub root: PathBuf,
    /// The device's name: its subdirectory.
    pub name: String,
    /// Discard whatever state exists and start empty.
    pub fresh: bool,
}

/// What the header records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub size_bytes: u64,
    pub arena_bytes: u64,
    pub codec: String,
    pub name: String,
    /// Random, fixed at creation: tells two states of one name apart.
    pub creation_id: u64,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(crate::PAGE_SIZE as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.size_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.arena_bytes.to_le_bytes());
        b[32..40].copy_from_slice(&self.creation_id.to_le_bytes());
        put_str(&mut b[40..40 + CODEC_LEN], &self.codec);
        put_str(&mut b[56..56 + NAME_LEN], &self.name);
        b
    }

    fn decode(b: &[u8; HEADER_LEN]) -> std::result::Result<Header, String> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        if b[0..8] != MAGIC {
            return Err("not a vzram device state (bad magic)".into());
        }
        let version = u32_at(8);
        if !(OLDEST_VERSION..=VERSION).contains(&version) {
            return Err(format!(
                "state format version {version}, this vzram reads version {VERSION}"
            ));
        }
        if u32_at(12) as usize != crate::PAGE_SIZE {
            return Err(format!(
                "page size {}, expected {}",
                u32_at(12),
                crate::PAGE_SIZE
            ));
        }
        Ok(Header {
            size_bytes: u64_at(16),
            arena_bytes: u64_at(24),
            creation_id: u64_at(32),
            codec: get_str(&b[40..40 + CODEC_LEN]),
            name: get_str(&b[56..56 + NAME_LEN]),
        })
    }
}

fn put_str(dst: &mut [u8], s: &str) {
    let n = s.len().min(dst.len());
    dst[..n].copy_from_slice(&s.as_bytes()[..n]);
}

fn get_str(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// One device's state: the locked header and the files to map. Clones
/// (`try_clone`) share the lock, so a process handed them keeps the state
/// locked for as long as it holds them.
pub struct StateFiles {
    pub dir: PathBuf,
    pub header: Header,
    /// True when the state existed before: the device must be recovered
    /// from its slot table.
    pub existing: bool,
    pub lock: File,
    pub table: File,
    pub arena: File,
    /// The device's budget and counters (`crate::cells::DeviceCells`).
    pub stats: File,
}

impl StateFiles {
    /// The same files through new descriptors (sharing the lock).
    pub fn try_clone(&self) -> Result<StateFiles> {
        let dup = |f: &File| {
            f.try_clone()
                .map_err(|e| StoreError::state(self.dir.display(), e))
        };
        Ok(StateFiles {
            dir: self.dir.clone(),
            header: self.header.clone(),
            existing: self.existing,
            lock: dup(&self.lock)?,
            table: dup(&self.table)?,
            arena: dup(&self.arena)?,
            stats: dup(&self.stats)?,
        })
    }

    /// A state handed over as open descriptors (by the process that opened
    /// and locked it): nothing is opened by path. The header is read back
    /// from `lock` and must describe a device of `size_bytes`.
    pub fn from_files(
        dir: PathBuf,
        lock: File,
        table: File,
        arena: File,
        stats: File,
        size_bytes: u64,
    ) -> Result<StateFiles> {
        use std::os::unix::fs::FileExt;
        let hpath = dir.join("header");
        let mut raw = [0u8; HEADER_LEN];
        lock.read_exact_at(&mut raw, 0)
            .map_err(|e| os_err(&hpath, "cannot read the header", e))?;
        let header = Header::decode(&raw).map_err(|m| err(&hpath, m))?;
        let st = StateFiles {
            dir,
            header,
            existing: true,
            lock,
            table,
            arena,
            stats,
        };
        st.check(size_bytes)?;
        Ok(st)
    }

    /// The header and the data files agree with each other and with the
    /// configured size.
    fn check(&self, size_bytes: u64) -> Result<()> {
        let dir = &self.dir;
        if self.header.size_bytes != size_bytes {
            return Err(err(
                &dir.join("header"),
                format!(
                    "holds a device of {} bytes, configured {size_bytes}; start with --fresh to discard it",
                    self.header.size_bytes
                ),
            ));
        }
        let want_table = (size_bytes / crate::PAGE_SIZE as u64) * 8;
        for (f, name, want) in [
            (&self.table, "table", want_table),
            (&self.arena, "arena", self.header.arena_bytes),
        ] {
            let len = f
                .metadata()
                .map_err(|e| StoreError::state(dir.join(name).display(), e))?
                .len();
            if len != want {
                return Err(err(
                    &dir.join(name),
                    format!("is {len} bytes, the header says {want}"),
                ));
            }
        }
        Ok(())
    }

    /// Memory the state files hold (their allocated blocks).
    pub fn bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        [&self.lock, &self.table, &self.arena, &self.stats]
            .iter()
            .map(|f| f.metadata().map_or(0, |m| m.blocks() * 512))
            .sum()
    }
}

fn err(path: &Path, msg: impl std::fmt::Display) -> StoreError {
    StoreError::state(format_args!("{}: {msg}", path.display()), None)
}

/// `doing` on the file failed with `e`.
fn os_err(path: &Path, doing: &str, e: std::io::Error) -> StoreError {
    StoreError::state(format_args!("{}: {doing}", path.display()), e)
}

/// Names that are a plain file name, so a device's state stays in its root.
fn check_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > NAME_LEN
        || name.starts_with('.')
        || name.contains('/')
        || name.contains('\0')
    {
        return Err(StoreError::InvalidConfig(format!(
            "device name {name:?} cannot name a state directory (1..={NAME_LEN} bytes, no '/', not starting with '.')"
        )));
    }
    Ok(())
}

/// How long to wait for a state another process holds: a worker of a
/// daemon that was just killed or stopped lets go within milliseconds.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

fn lock(file: &File, path: &Path) -> Result<()> {
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::WouldBlock {
            return Err(os_err(path, "cannot lock", e));
        }
        if std::time::Instant::now() >= deadline {
            return Err(err(path, "in use by another vzram process"));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn open_rw(path: &Path, create: bool) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(create)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| StoreError::state(path.display(), e))
}

/// Opens a device's state, making it if there is none (or if `fresh`).
/// An existing state must describe the same device: a different size, a
/// bad header or a newer format is an error naming the file, never a blank
/// disk served in its place.
pub fn open(
    spec: &StateSpec,
    size_bytes: u64,
    arena_bytes: u64,
    codec: Codec,
) -> Result<StateFiles> {
    check_name(&spec.name)?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&spec.root)
        .map_err(|e| StoreError::state(spec.root.display(), e))?;
    let dir = spec.root.join(&spec.name);
    remove_unfinished(&spec.root, &spec.name);
    if dir.exists() {
        if spec.fresh {
            discard(&dir)?;
        } else {
            return open_existing(dir, size_bytes);
        }
    }
    create(spec, dir, size_bytes, arena_bytes, codec)
}

fn open_existing(dir: PathBuf, size_bytes: u64) -> Result<StateFiles> {
    let hpath = dir.join("header");
    let mut hfile = open_rw(&hpath, false)?;
    lock(&hfile, &dir)?;
    let mut raw = [0u8; HEADER_LEN];
    hfile
        .read_exact(&mut raw)
        .map_err(|e| os_err(&hpath, "cannot read the header", e))?;
    let header = Header::decode(&raw).map_err(|m| err(&hpath, m))?;
    if header.arena_bytes > crate::slot::MAX_ARENA_BYTES {
        return Err(err(
            &hpath,
            format!(
                "arena of {} bytes is larger than this vzram can address",
                header.arena_bytes
            ),
        ));
    }
    if raw[8..12] != VERSION.to_le_bytes() {
        use std::os::unix::fs::FileExt;
        hfile
            .write_all_at(&header.encode(), 0)
            .map_err(|e| os_err(&hpath, "cannot update the header", e))?;
    }
    let st = StateFiles {
        table: open_rw(&dir.join("table"), false)?,
        arena: open_rw(&dir.join("arena"), false)?,
        // A state from before the counters file gets a zeroed one.
        stats: open_stats(&dir.join("stats"))?,
        dir,
        header,
        existing: true,
        lock: hfile,
    };
    st.check(size_bytes)?;
    Ok(st)
}

/// The counters file, made as long as the counters now, so whoever maps
/// it later (a process that may not grow files) finds it whole.
fn open_stats(path: &Path) -> Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| StoreError::state(path.display(), e))?;
    let need = std::mem::size_of::<crate::cells::DeviceCells>() as u64;
    if f.metadata()
        .map_err(|e| StoreError::state(path.display(), e))?
        .len()
        < need
    {
        f.set_len(need)
            .map_err(|e| StoreError::state(path.display(), e))?;
    }
    Ok(f)
}

fn create(
    spec: &StateSpec,
    dir: PathBuf,
    size_bytes: u64,
    arena_bytes: u64,
    codec: Codec,
) -> Result<StateFiles> {
    let tmp = spec
        .root
        .join(format!(".{}.new-{}", spec.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&tmp)
        .map_err(|e| StoreError::state(tmp.display(), e))?;
    let header = Header {
        size_bytes,
        arena_bytes,
        codec: codec.to_string(),
        name: spec.name.clone(),
        creation_id: crate::id::random_id(),
    };
    let mut h = open_rw(&tmp.join("header"), true)?;
    h.write_all(&header.encode())
        .map_err(|e| StoreError::state(tmp.join("header").display(), e))?;
    let table = open_rw(&tmp.join("table"), true)?;
    let arena = open_rw(&tmp.join("arena"), true)?;
    table
        .set_len((size_bytes / crate::PAGE_SIZE as u64) * 8)
        .map_err(|e| StoreError::state(tmp.join("table").display(), e))?;
    arena
        .set_len(arena_bytes)
        .map_err(|e| StoreError::state(tmp.join("arena").display(), e))?;
    let stats = open_stats(&tmp.join("stats"))?;
    lock(&h, &tmp)?;
    // Only a complete state ever carries the device's name.
    std::fs::rename(&tmp, &dir).map_err(|e| StoreError::state(dir.display(), e))?;
    Ok(StateFiles {
        dir,
        header,
        existing: false,
        lock: h,
        table,
        arena,
        stats,
    })
}

/// Deletes a device's state on purpose; refused while a process serves it.
pub fn discard(dir: &Path) -> Result<()> {
    if let Ok(h) = open_rw(&dir.join("header"), false) {
        lock(&h, dir)?;
    }
    std::fs::remove_dir_all(dir).map_err(|e| StoreError::state(dir.display(), e))
}

/// Deletes a device's state for good, only if `dir` holds one (its header
/// starts with the magic): a path given by mistake is left alone.
pub fn remove(dir: &Path) -> Result<()> {
    let mut magic = [0u8; 8];
    let ok = File::open(dir.join("header")).and_then(|mut h| h.read_exact(&mut magic));
    if ok.is_err() || magic != MAGIC {
        return Err(err(dir, "holds no vzram device state; left alone"));
    }
    discard(dir)
}

/// Half-made states of this name (a crash while creating one).
fn remove_unfinished(root: &Path, name: &str) {
    let prefix = format!(".{name}.new-");
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// The byte ranges of `file` that hold data (SEEK_DATA/SEEK_HOLE), so a
/// sparse file is walked without touching its holes.
pub fn data_ranges(file: &File) -> Vec<std::ops::Range<u64>> {
    let fd = file.as_raw_fd();
    let len = file.metadata().map_or(0, |m| m.len());
    let mut out = Vec::new();
    let mut pos = 0i64;
    while (pos as u64) < len {
        // SAFETY: lseek on a descriptor we own.
        let start = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if start < 0 {
            // ENXIO: no data past pos. Anything else: assume all data.
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO) {
                out.push(pos as u64..len);
            }
            break;
        }
        // SAFETY: as above.
        let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
        let end = if end < 0 { len as i64 } else { end };
        out.push(start as u64..end as u64);
        pos = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(tag: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("vzram-state-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        p
    }

    #[test]
    fn header_round_trips_and_refuses_what_it_is_not() {
        let h = Header {
            size_bytes: 1 << 30,
            arena_bytes: 1 << 32,
            codec: "zstd:3".into(),
            name: "vm1".into(),
            creation_id: 42,
        };
        let b = h.encode();
        assert_eq!(Header::decode(&b).unwrap(), h);
        let mut bad = b;
        bad[0] = b'X';
        assert!(Header::decode(&bad).unwrap_err().contains("magic"));
        let mut newer = b;
        newer[8] = 3;
        assert!(Header::decode(&newer).unwrap_err().contains("version 3"));
        let mut older = b;
        older[8] = 1;
        assert_eq!(Header::decode(&older).unwrap(), h);
    }

    #[test]
    fn create_reopen_lock_and_size_mismatch() {
        let r = root("open");
        let spec = StateSpec {
            root: r.clone(),
            name: "d".into(),
            fresh: false,
        };
        let a = open(&spec, 1 << 20, 1 << 22, Codec::Lz4).unwrap();
        assert!(!a.existing);
        // A second opener while the first holds it.
        let busy = open(&spec, 1 << 20, 1 << 22, Codec::Lz4).err().unwrap();
        assert!(busy.to_string().contains("in use"), "{busy}");
        let id = a.header.creation_id;
        drop(a);
        let b = open(&spec, 1 << 20, 1 << 22, Codec::Lz4).unwrap();
        assert!(b.existing);
        assert_eq!(b.header.creation_id, id);
        drop(b);
        let e = open(&spec, 2 << 20, 1 << 22, Codec::Lz4).err().unwrap();
        assert!(e.to_string().contains("--fresh"), "{e}");
        assert!(e.to_string().contains("header"), "{e}");
        let fresh = StateSpec {
            fresh: true,
            ..spec.clone()
        };
        let c = open(&fresh, 2 << 20, 1 << 22, Codec::Lz4).unwrap();
        assert!(!c.existing);
        assert_ne!(c.header.creation_id, id);
        drop(c);
        assert!(open(
            &StateSpec {
                name: "../x".into(),
                ..spec
            },
            1 << 20,
            1 << 22,
            Codec::Lz4
        )
        .is_err());
        std::fs::remove_dir_all(&r).unwrap();
    }

    #[test]
    fn data_ranges_skip_holes() {
        let r = root("sparse");
        std::fs::create_dir_all(&r).unwrap();
        let p = r.join("f");
        let f = open_rw(&p, true).unwrap();
        f.set_len(1 << 20).unwrap();
        assert!(data_ranges(&f).is_empty());
        use std::os::unix::fs::FileExt;
        f.write_all_at(&[1; 4096], 64 << 10).unwrap();
        let ranges = data_ranges(&f);
        assert_eq!(ranges.len(), 1, "{ranges:?}");
        assert!(ranges[0].contains(&(64 << 10)));
        std::fs::remove_dir_all(&r).unwrap();
    }
}
