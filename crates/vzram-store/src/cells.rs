//! Counters and budgets that several processes share: the host-wide budget
//! (one memory file per daemon) and each device's budget and statistics (the
//! `stats` file of its state). A worker process serving a device updates
//! them in place; the daemon that supervises it reads them without asking,
//! and a device's numbers outlive the worker that wrote them.
//!
//! Every field is an atomic integer, so any bytes are a valid value and a
//! process killed mid-update leaves at worst one stale number, which the
//! next recovery recomputes from the slot table.

use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::atomic::{
    AtomicU64,
    Ordering::{Relaxed, SeqCst},
};

use crate::error::Result;
use crate::limits::Budget;
use crate::mmap::Region;
use crate::stats::{self, Counters, DeviceStats};

/// Most allocator shards (queues) a device counts separately.
pub const MAX_SHARDS: usize = 64;

/// Types whose every bit pattern is a valid value (atomic integers only),
/// and which may therefore live in memory another process writes.
///
/// # Safety
/// Implementors must be `#[repr(C)]` structs of atomic integers (or arrays
/// or structs of them), with no padding that matters and no pointers.
pub unsafe trait Plain: Sync {}

// SAFETY: three AtomicU64, repr(C).
unsafe impl Plain for Budget {}
// SAFETY: repr(C) of a Budget and AtomicU64s.
unsafe impl Plain for HostCells {}
// SAFETY: repr(C) of a Budget, AtomicU64s, Latency (atomics) and an array
// of Counters (atomics).
unsafe impl Plain for DeviceCells {}

/// A `T` in a memory mapping: private and zeroed, or shared through a file
/// (a memfd or a state file) that other processes map too.
pub struct Cells<T: Plain> {
    region: Region,
    _t: PhantomData<T>,
}

impl<T: Plain> Cells<T> {
    /// Zeroed cells of this process alone.
    pub fn private() -> Result<Cells<T>> {
        Ok(Cells {
            region: Region::reserve(std::mem::size_of::<T>())?,
            _t: PhantomData,
        })
    }

    /// The cells kept in `file`, grown to hold them if it is shorter (new
    /// bytes read as zero).
    pub fn shared(file: &std::fs::File) -> Result<Cells<T>> {
        let need = std::mem::size_of::<T>() as u64;
        let len = file
            .metadata()
            .map_err(|e| crate::StoreError::map("stat of a counters file", e))?
            .len();
        if len < need {
            file.set_len(need)
                .map_err(|e| crate::StoreError::map("growing a counters file", e))?;
        }
        Ok(Cells {
            region: Region::map_allocated_file(file, need as usize)?,
            _t: PhantomData,
        })
    }
}

impl<T: Plain> Cells<T> {
    /// Where the cells are mapped, and how long the mapping is.
    pub fn mapping(&self) -> (*const u8, usize) {
        (self.region.as_ptr(), self.region.len())
    }
}

impl<T: Plain> Deref for Cells<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the region is at least size_of::<T>() bytes, page aligned
        // (so aligned for T), lives as long as self, and T is Plain: any
        // bytes are a valid T and all access is through atomics.
        unsafe { &*self.region.as_ptr().cast::<T>() }
    }
}

/// What every device of a daemon shares: the host budget.
#[repr(C)]
#[derive(Default)]
pub struct HostCells {
    pub(crate) budget: Budget,
    /// Random and fixed when the cells are made: tells whether a device's
    /// charge (`DeviceCells::charged_to`) is already in this budget.
    pub(crate) id: AtomicU64,
    /// Raw staging of all devices together: bytes of staged pages, against
    /// the host's staging budget (limit 0: no device stages). After `id`:
    /// cells from before it read as zeros, and stage nothing.
    pub(crate) staging: Budget,
}

impl HostCells {
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// The host's staging budget: staged bytes of every device, and the
    /// most they may be.
    pub fn staging(&self) -> &Budget {
        &self.staging
    }

