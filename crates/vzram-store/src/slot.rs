//! The 64-bit slot word: everything the store knows about one 4 KiB slot,
//! including its lock bit, so a slot costs exactly 8 bytes of table.
//!
//! ```text
//!  63   62   61   60   59   58..57  56 ....... 44  43     42..41  40 ......... 0
//! LOCK SAME HUGE IDLE  WB   CODEC   length (13 b)  TRIED  AGE     location / 16 (41 b)
//! ```
//! A huge object's CODEC field says which codec the device had; the
//! codec field of the other codec ([`staged_codec`]) marks a page written raw to be compressed
//! in the background (raw staging): it reads as any huge page does.
//! A same-filled slot reuses bits 0..=56 for its fill pattern. A written-back
//! slot (WB) keeps its backing-file block in bits 0..=40. A word of 0 is an
//! empty slot (never written or discarded): it reads as zeros.
//!
//! IDLE and AGE are access bits of stored objects (zram's `ZRAM_IDLE`, plus
//! a coarse age the ager raises while a page stays idle); any access clears
//! them. TRIED says recompression could not shrink the object, so it is not
//! tried again (with HUGE: zram's `ZRAM_INCOMPRESSIBLE`). None of the three
//! changes what the slot holds.

use std::sync::atomic::{AtomicU64, Ordering};

pub const LOCK: u64 = 1 << 63;
pub const SAME: u64 = 1 << 62;
pub const HUGE: u64 = 1 << 61;
/// Not accessed since it was marked idle (by `mark_idle` or the ager).
pub const IDLE: u64 = 1 << 60;
/// The page lives in a block of the backing file, not in the pool.
pub const WRITTEN_BACK: u64 = 1 << 59;
const CODEC_SHIFT: u32 = 57;

const LEN_SHIFT: u32 = 44;
const LEN_MASK: u64 = (1 << 13) - 1;
/// Recompression was tried and did not shrink the object.
pub const TRIED: u64 = 1 << 43;
const AGE_SHIFT: u32 = 41;
/// Ager passes the page stayed idle through, saturating at [`MAX_AGE`].
pub const AGE_MASK: u64 = 3 << AGE_SHIFT;
pub const MAX_AGE: u8 = 3;
/// The bits an access clears.
pub const ACCESS: u64 = IDLE | AGE_MASK;
const LOC_MASK: u64 = (1 << AGE_SHIFT) - 1;
/// Objects are 16-byte aligned; storing offset / 16 buys 4 bits of range.
pub const LOC_ALIGN: u64 = 16;
/// Largest arena the location field can address (32 TiB: devices up to 4 TiB).
pub const MAX_ARENA_BYTES: u64 = (LOC_MASK + 1) * LOC_ALIGN;
/// Blocks a written-back word can name.
pub const MAX_BLOCKS: u64 = LOC_MASK + 1;

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
    /// The raw page, in block `block` of the device's backing file.
    Backed {
        block: u64,
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
        } else if word & WRITTEN_BACK != 0 {
            Slot::Backed {
                block: word & LOC_MASK,
            }
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
            Slot::Backed { block } => {
                debug_assert!(block < MAX_BLOCKS);
                Some(WRITTEN_BACK | block)
            }
        }
    }
}

/// The codec field of a staged page on a device whose codec is
/// `device_codec`: the other codec's id. A huge object is the raw page
/// whatever its codec field says, so a binary that knows nothing of staging
/// reads it as an ordinary huge page and recovers it (an id of its own would
/// be an unknown codec to it, and the state refused).
#[inline]
pub fn staged_codec(device_codec: u8) -> u8 {
    (device_codec & 1) ^ 1
}

/// Whether a word (lock bit ignored) is a staged page on a device whose
/// codec is `device_codec`: stored raw by a write, waiting for the
/// background to compress it. A huge page a run with another codec stored
/// looks staged too: the background tries this codec on it once, then
/// stores it as this codec's huge page.
#[inline]
pub fn is_staged(word: u64, device_codec: u8) -> bool {
    is_object(word)
        && word & HUGE != 0
        && ((word >> CODEC_SHIFT) & 3) as u8 == staged_codec(device_codec)
}

