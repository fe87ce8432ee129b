//! The model itself: two devices of one pool beside plain copies in
//! memory, one operation at a time, each checked as it returns.

use super::*;

/// Operation counts as the device reports them (zram's io_stat).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Io {
    pub(crate) reads: u64,
    pub(crate) failed_reads: u64,
    pub(crate) writes: u64,
    pub(crate) failed_writes: u64,
    pub(crate) discards: u64,
    pub(crate) backed_reads: u64,
}

/// What an operation may do to memory use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemUse {
    Any,
    /// Refused, or not about memory: it changed nothing.
    Same,
    /// A write refused after a spill moved other pages out and then found
    /// the backing file full: use may only have dropped.
    NoMore,
}

pub(crate) struct Harness {
    pub(crate) pool: Arc<Pool>,
    pub(crate) devs: [Arc<Device>; 2],
    pub(crate) codec: Codec,
    /// Steps alternate between two contexts, so device 0 (two shards)
    /// frees objects from the other shard's spans too.
    pub(crate) cx: [Context; 2],
    /// What each slot must read as; None reads as zeros and holds nothing.
    pub(crate) pages: [Vec<Option<Box<Page>>>; 2],
    /// Where the pages that need an object are, and their slot words.
    pub(crate) objs: [Vec<Option<Obj>>; 2],
    /// Slots whose last whole write was noise: certainly stored raw.
    pub(crate) noise: [Vec<bool>; 2],
    pub(crate) io: [Io; 2],
    pub(crate) limits: [u64; 2],
    pub(crate) host_limit: u64,
    /// Highest use seen so far, per device and for the pool.
    pub(crate) max_seen: [u64; 3],
    pub(crate) compacted: u64,
    pub(crate) recompressed: [u64; 2],
    pub(crate) recompress_saved: [u64; 2],
    /// Where a writeback with a page limit starts: after the last page the
    /// last one took.
    pub(crate) wb_next: [u64; 2],
    /// For working out encodings as the store does.
    pub(crate) cs: CodecState,
    pub(crate) cbuf: Box<[u8; MAX_COMPRESSED]>,
    pub(crate) _files: Vec<BackingFile>,
}

/// Memory use: device 0, device 1, and the host budget.
pub(crate) type Usage = [u64; 3];

impl Harness {
    pub(crate) fn new(
        codec: Codec,
        limits: [u64; 2],
        host_limit: u64,
        backing: [Option<u64>; 2],
    ) -> Harness {
        let pool = Pool::new(PoolConfig {
            host_mem_limit: host_limit * P,
            arena_bytes: 1 << 30,
            ..PoolConfig::default()
        })
        .unwrap();
        let mut files = Vec::new();
        let mut mk = |d: usize, shards| {
            let mut cfg = DeviceConfig::new(SLOTS[d] * P, codec);
            cfg.mem_limit = limits[d] * P;
            cfg.shards = shards;
            if let Some(blocks) = backing[d] {
                let f = BackingFile::new(blocks);
                cfg.backing = Some(BackingSpec { path: f.0.clone() });
                files.push(f);
            }
            let dev = pool.create_device(cfg).unwrap();
            assert_eq!(dev.backing().map(|b| b.blocks()), backing[d]);
            dev
        };
        let devs = [mk(0, 2), mk(1, 1)];
        Harness {
            pages: SLOTS.map(|n| (0..n).map(|_| None).collect()),
            objs: SLOTS.map(|n| vec![None; n as usize]),
            noise: SLOTS.map(|n| vec![false; n as usize]),
            io: Default::default(),
            limits: limits.map(|l| l * P),
            host_limit: host_limit * P,
            max_seen: [0; 3],
            compacted: 0,
            recompressed: [0; 2],
            recompress_saved: [0; 2],
            wb_next: [0; 2],
            cs: CodecState::default(),
            cbuf: Box::new([0; MAX_COMPRESSED]),
            _files: files,
            codec,
            pool,
            devs,
            cx: [Context::new(0), Context::new(1)],
        }
    }

