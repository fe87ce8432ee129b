//! Size classes: one class per 16 bytes of object size, each with a span
//! length (1 to 8 pages) picked so that objects tile the span with little
//! waste at the tail.

use crate::PAGE_SIZE;

/// Granularity of object sizes; also the alignment of every object.
pub const CLASS_STEP: usize = 16;
/// Longest span, in pages. Spans live in fixed blocks of this many pages.
pub const MAX_SPAN_PAGES: usize = 8;
pub const BLOCK_BYTES: usize = MAX_SPAN_PAGES * PAGE_SIZE;
/// Number of classes: sizes 16, 32, ... 4096. The last holds raw ("huge") pages.
pub const NUM_CLASSES: usize = PAGE_SIZE / CLASS_STEP;

#[derive(Debug, Clone, Copy)]
pub struct Class {
    /// Bytes per object.
    pub size: u32,
    /// Pages per span.
    pub pages: u32,
    /// Objects per span.
    pub capacity: u32,
}

/// Class index holding objects of `len` bytes (1..=4096).
#[inline]
pub fn class_of(len: usize) -> usize {
    debug_assert!((1..=PAGE_SIZE).contains(&len));
    (len - 1) / CLASS_STEP
}

/// Computes the class table. A span is the shortest that wastes within 0.5%
/// of the best any span up to 8 pages could do: short spans keep partly used
/// spans cheap, long ones fit awkward sizes.
pub fn classes() -> [Class; NUM_CLASSES] {
    let mut out = [Class {
        size: 0,
        pages: 0,
        capacity: 0,
    }; NUM_CLASSES];
    for (i, c) in out.iter_mut().enumerate() {
        let size = (i + 1) * CLASS_STEP;
        let waste = |pages: usize| {
            let bytes = pages * PAGE_SIZE;
            (bytes % size) as f64 / bytes as f64
        };
        let best = (1..=MAX_SPAN_PAGES).map(waste).fold(f64::MAX, f64::min);
        let pages = (1..=MAX_SPAN_PAGES)
            .find(|&p| waste(p) <= best + 0.005)
            .unwrap_or(MAX_SPAN_PAGES);
        *c = Class {
            size: size as u32,
            pages: pages as u32,
            capacity: (pages * PAGE_SIZE / size) as u32,
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_sane() {
        let t = classes();
        for (i, c) in t.iter().enumerate() {
            assert_eq!(c.size as usize, (i + 1) * CLASS_STEP);
            assert!(c.capacity >= 1 && c.pages as usize <= MAX_SPAN_PAGES);
            let used = c.capacity as usize * c.size as usize;
            let span = c.pages as usize * PAGE_SIZE;
            assert!(used <= span);
            // Tail waste stays small for every class.
            assert!(
                (span - used) as f64 / span as f64 <= 0.11,
                "class {i}: {c:?}"
            );
        }
        assert_eq!(class_of(1), 0);
        assert_eq!(class_of(16), 0);
        assert_eq!(class_of(17), 1);
        assert_eq!(class_of(4096), NUM_CLASSES - 1);
        assert_eq!(t[NUM_CLASSES - 1].capacity, 1);
    }
}
