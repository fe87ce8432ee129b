//! Executing a parsed [`Request`] against a page store device.
//!
//! The disk is addressed in 512-byte sectors; the store in 4 KiB slots.
//! Whole, aligned pages go straight to `write_page`/`read_page` through one
//! bounce page per queue. Anything smaller is a read-modify-write in the
//! store under that slot's lock, so two queues writing different sectors of
//! one page never lose each other's bytes. Every store call carries the
//! queue's store [`Context`], which this layer holds but never looks into.

use std::sync::Arc;
use std::time::Instant;

use thiserror::Error;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use vm_memory::GuestMemory;
use vzram_store::{Context, Device, Op, Page, StoreError, PAGE_SIZE};

use crate::config::{BlkConfig, MAX_DISCARD_SECTORS, MAX_DISCARD_SEG, SECTOR_SIZE, SERIAL_LEN};
use crate::request::{Request, RequestType, SegmentCursor, DWZ_SEGMENT_LEN};

const PAGE: u64 = PAGE_SIZE as u64;

/// Why a well-formed request failed; each says the status the guest gets.
#[derive(Debug, Error)]
pub enum ExecError {
    /// The request reaches past the end of the device. IOERR.
    #[error("request past the end of the device")]
    OutOfRange,
    /// A write, discard or write-zeroes on a read-only device. IOERR.
    #[error("device is read-only")]
    ReadOnly,
    /// The store refused: a memory limit was hit (the slot keeps its old
    /// data), or a stored page is corrupt. IOERR.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Guest memory could not be read or written (it was unmapped under us). IOERR.
    #[error("guest memory access failed: {0}")]
    GuestMemory(String),
    /// Unknown request type, or discard/write-zeroes flags we do not know
    /// (or UNMAP on a discard). UNSUPP.
    #[error("unsupported request")]
    Unsupported,
    /// A discard/write-zeroes request with more segments than the device
    /// offers (`max_discard_seg`): what QEMU's own virtio-blk and
    /// qemu-storage-daemon answer too. UNSUPP.
    #[error("{0} discard/write-zeroes segments, the device takes {1}")]
    TooManySegments(u64, u32),
    /// A discard/write-zeroes segment longer than `max_discard_sectors`. IOERR.
    #[error("discard/write-zeroes segment of {0} sectors is too long")]
    SegmentTooLong(u32),
    /// Compressing or reading a page of the request on the compress pool
    /// failed unexpectedly (a bug, caught so the queue goes on). IOERR.
    #[error("the compress pool lost a page of this request")]
    Lost,
}

impl ExecError {
    /// The virtio status byte for this error: the one place an execution
    /// outcome becomes what the guest sees. No catch-all arm, so a new
    /// variant must say what the guest gets.
    pub fn status(&self) -> u8 {
        match self {
            ExecError::Unsupported | ExecError::TooManySegments(..) => VIRTIO_BLK_S_UNSUPP as u8,
            ExecError::OutOfRange
            | ExecError::ReadOnly
            | ExecError::Store(_)
            | ExecError::GuestMemory(_)
            | ExecError::SegmentTooLong(_)
            | ExecError::Lost => VIRTIO_BLK_S_IOERR as u8,
        }
    }
}

impl ExecError {
    /// Whether the host failed the request, not the guest's asking: a
    /// limit, a full or failing state, a lost page. The operator must hear
    /// of these; the rest only the guest needs to.
    pub fn host_side(&self) -> bool {
        match self {
            ExecError::Store(_) | ExecError::GuestMemory(_) | ExecError::Lost => true,
            ExecError::OutOfRange
            | ExecError::ReadOnly
            | ExecError::Unsupported
            | ExecError::TooManySegments(..)
            | ExecError::SegmentTooLong(_) => false,
        }
    }
}

impl From<vm_memory::GuestMemoryError> for ExecError {
    fn from(e: vm_memory::GuestMemoryError) -> Self {
        ExecError::GuestMemory(e.to_string())
    }
}

/// Status byte for a request that completed.
pub const STATUS_OK: u8 = VIRTIO_BLK_S_OK as u8;
/// Status byte for a malformed chain.
pub const STATUS_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;

/// One virtio-blk disk backed by a store device. Shared by all queue threads
/// and across frontend connections: the data lives as long as this does.
pub struct BlkDevice {
    store: Arc<Device>,
    readonly: bool,
    serial: [u8; SERIAL_LEN],
    num_queues: u16,
    /// Segments a discard or write-zeroes request may carry.
    dwz_segments: u32,
}

