//! Lazily backed memory regions: anonymous ones (the span directory, and
//! devices that keep no state) and shared mappings of a device's state files
//! (its slot table and arena, which outlive the process). All are reserved
//! up front with `MAP_NORESERVE`, so address space is cheap and memory grows
//! only with the pages actually touched.

use crate::error::{Result, StoreError};

pub struct Region {
    ptr: *mut u8,
    len: usize,
    /// A shared file mapping: freeing pages must free the file's pages too.
    shared: bool,
    /// The file, where new pages are allocated first (see [`Region::allocate`]).
    file: Option<std::fs::File>,
}

// SAFETY: a Region is a plain memory mapping owned by this value; access to
// its bytes is coordinated by the types that embed it (atomics, locks).
unsafe impl Send for Region {}
// SAFETY: see above; the Region itself has no interior state.
unsafe impl Sync for Region {}

pub const OS_PAGE: usize = 4096;

impl Region {
    /// Reserves `len` bytes (rounded up to a page) of zeroed, lazily backed memory.
    pub fn reserve(len: usize) -> Result<Region> {
        Region::map(len, None, false)
    }

    /// Maps `len` bytes of `file` (already that long) shared: stores land in
    /// the file at once, so they survive the process. The file should live on
    /// tmpfs, where its pages are memory.
    pub fn map_file(file: &std::fs::File, len: usize) -> Result<Region> {
        Region::map(len, Some(file), true)
    }

    /// Maps a file whose blocks are all allocated already (a counters file):
    /// no descriptor is kept for [`Region::allocate`].
    pub fn map_allocated_file(file: &std::fs::File, len: usize) -> Result<Region> {
        Region::map(len, Some(file), false)
    }

    fn map(len: usize, file: Option<&std::fs::File>, keep: bool) -> Result<Region> {
        use std::os::fd::AsRawFd;
        let len = len.max(1).div_ceil(OS_PAGE) * OS_PAGE;
        let (flags, fd) = match file {
            Some(f) => (libc::MAP_SHARED, f.as_raw_fd()),
            None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1),
        };
        // SAFETY: a new mapping (anonymous, or of a file we hold open) at no
        // fixed address touches no existing memory; the result is checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags | libc::MAP_NORESERVE,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            let of = if file.is_some() {
                " of a state file"
            } else {
                ""
            };
            return Err(StoreError::map(format_args!("mmap of {len} bytes{of}"), e));
        }
        // Transparent huge pages would make RSS grow in 2 MiB steps and turn
        // every 32 KiB span release into a huge-page split; density needs
        // small, exact steps.
        // SAFETY: advising our own fresh mapping; failure only costs memory.
        unsafe { libc::madvise(ptr, len, libc::MADV_NOHUGEPAGE) };
        let shared = file.is_some();
        let file = match file.filter(|_| keep) {
            Some(f) => Some(f.try_clone().map_err(|e| {
                // SAFETY: unmapping the mapping just made, which nothing uses.
                unsafe { libc::munmap(ptr, len) };
                StoreError::map("duplicating a state file's descriptor", e)
            })?),
            None => None,
        };
        Ok(Region {
            ptr: ptr.cast(),
            len,
            shared,
            file,
        })
    }

    /// Faults in `[offset, offset + len)` with one call instead of one
    /// page fault per page. Best effort: on old kernels pages fault later.
    /// A file mapping's pages are allocated in the file first: a full file
    /// system is an error here, not a SIGBUS at the first store.
    pub fn populate(&self, offset: usize, len: usize) -> std::io::Result<()> {
        debug_assert!(offset.is_multiple_of(OS_PAGE) && offset + len <= self.len);
        self.allocate(offset, len)?;
        // SAFETY: the range is inside this mapping; MADV_POPULATE_WRITE only
        // allocates zeroed pages there, as a write fault would.
        unsafe { libc::madvise(self.ptr.add(offset).cast(), len, libc::MADV_POPULATE_WRITE) };
        Ok(())
    }

    /// Allocates `[offset, offset + len)` in the mapped file (nothing for
    /// anonymous memory), so that storing there cannot fault.
    pub fn allocate(&self, offset: usize, len: usize) -> std::io::Result<()> {
        let Some(f) = &self.file else { return Ok(()) };
        use std::os::fd::AsRawFd;
        fallocate(f.as_raw_fd(), offset as u64, len as u64)
    }

    /// The mapped file's descriptor, when there is one to write through.
    pub fn file_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.file.as_ref().map(|f| f.as_raw_fd())
    }

    /// Stores `bytes` at `offset` through the file, not the mapping, where
    /// the page need not be backed yet: the file system allocates it as it
    /// copies, with no page fault and no page-table entry (backing a page
    /// through the mapping costs this kind of host twice as much, and an
    /// entry makes giving the page back a TLB shootdown). A mapping of the
    /// file sees the bytes at once. Without a file, a plain copy.
    pub fn write_unmapped(&self, offset: usize, bytes: &[u8]) -> std::io::Result<()> {
        assert!(offset + bytes.len() <= self.len);
        let Some(f) = &self.file else {
            // SAFETY: in bounds (above); the caller owns these bytes alone
            // and `bytes` is not in this region.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(offset), bytes.len())
            };
            return Ok(());
        };
        use std::os::unix::fs::FileExt;
        f.write_all_at(bytes, offset as u64)
    }

    #[inline]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Gives the pages fully inside `[offset, offset + len)` back to the OS.
    /// They read as zeros afterwards, so freed memory never leaks old bytes.
    pub fn release(&self, offset: usize, len: usize) {
        let start = offset.div_ceil(OS_PAGE) * OS_PAGE;
        let end = ((offset + len) / OS_PAGE * OS_PAGE).min(self.len);
        if end <= start {
            return;
        }
        // MADV_DONTNEED on a private anonymous mapping drops the pages and
        // refills them with zeros; on a shared file mapping it would only
        // unmap them, so there MADV_REMOVE punches them out of the file.
        let advice = if self.shared {
            libc::MADV_REMOVE
        } else {
            libc::MADV_DONTNEED
        };
        // SAFETY: the range lies inside this mapping (clamped above) and the
        // caller guarantees nothing live is stored there.
        let rc = unsafe { libc::madvise(self.ptr.add(start).cast(), end - start, advice) };
        if rc != 0 {
            tracing::warn!(
                "madvise({advice}) failed: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: ptr/len come from a successful mmap owned by self.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Asks the CPU to start loading the cache line at `p`, so that a later
/// access does not wait on memory. Never dereferences `p`: any address is
/// fine, and a prefetch of an unmapped one is dropped, not a fault.
#[inline]
pub fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is a hint that reads nothing the program can
        // see and cannot fault; SSE is part of the x86_64 baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Allocates `[offset, offset + len)` of the file `fd` without changing its
/// size (the last page of a mapping may reach past the file's end, and the
/// size says what a state is). tmpfs stops part way with EINTR when a
/// signal is pending (a thread being stopped and continued, a debugger):
/// that is no full file system, so the call is made again, and what was
/// allocated stays allocated.
pub(crate) fn fallocate(fd: std::os::fd::RawFd, offset: u64, len: u64) -> std::io::Result<()> {
    loop {
        // SAFETY: fallocate on a descriptor the caller owns; no memory is
        // passed.
        let rc =
            unsafe { libc::fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, offset as i64, len as i64) };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
