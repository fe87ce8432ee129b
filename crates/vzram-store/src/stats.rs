//! Counters in the shape of zram's `mm_stat` and `io_stat`. Each shard of a
//! device counts on its own cache line, so queue threads never share one.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

/// Per-device statistics (zram `mm_stat` fields, then `io_stat`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStats {
    pub orig_data_size: u64,
    pub compr_data_size: u64,
    pub mem_used_total: u64,
    pub mem_limit: u64,
    pub mem_used_max: u64,
    pub same_pages: u64,
    pub pages_compacted: u64,
    pub huge_pages: u64,
    pub failed_reads: u64,
    pub failed_writes: u64,
    /// Writes refused because the device or host memory limit was reached.
    pub limit_hits: u64,
    pub reads: u64,
    pub writes: u64,
    pub discards: u64,
    /// Pages in the backing file (zram `bd_stat` `bd_count`, in pages).
    pub backed_pages: u64,
    /// Pages read from and written to the backing file (`bd_reads`, `bd_writes`).
    pub backed_reads: u64,
    pub backed_writes: u64,
    /// Times a write found a limit reached and moved cold pages out.
    pub spills: u64,
    /// Pages a second codec made smaller, and the bytes that saved.
    pub pages_recompressed: u64,
    pub recompress_saved_bytes: u64,
    /// Bytes of slot table currently backed by RAM.
    pub table_bytes: u64,
    /// All metadata outside the pool: resident table plus span headers.
    pub meta_bytes: u64,
    pub size_bytes: u64,
    /// Pages the compress pool's threads compressed or decompressed (not
    /// those the queue threads did): read by a client of any version.
    #[serde(default)]
    pub pool_pages: u64,
    /// Raw staging: bytes stored raw waiting to be compressed, pages the
    /// background compressed, and the time they waited staged (total and
    /// longest, microseconds). Huge pages include the staged ones.
    #[serde(default)]
    pub staged_bytes: u64,
    #[serde(default)]
    pub staged_compressed: u64,
    #[serde(default)]
    pub staged_wait_micros: u64,
    #[serde(default)]
    pub staged_wait_max_micros: u64,
}

/// Whole-pool statistics: the device fields summed, with the host budget.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStats {
    pub devices: u64,
    pub orig_data_size: u64,
    pub compr_data_size: u64,
    pub mem_used_total: u64,
    pub mem_limit: u64,
    pub mem_used_max: u64,
    pub same_pages: u64,
    pub pages_compacted: u64,
    pub huge_pages: u64,
    pub failed_reads: u64,
    pub failed_writes: u64,
    pub limit_hits: u64,
    pub reads: u64,
    pub writes: u64,
    pub discards: u64,
    pub backed_pages: u64,
    pub backed_reads: u64,
    pub backed_writes: u64,
    pub spills: u64,
    pub pages_recompressed: u64,
    pub recompress_saved_bytes: u64,
    pub table_bytes: u64,
    pub meta_bytes: u64,
    #[serde(default)]
    pub pool_pages: u64,
    #[serde(default)]
    pub staged_bytes: u64,
    #[serde(default)]
    pub staged_compressed: u64,
    #[serde(default)]
    pub staged_wait_micros: u64,
    #[serde(default)]
    pub staged_wait_max_micros: u64,
    /// The host's staging budget and what it holds: the devices' staged
    /// bytes as the budget counts them (`staged_bytes` adds up the devices'
    /// own counts; the two differ only while a page is staged or released).
    #[serde(default)]
    pub staging_limit: u64,
    #[serde(default)]
    pub staging_used: u64,
}

// Exactly one 128-byte line per shard: the stats file's layout depends on it.
#[derive(Default)]
#[repr(C, align(128))]
pub(crate) struct Counters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub discards: AtomicU64,
    pub failed_reads: AtomicU64,
    pub failed_writes: AtomicU64,
    pub limit_hits: AtomicU64,
    pub pages_compacted: AtomicU64,
    pub backed_reads: AtomicU64,
    pub backed_writes: AtomicU64,
    pub recompressed: AtomicU64,
    pub recompress_saved: AtomicU64,
    // Gauges move both ways; a shard may go negative when another shard
    // stored what this one frees. Only the sum means anything.
    pub stored: AtomicI64,
    pub compr: AtomicI64,
    pub same: AtomicI64,
    pub huge: AtomicI64,
    pub backed: AtomicI64,
}

