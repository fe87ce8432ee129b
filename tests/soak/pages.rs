//! The soak's pages that identify themselves, and the history of every
//! page that a read is checked against (see `soak.rs` for the rules).

use super::*;

// ---------------------------------------------------------------------------
// Pages that identify themselves.

pub(crate) const MAGIC: u32 = 0x4b41_4f53; // "SOAK"
/// Same-filled pages: bit 54 set, then sector (16 bits), writer (7 bits)
/// and version (31 bits). Fits the store's 56-bit fill encoding.
pub(crate) const SAME_TAG: u64 = 1 << 54;
/// Writers from this id on are the fragmenter's, whose pages all have one
/// shape (so they share a size class or two): [`FRAG_RANDOM`] random chunks.
pub(crate) const FRAG_WRITER: u64 = 64;
pub(crate) const FRAG_RANDOM: u64 = 8;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Stamp {
    pub(crate) sector: u64,
    pub(crate) writer: u64,
    pub(crate) version: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Shape {
    /// One 8-byte value repeated: the store keeps only the value.
    Same,
    /// Header, then 64-byte chunks of which `n` in 64 are random and the
    /// rest one repeated word: compresses to anything from tiny to huge.
    Mixed(u64),
    /// Header, then exactly this many random 64-byte chunks and one word
    /// repeated: compresses to nearly the same size every time.
    Exact(u64),
    /// Header and noise: stored raw.
    Noise,
}

impl Stamp {
    pub(crate) fn hash(&self) -> u64 {
        mix(self.sector ^ mix(self.writer ^ mix(self.version)))
    }

    pub(crate) fn shape(&self) -> Shape {
        if self.writer >= FRAG_WRITER {
            return Shape::Exact(FRAG_RANDOM);
        }
        let h = self.hash();
        match h % 16 {
            0 => Shape::Same,
            1 => Shape::Noise,
            _ => Shape::Mixed((h >> 8) % 64),
        }
    }

    pub(crate) fn same_value(&self) -> u64 {
        SAME_TAG | (self.sector << 38) | (self.writer << 31) | self.version
    }

    pub(crate) fn from_same_value(v: u64) -> Option<Stamp> {
        (v >> 54 == 1).then_some(Stamp {
            sector: (v >> 38) & 0xffff,
            writer: (v >> 31) & 0x7f,
            version: v & 0x7fff_ffff,
        })
    }

    /// The page this stamp stands for.
    pub(crate) fn fill(&self, out: &mut [u8]) {
        assert!(self.sector < 1 << 16 && self.writer < 1 << 7 && self.version < 1 << 31);
        let out = &mut out[..PAGE];
        let shape = self.shape();
        if shape == Shape::Same {
            let v = self.same_value().to_le_bytes();
            out.chunks_exact_mut(8).for_each(|c| c.copy_from_slice(&v));
            return;
        }
        let mut rng = Rng::new(self.hash());
        let word = rng.next_u64().to_le_bytes();
        for (i, chunk) in out.chunks_exact_mut(64).enumerate() {
            let random = match shape {
                Shape::Mixed(n) => rng.below(64) < n,
                Shape::Exact(n) => (i as u64) < n,
                _ => true,
            };
            if random {
                chunk
                    .chunks_exact_mut(8)
                    .for_each(|c| c.copy_from_slice(&rng.next_u64().to_le_bytes()));
            } else {
                chunk
                    .chunks_exact_mut(8)
                    .for_each(|c| c.copy_from_slice(&word));
            }
        }
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&(self.sector as u32).to_le_bytes());
        out[8..16].copy_from_slice(&self.writer.to_le_bytes());
        out[16..24].copy_from_slice(&self.version.to_le_bytes());
    }

    pub(crate) fn page(&self) -> Vec<u8> {
        let mut v = vec![0; PAGE];
        self.fill(&mut v);
        v
    }
}

/// What a page read back looks like.
#[derive(Debug)]
pub(crate) enum Seen {
    Zero,
    /// A whole page of this stamp.
    Page(Stamp),
    /// It names this stamp but is not that page: torn or corrupt.
    Torn(Stamp),
    /// Nothing we write.
    Garbage,
}

pub(crate) fn word(p: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(p[i * 8..i * 8 + 8].try_into().unwrap())
}

pub(crate) fn decode(p: &[u8]) -> Seen {
    if p.iter().all(|&b| b == 0) {
        return Seen::Zero;
    }
    let first = word(p, 0);
    let claimed = if (0..PAGE / 8).all(|i| word(p, i) == first) {
        Stamp::from_same_value(first)
    } else if u32::from_le_bytes(p[0..4].try_into().unwrap()) == MAGIC {
        Some(Stamp {
            sector: u64::from(u32::from_le_bytes(p[4..8].try_into().unwrap())),
            writer: word(p, 1),
            version: word(p, 2),
        })
    } else {
        None
    };
    match claimed {
        None => Seen::Garbage,
        Some(s) if s.sector >= 1 << 16 || s.writer >= 1 << 7 || s.version >= 1 << 31 => {
            Seen::Garbage
        }
        Some(s) if s.page() == p => Seen::Page(s),
        Some(s) => Seen::Torn(s),
    }
}