    pub(crate) fn usage(&self) -> Usage {
        [
            self.devs[0].cells().budget().used(),
            self.devs[1].cells().budget().used(),
            self.pool.host_cells().budget().used(),
        ]
    }

    /// Free blocks of a device's backing file, if it has one.
    pub(crate) fn free_blocks(&self, dev: usize) -> Option<u64> {
        self.devs[dev].backing().map(|b| b.blocks() - b.used())
    }

    /// A new page in a slot; one that needs an object is at `loc`.
    pub(crate) fn set(
        &mut self,
        dev: usize,
        slot: u64,
        page: Option<Box<Page>>,
        noise: bool,
        loc: Loc,
    ) {
        let needs_object = page.as_deref().is_some_and(|p| !kept_as_fill(p));
        self.noise[dev][slot as usize] = noise && needs_object;
        self.objs[dev][slot as usize] = needs_object.then(|| Obj::fresh(loc));
        self.pages[dev][slot as usize] = page;
    }

    pub(crate) fn current(&self, dev: usize, slot: u64) -> Box<Page> {
        self.pages[dev][slot as usize]
            .clone()
            .unwrap_or_else(|| Box::new([0; PAGE_SIZE]))
    }

    /// Works out the encoding of freshly written pages, as the store did.
    pub(crate) fn resolve(&mut self, dev: usize) {
        for (o, p) in self.objs[dev].iter_mut().zip(&self.pages[dev]) {
            if let Some(o) = o.as_mut().filter(|o| o.enc == Enc::Fresh) {
                let page = p.as_deref().expect("objects hold pages");
                let len = self
                    .codec
                    .compress(page, &mut self.cbuf, DEFAULT_HUGE_THRESHOLD, &mut self.cs)
                    .unwrap_or(PAGE_SIZE);
                o.enc = Enc::Known {
                    codec: self.codec.id(),
                    len: len as u32,
                };
            }
        }
    }

    /// A spill scanned the device and wrote back pages of its choosing,
    /// marking the rest idle as it went (a second chance).
    pub(crate) fn spilled(&mut self, dev: usize) {
        for o in self.objs[dev].iter_mut().flatten() {
            if o.loc == Loc::Pool {
                o.loc = Loc::Either;
                if o.idle == Some(false) {
                    o.idle = None;
                }
            }
        }
    }

    /// Where the counts tell: with as many pages in the file as the model
    /// has there for sure, the undecided ones are all in the pool; with as
    /// many as it might have, all in the file.
    pub(crate) fn settle(&mut self) -> Result<(), TestCaseError> {
        for dev in 0..2 {
            let count = |l: Loc| {
                self.objs[dev]
                    .iter()
                    .flatten()
                    .filter(|o| o.loc == l)
                    .count() as u64
            };
            let (file, either) = (count(Loc::File), count(Loc::Either));
            if either == 0 {
                // check_stats compares the rest.
                continue;
            }
            let backed = self.devs[dev].stats().backed_pages;
            prop_assert!(
                (file..=file + either).contains(&backed),
                "device {dev}: {backed} pages in the file, the model has {file} and {either} undecided"
            );
            if backed == file || backed == file + either {
                let loc = if backed == file { Loc::Pool } else { Loc::File };
                for o in self.objs[dev].iter_mut().flatten() {
                    if o.loc == Loc::Either {
                        o.loc = loc;
                    }
                }
            }
        }
        Ok(())
    }

