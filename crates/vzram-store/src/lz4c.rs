//! C liblz4 for lz4 pages (feature `lz4-c`). It writes and reads the block
//! format lz4_flex does, so pages and state files written by either build
//! read back in the other.

use std::os::raw::{c_char, c_int, c_void};

use crate::PAGE_SIZE;

// lz4-sys binds neither the external-state compressor nor LZ4_initStream;
// the liblz4 it builds and links (1.10, lz4.h) exports both.
extern "C" {
    fn LZ4_sizeofState() -> c_int;
    fn LZ4_initStream(buffer: *mut c_void, size: usize) -> *mut c_void;
    fn LZ4_compress_fast_extState_fastReset(
        state: *mut c_void,
        src: *const c_char,
        dst: *mut c_char,
        src_size: c_int,
        dst_capacity: c_int,
        acceleration: c_int,
    ) -> c_int;
}

/// liblz4's compression state (16 KiB), kept between pages as lz4_flex's
/// table is: made once, not allocated per page (liblz4 still clears the
/// table for each 4 KiB input).
pub(crate) struct State(Box<[u64]>);

impl Default for State {
    fn default() -> State {
        // SAFETY: no arguments; returns a constant.
        let size = unsafe { LZ4_sizeofState() } as usize;
        // u64 words: the state must be pointer-aligned.
        let mut words = vec![0u64; size.div_ceil(8)].into_boxed_slice();
        // SAFETY: the buffer is at least `size` bytes and 8-byte aligned,
        // which is all LZ4_initStream asks; it returns NULL otherwise.
        let init = unsafe { LZ4_initStream(words.as_mut_ptr().cast(), size) };
        assert!(!init.is_null(), "LZ4_initStream refused the state buffer");
        State(words)
    }
}

impl State {
    /// Compresses a page; `None` only if it does not fit in `out` (the
    /// store's buffer is at least liblz4's bound: see the codec tests).
    pub(crate) fn compress(&mut self, page: &[u8; PAGE_SIZE], out: &mut [u8]) -> Option<usize> {
        let cap = c_int::try_from(out.len()).unwrap_or(c_int::MAX);
        // SAFETY: the state was initialised in `default` and only liblz4
        // writes it; liblz4 reads PAGE_SIZE bytes of `page` and writes at
        // most `cap` bytes of `out`, no more than its length.
        let n = unsafe {
            LZ4_compress_fast_extState_fastReset(
                self.0.as_mut_ptr().cast(),
                page.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                PAGE_SIZE as c_int,
                cap,
                1,
            )
        };
        (n > 0).then_some(n as usize)
    }
}

/// Decompresses `src` into a whole page; false unless exactly a page comes out.
pub(crate) fn decompress(src: &[u8], page: &mut [u8; PAGE_SIZE]) -> bool {
    let Ok(len) = c_int::try_from(src.len()) else {
        return false;
    };
    // SAFETY: LZ4_decompress_safe reads at most `len` bytes of `src` and
    // writes at most PAGE_SIZE bytes of `page`, whatever the input holds.
    let n = unsafe {
        lz4_sys::LZ4_decompress_safe(
            src.as_ptr().cast(),
            page.as_mut_ptr().cast(),
            len,
            PAGE_SIZE as c_int,
        )
    };
    n == PAGE_SIZE as c_int
}
