//! The 64-bit slot word: everything the store knows about one 4 KiB slot,
//! including its lock bit, so a slot costs exactly 8 bytes of table.
//!
//! ```text
//!  63   62   61   60   59   58..57  56 ........ 44  43 ............ 0
//! LOCK SAME HUGE IDLE  WB   CODEC   length (13 b)   location / 16 (44 b)
//! ```
//! A same-filled slot reuses bits 0..=56 for its fill pattern. A word of 0 is
//! an empty slot (never written or discarded): it reads as zeros.

use std::sync::atomic::{AtomicU64, Ordering};

pub const LOCK: u64 = 1 << 63;
pub const SAME: u64 = 1 << 62;
pub const HUGE: u64 = 1 << 61;
/// Reserved for idle tracking (zram's `ZRAM_IDLE`), issue: tiering.
#[allow(dead_code)]
pub const IDLE: u64 = 1 << 60;
/// Reserved for written-back pages, issue: tiering.
#[allow(dead_code)]
pub const WRITTEN_BACK: u64 = 1 << 59;
const CODEC_SHIFT: u32 = 57;

const LEN_SHIFT: u32 = 44;
const LEN_MASK: u64 = (1 << 13) - 1;
const LOC_MASK: u64 = (1 << LEN_SHIFT) - 1;
/// Objects are 16-byte aligned; storing offset / 16 buys 4 bits of range.
pub const LOC_ALIGN: u64 = 16;
/// Largest arena the location field can address (256 TiB).
pub const MAX_ARENA_BYTES: u64 = (LOC_MASK + 1) * LOC_ALIGN;

const FILL_MASK: u64 = (1 << 57) - 1;
const FILL_WIDE: u64 = 1 << 56;

/// What a slot holds, decoded from its word (lock bit ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    Empty,
    /// Every 8-byte word of the page equals `value`.
    Same(u64),
    /// A stored object of `len` bytes at arena byte offset `offset`.
    /// `huge` objects are the raw 4096-byte page.
    Object {
        offset: u64,
        len: u32,
        huge: bool,
        codec: u8,
    },
}

impl Slot {
    /// Decodes a word. Words are only ever produced by [`Slot::encode`].
    #[inline]
    pub fn decode(word: u64) -> Slot {
        let word = word & !LOCK;
        if word == 0 {
            Slot::Empty
        } else if word & SAME != 0 {
            Slot::Same(decode_fill(word & FILL_MASK))
        } else {
            Slot::Object {
                offset: (word & LOC_MASK) * LOC_ALIGN,
                len: ((word >> LEN_SHIFT) & LEN_MASK) as u32,
                huge: word & HUGE != 0,
                codec: ((word >> CODEC_SHIFT) & 3) as u8,
            }
        }
    }

    /// Encodes a slot. Returns `None` for a fill pattern that does not fit in
    /// the word (see [`encode_fill`]); such pages go through the codec.
    #[inline]
    pub fn encode(self) -> Option<u64> {
        match self {
            Slot::Empty => Some(0),
            Slot::Same(v) => encode_fill(v).map(|p| SAME | p),
            Slot::Object {
                offset,
                len,
                huge,
                codec,
            } => {
                debug_assert!(offset % LOC_ALIGN == 0 && offset < MAX_ARENA_BYTES);
                debug_assert!(len >= 1 && u64::from(len) <= LEN_MASK);
                let mut w = (offset / LOC_ALIGN) | (u64::from(len) << LEN_SHIFT);
                w |= u64::from(codec & 3) << CODEC_SHIFT;
                if huge {
                    w |= HUGE;
                }
                Some(w)
            }
        }
    }
}

/// Packs an 8-byte fill value into 57 bits. Two shapes fit: a 4-byte value
/// repeated (covers zero, all-ones and byte patterns) and any value that is a
/// sign-extended 56-bit number (small integers, small negative numbers).
#[inline]
pub fn encode_fill(v: u64) -> Option<u64> {
    if (v >> 32) == (v & 0xffff_ffff) {
        Some(v & 0xffff_ffff)
    } else if ((v << 8) as i64 >> 8) as u64 == v {
        Some(FILL_WIDE | (v & ((1 << 56) - 1)))
    } else {
        None
    }
}

#[inline]
fn decode_fill(p: u64) -> u64 {
    if p & FILL_WIDE == 0 {
        let lo = p & 0xffff_ffff;
        lo | (lo << 32)
    } else {
        (((p & ((1 << 56) - 1)) << 8) as i64 >> 8) as u64
    }
}

