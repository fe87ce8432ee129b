//! Parsing a virtio-blk descriptor chain into a [`Request`].
//!
//! Parsing has no side effects: it reads the descriptors and the 16-byte
//! header and nothing else, so it can be tested (and fuzzed) alone. The
//! chain is read as virtio 1.x says a device must, without assuming where
//! descriptor boundaries fall: the device-readable bytes are the header and
//! then the request's payload; the device-writable bytes are the payload the
//! device fills and then, as the very last byte, the status.
//!
//! Every error says which virtio status the guest gets. When the chain has
//! no writable last byte there is nowhere to put a status at all; the chain
//! is then returned with a used length of 0.

use std::ops::Deref;

use thiserror::Error;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_queue::DescriptorChain;
use vm_memory::{Address, GuestAddress, GuestMemory, Permissions};

use crate::config::{MAX_DESCRIPTORS, SECTOR_SIZE};

/// Size of `struct virtio_blk_outhdr`: type, ioprio, sector.
pub const HEADER_LEN: usize = 16;
/// Size of one `struct virtio_blk_discard_write_zeroes` segment.
pub const DWZ_SEGMENT_LEN: u64 = 16;

/// Why a chain could not be turned into a request.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum RequestError {
    /// The chain has no descriptors, so no status byte. Nothing is written;
    /// the chain is returned with used length 0.
    #[error("descriptor chain is empty")]
    EmptyChain,
    /// The last descriptor is device-readable, so the status byte cannot be
    /// written. Nothing is written; used length 0.
    #[error("status byte is not device-writable")]
    StatusNotWritable,
    /// A descriptor points outside guest memory. If the status byte itself is
    /// inside guest memory and writable, the guest gets IOERR; otherwise
    /// nothing is written (used length 0).
    #[error("descriptor {addr:#x}+{len} is outside guest memory")]
    OutsideGuestMemory { addr: u64, len: u32 },
    /// A device-readable descriptor follows a device-writable one. IOERR.
    #[error("device-readable descriptor after a device-writable one")]
    ReadableAfterWritable,
    /// The readable part is shorter than the 16-byte header. IOERR.
    #[error("request header is {0} bytes, need {HEADER_LEN}")]
    ShortHeader(u64),
    /// More descriptors than `seg_max` plus header and status. IOERR.
    #[error("more than {MAX_DESCRIPTORS} descriptors in a chain")]
    TooManySegments,
    /// Payload flows the wrong way for the request type: a read (IN) with
    /// readable data, a write (OUT) with writable data, or GET_ID, DISCARD or
    /// WRITE_ZEROES with payload in the wrong direction. IOERR.
    #[error("payload direction does not match the request type")]
    WrongDirection,
    /// The IN/OUT payload is not a whole number of 512-byte sectors. IOERR.
    #[error("payload of {0} bytes is not a multiple of 512")]
    NotSectorMultiple(u64),
    /// `sector * 512 + payload` does not fit in 64 bits. IOERR.
    #[error("sector {0} overflows the byte address space")]
    SectorOverflow(u64),
    /// DISCARD or WRITE_ZEROES payload is empty or not whole 16-byte
    /// segments. IOERR.
    #[error("discard/write-zeroes payload of {0} bytes is not whole segments")]
    BadSegmentList(u64),
    /// The chain ended on a descriptor that still says NEXT: it looped,
    /// pointed past the table or nested indirect tables, and virtio-queue
    /// stopped walking it. We cannot know where the status byte is, so
    /// nothing is written; used length 0.
    #[error("descriptor chain is cut short (loop or bad next index)")]
    TruncatedChain,
}

/// The request types we know; anything else gets UNSUPP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RequestType {
    #[default]
    In,
    Out,
    Flush,
    GetId,
    Discard,
    WriteZeroes,
    Unsupported(u32),
}

impl RequestType {
    pub fn from_raw(t: u32) -> RequestType {
        match t {
            VIRTIO_BLK_T_IN => RequestType::In,
            VIRTIO_BLK_T_OUT => RequestType::Out,
            VIRTIO_BLK_T_FLUSH => RequestType::Flush,
            VIRTIO_BLK_T_GET_ID => RequestType::GetId,
            VIRTIO_BLK_T_DISCARD => RequestType::Discard,
            VIRTIO_BLK_T_WRITE_ZEROES => RequestType::WriteZeroes,
            other => RequestType::Unsupported(other),
        }
    }
}

