//! A device's state as files, so that it outlives the process: a header
//! saying what the device is, the slot table and the arena. The table and
//! the arena are mapped shared; every store the daemon makes is in the file
//! at once, and after a crash the slot table alone says what is stored
//! (see `Device::recover`).
//!
//! ```text
//! <root>/<name>/header   magic, version, sizes, codec, name, creation id,
//!                        the socket it was made for
//! <root>/<name>/table    8 bytes per slot (sparse)
//! <root>/<name>/arena    the device's objects (sparse)
//! <root>/<name>/stats    its budget and counters, shared with the supervisor
//! ```
//!
//! Each of the table, arena and stats ends with the state's creation id
//! (see [`bind`]): files of two states mixed offline are refused.
//!
//! The files belong on tmpfs (`/dev/shm`, `$RUNTIME_DIRECTORY`): there their
//! pages are the memory the pool uses, not a copy of it. A state is made in a
//! hidden directory and renamed into place, so a crash never leaves a half
//! made one under the device's name, and removed by renaming it to a
//! tombstone first, so a crash never leaves a half deleted one there either.
//! Every file is locked (`flock`) while a process serves the device.
//!
//! A state is someone's disk: it is served only to the device it was made
//! for (its name and socket, both in the header), and an existing one is
//! taken only when the caller says so ([`Existing`]).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Result, StoreError};
use crate::Codec;
use fail::{err, os_err};

const MAGIC: [u8; 8] = *b"VZRAMST\0";
/// Bumped when the layout of the files changes incompatibly. Version 2
/// added written-back slots and access bits to the slot word, version 3
/// the socket path, version 4 the creation id in every data file (see
/// [`bind`]); an older state is read as is and rewritten as version 4, so
/// an older vzram refuses it.
pub const VERSION: u32 = 4;
const OLDEST_VERSION: u32 = 1;
/// The fixed part of the header (all of it before version 3).
const FIXED_LEN: usize = 128;
/// Version 3 adds the socket path: a 2-byte length, then the bytes.
const HEADER_LEN: usize = 512;
const SOCKET_AT: usize = FIXED_LEN + 2;
/// Longest socket path the header records (a unix socket path is at most
/// 107 bytes; a relative one made absolute can be longer).
pub const SOCKET_LEN: usize = HEADER_LEN - SOCKET_AT;
const NAME_LEN: usize = 64;
const CODEC_LEN: usize = 16;
/// Prefixes of the hidden entries beside the states: one being made, one
/// being deleted.
const NEW_TAG: &str = ".new-";
const GONE_TAG: &str = ".gone-";

/// What to do with a state that already exists under the device's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Existing {
    /// Serve what it holds: the same device, restarted.
    #[default]
    Recover,
    /// Refuse to start: the state may be another tenant's disk (a device
    /// added at run time that did not ask to recover one).
    Refuse,
    /// Delete it and start empty (`--fresh`).
    Discard,
}

