//! The vocabulary of the hand-written ring: virtio-blk request types and
//! status bytes, descriptor flags, where the ring, headers and data live
//! in guest RAM, and descriptors and used elements as the guest sees them.

/// virtio-blk request types and status bytes.
pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
pub const T_GET_ID: u32 = 8;
pub const T_DISCARD: u32 = 11;
pub const T_WRITE_ZEROES: u32 = 13;
pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;
pub const S_UNSUPP: u8 = 2;
/// What a status byte holds before the device writes it.
pub const UNTOUCHED: u8 = 0xee;

/// Descriptor flags.
pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
pub const F_INDIRECT: u16 = 4;

/// Acked only by tests that ask for it: EVENT_IDX makes completions
/// depend on notification suppression.
pub(super) const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;

/// The default guest RAM: a low region holding the ring, headers and
/// status bytes, and a high region for data, with a hole in between.
pub const LOW: (u64, usize) = (0, 4 << 20);
pub const HIGH: (u64, usize) = (16 << 20, 8 << 20);
/// An address in the hole between the two regions.
pub const GAP: u64 = 8 << 20;
/// Past the end of all guest RAM.
pub const FAR: u64 = 1 << 40;

/// Where things live in guest RAM (all in the low region but DATA).
pub const DESC: u64 = 0x1000; // up to 1024 descriptors: 0x1000..0x5000
pub const AVAIL: u64 = 0x5000; // 4 + 2 * 1024 + 2 bytes
pub const USED: u64 = 0x6000; // 4 + 8 * 1024 + 2 bytes
pub const HDR: u64 = 0x9000; // request headers, 16 bytes each
pub const STATUS: u64 = 0xa000; // status bytes, 1 apart
pub const SCRATCH: u64 = 0xb000; // indirect tables, discard segments ...
pub const DATA_LO: u64 = 0x10_0000; // data in the low region (up to 3 MiB)
pub const DATA: u64 = HIGH.0; // data in the high region (8 MiB)

/// A descriptor as the guest writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

/// A descriptor whose `next` is filled in by [`RawDev::chain`](super::RawDev::chain).
pub fn d(addr: u64, len: u32, flags: u16) -> Desc {
    Desc {
        addr,
        len,
        flags,
        next: 0,
    }
}

/// A descriptor with its `next` given.
pub fn dn(addr: u64, len: u32, flags: u16, next: u16) -> Desc {
    Desc {
        addr,
        len,
        flags,
        next,
    }
}

/// A used-ring element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Used {
    pub id: u32,
    pub len: u32,
}