/// A range of guest memory, known to be inside guest memory when parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub addr: GuestAddress,
    pub len: u32,
}

/// A parsed request. Kept per queue thread and reused, so parsing does not
/// allocate once the vectors have grown to the largest chain seen.
#[derive(Debug, Default, Clone)]
pub struct Request {
    pub kind: RequestType,
    /// First sector (512 bytes) of IN and OUT.
    pub sector: u64,
    /// Device-readable payload after the header: OUT data, or the
    /// discard/write-zeroes segments.
    pub readable: Vec<Segment>,
    pub readable_len: u64,
    /// Device-writable payload before the status byte: IN data, GET_ID.
    pub writable: Vec<Segment>,
    pub writable_len: u64,
    /// Where the status byte goes. Set whenever the chain ends in a writable
    /// byte inside guest memory, even if parsing then fails, so that the
    /// guest can still be told IOERR.
    pub status: Option<GuestAddress>,
}

impl Request {
    fn clear(&mut self) {
        self.kind = RequestType::default();
        self.sector = 0;
        self.readable.clear();
        self.readable_len = 0;
        self.writable.clear();
        self.writable_len = 0;
        self.status = None;
    }

    /// Byte offset of the first sector; checked not to overflow with the
    /// payload added (IN/OUT only).
    pub fn offset(&self) -> u64 {
        self.sector * SECTOR_SIZE
    }

    /// Number of discard/write-zeroes segments.
    pub fn num_dwz_segments(&self) -> u64 {
        self.readable_len / DWZ_SEGMENT_LEN
    }

