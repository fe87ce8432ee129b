//! Encodes inputs for the seed corpus with the same operation codes.

use super::op;

/// Layouts (configuration byte bits 0-1).
pub const ONE_REGION: u8 = 0;
pub const GAP: u8 = 1;
pub const ADJACENT: u8 = 2;
pub const TOP: u8 = 3;

pub struct Seed(pub Vec<u8>);

impl Seed {
    /// `qlog`: queue size 2^qlog (0..=8); modes 0 (see `modes`).
    pub fn new(layout: u8, qlog: u8, readonly: bool, limited: bool) -> Seed {
        Seed(vec![
            layout | qlog << 2 | u8::from(readonly) << 6 | u8::from(limited) << 7,
            0,
        ])
    }
    /// Sets the second configuration byte (`super::mode`).
    pub fn modes(&mut self, m: u8) -> &mut Seed {
        self.0[1] = m;
        self
    }
    fn push(&mut self, b: &[u8]) -> &mut Seed {
        self.0.extend_from_slice(b);
        self
    }
    /// Address encodings (see `Harness::addr`).
    pub fn a_first(off: u16) -> Vec<u8> {
        let mut v = vec![0];
        v.extend_from_slice(&off.to_le_bytes());
        v
    }
    pub fn a_raw(a: u64) -> Vec<u8> {
        let mut v = vec![8];
        v.extend_from_slice(&a.to_le_bytes());
        v
    }
    pub fn a_last(off: u16) -> Vec<u8> {
        let mut v = vec![2];
        v.extend_from_slice(&off.to_le_bytes());
        v
    }
    pub fn a_end_minus(n: u8) -> Vec<u8> {
        vec![4, n]
    }
    /// Length encodings (see `Harness::len`).
    pub fn l_raw(l: u32) -> Vec<u8> {
        let mut v = vec![8];
        v.extend_from_slice(&l.to_le_bytes());
        v
    }
    /// Sector encodings (see `Harness::sector`).
    pub fn s_raw(s: u64) -> Vec<u8> {
        let mut v = vec![4];
        v.extend_from_slice(&s.to_le_bytes());
        v
    }
    pub fn n_raw(n: u32) -> Vec<u8> {
        let mut v = vec![4];
        v.extend_from_slice(&n.to_le_bytes());
        v
    }
    pub fn f_raw(f: u32) -> Vec<u8> {
        let mut v = vec![2];
        v.extend_from_slice(&f.to_le_bytes());
        v
    }

