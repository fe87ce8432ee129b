//! Log-linear latency histogram (HDR-style): 64 linear sub-buckets per power of two,
//! so any recorded value is reported within ~1.6%. Fixed size (~30 KiB), O(1) record,
//! mergeable across worker threads. Values are nanoseconds.

const SUB_BITS: u32 = 6;
const SUB: u64 = 1 << SUB_BITS;
/// Enough buckets for the whole u64 range.
const BUCKETS: usize = ((64 - SUB_BITS as usize) + 1) * SUB as usize;

#[derive(Clone, Debug)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    sum: u128,
    min: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

#[inline]
fn index(v: u64) -> usize {
    if v < 2 * SUB {
        return v as usize;
    }
    let msb = 63 - v.leading_zeros();
    let shift = msb - SUB_BITS;
    ((shift as u64 + 1) * SUB + ((v >> shift) - SUB)) as usize
}

/// Smallest value that lands in bucket `i`, and the bucket's width.
fn bucket_range(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < 2 * SUB {
        return (i, 1);
    }
    let shift = i / SUB - 1;
    let low = (SUB + i % SUB) << shift;
    (low, 1 << shift)
}

impl Histogram {
    pub fn new() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
            sum: 0,
            min: u64::MAX,
            max: 0,
        }
    }

    #[inline]
    pub fn record(&mut self, v: u64) {
        self.counts[index(v)] += 1;
        self.total += 1;
        self.sum += v as u128;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.sum += other.sum;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }

    #[cfg(test)]
    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    pub fn mean(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.sum as f64 / self.total as f64
        }
    }

    /// Value at quantile `q` in [0, 1]: the midpoint of the bucket holding the
    /// ceil(q*n)-th smallest sample, clamped to the exact min/max seen.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let (low, width) = bucket_range(i);
                return (low + width / 2).clamp(self.min, self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous() {
        let mut expect = 0u64;
        for i in 0..BUCKETS - 1 {
            let (low, width) = bucket_range(i);
            assert_eq!(low, expect, "bucket {i}");
            assert_eq!(index(low), i);
            assert_eq!(index(low + width - 1), i);
            expect = low + width;
        }
        assert_eq!(index(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn percentiles_of_uniform_data() {
        let mut h = Histogram::new();
        for v in 1..=100_000u64 {
            h.record(v * 1000);
        }
        for (q, want) in [
            (0.5, 50_000_000.0),
            (0.99, 99_000_000.0),
            (0.999, 99_900_000.0),
        ] {
            let got = h.quantile(q) as f64;
            assert!(
                (got - want).abs() / want < 0.02,
                "q{q}: got {got}, want {want}"
            );
        }
        assert_eq!(h.quantile(1.0), 100_000_000);
        assert!((1000..=1016).contains(&h.quantile(0.0)));
        assert!((h.mean() - 50_000_500.0).abs() < 1.0);
    }

    #[test]
    fn exact_for_small_values_and_merge() {
        let mut a = Histogram::new();
        let mut b = Histogram::new();
        for _ in 0..90 {
            a.record(10);
        }
        for _ in 0..10 {
            b.record(100);
        }
        a.merge(&b);
        assert_eq!(a.count(), 100);
        assert_eq!(a.quantile(0.5), 10);
        assert_eq!(a.quantile(0.9), 10);
        assert_eq!(a.quantile(0.91), 100);
        assert_eq!(Histogram::new().quantile(0.5), 0);
    }
}
