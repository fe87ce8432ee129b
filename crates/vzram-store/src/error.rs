use std::fmt;
use std::io;
use std::sync::Arc;

use thiserror::Error;

/// Errors of the page store. The block layer maps every variant to a virtio
/// status; the comment on each says which.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// Slot index past the end of the device. Guest sees IOERR.
    #[error("slot {slot} is out of range (device has {slots} slots)")]
    OutOfRange { slot: u64, slots: u64 },
    /// Offset/length inside a page is invalid. Guest sees IOERR.
    #[error("byte range {offset}+{len} does not fit in a page")]
    BadPageRange { offset: usize, len: usize },
    /// Storing the page would pass the device's `mem_limit`. Guest sees IOERR;
    /// the slot keeps its old content.
    #[error("device memory limit reached")]
    DeviceLimit,
    /// Storing the page would pass the pool's host-wide limit. Guest sees
    /// IOERR; the slot keeps its old content.
    #[error("host memory limit reached")]
    HostLimit,
    /// A state file could not grow (a slot-table page or a span of the
    /// arena): the file system holding the state is full. Guest sees IOERR;
    /// the slot keeps its old content.
    #[error("the file system holding the device's state is full")]
    StateFull,
    /// The device's arena (the address space reserved for its objects) is
    /// used up. Guest sees IOERR; the slot keeps its old content.
    #[error("pool arena exhausted")]
    ArenaFull,
    /// A memory limit was reached and the backing file has no free block
    /// to spill to. Guest sees IOERR; the slot keeps its old content.
    #[error("memory limit reached and the backing file is full")]
    BackingFull,
    /// Reading or writing the backing file failed. Guest sees IOERR; a
    /// failed writeback leaves the page in memory. Shows as "backing file
    /// {what}: {OS error}"; see [`StoreError::backing`].
    #[error(transparent)]
    Backing(Cause),
    /// A stored object failed to decompress, or its slot word names no
    /// object it could be (a table damaged while served). A bug or damage,
    /// never guest input. Guest sees IOERR.
    #[error("stored page in slot {slot} is corrupt")]
    Corrupt { slot: u64 },
    /// Bad configuration handed to the store (size, codec level, ...).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A device's state files are unusable or in use: the device must not
    /// start (serving a blank disk in place of lost data would be worse).
    /// Shows as "device state {what}: {OS error}".
    #[error(transparent)]
    State(Cause),
    /// A migrated page that cannot be stored as sent (untrusted input).
    #[error("migration record refused: {0}")]
    BadRecord(String),
    /// mmap failed while reserving memory. Shows as "cannot map memory:
    /// {what}: {OS error}".
    #[error(transparent)]
    Map(Cause),
}

/// Whether to log a full state dir now: once every 10 s per process, so a
/// guest writing into a full tmpfs does not flood the log.
pub(crate) fn log_full_now() -> bool {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = LAST.load(Relaxed);
    now >= last + 10 && LAST.compare_exchange(last, now, Relaxed, Relaxed).is_ok()
}

impl StoreError {
    /// A [`StoreError::Backing`]: `what` (the file, and what was done to it)
    /// failed, with the OS error `source` if there was one.
    pub fn backing(what: impl fmt::Display, source: impl Into<Option<io::Error>>) -> StoreError {
        StoreError::Backing(Cause::new("backing file ", what, source.into()))
    }

    /// A [`StoreError::State`], as [`StoreError::backing`].
    pub fn state(what: impl fmt::Display, source: impl Into<Option<io::Error>>) -> StoreError {
        StoreError::State(Cause::new("device state ", what, source.into()))
    }

    /// A [`StoreError::Map`], as [`StoreError::backing`].
    pub fn map(what: impl fmt::Display, source: impl Into<Option<io::Error>>) -> StoreError {
        StoreError::Map(Cause::new("cannot map memory: ", what, source.into()))
    }
}

/// What a [`StoreError::Backing`], [`StoreError::State`] or
/// [`StoreError::Map`] is about: the file or mapping and what went wrong,
/// and the OS error under it, if any, as its `source()`. Its text starts
/// with the variant's words ("backing file ..."), so that the store error
/// can show it as it is and hand on its source: an error chain then holds
/// the OS error once, not a copy of the message.
#[derive(Debug, Clone)]
pub struct Cause {
    kind: &'static str,
    what: String,
    // Arc: the store's errors are Clone, io::Error is not.
    source: Option<Arc<io::Error>>,
}

impl Cause {
    fn new(kind: &'static str, what: impl fmt::Display, source: Option<io::Error>) -> Cause {
        Cause {
            kind,
            what: what.to_string(),
            source: source.map(Arc::new),
        }
    }

    /// What failed, without the kind's prefix or the OS error.
    pub fn what(&self) -> &str {
        &self.what
    }

    /// The OS error under it, if there was one.
    pub fn os_error(&self) -> Option<&io::Error> {
        self.source.as_deref()
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.kind, self.what)?;
        match &self.source {
            Some(e) => write!(f, ": {e}"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Equal when they say the same: io::Error has no equality, so the OS
/// errors compare by kind and errno.
impl PartialEq for Cause {
    fn eq(&self, o: &Cause) -> bool {
        let os = |c: &Cause| c.source.as_ref().map(|e| (e.kind(), e.raw_os_error()));
        self.kind == o.kind && self.what == o.what && os(self) == os(o)
    }
}

impl Eq for Cause {}

pub type Result<T> = std::result::Result<T, StoreError>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn the_os_error_is_shown_and_kept_as_the_source() {
        let e = StoreError::backing(
            "/b: reading its header",
            io::Error::from_raw_os_error(libc::EIO),
        );
        let text = e.to_string();
        assert!(
            text.starts_with("backing file /b: reading its header: "),
            "{text}"
        );
        let src = e.source().expect("a source");
        let io = src.downcast_ref::<io::Error>().expect("the io::Error");
        assert_eq!(io.raw_os_error(), Some(libc::EIO));
        assert!(matches!(&e, StoreError::Backing(c) if c.what() == "/b: reading its header"));
    }

    #[test]
    fn without_an_os_error_there_is_no_source() {
        let e = StoreError::state("/s/d: in use by another vzram process", None);
        assert_eq!(
            e.to_string(),
            "device state /s/d: in use by another vzram process"
        );
        assert!(e.source().is_none());
        let m = StoreError::map(
            "mmap of 4096 bytes",
            io::Error::from_raw_os_error(libc::ENOMEM),
        );
        assert!(m
            .to_string()
            .starts_with("cannot map memory: mmap of 4096 bytes: "));
        assert_ne!(m, StoreError::map("mmap of 4096 bytes", None));
    }
}
