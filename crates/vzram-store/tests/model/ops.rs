//! The model's operations: the pages they write, where the model expects
//! each page, and the proptest strategies that draw them.

use super::*;

#[derive(Debug, Clone, Copy)]
pub(crate) enum Shape {
    Zero,
    /// One byte repeated: always stored as a fill.
    Byte,
    /// One 8-byte word repeated; only some words fit in a slot word.
    Word,
    /// Random prefix, then text: compresses to the prefix's size.
    Text,
    /// Incompressible: always stored raw ("huge").
    Noise,
    /// Low-entropy bytes: mid-sized objects.
    Sparse,
}

pub(crate) fn shape() -> impl Strategy<Value = Shape> {
    prop_oneof![
        1 => Just(Shape::Zero),
        2 => Just(Shape::Byte),
        2 => Just(Shape::Word),
        6 => Just(Shape::Text),
        2 => Just(Shape::Noise),
        2 => Just(Shape::Sparse),
    ]
}

/// A page of `shape`. The device is mixed into the seed and the text, so the
/// two devices do not hold equal pages by chance.
pub(crate) fn make_page(shape: Shape, dev: usize, seed: u64) -> Box<Page> {
    let mut p: Box<Page> = Box::new([0; PAGE_SIZE]);
    let mut x = (seed ^ (dev as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1;
    match shape {
        Shape::Zero => {}
        Shape::Byte => p.fill(seed as u8),
        Shape::Word => {
            // Even seeds: a small number (fits); odd: most likely does not fit.
            let v = if seed & 1 == 0 { seed >> 52 } else { x };
            for c in p.chunks_exact_mut(8) {
                c.copy_from_slice(&v.to_ne_bytes());
            }
        }
        Shape::Text => {
            // Mostly prefixes that compress (lz4, zstd:3) into classes of two
            // or three objects per span, so a few discards leave sparse
            // spans: work for compaction.
            let v = (seed >> 8) as usize;
            let noisy = [1860 + v % 20, 2580 + v % 20, 1870, v % 2500][seed as usize % 4];
            let text = if dev == 0 {
                b"device zero swaps gently. "
            } else {
                b"device one swaps roughly. "
            };
            for (i, b) in p.iter_mut().enumerate() {
                *b = if i < noisy {
                    xorshift(&mut x) as u8
                } else {
                    text[i % text.len()]
                };
            }
        }
        Shape::Noise => p.iter_mut().for_each(|b| *b = xorshift(&mut x) as u8),
        Shape::Sparse => {
            for (i, b) in p.iter_mut().enumerate() {
                *b = if i % 64 < 40 {
                    (xorshift(&mut x) % 4) as u8 + dev as u8
                } else {
                    0
                };
            }
        }
    }
    p
}

/// Whether the store keeps this page in the slot word, needing no memory.
pub(crate) fn kept_as_fill(p: &Page) -> bool {
    let v = u64::from_ne_bytes(p[..8].try_into().unwrap());
    p.chunks_exact(8)
        .all(|c| u64::from_ne_bytes(c.try_into().unwrap()) == v)
        && encode_fill(v).is_some()
}

/// Ager passes after which an idle page is cold (the store's `slot::MAX_AGE`).
pub(crate) const MAX_AGE: u8 = 3;

/// Where a stored page that needs an object is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loc {
    Pool,
    File,
    /// A spill, or a pass the model could not follow, may have moved it.
    Either,
}

/// How a page in the pool is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Enc {
    /// Written with the device's codec; worked out when needed.
    Fresh,
    /// Codec id and object length (PAGE_SIZE: stored raw, "huge").
    Known {
        codec: u8,
        len: u32,
    },
    Unknown,
}

/// What the model knows of a page that needs an object. The bits are what
/// its slot word says while it is in the pool; None: not known.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Obj {
    pub(crate) loc: Loc,
    pub(crate) idle: Option<bool>,
    pub(crate) age: Option<u8>,
    pub(crate) tried: Option<bool>,
    pub(crate) enc: Enc,
}

impl Obj {
    pub(crate) fn fresh(loc: Loc) -> Obj {
        Obj {
            loc,
            idle: Some(false),
            age: Some(0),
            tried: Some(false),
            enc: Enc::Fresh,
        }
    }

    /// A read or write: the access bits go.
    pub(crate) fn touch(&mut self) {
        self.idle = Some(false);
        self.age = Some(0);
    }
}

/// No, cannot tell, yes: `min` is "and".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Tri {
    No,
    Maybe,
    Yes,
}

pub(crate) fn tri(b: Option<bool>) -> Tri {
    match b {
        Some(true) => Tri::Yes,
        Some(false) => Tri::No,
        None => Tri::Maybe,
    }
}

/// Whether a tiering pass with `f` takes the page (its encoding resolved).
pub(crate) fn takes(o: &Obj, f: Filter) -> Tri {
    if o.loc == Loc::File {
        return Tri::No;
    }
    let huge = || match o.enc {
        Enc::Known { len, .. } => Some(len as usize == PAGE_SIZE),
        Enc::Unknown => None,
        Enc::Fresh => unreachable!("encodings are resolved first"),
    };
    let mut t = Tri::Yes;
    if f.idle {
        t = t.min(tri(o.idle));
    }
    if f.cold {
        t = t.min(tri(o.age.map(|a| a >= MAX_AGE)));
    }
    if f.huge {
        t = t.min(tri(huge()));
    }
    if f.incompressible {
        t = t.min(tri(huge())).min(tri(o.tried));
    }
    if o.loc == Loc::Either {
        t = t.min(Tri::Maybe);
    }
    t
}

