//! The device side: each drain runs the backend's own `drain_queue`, with
//! a hook that runs the model before each chain and checks it after, and
//! then checks how the drain ended (used ring, notifications, EVENT_IDX,
//! its result).

use std::cell::Cell;
use std::sync::Arc;

use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory};
use vzram_blk::config::SERIAL_LEN;
use vzram_blk::device::ExecError;
use vzram_blk::pool::BATCH_PAGES;
use vzram_blk::queue::{
    drain_queue, ChainError, ChainHook, QueueError, POOL_MIN_PAGES, SIGNAL_EVERY,
};
use vzram_blk::request::Request;
use vzram_store::{Codec, StoreError};

use super::model::{AtRun, Effect, Expect, Outcome, Parsed};
use super::{
    Harness, AVAIL_RING, BIG_DEV_SIZE, DESC_TABLE, DRAIN_CAP, MAX_CHAINS, PAGE, SERIAL, ST_IOERR,
    ST_OK, ST_POISON, ST_UNSUPP, USED_RING,
};

/// One drain as the harness saw it.
#[derive(Default)]
pub(super) struct DrainLog {
    pub(super) chains: u32,
    /// Per chain: does its `add_used` succeed, and `used_event` after it ran.
    pub(super) log: Vec<(bool, u16)>,
    /// The used element the last chain should get (head, length).
    pub(super) pending: Option<(u16, u32)>,
    /// The avail index at the start; chains that change it may make the
    /// drain take several passes.
    pub(super) avail0: u16,
    pub(super) multi_pass: bool,
    /// Where in `log` the last batch starts (with no pool, each chain is
    /// its own batch).
    pub(super) batch_start: usize,
}

pub(super) struct ChainCtx {
    pub(super) head: u16,
    pub(super) descs: Vec<Descriptor>,
    pub(super) expect: Expect,
    /// The header the chain was parsed with, for the model at its turn.
    pub(super) hdr: Option<[u8; 16]>,
    /// Pages the pool takes of it; 0: it runs on the queue thread.
    pub(super) pooled: usize,
    pub(super) stats0: Option<vzram_store::DeviceStats>,
    /// `stats0` was taken after the chain before it ran (not when taken).
    pub(super) stats_fresh: bool,
}