    /// Well-formed request: kind 0 IN, 1 OUT, 2 FLUSH, 3 GET_ID, 4 DISCARD,
    /// 5 WRITE_ZEROES; `size` is sectors-1 for IN/OUT, bytes for GET_ID,
    /// segments-1 for DISCARD/WRITE_ZEROES (then `segs` follow).
    #[allow(clippy::too_many_arguments)]
    pub fn request(
        &mut self,
        kind: u8,
        sector: u64,
        head: u8,
        split: u8,
        indirect: bool,
        size: u8,
        seed: u8,
    ) -> &mut Seed {
        self.push(&[op::REQUEST, kind]);
        self.push(&Self::s_raw(sector));
        self.push(&[head, (split - 1) | u8::from(indirect) << 2]);
        match kind {
            0 | 1 => self.push(&[size, seed]),
            3 => self.push(&[size]),
            _ => self,
        }
    }
    /// For DISCARD/WRITE_ZEROES requests: count then segments.
    pub fn dwz(
        &mut self,
        kind: u8,
        head: u8,
        indirect: bool,
        segs: &[(u64, u32, u32)],
    ) -> &mut Seed {
        self.push(&[op::REQUEST, kind]);
        self.push(&Self::s_raw(0));
        self.push(&[head, u8::from(indirect) << 2]);
        self.push(&[segs.len() as u8 - 1]);
        for &(s, n, f) in segs {
            self.push(&Self::s_raw(s));
            self.push(&Self::n_raw(n));
            self.push(&Self::f_raw(f));
        }
        self
    }
    pub fn header(&mut self, at: &[u8], t: u32, sector: u64) -> &mut Seed {
        self.push(&[op::HEADER])
            .push(at)
            .push(&[6])
            .push(&t.to_le_bytes())
            .push(&[0]);
        self.push(&Self::s_raw(sector))
    }
    /// A linked chain in the main table from `head`; `descs` are
    /// (address encoding, length encoding, write?, indirect?).
    pub fn chain(&mut self, head: u8, descs: &[(Vec<u8>, Vec<u8>, bool, bool)]) -> &mut Seed {
        self.push(&[op::CHAIN, head, descs.len() as u8 - 1]);
        for (a, l, w, i) in descs {
            self.push(a)
                .push(l)
                .push(&[u8::from(*w) | u8::from(*i) << 6]);
        }
        self
    }
    pub fn indirect(
        &mut self,
        table: &[u8],
        head: u8,
        descs: &[(Vec<u8>, Vec<u8>, bool, bool)],
        len_sel: u8,
    ) -> &mut Seed {
        self.push(&[op::INDIRECT])
            .push(table)
            .push(&[head, descs.len() as u8 - 1]);
        for (a, l, w, i) in descs {
            self.push(a)
                .push(l)
                .push(&[u8::from(*w) | u8::from(*i) << 6]);
        }
        self.push(&[len_sel])
    }
    pub fn desc(&mut self, idx: u16, addr: &[u8], len: &[u8], flags: u8, next: u16) -> &mut Seed {
        self.push(&[op::DESC])
            .push(&idx.to_le_bytes())
            .push(addr)
            .push(len)
            .push(&[flags])
            .push(&next.to_le_bytes())
    }
    pub fn kick(&mut self, heads: &[u16]) -> &mut Seed {
        self.push(&[op::KICK, heads.len() as u8 - 1]);
        for h in heads {
            self.push(&h.to_le_bytes());
        }
        self
    }
    pub fn long_chain(
        &mut self,
        n: u16,
        table: &[u8],
        head: u8,
        hdr: &[u8],
        data: (Vec<u8>, Vec<u8>, bool),
        status: &[u8],
    ) -> &mut Seed {
        self.push(&[op::LONG_CHAIN])
            .push(&(n - 1).to_le_bytes())
            .push(table)
            .push(&[head])
            .push(hdr);
        self.push(&data.0)
            .push(&data.1)
            .push(&[u8::from(data.2)])
            .push(status)
    }
    pub fn bytes(&mut self, at: &[u8], b: &[u8]) -> &mut Seed {
        self.push(&[op::BYTES])
            .push(at)
            .push(&[b.len() as u8])
            .push(b)
    }
    pub fn readonly(&mut self) -> &mut Seed {
        self.push(&[op::READONLY])
    }
    pub fn limit(&mut self, sel: u8) -> &mut Seed {
        self.push(&[op::LIMIT, sel])
    }
    pub fn compact(&mut self) -> &mut Seed {
        self.push(&[op::COMPACT])
    }
    pub fn process(&mut self) -> &mut Seed {
        self.push(&[op::PROCESS])
    }
    /// Requests laid out and published together (`Harness::batch_macro`).
    pub fn batch(&mut self, reqs: &[B]) -> &mut Seed {
        self.push(&[op::BATCH, reqs.len() as u8 - 1]);
        for r in reqs {
            self.push(&[r.kind | u8::from(r.indirect) << 2]);
            if r.kind == 2 {
                continue;
            }
            self.push(&r.slot.to_le_bytes()).push(&[r.size, r.buf]);
            if r.kind == 3 {
                self.push(&[r.off]);
            }
            if r.kind != 1 {
                self.push(&[r.seed]);
            }
        }
        self
    }
}

/// One request of [`Seed::batch`]: `kind` 0 a write of `size + 1` pages
/// from slot `slot`, 1 a read of as many, 2 FLUSH, 3 a write of `size + 1`
/// sectors from `off` sectors into the slot; `buf` is its first page in
/// the data area, `seed` its data (see `payload`).
#[derive(Clone, Copy, Default)]
pub struct B {
    pub kind: u8,
    pub slot: u16,
    pub size: u8,
    pub buf: u8,
    pub off: u8,
    pub seed: u8,
    pub indirect: bool,
}

impl B {
    pub fn write(slot: u16, pages: u8, buf: u8, seed: u8) -> B {
        B {
            kind: 0,
            slot,
            size: pages - 1,
            buf,
            seed,
            ..B::default()
        }
    }
    pub fn read(slot: u16, pages: u8, buf: u8) -> B {
        B {
            kind: 1,
            slot,
            size: pages - 1,
            buf,
            ..B::default()
        }
    }
    pub fn flush() -> B {
        B {
            kind: 2,
            ..B::default()
        }
    }
    pub fn write_sectors(slot: u16, off: u8, sectors: u8, buf: u8, seed: u8) -> B {
        B {
            kind: 3,
            slot,
            size: sectors - 1,
            buf,
            off,
            seed,
            ..B::default()
        }
    }
    pub fn indirect(self) -> B {
        B {
            indirect: true,
            ..self
        }
    }
}
