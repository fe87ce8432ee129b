//! What a device's worker is doing, as the supervisor tracks it: the
//! phase, the control channel for orders, the backoff of a worker that
//! keeps failing, and the counters `vzram stat` shows.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{
    AtomicBool, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::proto::control::{WorkerState, WorkerStatus};

/// Waits before the next worker of a device whose workers keep failing
/// (from the second failure in a row): doubling from the first, up to the
/// last.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A worker that served this long before failing starts the count afresh.
const HEALTHY_AFTER: Duration = Duration::from_secs(60);
/// A worker that ends cleanly is only worth its start (a fork and a whole
/// recovery) if it served a request and lived at least this long.
pub const USEFUL_LIFE: Duration = Duration::from_secs(1);
/// After a worker that was not worth its start, the next waits this many
/// times its life (so starts and recoveries take at most a quarter of the
/// time, whatever a frontend does), within these bounds.
const USELESS_WAIT_FACTOR: u32 = 3;
const USELESS_WAIT_MIN: Duration = Duration::from_millis(50);
const USELESS_WAIT_MAX: Duration = Duration::from_secs(5);
/// Restart lines of one device at most this often (the rest are counted).
const RESTART_LOG_EVERY: Duration = Duration::from_secs(10);

/// [`HEALTHY_AFTER`], or less when `VZRAM_HEALTHY_AFTER_MS` says so: a test
/// cannot let a worker serve for a minute before it kills it.
fn healthy_after() -> Duration {
    static AFTER: OnceLock<Duration> = OnceLock::new();
    *AFTER.get_or_init(|| {
        std::env::var("VZRAM_HEALTHY_AFTER_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(HEALTHY_AFTER, |ms| {
                HEALTHY_AFTER.min(Duration::from_millis(ms))
            })
    })
}

pub(super) enum Phase {
    Idle,
    /// A connection waiting to say something (or for a backoff to end).
    Pending {
        conn: UnixStream,
        since: Instant,
        /// Since when part of its first header is there (the rest must
        /// follow soon).
        partial: Option<Instant>,
    },
    /// A worker serves it (or is being started). `frontend` is our copy of
    /// its connection, to tell a reconnect from a second frontend.
    Running {
        id: u64,
        pid: Option<u32>,
        frontend: Option<UnixStream>,
        started: Instant,
        /// Requests the device had served when the worker started.
        served_before: u64,
        /// Since when another client waits in the backlog while our
        /// frontend still looks connected.
        contender: Option<Instant>,
    },
    /// The supervisor itself holds the device (compacting, resetting or
    /// tiering one that has no frontend).
    Busy,
}

/// Why a device's worker ended other than by serving and leaving cleanly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restart {
    /// It ended cleanly but served nothing or lived under [`USEFUL_LIFE`].
    Short,
    /// It exited with an error code.
    Error,
    /// A signal killed it.
    Signal,
    /// It could not be started.
    StartFailed,
}

impl Restart {
    pub const ALL: [Restart; 4] = [
        Restart::Short,
        Restart::Error,
        Restart::Signal,
        Restart::StartFailed,
    ];

    /// The `reason` label of `vzram_worker_restarts_total`.
    pub fn name(self) -> &'static str {
        match self {
            Restart::Short => "short",
            Restart::Error => "error",
            Restart::Signal => "signal",
            Restart::StartFailed => "start_failed",
        }
    }
}

/// A device's worker as the supervisor tracks it. The admission loop moves
/// the phase; orders take the channel; `stat` reads the counters.
pub struct WorkerSlot {
    phase: Mutex<Phase>,
    /// No frontend is admitted and the loop lets go of the device's
    /// socket: it is being removed, or cut off for a while. Set under the
    /// phase lock where no frontend may slip in between.
    closed: AtomicBool,
    /// The control channel of the running worker, for orders. Dropping it
    /// (once no order holds a reference) ends the worker. An order holds
    /// its own reference and not this lock, so that the loop, `remove` and
    /// `stop` never wait for a long writeback.
    control: Mutex<Option<Arc<UnixStream>>>,
    /// One order at a time on the channel, so answers match their orders.
    ordering: Mutex<()>,
    /// Consecutive failures and when the next worker may start.
    backoff: Mutex<Option<(u32, Instant)>>,
    /// Connected to a frontend through a worker.
    connected: AtomicBool,
    /// Workers started so far, and those that ended badly.
    started: AtomicU64,
    failures: AtomicU64,
    /// Last abnormal end of a worker, for `vzram stat`.
    last_failure: Mutex<Option<String>>,
    /// Worker ends that were not a useful clean end, by [`Restart`].
    restarts: [AtomicU64; Restart::ALL.len()],
    /// Clients closed before any worker because their first message was
    /// not a vhost-user request.
    refused_clients: AtomicU64,
    /// When a short restart was last logged, and how many were not since.
    restart_log: Mutex<(Option<Instant>, u64)>,
}

