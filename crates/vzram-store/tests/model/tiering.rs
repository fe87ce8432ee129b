//! The model's tiering operations (writeback, recompression), and the
//! checks of the statistics after each step and at the end.

use super::*;

impl Harness {
    /// Runs a writeback and predicts it: the first pages the filter takes,
    /// in slot order, as many as `max` and the free blocks allow. Returns
    /// the slots to read back.
    pub(crate) fn writeback(
        &mut self,
        dev: usize,
        filter: Filter,
        max: Option<u64>,
        sb: &DeviceStats,
        before: Usage,
    ) -> Result<Vec<(usize, u64)>, TestCaseError> {
        if filter.huge || filter.incompressible {
            self.resolve(dev);
        }
        let takes: Vec<Tri> = self.objs[dev]
            .iter()
            .map(|o| o.map_or(Tri::No, |o| takes(&o, filter)))
            .collect();
        let free = self.free_blocks(dev);
        let r = self.devs[dev].writeback(filter, max);
        let Some(free) = free else {
            prop_assert!(matches!(r, Err(StoreError::InvalidConfig(_))), "{r:?}");
            return Ok(Vec::new());
        };
        let sa = self.devs[dev].stats();
        let moved = sa.backed_pages - sb.backed_pages;
        prop_assert_eq!(sa.backed_writes - sb.backed_writes, moved, "blocks written");
        let yes = takes.iter().filter(|&&t| t == Tri::Yes).count() as u64;
        let maybe = takes.iter().filter(|&&t| t == Tri::Maybe).count() as u64;
        let max = max.unwrap_or(u64::MAX);
        let (lo, hi) = (yes.min(max).min(free), (yes + maybe).min(max).min(free));
        prop_assert!(
            (lo..=hi).contains(&moved),
            "writeback of {filter:?} max {max} moved {moved}, not {lo}..={hi} ({free} blocks free)"
        );
        match r {
            Ok(rep) => {
                prop_assert_eq!(rep.pages, moved);
                prop_assert_eq!(rep.freed_bytes, before[dev] - sa.mem_used_total);
            }
            // The file filled before all the pages were in.
            Err(StoreError::BackingFull) => {
                prop_assert!(
                    (yes + maybe).min(max) > free && moved == free,
                    "{moved} moved, {free} free"
                );
            }
            Err(e) => return Err(TestCaseError::fail(format!("writeback: {e}"))),
        }
        // A pass with a page limit starts after the last page the last one
        // took and wraps around; one without starts at slot 0.
        let n = takes.len();
        let from = match max {
            u64::MAX => 0,
            _ => (self.wb_next[dev] as usize).min(n),
        };
        let exact = maybe == 0 && r.is_ok();
        let mut check = Vec::new();
        // The pass takes the first `max` pages in that order, and moves as
        // many of them as the file has room for.
        let (mut left, mut taken) = (moved, 0u64);
        let mut next = self.wb_next[dev];
        for s in (from..n).chain(0..from) {
            let o = self.objs[dev][s].as_mut();
            match (takes[s], o) {
                (Tri::Yes, Some(o)) if exact => {
                    taken += 1;
                    if taken == max {
                        next = s as u64 + 1;
                    }
                    // Past the pages the pass moved: still in the pool.
                    if left > 0 {
                        o.loc = Loc::File;
                        left -= 1;
                        check.push((dev, s as u64));
                    }
                }
                (Tri::Yes | Tri::Maybe, Some(o)) => {
                    o.loc = Loc::Either;
                    check.push((dev, s as u64));
                }
                _ => {}
            }
        }
        if max != u64::MAX {
            let cursor = self.devs[dev].writeback_cursor();
            if exact {
                prop_assert_eq!(cursor, next, "where the next limited writeback starts");
            }
            // After a pass it could not follow page by page, the model
            // takes the device's word for it, and predicts again from there.
            self.wb_next[dev] = cursor;
        }
        Ok(check)
    }

