//! Walking a sparse file by the ranges that hold data.

use std::fs::File;
use std::os::fd::AsRawFd;

/// The byte ranges of `file` that hold data (SEEK_DATA/SEEK_HOLE), so a
/// sparse file is walked without touching its holes.
pub fn data_ranges(file: &File) -> Vec<std::ops::Range<u64>> {
    let fd = file.as_raw_fd();
    let len = file.metadata().map_or(0, |m| m.len());
    let mut out = Vec::new();
    let mut pos = 0i64;
    while (pos as u64) < len {
        // SAFETY: lseek on a descriptor we own.
        let start = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if start < 0 {
            // ENXIO: no data past pos. Anything else: assume all data.
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO) {
                out.push(pos as u64..len);
            }
            break;
        }
        // SAFETY: as above.
        let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
        let end = if end < 0 { len as i64 } else { end };
        out.push(start as u64..end as u64);
        pos = end;
    }
    out
}