/// Where a device keeps its state, and what an existing one is to it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StateSpec {
    /// Directory holding one subdirectory per device.
    pub root: PathBuf,
    /// The device's name: its subdirectory.
    pub name: String,
    pub existing: Existing,
    /// The socket the device serves (absolute): recorded in a new state,
    /// compared with an existing one's. None: not compared (a library
    /// user without sockets).
    pub socket: Option<PathBuf>,
    /// Take an existing state made under another name or for another
    /// socket, and record this device's in it (`--adopt`).
    pub adopt: bool,
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
    /// The socket the state was made for (None in a state from before
    /// version 3, until it is opened once).
    pub socket: Option<PathBuf>,
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
        if let Some(p) = &self.socket {
            use std::os::unix::ffi::OsStrExt;
            let bytes = p.as_os_str().as_bytes();
            // Checked at creation (`check_socket`); a longer one is cut.
            let n = bytes.len().min(SOCKET_LEN);
            b[FIXED_LEN..SOCKET_AT].copy_from_slice(&(n as u16).to_le_bytes());
            b[SOCKET_AT..SOCKET_AT + n].copy_from_slice(&bytes[..n]);
        }
        b
    }

    /// `b` is the header file's contents: [`FIXED_LEN`] bytes before
    /// version 3, [`HEADER_LEN`] from it on.
    fn decode(b: &[u8]) -> std::result::Result<(Header, u32), String> {
        if b.len() < FIXED_LEN {
            return Err(format!(
                "is {} bytes, a header is at least {FIXED_LEN}",
                b.len()
            ));
        }
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
        let socket = if version >= 3 {
            if b.len() < HEADER_LEN {
                return Err(format!(
                    "is {} bytes, a version {version} header is {HEADER_LEN}",
                    b.len()
                ));
            }
            let n = u16::from_le_bytes([b[FIXED_LEN], b[FIXED_LEN + 1]]) as usize;
            if n > SOCKET_LEN {
                return Err(format!("records a socket path of {n} bytes"));
            }
            use std::os::unix::ffi::OsStrExt;
            (n > 0)
                .then(|| PathBuf::from(std::ffi::OsStr::from_bytes(&b[SOCKET_AT..SOCKET_AT + n])))
        } else {
            None
        };
        Ok((
            Header {
                size_bytes: u64_at(16),
                arena_bytes: u64_at(24),
                creation_id: u64_at(32),
                codec: get_str(&b[40..40 + CODEC_LEN]),
                name: get_str(&b[56..56 + NAME_LEN]),
                socket,
            },
            version,
        ))
    }
}

/// Reads a header file's contents (at most [`HEADER_LEN`] bytes).
fn read_header(f: &File, path: &Path) -> Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let mut raw = vec![0u8; HEADER_LEN];
    let mut n = 0;
    while n < HEADER_LEN {
        match f.read_at(&mut raw[n..], n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(os_err(path, "cannot read the header", e)),
        }
    }
    raw.truncate(n);
    Ok(raw)
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
    /// The creation id of the state this one replaced (`--fresh`): its
    /// backing file's pages are this device's to discard.
    pub replaced: Option<u64>,
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
            replaced: self.replaced,
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
        let hpath = dir.join("header");
        let raw = read_header(&lock, &hpath)?;
        let (header, _) = Header::decode(&raw).map_err(|m| err(&hpath, m))?;
        let st = StateFiles {
            dir,
            header,
            existing: true,
            replaced: None,
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
                    "holds a device of {} bytes, configured {size_bytes}: give the device its size again, or start with {}",
                    self.header.size_bytes,
                    fresh_hint(dir)
                ),
            ));
        }
        let want_table = table_len(size_bytes);
        for (f, name, want) in [
            (&self.table, "table", want_table),
            (&self.arena, "arena", self.header.arena_bytes),
        ] {
            let len = f
                .metadata()
                .map_err(|e| StoreError::state(dir.join(name).display(), e))?
                .len();
            // Its data alone (an older state), or with its creation id.
            if len != want && len != bind::bound_len(want) {
                return Err(err(
                    &dir.join(name),
                    format!("is {len} bytes, the header says {want}"),
                ));
            }
        }
        let need = stats_len();
        let len = self
            .stats
            .metadata()
            .map_err(|e| StoreError::state(dir.join("stats").display(), e))?
            .len();
        if len < need {
            return Err(err(
                &dir.join("stats"),
                format!("is {len} bytes, the counters need {need} (the file was truncated)"),
            ));
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

/// What a refusal advises to discard the state in `dir` and start its
/// device empty: the flag for that device alone.
pub fn fresh_hint(dir: &Path) -> String {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("`--fresh {name}` (or fresh=true on the device) to discard it")
}

impl StateFiles {
    /// The data files as [`bind`] checks and binds them.
    fn bind_files(&self) -> bind::Files<'_> {
        bind::Files {
            dir: &self.dir,
            id: self.header.creation_id,
            files: [
                (
                    bind::Kind::Table,
                    &self.table,
                    table_len(self.header.size_bytes),
                ),
                (bind::Kind::Arena, &self.arena, self.header.arena_bytes),
                (bind::Kind::Stats, &self.stats, stats_len()),
            ],
        }
    }
}