    /// Gives the cells their id if they have none yet (a fresh file).
    pub(crate) fn init_id(&self) -> u64 {
        let id = crate::id::random_id() | 1;
        match self.id.compare_exchange(0, id, Relaxed, Relaxed) {
            Ok(_) => id,
            Err(existing) => existing,
        }
    }

    pub fn id(&self) -> u64 {
        self.id.load(Relaxed)
    }
}

/// One device's budget and statistics.
#[repr(C)]
pub struct DeviceCells {
    pub(crate) budget: Budget,
    /// The `HostCells::id` whose budget holds this device's `budget.used`.
    pub(crate) charged_to: AtomicU64,
    /// Gauges only the serving process can measure, published by it.
    pub(crate) spans: AtomicU64,
    pub(crate) table_bytes: AtomicU64,
    /// Frontends the device's server has accepted (after their first
    /// message passed its checks); the serving layer counts them here so
    /// that a supervisor sees them without asking.
    pub connections: AtomicU64,
    /// Request latencies, by [`Op`]: the serving layer measures them, the
    /// store keeps them with the device's other counters.
    pub(crate) latency: [Latency; 3],
    pub(crate) counters: [Counters; MAX_SHARDS],
    // Added after the shard counters so older stats files keep their layout
    // (a shorter file is grown with zeros).
    pub(crate) spills: AtomicU64,
    /// Where a migration of the device stands; kept here so that an
    /// incoming device stays incoming across a worker's or daemon's restart.
    pub migration: MigrationCells,
    /// Request latencies, one set per queue (modulo): queue threads that
    /// shared one set bounced its cache lines between cores on every
    /// request. `latency` above is what older files recorded.
    shard_latency: [ShardLatency; LATENCY_SHARDS],
    /// What an operator asked of a send under way (an [`Ask`]):
    /// `vzram migrate --commit` (the VM has moved, for a VMM that keeps its
    /// source process) or `--cancel` (the VMM's migration was called off).
    /// Read by the sender.
    pub(crate) migration_commit: AtomicU64,
    /// Pages the compress pool's threads compressed or decompressed for
    /// this device (those its queue threads did themselves are not
    /// counted): whether the pool is doing anything.
    pub pool_pages: AtomicU64,
    /// Raw staging: bytes of pages stored raw and not compressed yet (a
    /// gauge recovery recounts), pages the background compressed, and how
    /// long they waited staged (sum and longest, in microseconds).
    pub(crate) staged_bytes: AtomicU64,
    pub(crate) staged_compressed: AtomicU64,
    pub(crate) staged_wait_micros: AtomicU64,
    pub(crate) staged_wait_max_micros: AtomicU64,
}

/// What an operator asked of a send under way (kept in
/// [`DeviceCells::migration_commit`]).
#[repr(u64)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// Nothing.
    None = 0,
    /// Commit the move (`vzram migrate --commit`, after the last delta).
    Commit = 1,
    /// Call the move off, the VM runs here (`vzram migrate --cancel`).
    Cancel = 2,
}

impl Ask {
    fn of(v: u64) -> Ask {
        match v {
            1 => Ask::Commit,
            2 => Ask::Cancel,
            _ => Ask::None,
        }
    }
}

impl DeviceCells {
    /// What the operator asked of the send under way.
    pub fn ask(&self) -> Ask {
        Ask::of(self.migration_commit.load(SeqCst))
    }

    /// Records an operator's ask for the sender.
    pub fn set_ask(&self, a: Ask) {
        self.migration_commit.store(a as u64, SeqCst);
    }

    /// Forgets an ask to commit (one given before the last delta, or for
    /// an earlier send); a cancel stays.
    pub fn forget_commit(&self) {
        let _ = self.migration_commit.compare_exchange(
            Ask::Commit as u64,
            Ask::None as u64,
            SeqCst,
            SeqCst,
        );
    }
}