impl BlkDevice {
    /// `serial` longer than 20 bytes is cut (GET_ID has room for 20).
    pub fn new(store: Arc<Device>, num_queues: u16, readonly: bool, serial: &str) -> BlkDevice {
        let mut s = [0u8; SERIAL_LEN];
        let n = serial.len().min(SERIAL_LEN);
        s[..n].copy_from_slice(&serial.as_bytes()[..n]);
        BlkDevice {
            store,
            readonly,
            serial: s,
            num_queues,
            dwz_segments: MAX_DISCARD_SEG,
        }
    }

    /// Offers `n` segments per discard or write-zeroes request instead of
    /// [`MAX_DISCARD_SEG`] (clamped to 1..=that): a frontend that compares
    /// config spaces across backends (qemu-storage-daemon offers 1) sees
    /// the same disk.
    pub fn with_dwz_segments(mut self, n: u32) -> BlkDevice {
        self.dwz_segments = n.clamp(1, MAX_DISCARD_SEG);
        self
    }

    pub fn store(&self) -> &Arc<Device> {
        &self.store
    }

    pub fn readonly(&self) -> bool {
        self.readonly
    }

    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    pub fn config(&self) -> BlkConfig {
        BlkConfig {
            dwz_segments: self.dwz_segments,
            ..BlkConfig::new(self.store.size_bytes(), self.num_queues)
        }
    }

