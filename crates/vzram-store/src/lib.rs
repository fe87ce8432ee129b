//! vzram's page store: compressed 4 KiB pages in one shared pool.
//!
//! A [`Pool`] owns the memory; each [`Device`] has a fixed number of slots
//! and a per-slot-locked table. Nothing here knows about virtio.

pub mod backing;
pub mod cells;
pub mod codec;
mod context;
pub mod device;
pub mod error;
mod id;
pub mod limits;
#[cfg(feature = "lz4-c")]
mod lz4c;
pub mod migrate;
mod mmap;
pub mod pool;
pub(crate) mod slot;
pub mod state;
pub mod stats;
mod store;
pub(crate) mod table;

pub use backing::{Backing, BackingSpec};
pub use cells::{Cells, DeviceCells, HostCells, LatencySnapshot, MigrationCells, Op};
pub use codec::{Codec, ParseCodecError};
pub use context::Context;
pub use device::{
    Device, DeviceConfig, Filter, Prepared, RecompressReport, Recovery, Waker, WritebackReport,
};
pub use error::{Result, StoreError};
pub use migrate::{ExportBuf, MigrateError, Record};
pub use pool::PoolConfig;
pub use slot::encode_fill;
pub use state::{Existing, Leftover, StateFiles, StateSpec};
pub use stats::{DeviceStats, PoolStats};
pub use store::Pool;

/// Bytes per slot.
pub const PAGE_SIZE: usize = 4096;
pub type Page = [u8; PAGE_SIZE];