    /// Parses `chain` into `self`, replacing what was there.
    pub fn parse<M>(&mut self, mut chain: DescriptorChain<M>) -> Result<(), RequestError>
    where
        M: Deref,
        M::Target: GuestMemory,
    {
        self.clear();

        // First pass over the descriptors: find the status byte (the last
        // byte of the last descriptor) before anything else can fail, and
        // collect the rest with their direction.
        let mut header = [0u8; HEADER_LEN];
        let mut header_got = 0usize;
        let mut count = 0usize;
        let mut seen_writable = false;
        let mut first_err: Option<RequestError> = None;
        let mut last: Option<(GuestAddress, u32, bool)> = None;
        let mut last_has_next = false;

        while let Some(desc) = chain.next() {
            last_has_next = desc.has_next();
            let mem = chain.memory();
            count += 1;
            if count > MAX_DESCRIPTORS {
                first_err.get_or_insert(RequestError::TooManySegments);
            }
            let (addr, len, write) = (desc.addr(), desc.len(), desc.is_write_only());
            last = Some((addr, len, write));
            if first_err.is_some() {
                continue; // keep walking only to find the status byte
            }
            let access = if write {
                Permissions::Write
            } else {
                Permissions::Read
            };
            if !crate::guest::in_range(mem, addr, len as usize, access) {
                first_err = Some(RequestError::OutsideGuestMemory {
                    addr: addr.raw_value(),
                    len,
                });
                continue;
            }
            if write {
                seen_writable = true;
                self.writable.push(Segment { addr, len });
                self.writable_len += u64::from(len);
            } else if seen_writable {
                first_err = Some(RequestError::ReadableAfterWritable);
            } else {
                // The header may span descriptors, or share one with data.
                let take = (HEADER_LEN - header_got).min(len as usize);
                if take > 0 {
                    // check_range above guarantees this read succeeds.
                    if crate::guest::read(mem, addr, &mut header[header_got..header_got + take])
                        .is_err()
                    {
                        first_err = Some(RequestError::OutsideGuestMemory {
                            addr: addr.raw_value(),
                            len,
                        });
                        continue;
                    }
                    header_got += take;
                }
                if take < len as usize {
                    self.readable.push(Segment {
                        addr: addr.unchecked_add(take as u64),
                        len: len - take as u32,
                    });
                    self.readable_len += u64::from(len) - take as u64;
                }
            }
        }

        let mem = chain.memory();
        if last_has_next {
            return Err(RequestError::TruncatedChain);
        }
        // The status byte.
        match last {
            None => return Err(RequestError::EmptyChain),
            Some((_, _, false)) => return Err(first_err.unwrap_or(RequestError::StatusNotWritable)),
            Some((_, 0, true)) => return Err(first_err.unwrap_or(RequestError::StatusNotWritable)),
            Some((addr, len, true)) => {
                let status = addr.checked_add(u64::from(len) - 1);
                if let Some(s) =
                    status.filter(|&s| crate::guest::in_range(mem, s, 1, Permissions::Write))
                {
                    self.status = Some(s);
                } else {
                    return Err(first_err.unwrap_or(RequestError::OutsideGuestMemory {
                        addr: addr.raw_value(),
                        len,
                    }));
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        // Drop the status byte from the writable payload.
        if let Some(seg) = self.writable.last_mut() {
            seg.len -= 1;
            if seg.len == 0 {
                self.writable.pop();
            }
        }
        self.writable_len -= 1;

        if header_got < HEADER_LEN {
            return Err(RequestError::ShortHeader(header_got as u64));
        }
        let raw_type = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
        self.sector = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
        self.kind = RequestType::from_raw(raw_type);

        match self.kind {
            RequestType::In | RequestType::Out => {
                let (data, other) = if self.kind == RequestType::In {
                    (self.writable_len, self.readable_len)
                } else {
                    (self.readable_len, self.writable_len)
                };
                if other != 0 {
                    return Err(RequestError::WrongDirection);
                }
                if !data.is_multiple_of(SECTOR_SIZE) {
                    return Err(RequestError::NotSectorMultiple(data));
                }
                self.sector
                    .checked_mul(SECTOR_SIZE)
                    .and_then(|o| o.checked_add(data))
                    .ok_or(RequestError::SectorOverflow(self.sector))?;
            }
            RequestType::GetId => {
                if self.readable_len != 0 {
                    return Err(RequestError::WrongDirection);
                }
            }
            RequestType::Discard | RequestType::WriteZeroes => {
                if self.writable_len != 0 {
                    return Err(RequestError::WrongDirection);
                }
                if self.readable_len == 0 || !self.readable_len.is_multiple_of(DWZ_SEGMENT_LEN) {
                    return Err(RequestError::BadSegmentList(self.readable_len));
                }
            }
            // FLUSH carries no payload; any stray bytes are ignored. Unknown
            // types are answered UNSUPP by the executor whatever they carry.
            RequestType::Flush | RequestType::Unsupported(_) => {}
        }
        Ok(())
    }
}

/// Whether any of `segs` overlaps a range of `ranges` ([start, end) guest
/// addresses).
pub(crate) fn overlaps(ranges: &[(u64, u64)], segs: &[Segment]) -> bool {
    segs.iter().any(|s| {
        let (a, b) = (s.addr.0, s.addr.0.saturating_add(u64::from(s.len)));
        ranges.iter().any(|&(lo, hi)| a < hi && lo < b)
    })
}

/// Walks a list of segments as one byte stream, copying to or from guest
/// memory in pieces of any size.
pub struct SegmentCursor<'a> {
    segs: &'a [Segment],
    idx: usize,
    off: u32,
}

impl<'a> SegmentCursor<'a> {
    pub fn new(segs: &'a [Segment]) -> SegmentCursor<'a> {
        SegmentCursor {
            segs,
            idx: 0,
            off: 0,
        }
    }

    /// Fills `buf` from the stream. Fails if guest memory went away or the
    /// stream is shorter than `buf` (callers size requests from the parsed
    /// lengths, so that is a bug, not guest input).
    pub fn read<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        buf: &mut [u8],
    ) -> Result<(), vm_memory::GuestMemoryError> {
        let mut done = 0;
        while done < buf.len() {
            let (addr, n) = self.next_piece(buf.len() - done)?;
            crate::guest::read(mem, addr, &mut buf[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// Writes `buf` into the stream.
    pub fn write<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        buf: &[u8],
    ) -> Result<(), vm_memory::GuestMemoryError> {
        let mut done = 0;
        while done < buf.len() {
            let (addr, n) = self.next_piece(buf.len() - done)?;
            crate::guest::write(mem, addr, &buf[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// Runs `f` on the next `n` bytes of the stream as one mutable slice of
    /// guest memory, and moves past them, when they lie in one segment and
    /// one region; else does nothing and returns None.
    ///
    /// # Safety
    ///
    /// As for [`crate::guest::with_mut`]: `f` only writes the slice and
    /// never relies on what it reads back.
    pub(crate) unsafe fn with_next_mut<M: GuestMemory + ?Sized, T>(
        &mut self,
        mem: &M,
        n: usize,
        f: impl FnOnce(&mut [u8]) -> T,
    ) -> Option<T> {
        while self.segs.get(self.idx)?.len == self.off {
            self.idx += 1;
            self.off = 0;
        }
        let seg = self.segs[self.idx];
        if ((seg.len - self.off) as usize) < n {
            return None;
        }
        let addr = seg.addr.unchecked_add(u64::from(self.off));
        // SAFETY: our caller keeps the contract for `f`.
        let r = unsafe { crate::guest::with_mut(mem, addr, n, f) }?;
        self.off += n as u32;
        Some(r)
    }

    /// The address of the next `n` bytes of the stream, and moves past
    /// them, when they lie in one segment; else None, and the cursor stays.
    pub(crate) fn next_whole(&mut self, n: usize) -> Option<GuestAddress> {
        while self.segs.get(self.idx)?.len == self.off {
            self.idx += 1;
            self.off = 0;
        }
        let seg = self.segs[self.idx];
        if ((seg.len - self.off) as usize) < n {
            return None;
        }
        let addr = seg.addr.unchecked_add(u64::from(self.off));
        self.off += n as u32;
        Some(addr)
    }

    fn next_piece(
        &mut self,
        want: usize,
    ) -> Result<(GuestAddress, usize), vm_memory::GuestMemoryError> {
        loop {
            let Some(seg) = self.segs.get(self.idx) else {
                return Err(vm_memory::GuestMemoryError::PartialBuffer {
                    expected: want,
                    completed: 0,
                });
            };
            let left = seg.len - self.off;
            if left == 0 {
                self.idx += 1;
                self.off = 0;
                continue;
            }
            let n = want.min(left as usize);
            let addr = seg.addr.unchecked_add(u64::from(self.off));
            self.off += n as u32;
            return Ok((addr, n));
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestMemoryMmap};

    pub const F_NEXT: u16 = 1;
    pub const F_WRITE: u16 = 2;

    pub fn guest_mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap()
    }

    pub fn d(addr: u64, len: u32, flags: u16) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags, 0))
    }

    pub fn header(mem: &GuestMemoryMmap, at: u64, t: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&t.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&h, GuestAddress(at)).unwrap();
    }

    pub fn parse(
        mem: &GuestMemoryMmap,
        descs: &[RawDescriptor],
    ) -> (Request, Result<(), RequestError>) {
        let q = MockSplitQueue::new(mem, 1024);
        let chain = q.build_desc_chain(descs).unwrap();
        let mut r = Request::default();
        let res = r.parse(chain);
        (r, res)
    }

    const H: u64 = 0x10_0000;
    const DATA: u64 = 0x20_0000;
    const ST: u64 = 0x30_0000;

    #[test]
    fn read_request() {
        let mem = guest_mem();
        header(&mem, H, VIRTIO_BLK_T_IN, 7);
        let (r, res) = parse(
            &mem,
            &[
                d(H, 16, 0),
                d(DATA, 4096, F_WRITE),
                d(DATA + 8192, 512, F_WRITE),
                d(ST, 1, F_WRITE),
            ],
        );
        res.unwrap();
        assert_eq!(r.kind, RequestType::In);
        assert_eq!(r.sector, 7);
        assert_eq!(r.writable_len, 4608);
        assert_eq!(r.writable.len(), 2);
        assert_eq!(r.readable_len, 0);
        assert_eq!(r.status, Some(GuestAddress(ST)));
    }

    #[test]
    fn write_request_with_header_and_data_in_one_descriptor() {
        let mem = guest_mem();
        header(&mem, H, VIRTIO_BLK_T_OUT, 3);
        let (r, res) = parse(&mem, &[d(H, 16 + 1024, 0), d(ST, 1, F_WRITE)]);
        res.unwrap();
        assert_eq!(r.kind, RequestType::Out);
        assert_eq!(
            r.readable,
            vec![Segment {
                addr: GuestAddress(H + 16),
                len: 1024
            }]
        );
        assert_eq!(r.offset(), 3 * 512);
    }

    #[test]
    fn header_split_over_descriptors_and_status_inside_data() {
        let mem = guest_mem();
        header(&mem, H, VIRTIO_BLK_T_IN, 9);
        // Header in two pieces; the status byte is the last byte of the data descriptor.
        let (r, res) = parse(&mem, &[d(H, 5, 0), d(H + 5, 11, 0), d(DATA, 513, F_WRITE)]);
        res.unwrap();
        assert_eq!(r.sector, 9);
        assert_eq!(r.writable_len, 512);
        assert_eq!(r.status, Some(GuestAddress(DATA + 512)));
    }

    #[test]
    fn flush_get_id_unknown() {
        let mem = guest_mem();
        header(&mem, H, VIRTIO_BLK_T_FLUSH, 0);
        let (r, res) = parse(&mem, &[d(H, 16, 0), d(ST, 1, F_WRITE)]);
        res.unwrap();
        assert_eq!(r.kind, RequestType::Flush);

        header(&mem, H, VIRTIO_BLK_T_GET_ID, 0);
        let (r, res) = parse(
            &mem,
            &[d(H, 16, 0), d(DATA, 20, F_WRITE), d(ST, 1, F_WRITE)],
        );
        res.unwrap();
        assert_eq!((r.kind, r.writable_len), (RequestType::GetId, 20));

        header(&mem, H, 99, 0);
        let (r, res) = parse(&mem, &[d(H, 16, 0), d(ST, 1, F_WRITE)]);
        res.unwrap();
        assert_eq!(r.kind, RequestType::Unsupported(99));
    }

    #[test]
    fn discard_segments() {
        let mem = guest_mem();
        header(&mem, H, VIRTIO_BLK_T_DISCARD, 0);
        let (r, res) = parse(&mem, &[d(H, 16, 0), d(DATA, 48, 0), d(ST, 1, F_WRITE)]);
        res.unwrap();
        assert_eq!((r.kind, r.num_dwz_segments()), (RequestType::Discard, 3));

        let (_, res) = parse(&mem, &[d(H, 16, 0), d(DATA, 20, 0), d(ST, 1, F_WRITE)]);
        assert_eq!(res, Err(RequestError::BadSegmentList(20)));
        let (_, res) = parse(&mem, &[d(H, 16, 0), d(ST, 1, F_WRITE)]);
        assert_eq!(res, Err(RequestError::BadSegmentList(0)));
        // More segments than the device takes is the executor's call
        // (UNSUPP, with the device's own limit): the chain itself is fine.
        let n = u64::from(crate::config::MAX_DISCARD_SEG) + 1;
        let (r, res) = parse(
            &mem,
            &[d(H, 16, 0), d(DATA, (n * 16) as u32, 0), d(ST, 1, F_WRITE)],
        );
        res.unwrap();
        assert_eq!(
            (r.num_dwz_segments(), r.status),
            (n, Some(GuestAddress(ST)))
        );

        header(&mem, H, VIRTIO_BLK_T_WRITE_ZEROES, 0);
        let (_, res) = parse(
            &mem,
            &[d(H, 16, 0), d(DATA, 16, F_WRITE), d(ST, 1, F_WRITE)],
        );
        assert_eq!(res, Err(RequestError::WrongDirection));
    }

    #[test]
    fn wrong_direction() {
        let mem = guest_mem();
        header(&mem, H, VIRTIO_BLK_T_IN, 0);
        let (r, res) = parse(&mem, &[d(H, 16, 0), d(DATA, 512, 0), d(ST, 1, F_WRITE)]);
        assert_eq!(res, Err(RequestError::WrongDirection));
        assert_eq!(r.status, Some(GuestAddress(ST)));

        header(&mem, H, VIRTIO_BLK_T_OUT, 0);
        let (_, res) = parse(
            &mem,
            &[d(H, 16, 0), d(DATA, 512, F_WRITE), d(ST, 1, F_WRITE)],
        );
        assert_eq!(res, Err(RequestError::WrongDirection));

        header(&mem, H, VIRTIO_BLK_T_GET_ID, 0);
        let (_, res) = parse(&mem, &[d(H, 16, 0), d(DATA, 20, 0), d(ST, 1, F_WRITE)]);
        assert_eq!(res, Err(RequestError::WrongDirection));

        // Readable after writable.
        header(&mem, H, VIRTIO_BLK_T_OUT, 0);
        let (r, res) = parse(
            &mem,
            &[
                d(H, 16, 0),
                d(DATA, 512, F_WRITE),
                d(DATA + 4096, 512, 0),
                d(ST, 1, F_WRITE),
            ],
        );
        assert_eq!(res, Err(RequestError::ReadableAfterWritable));
        assert_eq!(r.status, Some(GuestAddress(ST)));
    }

    #[test]
    fn status_missing_or_read_only() {
        let mem = guest_mem();
        header(&mem, H, VIRTIO_BLK_T_OUT, 0);
        let (r, res) = parse(&mem, &[d(H, 16, 0), d(DATA, 512, 0), d(ST, 1, 0)]);
        assert_eq!(res, Err(RequestError::StatusNotWritable));
        assert_eq!(r.status, None);
        let (r, res) = parse(&mem, &[d(H, 16, 0)]);
        assert_eq!(res, Err(RequestError::StatusNotWritable));
        assert_eq!(r.status, None);
        // A zero-length writable "status".
        let (r, res) = parse(&mem, &[d(H, 16, 0), d(ST, 0, F_WRITE)]);
        assert_eq!(res, Err(RequestError::StatusNotWritable));
        assert_eq!(r.status, None);
    }

    #[test]
    fn short_header() {
        let mem = guest_mem();
        let (r, res) = parse(&mem, &[d(H, 8, 0), d(ST, 1, F_WRITE)]);
        assert_eq!(res, Err(RequestError::ShortHeader(8)));
        assert_eq!(r.status, Some(GuestAddress(ST)));
        let (_, res) = parse(&mem, &[d(ST, 1, F_WRITE)]);
        assert_eq!(res, Err(RequestError::ShortHeader(0)));
    }

    #[test]
    fn lengths_not_sector_multiples() {
        let mem = guest_mem();
        header(&mem, H, VIRTIO_BLK_T_IN, 0);
        let (_, res) = parse(
            &mem,
            &[d(H, 16, 0), d(DATA, 511, F_WRITE), d(ST, 1, F_WRITE)],
        );
        assert_eq!(res, Err(RequestError::NotSectorMultiple(511)));
        header(&mem, H, VIRTIO_BLK_T_OUT, 0);
        let (_, res) = parse(
            &mem,
            &[
                d(H, 16, 0),
                d(DATA, 512, 0),
                d(DATA + 4096, 100, 0),
                d(ST, 1, F_WRITE),
            ],
        );
        assert_eq!(res, Err(RequestError::NotSectorMultiple(612)));
    }

    #[test]
    fn addresses_outside_guest_memory() {
        let mem = guest_mem();
        header(&mem, H, VIRTIO_BLK_T_IN, 0);
        let far = 0x1_0000_0000;
        let (r, res) = parse(
            &mem,
            &[d(H, 16, 0), d(far, 512, F_WRITE), d(ST, 1, F_WRITE)],
        );
        assert_eq!(
            res,
            Err(RequestError::OutsideGuestMemory {
                addr: far,
                len: 512
            })
        );
        assert_eq!(r.status, Some(GuestAddress(ST)));
        // Straddling the end of guest memory.
        let (_, res) = parse(
            &mem,
            &[d(H, 16, 0), d(0x3f_ff00, 512, F_WRITE), d(ST, 1, F_WRITE)],
        );
        assert!(matches!(res, Err(RequestError::OutsideGuestMemory { .. })));
        // The header itself outside.
        let (_, res) = parse(&mem, &[d(far, 16, 0), d(ST, 1, F_WRITE)]);
        assert!(matches!(res, Err(RequestError::OutsideGuestMemory { .. })));
        // The status byte outside: nothing can be reported.
        let (r, res) = parse(&mem, &[d(H, 16, 0), d(far, 1, F_WRITE)]);
        assert!(matches!(res, Err(RequestError::OutsideGuestMemory { .. })));
        assert_eq!(r.status, None);
        // Address arithmetic wrapping around 2^64.
        let (r, res) = parse(
            &mem,
            &[
                d(H, 16, 0),
                d(u64::MAX - 10, 512, F_WRITE),
                d(ST, 1, F_WRITE),
            ],
        );
        assert!(matches!(res, Err(RequestError::OutsideGuestMemory { .. })));
        assert_eq!(r.status, Some(GuestAddress(ST)));
    }

    #[test]
    fn sector_overflow() {
        let mem = guest_mem();
        header(&mem, H, VIRTIO_BLK_T_IN, u64::MAX / 256);
        let (_, res) = parse(
            &mem,
            &[d(H, 16, 0), d(DATA, 512, F_WRITE), d(ST, 1, F_WRITE)],
        );
        assert_eq!(res, Err(RequestError::SectorOverflow(u64::MAX / 256)));
        header(&mem, H, VIRTIO_BLK_T_OUT, u64::MAX / 512);
        let (_, res) = parse(&mem, &[d(H, 16, 0), d(DATA, 1024, 0), d(ST, 1, F_WRITE)]);
        assert_eq!(res, Err(RequestError::SectorOverflow(u64::MAX / 512)));
    }

    #[test]
    fn too_many_segments() {
        let mem = guest_mem();
        header(&mem, H, VIRTIO_BLK_T_OUT, 0);
        let mut descs = vec![d(H, 16, 0)];
        for i in 0..MAX_DESCRIPTORS as u64 {
            descs.push(d(DATA + i * 512, 512, 0));
        }
        descs.push(d(ST, 1, F_WRITE));
        let (r, res) = parse(&mem, &descs);
        assert_eq!(res, Err(RequestError::TooManySegments));
        assert_eq!(r.status, Some(GuestAddress(ST)));
        // Exactly at the limit is fine.
        descs.truncate(MAX_DESCRIPTORS - 1);
        descs.push(d(ST, 1, F_WRITE));
        let (_, res) = parse(&mem, &descs);
        res.unwrap();
    }

    #[test]
    fn indirect_chain() {
        let mem = guest_mem();
        header(&mem, H, VIRTIO_BLK_T_OUT, 1);
        // Indirect table at 0x28_0000: header, data, status.
        let table = 0x28_0000u64;
        let entries = [
            SplitDescriptor::new(H, 16, F_NEXT, 1),
            SplitDescriptor::new(DATA, 4096, F_NEXT, 2),
            SplitDescriptor::new(ST, 1, F_WRITE, 0),
        ];
        for (i, e) in entries.iter().enumerate() {
            mem.write_obj(*e, GuestAddress(table + 16 * i as u64))
                .unwrap();
        }
        let (r, res) = parse(&mem, &[d(table, 48, 4 /* VIRTQ_DESC_F_INDIRECT */)]);
        res.unwrap();
        assert_eq!(
            (r.kind, r.sector, r.readable_len),
            (RequestType::Out, 1, 4096)
        );
        assert_eq!(r.status, Some(GuestAddress(ST)));
    }

    #[test]
    fn cursor_crosses_segments() {
        let mem = guest_mem();
        let segs = [
            Segment {
                addr: GuestAddress(DATA),
                len: 3,
            },
            Segment {
                addr: GuestAddress(DATA + 100),
                len: 0,
            },
            Segment {
                addr: GuestAddress(DATA + 200),
                len: 5,
            },
        ];
        let mut c = SegmentCursor::new(&segs);
        c.write(&mem, b"abcdefgh").unwrap();
        assert!(c.write(&mem, b"x").is_err());
        let mut out = [0u8; 8];
        SegmentCursor::new(&segs).read(&mem, &mut out).unwrap();
        assert_eq!(&out, b"abcdefgh");
    }
}