/// Latency sets kept apart.
pub const LATENCY_SHARDS: usize = 8;

#[repr(C, align(128))]
struct ShardLatency([Latency; 3]);

/// A migration's state and progress, shared by the process that moves the
/// pages and the supervisor that shows them.
#[repr(C)]
#[derive(Default)]
pub struct MigrationCells {
    /// A [`Phase`], as its number (read and set through its methods).
    pub(crate) state: AtomicU64,
    pub bytes: AtomicU64,
    pub records: AtomicU64,
    pub pass: AtomicU64,
    /// Slots written since the current pass began (sending only).
    pub dirty: AtomicU64,
    /// The last finished send: its last delta (quiet to confirmed) and all of it.
    pub final_micros: AtomicU64,
    pub total_micros: AtomicU64,
}

/// Where a transfer stands, for whoever shows progress.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    pub bytes: u64,
    pub records: u64,
    pub pass: u32,
    /// Slots written since the pass began (source only).
    pub dirty: u64,
}

/// Where a device stands in a migration; kept in the shared cells (as its
/// number) so that it survives a worker's or the daemon's restart. The
/// events that move it, and who moves it, are in ARCHITECTURE.md
/// ("Migration states").
#[repr(u64)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// No migration, or the last one is over.
    None = 0,
    /// Incoming: waiting for a stream; requests wait.
    Incoming = 1,
    /// Incoming: a stream is arriving; requests wait.
    Receiving = 2,
    /// Incoming: the last stream failed; requests wait for another.
    Failed = 3,
    /// Sending to another daemon: pre-copy and the last delta.
    Sending = 4,
    /// Sent and confirmed; the pages here were dropped.
    Sent = 5,
    /// The last send failed or was called off; the device kept its pages.
    SendFailed = 6,
    /// Incoming: received and committed; it serves, and no later stream
    /// is taken (a restart does not make it incoming again).
    Received = 7,
    /// Incoming: every page is here and checked, waiting for the source
    /// to commit; requests wait.
    Prepared = 8,
    /// Sent with `--keep` and committed: the pages are here too.
    Copied = 9,
    /// Sending: the destination holds every page; waiting for proof that
    /// the VM runs there (its rings started) or an operator's commit.
    Committing = 10,
}

impl Phase {
    fn of(v: u64) -> Phase {
        match v {
            1 => Phase::Incoming,
            2 => Phase::Receiving,
            3 => Phase::Failed,
            4 => Phase::Sending,
            5 => Phase::Sent,
            6 => Phase::SendFailed,
            7 => Phase::Received,
            8 => Phase::Prepared,
            9 => Phase::Copied,
            10 => Phase::Committing,
            _ => Phase::None,
        }
    }

    /// Whether requests must wait: the device waits for its pages.
    pub fn incoming(self) -> bool {
        matches!(
            self,
            Phase::Incoming | Phase::Receiving | Phase::Prepared | Phase::Failed
        )
    }

    /// Whether a send is under way (any phase).
    pub fn sending(self) -> bool {
        matches!(self, Phase::Sending | Phase::Committing)
    }

    pub fn name(self) -> &'static str {
        match self {
            Phase::None => "none",
            Phase::Incoming => "incoming",
            Phase::Receiving => "receiving",
            Phase::Failed => "failed",
            Phase::Sending => "sending",
            Phase::Sent => "sent",
            Phase::SendFailed => "send-failed",
            Phase::Received => "received",
            Phase::Prepared => "prepared",
            Phase::Copied => "copied",
            Phase::Committing => "committing",
        }
    }
}

impl MigrationCells {
    /// The device's migration phase.
    pub fn phase(&self) -> Phase {
        Phase::of(self.state.load(SeqCst))
    }

    /// Moves the device to `p`.
    pub fn set(&self, p: Phase) {
        self.state.store(p as u64, SeqCst);
    }

