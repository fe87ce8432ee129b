//! The per-device slot table: one atomic 64-bit word per 4 KiB slot, in a
//! lazily backed mapping. A 1 TiB device reserves 2 GiB of address space but
//! only the table pages that cover written slots cost RAM. A page is
//! allocated ([`SlotTable::mark`]) before any word on it is written, and
//! words on pages never marked are never read: they are known to be 0.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::error::Result;
use crate::mmap::{Region, OS_PAGE};

/// Slots whose words share one page of the table.
pub const SLOTS_PER_PAGE: u64 = (OS_PAGE / 8) as u64;

pub struct SlotTable {
    words: Region,
    slots: u64,
    /// One bit per table page, set before any word on that page is first made
    /// non-zero and never cleared. This, not mincore, says where slots may
    /// be: a page the host swapped out is not resident but still holds them.
    /// One bit per 2 MiB of device: 64 KiB for a 1 TiB device.
    touched: Box<[AtomicU64]>,
}

impl SlotTable {
    /// A table in anonymous memory, or in `file` (shared, 8 bytes a slot).
    pub fn new(slots: u64, file: Option<&std::fs::File>) -> Result<SlotTable> {
        let bytes = usize::try_from(slots.max(1) * 8).map_err(|_| {
            crate::StoreError::InvalidConfig(format!("{slots} slots do not fit in memory"))
        })?;
        let pages = bytes.div_ceil(OS_PAGE);
        Ok(SlotTable {
            words: match file {
                Some(f) => Region::map_file(f, bytes)?,
                None => Region::reserve(bytes)?,
            },
            slots,
            touched: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    #[inline]
    pub fn len(&self) -> u64 {
        self.slots
    }

    /// Where the words are mapped, and how long the mapping is.
    pub(crate) fn mapping(&self) -> (*const u8, usize) {
        (self.words.as_ptr(), self.words.len())
    }

    /// The word of `slot`; the caller has checked `slot < len()`. Before
    /// storing a non-zero value there, call [`SlotTable::mark`].
    #[inline]
    pub fn word(&self, slot: u64) -> &AtomicU64 {
        assert!(slot < self.slots);
        // SAFETY: slot is in bounds, the mapping is 8-byte aligned (page
        // aligned) and zero-filled, and zero is a valid AtomicU64.
        unsafe { &*(self.words.as_ptr() as *const AtomicU64).add(slot as usize) }
    }

    /// Records that `slot`'s word may become non-zero, so [`SlotTable::touched`]
    /// covers it. Once a page is marked this is one Relaxed load.
    /// The first time, the page is allocated in the table's file (if it has
    /// one): a full file system fails the write instead of faulting on it.
    #[inline]
    pub fn mark(&self, slot: u64) -> crate::Result<()> {
        let page = slot / SLOTS_PER_PAGE;
        let bits = &self.touched[(page / 64) as usize];
        let bit = 1 << (page % 64);
        if bits.load(Relaxed) & bit == 0 {
            let at = page as usize * OS_PAGE;
            self.words
                .allocate(at, OS_PAGE.min(self.words.len() - at))
                .map_err(|e| {
                    if crate::error::log_full_now() {
                        tracing::warn!("the state dir is full: cannot allocate a slot-table page ({e}); writes fail with an I/O error until the state dir grows");
                    }
                    crate::StoreError::StateFull
                })?;
            bits.fetch_or(bit, Relaxed);
        }
        Ok(())
    }

    /// Whether `slot`'s table page was ever marked: if not, its word is 0
    /// and must not even be read (a read faults a page into the state
    /// file, which on a full tmpfs is a SIGBUS).
    #[inline]
    pub fn is_marked(&self, slot: u64) -> bool {
        let page = slot / SLOTS_PER_PAGE;
        self.touched[(page / 64) as usize].load(Relaxed) & (1 << (page % 64)) != 0
    }

    /// The slots of every table page ever marked, one range per page: every
    /// non-zero word is in one of them, resident or not.
    pub fn touched(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        self.touched.iter().enumerate().flat_map(move |(i, bits)| {
            let mut bits = bits.load(Relaxed);
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let page = i as u64 * 64 + u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                let start = page * SLOTS_PER_PAGE;
                Some(start..(start + SLOTS_PER_PAGE).min(self.slots))
            })
        })
    }

    /// Which pages of the table are backed by RAM right now (from mincore).
    /// If mincore fails every page counts as resident. Only for statistics:
    /// a page the host swapped out is not resident but still holds slots.
    pub fn resident_pages(&self) -> Vec<bool> {
        let pages = self.words.len() / OS_PAGE;
        let mut vec = vec![0u8; pages];
        // SAFETY: the region is one mapping of `len` bytes and `vec` has one
        // byte per page of it, as mincore requires.
        let rc = unsafe {
            libc::mincore(
                self.words.as_ptr().cast(),
                self.words.len(),
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return vec![true; pages];
        }
        vec.iter().map(|&b| b & 1 != 0).collect()
    }

    /// Bytes of the table backed by RAM right now.
    pub fn resident_bytes(&self) -> u64 {
        self.resident_pages().iter().filter(|&&r| r).count() as u64 * OS_PAGE as u64
    }
}

#[cfg(test)]
impl SlotTable {
    /// Test aid: does to table page `page` what the host's swap does, without
    /// needing swap. The page moves into an unlinked file and out of the page
    /// cache: its words still read back (they fault in from the file), but
    /// mincore reports the page as not resident. That needs a file system
    /// whose page cache can be dropped (not tmpfs): the temporary directory,
    /// else the crate's own. The caller must be the table's only user meanwhile.
    pub(crate) fn page_out(&self, page: usize) {
        let dirs = [
            std::env::temp_dir(),
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")),
        ];
        for dir in &dirs {
            if self.page_out_to(page, dir).unwrap() {
                return;
            }
        }
        panic!("mincore still reports table page {page} resident: are {dirs:?} all on tmpfs?");
    }

    /// Returns whether mincore now reports the page as not resident.
    fn page_out_to(&self, page: usize, dir: &std::path::Path) -> std::io::Result<bool> {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        use std::sync::atomic::AtomicUsize;

        static SEQ: AtomicUsize = AtomicUsize::new(0);
        assert!((page + 1) * OS_PAGE <= self.words.len());
        let mut bytes = Vec::with_capacity(OS_PAGE);
        for s in page as u64 * SLOTS_PER_PAGE..(page as u64 + 1) * SLOTS_PER_PAGE {
            let w = if s < self.slots {
                self.word(s).load(Relaxed)
            } else {
                0
            };
            bytes.extend_from_slice(&w.to_ne_bytes());
        }
        let path = dir.join(format!(
            "vzram-table-page-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Relaxed)
        ));
        let mut file = std::fs::File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        std::fs::remove_file(&path)?;
        file.write_all(&bytes)?;
        file.sync_data()?;
        let fd = file.as_raw_fd();
        // SAFETY: advice on our own open file; it only drops clean cached pages.
        unsafe { libc::posix_fadvise(fd, 0, OS_PAGE as libc::off_t, libc::POSIX_FADV_DONTNEED) };
        // SAFETY: the range is one page inside the table's own mapping, and
        // the file holds that page's words, so every reference into the table
        // stays valid and reads the same values; nobody writes them meanwhile.
        let ptr = unsafe {
            libc::mmap(
                self.words.as_ptr().add(page * OS_PAGE).cast(),
                OS_PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(!self.resident_pages()[page])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pages(t: &SlotTable) -> Vec<Range<u64>> {
        t.touched().collect()
    }

    #[test]
    fn touched_is_exactly_the_marked_pages() {
        // 130.5 table pages: three bitmap words, a short last page.
        let slots = 130 * SLOTS_PER_PAGE + SLOTS_PER_PAGE / 2;
        let t = SlotTable::new(slots, None).unwrap();
        assert_eq!(pages(&t), []);
        let p = |n: u64| n * SLOTS_PER_PAGE..(n + 1) * SLOTS_PER_PAGE;
        for s in [
            SLOTS_PER_PAGE - 1,
            0,
            3,
            64 * SLOTS_PER_PAGE,
            65 * SLOTS_PER_PAGE + 7,
            63 * SLOTS_PER_PAGE + 9,
            slots - 1,
        ] {
            t.mark(s).unwrap();
        }
        assert_eq!(
            pages(&t),
            [p(0), p(63), p(64), p(65), 130 * SLOTS_PER_PAGE..slots]
        );
        // Marks are idempotent and never spill onto a neighbour.
        t.mark(64 * SLOTS_PER_PAGE + SLOTS_PER_PAGE - 1).unwrap();
        t.mark(SLOTS_PER_PAGE).unwrap();
        assert_eq!(
            pages(&t),
            [p(0), p(1), p(63), p(64), p(65), 130 * SLOTS_PER_PAGE..slots]
        );
    }

    #[test]
    fn a_one_slot_table_has_one_page() {
        let t = SlotTable::new(1, None).unwrap();
        t.mark(0).unwrap();
        assert_eq!(pages(&t).as_slice(), &[Range { start: 0, end: 1 }]);
    }

    /// The test aid the device tests rely on does what it says.
    #[test]
    fn page_out_keeps_words_and_hides_the_page_from_mincore() {
        let t = SlotTable::new(3 * SLOTS_PER_PAGE, None).unwrap();
        for s in [5, SLOTS_PER_PAGE + 6, 2 * SLOTS_PER_PAGE + 7] {
            t.word(s).store(s * 3, Relaxed);
        }
        t.page_out(1);
        assert_eq!(t.resident_pages(), [true, false, true]);
        assert_eq!(
            t.word(SLOTS_PER_PAGE + 6).load(Relaxed),
            (SLOTS_PER_PAGE + 6) * 3
        );
        assert_eq!(t.word(SLOTS_PER_PAGE + 7).load(Relaxed), 0);
        assert_eq!(t.word(5).load(Relaxed), 15);
    }
}
