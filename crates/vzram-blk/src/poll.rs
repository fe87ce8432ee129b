//! Adaptive polling of a queue's avail ring once it has run dry.
//!
//! A queue thread that sleeps as soon as its ring is empty pays a wake-up
//! (the guest's kick, an eventfd, a task switch) for nearly every batch: at
//! QD32 the guest submits again a few microseconds after its completions.
//! So after a pass that did work, the thread watches the avail index for a
//! short window before it sleeps: at most 32 µs (QEMU's iothread default),
//! or as long as the pass itself worked, whichever is longer, and never
//! more than the maximum. Polling thus costs a busy queue at most what its
//! work does, and a guest that answers a batch of 32 completions within a
//! batch's time is caught without a kick. The window also adapts, as
//! QEMU's does: it doubles when the thread was woken again within that
//! limit of giving up (a longer poll would have caught the request), and
//! halves when it slept longer, so a guest whose requests come further
//! apart than the limit soon stops being polled. An idle queue never
//! polls: only a pass that took requests starts a poll.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use virtio_queue::QueueT;
use vm_memory::GuestMemory;

/// The default maximum window (`--poll-us`), reached only after a pass
/// that worked that long (a batch of about 30 writes).
pub const DEFAULT_POLL: Duration = Duration::from_micros(200);
/// How long any pass may poll, however short its work: QEMU's
/// `poll-max-ns`, which is what a guest on qemu-storage-daemon gets.
pub const BASE_POLL: Duration = Duration::from_micros(32);
/// The smallest window a growing one starts from.
const MIN_WINDOW: Duration = Duration::from_micros(2);

/// One queue's polling state; lives in its scratch space.
#[derive(Debug, Clone)]
pub struct Poller {
    max: Duration,
    window: Duration,
    /// When the last poll gave up (the thread then went to sleep), and the
    /// longest that poll could have lasted with the full window.
    gave_up: Option<(Instant, Duration)>,
}

impl Poller {
    /// `max` zero: never poll.
    pub fn new(max: Duration) -> Poller {
        Poller {
            max,
            window: max,
            gave_up: None,
        }
    }

    pub fn window(&self) -> Duration {
        self.window
    }

    /// Called when the queue is kicked: how long it slept since its last
    /// poll gave up sets the next window.
    pub fn woke(&mut self) {
        let Some((t, cap)) = self.gave_up.take() else {
            return;
        };
        if self.max.is_zero() {
            return;
        }
        self.window = if t.elapsed() <= cap {
            (self.window * 2).clamp(MIN_WINDOW, self.max)
        } else if self.window < MIN_WINDOW {
            Duration::ZERO
        } else {
            self.window / 2
        };
    }

    /// How long a poll after a pass that worked for `worked` may last.
    pub fn limit(&self, worked: Duration) -> Duration {
        self.window.min(Self::cap(self.max, worked))
    }

    /// The longest poll a pass that worked for `worked` earns.
    fn cap(max: Duration, worked: Duration) -> Duration {
        worked.max(BASE_POLL).min(max)
    }

    /// Watches `q`'s avail index for up to [`Poller::limit`]. True as soon
    /// as a new request is there (the caller drains again); false when the
    /// time passed (or is zero), and the caller goes to sleep.
    pub fn poll<Q: QueueT, M: GuestMemory>(&mut self, q: &Q, mem: &M, worked: Duration) -> bool {
        let limit = self.limit(worked);
        if !limit.is_zero() {
            let end = Instant::now() + limit;
            loop {
                match q.avail_idx(mem, Ordering::Acquire) {
                    Ok(i) if i.0 != q.next_avail() => return true,
                    Ok(_) => {}
                    // A ring we cannot read: the drain reports it.
                    Err(_) => break,
                }
                // A clock read costs more than a look at the index.
                for _ in 0..16 {
                    std::hint::spin_loop();
                }
                if Instant::now() >= end {
                    break;
                }
            }
        }
        self.gave_up = Some((Instant::now(), Self::cap(self.max, worked)));
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap()
    }

    #[test]
    fn an_empty_ring_is_watched_for_the_window_then_given_up() {
        let m = mem();
        let mq = MockSplitQueue::new(&m, 16);
        let q = mq.create_queue::<virtio_queue::Queue>().unwrap();
        let mut p = Poller::new(Duration::from_millis(20));
        // After a pass that worked 50 ms: the whole 20 ms window.
        let t = Instant::now();
        assert!(!p.poll(&q, &m, Duration::from_millis(50)));
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(20), "gave up after {took:?}");
        // After a short pass: the base window, not the whole maximum.
        assert_eq!(p.limit(Duration::from_micros(5)), BASE_POLL);
        assert_eq!(p.limit(Duration::from_millis(5)), Duration::from_millis(5));
    }

    #[test]
    fn a_new_request_ends_the_poll_at_once() {
        let m = mem();
        let mq = MockSplitQueue::new(&m, 16);
        let q = mq.create_queue::<virtio_queue::Queue>().unwrap();
        mq.avail().idx().store(u16::to_le(1));
        let mut p = Poller::new(Duration::from_secs(10));
        let t = Instant::now();
        assert!(p.poll(&q, &m, Duration::ZERO));
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn the_window_shrinks_for_a_quiet_queue_and_grows_for_a_busy_one() {
        let m = mem();
        let mq = MockSplitQueue::new(&m, 16);
        let q = mq.create_queue::<virtio_queue::Queue>().unwrap();
        let max = Duration::from_millis(5);
        let mut p = Poller::new(max);
        // Kicked long after each poll gave up: halves down to nothing.
        for _ in 0..16 {
            assert!(!p.poll(&q, &m, Duration::ZERO));
            std::thread::sleep(Duration::from_millis(20));
            p.woke();
        }
        assert_eq!(p.window(), Duration::ZERO);
        // A zero window does not spin.
        let t = Instant::now();
        assert!(!p.poll(&q, &m, Duration::ZERO));
        assert!(t.elapsed() < Duration::from_millis(5));
        // Kicked right after giving up, after passes that worked longer than
        // the maximum: grows back to it.
        for _ in 0..16 {
            p.woke();
            assert!(!p.poll(&q, &m, max * 2));
        }
        p.woke();
        assert_eq!(p.window(), max);
        // Kicked 1 ms after giving up, after short passes (a base limit of
        // 32 µs): a request every millisecond is not worth polling for.
        for _ in 0..16 {
            assert!(!p.poll(&q, &m, Duration::from_micros(5)));
            std::thread::sleep(Duration::from_millis(1));
            p.woke();
        }
        assert_eq!(p.window(), Duration::ZERO);
        // Off: never polls, never grows.
        let mut off = Poller::new(Duration::ZERO);
        assert!(!off.poll(&q, &m, Duration::ZERO));
        off.woke();
        assert_eq!(off.window(), Duration::ZERO);
    }
}