// ---------------------------------------------------------------------------
// The history of every page.

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Val {
    Zero,
    Data(Stamp),
}

#[derive(Clone, Debug)]
pub(crate) struct Op {
    pub(crate) val: Val,
    pub(crate) submit: u64,
    /// When it was known to be over: acknowledged, failed, seen by a read,
    /// or its connection replaced. NEVER while in flight.
    pub(crate) done: u64,
    pub(crate) failed: bool,
    /// Its connection was dropped before it completed.
    pub(crate) unknown: bool,
    /// The first read that saw it ended here (NEVER: none).
    pub(crate) seen: u64,
}

/// By `at`, everything that ended before `s` and holds other content
/// than `keep` is overwritten for good.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fence {
    pub(crate) s: u64,
    pub(crate) at: u64,
    pub(crate) keep: Val,
}

pub(crate) struct PageLog {
    pub(crate) ops: Vec<Op>,
    pub(crate) fences: Vec<Fence>,
}

impl PageLog {
    pub(crate) fn new() -> PageLog {
        PageLog {
            ops: vec![Op {
                val: Val::Zero,
                submit: 0,
                done: 0,
                failed: false,
                unknown: false,
                seen: NEVER,
            }],
            fences: vec![Fence {
                s: 0,
                at: 0,
                keep: Val::Zero,
            }],
        }
    }

    /// The fence reaching furthest among those in place before `rs`, and
    /// the furthest of those keeping other content than that one.
    pub(crate) fn top_fences(&self, rs: u64) -> (Option<Fence>, Option<Fence>) {
        let best = |skip: Option<Val>| {
            self.fences
                .iter()
                .filter(|f| f.at < rs && Some(f.keep) != skip)
                .max_by_key(|f| f.s)
                .copied()
        };
        let f1 = best(None);
        (f1, f1.and_then(|f| best(Some(f.keep))))
    }

    pub(crate) fn fenced(op: &Op, f: (Option<Fence>, Option<Fence>)) -> Option<Fence> {
        let (f1, f2) = f;
        let f = if f1.is_some_and(|f1| f1.keep != op.val) {
            f1
        } else {
            f2
        };
        f.filter(|f| op.done < f.s)
    }

    /// Checks a read that began at `rs`, ended at `rc` and returned `p`,
    /// and records what it saw.
    pub(crate) fn check_read(
        &mut self,
        sector: u64,
        rs: u64,
        rc: u64,
        p: &[u8],
    ) -> Result<(), String> {
        let val = match decode(p) {
            Seen::Zero => Val::Zero,
            Seen::Page(s) if s.sector == sector => Val::Data(s),
            Seen::Page(s) => return Err(format!("holds another sector's page: {s:?}")),
            Seen::Torn(s) => return Err(format!("torn or corrupt page claiming {s:?}")),
            Seen::Garbage => {
                return Err(format!("garbage, starting {:02x?}", &p[..32.min(p.len())]))
            }
        };
        let f = self.top_fences(rs);
        let ok: Vec<usize> = (0..self.ops.len())
            .filter(|&i| {
                let o = &self.ops[i];
                o.val == val && !o.failed && o.submit < rc && PageLog::fenced(o, f).is_none()
            })
            .collect();
        if ok.is_empty() {
            return Err(self.explain(val, rs, rc, f));
        }
        if let (Val::Data(_), &[i]) = (val, &ok[..]) {
            let o = &mut self.ops[i];
            o.done = o.done.min(rc);
            o.seen = o.seen.min(rc);
        }
        self.fences.push(Fence {
            s: rs,
            at: rc,
            keep: val,
        });
        Ok(())
    }

    pub(crate) fn explain(
        &self,
        val: Val,
        rs: u64,
        rc: u64,
        f: (Option<Fence>, Option<Fence>),
    ) -> String {
        let mut why = format!("read [{rs}, {rc}] returned {val:?}, which it may not: ");
        let same: Vec<&Op> = self.ops.iter().filter(|o| o.val == val).collect();
        if same.is_empty() {
            why += "no such write was ever made to this sector (or it was pruned as overwritten)";
        }
        for o in same {
            if o.failed {
                why += &format!("a write that FAILED (IOERR) {o:?}; ");
            } else if o.submit >= rc {
                why += &format!("submitted only after the read ended {o:?}; ");
            } else if let Some(fence) = PageLog::fenced(o, f) {
                why +=
                    &format!("STALE: {o:?} was overwritten by {fence:?} before the read began; ");
            }
        }
        why += &format!("\nhistory: {:#?}", self.ops);
        why
    }

    /// Forgets what no later read may return (every request is over and
    /// every later read begins after every fence).
    pub(crate) fn prune(&mut self) {
        let f = self.top_fences(NEVER);
        self.ops
            .retain(|o| !o.failed && PageLog::fenced(o, f).is_none());
        self.fences = [f.0, f.1].into_iter().flatten().collect();
    }
}
