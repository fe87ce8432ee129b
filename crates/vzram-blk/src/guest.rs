//! Guest memory access with one region lookup per buffer.
//!
//! vm-memory's `read_slice`/`write_slice`/`check_range` go through its
//! generic slice iterator (an IOMMU-ready path) on every call; a request
//! makes about seven such calls (range checks, header, payload, status),
//! and the walk cost as much as a tenth of a read's CPU. A buffer that lies
//! in one region (nearly all do) is reached here with a single lookup; one
//! that straddles regions, or memory behind a translation layer, takes
//! vm-memory's general path, so the answers are the same either way.

use vm_memory::bitmap::Bitmap;
use vm_memory::{
    Bytes, GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryError, Permissions,
};

/// Whether `[addr, addr + len)` is guest memory.
pub fn in_range<M: GuestMemory + ?Sized>(
    mem: &M,
    addr: GuestAddress,
    len: usize,
    access: Permissions,
) -> bool {
    if len > 0 {
        if let Some(pm) = mem.physical_memory() {
            if pm.get_slice(addr, len).is_ok() {
                return true;
            }
        }
    }
    mem.check_range(addr, len, access)
}

/// Fills `buf` from guest memory at `addr`.
pub fn read<M: GuestMemory + ?Sized>(
    mem: &M,
    addr: GuestAddress,
    buf: &mut [u8],
) -> Result<(), GuestMemoryError> {
    if let Some(s) = mem
        .physical_memory()
        .and_then(|pm| pm.get_slice(addr, buf.len()).ok())
    {
        if s.copy_to(buf) == buf.len() {
            return Ok(());
        }
    }
    mem.read_slice(buf, addr)
}

/// Writes `buf` into guest memory at `addr`; the dirty log (if any) sees it.
pub fn write<M: GuestMemory + ?Sized>(
    mem: &M,
    addr: GuestAddress,
    buf: &[u8],
) -> Result<(), GuestMemoryError> {
    if let Some(s) = mem
        .physical_memory()
        .and_then(|pm| pm.get_slice(addr, buf.len()).ok())
    {
        if s.len() == buf.len() {
            s.copy_from(buf);
            return Ok(());
        }
    }
    mem.write_slice(buf, addr)
}

/// Runs `f` on the `len` bytes at `addr` as one mutable byte slice, when
/// they lie in one region: a read decompresses straight into the guest's
/// buffer instead of into a bounce page and then copying. None (and `f` not
/// run) otherwise. The dirty log sees the bytes as written.
///
/// # Safety
///
/// The slice is not exclusive, though `&mut` says it is. The guest chooses
/// the address, and while `f` runs the guest's vCPUs, the frontend, and our
/// other queue threads (another request naming the same buffer, or a used
/// ring placed there) may write the same bytes. That breaks Rust's aliasing
/// rule for `&mut`; vm-memory's volatile slices exist to avoid it. It is
/// kept because it saves a bounce page and a 4 KiB copy on every whole-page
/// read, and because what it can break is bounded:
///
/// - the bytes are `u8`, with no validity invariant: any value another
///   writer leaves is a valid `u8`, and no Rust object lives in guest RAM;
/// - `f` must only write the slice and never take control flow, lengths or
///   indices from what it reads back (a decoder's match copies read earlier
///   output, as data only). Then whatever the compiler assumes about the
///   bytes, and however the writers interleave, only the data the guest
///   gets can be wrong;
/// - the guest chooses every address involved, so only it can cause the
///   race (by changing a buffer it gave us, or naming it twice), and it
///   spoils only its own data, as with DMA into memory it is changing.
pub(crate) unsafe fn with_mut<M: GuestMemory + ?Sized, T>(
    mem: &M,
    addr: GuestAddress,
    len: usize,
    f: impl FnOnce(&mut [u8]) -> T,
) -> Option<T> {
    let s = mem.physical_memory()?.get_slice(addr, len).ok()?;
    if s.len() != len {
        return None;
    }
    let guard = s.ptr_guard_mut();
    // SAFETY: `len` bytes at the pointer lie in one region (get_slice checked
    // them), which stays mapped while `mem` is borrowed. The slice is not
    // exclusive: others may write these bytes while `f` runs. Our caller's
    // contract (above) is what makes that harmless to anyone but the guest.
    let buf = unsafe { std::slice::from_raw_parts_mut(guard.as_ptr(), len) };
    let r = f(buf);
    s.bitmap().mark_dirty(0, len);
    Some(r)
}

