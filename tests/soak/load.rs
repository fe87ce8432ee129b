//! The soak's load: queue workers with requests in flight, their phases,
//! and reconnecting with requests in flight.

use super::*;

// ---------------------------------------------------------------------------
// The load.

#[derive(Default)]
pub(crate) struct Counts {
    pub(crate) writes_ok: AtomicU64,
    pub(crate) writes_failed: AtomicU64,
    pub(crate) writes_unknown: AtomicU64,
    pub(crate) reads: AtomicU64,
    pub(crate) discards: AtomicU64,
}

pub(crate) struct Shared {
    pub(crate) seq: AtomicU64,
    pub(crate) version: AtomicU64,
    pub(crate) log: Mutex<Vec<PageLog>>,
    /// Ends the current phase.
    pub(crate) stop: AtomicBool,
    /// Queues that did their share of the current phase.
    pub(crate) ready: AtomicUsize,
    /// Ends the control thread.
    pub(crate) end: AtomicBool,
    /// Some thread panicked: everyone stops.
    pub(crate) failed: AtomicBool,
    /// Completed requests, to pace the control thread.
    pub(crate) progress: AtomicU64,
    /// Held by the control thread while it acts; taken to hold it off.
    pub(crate) gate: Mutex<()>,
    pub(crate) counts: Counts,
    pub(crate) seed: u64,
}

impl Shared {
    pub(crate) fn seq(&self) -> u64 {
        self.seq.fetch_add(1, SeqCst)
    }

    pub(crate) fn log(&self) -> std::sync::MutexGuard<'_, Vec<PageLog>> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Sets `failed` when the thread holding it panics, so the others stop.
pub(crate) struct PanicFlag<'a>(pub(crate) &'a AtomicBool);

impl Drop for PanicFlag<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, SeqCst);
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) enum Req {
    Free,
    Write { page: u64, op: usize },
    Discard { first: u64, ops: Vec<usize> },
    Read { page: u64, rs: u64 },
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Writes, reads and discards until told to stop; then wait for all.
    Load,
    /// The same, but stop with requests in flight (the connection drops).
    LoadThenDrop,
    /// Read back this queue's share of the pages, no other I/O running.
    Scan,
    /// Fill this queue's share of the upper half of the device with pages
    /// of one shape, no other I/O running...
    Fill,
    /// ...and discard three in four of them again: sparse spans.
    Punch,
}

pub(crate) struct Worker<'a> {
    pub(crate) q: &'a mut Queue,
    pub(crate) qi: usize,
    pub(crate) sh: &'a Shared,
    pub(crate) slots: Vec<Req>,
    pub(crate) inflight: usize,
    pub(crate) completed: u64,
}