    /// Runs a recompression and predicts it page by page, compressing as
    /// the store does: the pages the filter takes, not tried before, raw or
    /// in another codec, are tried; those that `codec` puts in a smaller
    /// size class are recompressed, the rest marked tried. A limit stops
    /// the pass at the page that found no room.
    pub(crate) fn recompress(
        &mut self,
        dev: usize,
        filter: Filter,
        codec: Codec,
        sb: &DeviceStats,
        before: Usage,
    ) -> Result<(), TestCaseError> {
        self.resolve(dev);
        // (slot, length, what `codec` makes of it if smaller)
        let mut plan = Vec::new();
        let mut exact = true;
        let mut candidates = Vec::new();
        for s in 0..SLOTS[dev] as usize {
            let Some(o) = self.objs[dev][s] else {
                continue;
            };
            let mut t = takes(&o, filter).min(tri(o.tried.map(|t| !t)));
            let Enc::Known { codec: id, len } = o.enc else {
                if t != Tri::No {
                    exact = false;
                    candidates.push(s);
                }
                continue;
            };
            let huge = len as usize == PAGE_SIZE;
            if !huge && id == codec.id() {
                t = Tri::No;
            }
            match t {
                Tri::No => continue,
                Tri::Maybe => exact = false,
                Tri::Yes => {
                    let page = self.pages[dev][s].as_deref().expect("objects hold pages");
                    let limit = if huge {
                        DEFAULT_HUGE_THRESHOLD
                    } else {
                        len as usize
                    };
                    let n = codec
                        .compress(page, &mut self.cbuf, limit, &mut self.cs)
                        .filter(|&n| class_of(n) < class_of(len as usize));
                    plan.push((s, len, n));
                }
            }
            candidates.push(s);
        }
        let r = self.devs[dev].recompress(filter, codec);
        let sa = self.devs[dev].stats();
        let pages = sa.pages_recompressed - sb.pages_recompressed;
        let saved = sa.recompress_saved_bytes - sb.recompress_saved_bytes;
        self.recompressed[dev] += pages;
        self.recompress_saved[dev] += saved;
        prop_assert_eq!(
            sb.compr_data_size - sa.compr_data_size,
            saved,
            "compressed bytes saved"
        );
        match &r {
            Ok(rep) => {
                prop_assert_eq!((rep.pages, rep.saved_bytes), (pages, saved));
                prop_assert!(
                    rep.pages <= rep.tried && rep.tried <= candidates.len() as u64,
                    "{rep:?}"
                );
                prop_assert_eq!(
                    rep.freed_bytes,
                    before[dev].saturating_sub(sa.mem_used_total)
                );
            }
            Err(StoreError::DeviceLimit) => prop_assert!(self.limits[dev] != 0),
            Err(StoreError::HostLimit) => prop_assert!(self.host_limit != 0),
            Err(e) => return Err(TestCaseError::fail(format!("recompress: {e}"))),
        }
        if !exact {
            for s in candidates {
                let o = self.objs[dev][s].as_mut().unwrap();
                o.tried = None;
                o.enc = Enc::Unknown;
            }
            return Ok(());
        }
        if let Ok(rep) = &r {
            prop_assert_eq!(rep.tried, plan.len() as u64, "pages tried");
        }
        let (mut done, mut done_saved, mut stopped) = (0, 0, false);
        for &(s, len, n) in &plan {
            let o = self.objs[dev][s].as_mut().unwrap();
            match n {
                Some(_) if done == pages => {
                    // The page the pass found no room for.
                    stopped = true;
                    break;
                }
                Some(n) => {
                    done += 1;
                    done_saved += u64::from(len) - n as u64;
                    o.enc = Enc::Known {
                        codec: codec.id(),
                        len: n as u32,
                    };
                }
                None => o.tried = Some(true),
            }
        }
        prop_assert_eq!(done, pages, "pages recompressed");
        prop_assert_eq!(done_saved, saved);
        prop_assert_eq!(stopped, r.is_err(), "stopped early: {:?}", r);
        Ok(())
    }