impl Harness<'_> {
    pub(super) fn used_event_at(&self) -> u64 {
        AVAIL_RING + 4 + 2 * u64::from(self.qsize)
    }

    pub(super) fn avail_event_at(&self) -> u64 {
        USED_RING + 4 + 8 * u64::from(self.qsize)
    }

    /// A little-endian u16 from a snapshot (the rings are in the first region).
    pub(super) fn snap_u16(snap: &[Vec<u8>], at: u64) -> u16 {
        let at = at as usize;
        u16::from_le_bytes([snap[0][at], snap[0][at + 1]])
    }

    /// Drains the queue with the backend's own `drain_queue`; the checks run
    /// in the hook (`popped`, `ran`) and in `end_drain`.
    pub(super) fn process(&mut self) {
        if self.summary.chains >= MAX_CHAINS as u64 {
            return;
        }
        // The harness itself wrote to guest memory since the last time.
        let mut cur = std::mem::take(&mut self.cur);
        self.snapshot_into(&mut cur);
        self.cur = cur;
        self.drain = DrainLog {
            avail0: Self::snap_u16(&self.cur, AVAIL_RING + 2),
            ..DrainLog::default()
        };
        self.taking = false;
        let used0 = self.next_used;
        let dev = Arc::clone(if self.readonly { &self.ro } else { &self.rw });
        let mut queue = self.queue.take().expect("queue");
        let mut scratch = self.scratch.take().expect("scratch");
        let mem = self.mem;
        let event_idx = self.event_idx;
        // The used index at each notification, as the model counts it.
        let used_idx = Cell::new(used0);
        let mut notes: Vec<u16> = Vec::new();
        let result = drain_queue(
            &mut (&mut queue, || {
                notes.push(used_idx.get());
                Ok(())
            }),
            &mem,
            &dev,
            event_idx,
            &mut scratch,
            &mut Watch {
                h: self,
                used_idx: &used_idx,
            },
        );
        self.end_drain(&queue, result, &notes, used0);
        self.queue = Some(queue);
        self.scratch = Some(scratch);
    }

    /// Everything the drain did after the last chain ran: its used element,
    /// notifications, EVENT_IDX's avail_event, and how it ended.
    pub(super) fn end_drain(
        &mut self,
        queue: &Queue,
        result: Result<(), QueueError>,
        notes: &[u16],
        used0: u16,
    ) {
        assert!(
            self.chains.is_empty(),
            "{} chains taken and never completed",
            self.chains.len()
        );
        // A bad head fails alone; the drain ends after its batch.
        let bad_head = self.drain.log[self.drain.batch_start..]
            .iter()
            .any(|&(ok, _)| !ok);
        self.apply_pending_used();
        let mut after = std::mem::take(&mut self.next);
        self.snapshot_into(&mut after);
        let avail = Self::snap_u16(&after, AVAIL_RING + 2);
        let mut want = std::mem::take(&mut self.cur);
        if self.event_idx {
            let at = self.avail_event_at();
            if !bad_head {
                // enable_notification, last thing before the drain ends.
                self.write_want(&mut want, at, &self.next_avail.to_le_bytes());
            } else if Self::snap_u16(&after, at) == self.next_avail {
                // An earlier pass may have ended with it.
                self.write_want(&mut want, at, &self.next_avail.to_le_bytes());
            }
        }
        let ctx = || format!("end of a drain of {} chains", self.drain.chains);
        self.assert_mem(&want, &after, &ctx);
        self.cur = want;
        self.next = after;

        assert_eq!(queue.next_avail(), self.next_avail, "next_avail: {}", ctx());
        assert_eq!(queue.next_used(), self.next_used, "next_used: {}", ctx());
        if bad_head {
            self.summary.bad_head_drains += 1;
            assert!(
                matches!(
                    result,
                    Err(QueueError::Ring(
                        virtio_queue::Error::InvalidDescriptorIndex
                    ))
                ),
                "drain after an out-of-range head ended {result:?}"
            );
        } else if self.event_idx && avail != self.next_avail {
            self.summary.unreadable_drains += 1;
            assert!(
                matches!(result, Err(QueueError::Unreadable)),
                "drain with EVENT_IDX left avail {avail} != next_avail {} and ended {result:?}",
                self.next_avail
            );
        } else {
            assert!(result.is_ok(), "drain ended {result:?}: {}", ctx());
        }

        // Notifications: a check after every SIGNAL_EVERY completions and at
        // the end (also when an add_used fails); with EVENT_IDX a check
        // notifies only when used_event lies in the stretch it covers (virtio
        // 1.2, 2.7.7.2, the kernel's vring_need_event). Several passes (chains
        // that moved the avail index) reset the count where we cannot see.
        if self.drain.multi_pass {
            return;
        }
        let mut want_notes = Vec::new();
        let (mut used, mut old, mut pending) = (used0, used0, 0u32);
        let mut check = |new: u16, used_event: u16, old: &mut u16| {
            let notify = !self.event_idx
                || new.wrapping_sub(used_event).wrapping_sub(1) < new.wrapping_sub(*old);
            *old = new;
            if notify {
                want_notes.push(new);
            }
        };
        for &(ok, used_event) in &self.drain.log {
            if !ok {
                continue;
            }
            used = used.wrapping_add(1);
            pending += 1;
            if pending == SIGNAL_EVERY {
                check(used, used_event, &mut old);
                pending = 0;
            }
        }
        if pending > 0 {
            let used_event = self.drain.log.last().expect("a chain").1;
            check(used, used_event, &mut old);
        }
        assert_eq!(
            notes,
            &want_notes[..],
            "notifications (used index at each): {}",
            ctx()
        );
        self.summary.early_signals += notes.iter().filter(|&&n| n != used).count() as u64;
    }

    /// The used element `add_used` wrote for the chain that ran last.
    pub(super) fn apply_pending_used(&mut self) {
        if let Some((head, len)) = self.drain.pending.take() {
            let slot = USED_RING + 4 + 8 * u64::from(self.next_used.wrapping_sub(1) % self.qsize);
            let mut elem = [0u8; 8];
            elem[..4].copy_from_slice(&u32::from(head).to_le_bytes());
            elem[4..].copy_from_slice(&len.to_le_bytes());
            let mut want = std::mem::take(&mut self.cur);
            self.write_want(&mut want, slot, &elem);
            self.write_want(&mut want, USED_RING + 2, &self.next_used.to_le_bytes());
            self.cur = want;
        }
    }

    /// A chain was popped: bring the expected memory up to date, run the
    /// model, poison the status byte.
    pub(super) fn popped<M: GuestMemory>(&mut self, chain: &DescriptorChain<&M>) {
        if !self.taking {
            // The first chain of a batch.
            self.taking = true;
            self.batch_pages = 0;
            self.batch_pooled_done = 0;
            self.drain.batch_start = self.drain.log.len();
        }
        self.summary.chains += 1;
        self.drain.chains += 1;
        if self.pool.is_some() {
            self.summary.pooled_chains += 1;
        }
        self.apply_pending_used();
        if self.event_idx {
            // A pass that ended before this pop re-enabled notifications.
            let at = self.avail_event_at();
            let got: u16 = self.mem.read_obj(GuestAddress(at)).unwrap_or(0);
            if got == self.next_avail {
                let mut want = std::mem::take(&mut self.cur);
                self.write_want(&mut want, at, &got.to_le_bytes());
                self.cur = want;
            }
        }
        self.next_avail = self.next_avail.wrapping_add(1);

        let descs: Vec<Descriptor> = chain.clone().collect();
        let head_desc: Option<Descriptor> = self
            .mem
            .read_obj(GuestAddress(
                DESC_TABLE + 16 * u64::from(chain.head_index()),
            ))
            .ok();
        let table = head_desc
            .filter(|d| d.refers_to_indirect_table() && chain.head_index() < self.qsize)
            .map(|d| (d.addr().0, u64::from(d.len())));
        if table.is_some() {
            self.summary.indirect += 1;
        }
        if self.readonly {
            self.summary.readonly_chains += 1;
        }
        if self.event_idx {
            self.summary.event_idx += 1;
        }
        if self.dev_size == BIG_DEV_SIZE {
            self.summary.big_disk += 1;
        }
        if matches!(self.store.codec(), Codec::Zstd { .. }) {
            self.summary.zstd += 1;
        }
        let (expect, hdr) = self.model(&descs, None);
        let pooled = self.pool_pages(&expect);
        if let Expect::Status { at, .. } = expect {
            if self.poison_ok(at, &descs, table) {
                let old: u8 = self.mem.read_obj(GuestAddress(at)).expect("status byte");
                let _ = self.mem.write_obj(ST_POISON, GuestAddress(at));
                // The byte may be in a table the chain is read from (an
                // indirect descriptor past the head): then leave it alone.
                let key = |d: &Descriptor| (d.addr().0, d.len(), d.flags(), d.next());
                if chain.clone().map(|d| key(&d)).eq(descs.iter().map(key)) {
                    let mut want = std::mem::take(&mut self.cur);
                    self.write_want(&mut want, at, &[ST_POISON]);
                    self.cur = want;
                } else {
                    let _ = self.mem.write_obj(old, GuestAddress(at));
                }
            }
        }
        // Counters only where the device runs and must not write: stats()
        // is too slow to take for every chain.
        let watch_store = matches!(
            expect,
            Expect::Status {
                outcome: Outcome::IoErr
                    | Outcome::Unsupp
                    | Outcome::Ok(Effect::Nothing | Effect::Read { .. } | Effect::GetId { .. }),
                ..
            }
        );
        let stats0 = watch_store.then(|| self.store.stats());
        self.chains.push_back(ChainCtx {
            head: chain.head_index(),
            descs,
            expect,
            hdr,
            pooled,
            stats0,
            stats_fresh: false,
        });
    }

    /// Pages the pool takes of a chain: with the pool, a write of whole
    /// pages, at least `POOL_MIN_PAGES`, that fits in what is left of its
    /// batch (the queue's rule). The pool reads its pages when it is taken.
    pub(super) fn pool_pages(&mut self, expect: &Expect) -> usize {
        if self.pool.is_none() {
            return 0;
        }
        let Expect::Status {
            outcome: Outcome::Ok(Effect::Write { start, data }),
            ..
        } = expect
        else {
            return 0;
        };
        let len = data.len() as u64;
        let n = (len / PAGE) as usize;
        let fits = POOL_MIN_PAGES..=BATCH_PAGES - self.batch_pages;
        if !start.is_multiple_of(PAGE) || !len.is_multiple_of(PAGE) || !fits.contains(&n) {
            return 0;
        }
        self.batch_pages += n;
        n
    }

    /// May the status byte at `at` be poisoned before the chain runs? Not
    /// where the rings, the descriptor table, the head's indirect table or
    /// the readable buffers are (`popped` also checks the chain still reads
    /// the same after).
    pub(super) fn poison_ok(
        &self,
        at: u64,
        descs: &[Descriptor],
        table: Option<(u64, u64)>,
    ) -> bool {
        let q = u64::from(self.qsize);
        let mut read = vec![
            (DESC_TABLE, 16 * q),
            (AVAIL_RING, 6 + 2 * q),
            (USED_RING, 6 + 8 * q),
        ];
        read.extend(table);
        read.extend(
            descs
                .iter()
                .filter(|d| !d.is_write_only())
                .map(|d| (d.addr().0, u64::from(d.len()))),
        );
        !read.iter().any(|&(start, len)| {
            u128::from(start) <= u128::from(at)
                && u128::from(at) < u128::from(start) + u128::from(len)
        })
    }

    /// The chain ran: check status, payload, used length and the store
    /// against the model.
    pub(super) fn ran(
        &mut self,
        head: u16,
        req: &Request,
        result: &Result<u32, ChainError>,
        used: u32,
    ) {
        // In a batch, the chain before this one was added to the used ring.
        self.apply_pending_used();
        self.taking = false;
        let ChainCtx {
            head: taken,
            descs,
            expect,
            hdr,
            pooled,
            stats0,
            stats_fresh,
        } = self.chains.pop_front().expect("ran without popped");
        assert_eq!(
            head, taken,
            "completion order: head {head} completed before head {taken}, taken before it"
        );
        // Run after the others before it in its batch: what it reads when
        // it runs is what memory holds now (a pooled write's pages were
        // read when it was taken).
        let expect = match hdr {
            Some(hdr) if self.pool.is_some() && pooled == 0 => {
                let run = AtRun {
                    hdr,
                    mem: &self.cur,
                };
                self.model(&descs, Some(&run)).0
            }
            _ => expect,
        };
        let mut after = std::mem::take(&mut self.next);
        self.snapshot_into(&mut after);
        let store_touched = stats0.is_some_and(|s0| {
            let s1 = self.store.stats();
            // The first of a batch was taken before the pool prepared the
            // writes after it (each page counts as a write).
            let pooled_after: u64 = match stats_fresh {
                true => 0,
                false => self.chains.iter().map(|c| c.pooled as u64).sum(),
            };
            s1.writes != s0.writes + pooled_after || s1.discards != s0.discards
        });
        let malformed = matches!(result, Err(ChainError::Malformed(_)));
        let mut want = std::mem::take(&mut self.cur);
        let ctx = || format!("chain {descs:x?} ended {result:?}");

        let want_used = match expect {
            Expect::NoStatus => {
                self.summary.no_status += 1;
                assert!(malformed, "chain without a status byte parsed: {}", ctx());
                assert_eq!(
                    req.status,
                    None,
                    "status set for a chain without one: {}",
                    ctx()
                );
                assert!(
                    !store_touched,
                    "chain without status reached the store: {}",
                    ctx()
                );
                0
            }
            Expect::Status {
                at,
                parsed,
                outcome,
            } => {
                assert_eq!(
                    req.status,
                    Some(GuestAddress(at)),
                    "status address: {}",
                    ctx()
                );
                self.check_parsed(req, parsed.as_ref(), malformed, &ctx);
                let (status, want_used) =
                    self.check_outcome(outcome, result, store_touched, &mut want, &ctx);
                self.write_want(&mut want, at, &[status]);
                want_used
            }
        };
        assert_eq!(used, want_used, "used length: {}", ctx());
        self.assert_mem(&want, &after, &ctx);
        if pooled > 0 {
            self.summary.pooled_writes += 1;
            self.batch_pooled_done += 1;
        }
        if self.pool.is_some() {
            // The next chain of the batch runs from here on.
            let store = &self.store;
            if let Some(next) = self.chains.front_mut().filter(|c| c.stats0.is_some()) {
                next.stats0 = Some(store.stats());
                next.stats_fresh = true;
            }
        }

        // add_used comes next; it fails for a head outside the queue.
        let ok = head < self.qsize;
        let used_event = Self::snap_u16(&after, self.used_event_at());
        self.drain.log.push((ok, used_event));
        if ok {
            self.next_used = self.next_used.wrapping_add(1);
            self.drain.pending = Some((head, want_used));
        }
        if Self::snap_u16(&after, AVAIL_RING + 2) != self.drain.avail0 {
            self.drain.multi_pass = true;
        }
        if self.drain.chains >= DRAIN_CAP {
            // As the guest, stop publishing: the next pop finds nothing.
            let _ = self
                .mem
                .write_obj(self.next_avail, GuestAddress(AVAIL_RING + 2));
            self.write_want(&mut want, AVAIL_RING + 2, &self.next_avail.to_le_bytes());
            self.drain.avail0 = self.next_avail;
        }
        self.cur = want;
        self.next = after;
    }

    pub(super) fn check_parsed(
        &self,
        req: &Request,
        want: Option<&Parsed>,
        malformed: bool,
        ctx: &dyn Fn() -> String,
    ) {
        match want {
            None => assert!(malformed, "parsed, model expected malformed: {}", ctx()),
            Some(p) => {
                assert!(!malformed, "malformed, model expected {p:?}: {}", ctx());
                assert_eq!(
                    (req.kind, req.sector, req.readable_len, req.writable_len),
                    (p.kind, p.sector, p.readable_len, p.writable_len),
                    "parsed request: {}",
                    ctx()
                );
                assert_eq!(
                    req.readable.iter().map(|s| u64::from(s.len)).sum::<u64>(),
                    req.readable_len
                );
                assert_eq!(
                    req.writable.iter().map(|s| u64::from(s.len)).sum::<u64>(),
                    req.writable_len
                );
            }
        }
    }

    /// Checks a chain that has a status byte; applies its expected payload
    /// to `want` and its effect to the shadow. Returns the expected status
    /// and used length.
    pub(super) fn check_outcome(
        &mut self,
        outcome: Outcome,
        result: &Result<u32, ChainError>,
        store_touched: bool,
        want: &mut [Vec<u8>],
        ctx: &dyn Fn() -> String,
    ) -> (u8, u32) {
        let limit_hit = matches!(
            result,
            Err(ChainError::Exec(ExecError::Store(
                StoreError::DeviceLimit | StoreError::HostLimit
            )))
        );
        match outcome {
            Outcome::Ok(effect @ (Effect::Write { .. } | Effect::Zero(_))) if limit_hit => {
                assert!(self.limited(), "limit error without a limit: {}", ctx());
                self.summary.limit_failures += 1;
                self.check_partial(&effect, ctx);
                let pieces = Self::pieces(&effect);
                self.unflushed
                    .extend(pieces.iter().map(|&(s, e, _)| (s, e)));
                (ST_IOERR, 1)
            }
            Outcome::Ok(effect) => {
                let written = match result {
                    Ok(n) => *n,
                    Err(_) => panic!("model expected success: {}", ctx()),
                };
                let want_used = match effect {
                    Effect::Nothing => {
                        self.summary.ok_other += 1;
                        assert!(!store_touched, "FLUSH touched the store");
                        // What was written before it is in the store now.
                        let mut unflushed = std::mem::take(&mut self.unflushed);
                        for &(s, e) in &unflushed {
                            self.verify_range(s, e, "at a FLUSH, written before it");
                        }
                        unflushed.clear();
                        self.unflushed = unflushed;
                        if self.batch_pooled_done > 0 {
                            self.summary.flush_behind_pooled += 1;
                        }
                        1
                    }
                    Effect::Read { start, segs, len } => {
                        self.summary.ok_reads += 1;
                        let data = self.shadow[start as usize..(start + len) as usize].to_vec();
                        self.write_stream(want, &segs, &data);
                        assert!(!store_touched, "IN touched the store");
                        len as u32 + 1
                    }
                    Effect::GetId { segs, n } => {
                        self.summary.ok_other += 1;
                        let mut serial = [0u8; SERIAL_LEN];
                        let s = SERIAL.as_bytes();
                        let k = s.len().min(SERIAL_LEN);
                        serial[..k].copy_from_slice(&s[..k]);
                        self.write_stream(want, &segs, &serial[..n]);
                        n as u32 + 1
                    }
                    effect @ Effect::Write { .. } => {
                        self.summary.ok_writes += 1;
                        let Effect::Write { start, ref data } = effect else {
                            unreachable!()
                        };
                        let (start, end) = (start, start + data.len() as u64);
                        self.unflushed.push((start, end));
                        let pieces = Self::pieces(&effect);
                        self.apply_pieces(&pieces);
                        if self.sabotage && start < end {
                            self.shadow[start as usize] ^= 0x5a;
                        }
                        self.verify_range(start, end, "after write");
                        1
                    }
                    effect @ Effect::Zero(_) => {
                        self.summary.ok_zero += 1;
                        let pieces = Self::pieces(&effect);
                        self.apply_pieces(&pieces);
                        let Effect::Zero(ranges) = &effect else {
                            unreachable!()
                        };
                        for &(s, e) in ranges {
                            self.verify_range(s, e, "after discard/write-zeroes");
                            self.unflushed.push((s, e));
                        }
                        1
                    }
                };
                assert_eq!(written + 1, want_used, "payload length: {}", ctx());
                (ST_OK, want_used)
            }
            other => {
                let want_status = match other {
                    Outcome::Malformed => {
                        self.summary.malformed += 1;
                        ST_IOERR
                    }
                    Outcome::Unsupp => {
                        self.summary.unsupp += 1;
                        ST_UNSUPP
                    }
                    _ => {
                        self.summary.exec_ioerr += 1;
                        ST_IOERR
                    }
                };
                let got_status = match result {
                    Ok(_) => ST_OK,
                    Err(ChainError::Malformed(_)) => ST_IOERR,
                    Err(ChainError::Exec(e)) => e.status(),
                };
                assert_eq!(
                    got_status,
                    want_status,
                    "status (model {other:?}): {}",
                    ctx()
                );
                assert!(
                    !store_touched,
                    "failed request reached the store ({other:?}): {}",
                    ctx()
                );
                (want_status, 1)
            }
        }
    }
}

/// The drain's view of the harness: `drain_queue` calls it around each chain.
struct Watch<'h, 'a> {
    h: &'h mut Harness<'a>,
    /// The used index the model expects once the chain's `add_used` is done;
    /// the notify callback reads it.
    used_idx: &'h Cell<u16>,
}

impl ChainHook for Watch<'_, '_> {
    fn popped<M: GuestMemory>(&mut self, chain: &DescriptorChain<&M>) {
        self.h.popped(chain);
    }

    fn ran(&mut self, head: u16, req: &Request, result: &Result<u32, ChainError>, used: u32) {
        self.h.ran(head, req, result, used);
        self.used_idx.set(self.h.next_used);
    }
}