#[derive(Debug, Clone)]
pub(crate) enum Op {
    Write {
        dev: usize,
        slot: u64,
        shape: Shape,
        seed: u64,
    },
    Partial {
        dev: usize,
        slot: u64,
        offset: usize,
        len: usize,
        shape: Shape,
        seed: u64,
    },
    Zero {
        dev: usize,
        slot: u64,
        offset: usize,
        len: usize,
    },
    Discard {
        dev: usize,
        start: u64,
        end: u64,
    },
    /// Discards one slot in `stride`, one at a time, as a guest freeing
    /// scattered swap pages does: this is what leaves spans sparse.
    Thin {
        dev: usize,
        stride: u64,
        phase: u64,
    },
    Read {
        dev: usize,
        slot: u64,
    },
    DeviceLimit {
        dev: usize,
        pages: u64,
    },
    HostLimit {
        pages: u64,
    },
    /// One device, or the whole pool.
    Compact {
        dev: Option<usize>,
    },
    MarkIdle {
        dev: usize,
    },
    /// Ager passes in a row; reads in between would make pages young.
    Age {
        dev: usize,
        passes: u8,
    },
    Writeback {
        dev: usize,
        filter: Filter,
        max: Option<u64>,
    },
    Recompress {
        dev: usize,
        filter: Filter,
        codec: Codec,
    },
}

/// Byte ranges inside a page: sectors, arbitrary, the whole page, and some
/// that do not fit.
pub(crate) fn byte_range() -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![
        3 => (0..8usize, 1..=8usize).prop_map(|(s, n)| (s * 512, (n * 512).min(PAGE_SIZE - s * 512))),
        4 => (0..PAGE_SIZE, 0..=PAGE_SIZE).prop_map(|(o, l)| (o, l.min(PAGE_SIZE - o))),
        1 => Just((0, PAGE_SIZE)),
        1 => (0..=PAGE_SIZE, 0..=PAGE_SIZE),
    ]
}

/// Limits in pages: often none, often tight, sometimes roomy.
pub(crate) fn limit_pages() -> impl Strategy<Value = u64> {
    prop_oneof![2 => Just(0u64), 3 => 1..48u64, 1 => 48..160u64]
}

/// A device and a slot of it, sometimes just past its end.
pub(crate) fn dev_slot() -> impl Strategy<Value = (usize, u64)> {
    (0..2usize).prop_flat_map(|d| (Just(d), 0..SLOTS[d] + 2))
}

/// Every page, one condition, or any combination of them.
pub(crate) fn filter() -> impl Strategy<Value = Filter> {
    let f = |b: u8| Filter {
        idle: b & 1 != 0,
        cold: b & 2 != 0,
        huge: b & 4 != 0,
        incompressible: b & 8 != 0,
    };
    prop_oneof![
        1 => Just(Filter::default()),
        2 => (0..4u8).prop_map(move |i| f(1 << i)),
        2 => (0..16u8).prop_map(f),
    ]
}

pub(crate) fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (dev_slot(), shape(), any::<u64>())
            .prop_map(|((dev, slot), shape, seed)| Op::Write { dev, slot, shape, seed }),
        3 => (dev_slot(), byte_range(), shape(), any::<u64>()).prop_map(
            |((dev, slot), (offset, len), shape, seed)| Op::Partial { dev, slot, offset, len, shape, seed }
        ),
        3 => (dev_slot(), byte_range())
            .prop_map(|((dev, slot), (offset, len))| Op::Zero { dev, slot, offset, len }),
        2 => (0..2usize)
            .prop_flat_map(|d| (Just(d), 0..SLOTS[d] + 3, 0..SLOTS[d] + 3))
            .prop_map(|(dev, a, b)| {
                // Mostly short ranges; some reversed or past the end.
                let end = if b % 4 == 0 { b } else { (a + b % 5).min(SLOTS[dev] + 2) };
                Op::Discard { dev, start: a, end }
            }),
        1 => (0..2usize, 2..5u64, 0..5u64).prop_map(|(dev, stride, phase)| Op::Thin { dev, stride, phase }),
        3 => dev_slot().prop_map(|(dev, slot)| Op::Read { dev, slot }),
        1 => (0..2usize, limit_pages()).prop_map(|(dev, pages)| Op::DeviceLimit { dev, pages }),
        1 => limit_pages().prop_map(|pages| Op::HostLimit { pages }),
        2 => prop_oneof![Just(None), (0..2usize).prop_map(Some)].prop_map(|dev| Op::Compact { dev }),
        1 => (0..2usize).prop_map(|dev| Op::MarkIdle { dev }),
        2 => (0..2usize, 1..=4u8).prop_map(|(dev, passes)| Op::Age { dev, passes }),
        3 => (0..2usize, filter(), prop_oneof![Just(None), (0..24u64).prop_map(Some)])
            .prop_map(|(dev, filter, max)| Op::Writeback { dev, filter, max }),
        2 => (
            0..2usize,
            filter(),
            prop_oneof![Just(Codec::Lz4), (1..=5i32).prop_map(|level| Codec::Zstd { level })],
        )
            .prop_map(|(dev, filter, codec)| Op::Recompress { dev, filter, codec }),
    ]
}