impl Default for WorkerSlot {
    fn default() -> WorkerSlot {
        WorkerSlot {
            phase: Mutex::new(Phase::Idle),
            closed: AtomicBool::new(false),
            control: Mutex::new(None),
            ordering: Mutex::new(()),
            backoff: Mutex::new(None),
            connected: AtomicBool::new(false),
            started: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            last_failure: Mutex::new(None),
            restarts: Default::default(),
            refused_clients: AtomicU64::new(0),
            restart_log: Mutex::new((None, 0)),
        }
    }
}

impl WorkerSlot {
    pub(super) fn phase(&self) -> MutexGuard<'_, Phase> {
        lock(&self.phase)
    }

    pub(super) fn idle(&self) -> bool {
        matches!(*self.phase(), Phase::Idle)
    }

    pub(super) fn running(&self) -> bool {
        matches!(*self.phase(), Phase::Running { .. })
    }

    /// Admits no frontend from now on, and has the loop let go of the
    /// device's socket.
    pub(super) fn close(&self) {
        self.closed.store(true, Relaxed);
    }

    /// Frontends are welcome again.
    pub(super) fn reopen(&self) {
        self.closed.store(false, Relaxed);
    }

    pub(super) fn closed(&self) -> bool {
        self.closed.load(Relaxed)
    }

    /// A worker was started, serving a frontend over `control`.
    pub(super) fn count_start(&self, control: UnixStream) {
        *lock(&self.control) = Some(Arc::new(control));
        self.started.fetch_add(1, Relaxed);
        self.connected.store(true, Relaxed);
    }

    /// The worker is gone: the device is idle, with no channel and no
    /// frontend.
    pub(super) fn gone(&self) {
        *self.phase() = Phase::Idle;
        self.end_channel();
        self.connected.store(false, Relaxed);
    }

    pub fn connected(&self) -> bool {
        self.connected.load(Relaxed)
    }

    /// One order at a time: held while an order is on the channel.
    pub(super) fn one_order(&self) -> MutexGuard<'_, ()> {
        lock(&self.ordering)
    }

    /// The running worker's control channel, if there is one.
    pub(super) fn channel(&self) -> Option<Arc<UnixStream>> {
        lock(&self.control).clone()
    }

    /// Drops the worker's channel, which ends it once no order holds it.
    pub(super) fn end_channel(&self) {
        *lock(&self.control) = None;
    }

    /// [`WorkerSlot::end_channel`], unless a new worker took over since
    /// `c` was taken.
    pub(super) fn end_channel_if(&self, c: &Arc<UnixStream>) {
        let mut ctl = lock(&self.control);
        if ctl.as_ref().is_some_and(|now| Arc::ptr_eq(now, c)) {
            *ctl = None;
        }
    }

    /// When the next worker may start, if a backoff was set.
    pub(super) fn backoff_until(&self) -> Option<Instant> {
        lock(&self.backoff).map(|(_, until)| until)
    }

    pub(super) fn backing_off(&self) -> bool {
        self.backoff_until()
            .is_some_and(|until| Instant::now() < until)
    }

    /// Failures in a row (0: the last worker ended well, or none failed).
    fn failing(&self) -> u32 {
        lock(&self.backoff).map_or(0, |(n, _)| n)
    }

    /// A client was closed: its first message was not vhost-user.
    pub(super) fn count_refused(&self) {
        self.refused_clients.fetch_add(1, Relaxed);
    }

    /// Worker ends for `why` so far.
    pub fn restarts(&self, why: Restart) -> u64 {
        self.restarts[why as usize].load(Relaxed)
    }

    /// The worker's part of `vzram stat`.
    pub fn status(&self) -> WorkerStatus {
        // Before what `failed` sets ahead of it (the phase is set before
        // `failed` runs, too).
        let failures = self.failures.load(Acquire);
        let (state, pid) = match &*self.phase() {
            Phase::Idle => (WorkerState::Idle, None),
            Phase::Pending { .. } => (WorkerState::Starting, None),
            Phase::Running { pid, .. } => (WorkerState::Running, *pid),
            // The supervisor itself holds the device: compacting, resetting
            // or tiering it.
            Phase::Busy => (WorkerState::Busy, None),
        };
        let failing = u64::from(self.failing());
        WorkerStatus {
            state: if failing > 0 && state != WorkerState::Running {
                WorkerState::Failing
            } else {
                state
            },
            pid,
            started: self.started.load(Relaxed),
            failures,
            failing,
            last_failure: lock(&self.last_failure).clone(),
            short_lived: self.restarts(Restart::Short),
            refused_clients: self.refused_clients.load(Relaxed),
        }
    }

    /// A worker of device `device` ended cleanly: if it served requests
    /// for long enough the backoff starts afresh; if not (a frontend that
    /// sets up and leaves, in a loop) its start was mostly a recovery, and
    /// the next waits three times as long as it lived, so one tenant
    /// cannot keep a core busy recovering. Returns the wait, if any.
    pub(super) fn ended_cleanly(
        &self,
        device: &str,
        ran: Duration,
        served: u64,
    ) -> Option<Duration> {
        let mut b = lock(&self.backoff);
        if served > 0 && ran >= USEFUL_LIFE {
            *b = None;
            return None;
        }
        let wait = ran
            .saturating_mul(USELESS_WAIT_FACTOR)
            .clamp(USELESS_WAIT_MIN, USELESS_WAIT_MAX);
        // The failure count stays as it was: an error before still counts.
        let n = b.map_or(0, |(n, _)| n);
        *b = Some((n, Instant::now() + wait));
        drop(b);
        self.note_restart(
            device,
            Restart::Short,
            &format!(
                "the worker ended after {ran:.1?} having served {served} requests; next worker in {wait:?}"
            ),
        );
        Some(wait)
    }

    /// Counts a worker's bad end and sets when the next may start: a first
    /// failure costs only the reconnect, repeats wait, doubling. Returns
    /// the wait.
    pub(super) fn failed(
        &self,
        device: &str,
        kind: Restart,
        why: String,
        ran: Duration,
    ) -> Duration {
        *lock(&self.last_failure) = Some(why.clone());
        let mut b = lock(&self.backoff);
        let n = match *b {
            Some((n, _)) if ran < healthy_after() => n + 1,
            _ => 1,
        };
        let wait = if n == 1 {
            Duration::ZERO
        } else {
            BACKOFF_FIRST
                .saturating_mul(1 << (n - 2).min(16))
                .min(BACKOFF_MAX)
        };
        *b = Some((n, Instant::now() + wait));
        drop(b);
        self.note_restart(
            device,
            kind,
            &format!(
                "{why}; the device's state is kept; {n} failures in a row, next worker in {wait:?}"
            ),
        );
        // Counted last: a `stat` that shows this failure shows its reason,
        // its backoff and its log line too.
        self.failures.fetch_add(1, Release);
        wait
    }

    /// Counts a restart and logs it. Failures are logged each time (their
    /// backoff doubles, so a crash loop logs a line per 30 s at most); the
    /// short clean ends a frontend can cause at will, at most once per
    /// [`RESTART_LOG_EVERY`] for the device, with a count of the rest.
    fn note_restart(&self, device: &str, why: Restart, line: &str) {
        self.restarts[why as usize].fetch_add(1, Relaxed);
        if why != Restart::Short {
            tracing::error!(device = %device, reason = why.name(), "{line}");
            return;
        }
        match self.short_log_due(Instant::now()) {
            None => {}
            Some(0) => tracing::info!(device = %device, reason = why.name(), "{line}"),
            Some(quiet) => {
                tracing::info!(device = %device, reason = why.name(), "{line} ({quiet} more like it not logged)")
            }
        }
    }

    /// Whether a short restart at `now` is logged: None if not (it is
    /// counted), or how many were not logged since the last line.
    fn short_log_due(&self, now: Instant) -> Option<u64> {
        let mut log = lock(&self.restart_log);
        if log
            .0
            .is_some_and(|t| now.saturating_duration_since(t) < RESTART_LOG_EVERY)
        {
            log.1 += 1;
            return None;
        }
        log.0 = Some(now);
        Some(std::mem::take(&mut log.1))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    const DEV: &str = "test";

    fn wait_left(w: &WorkerSlot) -> Duration {
        w.backoff_until()
            .expect("a backoff")
            .saturating_duration_since(Instant::now())
    }

    #[test]
    fn repeated_failures_wait_doubling_up_to_the_cap() {
        let w = WorkerSlot::default();
        let fail = || w.failed(DEV, Restart::Error, "exited".into(), Duration::ZERO);
        assert_eq!(
            fail(),
            Duration::ZERO,
            "a first failure costs the reconnect"
        );
        assert_eq!(fail(), BACKOFF_FIRST);
        assert_eq!(fail(), BACKOFF_FIRST * 2);
        assert_eq!(fail(), BACKOFF_FIRST * 4);
        let mut last = Duration::ZERO;
        for _ in 0..20 {
            last = fail();
        }
        assert_eq!(last, BACKOFF_MAX);
        assert_eq!(w.failing(), 24);
        let st = w.status();
        assert_eq!(st.failures, 24);
        assert_eq!(st.failing, 24);
        assert_eq!(st.state, WorkerState::Failing);
        assert_eq!(st.last_failure.as_deref(), Some("exited"));
        assert_eq!(w.restarts(Restart::Error), 24);
        assert_eq!(w.restarts(Restart::Signal), 0);
    }

    #[test]
    fn a_worker_that_ran_healthy_before_failing_starts_the_count_afresh() {
        let w = WorkerSlot::default();
        w.failed(DEV, Restart::Signal, "killed".into(), Duration::ZERO);
        w.failed(DEV, Restart::Signal, "killed".into(), Duration::ZERO);
        assert_eq!(w.failing(), 2);
        let wait = w.failed(DEV, Restart::Signal, "killed".into(), HEALTHY_AFTER);
        assert_eq!((w.failing(), wait), (1, Duration::ZERO));
        assert_eq!(w.restarts(Restart::Signal), 3);
    }

    #[test]
    fn a_useful_clean_end_resets_the_backoff() {
        let w = WorkerSlot::default();
        w.failed(DEV, Restart::Error, "exited".into(), Duration::ZERO);
        w.failed(DEV, Restart::Error, "exited".into(), Duration::ZERO);
        assert_eq!(w.ended_cleanly(DEV, USEFUL_LIFE, 1), None);
        assert_eq!(w.failing(), 0);
        assert!(w.backoff_until().is_none());
        assert!(!w.backing_off());
        assert_eq!(w.status().state, WorkerState::Idle);
        // Not a restart: nothing counted.
        assert_eq!(w.restarts(Restart::Short), 0);
        assert_eq!(w.status().failures, 2, "failures so far stay counted");
    }

    #[test]
    fn a_short_clean_end_waits_three_times_its_life_and_keeps_the_count() {
        let w = WorkerSlot::default();
        w.failed(DEV, Restart::Error, "exited".into(), Duration::ZERO);
        w.failed(DEV, Restart::Error, "exited".into(), Duration::ZERO);
        // Long enough but served nothing.
        let ran = Duration::from_secs(1);
        assert_eq!(w.ended_cleanly(DEV, ran, 0), Some(ran * 3));
        assert_eq!(w.failing(), 2, "an error before still counts");
        assert!(wait_left(&w) > Duration::from_secs(2));
        // Served, but too briefly; the wait has its floor and its cap.
        assert_eq!(
            w.ended_cleanly(DEV, Duration::ZERO, 5),
            Some(USELESS_WAIT_MIN)
        );
        assert_eq!(
            w.ended_cleanly(DEV, Duration::from_secs(100), 0),
            Some(USELESS_WAIT_MAX)
        );
        assert_eq!(w.restarts(Restart::Short), 3);
        assert_eq!(w.status().short_lived, 3);
        assert_eq!(w.status().failures, 2, "a short end is not a failure");
    }

    #[test]
    fn short_restarts_are_logged_at_most_once_per_period_with_a_count() {
        let w = WorkerSlot::default();
        let t = Instant::now();
        assert_eq!(w.short_log_due(t), Some(0));
        assert_eq!(w.short_log_due(t + Duration::from_secs(1)), None);
        assert_eq!(w.short_log_due(t + Duration::from_secs(9)), None);
        assert_eq!(w.short_log_due(t + RESTART_LOG_EVERY), Some(2));
        assert_eq!(
            w.short_log_due(t + RESTART_LOG_EVERY + Duration::from_secs(1)),
            None
        );
        // Only those since the last line are counted in the next.
        assert_eq!(w.short_log_due(t + RESTART_LOG_EVERY * 2), Some(1));
    }

    #[test]
    fn a_start_connects_and_opens_a_channel_that_the_end_drops() {
        let w = WorkerSlot::default();
        let (ours, _theirs) = UnixStream::pair().unwrap();
        assert!(w.channel().is_none());
        w.count_start(ours);
        assert!(w.connected());
        let c = w.channel().expect("a channel");
        assert_eq!(w.status().started, 1);
        // A channel another worker has since replaced stays.
        let (next, _) = UnixStream::pair().unwrap();
        w.count_start(next);
        w.end_channel_if(&c);
        assert!(w.channel().is_some(), "the new worker's channel stays");
        let c = w.channel().unwrap();
        w.end_channel_if(&c);
        assert!(w.channel().is_none());
        w.gone();
        assert!(!w.connected());
        assert!(w.idle());
        assert_eq!(w.status().started, 2);
    }
}
