//! Memory budgets: one per device and one for the whole pool. Both count
//! bytes of spans actually mapped, and both can change at runtime.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
#[repr(C)]
pub struct Budget {
    used: AtomicU64,
    max: AtomicU64,
    /// 0 means unlimited.
    limit: AtomicU64,
}

impl Budget {
    pub fn new(limit: u64) -> Budget {
        Budget {
            limit: AtomicU64::new(limit),
            ..Default::default()
        }
    }

    /// Charges `bytes`, or refuses (charging nothing) if that would pass the limit.
    /// A compare-and-swap loop, not add-then-undo: a refused charge never
    /// shows in `used`, so it cannot make a concurrent charge that fits fail,
    /// and `max` only ever sees values `used` really held.
    pub fn try_charge(&self, bytes: u64) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        let charged = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(bytes)
                    .filter(|&now| limit == 0 || now <= limit)
            });
        match charged {
            Ok(prev) => {
                self.max.fetch_max(prev + bytes, Ordering::Relaxed);
                true
            }
            Err(_) => false,
        }
    }

    /// Charges `bytes` whatever the limit: for memory already in use (a
    /// device recovered after a restart).
    pub fn force_charge(&self, bytes: u64) {
        let now = self.used.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.max.fetch_max(now, Ordering::Relaxed);
    }

    /// Saturates at zero: a budget shared between processes can be a span
    /// short after one of them was killed between its two charges.
    pub fn uncharge(&self, bytes: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                Some(u.saturating_sub(bytes))
            });
    }

    /// Sets what is in use outright, for a device whose use was just
    /// recomputed.
    pub(crate) fn reset_used(&self) {
        self.used.store(0, Ordering::Relaxed);
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub fn max(&self) -> u64 {
        self.max.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Lowering a limit below current use refuses new spans until use drops
    /// under it; nothing already stored is evicted.
    pub fn set_limit(&self, bytes: u64) {
        self.limit.store(bytes, Ordering::Relaxed);
    }

    /// Restarts `mem_used_max` from the current use (zram's `reset mem_used_max`).
    pub fn reset_max(&self) {
        self.max.store(self.used(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_refuses_and_keeps_accounting() {
        let b = Budget::new(100);
        assert!(b.try_charge(60));
        assert!(!b.try_charge(50));
        assert_eq!(b.used(), 60);
        assert!(b.try_charge(40));
        assert_eq!(b.max(), 100);
        b.uncharge(100);
        assert_eq!(b.used(), 0);
        b.set_limit(0);
        assert!(b.try_charge(1 << 40));
    }
}
