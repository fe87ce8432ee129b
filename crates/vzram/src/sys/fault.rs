//! Mappings of vzram's own files that a SIGBUS may hit: a state file
//! truncated under a live mapping, or a full tmpfs. Each is registered
//! with its path, so the SIGBUS handler ([`report_sigbus`], at the end of
//! this file) names the file instead of blaming
//! guest memory; one registered as repairable (the supervisor's view of a
//! device's counters) gets a zero page in place of the lost one, and the
//! process goes on with that device marked damaged instead of dying with
//! every device it serves.
//!
//! The table is fixed and lock-free: the handler may run at any moment,
//! on any thread, so it only loads atomics and calls mmap.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::signals::{set_handler_flags, HandlerError, Line};

const SLOTS: usize = 512;
const PATH_LEN: usize = 160;

struct Entry {
    /// Bumped on every register and release: the handler compares it
    /// before and after reading an entry, so it never pairs one
    /// registration's range with another's, or reads a path being written.
    gen: AtomicUsize,
    /// 0: free. Set first when claimed, cleared last when released.
    start: AtomicUsize,
    /// Published after `path`; 0 while the entry is being filled.
    len: AtomicUsize,
    repair: AtomicBool,
    hit: AtomicBool,
    path_len: AtomicUsize,
    path: UnsafeCell<[u8; PATH_LEN]>,
}

// SAFETY: `path` is written only by the thread that claimed the entry
// (start 0 -> non-zero), after bumping `gen` and before it publishes `len`
// with Release; the handler reads it only after `len` is loaded non-zero
// with Acquire and the same `gen` is seen before and after. A registration
// lives as long as its mapping, so a fault in it cannot race its release.
unsafe impl Sync for Entry {}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Entry = Entry {
    gen: AtomicUsize::new(0),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    repair: AtomicBool::new(false),
    hit: AtomicBool::new(false),
    path_len: AtomicUsize::new(0),
    path: UnsafeCell::new([0; PATH_LEN]),
};

static TABLE: [Entry; SLOTS] = [FREE; SLOTS];

/// A registered mapping; dropping it unregisters it (before the mapping
/// goes).
#[derive(Debug)]
pub struct Guarded(usize);

impl Guarded {
    /// A SIGBUS hit this mapping (and, if repairable, got a zero page).
    pub fn hit(&self) -> bool {
        TABLE[self.0].hit.load(Ordering::Relaxed)
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        let e = &TABLE[self.0];
        e.gen.fetch_add(1, Ordering::AcqRel);
        e.len.store(0, Ordering::Release);
        e.hit.store(false, Ordering::Relaxed);
        e.start.store(0, Ordering::Release);
    }
}

/// Registers `[ptr, ptr + len)`, a mapping of the file at `path`. None
/// when the table is full: the mapping is then only unnamed, not unsafe.
pub fn register(
    ptr: *const u8,
    len: usize,
    path: &std::path::Path,
    repair: bool,
) -> Option<Guarded> {
    use std::os::unix::ffi::OsStrExt;
    let start = ptr as usize;
    if start == 0 || len == 0 {
        return None;
    }
    for (i, e) in TABLE.iter().enumerate() {
        if e.start
            .compare_exchange(0, start, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            e.gen.fetch_add(1, Ordering::AcqRel);
            let bytes = path.as_os_str().as_bytes();
            let n = bytes.len().min(PATH_LEN);
            // SAFETY: this thread claimed the entry; no reader looks at
            // `path` until `len` is published below.
            unsafe { (&mut *e.path.get())[..n].copy_from_slice(&bytes[..n]) };
            e.path_len.store(n, Ordering::Relaxed);
            e.repair.store(repair, Ordering::Relaxed);
            e.hit.store(false, Ordering::Relaxed);
            e.len.store(len, Ordering::Release);
            return Some(Guarded(i));
        }
    }
    None
}