    /// Statistics against the model, and limits against memory use.
    pub(crate) fn check_stats(
        &mut self,
        before: Usage,
        compacts: bool,
    ) -> Result<(), TestCaseError> {
        let ds = [self.devs[0].stats(), self.devs[1].stats()];
        let ps = self.pool.stats();
        for (dev, s) in ds.iter().enumerate() {
            let stored = self.pages[dev].iter().flatten().count() as u64;
            let objs = || self.objs[dev].iter().flatten();
            let needing = objs().count() as u64;
            let fills = stored - needing;
            let in_file = s.backed_pages;
            prop_assert_eq!(
                in_file,
                self.devs[dev].backing().map_or(0, |b| b.used()),
                "device {} written-back pages vs blocks in use",
                dev
            );
            prop_assert!(
                in_file <= needing,
                "device {dev}: {in_file} pages in the file of {needing}"
            );
            let objects = needing - in_file;
            let raw = (0..SLOTS[dev] as usize)
                .filter(|&i| {
                    self.noise[dev][i] && self.objs[dev][i].is_some_and(|o| o.loc == Loc::Pool)
                })
                .count() as u64;
            let used = s.mem_used_total;
            prop_assert_eq!(s.orig_data_size, stored * P, "device {} stored pages", dev);
            prop_assert_eq!(s.same_pages, fills, "device {} same pages", dev);
            prop_assert!(
                (raw..=objects).contains(&s.huge_pages),
                "device {dev}: {} huge pages, {raw} noise in the pool of {objects} objects",
                s.huge_pages
            );
            prop_assert!(
                (objects..=objects * P).contains(&s.compr_data_size),
                "device {dev}: compr {} for {objects} objects",
                s.compr_data_size
            );
            // Every object lives in a span, every span holds an object, and
            // spans are whole pages of at most MAX_SPAN.
            prop_assert!(used % P == 0 && used >= s.compr_data_size, "{s:?}");
            prop_assert!(used <= objects * MAX_SPAN, "device {dev} leaks: {s:?}");
            prop_assert_eq!(used == 0, objects == 0, "device {} used {}", dev, used);
            prop_assert_eq!(s.mem_limit, self.limits[dev]);
            self.max_seen[dev] = self.max_seen[dev].max(used);
            prop_assert!(s.mem_used_max >= self.max_seen[dev], "{s:?}");
            let io = Io {
                reads: s.reads,
                failed_reads: s.failed_reads,
                writes: s.writes,
                failed_writes: s.failed_writes,
                discards: s.discards,
                backed_reads: s.backed_reads,
            };
            prop_assert_eq!(&io, &self.io[dev], "device {} io counters", dev);
            prop_assert_eq!(
                (s.pages_recompressed, s.recompress_saved_bytes),
                (self.recompressed[dev], self.recompress_saved[dev])
            );
        }
        let devices_used = ds[0].mem_used_total + ds[1].mem_used_total;
        prop_assert_eq!(ps.mem_used_total, devices_used, "host budget vs devices");
        prop_assert_eq!(ps.mem_limit, self.host_limit);
        prop_assert_eq!(
            ps.orig_data_size,
            ds[0].orig_data_size + ds[1].orig_data_size
        );
        prop_assert_eq!(ps.backed_pages, ds[0].backed_pages + ds[1].backed_pages);
        if compacts {
            prop_assert!(ps.pages_compacted >= self.compacted);
            self.compacted = ps.pages_compacted;
        }
        prop_assert_eq!(ps.pages_compacted, self.compacted);
        self.max_seen[2] = self.max_seen[2].max(ps.mem_used_total);
        prop_assert!(ps.mem_used_max >= self.max_seen[2], "{ps:?}");
        // Use stays under each limit. Lowering a limit evicts nothing, so
        // use may sit above one; it must never grow while it does. The
        // device sum is checked on its own so a host budget that stopped
        // counting shows too.
        let after = [
            ds[0].mem_used_total,
            ds[1].mem_used_total,
            ps.mem_used_total,
        ];
        let limits = [self.limits[0], self.limits[1], self.host_limit];
        let before_devices = before[0] + before[1];
        for (i, name) in ["device 0", "device 1", "host"].iter().enumerate() {
            if limits[i] != 0 {
                prop_assert!(
                    after[i] <= limits[i].max(before[i]),
                    "{name} grew past its limit {}: {} -> {}",
                    limits[i],
                    before[i],
                    after[i]
                );
            }
        }
        if self.host_limit != 0 {
            prop_assert!(
                devices_used <= self.host_limit.max(before_devices),
                "devices grew past the host limit {}: {before_devices} -> {devices_used}",
                self.host_limit
            );
        }
        Ok(())
    }

    /// Reads everything, then discards everything: the pool and the
    /// backing files must be empty.
    pub(crate) fn finish(&mut self) -> Result<(), TestCaseError> {
        self.read_all(true)?;
        for (dev, &n) in SLOTS.iter().enumerate() {
            prop_assert_eq!(self.devs[dev].discard(&mut self.cx[0], 0..n), Ok(()));
            for s in 0..n {
                self.set(dev, s, None, false, Loc::Pool);
            }
            self.io[dev].discards += n;
        }
        let before = self.usage();
        self.check_stats(before, false)?;
        prop_assert_eq!(self.usage(), [0, 0, 0]);
        for d in &self.devs {
            let s = d.stats();
            prop_assert_eq!(
                (
                    s.compr_data_size,
                    s.same_pages,
                    s.huge_pages,
                    s.backed_pages
                ),
                (0, 0, 0, 0)
            );
        }
        self.read_all(true)
    }
}
