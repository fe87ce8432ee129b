//! The guest side: the operations an input is made of, which write
//! descriptors, headers, segments and bytes into guest memory, build direct,
//! indirect and long chains, publish heads and kick; the request macro,
//! which lays out a well-formed request, and the batch macro, several at
//! once.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress};
use vzram_blk::config::MAX_DISCARD_SEG;

use super::{
    op, Harness, AVAIL_RING, BATCH_DATA_LEN, BATCH_HDR_AT, BATCH_STATUS_AT, BATCH_TABLES_AT,
    DATA_AT, DESC_TABLE, F_INDIRECT, F_NEXT, F_WRITE, HDR_AT, INDIRECT_AT, PAGE, SECTOR, SEGS_AT,
    STATUS_AT,
};

impl Harness<'_> {
    pub(super) fn write_desc(&self, at: u64, d: Descriptor) {
        let _ = self.mem.write_obj(d, GuestAddress(at));
    }

    pub(super) fn write_bytes(&self, at: u64, b: &[u8]) {
        // Region by region, so a write straddling a hole (or the end of the
        // address space) still lands where there is memory.
        let (start, end) = (u128::from(at), u128::from(at) + b.len() as u128);
        for r in &self.regions {
            let s = start.max(u128::from(r.start));
            let e = end.min(u128::from(r.end()));
            if s < e {
                let part = &b[(s - start) as usize..(e - start) as usize];
                self.mem
                    .write_slice(part, GuestAddress(s as u64))
                    .expect("write inside a region");
            }
        }
    }

    pub(super) fn header_bytes(t: u32, ioprio: u32, sector: u64) -> [u8; 16] {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&t.to_le_bytes());
        h[4..8].copy_from_slice(&ioprio.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        h
    }

    pub(super) fn segment_bytes(sector: u64, num: u32, flags: u32) -> [u8; 16] {
        let mut s = [0u8; 16];
        s[0..8].copy_from_slice(&sector.to_le_bytes());
        s[8..12].copy_from_slice(&num.to_le_bytes());
        s[12..16].copy_from_slice(&flags.to_le_bytes());
        s
    }

    /// Publishes `head` in the avail ring, as the guest driver does.
    pub(super) fn push_avail(&self, head: u16) {
        let idx: u16 = self.mem.read_obj(GuestAddress(AVAIL_RING + 2)).unwrap_or(0);
        let slot = AVAIL_RING + 4 + 2 * u64::from(idx % self.qsize);
        let _ = self.mem.write_obj(head, GuestAddress(slot));
        let _ = self
            .mem
            .write_obj(idx.wrapping_add(1), GuestAddress(AVAIL_RING + 2));
    }

    /// Writes a linked chain at consecutive table indices starting at `head`.
    pub(super) fn write_chain_at_table(
        &self,
        table: u64,
        size: u16,
        head: u16,
        descs: &[(u64, u32, u16)],
    ) {
        for (i, &(addr, len, flags)) in descs.iter().enumerate() {
            let idx = (usize::from(head) + i) % usize::from(size);
            let last = i + 1 == descs.len();
            let next = ((idx + 1) % usize::from(size)) as u16;
            let flags = if last {
                flags & !F_NEXT
            } else {
                flags | F_NEXT
            };
            self.write_desc(
                table.wrapping_add(16 * idx as u64),
                Descriptor::new(addr, len, flags, if last { 0 } else { next }),
            );
        }
    }

    pub(super) fn op(&mut self) {
        let code = match self.inp.u8() {
            op::BATCH => op::BATCH,
            b => b % op::OP_COUNT,
        };
        match code {
            op::DESC => {
                let idx = self.inp.u16() % self.qsize;
                let (addr, len, flags, next) =
                    (self.addr(), self.len(), self.flags(), self.inp.u16());
                self.write_desc(
                    DESC_TABLE + 16 * u64::from(idx),
                    Descriptor::new(addr, len, flags, next),
                );
            }
            op::DESC_AT => {
                let at = self.addr();
                let (addr, len, flags, next) =
                    (self.addr(), self.len(), self.flags(), self.inp.u16());
                self.write_desc(at, Descriptor::new(addr, len, flags, next));
            }
            op::BYTES => {
                let at = self.addr();
                let n = usize::from(self.inp.u8());
                let b = self.inp.bytes(n);
                self.write_bytes(at, &b);
            }
            op::HEADER => {
                let at = self.addr();
                let (t, prio, sector) = (self.req_type(), u32::from(self.inp.u8()), self.sector());
                self.write_bytes(at, &Self::header_bytes(t, prio, sector));
            }
            op::SEGMENTS => {
                let at = self.addr();
                let n = match self.inp.u8() {
                    250..=255 => MAX_DISCARD_SEG as usize + 1,
                    240..=249 => MAX_DISCARD_SEG as usize,
                    x => usize::from(x % 8) + 1,
                };
                let mut buf = Vec::with_capacity(16 * n);
                // Beyond the eighth segment repeat the input's last one: the
                // fuzzer need not spell out 257 segments.
                let mut seg = [0u8; 16];
                for i in 0..n {
                    if i < 8 {
                        seg = Self::segment_bytes(self.sector(), self.dwz_num(), self.dwz_flags());
                    }
                    buf.extend_from_slice(&seg);
                }
                self.write_bytes(at, &buf);
            }
            op::FILL => {
                let at = self.addr();
                let (len, byte) = (usize::from(self.inp.u16()), self.inp.u8());
                self.write_bytes(at, &vec![byte; len]);
            }
            op::KICK => {
                let n = self.inp.u8() % 4 + 1;
                for _ in 0..n {
                    let head = self.inp.u16();
                    // Mostly valid heads; sometimes any index.
                    let head = if head & 0x8000 != 0 {
                        head & 0x7fff
                    } else {
                        head % self.qsize
                    };
                    self.push_avail(head);
                }
                self.process();
            }
            op::CHAIN => {
                let head = u16::from(self.inp.u8()) % self.qsize;
                let n = usize::from(self.inp.u8() % 8) + 1;
                let descs: Vec<_> = (0..n).map(|_| self.compact_desc()).collect();
                self.write_chain_at_table(DESC_TABLE, self.qsize, head, &descs);
                self.push_avail(head);
                self.process();
            }
            op::INDIRECT => {
                let table = self.addr();
                let head = u16::from(self.inp.u8()) % self.qsize;
                let n = usize::from(self.inp.u8() % 8) + 1;
                let descs: Vec<_> = (0..n).map(|_| self.compact_desc()).collect();
                let len = match self.inp.u8() % 6 {
                    0 => 0,
                    1 => 16 * n as u32 + 8,
                    2 => self.inp.u32(),
                    _ => 16 * n as u32,
                };
                self.write_chain_at_table(table, n as u16, 0, &descs);
                self.write_desc(
                    DESC_TABLE + 16 * u64::from(head),
                    Descriptor::new(table, len, F_INDIRECT, 0),
                );
                self.push_avail(head);
                self.process();
            }
            op::REQUEST => self.request_macro(),
            op::READONLY => self.readonly = !self.readonly,
            op::LIMIT => {
                let limit = match self.inp.u8() % 4 {
                    0 => 0,
                    1 => 16 * 1024,
                    2 => 64 * 1024,
                    _ => self.store.stats().mem_used_total + 4096,
                };
                self.store.set_mem_limit(limit);
            }
            op::COMPACT => {
                self.store.compact();
                self.verify_all("after compaction");
            }
            op::PROCESS => self.process(),
            op::BATCH => self.batch_macro(),
            _ => self.long_chain(),
        }
    }

    /// A well-formed request with fuzz-chosen type, sector, size and data:
    /// the fuzzer reaches successful I/O without finding the format first.
    pub(super) fn request_macro(&mut self) {
        let kind = self.inp.u8() % 6;
        let sector = self.sector();
        let head = u16::from(self.inp.u8()) % self.qsize;
        let shape = self.inp.u8();
        let (split, indirect) = (usize::from(shape % 4) + 1, shape & 4 != 0);
        let t = [
            VIRTIO_BLK_T_IN,
            VIRTIO_BLK_T_OUT,
            VIRTIO_BLK_T_FLUSH,
            VIRTIO_BLK_T_GET_ID,
            VIRTIO_BLK_T_DISCARD,
            VIRTIO_BLK_T_WRITE_ZEROES,
        ][usize::from(kind)];
        self.write_bytes(HDR_AT, &Self::header_bytes(t, 0, sector));
        let mut descs = vec![(HDR_AT, 16u32, 0u16)];
        let (data_len, data_flags) = match t {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let len = 512 * (u32::from(self.inp.u8() % 32) + 1);
                let seed = self.inp.u8();
                if t == VIRTIO_BLK_T_OUT {
                    let data = payload(len as usize, seed);
                    self.write_bytes(DATA_AT, &data);
                }
                (len, if t == VIRTIO_BLK_T_IN { F_WRITE } else { 0 })
            }
            VIRTIO_BLK_T_GET_ID => (u32::from(self.inp.u8() % 32), F_WRITE),
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                let n = usize::from(self.inp.u8() % 4) + 1;
                let mut buf = Vec::new();
                for _ in 0..n {
                    buf.extend_from_slice(&Self::segment_bytes(
                        self.sector(),
                        self.dwz_num(),
                        self.dwz_flags(),
                    ));
                }
                self.write_bytes(SEGS_AT, &buf);
                (buf.len() as u32, 0)
            }
            _ => (0, 0),
        };
        let base = if t == VIRTIO_BLK_T_DISCARD || t == VIRTIO_BLK_T_WRITE_ZEROES {
            SEGS_AT
        } else {
            DATA_AT
        };
        // Split the payload into `split` descriptors of uneven sizes.
        let mut off = 0u32;
        for i in 0..split {
            let piece = if i + 1 == split {
                data_len - off
            } else {
                (data_len - off) / 2
            };
            if piece > 0 || (i == 0 && data_len == 0 && t == VIRTIO_BLK_T_GET_ID) {
                descs.push((base + u64::from(off), piece, data_flags));
            }
            off += piece;
        }
        descs.push((STATUS_AT, 1, F_WRITE));
        if indirect {
            self.write_chain_at_table(INDIRECT_AT, descs.len() as u16, 0, &descs);
            let len = 16 * descs.len() as u32;
            self.write_desc(
                DESC_TABLE + 16 * u64::from(head),
                Descriptor::new(INDIRECT_AT, len, F_INDIRECT, 0),
            );
        } else {
            self.write_chain_at_table(DESC_TABLE, self.qsize, head, &descs);
        }
        self.push_avail(head);
        self.process();
    }

    /// An indirect table of up to 300 descriptors: header, `n - 2` copies of
    /// one data descriptor, status. Reaches the descriptor-count limit and
    /// large scattered requests.
    pub(super) fn long_chain(&mut self) {
        let n = usize::from(self.inp.u16() % 300) + 1;
        let table = self.addr();
        let head = u16::from(self.inp.u8()) % self.qsize;
        let hdr = (self.addr(), 16, 0);
        let data = self.compact_desc();
        let status = (self.addr(), 1, F_WRITE);
        let mut descs = vec![hdr];
        descs.extend(std::iter::repeat_n(data, n.saturating_sub(2)));
        if n > 1 {
            descs.push(status);
        }
        self.write_chain_at_table(table, descs.len() as u16, 0, &descs);
        let len = 16 * descs.len() as u32;
        self.write_desc(
            DESC_TABLE + 16 * u64::from(head),
            Descriptor::new(table, len, F_INDIRECT, 0),
        );
        self.push_avail(head);
        self.process();
    }

    /// Up to 8 well-formed requests laid out side by side and published at
    /// once, so that one drain takes them together: writes of whole pages
    /// (with the pool mode, those of `POOL_MIN_PAGES` and more go to the
    /// pool), reads of whole pages, FLUSH, and writes of sectors (which run
    /// on the queue thread). Their buffers lie in the last 64 KiB of memory
    /// and may overlap, so a read in a batch may change what a write after
    /// it reads.
    pub(super) fn batch_macro(&mut self) {
        let n = usize::from(self.inp.u8() % 8) + 1;
        // Three table entries a chain: room for all in the queue.
        let n = n.min(usize::from(self.qsize / 3).max(1));
        let data_at = self.last().end() - BATCH_DATA_LEN;
        let (dev_pages, area_pages) = (self.dev_size / PAGE, BATCH_DATA_LEN / PAGE);
        let mut heads = Vec::with_capacity(n);
        for i in 0..n {
            let sel = self.inp.u8();
            let t = [
                VIRTIO_BLK_T_OUT,
                VIRTIO_BLK_T_IN,
                VIRTIO_BLK_T_FLUSH,
                VIRTIO_BLK_T_OUT,
            ][usize::from(sel % 4)];
            let mut descs = Vec::with_capacity(3);
            let hdr = BATCH_HDR_AT + 16 * i as u64;
            let mut sector = 0;
            if t != VIRTIO_BLK_T_FLUSH {
                let slot = u64::from(self.inp.u16()) % dev_pages;
                let size = u64::from(self.inp.u8());
                let buf = u64::from(self.inp.u8()) % area_pages;
                let room = area_pages - buf;
                let len = if sel % 4 == 3 {
                    sector = slot * (PAGE / SECTOR) + u64::from(self.inp.u8() % 8);
                    let sectors = (size % 32 + 1)
                        .min(self.dev_size / SECTOR - sector)
                        .min(room * (PAGE / SECTOR));
                    sectors * SECTOR
                } else {
                    sector = slot * (PAGE / SECTOR);
                    (size % 16 + 1).min(dev_pages - slot).min(room) * PAGE
                };
                let addr = data_at + buf * PAGE;
                let flags = if t == VIRTIO_BLK_T_IN {
                    F_WRITE
                } else {
                    let seed = self.inp.u8();
                    self.write_bytes(addr, &payload(len as usize, seed));
                    0
                };
                descs.push((addr, len as u32, flags));
            }
            self.write_bytes(hdr, &Self::header_bytes(t, 0, sector));
            descs.insert(0, (hdr, 16, 0));
            descs.push((BATCH_STATUS_AT + i as u64, 1, F_WRITE));
            let head = (3 * i as u16) % self.qsize;
            if sel & 4 != 0 {
                let table = BATCH_TABLES_AT + 64 * i as u64;
                self.write_chain_at_table(table, descs.len() as u16, 0, &descs);
                let len = 16 * descs.len() as u32;
                self.write_desc(
                    DESC_TABLE + 16 * u64::from(head),
                    Descriptor::new(table, len, F_INDIRECT, 0),
                );
            } else {
                self.write_chain_at_table(DESC_TABLE, self.qsize, head, &descs);
            }
            heads.push(head);
        }
        for head in heads {
            self.push_avail(head);
        }
        self.process();
    }
}

/// Data the request macro writes: compressible for seeds below 0x80,
/// incompressible (xorshift) above, to reach the memory limits.
pub(super) fn payload(len: usize, seed: u8) -> Vec<u8> {
    if seed & 0x80 == 0 {
        return (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
            .collect();
    }
    let mut x = 0x9e37_79b9u32 ^ u32::from(seed) << 8;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}
