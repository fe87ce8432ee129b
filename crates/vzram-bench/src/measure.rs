//! The measurement window shared by all workers of a run, and what each worker counts.

use crate::hist::Histogram;
use std::time::{Duration, Instant};

/// Absolute instants, identical for every worker (and the main thread, which samples
/// the daemon's CPU and memory at the same instants).
#[derive(Clone, Copy, Debug)]
pub struct Window {
    pub ramp_end: Instant,
    /// `None`: run until the op generator is exhausted (prefill/fill).
    pub end: Option<Instant>,
}

impl Window {
    pub fn timed(start: Instant, ramp: Duration, runtime: Duration) -> Self {
        Window {
            ramp_end: start + ramp,
            end: Some(start + ramp + runtime),
        }
    }

    pub fn exhaust(start: Instant) -> Self {
        Window {
            ramp_end: start,
            end: None,
        }
    }

    /// The window a job measures in: a fill runs until its region is
    /// written, every other job for its ramp plus runtime.
    pub fn for_job(job: &crate::job::JobSpec, start: Instant) -> Self {
        if job.kind == crate::job::JobKind::Fill {
            Window::exhaust(start)
        } else {
            Window::timed(start, job.ramp(), job.runtime())
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct WorkerStats {
    pub ios: u64,
    pub reads: u64,
    pub writes: u64,
    pub bytes: u64,
    pub hist: Histogram,
    /// Measured wall time: from the window's start (end of ramp) to the last counted
    /// completion batch.
    pub wall: Duration,
    pub cpu: Duration,
    pub verify_errors: u64,
}

/// Tracks which phase a worker is in and snapshots its CPU clock at the edges.
pub struct Phase {
    window: Window,
    measuring: bool,
    stopped: bool,
    t0: Instant,
    cpu0: Duration,
}

impl Phase {
    pub fn new(window: Window) -> Self {
        let now = Instant::now();
        Phase {
            window,
            measuring: false,
            stopped: false,
            t0: window.ramp_end.min(now),
            cpu0: crate::sys::thread_cpu(),
        }
        .tick_start(now)
    }

    fn tick_start(mut self, now: Instant) -> Self {
        if now >= self.window.ramp_end {
            self.measuring = true;
        }
        self
    }

    /// Call at each completion batch. Returns whether this batch is counted.
    /// On entering the window, the stats are reset so the ramp is not counted.
    #[inline]
    pub fn tick(&mut self, now: Instant, stats: &mut WorkerStats) -> bool {
        if self.stopped {
            return false;
        }
        if !self.measuring {
            if now < self.window.ramp_end {
                return false;
            }
            self.measuring = true;
            // The window opened at ramp_end, not at this (possibly late) batch: a
            // worker that was descheduled must not divide its few completions by a
            // sliver of time.
            self.t0 = self.window.ramp_end;
            self.cpu0 = crate::sys::thread_cpu();
            *stats = WorkerStats::default();
        }
        if let Some(end) = self.window.end {
            if now >= end || crate::sys::interrupted() {
                self.finish(now, stats);
            }
        }
        true
    }

    /// Whether new operations may still be submitted.
    pub fn submitting(&self) -> bool {
        !self.stopped && !crate::sys::interrupted()
    }

    /// Close the window at `now` (also used when the generator runs dry).
    pub fn finish(&mut self, now: Instant, stats: &mut WorkerStats) {
        if !self.stopped {
            self.stopped = true;
            stats.wall = now.saturating_duration_since(self.t0);
            stats.cpu = crate::sys::thread_cpu().saturating_sub(self.cpu0);
        }
    }
}

/// Sum of all workers of one run.
#[derive(Clone, Debug, Default)]
pub struct Totals {
    pub ios: u64,
    pub reads: u64,
    pub writes: u64,
    pub bytes: u64,
    pub iops: f64,
    pub bytes_per_s: f64,
    pub hist: Histogram,
    pub wall: Duration,
    pub cpu: Duration,
    pub verify_errors: u64,
}

impl Totals {
    pub fn add(&mut self, w: &WorkerStats) {
        self.ios += w.ios;
        self.reads += w.reads;
        self.writes += w.writes;
        self.bytes += w.bytes;
        let secs = w.wall.as_secs_f64();
        if secs > 0.0 {
            // Per-worker rates, summed: workers' windows differ by a batch at most.
            self.iops += w.ios as f64 / secs;
            self.bytes_per_s += w.bytes as f64 / secs;
        }
        self.hist.merge(&w.hist);
        self.wall = self.wall.max(w.wall);
        self.cpu += w.cpu;
        self.verify_errors += w.verify_errors;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn late_first_batch_counts_from_window_start() {
        let start = Instant::now() - Duration::from_millis(50);
        let w = Window::timed(start, Duration::from_millis(10), Duration::from_millis(20));
        let mut st = WorkerStats::default();
        let mut p = Phase::new(w);
        // First batch seen only after the window closed: counted, window closed.
        assert!(p.tick(Instant::now(), &mut st));
        assert!(!p.submitting());
        assert!(st.wall >= Duration::from_millis(40), "{:?}", st.wall);
        assert!(!p.tick(Instant::now(), &mut st));
    }
}