/// The state in `root` whose header records `id`, if any.
fn whose(root: &Path, id: u64) -> Option<PathBuf> {
    std::fs::read_dir(root)
        .ok()?
        .flatten()
        .filter_map(|e| Leftover::read(&e.path()))
        .find(|l| l.creation_id == id)
        .map(|l| l.dir)
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

fn check_socket(socket: &Option<PathBuf>) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    match socket {
        Some(p) if p.as_os_str().len() > SOCKET_LEN => Err(StoreError::InvalidConfig(format!(
            "socket path {} is longer than the {SOCKET_LEN} bytes a device state can record",
            p.display()
        ))),
        Some(p) if p.as_os_str().as_bytes().is_empty() => {
            Err(StoreError::InvalidConfig("empty socket path".into()))
        }
        _ => Ok(()),
    }
}

/// How long to wait for a state another process holds: a worker of a
/// daemon that was just killed or stopped lets go within milliseconds.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

fn lock(file: &File, path: &Path) -> Result<()> {
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        match try_lock(file, path)? {
            true => return Ok(()),
            false if std::time::Instant::now() >= deadline => {
                return Err(err(path, "in use by another vzram process"))
            }
            false => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
}

/// Takes the lock if it is free: false if another open file holds it.
fn try_lock(file: &File, path: &Path) -> Result<bool> {
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.kind() == std::io::ErrorKind::WouldBlock {
        return Ok(false);
    }
    Err(os_err(path, "cannot lock", e))
}

/// A data file of a state whose header we hold locked: no one else may
/// have it open for writing as theirs (a backing file named by mistake).
fn lock_data(file: &File, path: &Path) -> Result<()> {
    // A worker that is exiting lets go of its files one by one: wait, as
    // for the header.
    lock(file, path).map_err(|_| {
        err(
            path,
            "is locked by another process (used as a backing file?)",
        )
    })
}

/// The open file `f` is this user's alone (`fstat`: what was opened, not
/// what the path names now).
fn private_file(f: &File, path: &Path) -> Result<()> {
    let m = f
        .metadata()
        .map_err(|e| StoreError::state(path.display(), e))?;
    private::check(path, &m, private::Part::File)
}

fn open_rw(path: &Path, create: bool) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(create)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| StoreError::state(path.display(), e))
}

/// Allocates `[0, len)` of `f`, so that nothing mapped from it can fault
/// for want of a page: a full file system is this error, never a SIGBUS.
fn allocate(f: &File, path: &Path, len: u64) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let Err(e) = crate::mmap::fallocate(f.as_raw_fd(), 0, len) else {
        return Ok(());
    };
    if e.raw_os_error() == Some(libc::ENOSPC) {
        let dir = path.parent().and_then(Path::parent).unwrap_or(path);
        return Err(err(
            path,
            format_args!(
                "cannot allocate {len} bytes: state dir {} is full",
                dir.display()
            ),
        ));
    }
    Err(os_err(path, "cannot allocate its blocks", e))
}

/// Whether two paths name the same place, through links and `..` where
/// they exist (`/var/run` and `/run`): what is missing compares as written.
pub fn same_path(a: &Path, b: &Path) -> bool {
    a == b || canonical(a) == canonical(b)
}

fn canonical(p: &Path) -> PathBuf {
    if let Ok(c) = std::fs::canonicalize(p) {
        return c;
    }
    match (p.parent(), p.file_name()) {
        (Some(d), Some(f)) => {
            std::fs::canonicalize(d).map_or_else(|_| p.to_path_buf(), |d| d.join(f))
        }
        _ => p.to_path_buf(),
    }
}

/// True if `dir` holds a device state (a header with the magic).
pub fn is_state_dir(dir: &Path) -> bool {
    let mut magic = [0u8; 8];
    File::open(dir.join("header"))
        .and_then(|mut h| h.read_exact(&mut magic))
        .is_ok()
        && magic == MAGIC
}