impl Worker<'_> {
    pub(crate) fn buf(&mut self, slot: usize) -> *mut u8 {
        assert!((slot + 1) * PAGE <= QUEUE_BUF);
        // SAFETY: slot `slot` of this queue's own buffer, inside it (checked).
        unsafe { self.q.buf_ptr().add(slot * PAGE) }
    }

    pub(crate) fn slot_bytes(&mut self, slot: usize) -> &mut [u8] {
        let p = self.buf(slot);
        // SAFETY: as in `buf`; the slot is not in flight while we touch it.
        unsafe { std::slice::from_raw_parts_mut(p, PAGE) }
    }

    pub(crate) fn submit_read(&mut self, slot: usize, page: u64) {
        self.slot_bytes(slot).fill(0xa5);
        let rs = self.sh.seq();
        let buf = self.buf(slot);
        self.q
            .raw()
            .read(page * PAGE as u64, buf, PAGE, slot, ReqFlags::empty());
        self.slots[slot] = Req::Read { page, rs };
        self.inflight += 1;
    }

    pub(crate) fn submit_write(&mut self, slot: usize, page: u64, writer: u64) {
        let stamp = Stamp {
            sector: page,
            writer,
            version: self.sh.version.fetch_add(1, SeqCst),
        };
        stamp.fill(self.slot_bytes(slot));
        let op = {
            let mut log = self.sh.log();
            let pl = &mut log[page as usize];
            pl.ops.push(Op {
                val: Val::Data(stamp),
                submit: self.sh.seq(),
                done: NEVER,
                failed: false,
                unknown: false,
                seen: NEVER,
            });
            pl.ops.len() - 1
        };
        let buf = self.buf(slot);
        self.q
            .raw()
            .write(page * PAGE as u64, buf, PAGE, slot, ReqFlags::empty());
        self.slots[slot] = Req::Write { page, op };
        self.inflight += 1;
    }

    pub(crate) fn submit_discard(&mut self, slot: usize, first: u64, n: u64) {
        let ops = {
            let mut log = self.sh.log();
            let s = self.sh.seq();
            (first..first + n)
                .map(|p| {
                    let pl = &mut log[p as usize];
                    pl.ops.push(Op {
                        val: Val::Zero,
                        submit: s,
                        done: NEVER,
                        failed: false,
                        unknown: false,
                        seen: NEVER,
                    });
                    pl.ops.len() - 1
                })
                .collect()
        };
        self.q.raw().discard(
            first * PAGE as u64,
            n * PAGE as u64,
            slot,
            ReqFlags::empty(),
        );
        self.slots[slot] = Req::Discard { first, ops };
        self.inflight += 1;
    }

    pub(crate) fn submit_random(&mut self, slot: usize, rng: &mut Rng) {
        let page = if rng.below(2) == 0 {
            rng.below(HOT)
        } else {
            rng.below(PAGES)
        };
        match rng.below(20) {
            0..=12 => self.submit_write(slot, page, self.qi as u64),
            13..=17 => self.submit_read(slot, page),
            _ => {
                let n = (1 + rng.below(4)).min(PAGES - page);
                self.submit_discard(slot, page, n)
            }
        }
    }

    pub(crate) fn complete(&mut self, slot: usize, ret: i32) {
        let req = std::mem::replace(&mut self.slots[slot], Req::Free);
        self.inflight -= 1;
        self.completed += 1;
        self.sh.progress.fetch_add(1, SeqCst);
        let sh = self.sh;
        let seed = sh.seed;
        match req {
            Req::Free => panic!("completion for free slot {slot}"),
            Req::Read { page, rs } => {
                assert_eq!(ret, 0, "read of page {page} failed: {ret} (seed {seed})");
                let rc = sh.seq();
                let p = self.slot_bytes(slot).to_vec();
                let mut log = sh.log();
                if let Err(e) = log[page as usize].check_read(page, rs, rc, &p) {
                    sh.failed.store(true, SeqCst);
                    panic!("queue {}: page {page}: {e}\n(seed {seed})", self.qi);
                }
                sh.counts.reads.fetch_add(1, SeqCst);
            }
            Req::Write { page, op } => {
                let mut log = sh.log();
                let at = sh.seq();
                let pl = &mut log[page as usize];
                let o = &mut pl.ops[op];
                match ret {
                    0 => {
                        o.done = o.done.min(at);
                        let f = Fence {
                            s: o.submit,
                            at,
                            keep: o.val,
                        };
                        pl.fences.push(f);
                        sh.counts.writes_ok.fetch_add(1, SeqCst);
                    }
                    e if e == -libc::EIO => {
                        let o = o.clone();
                        assert!(
                            o.seen == NEVER,
                            "page {page}: a write failed (IOERR) but a read had already \
                             returned its data: {o:?} (seed {seed})"
                        );
                        let o = &mut pl.ops[op];
                        o.failed = true;
                        o.done = at;
                        sh.counts.writes_failed.fetch_add(1, SeqCst);
                    }
                    e => panic!("write of page {page}: status {e}, not OK or IOERR (seed {seed})"),
                }
            }
            Req::Discard { first, ops } => {
                assert_eq!(
                    ret, 0,
                    "discard at page {first} failed: {ret} (seed {seed})"
                );
                let mut log = sh.log();
                let at = sh.seq();
                for (i, op) in ops.into_iter().enumerate() {
                    let pl = &mut log[first as usize + i];
                    let o = &mut pl.ops[op];
                    o.done = o.done.min(at);
                    let f = Fence {
                        s: o.submit,
                        at,
                        keep: Val::Zero,
                    };
                    pl.fences.push(f);
                }
                sh.counts.discards.fetch_add(1, SeqCst);
            }
        }
    }

    /// Waits for at least `min` completions (0: takes what is there, and
    /// makes sure everything queued has reached the device).
    pub(crate) fn reap(&mut self, min: usize) {
        let mut done: [MaybeUninit<Completion>; QD] =
            std::array::from_fn(|_| MaybeUninit::uninit());
        let mut timeout = IO_TIMEOUT;
        let n = self
            .q
            .raw()
            .do_io(&mut done, min, Some(&mut timeout), None)
            .expect("blkio do_io");
        assert!(n >= min, "no completion within {IO_TIMEOUT:?}");
        for c in &done[..n] {
            // SAFETY: do_io filled in the first n completions.
            let c = unsafe { c.assume_init_read() };
            self.complete(c.user_data, c.ret);
        }
    }

    pub(crate) fn run(mut self, phase: Phase, rng: &mut Rng) -> Vec<Req> {
        let _flag = PanicFlag(&self.sh.failed);
        if let Phase::Scan | Phase::Fill | Phase::Punch = phase {
            let mine: Vec<u64> = match phase {
                Phase::Fill => (PAGES / 2..PAGES).collect(),
                Phase::Punch => (PAGES / 2..PAGES).filter(|p| p % 16 >= 4).collect(),
                _ => (0..PAGES).collect(),
            };
            let qi = self.qi;
            let mut next = mine.into_iter().filter(|p| *p as usize % QUEUES == qi);
            loop {
                while self.inflight < QD {
                    let Some(page) = next.next() else { break };
                    let slot = self.slots.iter().position(|r| matches!(r, Req::Free));
                    match phase {
                        Phase::Fill => {
                            let writer = FRAG_WRITER + self.qi as u64;
                            self.submit_write(slot.unwrap(), page, writer)
                        }
                        Phase::Punch => self.submit_discard(slot.unwrap(), page, 1),
                        _ => self.submit_read(slot.unwrap(), page),
                    }
                }
                if self.inflight == 0 {
                    return Vec::new();
                }
                self.reap(1);
            }
        }
        let mut counted = false;
        loop {
            if self.sh.stop.load(SeqCst) || self.sh.failed.load(SeqCst) {
                break;
            }
            for slot in 0..QD {
                if matches!(self.slots[slot], Req::Free) {
                    self.submit_random(slot, rng);
                }
            }
            self.reap(1);
            if !counted && self.completed >= MIN_OPS {
                counted = true;
                self.sh.ready.fetch_add(1, SeqCst);
            }
        }
        if phase == Phase::LoadThenDrop {
            // A full queue of new requests goes to the device (do_io kicks
            // it) and the connection drops before they are reaped.
            if !self.sh.failed.load(SeqCst) {
                for slot in 0..QD {
                    if matches!(self.slots[slot], Req::Free) {
                        self.submit_random(slot, rng);
                    }
                }
            }
            self.reap(0);
            return self
                .slots
                .into_iter()
                .filter(|r| !matches!(r, Req::Free))
                .collect();
        }
        while self.inflight > 0 {
            self.reap(1);
        }
        Vec::new()
    }
}

