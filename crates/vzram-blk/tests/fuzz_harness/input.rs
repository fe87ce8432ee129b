//! Reading an input: the byte stream, and the value decoders the guest's
//! operations draw addresses, lengths, sectors, types and flags from. Each
//! favours edges (of memory, of the disk, of u64) over uniform values.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use vzram_blk::config::MAX_DISCARD_SECTORS;

use super::memory::Region;
use super::{Harness, F_INDIRECT, F_WRITE, SECTOR};

/// Reads the input as a stream; past its end every read yields zeros.
pub(super) struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Input<'_> {
    pub(super) fn new(data: &[u8]) -> Input<'_> {
        Input { data, pos: 0 }
    }
    pub(super) fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }
    pub(super) fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    pub(super) fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        for b in a.iter_mut() {
            *b = self.u8();
        }
        a
    }
    pub(super) fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }
    pub(super) fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    pub(super) fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
    pub(super) fn bytes(&mut self, n: usize) -> Vec<u8> {
        let end = (self.pos + n).min(self.data.len());
        let v = self.data.get(self.pos..end).unwrap_or(&[]).to_vec();
        self.pos += n;
        v
    }
}

impl Harness<'_> {
    pub(super) fn first(&self) -> Region {
        self.regions[0]
    }
    pub(super) fn last(&self) -> Region {
        *self.regions.last().expect("a region")
    }

    /// A guest address: mostly inside memory, often at its edges, in the gap,
    /// past the end, or near 2^64.
    pub(super) fn addr(&mut self) -> u64 {
        let (a, b) = (self.first(), self.last());
        match self.inp.u8() % 10 {
            0 | 1 => a.start + u64::from(self.inp.u16()) % a.len,
            2 => b.start + u64::from(self.inp.u16()) % b.len,
            3 => a.end() - u64::from(self.inp.u8()),
            4 => b.end() - u64::from(self.inp.u8()),
            5 => b.end().saturating_add(u64::from(self.inp.u16())),
            6 => a.end() + u64::from(self.inp.u16()),
            7 => u64::MAX - u64::from(self.inp.u16()),
            8 => self.inp.u64(),
            _ => b.start.wrapping_sub(1 + u64::from(self.inp.u8())),
        }
    }

    /// A descriptor length: 0, 1, header-sized, sector multiples, pages,
    /// odd sizes, and values near 2^32.
    pub(super) fn len(&mut self) -> u32 {
        match self.inp.u8() % 10 {
            0 => 0,
            1 => 1,
            2 => 16,
            3 => 512 * (u32::from(self.inp.u8() % 16) + 1),
            4 => 4096 * (u32::from(self.inp.u8() % 4) + 1),
            5 => u32::from(self.inp.u8()),
            6 => u32::from(self.inp.u16()),
            7 => u32::MAX - u32::from(self.inp.u8()),
            8 => self.inp.u32(),
            _ => 17,
        }
    }

    /// A sector: inside the disk, at its end, past it, and at the edge of
    /// `sector * 512` overflowing u64.
    pub(super) fn sector(&mut self) -> u64 {
        match self.inp.u8() % 9 {
            0 => u64::from(self.inp.u8()),
            1 => u64::from(self.inp.u16()),
            2 => (self.dev_size / SECTOR).saturating_sub(u64::from(self.inp.u8())),
            3 => self.dev_size / SECTOR + u64::from(self.inp.u8()),
            4 => self.inp.u64(),
            5 => (u64::MAX / SECTOR + 1).wrapping_sub(u64::from(self.inp.u8() % 4)),
            6 => u64::MAX - u64::from(self.inp.u8()),
            7 => u64::from(self.inp.u8()) * 8,
            _ => 1 << 55 | u64::from(self.inp.u8()),
        }
    }

    pub(super) fn req_type(&mut self) -> u32 {
        match self.inp.u8() % 10 {
            0 => VIRTIO_BLK_T_IN,
            1 => VIRTIO_BLK_T_OUT,
            2 => VIRTIO_BLK_T_FLUSH,
            3 => VIRTIO_BLK_T_GET_ID,
            4 => VIRTIO_BLK_T_DISCARD,
            5 => VIRTIO_BLK_T_WRITE_ZEROES,
            6 => self.inp.u32(),
            7 => 2,  // SCSI_CMD
            8 => 14, // SECURE_ERASE, not offered
            _ => 0x8000_0000 | u32::from(self.inp.u8()),
        }
    }

    pub(super) fn dwz_num(&mut self) -> u32 {
        match self.inp.u8() % 6 {
            0 => u32::from(self.inp.u8()),
            1 => 8 * u32::from(self.inp.u8()),
            2 => MAX_DISCARD_SECTORS,
            3 => MAX_DISCARD_SECTORS + 1,
            4 => self.inp.u32(),
            _ => u32::MAX,
        }
    }

    pub(super) fn dwz_flags(&mut self) -> u32 {
        match self.inp.u8() % 4 {
            0 => 0,
            1 => VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
            2 => self.inp.u32(),
            _ => 2,
        }
    }

    /// Descriptor flags: mostly NEXT/WRITE/INDIRECT, sometimes any u16.
    pub(super) fn flags(&mut self) -> u16 {
        let f = self.inp.u8();
        let mut flags = u16::from(f & 7);
        if f & 0x80 != 0 {
            flags |= self.inp.u16();
        }
        flags
    }

    /// A compact descriptor for the chain builders: NEXT is set by them.
    pub(super) fn compact_desc(&mut self) -> (u64, u32, u16) {
        let addr = self.addr();
        let len = self.len();
        let f = self.inp.u8();
        let mut flags = 0;
        if f & 1 != 0 {
            flags |= F_WRITE;
        }
        if f & 0x40 != 0 {
            flags |= F_INDIRECT;
        }
        (addr, len, flags)
    }
}
