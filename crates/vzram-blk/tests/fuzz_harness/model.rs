//! The model: what a chain must do, worked out from the virtio spec and the
//! limits vzram advertises, independently of `vzram_blk::request`.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress};
use vzram_blk::config::{MAX_DESCRIPTORS, MAX_DISCARD_SECTORS, MAX_DISCARD_SEG, SERIAL_LEN};
use vzram_blk::request::RequestType;

use super::{Harness, SECTOR};

/// A range of guest memory as the model sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Seg {
    pub(super) addr: u64,
    pub(super) len: u64,
}

#[derive(Debug)]
pub(super) enum Effect {
    /// FLUSH: nothing changes but the status.
    Nothing,
    /// IN: the disk bytes at `start` land in the writable payload.
    Read {
        start: u64,
        segs: Vec<Seg>,
        len: u64,
    },
    /// GET_ID: the serial's first `n` bytes land in the writable payload.
    GetId { segs: Vec<Seg>, n: usize },
    /// OUT: `data` is written at `start`.
    Write { start: u64, data: Vec<u8> },
    /// DISCARD / WRITE_ZEROES: these byte ranges read as zeros.
    Zero(Vec<(u64, u64)>),
}

/// See [`Harness::model`].
pub(super) struct AtRun<'s> {
    pub(super) hdr: [u8; 16],
    pub(super) mem: &'s [Vec<u8>],
}

#[derive(Debug)]
pub(super) enum Outcome {
    /// The chain is not a valid request: parse fails, IOERR.
    Malformed,
    /// Parsed, but the device says UNSUPP.
    Unsupp,
    /// Parsed, but the device says IOERR (range, read-only, segment length).
    IoErr,
    Ok(Effect),
}

#[derive(Debug)]
pub(super) struct Parsed {
    pub(super) kind: RequestType,
    pub(super) sector: u64,
    pub(super) readable_len: u64,
    pub(super) writable_len: u64,
}

#[derive(Debug)]
pub(super) enum Expect {
    /// No writable last byte in guest memory: nothing is written, used 0.
    NoStatus,
    Status {
        at: u64,
        parsed: Option<Parsed>,
        outcome: Outcome,
    },
}