const _: () = assert!(std::mem::size_of::<Counters>() == 128);

/// A slot's contribution to the gauges.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Footprint {
    pub stored: i64,
    pub compr: i64,
    pub same: i64,
    pub huge: i64,
    pub backed: i64,
}

impl Counters {
    /// Counts a failed write, and whether a memory limit refused it.
    pub fn failed_write(&self, e: &crate::StoreError) {
        self.failed_writes.fetch_add(1, Relaxed);
        if matches!(
            e,
            crate::StoreError::DeviceLimit | crate::StoreError::HostLimit
        ) {
            self.limit_hits.fetch_add(1, Relaxed);
        }
    }

    /// Zeroes the gauges, which recovery recomputes; counts stay.
    pub fn clear_gauges(&self) {
        for g in [
            &self.stored,
            &self.compr,
            &self.same,
            &self.huge,
            &self.backed,
        ] {
            g.store(0, Relaxed);
        }
    }

    pub fn apply(&self, old: Footprint, new: Footprint) {
        for (g, d) in [
            (&self.stored, new.stored - old.stored),
            (&self.compr, new.compr - old.compr),
            (&self.same, new.same - old.same),
            (&self.huge, new.huge - old.huge),
            (&self.backed, new.backed - old.backed),
        ] {
            if d != 0 {
                g.fetch_add(d, Relaxed);
            }
        }
    }
}

pub(crate) fn sum(shards: &[Counters], out: &mut DeviceStats) {
    let s = |f: fn(&Counters) -> &AtomicU64| shards.iter().map(|c| f(c).load(Relaxed)).sum::<u64>();
    let g = |f: fn(&Counters) -> &AtomicI64| {
        shards
            .iter()
            .map(|c| f(c).load(Relaxed))
            .sum::<i64>()
            .max(0) as u64
    };
    out.reads = s(|c| &c.reads);
    out.writes = s(|c| &c.writes);
    out.discards = s(|c| &c.discards);
    out.failed_reads = s(|c| &c.failed_reads);
    out.failed_writes = s(|c| &c.failed_writes);
    out.limit_hits = s(|c| &c.limit_hits);
    out.pages_compacted = s(|c| &c.pages_compacted);
    out.orig_data_size = g(|c| &c.stored) * crate::PAGE_SIZE as u64;
    out.compr_data_size = g(|c| &c.compr);
    out.same_pages = g(|c| &c.same);
    out.huge_pages = g(|c| &c.huge);
    out.backed_pages = g(|c| &c.backed);
    out.backed_reads = s(|c| &c.backed_reads);
    out.backed_writes = s(|c| &c.backed_writes);
    out.pages_recompressed = s(|c| &c.recompressed);
    out.recompress_saved_bytes = s(|c| &c.recompress_saved);
}

impl PoolStats {
    pub fn add(&mut self, d: &DeviceStats) {
        self.devices += 1;
        self.orig_data_size += d.orig_data_size;
        self.compr_data_size += d.compr_data_size;
        self.same_pages += d.same_pages;
        self.pages_compacted += d.pages_compacted;
        self.huge_pages += d.huge_pages;
        self.failed_reads += d.failed_reads;
        self.failed_writes += d.failed_writes;
        self.limit_hits += d.limit_hits;
        self.reads += d.reads;
        self.writes += d.writes;
        self.discards += d.discards;
        self.backed_pages += d.backed_pages;
        self.backed_reads += d.backed_reads;
        self.backed_writes += d.backed_writes;
        self.spills += d.spills;
        self.pages_recompressed += d.pages_recompressed;
        self.recompress_saved_bytes += d.recompress_saved_bytes;
        self.table_bytes += d.table_bytes;
        self.meta_bytes += d.meta_bytes;
        self.pool_pages += d.pool_pages;
        self.staged_bytes += d.staged_bytes;
        self.staged_compressed += d.staged_compressed;
        self.staged_wait_micros += d.staged_wait_micros;
        self.staged_wait_max_micros = self.staged_wait_max_micros.max(d.staged_wait_max_micros);
    }
}