/// The start of the `len` bytes at `addr`, when they lie in one region,
/// for a pooled read to decompress into from another thread (see
/// `pool::GuestPage`). The pointer is valid while the snapshot `mem` is
/// from stays alive; writing through it falls under [`with_mut`]'s
/// contract, and the writer marks the bytes dirty ([`mark_dirty`]) after.
pub(crate) fn ptr_mut<M: GuestMemory + ?Sized>(
    mem: &M,
    addr: GuestAddress,
    len: usize,
) -> Option<std::ptr::NonNull<u8>> {
    let s = mem.physical_memory()?.get_slice(addr, len).ok()?;
    if s.len() != len {
        return None;
    }
    // The guard of an mmap region (vm-memory without xen) unmaps nothing
    // when dropped: the pointer outlives it.
    std::ptr::NonNull::new(s.ptr_guard_mut().as_ptr())
}

/// Tells the dirty log (if any) that the `len` bytes at `addr` changed:
/// what [`with_mut`] does after its writer, for bytes another thread wrote
/// through [`ptr_mut`].
pub(crate) fn mark_dirty<M: GuestMemory + ?Sized>(mem: &M, addr: GuestAddress, len: usize) {
    if let Some(s) = mem
        .physical_memory()
        .and_then(|pm| pm.get_slice(addr, len).ok())
    {
        s.bitmap().mark_dirty(0, s.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    // Two regions with a hole between them: [0x1000, 0x3000) and [0x3000, 0x5000)
    // touch, [0x8000, 0x9000) stands apart.
    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0x1000), 0x2000),
            (GuestAddress(0x3000), 0x2000),
            (GuestAddress(0x8000), 0x1000),
        ])
        .unwrap()
    }

    #[test]
    fn same_answers_as_vm_memory() {
        let m = mem();
        let cases: &[(u64, usize)] = &[
            (0x1000, 16),
            (0x2ff0, 32),  // straddles two touching regions
            (0x4ff0, 32),  // runs off the end into the hole
            (0x5000, 1),   // in the hole
            (0x8ff8, 8),   // last bytes of a region
            (0x8ff8, 9),   // one past it
            (0x0, 0),      // empty, outside
            (0x1000, 0),   // empty, inside
            (u64::MAX, 2), // wraps
        ];
        for &(a, n) in cases {
            let addr = GuestAddress(a);
            for access in [Permissions::Read, Permissions::Write] {
                assert_eq!(
                    in_range(&m, addr, n, access),
                    GuestMemory::check_range(&m, addr, n, access),
                    "{a:#x}+{n}"
                );
            }
            let data: Vec<u8> = (0..n).map(|i| i as u8 ^ 0x5a).collect();
            let ours = write(&m, addr, &data);
            assert_eq!(
                ours.is_ok(),
                GuestMemory::check_range(&m, addr, n, Permissions::Write),
                "{a:#x}+{n}"
            );
            if ours.is_ok() {
                let mut back = vec![0u8; n];
                m.read_slice(&mut back, addr).unwrap();
                assert_eq!(back, data);
                let mut again = vec![0u8; n];
                read(&m, addr, &mut again).unwrap();
                assert_eq!(again, data);
            } else {
                let mut buf = vec![0u8; n];
                assert!(read(&m, addr, &mut buf).is_err(), "{a:#x}+{n}");
            }
        }
    }

    #[test]
    fn with_mut_only_within_one_region() {
        let m = mem();
        // SAFETY: the closures only write (or never run).
        let got = unsafe {
            with_mut(&m, GuestAddress(0x8000), 0x1000, |b| {
                b.fill(7);
                b.len()
            })
        };
        assert_eq!(got, Some(0x1000));
        let mut back = [0u8; 0x1000];
        m.read_slice(&mut back, GuestAddress(0x8000)).unwrap();
        assert!(back.iter().all(|&x| x == 7));
        // Straddling two regions, or running into the hole: f never runs.
        for (a, n) in [(0x2800u64, 0x1000usize), (0x4800, 0x1000), (0x6000, 16)] {
            // SAFETY: the closure never runs.
            let got = unsafe { with_mut(&m, GuestAddress(a), n, |_| unreachable!()) };
            assert_eq!(got, None::<()>);
        }
    }
}