/// One phase on every queue at once; returns the requests left in flight.
pub(crate) fn phase(
    c: &mut Client,
    sh: &Shared,
    rngs: &mut [Rng],
    phase: Phase,
    length: Duration,
) -> Vec<Req> {
    sh.stop.store(false, SeqCst);
    sh.ready.store(0, SeqCst);
    let start = Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = c
            .queues
            .iter_mut()
            .zip(rngs.iter_mut())
            .enumerate()
            .map(|(qi, (q, rng))| {
                let w = Worker {
                    q,
                    qi,
                    sh,
                    slots: vec![Req::Free; QD],
                    inflight: 0,
                    completed: 0,
                };
                s.spawn(move || w.run(phase, rng))
            })
            .collect();
        if let Phase::Load | Phase::LoadThenDrop = phase {
            // Until every queue did its share and the time is up (or a
            // queue failed): polls, since it is a condition on the others.
            while !sh.failed.load(SeqCst)
                && (sh.ready.load(SeqCst) < QUEUES || start.elapsed() < length)
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            sh.stop.store(true, SeqCst);
        }
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// Drops the connection with `left` in flight and connects again; their
/// outcome is unknown, but settled once the new connection is up.
pub(crate) fn reconnect(c: Client, left: Vec<Req>, sock: &Path, d: &Daemon, sh: &Shared) -> Client {
    drop(c);
    let c = Client::connect_retrying(sock, QUEUES, d);
    let at = sh.seq();
    let mut log = sh.log();
    for r in left {
        let ops: Vec<(u64, usize)> = match r {
            Req::Write { page, op } => vec![(page, op)],
            Req::Discard { first, ops } => ops
                .into_iter()
                .enumerate()
                .map(|(i, op)| (first + i as u64, op))
                .collect(),
            _ => continue,
        };
        for (page, op) in ops {
            let o = &mut log[page as usize].ops[op];
            o.done = o.done.min(at);
            o.unknown = true;
            sh.counts.writes_unknown.fetch_add(1, SeqCst);
        }
    }
    c
}
