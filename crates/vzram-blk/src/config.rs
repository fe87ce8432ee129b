//! What the device advertises: virtio feature bits, vhost-user protocol
//! features, and the `virtio_blk_config` space the guest reads.
//!
//! Every limit the guest is told about is a real one that the device and
//! request modules enforce. The discard and write-zeroes limits are
//! nonzero on purpose: some guests (Windows on cloud-hypervisor) divide by
//! them.

use std::mem::{offset_of, size_of};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use virtio_bindings::virtio_blk::{
    virtio_blk_config, VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_TOPOLOGY,
    VIRTIO_BLK_F_WRITE_ZEROES, VIRTIO_BLK_ID_BYTES,
};
use virtio_bindings::virtio_config::{VIRTIO_F_IN_ORDER, VIRTIO_F_VERSION_1};
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// virtio-blk addresses the disk in 512-byte sectors, whatever the block size.
pub const SECTOR_SHIFT: u32 = 9;
pub const SECTOR_SIZE: u64 = 1 << SECTOR_SHIFT;

/// Logical block size told to the guest: the store's page. Guests then do
/// I/O in whole pages, which is the fast path.
pub const BLOCK_SIZE: u32 = vzram_store::PAGE_SIZE as u32;
/// Sectors per store page.
pub const SECTORS_PER_PAGE: u64 = BLOCK_SIZE as u64 / SECTOR_SIZE;

/// Largest virtqueue a frontend may set up.
pub const MAX_QUEUE_SIZE: usize = 1024;
/// Most queues one device may have (vhost-user-backend's thread masks are 64-bit).
pub const MAX_QUEUES: usize = 64;

/// Data segments per request (`seg_max`). A chain may hold this many data
/// descriptors plus the header and the status byte.
pub const SEG_MAX: u32 = 254;
/// Longest chain accepted, in descriptors.
pub const MAX_DESCRIPTORS: usize = SEG_MAX as usize + 2;

/// Sectors one discard or write-zeroes segment may cover (1 GiB).
pub const MAX_DISCARD_SECTORS: u32 = 1 << 21;
/// Segments per discard request; Linux caps its own at 256.
pub const MAX_DISCARD_SEG: u32 = 256;
/// Discards are best aligned to whole pages: only those free memory.
pub const DISCARD_SECTOR_ALIGNMENT: u32 = SECTORS_PER_PAGE as u32;
pub const MAX_WRITE_ZEROES_SECTORS: u32 = MAX_DISCARD_SECTORS;

/// Length of the serial returned by GET_ID.
pub const SERIAL_LEN: usize = VIRTIO_BLK_ID_BYTES as usize;

/// Bytes of config space we answer for (the whole current struct, including
/// secure-erase and zoned fields, which stay zero).
pub const CONFIG_SPACE_LEN: usize = size_of::<virtio_blk_config>();

/// Virtio feature bits offered to the frontend.
///
/// IN_ORDER: each queue is drained by one thread that completes requests in
/// the order it took them (see `queue.rs`). That is what makes a frontend's
/// replay after a backend restart exact: QEMU rewinds the avail index to the
/// used index and submits from there (it has no INFLIGHT_SHMFD from us), and
/// cloud-hypervisor replays from the used index only when IN_ORDER was
/// negotiated. Re-running a half-done block write is harmless.
pub fn virtio_features(readonly: bool) -> u64 {
    let mut f = 1u64 << VIRTIO_F_VERSION_1
        | 1 << VIRTIO_F_IN_ORDER
        | 1 << VIRTIO_RING_F_EVENT_IDX
        | 1 << VIRTIO_RING_F_INDIRECT_DESC
        | 1 << VIRTIO_BLK_F_SEG_MAX
        | 1 << VIRTIO_BLK_F_BLK_SIZE
        | 1 << VIRTIO_BLK_F_TOPOLOGY
        | 1 << VIRTIO_BLK_F_FLUSH
        | 1 << VIRTIO_BLK_F_MQ
        | 1 << VIRTIO_BLK_F_DISCARD
        | 1 << VIRTIO_BLK_F_WRITE_ZEROES
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
        // Dirty page logging: without it QEMU refuses to migrate the VM.
        | VhostUserVirtioFeatures::LOG_ALL.bits();
    if readonly {
        f |= 1 << VIRTIO_BLK_F_RO;
    }
    f
}

/// vhost-user protocol features. QEMU refuses a blk backend without CONFIG;
/// CONFIGURE_MEM_SLOTS lifts QEMU's 8-region limit (memory hotplug, virtio-mem).
/// LOG_SHMFD: the dirty log comes as shared memory (SET_LOG_BASE), which is
/// how QEMU learns which guest pages we wrote while it migrates the VM.
pub fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::LOG_SHMFD
}

/// The guest-visible configuration of one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlkConfig {
    /// Capacity in 512-byte sectors.
    pub capacity_sectors: u64,
    pub num_queues: u16,
    /// Segments one discard or write-zeroes request may carry
    /// (`max_discard_seg` and `max_write_zeroes_seg`), 1..=[`MAX_DISCARD_SEG`].
    pub dwz_segments: u32,
}