/// True if `bytes` start like a state's header.
pub fn is_state_header(bytes: &[u8]) -> bool {
    bytes.len() >= 8 && bytes[..8] == MAGIC
}

/// The device state directory `path` lies in (itself or an ancestor), if
/// any: no state root, backing file or other state belongs in one.
pub fn enclosing_state(path: &Path) -> Option<PathBuf> {
    let abs = std::path::absolute(path).ok()?;
    abs.ancestors()
        .find(|a| is_state_dir(a))
        .map(Path::to_path_buf)
}

/// Opens a device's state, making it if there is none. An existing state
/// must be this device's (its name, socket and size) and wanted
/// ([`Existing`]): a mismatch is an error naming both, never another
/// tenant's pages or a blank disk served in their place.
pub fn open(
    spec: &StateSpec,
    size_bytes: u64,
    arena_bytes: u64,
    codec: Codec,
) -> Result<StateFiles> {
    check_name(&spec.name)?;
    check_socket(&spec.socket)?;
    prepare_root(&spec.root, None)?;
    let dir = spec.root.join(&spec.name);
    finish_removals(&spec.root, Some(&spec.name));
    let mut replaced = None;
    match std::fs::symlink_metadata(&dir) {
        Ok(m) if !m.is_dir() => {
            return Err(err(&dir, "is not a directory; left alone"));
        }
        Ok(_) => match spec.existing {
            Existing::Discard => {
                let old = Leftover::read(&dir);
                // Someone's disk, deleted on purpose: said loudly, with its size.
                tracing::warn!(
                    device = %spec.name,
                    state = %dir.display(),
                    size = old.as_ref().map_or(0, |l| l.size_bytes),
                    bytes_held = old.as_ref().map_or(0, |l| l.bytes),
                    "fresh: discarding the device's existing state; its pages are deleted"
                );
                replaced = old.map(|l| l.creation_id);
                discard(&dir)?
            }
            Existing::Refuse => {
                return Err(refused(&dir, &spec.name));
            }
            Existing::Recover => return open_existing(spec, dir, size_bytes),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(StoreError::state(dir.display(), e)),
    }
    let mut st = create(spec, dir, size_bytes, arena_bytes, codec)?;
    st.replaced = replaced;
    Ok(st)
}

/// A state found where a new device was to start.
fn refused(dir: &Path, name: &str) -> StoreError {
    let made_for = Leftover::read(dir)
        .and_then(|l| l.socket)
        .map(|s| format!(", made for socket {}", s.display()))
        .unwrap_or_default();
    StoreError::InvalidConfig(format!(
        "device {name} has state left in {}{made_for}: add it with recover=true to serve those pages, \
         fresh=true to discard them, or delete it first with `vzram forget {name}`",
        dir.display()
    ))
}

/// The state root: made if missing (0700), only under a directory that
/// exists unless `parent` (a built-in default's, with its mode) says to
/// make that too (a typo must not create a tree), never inside a state,
/// only ever this user's own (see [`private`]). Returns whether it was made.
pub fn prepare_root(root: &Path, parent: Option<(&Path, u32)>) -> Result<bool> {
    check_root_place(root)?;
    private::make_root(root, parent)
}

/// [`prepare_root`]'s one check that makes nothing: not inside a state.
pub fn check_root_place(root: &Path) -> Result<()> {
    enclosing_state(root).map_or(Ok(()), |s| {
        Err(StoreError::InvalidConfig(format!(
            "state dir {} is inside the state of another device ({}); choose a directory of its own",
            root.display(),
            s.display()
        )))
    })
}

fn open_existing(spec: &StateSpec, dir: PathBuf, size_bytes: u64) -> Result<StateFiles> {
    // Ours alone, before anything of it is read: a state another user
    // planted or opened is never served.
    private::check_path(&dir, private::Part::State)?;
    let hpath = dir.join("header");
    let hfile = open_rw(&hpath, false)?;
    private_file(&hfile, &hpath)?;
    lock(&hfile, &dir)?;
    let raw = read_header(&hfile, &hpath)?;
    let (mut header, version) = Header::decode(&raw).map_err(|m| err(&hpath, m))?;
    if header.arena_bytes > crate::slot::MAX_ARENA_BYTES {
        return Err(err(
            &hpath,
            format!(
                "arena of {} bytes is larger than this vzram can address",
                header.arena_bytes
            ),
        ));
    }
    let mut rewrite = version != VERSION;
    if header.name != spec.name {
        if !spec.adopt {
            return Err(StoreError::InvalidConfig(format!(
                "{} holds the state of device {:?}, not {:?} (a state directory was renamed, moved or copied): \
                 put it back, start with `--adopt {}` to take it for {:?}, or with {}",
                dir.display(),
                header.name,
                spec.name,
                spec.name,
                spec.name,
                fresh_hint(&dir)
            )));
        }
        tracing::warn!(state = %dir.display(), was = %header.name, now = %spec.name, "adopted: the state now belongs to this device");
        header.name = spec.name.clone();
        rewrite = true;
    }
    match (&header.socket, &spec.socket) {
        (Some(was), Some(now)) if !same_path(was, now) => {
            if !spec.adopt {
                return Err(StoreError::InvalidConfig(format!(
                    "device {}: its state {} was made for socket {}, not {}: start with `--adopt {}` to serve it on {} \
                     (whoever used the old socket loses it), or with {}",
                    spec.name,
                    dir.display(),
                    was.display(),
                    now.display(),
                    spec.name,
                    now.display(),
                    fresh_hint(&dir)
                )));
            }
            tracing::warn!(state = %dir.display(), was = %was.display(), now = %now.display(), "adopted: the state now belongs to this socket");
            header.socket = Some(now.clone());
            rewrite = true;
        }
        (None, Some(now)) => {
            // A state from before sockets were recorded: from now on it is
            // this socket's.
            header.socket = Some(now.clone());
            rewrite = true;
        }
        _ => {}
    }
    let table = open_rw(&dir.join("table"), false)?;
    let arena = open_rw(&dir.join("arena"), false)?;
    // A state from before the counters file gets a zeroed one.
    let fresh_stats = !dir.join("stats").exists();
    let stats = open_stats(&dir.join("stats"), false)?;
    for (f, name) in [(&table, "table"), (&arena, "arena"), (&stats, "stats")] {
        private_file(f, &dir.join(name))?;
        lock_data(f, &dir.join(name))?;
    }
    let st = StateFiles {
        table,
        arena,
        stats,
        dir,
        header,
        existing: true,
        replaced: None,
        lock: hfile,
    };
    st.check(size_bytes)?;
    allocate(&st.stats, &st.dir.join("stats"), stats_len())?;
    let files = st.bind_files();
    let whose = |id| whose(files.dir.parent().unwrap_or(files.dir), id);
    let unbound = bind::check(&files, version, fresh_stats, whose)?;
    // Only a state that passed every check is bound to its id and
    // rewritten as this device's.
    bind::bind(&files, &unbound)?;
    if rewrite {
        use std::os::unix::fs::FileExt;
        st.lock
            .write_all_at(&st.header.encode(), 0)
            .and_then(|()| st.lock.sync_data())
            .map_err(|e| os_err(&hpath, "cannot update the header", e))?;
    }
    Ok(st)
}

/// The slot table's bytes for a device of `size_bytes`.
fn table_len(size_bytes: u64) -> u64 {
    (size_bytes / crate::PAGE_SIZE as u64) * 8
}

fn stats_len() -> u64 {
    std::mem::size_of::<crate::cells::DeviceCells>() as u64
}

/// The counters file, made as long as the counters now and allocated, so
/// whoever maps it later (a process that may not grow files) finds it
/// whole and can never fault on it.
fn open_stats(path: &Path, create: bool) -> Result<File> {
    let made = create || !path.exists();
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .create_new(create)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| StoreError::state(path.display(), e))?;
    let need = stats_len();
    let len = f
        .metadata()
        .map_err(|e| StoreError::state(path.display(), e))?
        .len();
    // Only a file made here is grown: one truncated under a live state is
    // refused by `check`.
    if len == 0 && made {
        allocate(&f, path, need)?;
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
        .join(format!(".{}{NEW_TAG}{}", spec.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&tmp)
        .map_err(|e| StoreError::state(tmp.display(), e))?;
    let made = make_files(spec, &tmp, size_bytes, arena_bytes, codec);
    let (header, h, table, arena, stats) = match made {
        Ok(m) => m,
        Err(e) => {
            // Nothing half made stays behind (a full state dir).
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    // Only a complete state ever carries the device's name.
    if let Err(e) = std::fs::rename(&tmp, &dir) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(StoreError::state(dir.display(), e));
    }
    Ok(StateFiles {
        dir,
        header,
        existing: false,
        replaced: None,
        lock: h,
        table,
        arena,
        stats,
    })
}

type Made = (Header, File, File, File, File);

fn make_files(
    spec: &StateSpec,
    tmp: &Path,
    size_bytes: u64,
    arena_bytes: u64,
    codec: Codec,
) -> Result<Made> {
    let header = Header {
        size_bytes,
        arena_bytes,
        codec: codec.to_string(),
        name: spec.name.clone(),
        creation_id: crate::id::random_id(),
        socket: spec.socket.clone(),
    };
    let mut h = open_rw(&tmp.join("header"), true)?;
    h.write_all(&header.encode())
        .map_err(|e| StoreError::state(tmp.join("header").display(), e))?;
    let table = open_rw(&tmp.join("table"), true)?;
    let arena = open_rw(&tmp.join("arena"), true)?;
    table
        .set_len(table_len(size_bytes))
        .map_err(|e| StoreError::state(tmp.join("table").display(), e))?;
    arena
        .set_len(arena_bytes)
        .map_err(|e| StoreError::state(tmp.join("arena").display(), e))?;
    let stats = open_stats(&tmp.join("stats"), true)?;
    let id = header.creation_id;
    for (f, kind, data_len) in [
        (&table, bind::Kind::Table, table_len(size_bytes)),
        (&arena, bind::Kind::Arena, arena_bytes),
        (&stats, bind::Kind::Stats, stats_len()),
    ] {
        bind::write(f, &tmp.join(kind.name()), kind, data_len, id)?;
    }
    lock(&h, tmp)?;
    for (f, name) in [(&table, "table"), (&arena, "arena"), (&stats, "stats")] {
        lock_data(f, &tmp.join(name))?;
    }
    Ok((header, h, table, arena, stats))
}

/// Deletes a device's state on purpose; refused while a process serves it.
/// The state is first renamed to a tombstone, so a crash part way leaves
/// no half deleted state under the name: the next open finishes it off.
pub fn discard(dir: &Path) -> Result<()> {
    // Another user's is never deleted.
    private::check_path(dir, private::Part::State)?;
    let h = open_rw(&dir.join("header"), false).ok();
    if let Some(h) = &h {
        lock(h, dir)?;
    }
    bury(dir)
}

/// Deletes `st`, a state this process holds (just made, and refused):
/// its own descriptors hold the lock, so none is taken again.
pub fn discard_held(st: &StateFiles) -> Result<()> {
    bury(&st.dir)
}

/// Renames `dir` to a tombstone, then deletes that: a crash part way
/// leaves no half deleted state under the name.
fn bury(dir: &Path) -> Result<()> {
    let (Some(root), Some(name)) = (dir.parent(), dir.file_name()) else {
        return Err(err(dir, "is not a state directory"));
    };
    let tomb = root.join(format!(
        ".{}{GONE_TAG}{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        crate::id::random_id()
    ));
    std::fs::rename(dir, &tomb).map_err(|e| StoreError::state(dir.display(), e))?;
    // Another daemon finishing it off at the same moment is no failure.
    match std::fs::remove_dir_all(&tomb) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(StoreError::state(tomb.display(), e))
        }
        _ => Ok(()),
    }
}

/// Deletes a device's state for good, only if `dir` holds one (its header
/// starts with the magic): a path given by mistake is left alone.
pub fn remove(dir: &Path) -> Result<()> {
    if !is_state_dir(dir) {
        return Err(err(dir, "holds no vzram device state; left alone"));
    }
    discard(dir)
}

/// Finishes what a crash cut short in `root`: states half made (of `name`,
/// or of every name) and tombstones of states being deleted (all of them:
/// a tombstone is never a device's).
pub fn finish_removals(root: &Path, name: Option<&str>) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    let new = name.map(|n| format!(".{n}{NEW_TAG}"));
    for e in entries.flatten() {
        let f = e.file_name();
        let f = f.to_string_lossy();
        if !f.starts_with('.') {
            continue;
        }
        let half_made = match &new {
            Some(p) => f.starts_with(p.as_str()),
            None => f.contains(NEW_TAG),
        };
        // A tombstone is never anyone's device: finish it off whoever
        // buried it (a live one tolerates the race). A state being made is
        // left to its maker while it runs.
        if !(f.contains(GONE_TAG) || (half_made && !pid_alive(&f))) {
            continue;
        }
        // Only what this user made: a directory named like a tombstone
        // by someone else is theirs.
        if private::is_ours(&e.path()) {
            let _ = std::fs::remove_dir_all(e.path());
        } else {
            tracing::warn!(entry = %e.path().display(), "not this user's: left alone");
        }
    }
}

