//! A log line per interval, not per event: a guest can make a queue fail
//! as often as it likes, and the log must stay readable.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Lets one event through per interval and counts the rest.
pub(crate) struct RateLimit {
    start: Instant,
    interval: Duration,
    /// Nanoseconds since `start` before which events are only counted.
    next: AtomicU64,
    suppressed: AtomicU64,
}

impl RateLimit {
    pub(crate) fn new(interval: Duration) -> RateLimit {
        RateLimit {
            start: Instant::now(),
            interval,
            next: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Some(events suppressed since the last one let through), or None.
    pub(crate) fn allow(&self) -> Option<u64> {
        let now = self.start.elapsed().as_nanos() as u64;
        let next = self.next.load(Ordering::Relaxed);
        let later = now + self.interval.as_nanos() as u64;
        if now >= next
            && self
                .next
                .compare_exchange(next, later, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limit_lets_one_through_per_interval() {
        let r = RateLimit::new(Duration::from_secs(3600));
        assert_eq!(r.allow(), Some(0));
        for _ in 0..1000 {
            assert_eq!(r.allow(), None);
        }
        let r = RateLimit::new(Duration::ZERO);
        assert_eq!(r.allow(), Some(0));
        assert_eq!(r.allow(), Some(0));
    }
}