/// Whether a word (lock bit ignored) is a stored object in the pool: the
/// only kind that carries access bits.
#[inline]
pub fn is_object(word: u64) -> bool {
    let w = word & !LOCK;
    w != 0 && w & (SAME | WRITTEN_BACK) == 0
}

/// What a word says the slot holds, without lock or access bits: two words
/// with the same content name the same object.
#[inline]
pub fn content(word: u64) -> u64 {
    if is_object(word) {
        word & !(LOCK | ACCESS)
    } else {
        word & !LOCK
    }
}

/// The ager's count for an object word.
#[inline]
pub fn age(word: u64) -> u8 {
    ((word & AGE_MASK) >> AGE_SHIFT) as u8
}

/// An object word with its age set to `age` (and IDLE kept).
#[inline]
pub fn with_age(word: u64, age: u8) -> u64 {
    (word & !AGE_MASK) | (u64::from(age.min(MAX_AGE)) << AGE_SHIFT)
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

    /// Takes the lock only if it is free right now: for background work
    /// that must never wait on a slot (its caller may hold another lock).
    #[inline]
    pub fn try_lock(word: &'a AtomicU64) -> Option<SlotGuard<'a>> {
        let cur = word.load(Ordering::Relaxed);
        if cur & LOCK != 0 {
            return None;
        }
        word.compare_exchange(cur, cur | LOCK, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|old| SlotGuard { word, old })
    }

    /// The word as it was when locked (without the lock bit).
    #[inline]
    pub fn old(&self) -> u64 {
        self.old
    }

    /// Records an access: the word is put back without its access bits
    /// when the guard is dropped.
    #[inline]
    pub fn touch(&mut self) {
        if is_object(self.old) {
            self.old &= !ACCESS;
        }
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
            (1 << 44, 77, false, 1),
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
            // Access and TRIED bits change nothing about the content.
            let marked = with_age(w | IDLE | TRIED, 3);
            assert_eq!(Slot::decode(marked), s);
            assert_eq!(content(marked | LOCK), w | TRIED);
            assert_eq!(age(marked), 3);
            assert!(is_object(marked));
        }
    }

    #[test]
    fn only_huge_objects_in_the_other_codec_are_staged() {
        let obj = |huge, codec| {
            Slot::Object {
                offset: 4096,
                len: if huge { 4096 } else { 100 },
                huge,
                codec,
            }
            .encode()
            .unwrap()
        };
        for dev in [0u8, 1] {
            let other = staged_codec(dev);
            assert_ne!(other, dev);
            // A codec id an older binary knows: it recovers the page.
            assert!(other <= 1);
            assert!(is_staged(obj(true, other), dev));
            assert!(is_staged(obj(true, other) | LOCK | IDLE, dev));
            assert!(
                !is_staged(obj(true, dev), dev),
                "the device's own huge page"
            );
            assert!(!is_staged(obj(false, other), dev), "a compressed page");
            assert!(!is_staged(Slot::Same(u64::MAX).encode().unwrap(), dev));
            assert!(!is_staged(
                Slot::Backed {
                    block: u64::MAX >> 30
                }
                .encode()
                .unwrap(),
                dev
            ));
        }
    }

    #[test]
    fn backed_round_trip() {
        for block in [0u64, 1, 12345, MAX_BLOCKS - 1] {
            let w = Slot::Backed { block }.encode().unwrap();
            assert_eq!(Slot::decode(w), Slot::Backed { block });
            assert!(!is_object(w));
            assert_eq!(content(w | LOCK), w);
        }
    }

    #[test]
    fn fills_keep_bits_that_objects_use_for_access() {
        // A fill pattern may set bits 41..=43 and 60 is never set: content()
        // must not strip them from a same-filled word.
        let w = Slot::Same(0x0000_0e00_0000_0000).encode().unwrap();
        assert_eq!(content(w), w);
        assert!(!is_object(w));
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
    fn try_lock_never_waits_and_touch_clears_access_bits() {
        let w = AtomicU64::new(with_age(0x1234 | IDLE, 2));
        let mut g = SlotGuard::try_lock(&w).unwrap();
        assert!(SlotGuard::try_lock(&w).is_none());
        g.touch();
        drop(g);
        assert_eq!(w.load(Ordering::Relaxed), 0x1234);
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