/// Whether the process that is making a state (`.NAME.new-PID`) still
/// runs: another daemon sharing the root may be in the middle of it. This
/// process's own entries are never in use.
fn pid_alive(entry: &str) -> bool {
    let tail = entry.rsplit_once(NEW_TAG).map_or("", |(_, t)| t);
    let Ok(pid) = tail.split('-').next().unwrap_or("").parse::<u32>() else {
        return false;
    };
    pid != std::process::id() && Path::new(&format!("/proc/{pid}")).exists()
}

/// A state in a root that no device of this process serves: someone's
/// disk, kept until it is recovered or deleted on purpose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    pub name: String,
    pub dir: PathBuf,
    pub size_bytes: u64,
    /// Memory its files hold.
    pub bytes: u64,
    pub socket: Option<PathBuf>,
    pub creation_id: u64,
}

impl Leftover {
    /// Reads what `dir`'s header says, without locking or changing it.
    pub fn read(dir: &Path) -> Option<Leftover> {
        use std::os::unix::fs::MetadataExt;
        let h = File::open(dir.join("header")).ok()?;
        let raw = read_header(&h, &dir.join("header")).ok()?;
        let (header, _) = Header::decode(&raw).ok()?;
        let bytes = ["header", "table", "arena", "stats"]
            .iter()
            .filter_map(|f| std::fs::symlink_metadata(dir.join(f)).ok())
            .map(|m| m.blocks() * 512)
            .sum();
        Some(Leftover {
            name: dir.file_name()?.to_string_lossy().into_owned(),
            dir: dir.to_path_buf(),
            size_bytes: header.size_bytes,
            bytes,
            socket: header.socket,
            creation_id: header.creation_id,
        })
    }
}

/// The states in `root` that no process holds (their header lock is
/// free) and whose names are not in `serving`.
pub fn leftovers(root: &Path, serving: &[&str]) -> Vec<Leftover> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut out: Vec<Leftover> = entries
        .flatten()
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            !n.starts_with('.') && !serving.contains(&n.as_ref())
        })
        .filter(|e| is_state_dir(&e.path()))
        .filter(|e| {
            // Held by a live daemon: its device, not left over.
            File::open(e.path().join("header"))
                .ok()
                .and_then(|h| try_lock(&h, &e.path()).ok())
                .unwrap_or(false)
        })
        .filter_map(|e| Leftover::read(&e.path()))
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

mod bind;
mod fail;
mod holes;
mod private;
#[cfg(test)]
mod tests;

pub use holes::data_ranges;
pub use private::euid;
