//! The fake guest's memory: its layouts, and the snapshots the checks
//! compare (one vector per region) with the writes the model expects.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::model::Seg;
use super::Harness;

pub(super) const K64: u64 = 0x1_0000;
/// Guest memory layouts, chosen by the configuration byte: one region; two
/// with a gap; two adjacent regions (one contiguous range split in two
/// mappings); one region at the very top of the address space.
pub(super) const LAYOUTS: [&[(u64, u64)]; 4] = [
    &[(0, 2 * K64)],
    &[(0, K64), (2 * K64, K64)],
    &[(0, K64), (K64, K64)],
    &[(0, K64), (0xffff_ffff_fffe_0000, K64)],
];

#[derive(Debug, Clone, Copy)]
pub(super) struct Region {
    pub(super) start: u64,
    pub(super) len: u64,
}

impl Region {
    pub(super) fn end(&self) -> u64 {
        self.start + self.len
    }
}

pub(super) static ZEROS: [u8; 0x1_0000] = [0; 0x1_0000];

pub(super) fn zero(mem: &GuestMemoryMmap, start: u64, len: u64) {
    for off in (0..len).step_by(ZEROS.len()) {
        mem.write_slice(&ZEROS, GuestAddress(start + off))
            .expect("zero guest memory");
    }
}

impl Harness<'_> {
    pub(super) fn snapshot_into(&self, buf: &mut Vec<Vec<u8>>) {
        buf.resize_with(self.regions.len(), Vec::new);
        for (v, r) in buf.iter_mut().zip(&self.regions) {
            v.resize(r.len as usize, 0);
            self.mem
                .read_slice(v, GuestAddress(r.start))
                .expect("snapshot");
        }
    }

    /// Applies a write at guest address `addr` to a snapshot.
    pub(super) fn write_want(&self, want: &mut [Vec<u8>], addr: u64, bytes: &[u8]) {
        let mut done = 0usize;
        while done < bytes.len() {
            let a = addr + done as u64;
            let (i, r) = self
                .regions
                .iter()
                .enumerate()
                .find(|(_, r)| r.start <= a && a < r.end())
                .expect("model writes inside memory");
            let off = (a - r.start) as usize;
            let n = (bytes.len() - done).min(r.len as usize - off);
            want[i][off..off + n].copy_from_slice(&bytes[done..done + n]);
            done += n;
        }
    }

    /// Reads `out.len()` bytes at guest address `addr` from a snapshot.
    pub(super) fn read_snap(&self, snap: &[Vec<u8>], addr: u64, out: &mut [u8]) {
        let mut done = 0usize;
        while done < out.len() {
            let a = addr + done as u64;
            let (i, r) = self
                .regions
                .iter()
                .enumerate()
                .find(|(_, r)| r.start <= a && a < r.end())
                .expect("model reads inside memory");
            let off = (a - r.start) as usize;
            let n = (out.len() - done).min(r.len as usize - off);
            out[done..done + n].copy_from_slice(&snap[i][off..off + n]);
            done += n;
        }
    }

    pub(super) fn write_stream(&self, want: &mut [Vec<u8>], segs: &[Seg], data: &[u8]) {
        let mut done = 0usize;
        for s in segs {
            if done == data.len() {
                break;
            }
            let n = (s.len as usize).min(data.len() - done);
            self.write_want(want, s.addr, &data[done..done + n]);
            done += n;
        }
        assert_eq!(done, data.len(), "model payload longer than its buffers");
    }

    pub(super) fn assert_mem(&self, want: &[Vec<u8>], got: &[Vec<u8>], ctx: &dyn Fn() -> String) {
        for (i, (w, g)) in want.iter().zip(got).enumerate() {
            if let Some(off) = first_diff(w, g) {
                panic!(
                    "guest memory at {:#x} is {:#04x}, expected {:#04x}: {}",
                    self.regions[i].start + off as u64,
                    g[off],
                    w[off],
                    ctx()
                );
            }
        }
    }
}

/// Where two equally long buffers first differ. Compares with `==` (memcmp)
/// first: a byte loop is slow under coverage instrumentation.
pub(super) fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    if a == b {
        return None;
    }
    Some(
        a.iter()
            .zip(b)
            .position(|(x, y)| x != y)
            .unwrap_or(a.len().min(b.len())),
    )
}