    /// Moves the device from one of `from` to `to`; whether it did.
    pub fn shift(&self, from: &[Phase], to: Phase) -> bool {
        self.state
            .fetch_update(SeqCst, SeqCst, |v| {
                from.contains(&Phase::of(v)).then_some(to as u64)
            })
            .is_ok()
    }

    /// Whether requests must wait: the device waits for its pages.
    pub fn incoming(&self) -> bool {
        self.phase().incoming()
    }

    /// Whether a send is under way (any phase).
    pub fn sending(&self) -> bool {
        self.phase().sending()
    }

    pub fn state_name(&self) -> &'static str {
        self.phase().name()
    }

    /// Publishes a transfer's progress.
    pub fn progress(&self, p: Progress) {
        self.bytes.store(p.bytes, Relaxed);
        self.records.store(p.records, Relaxed);
        self.pass.store(u64::from(p.pass), Relaxed);
        self.dirty.store(p.dirty, Relaxed);
    }

    /// Starts a transfer in `p`, its progress at zero.
    pub fn begin(&self, p: Phase) {
        for c in [&self.bytes, &self.records, &self.pass, &self.dirty] {
            c.store(0, Relaxed);
        }
        self.set(p);
    }
}

impl DeviceCells {
    /// The device's statistics as last published, for a process that does
    /// not map the device itself.
    pub fn stats(&self, size_bytes: u64) -> DeviceStats {
        let mut s = DeviceStats::default();
        stats::sum(&self.counters, &mut s);
        s.mem_used_total = self.budget.used();
        s.mem_used_max = self.budget.max();
        s.mem_limit = self.budget.limit();
        s.table_bytes = self.table_bytes.load(Relaxed);
        s.meta_bytes = s.table_bytes
            + self.spans.load(Relaxed)
                * std::mem::size_of::<crate::pool::arena::SpanHeader>() as u64;
        s.size_bytes = size_bytes;
        s.spills = self.spills.load(Relaxed);
        s.pool_pages = self.pool_pages.load(Relaxed);
        s.staged_bytes = self.staged_bytes.load(Relaxed);
        s.staged_compressed = self.staged_compressed.load(Relaxed);
        s.staged_wait_micros = self.staged_wait_micros.load(Relaxed);
        s.staged_wait_max_micros = self.staged_wait_max_micros.load(Relaxed);
        s
    }

    /// Zeroes the event counters and latencies (reads, writes, discards,
    /// failures, compactions, backing-file traffic, recompressions,
    /// spills), as zram's reset does; the gauges describe what is stored
    /// and stay. For `vzram reset`, once the device is empty.
    pub fn zero_counters(&self) {
        for c in &self.counters {
            for a in [
                &c.reads,
                &c.writes,
                &c.discards,
                &c.failed_reads,
                &c.failed_writes,
                &c.limit_hits,
                &c.pages_compacted,
                &c.backed_reads,
                &c.backed_writes,
                &c.recompressed,
                &c.recompress_saved,
            ] {
                a.store(0, Relaxed);
            }
        }
        self.spills.store(0, Relaxed);
        self.pool_pages.store(0, Relaxed);
        self.staged_compressed.store(0, Relaxed);
        self.staged_wait_micros.store(0, Relaxed);
        self.staged_wait_max_micros.store(0, Relaxed);
        for l in self
            .latency
            .iter()
            .chain(self.shard_latency.iter().flat_map(|s| &s.0))
        {
            l.clear();
        }
    }

    /// Records one request's latency for queue (or store shard) `queue`.
    #[inline]
    pub fn record(&self, op: Op, queue: usize, d: std::time::Duration) {
        self.shard_latency[queue % LATENCY_SHARDS].0[op as usize].record(d);
    }