    pub(crate) fn read_check(&mut self, dev: usize, slot: u64) -> Result<(), TestCaseError> {
        let mut buf = [0xa5u8; PAGE_SIZE];
        let obj = self.objs[dev].get(slot as usize).copied().flatten();
        // Only needed to tell where an undecided page is: check_stats
        // compares the count of the others.
        let either = obj.is_some_and(|o| o.loc == Loc::Either);
        let backed_reads = if either {
            self.devs[dev].stats().backed_reads
        } else {
            0
        };
        let r = self.devs[dev].read_page(&mut self.cx[0], slot, &mut buf);
        self.io[dev].reads += 1;
        if slot >= SLOTS[dev] {
            self.io[dev].failed_reads += 1;
            prop_assert_eq!(
                r,
                Err(StoreError::OutOfRange {
                    slot,
                    slots: SLOTS[dev]
                })
            );
            return Ok(());
        }
        prop_assert_eq!(r, Ok(()));
        if let Some(mut o) = obj {
            // A page in the file is read from it; which of the two an
            // undecided page is shows here.
            let from_file = match o.loc {
                Loc::Pool => 0,
                Loc::File => 1,
                Loc::Either => {
                    let n = self.devs[dev].stats().backed_reads - backed_reads;
                    prop_assert!(n <= 1);
                    n
                }
            };
            self.io[dev].backed_reads += from_file;
            if from_file == 1 {
                o.loc = Loc::File;
            } else {
                o.loc = Loc::Pool;
                o.touch();
            }
            self.objs[dev][slot as usize] = Some(o);
        }
        let want = self.current(dev, slot);
        prop_assert!(buf == *want, "device {} slot {} differs", dev, slot);
        Ok(())
    }

    /// Reads every slot; `file`: those in the backing file too (each one
    /// a read from disk).
    pub(crate) fn read_all(&mut self, file: bool) -> Result<(), TestCaseError> {
        for (dev, &n) in SLOTS.iter().enumerate() {
            for slot in 0..n {
                let loc = self.objs[dev][slot as usize].map(|o| o.loc);
                if file || loc != Some(Loc::File) {
                    self.read_check(dev, slot)?;
                }
            }
        }
        Ok(())
    }

