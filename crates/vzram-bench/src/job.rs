//! What a run does: the job kind, its geometry, and the per-queue offset generator.

use crate::error::{bail, Result};
use crate::rng::Rng;
use crate::units::format_size;
use serde::Serialize;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    Randread,
    Randwrite,
    /// 70% reads, 30% writes, random offsets.
    Randrw,
    Read,
    Write,
    /// Write the whole region once, sequentially; measures fill speed and memory.
    Fill,
}

impl JobKind {
    pub fn name(self) -> &'static str {
        match self {
            JobKind::Randread => "randread",
            JobKind::Randwrite => "randwrite",
            JobKind::Randrw => "randrw",
            JobKind::Read => "read",
            JobKind::Write => "write",
            JobKind::Fill => "fill",
        }
    }

    pub fn reads(self) -> bool {
        matches!(self, JobKind::Randread | JobKind::Randrw | JobKind::Read)
    }

    fn read_pct(self) -> u64 {
        match self {
            JobKind::Randread | JobKind::Read => 100,
            JobKind::Randrw => 70,
            _ => 0,
        }
    }

    fn random(self) -> bool {
        matches!(
            self,
            JobKind::Randread | JobKind::Randwrite | JobKind::Randrw
        )
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct JobSpec {
    pub kind: JobKind,
    pub bs: u64,
    pub iodepth: u32,
    pub queues: u32,
    pub size: u64,
    pub runtime_s: f64,
    pub ramp_s: f64,
    pub prefill: bool,
    pub verify: bool,
    pub poll: bool,
    /// Wait after each completion before submitting again (µs).
    pub think_us: u64,
    /// Wait after the job before measuring memory (s).
    pub settle_s: f64,
}

impl JobSpec {
    pub fn validate(&self) -> Result<()> {
        if self.bs < 4096 || !self.bs.is_multiple_of(4096) {
            bail!("--bs {} must be a multiple of 4K", self.bs);
        }
        if self.iodepth == 0 || self.iodepth > 1024 {
            bail!("--iodepth {} must be in 1..=1024", self.iodepth);
        }
        if self.queues == 0 || self.queues > 256 {
            bail!("--queues {} must be in 1..=256", self.queues);
        }
        if !self.size.is_multiple_of(self.bs) || self.size / self.bs < self.queues as u64 {
            bail!(
                "--size {} must be a multiple of --bs {} with at least one block per queue",
                self.size,
                self.bs
            );
        }
        if !(0.0..=3600.0).contains(&self.settle_s) {
            bail!("--settle {} must be in 0..=3600 seconds", self.settle_s);
        }
        if self.kind != JobKind::Fill && self.runtime_s <= 0.0 {
            bail!("--runtime must be > 0");
        }
        Ok(())
    }

    pub fn runtime(&self) -> Duration {
        Duration::from_secs_f64(self.runtime_s)
    }

    pub fn ramp(&self) -> Duration {
        Duration::from_secs_f64(self.ramp_s)
    }

    /// Byte range `[start, start+len)` owned by queue `q`: queues split the region so
    /// that sequential jobs stay sequential and writers never overlap.
    pub fn slice(&self, q: u32) -> (u64, u64) {
        let blocks = self.size / self.bs;
        let per = blocks / self.queues as u64;
        let start = per * q as u64;
        let n = if q + 1 == self.queues {
            blocks - start
        } else {
            per
        };
        (start * self.bs, n * self.bs)
    }

    /// Short config key used to group and compare runs: "randread 4K qd32
    /// q1", with " think100us" when the queues wait between requests.
    pub fn key(&self) -> String {
        config_key(
            self.kind.name(),
            self.bs,
            self.iodepth,
            self.queues,
            self.think_us,
        )
    }
}

/// "randread 4K qd32 q1", with " think100us" for a job that waits between
/// requests.
pub fn config_key(job: &str, bs: u64, iodepth: u32, queues: u32, think_us: u64) -> String {
    let think = if think_us > 0 {
        format!(" think{think_us}us")
    } else {
        String::new()
    };
    format!("{job} {} qd{iodepth} q{queues}{think}", format_size(bs))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

#[derive(Clone, Copy, Debug)]
pub struct Op {
    pub dir: Dir,
    pub offset: u64,
    pub len: usize,
}

/// Produces the operations of one queue.
pub struct OpGen {
    rng: Rng,
    read_pct: u64,
    random: bool,
    start: u64,
    len: u64,
    bs: u64,
    cursor: u64,
    /// Sequential write of the slice exactly once (prefill / fill).
    once: bool,
}

impl OpGen {
    pub fn for_job(job: &JobSpec, queue: u32, seed: u64) -> Self {
        let (start, len) = job.slice(queue);
        OpGen {
            rng: Rng::new(seed ^ (queue as u64).wrapping_mul(0x9E37_79B9)),
            read_pct: job.kind.read_pct(),
            random: job.kind.random(),
            start,
            len,
            bs: job.bs,
            cursor: 0,
            once: job.kind == JobKind::Fill,
        }
    }

    /// Write `[start, start+len)` once in `chunk`-sized pieces.
    pub fn fill_once(start: u64, len: u64, chunk: u64) -> Self {
        OpGen {
            rng: Rng::new(0),
            read_pct: 0,
            random: false,
            start,
            len,
            bs: chunk,
            cursor: 0,
            once: true,
        }
    }

    #[inline]
    pub fn next_op(&mut self) -> Option<Op> {
        let dir = if self.read_pct == 100 || (self.read_pct > 0 && self.rng.percent(self.read_pct))
        {
            Dir::Read
        } else {
            Dir::Write
        };
        if self.random {
            let blocks = self.len / self.bs;
            let offset = self.start + self.rng.below(blocks) * self.bs;
            return Some(Op {
                dir,
                offset,
                len: self.bs as usize,
            });
        }
        if self.cursor >= self.len {
            if self.once {
                return None;
            }
            self.cursor = 0;
        }
        let len = self.bs.min(self.len - self.cursor);
        let op = Op {
            dir,
            offset: self.start + self.cursor,
            len: len as usize,
        };
        self.cursor += len;
        Some(op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(kind: JobKind, queues: u32) -> JobSpec {
        JobSpec {
            kind,
            bs: 8192,
            iodepth: 4,
            queues,
            size: 1 << 20,
            runtime_s: 1.0,
            ramp_s: 0.0,
            prefill: false,
            verify: false,
            poll: false,
            think_us: 0,
            settle_s: 0.0,
        }
    }

    #[test]
    fn slices_cover_region_without_overlap() {
        let mut j = job(JobKind::Read, 3);
        j.size = 8192 * 10;
        let s: Vec<_> = (0..3).map(|q| j.slice(q)).collect();
        assert_eq!(
            s,
            vec![(0, 3 * 8192), (3 * 8192, 3 * 8192), (6 * 8192, 4 * 8192)]
        );
    }

    #[test]
    fn random_ops_stay_in_slice_and_mix_70_30() {
        let j = job(JobKind::Randrw, 2);
        let (start, len) = j.slice(1);
        let mut g = OpGen::for_job(&j, 1, 42);
        let mut reads = 0;
        for _ in 0..10_000 {
            let op = g.next_op().unwrap();
            assert!(op.offset >= start && op.offset + op.len as u64 <= start + len);
            assert_eq!(op.offset % j.bs, 0);
            reads += (op.dir == Dir::Read) as u32;
        }
        assert!((6_700..7_300).contains(&reads), "reads {reads}");
    }

    #[test]
    fn fill_once_ends_with_short_chunk() {
        let mut g = OpGen::fill_once(4096, 3 * 4096, 8192);
        let a = g.next_op().unwrap();
        let b = g.next_op().unwrap();
        assert_eq!((a.offset, a.len, a.dir), (4096, 8192, Dir::Write));
        assert_eq!((b.offset, b.len), (3 * 4096, 4096));
        assert!(g.next_op().is_none());
    }

    #[test]
    fn sequential_wraps() {
        let mut j = job(JobKind::Read, 1);
        j.size = 2 * 8192;
        let mut g = OpGen::for_job(&j, 0, 1);
        let offs: Vec<_> = (0..3).map(|_| g.next_op().unwrap().offset).collect();
        assert_eq!(offs, vec![0, 8192, 0]);
    }
}