    /// Runs `req` with the queue's bounce page and store context. Returns
    /// how many payload bytes were written into the guest's buffers (not
    /// counting the status byte).
    pub fn execute<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        req: &Request,
        bounce: &mut Page,
        cx: &mut Context,
    ) -> Result<u32, ExecError> {
        self.execute_chained(mem, req, bounce, cx, &mut None)
    }

    /// [`BlkDevice::execute`] for requests run back to back: `clock` holds
    /// when the previous one ended, which is when this one starts, so each
    /// request reads the clock once instead of twice (the reads were 2.4%
    /// of a 4K write's CPU). A request's time then also holds the ring work
    /// since the one before (the previous status byte and used entry, its
    /// own pop and parse). `clock` is left holding this request's end, or
    /// None after one that is not timed.
    pub fn execute_chained<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        req: &Request,
        bounce: &mut Page,
        cx: &mut Context,
        clock: &mut Option<Instant>,
    ) -> Result<u32, ExecError> {
        let op = match req.kind {
            RequestType::In => Some(Op::Read),
            RequestType::Out => Some(Op::Write),
            RequestType::Discard | RequestType::WriteZeroes => Some(Op::Discard),
            _ => None,
        };
        let Some(op) = op else {
            *clock = None;
            return self.run(mem, req, bounce, cx);
        };
        let t0 = clock.take().unwrap_or_else(Instant::now);
        let r = self.run(mem, req, bounce, cx);
        let t1 = Instant::now();
        self.store.cells().record(op, cx.shard(), t1 - t0);
        *clock = Some(t1);
        r
    }

    fn run<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        req: &Request,
        bounce: &mut Page,
        cx: &mut Context,
    ) -> Result<u32, ExecError> {
        match req.kind {
            RequestType::In => {
                self.read(mem, req, bounce, cx)?;
                // The chain is < 4 GiB by construction (virtio-queue stops at 2^32).
                Ok(req.writable_len as u32)
            }
            RequestType::Out => {
                self.check_writable()?;
                self.write(mem, req, bounce, cx)?;
                Ok(0)
            }
            RequestType::Flush => Ok(0), // nothing is cached between us and RAM
            RequestType::GetId => {
                let n = (req.writable_len as usize).min(SERIAL_LEN);
                SegmentCursor::new(&req.writable).write(mem, &self.serial[..n])?;
                Ok(n as u32)
            }
            RequestType::Discard | RequestType::WriteZeroes => {
                self.check_writable()?;
                self.discard_or_zero(mem, req, cx)?;
                Ok(0)
            }
            RequestType::Unsupported(_) => Err(ExecError::Unsupported),
        }
    }

    /// The slot a read or write starts in, for [`BlkDevice::prefetch_slot`]
    /// and [`BlkDevice::prefetch_object`]; None for other requests.
    pub fn first_slot(&self, req: &Request) -> Option<u64> {
        matches!(req.kind, RequestType::In | RequestType::Out)
            .then(|| req.offset() / PAGE_SIZE as u64)
    }

    /// Starts loading the slot word of a request taken from the ring and
    /// not yet run (see [`vzram_store::Device::prefetch_slot`]).
    pub fn prefetch_slot(&self, slot: Option<u64>) {
        if let Some(s) = slot {
            self.store.prefetch_slot(s);
        }
    }

    /// Starts loading the object a request will read or replace, one
    /// request ahead of running it.
    pub fn prefetch_object(&self, slot: Option<u64>) {
        if let Some(s) = slot {
            self.store.prefetch_object(s);
        }
    }

    /// The first slot and the page count of a write that is whole, aligned
    /// pages on a writable device, inside it: what the compress pool can
    /// take. Anything else runs through [`BlkDevice::execute`].
    pub fn whole_page_write(&self, req: &Request) -> Option<(u64, usize)> {
        if req.kind != RequestType::Out || self.readonly {
            return None;
        }
        self.whole_pages(req.offset(), req.readable_len)
    }

    /// Whether a whole-page write of `pages` pages is better staged raw on
    /// its queue thread than handed to the compress pool: while the
    /// staging budgets have room for all of it (a swap-out burst).
    pub fn stages(&self, pages: usize) -> bool {
        self.store.staging_room(pages as u64)
    }

    /// The first slot and the page count of a read that is whole, aligned
    /// pages inside the device: what the compress pool can decompress.
    pub fn whole_page_read(&self, req: &Request) -> Option<(u64, usize)> {
        if req.kind != RequestType::In {
            return None;
        }
        self.whole_pages(req.offset(), req.writable_len)
    }

    /// `len` bytes at `offset` as whole, aligned pages inside the device
    /// (at least one): their first slot and count.
    fn whole_pages(&self, offset: u64, len: u64) -> Option<(u64, usize)> {
        let (start, end) = self.byte_range(offset, len).ok()?;
        if !start.is_multiple_of(PAGE) || !len.is_multiple_of(PAGE) || start == end {
            return None;
        }
        Some((start / PAGE, ((end - start) / PAGE) as usize))
    }

    /// Records a request's latency, as [`BlkDevice::execute`] does.
    pub fn record_latency(&self, op: Op, queue: usize, since: Instant) {
        self.store.cells().record(op, queue, since.elapsed());
    }

    fn check_writable(&self) -> Result<(), ExecError> {
        if self.readonly {
            Err(ExecError::ReadOnly)
        } else {
            Ok(())
        }
    }

    /// Byte range of an IN/OUT request, checked against the capacity.
    fn byte_range(&self, start: u64, len: u64) -> Result<(u64, u64), ExecError> {
        let end = start.checked_add(len).ok_or(ExecError::OutOfRange)?;
        if end > self.store.size_bytes() {
            return Err(ExecError::OutOfRange);
        }
        Ok((start, end))
    }

    fn read<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        req: &Request,
        bounce: &mut Page,
        cx: &mut Context,
    ) -> Result<(), ExecError> {
        let (mut pos, end) = self.byte_range(req.offset(), req.writable_len)?;
        let mut out = SegmentCursor::new(&req.writable);
        while pos < end {
            let slot = pos / PAGE;
            let off = (pos % PAGE) as usize;
            let n = (PAGE_SIZE - off).min((end - pos) as usize);
            pos += n as u64;
            if n == PAGE_SIZE {
                // SAFETY: read_page only writes `page` (a fill, a copy, or a
                // decoder's output, whose match copies read earlier output
                // as data but take no length or index from it).
                let direct = unsafe {
                    out.with_next_mut(mem, PAGE_SIZE, |buf| {
                        let page: &mut Page = buf.try_into().expect("one page");
                        self.store.read_page(cx, slot, page)
                    })
                };
                if let Some(r) = direct {
                    r?;
                    continue;
                }
            }
            self.store.read_page(cx, slot, bounce)?;
            out.write(mem, &bounce[off..off + n])?;
        }
        Ok(())
    }

    fn write<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        req: &Request,
        bounce: &mut Page,
        cx: &mut Context,
    ) -> Result<(), ExecError> {
        let (mut pos, end) = self.byte_range(req.offset(), req.readable_len)?;
        let mut input = SegmentCursor::new(&req.readable);
        while pos < end {
            let slot = pos / PAGE;
            let off = (pos % PAGE) as usize;
            let n = (PAGE_SIZE - off).min((end - pos) as usize);
            // Copy out of guest memory first: the guest may change its buffer
            // while we compress, and the store needs a stable page.
            input.read(mem, &mut bounce[..n])?;
            if n == PAGE_SIZE {
                self.store.write_page(cx, slot, bounce)?;
            } else {
                self.store.write_partial(cx, slot, off, &bounce[..n])?;
            }
            pos += n as u64;
        }
        Ok(())
    }

    fn discard_or_zero<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        req: &Request,
        cx: &mut Context,
    ) -> Result<(), ExecError> {
        let allowed_flags = match req.kind {
            RequestType::WriteZeroes => VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
            _ => 0,
        };
        // Read and check every segment before touching anything, so a bad
        // segment fails the whole request with no change on the disk.
        let count = req.num_dwz_segments();
        if count > u64::from(self.dwz_segments) {
            return Err(ExecError::TooManySegments(count, self.dwz_segments));
        }
        let mut ranges = [(0u64, 0u64); MAX_DISCARD_SEG as usize];
        let ranges = ranges
            .get_mut(..count as usize)
            .ok_or(ExecError::TooManySegments(count, self.dwz_segments))?;
        let mut input = SegmentCursor::new(&req.readable);
        let mut seg = [0u8; DWZ_SEGMENT_LEN as usize];
        let capacity = self.store.size_bytes();
        for r in ranges.iter_mut() {
            input.read(mem, &mut seg)?;
            let sector = u64::from_le_bytes(seg[0..8].try_into().expect("8 bytes"));
            let num = u32::from_le_bytes(seg[8..12].try_into().expect("4 bytes"));
            let flags = u32::from_le_bytes(seg[12..16].try_into().expect("4 bytes"));
            if flags & !allowed_flags != 0 {
                return Err(ExecError::Unsupported);
            }
            if num > MAX_DISCARD_SECTORS {
                return Err(ExecError::SegmentTooLong(num));
            }
            let start = sector
                .checked_mul(SECTOR_SIZE)
                .ok_or(ExecError::OutOfRange)?;
            let end = start
                .checked_add(u64::from(num) * SECTOR_SIZE)
                .ok_or(ExecError::OutOfRange)?;
            if end > capacity {
                return Err(ExecError::OutOfRange);
            }
            *r = (start, end);
        }
        for &(start, end) in ranges.iter() {
            self.zero_range(cx, start, end)?;
        }
        Ok(())
    }

    /// Makes `[start, end)` read as zeros: whole slots are freed, the ends
    /// of partial pages are zeroed in place.
    fn zero_range(&self, cx: &mut Context, start: u64, end: u64) -> Result<(), StoreError> {
        let mut pos = start;
        while pos < end {
            let slot = pos / PAGE;
            let off = (pos % PAGE) as usize;
            if off == 0 && end - pos >= PAGE {
                let last = end / PAGE;
                self.store.discard(cx, slot..last)?;
                pos = last * PAGE;
                continue;
            }
            let n = (PAGE_SIZE - off).min((end - pos) as usize);
            self.store.zero_partial(cx, slot, off, n)?;
            pos += n as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::tests::{d, guest_mem, header, F_WRITE};
    use crate::request::RequestError;
    use std::mem::offset_of;
    use virtio_bindings::virtio_blk::*;
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
    use vzram_store::{Codec, DeviceConfig, Pool, PoolConfig};

    const H: u64 = 0x10_0000;
    const DATA: u64 = 0x20_0000;
    const ST: u64 = 0x30_0000;
    const SIZE: u64 = 1 << 20;

    struct Fixture {
        mem: GuestMemoryMmap,
        dev: BlkDevice,
        bounce: Box<Page>,
        cx: Context,
    }

    fn fixture(readonly: bool) -> Fixture {
        fixture_with(readonly, 0)
    }

    fn fixture_with(readonly: bool, mem_limit: u64) -> Fixture {
        let pool = Pool::new(PoolConfig {
            host_mem_limit: 0,
            arena_bytes: 1 << 30,
            ..PoolConfig::default()
        })
        .unwrap();
        let mut cfg = DeviceConfig::new(SIZE, Codec::Lz4);
        cfg.shards = 1;
        cfg.mem_limit = mem_limit;
        let store = pool.create_device(cfg).unwrap();
        Fixture {
            mem: guest_mem(),
            dev: BlkDevice::new(store, 1, readonly, "serial-123"),
            bounce: Box::new([0; PAGE_SIZE]),
            cx: Context::new(0),
        }
    }

    /// Only an unknown request or flag is UNSUPP; every other failure is
    /// IOERR.
    #[test]
    fn each_error_has_its_status() {
        let unsupp = VIRTIO_BLK_S_UNSUPP as u8;
        let ioerr = VIRTIO_BLK_S_IOERR as u8;
        for (e, want) in [
            (ExecError::Unsupported, unsupp),
            (ExecError::TooManySegments(2, 1), unsupp),
            (ExecError::OutOfRange, ioerr),
            (ExecError::ReadOnly, ioerr),
            (ExecError::Store(StoreError::Corrupt { slot: 0 }), ioerr),
            (ExecError::GuestMemory(String::new()), ioerr),
            (ExecError::SegmentTooLong(0), ioerr),
            (ExecError::Lost, ioerr),
        ] {
            assert_eq!(e.status(), want, "{e:?}");
        }
    }

    impl Fixture {
        /// Runs one chain the way the queue thread does (`run_chain` in
        /// queue.rs): a chain that does not parse gets IOERR and is not
        /// executed. Returns (status, used payload bytes).
        fn run(&mut self, descs: &[RawDescriptor]) -> (u8, u32) {
            let q = MockSplitQueue::new(&self.mem, 1024);
            let chain = q.build_desc_chain(descs).unwrap();
            let mut req = Request::default();
            match req.parse(chain) {
                Ok(()) => match self
                    .dev
                    .execute(&self.mem, &req, &mut self.bounce, &mut self.cx)
                {
                    Ok(n) => (STATUS_OK, n),
                    Err(e) => (e.status(), 0),
                },
                Err(_) => (STATUS_IOERR, 0),
            }
        }

        fn write(&mut self, sector: u64, data: &[u8]) -> u8 {
            header(&self.mem, H, VIRTIO_BLK_T_OUT, sector);
            self.mem.write_slice(data, GuestAddress(DATA)).unwrap();
            self.run(&[
                d(H, 16, 0),
                d(DATA, data.len() as u32, 0),
                d(ST, 1, F_WRITE),
            ])
            .0
        }

        fn read(&mut self, sector: u64, len: usize) -> (u8, Vec<u8>) {
            header(&self.mem, H, VIRTIO_BLK_T_IN, sector);
            let (st, n) = self.run(&[d(H, 16, 0), d(DATA, len as u32, F_WRITE), d(ST, 1, F_WRITE)]);
            let mut out = vec![0u8; len];
            self.mem.read_slice(&mut out, GuestAddress(DATA)).unwrap();
            if st == STATUS_OK {
                assert_eq!(n as usize, len);
            }
            (st, out)
        }

        fn dwz(&mut self, t: u32, segs: &[(u64, u32, u32)]) -> u8 {
            header(&self.mem, H, t, 0);
            for (i, &(sector, num, flags)) in segs.iter().enumerate() {
                let mut b = [0u8; 16];
                b[0..8].copy_from_slice(&sector.to_le_bytes());
                b[8..12].copy_from_slice(&num.to_le_bytes());
                b[12..16].copy_from_slice(&flags.to_le_bytes());
                self.mem
                    .write_slice(&b, GuestAddress(DATA + 16 * i as u64))
                    .unwrap();
            }
            self.run(&[
                d(H, 16, 0),
                d(DATA, 16 * segs.len() as u32, 0),
                d(ST, 1, F_WRITE),
            ])
            .0
        }
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
            .collect()
    }

    #[test]
    fn whole_pages_round_trip() {
        let mut f = fixture(false);
        let data = pattern(3 * PAGE_SIZE, 1);
        assert_eq!(f.write(8, &data), STATUS_OK);
        assert_eq!(f.read(8, data.len()), (STATUS_OK, data));
        let (st, zeros) = f.read(0, 4096);
        assert_eq!(st, STATUS_OK);
        assert!(zeros.iter().all(|&b| b == 0));
    }

    #[test]
    fn unaligned_and_sub_page_io_match_a_model() {
        let mut f = fixture(false);
        let mut model = vec![0u8; 64 * 1024];
        let cases: &[(u64, usize)] = &[
            (1, 512),
            (7, 1024),
            (3, 4096),
            (9, 8192 + 512),
            (0, 512),
            (15, 3 * 4096),
            (30, 512),
        ];
        for (i, &(sector, len)) in cases.iter().enumerate() {
            let data = pattern(len, i as u8 + 7);
            assert_eq!(f.write(sector, &data), STATUS_OK);
            let off = sector as usize * 512;
            model[off..off + len].copy_from_slice(&data);
        }
        let (st, all) = f.read(0, model.len());
        assert_eq!(st, STATUS_OK);
        assert_eq!(all, model);
        // Unaligned read spanning pages.
        let (st, part) = f.read(5, 5000 / 512 * 512);
        assert_eq!(st, STATUS_OK);
        assert_eq!(part, model[5 * 512..5 * 512 + 5000 / 512 * 512]);
    }

    #[test]
    fn scattered_descriptors() {
        let mut f = fixture(false);
        // Write 3 sectors from three separate buffers, one straddling a page of the disk.
        header(&f.mem, H, VIRTIO_BLK_T_OUT, 7);
        let data = pattern(1536, 9);
        f.mem.write_slice(&data[..512], GuestAddress(DATA)).unwrap();
        f.mem
            .write_slice(&data[512..1024], GuestAddress(DATA + 0x5000))
            .unwrap();
        f.mem
            .write_slice(&data[1024..], GuestAddress(DATA + 0x9000))
            .unwrap();
        let (st, _) = f.run(&[
            d(H, 16, 0),
            d(DATA, 512, 0),
            d(DATA + 0x5000, 512, 0),
            d(DATA + 0x9000, 512, 0),
            d(ST, 1, F_WRITE),
        ]);
        assert_eq!(st, STATUS_OK);
        assert_eq!(f.read(7, 1536), (STATUS_OK, data));
    }

    #[test]
    fn out_of_range() {
        let mut f = fixture(false);
        let last = SIZE / 512 - 1;
        assert_eq!(f.write(last, &[1; 512]), STATUS_OK);
        assert_eq!(f.write(last, &[1; 1024]), STATUS_IOERR);
        assert_eq!(f.read(last + 1, 512).0, STATUS_IOERR);
        assert_eq!(f.read(last, 512).0, STATUS_OK);
        assert_eq!(f.dwz(VIRTIO_BLK_T_DISCARD, &[(last, 2, 0)]), STATUS_IOERR);
        assert_eq!(
            f.dwz(VIRTIO_BLK_T_DISCARD, &[(u64::MAX / 2, 8, 0)]),
            STATUS_IOERR
        );
    }

    #[test]
    fn read_only_rejects_writes() {
        let mut f = fixture(true);
        assert_eq!(f.write(0, &[1; 4096]), STATUS_IOERR);
        assert_eq!(f.dwz(VIRTIO_BLK_T_DISCARD, &[(0, 8, 0)]), STATUS_IOERR);
        assert_eq!(f.dwz(VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 8, 0)]), STATUS_IOERR);
        assert_eq!(f.read(0, 4096), (STATUS_OK, vec![0; 4096]));
        header(&f.mem, H, VIRTIO_BLK_T_FLUSH, 0);
        assert_eq!(f.run(&[d(H, 16, 0), d(ST, 1, F_WRITE)]).0, STATUS_OK);
        assert_eq!(f.dev.store().stats().writes, 0);
    }

    #[test]
    fn discard_and_write_zeroes_free_memory() {
        let mut f = fixture(false);
        let data = pattern(16 * PAGE_SIZE, 3);
        assert_eq!(f.write(0, &data), STATUS_OK);
        let before = f.dev.store().stats();
        assert!(before.mem_used_total > 0);
        // Two segments: sectors 8..24 (pages 1-2) and 40..44 (half of page 5).
        assert_eq!(
            f.dwz(VIRTIO_BLK_T_DISCARD, &[(8, 16, 0), (40, 4, 0)]),
            STATUS_OK
        );
        let mut model = data.clone();
        model[8 * 512..24 * 512].fill(0);
        model[40 * 512..44 * 512].fill(0);
        assert_eq!(f.read(0, model.len()), (STATUS_OK, model.clone()));
        // Write-zeroes with UNMAP, unaligned start and end.
        assert_eq!(
            f.dwz(
                VIRTIO_BLK_T_WRITE_ZEROES,
                &[(49, 40, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP)]
            ),
            STATUS_OK
        );
        model[49 * 512..89 * 512].fill(0);
        assert_eq!(f.read(0, model.len()), (STATUS_OK, model));
        // Logical data shrinks at once.
        let after = f.dev.store().stats();
        assert!(after.orig_data_size < before.orig_data_size);
        assert!(after.compr_data_size < before.compr_data_size);
        assert!(after.discards >= 2);
    }

    #[test]
    fn discarding_most_of_the_disk_gives_memory_back() {
        let mut f = fixture(false);
        let pages = 192;
        for chunk in 0..pages / 16 {
            let data = pattern(16 * PAGE_SIZE, chunk as u8);
            assert_eq!(f.write(chunk * 16 * 8, &data), STATUS_OK);
        }
        let before = f.dev.store().stats().mem_used_total;
        assert_eq!(f.dwz(VIRTIO_BLK_T_DISCARD, &[(0, 160 * 8, 0)]), STATUS_OK);
        let after = f.dev.store().stats().mem_used_total;
        assert!(after < before / 2, "{after} !< {before} / 2");
    }

    #[test]
    fn discard_flags_and_segment_checks() {
        let mut f = fixture(false);
        assert_eq!(f.write(0, &[7; 4096]), STATUS_OK);
        // UNMAP is not allowed on a discard; unknown flags nowhere.
        assert_eq!(f.dwz(VIRTIO_BLK_T_DISCARD, &[(0, 8, 1)]), STATUS_UNSUPP);
        assert_eq!(
            f.dwz(VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 8, 2)]),
            STATUS_UNSUPP
        );
        // Too long a segment.
        assert_eq!(
            f.dwz(VIRTIO_BLK_T_DISCARD, &[(0, MAX_DISCARD_SECTORS + 8, 0)]),
            STATUS_IOERR
        );
        // One good and one bad segment: nothing happens.
        assert_eq!(
            f.dwz(VIRTIO_BLK_T_DISCARD, &[(0, 8, 0), (SIZE / 512, 8, 0)]),
            STATUS_IOERR
        );
        assert_eq!(f.read(0, 4096), (STATUS_OK, vec![7; 4096]));
        // Zero-length segments are fine.
        assert_eq!(f.dwz(VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 0, 0)]), STATUS_OK);
        // More segments than the device offers: UNSUPP, and nothing happens.
        let many = vec![(0u64, 8u32, 0u32); MAX_DISCARD_SEG as usize + 1];
        assert_eq!(f.dwz(VIRTIO_BLK_T_DISCARD, &many), STATUS_UNSUPP);
        assert_eq!(f.read(0, 4096), (STATUS_OK, vec![7; 4096]));
    }

    /// A device offering one segment per request (as qemu-storage-daemon
    /// does) says so in its config space and refuses two with UNSUPP.
    #[test]
    fn a_device_offering_one_segment_refuses_two() {
        let mut f = fixture(false);
        f.dev = BlkDevice::new(f.dev.store().clone(), 1, false, "s").with_dwz_segments(1);
        let cfg = f.dev.config().to_bytes();
        type C = virtio_blk_config;
        for off in [
            offset_of!(C, max_discard_seg),
            offset_of!(C, max_write_zeroes_seg),
        ] {
            assert_eq!(cfg[off..off + 4], 1u32.to_le_bytes(), "at {off}");
        }
        assert_eq!(f.write(0, &[7; 8192]), STATUS_OK);
        for t in [VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_WRITE_ZEROES] {
            assert_eq!(f.dwz(t, &[(0, 8, 0), (8, 8, 0)]), STATUS_UNSUPP, "{t}");
        }
        assert_eq!(f.read(0, 8192), (STATUS_OK, vec![7; 8192]));
        assert_eq!(f.dwz(VIRTIO_BLK_T_DISCARD, &[(0, 8, 0)]), STATUS_OK);
        assert_eq!(f.read(0, 4096), (STATUS_OK, vec![0; 4096]));
        assert_eq!(
            BlkDevice::new(f.dev.store().clone(), 1, false, "s")
                .with_dwz_segments(0)
                .config()
                .dwz_segments,
            1
        );
    }

    const STATUS_UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

    /// Back-to-back requests share clock reads: each starts when the one
    /// before ended; one that is not timed (a flush) breaks the chain.
    #[test]
    fn chained_clock() {
        let mut f = fixture(false);
        let run =
            |f: &mut Fixture, t: u32, descs: &[RawDescriptor], clock: &mut Option<Instant>| {
                header(&f.mem, H, t, 0);
                let q = MockSplitQueue::new(&f.mem, 1024);
                let mut req = Request::default();
                req.parse(q.build_desc_chain(descs).unwrap()).unwrap();
                f.dev
                    .execute_chained(&f.mem, &req, &mut f.bounce, &mut f.cx, clock)
                    .unwrap();
            };
        let page = [d(H, 16, 0), d(DATA, 4096, 0), d(ST, 1, F_WRITE)];
        let before = Instant::now();
        let mut clock = None;
        run(&mut f, VIRTIO_BLK_T_OUT, &page, &mut clock);
        let first = clock.expect("a write is timed");
        assert!(first >= before);
        run(&mut f, VIRTIO_BLK_T_OUT, &page, &mut clock);
        assert!(clock.expect("still chained") >= first);
        run(
            &mut f,
            VIRTIO_BLK_T_FLUSH,
            &[d(H, 16, 0), d(ST, 1, F_WRITE)],
            &mut clock,
        );
        assert_eq!(clock, None);
        let read = [d(H, 16, 0), d(DATA, 4096, F_WRITE), d(ST, 1, F_WRITE)];
        run(&mut f, VIRTIO_BLK_T_IN, &read, &mut clock);
        assert!(clock.is_some());
        let st = f.dev.store().stats();
        assert_eq!((st.writes, st.reads), (2, 1));
        // The start handed in is the one recorded: a read "begun" a second
        // ago is timed at a second or more.
        let mut clock = Some(Instant::now() - std::time::Duration::from_secs(1));
        run(&mut f, VIRTIO_BLK_T_IN, &read, &mut clock);
        let reads = f
            .dev
            .store()
            .cells()
            .latencies()
            .into_iter()
            .find(|(op, _)| *op == Op::Read)
            .expect("read latencies")
            .1;
        assert_eq!(reads.count, 2);
        assert!(reads.sum_seconds >= 1.0, "{}", reads.sum_seconds);
    }

    #[test]
    fn get_id_and_unknown_type() {
        let mut f = fixture(false);
        header(&f.mem, H, VIRTIO_BLK_T_GET_ID, 0);
        f.mem.write_slice(&[0xff; 20], GuestAddress(DATA)).unwrap();
        let (st, n) = f.run(&[d(H, 16, 0), d(DATA, 20, F_WRITE), d(ST, 1, F_WRITE)]);
        assert_eq!((st, n), (STATUS_OK, 20));
        let mut id = [0u8; 20];
        f.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id[..10], b"serial-123");
        assert!(id[10..].iter().all(|&b| b == 0));

        header(&f.mem, H, VIRTIO_BLK_T_SCSI_CMD, 0);
        assert_eq!(f.run(&[d(H, 16, 0), d(ST, 1, F_WRITE)]).0, STATUS_UNSUPP);
        header(&f.mem, H, 0xdead, 0);
        assert_eq!(
            f.run(&[d(H, 16, 0), d(DATA, 512, 0), d(ST, 1, F_WRITE)]).0,
            STATUS_UNSUPP
        );
    }

    #[test]
    fn limit_hit_keeps_old_data() {
        let mut f = fixture_with(false, 64 * 1024);
        let page = |seed: u8| -> Vec<u8> {
            // Incompressible so that every page costs a full 4 KiB.
            let mut x = 0x9e37_79b9u32 ^ u32::from(seed);
            (0..PAGE_SIZE)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x as u8
                })
                .collect()
        };
        let first = page(1);
        assert_eq!(f.write(0, &first), STATUS_OK);
        let mut failed = false;
        for i in 1..64u64 {
            if f.write(i * 8, &page(i as u8 + 1)) == STATUS_IOERR {
                failed = true;
                break;
            }
        }
        assert!(failed, "the device limit was never hit");
        let failed_before = f.dev.store().stats().failed_writes;
        assert!(failed_before >= 1);
        // Overwriting slot 0 at the limit fails and leaves it intact.
        assert_eq!(f.write(0, &page(200)), STATUS_IOERR);
        assert_eq!(f.dev.store().stats().failed_writes, failed_before + 1);
        assert_eq!(f.read(0, PAGE_SIZE), (STATUS_OK, first));
    }

    #[test]
    fn malformed_chains_never_reach_the_store() {
        let mut f = fixture(false);
        // The same chain with a whole sector of data is executed: the
        // counter below does move when a write reaches the store.
        assert_eq!(f.write(0, &[0x5a; 512]), STATUS_OK);
        let writes = f.dev.store().stats().writes;
        assert!(writes >= 1);
        // 100 bytes is not a whole sector: the chain fails to parse, the
        // guest gets IOERR and neither the counter nor the data changes.
        header(&f.mem, H, VIRTIO_BLK_T_OUT, 0);
        f.mem.write_slice(&[0xa5; 100], GuestAddress(DATA)).unwrap();
        let q = MockSplitQueue::new(&f.mem, 1024);
        let descs = [d(H, 16, 0), d(DATA, 100, 0), d(ST, 1, F_WRITE)];
        let chain = q.build_desc_chain(&descs).unwrap();
        let mut req = Request::default();
        assert_eq!(req.parse(chain), Err(RequestError::NotSectorMultiple(100)));
        assert_eq!(f.run(&descs), (STATUS_IOERR, 0));
        assert_eq!(f.dev.store().stats().writes, writes);
        assert_eq!(f.read(0, 512), (STATUS_OK, vec![0x5a; 512]));
    }
}
