//! lz4 and zstd over single pages. zstd's contexts live in a [`CodecState`]
//! that each queue owns (inside its store `Context`): queue threads never
//! share or lock one.

use std::fmt;
use std::str::FromStr;

use crate::PAGE_SIZE;

/// Bytes a compressed page may need in the worst case (lz4's bound).
pub const MAX_COMPRESSED: usize = lz4_flex::block::get_maximum_output_size(PAGE_SIZE);

/// What compresses and decompresses lz4 pages in this build.
pub const LZ4_IMPLEMENTATION: &str = if cfg!(feature = "lz4-c") {
    "liblz4"
} else {
    "lz4_flex"
};

/// Compression algorithm of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Lz4,
    Zstd { level: i32 },
}

impl Codec {
    pub const DEFAULT_ZSTD_LEVEL: i32 = 1;

    /// The 2-bit id kept in the slot word.
    pub fn id(self) -> u8 {
        match self {
            Codec::Lz4 => 0,
            Codec::Zstd { .. } => 1,
        }
    }

    /// Compresses one page into `out` and returns the compressed length, or
    /// `None` when the result would not be smaller than `limit` bytes.
    pub fn compress(
        self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8; MAX_COMPRESSED],
        limit: usize,
        st: &mut CodecState,
    ) -> Option<usize> {
        let n = match self {
            #[cfg(not(feature = "lz4-c"))]
            Codec::Lz4 => {
                let table = st.lz4_table.get_or_insert_with(Default::default);
                lz4_flex::block::compress_into_with_table(page, out, table).ok()?
            }
            #[cfg(feature = "lz4-c")]
            Codec::Lz4 => st
                .lz4c
                .get_or_insert_with(Default::default)
                .compress(page, out)?,
            Codec::Zstd { level } => {
                let ctx = match &mut st.zstd_c {
                    Some((l, ctx)) if *l == level => ctx,
                    slot => {
                        let ctx = zstd::bulk::Compressor::new(level).ok()?;
                        &mut slot.insert((level, ctx)).1
                    }
                };
                ctx.compress_to_buffer(&page[..], &mut out[..limit]).ok()?
            }
        };
        (n < limit).then_some(n)
    }

    /// Decompresses `src` into a whole page. Fails unless exactly a page
    /// comes out.
    pub fn decompress(self, src: &[u8], page: &mut [u8; PAGE_SIZE], st: &mut CodecState) -> bool {
        match self {
            #[cfg(not(feature = "lz4-c"))]
            Codec::Lz4 => matches!(lz4_flex::block::decompress_into(src, page), Ok(PAGE_SIZE)),
            #[cfg(feature = "lz4-c")]
            Codec::Lz4 => crate::lz4c::decompress(src, page),
            Codec::Zstd { .. } => {
                let ctx = match &mut st.zstd_d {
                    Some(ctx) => ctx,
                    slot => match zstd::bulk::Decompressor::new() {
                        Ok(ctx) => slot.insert(ctx),
                        Err(_) => return false,
                    },
                };
                matches!(ctx.decompress_to_buffer(src, &mut page[..]), Ok(PAGE_SIZE))
            }
        }
    }

    /// The codec for a stored id; zstd's level only matters when compressing.
    pub fn from_id(id: u8) -> Codec {
        match id {
            1 => Codec::Zstd {
                level: Self::DEFAULT_ZSTD_LEVEL,
            },
            _ => Codec::Lz4,
        }
    }
}

/// The codecs' reusable state for one thread at a time: zstd's compression
/// context (for one level) and decompression context, made on first use so a
/// queue that only sees lz4 never pays for them; lz4's match table likewise.
#[derive(Default)]
pub struct CodecState {
    zstd_c: Option<(i32, zstd::bulk::Compressor<'static>)>,
    zstd_d: Option<zstd::bulk::Decompressor<'static>>,
    /// lz4's match table, kept between pages: a fresh one per call was a
    /// heap allocation and free on every write.
    #[cfg(not(feature = "lz4-c"))]
    lz4_table: Option<Box<lz4_flex::block::CompressTable>>,
    #[cfg(feature = "lz4-c")]
    lz4c: Option<crate::lz4c::State>,
}

impl fmt::Debug for CodecState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CodecState")
            .field("zstd_level", &self.zstd_c.as_ref().map(|c| c.0))
            .field("zstd_d", &self.zstd_d.is_some())
            .finish()
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Codec::Lz4 => write!(f, "lz4"),
            Codec::Zstd { level } => write!(f, "zstd:{level}"),
        }
    }
}

/// Why a codec name does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseCodecError {
    #[error("bad zstd level {0:?}")]
    Level(String),
    #[error("zstd level {level} is outside {min}..={max} (0 excluded)")]
    LevelRange { level: i32, min: i32, max: i32 },
    #[error("unknown algorithm {0:?} (expected lz4, zstd or zstd:LEVEL)")]
    Unknown(String),
}

impl FromStr for Codec {
    type Err = ParseCodecError;