    /// Request latencies, by operation, all queues together.
    pub fn latencies(&self) -> Vec<(Op, LatencySnapshot)> {
        Op::ALL
            .iter()
            .map(|&op| {
                let mut s = self.latency[op as usize].snapshot();
                for sh in &self.shard_latency {
                    s.add(&sh.0[op as usize].snapshot());
                }
                (op, s)
            })
            .collect()
    }

    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Gives back this device's charge to the host budget it is in, for a
    /// device removed for good.
    pub fn release(&self, host: &HostCells) {
        if self.charged_to.load(Relaxed) == host.id() {
            host.budget.uncharge(self.budget.used());
            host.staging.uncharge(self.staged_bytes.load(Relaxed));
            self.charged_to.store(0, Relaxed);
        }
    }
}

/// What a latency is recorded for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read = 0,
    Write = 1,
    /// Discard and write-zeroes.
    Discard = 2,
}

impl Op {
    pub const ALL: [Op; 3] = [Op::Read, Op::Write, Op::Discard];

    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Discard => "discard",
        }
    }
}

/// Histogram buckets: at most 1 µs, 2 µs, 4 µs, ... 2^22 µs (about 4 s),
/// and the rest.
pub const LATENCY_BUCKETS: usize = 24;

/// A latency histogram in shared memory: power-of-two buckets of
/// microseconds, the count and the sum. Each record is three relaxed adds.
#[repr(C)]
pub struct Latency {
    buckets: [AtomicU64; LATENCY_BUCKETS],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

/// A histogram read out: per-bucket counts (not cumulative) with their
/// upper bounds in seconds (the last is +Inf), the count and the sum.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LatencySnapshot {
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub sum_seconds: f64,
}

impl LatencySnapshot {
    /// Adds another set's counts (same buckets) to this one.
    fn add(&mut self, o: &LatencySnapshot) {
        for (b, ob) in self.buckets.iter_mut().zip(&o.buckets) {
            b.1 += ob.1;
        }
        self.count += o.count;
        self.sum_seconds += o.sum_seconds;
    }
}

impl Latency {
    #[inline]
    pub fn record(&self, d: std::time::Duration) {
        let ns = d.as_nanos().min(u128::from(u64::MAX)) as u64;
        let us = ns.div_ceil(1000).max(1);
        // Smallest k with us <= 2^k.
        let k = (64 - (us - 1).leading_zeros()) as usize;
        self.buckets[k.min(LATENCY_BUCKETS - 1)].fetch_add(1, Relaxed);
        self.count.fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    fn clear(&self) {
        for b in &self.buckets {
            b.store(0, Relaxed);
        }
        self.count.store(0, Relaxed);
        self.sum_ns.store(0, Relaxed);
    }

    pub(crate) fn snapshot(&self) -> LatencySnapshot {
        LatencySnapshot {
            buckets: self
                .buckets
                .iter()
                .enumerate()
                .map(|(k, b)| {
                    let bound = if k == LATENCY_BUCKETS - 1 {
                        f64::INFINITY
                    } else {
                        (1u64 << k) as f64 * 1e-6
                    };
                    (bound, b.load(Relaxed))
                })
                .collect(),
            count: self.count.load(Relaxed),
            sum_seconds: self.sum_ns.load(Relaxed) as f64 * 1e-9,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn latency_buckets() {
        let cells = Cells::<DeviceCells>::private().unwrap();
        let h = &cells.latency[Op::Write as usize];
        for us in [0, 1, 2, 3, 1000, 5_000_000_000] {
            h.record(Duration::from_micros(us));
        }
        let s = h.snapshot();
        assert_eq!(s.count, 6);
        let at = |bound: f64| s.buckets.iter().find(|b| b.0 == bound).unwrap().1;
        assert_eq!(at(1e-6), 2); // 0 and 1 us
        assert_eq!(at(2e-6), 1);
        assert_eq!(at(4e-6), 1); // 3 us
        assert_eq!(at(1024e-6), 1); // 1000 us
        assert_eq!(s.buckets.last().unwrap(), &(f64::INFINITY, 1));
        assert!((s.sum_seconds - (1006e-6 + 5e9 * 1e-6)).abs() < 1e-6);
    }
}