/// How long a contended slot lock spins before it starts yielding the CPU,
/// and how many yields before it sleeps: queues rarely touch the same slot,
/// and when they do the holder is done within one page's codec time.
const SPINS: u32 = 128;
const YIELDS: u32 = 64;

/// A locked slot. The only way to change a slot's word: [`SlotGuard::publish`]
/// stores the new word and unlocks in one atomic store, and dropping the
/// guard unlocks with the word as it was, so an early return, an error or a
/// panic never leaves a slot locked or changed.
pub struct SlotGuard<'a> {
    word: &'a AtomicU64,
    old: u64,
}

impl<'a> SlotGuard<'a> {
    /// Waits for the slot's lock bit and takes it.
    #[inline]
    pub fn lock(word: &'a AtomicU64) -> SlotGuard<'a> {
        SlotGuard {
            word,
            old: lock(word),
        }
    }

    /// The word as it was when locked (without the lock bit).
    #[inline]
    pub fn old(&self) -> u64 {
        self.old
    }

    /// Makes `new` the slot's word and unlocks.
    #[inline]
    pub fn publish(self, new: u64) {
        unlock(self.word, new);
        std::mem::forget(self);
    }
}

impl Drop for SlotGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        unlock(self.word, self.old);
    }
}

/// Takes the slot's lock bit and returns the word as it was (unlocked).
#[inline]
fn lock(word: &AtomicU64) -> u64 {
    let mut tries = 0u32;
    loop {
        let cur = word.load(Ordering::Relaxed);
        if cur & LOCK == 0
            && word
                .compare_exchange_weak(cur, cur | LOCK, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        {
            return cur;
        }
        tries += 1;
        if tries < SPINS {
            std::hint::spin_loop();
        } else if tries < SPINS + YIELDS {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }
}

/// Publishes `new` (which must not carry the lock bit) and releases the lock.
#[inline]
fn unlock(word: &AtomicU64, new: u64) {
    debug_assert!(new & LOCK == 0);
    debug_assert!(word.load(Ordering::Relaxed) & LOCK != 0);
    word.store(new, Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_round_trip() {
        for (offset, len, huge, codec) in [
            (0u64, 1u32, false, 0u8),
            (16, 4095, false, 1),
            (MAX_ARENA_BYTES - 16, 4096, true, 3),
            (1 << 40, 1234, false, 2),
        ] {
            let s = Slot::Object {
                offset,
                len,
                huge,
                codec,
            };
            let w = s.encode().unwrap();
            assert_eq!(w & LOCK, 0);
            assert_ne!(w, 0);
            assert_eq!(Slot::decode(w), s);
            assert_eq!(Slot::decode(w | LOCK), s);
        }
    }

    #[test]
    fn fills_that_fit_round_trip() {
        for v in [
            0u64,
            u64::MAX,
            0x4141_4141_4141_4141,
            0xdead_beef_dead_beef,
            1,
            42,
            (-7i64) as u64,
            0xff80_0000_0000_0000,
        ] {
            let w = Slot::Same(v).encode().unwrap();
            assert_eq!(Slot::decode(w), Slot::Same(v), "{v:#x}");
        }
        assert_eq!(Slot::Same(0).encode(), Some(SAME));
        assert_eq!(Slot::decode(0), Slot::Empty);
    }

    #[test]
    fn fills_that_do_not_fit_are_refused() {
        assert_eq!(encode_fill(0x0123_4567_89ab_cdef), None);
        assert_eq!(encode_fill(0x8000_0000_0000_0001), None);
    }

    #[test]
    fn guard_publishes_or_restores() {
        let w = AtomicU64::new(5);
        let g = SlotGuard::lock(&w);
        assert_eq!(g.old(), 5);
        assert_ne!(w.load(Ordering::Relaxed) & LOCK, 0);
        g.publish(9);
        assert_eq!(w.load(Ordering::Relaxed), 9);
        // Dropped without publishing: back as it was, unlocked.
        drop(SlotGuard::lock(&w));
        assert_eq!(w.load(Ordering::Relaxed), 9);
        // A panic while locked unlocks too.
        let r = std::panic::catch_unwind(|| {
            let _g = SlotGuard::lock(&w);
            panic!("in the middle of a write");
        });
        assert!(r.is_err());
        assert_eq!(w.load(Ordering::Relaxed), 9);
    }
}
