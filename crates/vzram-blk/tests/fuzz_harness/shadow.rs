//! The store against its shadow: a plain copy of the disk that every
//! successful write and discard is applied to, compared with what the store
//! reads back; and, for a write cut short by a memory limit, the prefix of
//! it that may have landed.

use vzram_store::{Page, PAGE_SIZE};

use super::memory::first_diff;
use super::model::Effect;
use super::{Harness, PAGE, SECTOR};

/// A page's content as a u64 for the version sets: FxHash over words, much
/// cheaper than SipHash; nothing here is adversarial enough to need more.
pub(super) fn page_hash(page: &[u8]) -> u64 {
    page.chunks_exact(8).fold(page.len() as u64, |h, w| {
        let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        (h.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95)
    })
}

impl Harness<'_> {
    pub(super) fn read_slot(&mut self, slot: u64) -> Page {
        let mut page = [0u8; PAGE_SIZE];
        self.store
            .read_page(&mut self.check_cx, slot, &mut page)
            .unwrap_or_else(|e| panic!("store read of slot {slot}: {e}"));
        page
    }

    pub(super) fn verify_range(&mut self, start: u64, end: u64, what: &str) {
        if start >= end {
            return;
        }
        for slot in start / PAGE..end.div_ceil(PAGE) {
            let page = self.read_slot(slot);
            let s = (slot * PAGE) as usize;
            if let Some(off) = first_diff(&page, &self.shadow[s..s + PAGE_SIZE]) {
                panic!(
                    "{what}: disk byte {:#x} is {:#04x}, shadow says {:#04x}",
                    s + off,
                    page[off],
                    self.shadow[s + off]
                );
            }
        }
    }

    pub(super) fn verify_all(&mut self, what: &str) {
        self.verify_range(0, self.dev_size, what);
    }

    /// How the device applies a write or discard: page-sized pieces, in
    /// order, each atomic; (start, end, data or None for zeros). A run of
    /// whole pages zeroed is one piece.
    pub(super) fn pieces(effect: &Effect) -> Vec<(u64, u64, Option<&[u8]>)> {
        let mut pieces = Vec::new();
        match effect {
            Effect::Write { start, data } => {
                let mut pos = *start;
                let end = start + data.len() as u64;
                while pos < end {
                    let n = (PAGE - pos % PAGE).min(end - pos);
                    let d = &data[(pos - start) as usize..(pos - start + n) as usize];
                    pieces.push((pos, pos + n, Some(d)));
                    pos += n;
                }
            }
            Effect::Zero(ranges) => {
                for &(start, end) in ranges {
                    let mut pos = start;
                    while pos < end {
                        if pos % PAGE == 0 && end - pos >= PAGE {
                            let last = end / PAGE * PAGE;
                            pieces.push((pos, last, None));
                            pos = last;
                        } else {
                            let n = (PAGE - pos % PAGE).min(end - pos);
                            pieces.push((pos, pos + n, None));
                            pos += n;
                        }
                    }
                }
            }
            _ => unreachable!("only writes and discards have pieces"),
        }
        pieces
    }

    /// Applies pieces to the shadow, in order; with a second queue reading,
    /// records each version a page goes through.
    pub(super) fn apply_pieces(&mut self, pieces: &[(u64, u64, Option<&[u8]>)]) {
        for &(s, e, d) in pieces {
            match d {
                Some(d) => self.shadow[s as usize..e as usize].copy_from_slice(d),
                None => self.shadow[s as usize..e as usize].fill(0),
            }
            if let Some(v) = self.versions.as_mut() {
                for slot in s / PAGE..e.div_ceil(PAGE) {
                    let p = (slot * PAGE) as usize;
                    v.insert((slot, page_hash(&self.shadow[p..p + PAGE_SIZE])));
                }
            }
        }
    }

    /// A write or discard failed on a memory limit half-way. The device
    /// applies a request in page-sized pieces, in order, each atomically, and
    /// stops at the first failure; so the disk must equal the shadow with some
    /// prefix of those pieces applied, and that prefix must be a strict one.
    pub(super) fn check_partial(&mut self, effect: &Effect, ctx: &dyn Fn() -> String) {
        let pieces = Self::pieces(effect);
        let size = self.dev_size as usize;
        let mut disk = vec![0u8; size];
        for slot in 0..self.dev_size / PAGE {
            let p = self.read_slot(slot);
            disk[(slot * PAGE) as usize..((slot + 1) * PAGE) as usize].copy_from_slice(&p);
        }
        // First piece covering each sector (every piece is whole sectors).
        let mut first = vec![usize::MAX; (self.dev_size / SECTOR) as usize];
        for (i, &(s, e, _)) in pieces.iter().enumerate() {
            for sec in s / SECTOR..e / SECTOR {
                let f = &mut first[sec as usize];
                *f = (*f).min(i);
            }
        }
        let mut k = 0usize;
        for (sec, &f) in first.iter().enumerate() {
            let r = sec * SECTOR as usize..(sec + 1) * SECTOR as usize;
            if disk[r.clone()] != self.shadow[r] {
                assert_ne!(
                    f,
                    usize::MAX,
                    "failed request changed sector {sec} outside its range: {}",
                    ctx()
                );
                k = k.max(f + 1);
            }
        }
        assert!(
            k < pieces.len(),
            "request failed but all {} pieces were applied: {}",
            pieces.len(),
            ctx()
        );
        self.apply_pieces(&pieces[..k]);
        if let Some(off) = first_diff(&self.shadow, &disk) {
            panic!("after a failed write, disk byte {off:#x} matches no prefix of the request's pieces: {}", ctx());
        }
    }
}
