//! Guest RAM: memfds mapped here and described to the daemon.

use std::fs::File;
use std::os::fd::FromRawFd;

use vhost::VhostUserMemoryRegionInfo;
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};

use super::ring::{HIGH, LOW};

/// A guest memory region as the daemon is told about it.
pub struct RamRegion {
    pub gpa: u64,
    pub size: u64,
    pub file: File,
}

/// Guest RAM: one memfd per region, mapped here through vm-memory.
pub struct Ram {
    pub mem: GuestMemoryMmap,
    pub regions: Vec<RamRegion>,
}

/// An anonymous memory file of `size` bytes.
pub fn memfd(size: u64) -> File {
    // SAFETY: memfd_create takes a NUL-terminated name and flags, and
    // returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(c"vzram-hostile".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a new descriptor that nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).expect("size the memfd");
    f
}

impl Ram {
    /// Regions `(gpa, size)`, sorted and not overlapping.
    pub fn new(layout: &[(u64, usize)]) -> Ram {
        let regions: Vec<RamRegion> = layout
            .iter()
            .map(|&(gpa, size)| RamRegion {
                gpa,
                size: size as u64,
                file: memfd(size as u64),
            })
            .collect();
        let mem = GuestMemoryMmap::from_ranges_with_files(regions.iter().map(|r| {
            (
                GuestAddress(r.gpa),
                r.size as usize,
                Some(FileOffset::new(r.file.try_clone().expect("dup memfd"), 0)),
            )
        }))
        .expect("map guest RAM");
        Ram { mem, regions }
    }

    /// The standard two-region layout.
    pub fn standard() -> Ram {
        Ram::new(&[LOW, HIGH])
    }

    /// The memory table entries for all regions, as a VMM would send them.
    pub fn table(&self) -> Vec<VhostUserMemoryRegionInfo> {
        self.mem
            .iter()
            .map(|r| VhostUserMemoryRegionInfo::from_guest_region(r).expect("file-backed region"))
            .collect()
    }

    /// This process's address of a guest address (what ring addresses are
    /// given as in vhost-user).
    pub fn host_addr(&self, gpa: u64) -> u64 {
        let r = self
            .mem
            .find_region(GuestAddress(gpa))
            .unwrap_or_else(|| panic!("{gpa:#x} is not in guest RAM"));
        r.as_ptr() as u64 + (gpa - r.start_addr().0)
    }

    pub fn write(&self, gpa: u64, data: &[u8]) {
        self.mem
            .write_slice(data, GuestAddress(gpa))
            .unwrap_or_else(|e| panic!("write guest RAM at {gpa:#x}: {e}"));
    }

    pub fn read(&self, gpa: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mem
            .read_slice(&mut v, GuestAddress(gpa))
            .unwrap_or_else(|e| panic!("read guest RAM at {gpa:#x}: {e}"));
        v
    }

    pub fn u8_at(&self, gpa: u64) -> u8 {
        self.read(gpa, 1)[0]
    }
}
