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
    /// The pool's reserved address space is used up. Guest sees IOERR.
    #[error("the file system holding the device's state is full")]
    StateFull,
    #[error("pool arena exhausted")]
    ArenaFull,
    /// A memory limit was reached and the backing file has no free block
    /// to spill to. Guest sees IOERR; the slot keeps its old content.
    #[error("memory limit reached and the backing file is full")]
    BackingFull,
    /// Reading or writing the backing file failed. Guest sees IOERR; a
    /// failed writeback leaves the page in memory.
    #[error("backing file {0}")]
    Backing(String),
    /// A stored object failed to decompress. This is a bug, never guest input.
    #[error("stored page in slot {slot} is corrupt")]
    Corrupt { slot: u64 },
    /// Bad configuration handed to the store (size, codec level, ...).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A device's state files are unusable or in use: the device must not
    /// start (serving a blank disk in place of lost data would be worse).
    #[error("device state {0}")]
    State(String),
    /// A migrated page that cannot be stored as sent (untrusted input).
    #[error("migration record refused: {0}")]
    BadRecord(String),
    /// mmap failed while reserving memory.
    #[error("cannot map memory: {0}")]
    Map(String),
}

pub type Result<T> = std::result::Result<T, StoreError>;