impl BlkConfig {
    pub fn new(size_bytes: u64, num_queues: u16) -> BlkConfig {
        BlkConfig {
            capacity_sectors: size_bytes >> SECTOR_SHIFT,
            num_queues,
            dwz_segments: MAX_DISCARD_SEG,
        }
    }

    /// The config space, little-endian as virtio 1.x requires.
    pub fn to_bytes(&self) -> [u8; CONFIG_SPACE_LEN] {
        let mut b = [0u8; CONFIG_SPACE_LEN];
        let mut put = |off: usize, v: &[u8]| b[off..off + v.len()].copy_from_slice(v);
        type C = virtio_blk_config;
        put(
            offset_of!(C, capacity),
            &self.capacity_sectors.to_le_bytes(),
        );
        put(offset_of!(C, seg_max), &SEG_MAX.to_le_bytes());
        put(offset_of!(C, blk_size), &BLOCK_SIZE.to_le_bytes());
        // Topology is counted in logical blocks (blk_size), so 4 KiB
        // physical blocks with a 4 KiB logical block is exponent 0, and the
        // minimum and optimal I/O size is one block.
        put(offset_of!(C, physical_block_exp), &[0]);
        put(offset_of!(C, alignment_offset), &[0]);
        put(offset_of!(C, min_io_size), &1u16.to_le_bytes());
        put(offset_of!(C, opt_io_size), &1u32.to_le_bytes());
        put(offset_of!(C, num_queues), &self.num_queues.to_le_bytes());
        put(
            offset_of!(C, max_discard_sectors),
            &MAX_DISCARD_SECTORS.to_le_bytes(),
        );
        put(
            offset_of!(C, max_discard_seg),
            &self.dwz_segments.to_le_bytes(),
        );
        put(
            offset_of!(C, discard_sector_alignment),
            &DISCARD_SECTOR_ALIGNMENT.to_le_bytes(),
        );
        put(
            offset_of!(C, max_write_zeroes_sectors),
            &MAX_WRITE_ZEROES_SECTORS.to_le_bytes(),
        );
        put(
            offset_of!(C, max_write_zeroes_seg),
            &self.dwz_segments.to_le_bytes(),
        );
        // Zeroing a whole page frees it, so "may unmap" is always true.
        put(offset_of!(C, write_zeroes_may_unmap), &[1]);
        b
    }

    /// A GET_CONFIG reply: exactly `size` bytes from `offset`, zero past
    /// the end of our config space. vhost-user treats any other length as
    /// an error, and frontends differ in how much of the struct they know.
    pub fn read(&self, offset: u32, size: u32) -> Vec<u8> {
        let bytes = self.to_bytes();
        let mut out = vec![0u8; size as usize];
        let start = (offset as usize).min(CONFIG_SPACE_LEN);
        let end = (offset as usize)
            .saturating_add(size as usize)
            .min(CONFIG_SPACE_LEN);
        out[..end - start].copy_from_slice(&bytes[start..end]);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }

    #[test]
    fn layout_matches_the_spec() {
        let c = BlkConfig::new(8 << 30, 4).to_bytes();
        assert_eq!(CONFIG_SPACE_LEN, 96);
        assert_eq!(
            u64::from_le_bytes(c[0..8].try_into().unwrap()),
            (8u64 << 30) / 512
        );
        assert_eq!(u32_at(&c, 12), SEG_MAX);
        assert_eq!(u32_at(&c, 20), 4096);
        assert_eq!(c[24], 0, "physical_block_exp");
        assert_eq!(u16::from_le_bytes([c[26], c[27]]), 1, "min_io_size");
        assert_eq!(u32_at(&c, 28), 1, "opt_io_size");
        assert_eq!(u16::from_le_bytes([c[34], c[35]]), 4, "num_queues");
        for off in [36, 40, 44, 48, 52] {
            assert_ne!(
                u32_at(&c, off),
                0,
                "discard/write-zeroes field at {off} is zero"
            );
        }
        assert_eq!(u32_at(&c, 44), 8, "discard_sector_alignment");
        assert_eq!(c[56], 1, "write_zeroes_may_unmap");
        assert!(c[60..].iter().all(|&b| b == 0));
    }

    #[test]
    fn get_config_is_exactly_the_requested_size() {
        let cfg = BlkConfig::new(1 << 20, 1);
        let all = cfg.to_bytes();
        assert_eq!(cfg.read(0, 60), all[..60].to_vec());
        assert_eq!(cfg.read(8, 4), all[8..12].to_vec());
        let long = cfg.read(90, 16);
        assert_eq!(long.len(), 16);
        assert_eq!(&long[..6], &all[90..96]);
        assert!(long[6..].iter().all(|&b| b == 0));
        assert_eq!(cfg.read(200, 8), vec![0; 8]);
        assert_eq!(cfg.read(u32::MAX, 4), vec![0; 4]);
        assert!(cfg.read(0, 0).is_empty());
    }

    #[test]
    fn features() {
        let rw = virtio_features(false);
        assert_eq!(rw & (1 << VIRTIO_BLK_F_RO), 0);
        assert_ne!(virtio_features(true) & (1 << VIRTIO_BLK_F_RO), 0);
        for bit in [32, 35, 29, 28, 2, 6, 10, 9, 12, 13, 14, 30] {
            assert_ne!(rw & (1 << bit), 0, "feature bit {bit} missing");
        }
    }
}