    /// Accepts `lz4`, `zstd` and `zstd:LEVEL` (LEVEL in zstd's range).
    fn from_str(s: &str) -> Result<Self, ParseCodecError> {
        let (name, level) = match s.split_once(':') {
            Some((n, l)) => (n, Some(l)),
            None => (s, None),
        };
        match (name, level) {
            ("lz4", None) => Ok(Codec::Lz4),
            ("zstd", None) => Ok(Codec::Zstd {
                level: Self::DEFAULT_ZSTD_LEVEL,
            }),
            ("zstd", Some(l)) => {
                let level: i32 = l
                    .parse()
                    .map_err(|_| ParseCodecError::Level(l.to_string()))?;
                let range = zstd::compression_level_range();
                if !range.contains(&level) || level == 0 {
                    return Err(ParseCodecError::LevelRange {
                        level,
                        min: *range.start(),
                        max: *range.end(),
                    });
                }
                Ok(Codec::Zstd { level })
            }
            _ => Err(ParseCodecError::Unknown(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_page() -> [u8; PAGE_SIZE] {
        let mut p = [0u8; PAGE_SIZE];
        for (i, b) in p.iter_mut().enumerate() {
            *b = b"the quick brown fox jumps over the lazy dog "[i % 44] ^ (i / 700) as u8;
        }
        p
    }

    /// A reused lz4 table carries nothing from one page to the next: the
    /// output is what a fresh table gives, page after page.
    #[cfg(not(feature = "lz4-c"))]
    #[test]
    fn lz4_table_reuse_matches_a_fresh_table() {
        let mut st = CodecState::default();
        let mut page = text_page();
        for round in 0..64u32 {
            // Vary the content so that stale table entries would matter.
            for (i, b) in page.iter_mut().enumerate() {
                if (i as u32).wrapping_mul(2654435761).wrapping_add(round) % 7 == 0 {
                    *b = b.wrapping_add(round as u8);
                }
            }
            let mut ours = [0u8; MAX_COMPRESSED];
            let n = Codec::Lz4.compress(&page, &mut ours, MAX_COMPRESSED, &mut st);
            let mut fresh = [0u8; MAX_COMPRESSED];
            let m = lz4_flex::block::compress_into(&page, &mut fresh).unwrap();
            assert_eq!(n, Some(m), "round {round}");
            assert_eq!(ours[..m], fresh[..m], "round {round}");
        }
    }

    #[test]
    fn round_trip_both_codecs() {
        let page = text_page();
        // One state for all: a level change must make a new zstd context.
        let mut st = CodecState::default();
        for codec in [
            Codec::Lz4,
            Codec::Zstd { level: 1 },
            Codec::Zstd { level: 9 },
        ] {
            let mut buf = [0u8; MAX_COMPRESSED];
            let n = codec
                .compress(&page, &mut buf, 3072, &mut st)
                .expect("compressible");
            assert!(n < 3072);
            let mut out = [0xaa; PAGE_SIZE];
            assert!(codec.decompress(&buf[..n], &mut out, &mut st));
            assert_eq!(out, page);
            assert!(
                !codec.decompress(&buf[..n / 2], &mut out, &mut st),
                "{codec} accepted a truncated page"
            );
        }
    }

    /// liblz4 and lz4_flex read each other's pages: a store built with or
    /// without `lz4-c` reads what the other wrote.
    #[cfg(feature = "lz4-c")]
    #[test]
    fn lz4_c_and_lz4_flex_read_each_other() {
        // SAFETY: no arguments.
        let bound = unsafe { lz4_sys::LZ4_compressBound(PAGE_SIZE as _) };
        assert!(bound as usize <= MAX_COMPRESSED);
        assert_eq!(LZ4_IMPLEMENTATION, "liblz4");
        let mut st = CodecState::default();
        let mut page = text_page();
        for round in 0..64u32 {
            for (i, b) in page.iter_mut().enumerate() {
                if (i as u32).wrapping_mul(2654435761).wrapping_add(round) % 5 == 0 {
                    *b = b.wrapping_mul(31).wrapping_add(round as u8);
                }
            }
            let mut c = [0u8; MAX_COMPRESSED];
            let n = Codec::Lz4
                .compress(&page, &mut c, MAX_COMPRESSED, &mut st)
                .unwrap();
            let mut out = [0u8; PAGE_SIZE];
            let m = lz4_flex::block::decompress_into(&c[..n], &mut out);
            assert_eq!(m.ok(), Some(PAGE_SIZE));
            assert_eq!(out, page, "round {round}: liblz4 -> lz4_flex");
            let flex = lz4_flex::block::compress(&page);
            out.fill(0);
            assert!(Codec::Lz4.decompress(&flex, &mut out, &mut st));
            assert_eq!(out, page, "round {round}: lz4_flex -> liblz4");
        }
    }

    #[test]
    fn incompressible_is_refused() {
        let mut page = [0u8; PAGE_SIZE];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for b in page.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        let mut buf = [0u8; MAX_COMPRESSED];
        let st = &mut CodecState::default();
        assert_eq!(Codec::Lz4.compress(&page, &mut buf, 3072, st), None);
        assert_eq!(
            Codec::Zstd { level: 1 }.compress(&page, &mut buf, 3072, st),
            None
        );
    }

    #[test]
    fn parse() {
        assert_eq!("lz4".parse(), Ok(Codec::Lz4));
        assert_eq!("zstd".parse(), Ok(Codec::Zstd { level: 1 }));
        assert_eq!("zstd:7".parse(), Ok(Codec::Zstd { level: 7 }));
        assert!("zstd:99".parse::<Codec>().is_err());
        assert!("zstd:x".parse::<Codec>().is_err());
        assert!("lz4:1".parse::<Codec>().is_err());
        assert!("gzip".parse::<Codec>().is_err());
        assert_eq!(Codec::Zstd { level: 3 }.to_string(), "zstd:3");
    }
}