    /// Judges the outcome of a write (whole, partial or zeroing) that would
    /// leave `new` in the slot, and applies it to the model if it succeeded.
    /// A limit error is only acceptable when that limit is set, the new
    /// content needs memory, and the largest span might not fit under it;
    /// with a backing file, never: the write spills, and fails only when
    /// the file is full too. `locked`: the write held the slot's lock
    /// while it spilled (a partial write), so its page could not move.
    /// Returns what the write may have done to memory use.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn judge_write(
        &mut self,
        dev: usize,
        slot: u64,
        r: Result<(), StoreError>,
        new: Option<Box<Page>>,
        noise: bool,
        before: Usage,
        sb: &DeviceStats,
        locked: bool,
    ) -> Result<MemUse, TestCaseError> {
        self.io[dev].writes += 1;
        if r.is_err() {
            self.io[dev].failed_writes += 1;
        }
        if slot >= SLOTS[dev] {
            prop_assert_eq!(
                r,
                Err(StoreError::OutOfRange {
                    slot,
                    slots: SLOTS[dev]
                })
            );
            return Ok(MemUse::Same);
        }
        let needs_memory = new.as_deref().is_some_and(|p| !kept_as_fill(p));
        let might_not_fit = |used: u64, limit: u64| limit != 0 && used + MAX_SPAN > limit;
        let over = might_not_fit(before[dev], self.limits[dev])
            || might_not_fit(before[2], self.host_limit);
        let backing = self.free_blocks(dev).is_some();
        let sa = self.devs[dev].stats();
        let spills = sa.spills - sb.spills;
        let to_file = sa.backed_writes - sb.backed_writes;
        if !backing {
            prop_assert_eq!((spills, to_file), (0, 0));
        }
        // What a spill could have moved: every page of the device in the
        // pool, but the one a partial write holds.
        let movable = self.objs[dev]
            .iter()
            .enumerate()
            .filter(|(s, o)| {
                o.is_some_and(|o| o.loc == Loc::Pool) && !(locked && *s as u64 == slot)
            })
            .count();
        if spills > 0 {
            prop_assert!(
                needs_memory && over,
                "device {dev} slot {slot}: a spill under the limits"
            );
            self.spilled(dev);
        }
        match r {
            Ok(()) => {
                let loc = if spills > 0 {
                    Loc::Either
                } else if to_file > 0 {
                    // No spill round ran, yet the page went to the file:
                    // only right when there was nothing to move out.
                    prop_assert_eq!(to_file, 1);
                    prop_assert!(needs_memory && over);
                    prop_assert!(
                        movable == 0,
                        "device {dev} slot {slot}: the page went to the backing file while {movable} \
                         pages in the pool were never considered for spilling"
                    );
                    Loc::File
                } else {
                    Loc::Pool
                };
                self.set(dev, slot, new, noise, loc);
                Ok(MemUse::Any)
            }
            Err(StoreError::BackingFull) => {
                prop_assert!(
                    backing && needs_memory && over,
                    "device {dev} slot {slot}: BackingFull, needs memory {needs_memory}, used {before:?}"
                );
                prop_assert_eq!(
                    self.free_blocks(dev),
                    Some(0),
                    "BackingFull with free blocks"
                );
                Ok(MemUse::NoMore)
            }
            Err(StoreError::DeviceLimit) => {
                prop_assert!(
                    !backing && needs_memory && might_not_fit(before[dev], self.limits[dev]),
                    "device {dev} slot {slot}: DeviceLimit with limit {} used {} needs memory {needs_memory} backing {backing}",
                    self.limits[dev],
                    before[dev]
                );
                Ok(MemUse::Same)
            }
            Err(StoreError::HostLimit) => {
                prop_assert!(
                    !backing && needs_memory && might_not_fit(before[2], self.host_limit),
                    "device {dev} slot {slot}: HostLimit with limit {} used {} needs memory {needs_memory} backing {backing}",
                    self.host_limit,
                    before[2]
                );
                Ok(MemUse::Same)
            }
            Err(e) => Err(TestCaseError::fail(format!(
                "device {dev} slot {slot}: {e}"
            ))),
        }
    }

    /// A read-modify-write loads the old page, from the file if it is there.
    pub(crate) fn loaded(
        &mut self,
        dev: usize,
        slot: u64,
        sb: &DeviceStats,
    ) -> Result<(), TestCaseError> {
        let from_file = self.devs[dev].stats().backed_reads - sb.backed_reads;
        let was = self.objs[dev]
            .get(slot as usize)
            .copied()
            .flatten()
            .map(|o| o.loc);
        match was {
            Some(Loc::File) => prop_assert_eq!(from_file, 1),
            Some(Loc::Either) => prop_assert!(from_file <= 1),
            _ => prop_assert_eq!(from_file, 0),
        }
        self.io[dev].backed_reads += from_file;
        Ok(())
    }

    pub(crate) fn step(&mut self, op: &Op, step: usize) -> Result<(), TestCaseError> {
        let before = self.usage();
        let dev = match *op {
            Op::Write { dev, .. }
            | Op::Partial { dev, .. }
            | Op::Zero { dev, .. }
            | Op::Writeback { dev, .. }
            | Op::Recompress { dev, .. } => Some(dev),
            _ => None,
        };
        // Counters of the device the operation may spill on or tier.
        let sb = dev.map(|d| self.devs[d].stats()).unwrap_or_default();
        // Slots whose content this step may have changed; read back on both devices.
        let mut touched = 0..0;
        // Slots of one device to read back.
        let mut check: Vec<(usize, u64)> = Vec::new();
        // Read every slot, but those in the file (compaction and discards
        // do not touch them).
        let mut read_everything = false;
        let mut mem = MemUse::Any;
        // Passes that compact on their own (tiering, spills).
        let mut compacts = false;
        match *op {
            Op::Write {
                dev,
                slot,
                shape,
                seed,
            } => {
                let p = make_page(shape, dev, seed);
                let r = self.devs[dev].write_page(&mut self.cx[step % 2], slot, &p);
                let noise = matches!(shape, Shape::Noise);
                mem = self.judge_write(dev, slot, r, Some(p), noise, before, &sb, false)?;
                touched = slot..slot + 1;
            }
            Op::Partial {
                dev,
                slot,
                offset,
                len,
                shape,
                seed,
            } => {
                let data = make_page(shape, dev, seed);
                let r = self.devs[dev].write_partial(
                    &mut self.cx[step % 2],
                    slot,
                    offset,
                    &data[..len],
                );
                if offset + len > PAGE_SIZE {
                    prop_assert_eq!(r, Err(StoreError::BadPageRange { offset, len }));
                    mem = MemUse::Same;
                } else {
                    let new = (slot < SLOTS[dev]).then(|| {
                        let mut p = self.current(dev, slot);
                        p[offset..offset + len].copy_from_slice(&data[..len]);
                        p
                    });
                    if slot < SLOTS[dev] {
                        self.loaded(dev, slot, &sb)?;
                    }
                    // A page left all zeros frees the slot.
                    let new = new.filter(|p| p.iter().any(|&b| b != 0));
                    mem = self.judge_write(dev, slot, r, new, false, before, &sb, true)?;
                }
                touched = slot..slot + 1;
            }
            Op::Zero {
                dev,
                slot,
                offset,
                len,
            } => {
                let r = self.devs[dev].zero_partial(&mut self.cx[step % 2], slot, offset, len);
                if offset + len > PAGE_SIZE {
                    prop_assert_eq!(r, Err(StoreError::BadPageRange { offset, len }));
                    mem = MemUse::Same;
                } else if len == PAGE_SIZE {
                    // A whole page is a discard.
                    if slot < SLOTS[dev] {
                        prop_assert_eq!(r, Ok(()));
                        self.set(dev, slot, None, false, Loc::Pool);
                        self.io[dev].discards += 1;
                    } else {
                        prop_assert!(matches!(r, Err(StoreError::OutOfRange { .. })), "{r:?}");
                        mem = MemUse::Same;
                    }
                } else {
                    let new = (slot < SLOTS[dev]).then(|| {
                        let mut p = self.current(dev, slot);
                        p[offset..offset + len].fill(0);
                        p
                    });
                    if slot < SLOTS[dev] {
                        self.loaded(dev, slot, &sb)?;
                    }
                    let new = new.filter(|p| p.iter().any(|&b| b != 0));
                    let noise = self.noise[dev].get(slot as usize) == Some(&true) && len == 0;
                    mem = self.judge_write(dev, slot, r, new, noise, before, &sb, true)?;
                }
                touched = slot..slot + 1;
            }
            Op::Discard { dev, start, end } => {
                let r = self.devs[dev].discard(&mut self.cx[step % 2], start..end);
                if start > end || end > SLOTS[dev] {
                    prop_assert!(
                        matches!(r, Err(StoreError::OutOfRange { .. })),
                        "discard {start}..{end} on {} slots: {r:?}",
                        SLOTS[dev]
                    );
                    mem = MemUse::Same;
                } else {
                    prop_assert_eq!(r, Ok(()));
                    for s in start..end {
                        self.set(dev, s, None, false, Loc::Pool);
                    }
                    self.io[dev].discards += end - start;
                }
                touched = start.min(end)..start.max(end);
            }
            Op::Thin { dev, stride, phase } => {
                for s in (phase % stride..SLOTS[dev]).step_by(stride as usize) {
                    let r = self.devs[dev].discard(&mut self.cx[step % 2], s..s + 1);
                    prop_assert_eq!(r, Ok(()));
                    self.set(dev, s, None, false, Loc::Pool);
                    self.io[dev].discards += 1;
                }
                read_everything = true;
            }
            Op::Read { dev, slot } => self.read_check(dev, slot)?,
            Op::DeviceLimit { dev, pages } => {
                self.devs[dev].set_mem_limit(pages * P);
                self.limits[dev] = pages * P;
                prop_assert_eq!(self.devs[dev].mem_limit(), pages * P);
            }
            Op::HostLimit { pages } => {
                self.pool.set_host_mem_limit(pages * P);
                self.host_limit = pages * P;
                prop_assert_eq!(self.pool.host_mem_limit(), pages * P);
            }
            Op::Compact { dev } => {
                let pages = match dev {
                    Some(d) => self.devs[d].compact(),
                    None => self.pool.compact(),
                };
                self.compacted += pages;
                let after = self.usage();
                // Alone, compaction moves objects into room that exists and
                // gives back exactly the pages it reports.
                prop_assert!(
                    (0..3).all(|i| after[i] <= before[i]),
                    "compaction grew memory use: {before:?} -> {after:?}"
                );
                prop_assert_eq!(before[2] - after[2], pages * P, "pages given back");
                read_everything = true;
            }
            Op::MarkIdle { dev } => {
                let n = self.devs[dev].mark_idle();
                let (mut lo, mut hi) = (0, 0);
                for o in self.objs[dev].iter_mut().flatten() {
                    if o.loc == Loc::File {
                        continue;
                    }
                    let newly = tri(o.idle.map(|i| !i)).min(if o.loc == Loc::Pool {
                        Tri::Yes
                    } else {
                        Tri::Maybe
                    });
                    lo += u64::from(newly == Tri::Yes);
                    hi += u64::from(newly != Tri::No);
                    o.idle = Some(true);
                }
                prop_assert!(
                    (lo..=hi).contains(&n),
                    "mark_idle marked {n}, not {lo}..={hi}"
                );
                mem = MemUse::Same;
            }
            Op::Age { dev, passes } => {
                for _ in 0..passes {
                    let n = self.devs[dev].age();
                    let (mut lo, mut hi) = (0, 0);
                    for o in self.objs[dev].iter_mut().flatten() {
                        if o.loc == Loc::File {
                            continue;
                        }
                        // Not idle: marked now. Idle: a pass older.
                        o.age = match o.idle {
                            Some(false) => o.age,
                            Some(true) => o.age.map(|a| (a + 1).min(MAX_AGE)),
                            None => None,
                        };
                        o.idle = Some(true);
                        let cold = tri(o.age.map(|a| a >= MAX_AGE)).min(if o.loc == Loc::Pool {
                            Tri::Yes
                        } else {
                            Tri::Maybe
                        });
                        lo += u64::from(cold == Tri::Yes);
                        hi += u64::from(cold != Tri::No);
                    }
                    prop_assert!(
                        (lo..=hi).contains(&n),
                        "age found {n} cold, not {lo}..={hi}"
                    );
                }
                mem = MemUse::Same;
            }
            Op::Writeback { dev, filter, max } => {
                check = self.writeback(dev, filter, max, &sb, before)?;
                if check.is_empty() && self.free_blocks(dev).is_none() {
                    mem = MemUse::Same;
                }
                compacts = true;
            }
            Op::Recompress { dev, filter, codec } => {
                self.recompress(dev, filter, codec, &sb, before)?;
                compacts = true;
            }
        }
        // A spill compacts too.
        compacts |= dev.is_some_and(|d| self.devs[d].stats().spills != sb.spills);
        match mem {
            MemUse::Any => {}
            MemUse::Same => prop_assert_eq!(self.usage(), before, "{:?} changed memory use", op),
            MemUse::NoMore => {
                let after = self.usage();
                prop_assert!(
                    (0..3).all(|i| after[i] <= before[i]),
                    "a refused {op:?} grew memory use: {before:?} -> {after:?}"
                );
            }
        }
        self.check_stats(before, compacts)?;
        if read_everything || step % 32 == 31 {
            // Pages in the file only every other time: each is a disk read.
            self.read_all(step % 64 == 63)?;
        } else {
            for slot in touched {
                for (dev, &slots) in SLOTS.iter().enumerate() {
                    if slot < slots {
                        self.read_check(dev, slot)?;
                    }
                }
            }
            for (dev, slot) in check {
                self.read_check(dev, slot)?;
            }
        }
        self.settle()
    }
}