/// What the SIGBUS handler learns about a faulting address.
pub enum Fault {
    /// Not one of ours (guest memory, most likely).
    Unknown,
    /// In a registered file that is not repaired: named, then fatal.
    Named(&'static [u8]),
    /// In a repairable one: a zero page is in place, go on.
    Repaired(&'static [u8]),
}

/// Called from the SIGBUS handler only: async-signal-safe (atomics, mmap).
pub fn on_fault(addr: usize) -> Fault {
    for e in TABLE.iter() {
        let gen = e.gen.load(Ordering::Acquire);
        let len = e.len.load(Ordering::Acquire);
        if len == 0 {
            continue;
        }
        let start = e.start.load(Ordering::Acquire);
        if addr < start || addr >= start + len {
            continue;
        }
        if e.gen.load(Ordering::Acquire) != gen {
            // Re-registered meanwhile: not the mapping that faulted.
            continue;
        }
        // SAFETY: `len` was published after `path` was written, and the
        // entry's owner never rewrites `path` while it is registered. The
        // 'static borrow lasts only until the handler returns.
        let path: &'static [u8] = unsafe {
            let p = &*e.path.get();
            &p[..e.path_len.load(Ordering::Relaxed).min(PATH_LEN)]
        };
        if !e.repair.load(Ordering::Relaxed) {
            return Fault::Named(path);
        }
        let page = addr & !4095;
        // SAFETY: replaces one page of a mapping the owner registered as
        // repairable with a private zero page: every reference into it
        // stays valid and now reads zeros. The owner checks `hit` and
        // treats what it reads there as damaged.
        let p = unsafe {
            libc::mmap(
                page as *mut libc::c_void,
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Fault::Named(path);
        }
        e.hit.store(true, Ordering::Relaxed);
        return Fault::Repaired(path);
    }
    Fault::Unknown
}

/// Names the cause of a SIGBUS, then lets it kill us: returning re-runs
/// the faulting access with the default action back in place. A SIGBUS
/// is a file mapping whose pages are gone: one of vzram's own state files
/// (registered above, named here; one registered as repairable gets a
/// zero page and the process goes on), else a frontend's guest memory
/// file. Only async-signal-safe work: [`on_fault`] and write(2).
extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t; si_addr is set for SIGBUS.
    let addr = unsafe { (*info).si_addr() } as u64;
    let mut line = Line::new();
    line.put(b"vzram: SIGBUS at 0x").num(addr, 16);
    match on_fault(addr as usize) {
        Fault::Unknown => {
            line.put(b": a mapped file has no page there (a frontend's guest memory file was truncated, or its huge pages ran out); exiting\n");
        }
        Fault::Named(path) => {
            line.put(b" in ").put(path).put(
                b": the file lost its pages (truncated, or its file system is full); exiting\n",
            );
        }
        Fault::Repaired(path) => {
            line.put(b" in ")
                .put(path)
                .put(b": the file lost its pages (truncated?); reading zeros there, the device is marked damaged\n");
            line.write();
            return;
        }
    }
    line.write();
    // Fatal: the default action back, so the access, run again on return,
    // kills us with SIGBUS. (The handler stays installed until then, so a
    // repairable fault on another thread meanwhile is still repaired.)
    // SAFETY: a zeroed sigaction is SIG_DFL with no flags; sigaction is
    // async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}

/// Reports a SIGBUS's cause before it kills the daemon (see [`on_sigbus`]).
/// Installed whatever the seccomp mode: the cause matters either way.
pub fn report_sigbus() -> Result<(), HandlerError> {
    // Not SA_RESETHAND: two threads may fault on one repairable page at
    // once; the handler itself puts the default back when a fault is fatal.
    set_handler_flags(
        libc::SIGBUS,
        on_sigbus as *const () as usize,
        libc::SA_SIGINFO | libc::SA_NODEFER,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_truncated_file_under_a_repairable_mapping_reads_zeros() {
        use std::os::fd::AsRawFd;
        report_sigbus().unwrap();
        let path = std::env::temp_dir().join(format!("vzram-fault-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.set_len(8192).unwrap();
        // SAFETY: a new shared mapping of a file we hold.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let g = register(p.cast(), 8192, &path, true).unwrap();
        // SAFETY: inside the mapping.
        unsafe { p.cast::<u8>().write_volatile(7) };
        f.set_len(0).unwrap();
        // SAFETY: inside the mapping; the page is gone from the file, so
        // this faults and the handler puts a zero page in its place.
        let v = unsafe { p.cast::<u8>().add(4096).read_volatile() };
        assert_eq!(v, 0);
        assert!(g.hit());
        drop(g);
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, 8192) };
        std::fs::remove_file(&path).unwrap();
    }
}
