//! C liblz4 (the reference implementation, compiled by lz4-sys) over single
//! pages. It writes and reads the lz4 block format, as lz4_flex does, so
//! either decodes what the other wrote.

use std::os::raw::{c_char, c_int, c_void};

// lz4-sys binds neither the external-state compressor nor LZ4_initStream;
// the liblz4 it builds and links (1.10, lz4.h) exports both.
extern "C" {
    fn LZ4_sizeofState() -> c_int;
    fn LZ4_initStream(buffer: *mut c_void, size: usize) -> *mut c_void;
    fn LZ4_compress_fast_extState(
        state: *mut c_void,
        src: *const c_char,
        dst: *mut c_char,
        src_size: c_int,
        dst_capacity: c_int,
        acceleration: c_int,
    ) -> c_int;
    fn LZ4_compress_fast_extState_fastReset(
        state: *mut c_void,
        src: *const c_char,
        dst: *mut c_char,
        src_size: c_int,
        dst_capacity: c_int,
        acceleration: c_int,
    ) -> c_int;
}

/// How the compressor's reused state is reset before each page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reset {
    /// `LZ4_compress_fast_extState_fastReset`: stale entries are recognised
    /// rather than cleared (what liblz4 advises for a reused state).
    Fast,
    /// `LZ4_compress_fast_extState`: the whole 16 KiB state is zeroed per call.
    Full,
}

/// One thread's liblz4 compressor state, kept between pages as the store
/// keeps lz4_flex's table. Acceleration 1 (the default, as zram's lz4).
pub struct Lz4C {
    /// u64 words: the state must be pointer-aligned.
    state: Box<[u64]>,
    reset: Reset,
}

impl Lz4C {
    pub fn new(reset: Reset) -> Lz4C {
        // SAFETY: no arguments; returns a constant.
        let size = unsafe { LZ4_sizeofState() } as usize;
        let mut state = vec![0u64; size.div_ceil(8)].into_boxed_slice();
        // SAFETY: the buffer is `size` bytes (or more) and 8-byte aligned,
        // which is all LZ4_initStream asks; it returns NULL otherwise.
        let init = unsafe { LZ4_initStream(state.as_mut_ptr().cast(), size) };
        assert!(!init.is_null(), "LZ4_initStream refused the state buffer");
        Lz4C { state, reset }
    }

    /// Compresses `src` into `dst`; `None` when it does not fit.
    pub fn compress(&mut self, src: &[u8], dst: &mut [u8]) -> Option<usize> {
        let (sl, dl) = (len(src.len())?, len(dst.len())?);
        let f = match self.reset {
            Reset::Fast => LZ4_compress_fast_extState_fastReset,
            Reset::Full => LZ4_compress_fast_extState,
        };
        // SAFETY: the state was initialised in `new` and only liblz4 writes
        // it; liblz4 reads at most `sl` bytes of `src` and writes at most
        // `dl` bytes of `dst`, both within their slices.
        let n = unsafe {
            f(
                self.state.as_mut_ptr().cast(),
                src.as_ptr().cast(),
                dst.as_mut_ptr().cast(),
                sl,
                dl,
                1,
            )
        };
        (n > 0).then_some(n as usize)
    }
}

/// Decompresses `src` into `dst`; `None` on malformed input or output that
/// does not fit. Needs no state.
pub fn decompress(src: &[u8], dst: &mut [u8]) -> Option<usize> {
    let (sl, dl) = (len(src.len())?, len(dst.len())?);
    // SAFETY: LZ4_decompress_safe reads at most `sl` bytes of `src` and
    // writes at most `dl` bytes of `dst`, whatever the input holds.
    let n = unsafe {
        lz4_sys::LZ4_decompress_safe(src.as_ptr().cast(), dst.as_mut_ptr().cast(), sl, dl)
    };
    (n >= 0).then_some(n as usize)
}

/// liblz4's version, as "1.10.0".
pub fn version() -> String {
    // SAFETY: no arguments; returns a constant.
    let v = unsafe { lz4_sys::LZ4_versionNumber() };
    format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
}

fn len(n: usize) -> Option<c_int> {
    c_int::try_from(n).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{Corpus, PAGE};

    /// The pages the round trips run over: the real corpus when this
    /// checkout has it, the synthetic mix, and the edge cases.
    fn pages() -> Vec<Vec<u8>> {
        let mut v: Vec<Vec<u8>> = Vec::new();
        let real = [
            std::path::Path::new(crate::data::DEFAULT_DATA).to_path_buf(),
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(crate::data::DEFAULT_DATA),
        ]
        .into_iter()
        .find(|p| p.is_file());
        if let Some(p) = real {
            let c = Corpus::load(&p).unwrap();
            v.extend((0..c.len() as u64).map(|i| c.page(i).to_vec()));
        }
        let c = Corpus::synthetic(512, 7);
        v.extend((0..c.len() as u64).map(|i| c.page(i).to_vec()));
        v.push(vec![0; PAGE]);
        v.push(vec![0xa5; PAGE]);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        v.push(
            (0..PAGE)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect(),
        );
        v
    }

    /// Every page survives liblz4 both ways, and each implementation reads
    /// the other's output: a store that switched between them keeps its
    /// pages readable.
    #[test]
    fn round_trip_and_cross_decode_with_lz4_flex() {
        let bound = lz4_flex::block::get_maximum_output_size(PAGE);
        // SAFETY: no arguments.
        assert!(bound >= unsafe { lz4_sys::LZ4_compressBound(PAGE as c_int) } as usize);
        let mut table = Box::<lz4_flex::block::CompressTable>::default();
        let (mut fast, mut full) = (Lz4C::new(Reset::Fast), Lz4C::new(Reset::Full));
        let (mut a, mut b) = (vec![0u8; bound], vec![0u8; bound]);
        let mut out = vec![0u8; PAGE];
        for (i, page) in pages().iter().enumerate() {
            let n = fast.compress(page, &mut a).unwrap();
            // Same bytes whichever way the state was reset.
            let m = full.compress(page, &mut b).unwrap();
            assert_eq!(a[..n], b[..m], "page {i}: fast and full reset differ");
            assert_eq!(decompress(&a[..n], &mut out), Some(PAGE), "page {i}");
            assert_eq!(&out, page, "page {i}: C -> C");
            out.fill(0);
            assert_eq!(
                lz4_flex::block::decompress_into(&a[..n], &mut out).unwrap(),
                PAGE
            );
            assert_eq!(&out, page, "page {i}: C -> lz4_flex");

            let k = lz4_flex::block::compress_into_with_table(page, &mut b, &mut table).unwrap();
            out.fill(0);
            assert_eq!(decompress(&b[..k], &mut out), Some(PAGE), "page {i}");
            assert_eq!(&out, page, "page {i}: lz4_flex -> C");
        }
    }

    #[test]
    fn bad_input_is_refused() {
        let page: Vec<u8> = (0..PAGE)
            .map(|i| (i % 251) as u8 ^ (i / 300) as u8)
            .collect();
        let mut c = Lz4C::new(Reset::Fast);
        let mut buf = vec![0u8; PAGE * 2];
        let n = c.compress(&page, &mut buf).unwrap();
        let mut out = vec![0u8; PAGE];
        assert_eq!(decompress(&buf[..n / 2], &mut out), None, "truncated");
        let mut small = vec![0u8; PAGE - 1];
        assert_eq!(decompress(&buf[..n], &mut small), None, "no room");
        // A compressed page too big for `dst` is refused, not overrun.
        assert_eq!(c.compress(&page, &mut buf[..n - 1]), None);
        assert!(version().starts_with("1."), "{}", version());
    }
}
