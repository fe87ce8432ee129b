//! A device's store configuration from what the daemon knows of it, in
//! one place: every process that opens or recovers a device's state (the
//! supervisor at start-up and for `add`, the launcher preparing a state,
//! a worker) builds it here, so the arena is sized alike everywhere.

use std::sync::Arc;

use vzram_store::{Backing, Codec, Device, DeviceConfig, Pool, StateFiles, StoreError};

/// The store configuration of a device of `size` bytes stored with
/// `algo`, with one allocator shard per queue (the state's arena is sized
/// for those; the compress pool's threads share them) and `mem_limit`
/// bytes of memory at most (0: none).
pub fn device_config(size: u64, algo: Codec, queues: u16, mem_limit: u64) -> DeviceConfig {
    let mut dc = DeviceConfig::new(size, algo);
    dc.mem_limit = mem_limit;
    dc.shards = usize::from(queues);
    dc
}

/// Recovers a device from `files` (and its backing file) in this process;
/// the state stays locked by the caller's own descriptors.
pub fn attach(
    pool: &Arc<Pool>,
    dc: DeviceConfig,
    files: &StateFiles,
    backing: Option<Backing>,
) -> Result<Arc<Device>, StoreError> {
    pool.attach_device(dc, files.try_clone()?, backing)
}