impl Harness<'_> {
    /// Is `[addr, addr + len)` all guest memory? Computed here from the
    /// layout, not through vm-memory. Empty ranges are, anywhere.
    pub(super) fn covered(&self, addr: u64, len: u64) -> bool {
        let mut cur = u128::from(addr);
        let end = cur + u128::from(len);
        while cur < end {
            match self
                .regions
                .iter()
                .find(|r| u128::from(r.start) <= cur && cur < u128::from(r.end()))
            {
                Some(r) => cur = u128::from(r.end()),
                None => return false,
            }
        }
        true
    }

    /// `len` bytes of the stream `segs`, after skipping `skip`: from guest
    /// memory, or from snapshot `snap`.
    pub(super) fn read_stream(
        &self,
        snap: Option<&[Vec<u8>]>,
        segs: &[Seg],
        mut skip: u64,
        len: u64,
    ) -> Vec<u8> {
        let mut out = Vec::with_capacity(len as usize);
        for s in segs {
            if out.len() as u64 == len {
                break;
            }
            if skip >= s.len {
                skip -= s.len;
                continue;
            }
            let n = (s.len - skip).min(len - out.len() as u64);
            let mut buf = vec![0u8; n as usize];
            match snap {
                Some(snap) => self.read_snap(snap, s.addr + skip, &mut buf),
                None => self
                    .mem
                    .read_slice(&mut buf, GuestAddress(s.addr + skip))
                    .expect("model reads inside memory"),
            }
            out.extend_from_slice(&buf);
            skip = 0;
        }
        assert_eq!(out.len() as u64, len, "model stream too short");
        out
    }

    /// What `descs` must do, and the header it was read with. `run`: the
    /// chain was taken in a batch and runs after others of it, so its
    /// payload (OUT data, discard segments) is read from `run.mem` (memory
    /// as the checks expect it when the chain runs), its header is the one
    /// parsed when it was taken.
    pub(super) fn model(
        &self,
        descs: &[Descriptor],
        run: Option<&AtRun>,
    ) -> (Expect, Option<[u8; 16]>) {
        let mut hdr = None;
        let e = self.model_with(descs, run, &mut hdr);
        (e, hdr)
    }

    fn model_with(
        &self,
        descs: &[Descriptor],
        run: Option<&AtRun>,
        hdr_out: &mut Option<[u8; 16]>,
    ) -> Expect {
        // The status byte: the last byte of the last descriptor, which must be
        // device-writable and in guest memory.
        let Some(last) = descs.last() else {
            return Expect::NoStatus;
        };
        // A chain that virtio-queue cut short (loop, bad next) still says
        // NEXT on its last descriptor: the parser refuses it, used 0.
        if last.has_next() {
            return Expect::NoStatus;
        }
        if !last.is_write_only() || last.len() == 0 {
            return Expect::NoStatus;
        }
        let Some(at) = last.addr().0.checked_add(u64::from(last.len()) - 1) else {
            return Expect::NoStatus;
        };
        if !self.covered(at, 1) {
            return Expect::NoStatus;
        }
        let done = |parsed, outcome| Expect::Status {
            at,
            parsed,
            outcome,
        };
        if descs.len() > MAX_DESCRIPTORS {
            return done(None, Outcome::Malformed);
        }
        let (mut readable, mut writable) = (Vec::new(), Vec::new());
        for d in descs {
            let seg = Seg {
                addr: d.addr().0,
                len: u64::from(d.len()),
            };
            if !self.covered(seg.addr, seg.len) {
                return done(None, Outcome::Malformed);
            }
            if d.is_write_only() {
                writable.push(seg);
            } else if !writable.is_empty() {
                return done(None, Outcome::Malformed);
            } else {
                readable.push(seg);
            }
        }
        let rlen: u64 = readable.iter().map(|s| s.len).sum();
        let wlen: u64 = writable.iter().map(|s| s.len).sum();
        if rlen < 16 {
            return done(None, Outcome::Malformed);
        }
        let hdr = match run {
            Some(r) => r.hdr,
            None => self.read_stream(None, &readable, 0, 16).try_into().unwrap(),
        };
        *hdr_out = Some(hdr);
        let payload = run.map(|r| r.mem);
        let t = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
        let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap());
        let (pr, pw) = (rlen - 16, wlen - 1);
        // The writable payload: everything writable but the status byte.
        let mut wsegs = writable;
        if let Some(s) = wsegs.last_mut() {
            s.len -= 1;
        }
        let kind = RequestType::from_raw(t);
        let parsed = || {
            Some(Parsed {
                kind,
                sector,
                readable_len: pr,
                writable_len: pw,
            })
        };
        match t {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let (data, other) = if t == VIRTIO_BLK_T_IN {
                    (pw, pr)
                } else {
                    (pr, pw)
                };
                let start = sector.checked_mul(SECTOR);
                let end = start.and_then(|s| s.checked_add(data));
                let (Some(start), Some(end)) = (start, end) else {
                    return done(None, Outcome::Malformed);
                };
                if other != 0 || data % SECTOR != 0 {
                    return done(None, Outcome::Malformed);
                }
                if (t == VIRTIO_BLK_T_OUT && self.readonly) || end > self.dev_size {
                    return done(parsed(), Outcome::IoErr);
                }
                let effect = if t == VIRTIO_BLK_T_IN {
                    Effect::Read {
                        start,
                        segs: wsegs,
                        len: data,
                    }
                } else {
                    Effect::Write {
                        start,
                        data: self.read_stream(payload, &readable, 16, data),
                    }
                };
                done(parsed(), Outcome::Ok(effect))
            }
            VIRTIO_BLK_T_FLUSH => done(parsed(), Outcome::Ok(Effect::Nothing)),
            VIRTIO_BLK_T_GET_ID => {
                if pr != 0 {
                    return done(None, Outcome::Malformed);
                }
                let n = (pw as usize).min(SERIAL_LEN);
                done(parsed(), Outcome::Ok(Effect::GetId { segs: wsegs, n }))
            }
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                if pw != 0 || pr == 0 || pr % 16 != 0 {
                    return done(None, Outcome::Malformed);
                }
                if self.readonly {
                    return done(parsed(), Outcome::IoErr);
                }
                // More segments than the device offers: UNSUPP, as QEMU says.
                if pr / 16 > u64::from(MAX_DISCARD_SEG) {
                    return done(parsed(), Outcome::Unsupp);
                }
                let allowed = if t == VIRTIO_BLK_T_WRITE_ZEROES {
                    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
                } else {
                    0
                };
                let raw = self.read_stream(payload, &readable, 16, pr);
                let mut ranges = Vec::new();
                // The first bad segment decides; nothing is applied unless all are good.
                for s in raw.chunks_exact(16) {
                    let sector = u64::from_le_bytes(s[0..8].try_into().unwrap());
                    let num = u32::from_le_bytes(s[8..12].try_into().unwrap());
                    let flags = u32::from_le_bytes(s[12..16].try_into().unwrap());
                    if flags & !allowed != 0 {
                        return done(parsed(), Outcome::Unsupp);
                    }
                    if num > MAX_DISCARD_SECTORS {
                        return done(parsed(), Outcome::IoErr);
                    }
                    let start = sector.checked_mul(SECTOR);
                    let end = start.and_then(|s| s.checked_add(u64::from(num) * SECTOR));
                    match (start, end) {
                        (Some(s), Some(e)) if e <= self.dev_size => ranges.push((s, e)),
                        _ => return done(parsed(), Outcome::IoErr),
                    }
                }
                done(parsed(), Outcome::Ok(Effect::Zero(ranges)))
            }
            _ => done(parsed(), Outcome::Unsupp),
        }
    }
}
