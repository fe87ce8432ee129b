//! The compress pool: a few threads, shared by every queue of the process,
//! that turn the pages of a queue's multi-page writes into store objects
//! ([`vzram_store::Device::prepare_compressed`]: never staged, this is
//! off the request path already) and decompress the pages of its
//! multi-page reads straight into guest memory
//! ([`vzram_store::Device::read_page`]) while the queue thread goes on
//! parsing. The queue thread commits and completes in its own order; the
//! pool only ever sees pages, never the ring. Writes smaller than
//! `POOL_MIN_PAGES` and reads smaller than `POOL_MIN_READ_PAGES` (queue.rs)
//! stay on the queue thread.
//!
//! A queue thread hands over a [`Batch`] of jobs and then helps: it runs
//! jobs off the shared list itself until its own are done, so a pool of N
//! threads puts N + (busy queues) cores on compression, and a queue whose
//! pool threads are busy elsewhere still makes progress on its own.
//! A queue thread whose last pages are on pool threads watches them finish
//! for up to [`SPIN_MAX`] before it sleeps: they are a page's work away,
//! and a sleep costs a futex wake-up on each side. A pool thread that ran
//! jobs watches for the next batch as long as they took (at most
//! [`SPIN_MAX`]), unless it was preempted in its last watch: on a host
//! with more runnable threads than cores it would take the CPU from one
//! with work, so for a while ([`CONTENDED`]) it sleeps at once. Past the
//! watch, threads sleep on a condition variable: an idle pool never polls.
//!
//! With no job on the list, a pool thread compresses pages that writes
//! stored raw (staged) on the devices it serves
//! ([`CompressPool::serve_staging`]): a few at a time, looking at the
//! list again between batches, so a queue's jobs never wait behind more
//! than one small batch. A write that stages into an empty queue of staged
//! pages wakes a sleeping pool thread.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vzram_store::{Context, Device, Page, Prepared, StoreError, PAGE_SIZE};

use crate::thread_hook::ThreadHook;

/// Staged pages a pool thread compresses before it looks at the job list
/// again: about 50 us of lz4.
const STAGED_BATCH: usize = 8;
/// How long a pool thread leaves staged pages alone after a batch made no
/// progress (no memory for compressed objects): a limit lifted or a
/// compaction may make room later; until then nothing spins.
const STAGED_BACKOFF: std::time::Duration = std::time::Duration::from_millis(100);
/// The longest a thread watches before it sleeps (a queue thread for its
/// batch's last pages, a pool thread for the next batch): QEMU's
/// `poll-max-ns`, as the queue thread's base window for its ring.
pub const SPIN_MAX: Duration = crate::poll::BASE_POLL;
/// A gap this long between two looks at the clock of a watch (64 turns
/// apart, a few microseconds) means the thread was preempted.
const PREEMPTED: Duration = Duration::from_micros(20);
/// How long a pool thread preempted while it watched for work goes
/// straight to sleep afterwards: the host has more runnable threads than
/// cores, and a watch would take the CPU from one of them.
const CONTENDED: Duration = Duration::from_millis(50);

/// Pages one batch may carry: a full ring of 4 KiB writes at the queue
/// depths guests use, with the memory per queue bounded (1 MiB).
pub const BATCH_PAGES: usize = 256;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The shared list of jobs and the threads that take them.
pub struct CompressPool {
    inner: Arc<Inner>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

struct Inner {
    tasks: Mutex<Tasks>,
    /// `tasks.queue`'s length, for a thread watching without the lock.
    queued: AtomicUsize,
    /// How long a thread may watch before it sleeps, in nanoseconds
    /// ([`CompressPool::set_spin`]).
    spin_ns: AtomicU64,
    work: Condvar,
    /// Run on each pool thread before its first job, or as soon as
    /// [`CompressPool::run_thread_hook`] asks, whichever comes first.
    hook: std::sync::OnceLock<ThreadHook>,
    /// Signalled as each thread is done with the hook once asked.
    hooked: Condvar,
    /// Devices whose staged pages the threads compress when idle.
    staging: Mutex<Vec<Arc<Device>>>,
}

/// What a pool thread does next.
enum Next {
    Job(Arc<Batch>, usize),
    Staged(Arc<Device>),
}

#[derive(Default)]
struct Tasks {
    queue: VecDeque<(Arc<Batch>, usize)>,
    /// Pool threads waiting on `work`: only then is a wake-up worth a
    /// system call.
    sleeping: usize,
    /// Of those, the ones with no staged pages to come back to: only they
    /// need a staged page's wake-up. One backing off (no memory for the
    /// last try) tries again by itself; woken at each page put back, the
    /// threads of a device at its limit would wake each other in turn.
    idle: usize,
    /// Times a thread went to sleep.
    #[cfg(test)]
    naps: u64,
    stop: bool,
    /// [`CompressPool::run_thread_hook`] asked: idle threads wake to run it.
    hook_asked: bool,
    /// Threads that ran it since it was asked.
    hooked: usize,
}

/// A page of guest memory a pooled read decompresses into.
#[derive(Clone, Copy)]
pub struct GuestPage(NonNull<Page>);

// SAFETY: a pointer into guest memory, which is shared by every thread of
// the process; `GuestPage::new`'s caller keeps it mapped until the job that
// holds it is done, whichever thread runs it.
unsafe impl Send for GuestPage {}

impl GuestPage {
    /// # Safety
    ///
    /// `ptr` is the start of `PAGE_SIZE` bytes of guest memory in one
    /// region, which stay mapped until every job of the batch it is put in
    /// is done ([`CompressPool::wait`] returned, or [`Held`] dropped).
    /// The bytes are written as `crate::guest::with_mut` writes them, and
    /// its contract holds for them.
    pub(crate) unsafe fn new(ptr: NonNull<u8>) -> GuestPage {
        GuestPage(ptr.cast())
    }
}

/// One page of a write to prepare and, once done, its result.
pub struct Job {
    pub slot: u64,
    /// Allocated on first use: a queue that never writes 4 pages at once
    /// (or a VM that only reads) keeps no 1 MiB of pages per queue.
    page: Option<Box<Page>>,
    /// None until done; stays None if preparing panicked.
    out: Option<Result<Prepared, StoreError>>,
}

impl Job {
    /// The page to fill in before the job is submitted.
    pub fn page_mut(&mut self) -> &mut Page {
        self.page.get_or_insert_with(|| Box::new([0; PAGE_SIZE]))
    }
}

/// One page of a read, decompressed into guest memory, and its result.
struct ReadJob {
    slot: u64,
    to: Option<GuestPage>,
    /// None until done; stays None if the read panicked.
    out: Option<Result<(), StoreError>>,
}

/// A job on cache lines of its own: neighbouring jobs run on different
/// threads at once, and sharing a line would bounce it between their cores
/// at every lock.
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// A queue's jobs in flight. Made once per queue and reused: the pages
/// stay allocated. Reads have jobs of their own (no page: they write into
/// guest memory), so they never take a write's room in the batch.
pub struct Batch {
    dev: Arc<Device>,
    jobs: Box<[Padded<Mutex<Job>>]>,
    reads: Box<[Padded<Mutex<ReadJob>>]>,
    pending: AtomicUsize,
    /// Threads asleep in [`Batch::wait_done`]: the last job wakes them only
    /// if there are any (a notify is a system call even with no waiter).
    done: Mutex<usize>,
    done_cv: Condvar,
}

impl Batch {
    pub fn new(dev: Arc<Device>) -> Arc<Batch> {
        Arc::new(Batch {
            dev,
            jobs: (0..BATCH_PAGES)
                .map(|_| {
                    Padded(Mutex::new(Job {
                        slot: 0,
                        page: None,
                        out: None,
                    }))
                })
                .collect(),
            reads: (0..BATCH_PAGES)
                .map(|_| {
                    Padded(Mutex::new(ReadJob {
                        slot: 0,
                        to: None,
                        out: None,
                    }))
                })
                .collect(),
            pending: AtomicUsize::new(0),
            done: Mutex::new(0),
            done_cv: Condvar::new(),
        })
    }

    /// Write job `i`, to fill in before handing it over with
    /// [`CompressPool::submit`].
    pub fn job(&self, i: usize) -> MutexGuard<'_, Job> {
        lock(&self.jobs[i])
    }

    /// Makes read job `i` a read of `slot` into `to`, for
    /// [`CompressPool::submit_reads`].
    pub fn read_job(&self, i: usize, slot: u64, to: GuestPage) {
        let mut job = lock(&self.reads[i]);
        job.slot = slot;
        job.to = Some(to);
    }

    /// Write job `i`'s result, once [`CompressPool::wait`] returned. None:
    /// it was never submitted, or preparing it panicked.
    pub fn take(&self, i: usize) -> Option<Result<Prepared, StoreError>> {
        lock(&self.jobs[i]).out.take()
    }

    /// Read job `i`'s result, as [`Batch::take`].
    pub fn take_read(&self, i: usize) -> Option<Result<(), StoreError>> {
        let mut job = lock(&self.reads[i]);
        job.to = None;
        job.out.take()
    }

    /// Blocks until every submitted job is done, running none of them.
    fn wait_done(&self) {
        let mut g = lock(&self.done);
        *g += 1;
        while self.pending.load(Ordering::Acquire) > 0 {
            g = self.done_cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        *g -= 1;
    }

    /// Runs task `t`: write job `t`, or read job `t - BATCH_PAGES`.
    fn run(&self, t: usize, cx: &mut Context) {
        // A panic must not leave the queue waiting for this job forever.
        if let Some(r) = t.checked_sub(BATCH_PAGES) {
            let mut job = lock(&self.reads[r]);
            let ReadJob { slot, to, out } = &mut *job;
            *out = to.and_then(|mut to| {
                catch_unwind(AssertUnwindSafe(|| {
                    // SAFETY: `GuestPage::new`'s caller keeps the page
                    // mapped until this job is done, and read_page only
                    // writes it (a fill, a copy, or a decoder's output,
                    // taking no length or index from what it reads back):
                    // `guest::with_mut`'s contract, as for a read on the
                    // queue thread.
                    let dst = unsafe { to.0.as_mut() };
                    self.dev.read_page(cx, *slot, dst)
                }))
                .ok()
            });
        } else {
            let mut job = lock(&self.jobs[t]);
            let Job { slot, page, out } = &mut *job;
            // A submitted job was filled in, so it has its page.
            *out = page.as_deref().and_then(|page| {
                catch_unwind(AssertUnwindSafe(|| {
                    self.dev.prepare_compressed(cx, *slot, page)
                }))
                .ok()
            });
        }
        // A waiter counts itself and checks `pending` under `done`'s lock,
        // so it either sees 0 or is counted before this looks.
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 && *lock(&self.done) > 0 {
            self.done_cv.notify_all();
        }
    }
}

/// The guest memory snapshots a batch's pooled reads write into, kept
/// until the batch's jobs are done: a memory table change must not unmap
/// a page a pool thread is writing. Should the queue thread unwind before
/// it waited, dropping this finishes the jobs, running them itself as
/// [`CompressPool::wait`] does (a pool of no threads has nobody else).
pub struct Held<T> {
    batch: Option<(Arc<CompressPool>, Arc<Batch>)>,
    first: Option<T>,
    more: Vec<T>,
}

impl<T> Default for Held<T> {
    fn default() -> Self {
        Held {
            batch: None,
            first: None,
            more: Vec::new(),
        }
    }
}

impl<T> Held<T> {
    /// Keeps `snap` (once: requests between table changes share one) until
    /// the jobs of `batch` on `pool` are done.
    pub fn keep<M: ?Sized>(&mut self, pool: &Arc<CompressPool>, batch: &Arc<Batch>, snap: T)
    where
        T: std::ops::Deref<Target = M>,
    {
        if self.batch.is_none() {
            self.batch = Some((pool.clone(), batch.clone()));
        }
        let last = self.more.last().or(self.first.as_ref());
        if last.is_some_and(|l| std::ptr::eq::<M>(&**l, &*snap)) {
            return;
        }
        match self.first {
            None => self.first = Some(snap),
            Some(_) => self.more.push(snap),
        }
    }
}

impl<T> Drop for Held<T> {
    fn drop(&mut self) {
        if let Some((pool, b)) = &self.batch {
            // After the queue thread's own wait nothing is left, and no
            // context is made.
            if b.pending.load(Ordering::Acquire) > 0 {
                pool.wait(b, &mut Context::new(0));
            }
        }
    }
}

impl CompressPool {
    /// A pool of `threads` threads; their store contexts take allocator
    /// shards `first_shard..`, modulo the device's shard count (one per
    /// queue), so they share the queues' shards: a shard's lock is held
    /// for one allocation, never while compressing. 0 threads: the queue
    /// threads do all the work themselves.
    pub fn new(threads: usize, first_shard: usize) -> std::io::Result<Arc<CompressPool>> {
        let inner = Arc::new(Inner {
            tasks: Mutex::new(Tasks::default()),
            queued: AtomicUsize::new(0),
            spin_ns: AtomicU64::new(SPIN_MAX.as_nanos() as u64),
            work: Condvar::new(),
            hook: std::sync::OnceLock::new(),
            hooked: Condvar::new(),
            staging: Mutex::new(Vec::new()),
        });
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let inner = inner.clone();
            let h = std::thread::Builder::new()
                .name(format!("vzram-compress-{i}"))
                .spawn(move || inner.serve(Context::new(first_shard + i)))?;
            handles.push(h);
        }
        Ok(Arc::new(CompressPool {
            inner,
            threads: handles,
        }))
    }

    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// How long a queue thread watches its batch's last pages, and a pool
    /// thread for the next batch, before they sleep: at most `max`
    /// ([`SPIN_MAX`] by default; zero: they sleep at once, as
    /// `--poll-us 0` asks of the queues).
    pub fn set_spin(&self, max: Duration) {
        let ns = max.min(SPIN_MAX).as_nanos() as u64;
        self.inner.spin_ns.store(ns, Ordering::Relaxed);
    }

    /// Each pool thread runs `hook` on itself before its next job (see
    /// [`crate::thread_hook`]). Set once; a second hook is ignored.
    pub fn set_thread_hook(&self, hook: ThreadHook) {
        let _ = self.inner.hook.set(hook);
    }

    /// Has every pool thread run the hook now, idle ones included (one
    /// that never gets a job would otherwise never run it), and waits up
    /// to `within` for them all; true if they all did. A thread busy with
    /// a job runs it once that job is done.
    pub fn run_thread_hook(&self, within: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + within;
        let mut t = lock(&self.inner.tasks);
        t.hook_asked = true;
        self.inner.work.notify_all();
        while t.hooked < self.threads.len() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            t = self
                .inner
                .hooked
                .wait_timeout(t, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Has the pool threads compress `dev`'s staged pages
    /// ([`Device::compress_staged`]) whenever they have no job, woken by a
    /// write that stages a page. Returns false on a pool of no threads:
    /// nobody would compress them, so the device must not stage.
    pub fn serve_staging(&self, dev: &Arc<Device>) -> bool {
        if self.threads.is_empty() {
            return false;
        }
        lock(&self.inner.staging).push(dev.clone());
        let inner = Arc::downgrade(&self.inner);
        dev.set_staging_waker(Box::new(move || {
            if let Some(inner) = inner.upgrade() {
                let t = lock(&inner.tasks);
                if t.idle > 0 {
                    drop(t);
                    inner.work.notify_one();
                }
            }
        }));
        // Pages already staged (recovered from a worker before) wake no
        // one by themselves: a staged write only wakes the threads when
        // the FIFO was empty. Under the tasks lock, so that a thread about
        // to sleep sees the device or gets the wake-up.
        if dev.has_staged() {
            let _t = lock(&self.inner.tasks);
            self.inner.work.notify_all();
        }
        true
    }

    /// Hands jobs `range` of `batch` to the pool. Each must have been
    /// filled in and not be in flight.
    pub fn submit(&self, batch: &Arc<Batch>, range: std::ops::Range<usize>) {
        self.submit_tasks(batch, range);
    }

    /// Hands read jobs `range` of `batch` ([`Batch::read_job`]) to the pool.
    pub fn submit_reads(&self, batch: &Arc<Batch>, range: std::ops::Range<usize>) {
        self.submit_tasks(batch, range.start + BATCH_PAGES..range.end + BATCH_PAGES);
    }

    fn submit_tasks(&self, batch: &Arc<Batch>, range: std::ops::Range<usize>) {
        let n = range.len();
        if n == 0 {
            return;
        }
        batch.pending.fetch_add(n, Ordering::AcqRel);
        let mut t = lock(&self.inner.tasks);
        t.queue.extend(range.map(|i| (batch.clone(), i)));
        self.inner.queued.store(t.queue.len(), Ordering::Relaxed);
        let wake = t.sleeping.min(n);
        drop(t);
        for _ in 0..wake {
            self.inner.work.notify_one();
        }
    }

    /// Runs jobs (this batch's or any other's) on the calling thread with
    /// its context until every job of `batch` is done.
    pub fn wait(&self, batch: &Batch, cx: &mut Context) {
        let mut spun = false;
        while batch.pending.load(Ordering::Acquire) > 0 {
            let next = self.inner.pop();
            match next {
                Some((b, i)) => b.run(i, cx),
                // The rest are running on pool threads: a page's work at
                // most, unless one was preempted. Work queued meanwhile
                // (another queue's) ends the watch: this thread helps.
                None if !spun => {
                    spun = true;
                    let inner = &self.inner;
                    let _ = watch(inner.spin(), || {
                        batch.pending.load(Ordering::Acquire) == 0
                            || inner.queued.load(Ordering::Relaxed) > 0
                    });
                }
                None => batch.wait_done(),
            }
        }
    }
}

impl Inner {
    fn pop(&self) -> Option<(Arc<Batch>, usize)> {
        let mut t = lock(&self.tasks);
        let next = t.queue.pop_front();
        self.queued.store(t.queue.len(), Ordering::Relaxed);
        next
    }

    fn spin(&self) -> Duration {
        Duration::from_nanos(self.spin_ns.load(Ordering::Relaxed))
    }

    /// A device with staged pages waiting, if any.
    fn staged(&self) -> Option<Arc<Device>> {
        lock(&self.staging).iter().find(|d| d.has_staged()).cloned()
    }

    fn serve(&self, mut cx: Context) {
        let mut hooked = false;
        // Staged pages made no progress (no memory): leave them a while.
        let mut stalled = false;
        let mut watcher = Watcher::default();
        loop {
            let mut t = lock(&self.tasks);
            let next = loop {
                if t.stop {
                    return;
                }
                if t.hook_asked && !hooked {
                    drop(t);
                    crate::thread_hook::run(self.hook.get());
                    hooked = true;
                    t = lock(&self.tasks);
                    t.hooked += 1;
                    self.hooked.notify_all();
                    continue;
                }
                if let Some((b, i)) = t.queue.pop_front() {
                    self.queued.store(t.queue.len(), Ordering::Relaxed);
                    watcher.ran_job(Instant::now());
                    break Next::Job(b, i);
                }
                if !stalled {
                    if let Some(dev) = self.staged() {
                        break Next::Staged(dev);
                    }
                }
                if let Some(window) = watcher.window(Instant::now(), self.spin()) {
                    drop(t);
                    let calm = watch(window, || self.queued.load(Ordering::Relaxed) > 0);
                    watcher.watched(calm, Instant::now());
                    t = lock(&self.tasks);
                    continue;
                }
                t.sleeping += 1;
                #[cfg(test)]
                {
                    t.naps += 1;
                }
                if stalled {
                    t = self
                        .work
                        .wait_timeout(t, STAGED_BACKOFF)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                    stalled = false;
                } else {
                    t.idle += 1;
                    t = self.work.wait(t).unwrap_or_else(|e| e.into_inner());
                    t.idle -= 1;
                }
                t.sleeping -= 1;
            };
            drop(t);
            crate::thread_hook::run(self.hook.get());
            match next {
                Next::Job(b, i) => {
                    b.run(i, &mut cx);
                    // Counted here, not in `run`: the queue thread runs jobs
                    // too, and this says how much the pool took off it.
                    b.dev.cells().pool_pages.fetch_add(1, Ordering::Relaxed);
                }
                Next::Staged(dev) => {
                    let done = catch_unwind(AssertUnwindSafe(|| {
                        dev.compress_staged(&mut cx, STAGED_BATCH)
                    }));
                    stalled = !matches!(done, Ok(n) if n > 0);
                }
            }
        }
    }
}

/// Spins until `done` says so or `window` has passed. False when the
/// thread was preempted while it spun: another thread wanted the CPU,
/// and the watch gave up at once.
fn watch(window: Duration, done: impl Fn() -> bool) -> bool {
    if window.is_zero() {
        return true;
    }
    let t0 = Instant::now();
    let mut last = t0;
    while !done() {
        // The clock is read every 64 turns: a read costs as much as
        // several dozen of them.
        for _ in 0..64 {
            std::hint::spin_loop();
        }
        let now = Instant::now();
        if now - last >= PREEMPTED {
            return false;
        }
        if now - t0 >= window {
            return true;
        }
        last = now;
    }
    true
}

/// When a pool thread out of work watches for more, and for how long:
/// once per run of jobs, as long as the run took (at most the pool's
/// window), since at a steady queue depth the next batch comes within that
/// and a sleep costs a wake-up; never for [`CONTENDED`] after a watch that
/// was preempted.
#[derive(Default)]
struct Watcher {
    /// Since when the thread has been running jobs (staged pages between
    /// them count too: the window is capped anyway).
    busy: Option<Instant>,
    /// Until when it sleeps at once.
    contended: Option<Instant>,
}

impl Watcher {
    fn ran_job(&mut self, now: Instant) {
        self.busy.get_or_insert(now);
    }

    /// How long to watch now, if at all; `max` zero: never.
    fn window(&mut self, now: Instant, max: Duration) -> Option<Duration> {
        let since = self.busy.take()?;
        if max.is_zero() || self.contended.is_some_and(|until| now < until) {
            return None;
        }
        Some((now - since).min(max))
    }

    /// A watch ended: `calm` false if it was preempted.
    fn watched(&mut self, calm: bool, now: Instant) {
        self.contended = (!calm).then(|| now + CONTENDED);
    }
}

impl Drop for CompressPool {
    fn drop(&mut self) {
        lock(&self.inner.tasks).stop = true;
        self.inner.work.notify_all();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// Pool threads when `--compress-threads` is not given: a core less than
/// the host has, at least 1, up to this many. Each connected VM's worker
/// has its own pool, so the cap keeps a host full of VMs from holding
/// cores × VMs sleeping threads, while a swap-out of 64 pages is still
/// split five ways (the queue thread helps).
pub const DEFAULT_MAX_THREADS: usize = 4;

/// The pool size for `--compress-threads N` (None: the default): N, but
/// never more than the cores (more threads than cores only adds switches).
/// The default leaves a core to the queue thread, which does its share of
/// every request's pages: on 2 vCPUs one pool thread against two, same
/// build, same run (BENCHMARKS.md), read 32K 1.06x at QD8 and 1.14x at QD1
/// with 8-15% less CPU per request, wrote 64K 1.08x, and the 4K jobs and
/// fills within 1%. Hosts of 5 cores or more keep 4.
pub fn pool_threads(requested: Option<usize>) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    requested
        .unwrap_or_else(|| cores.saturating_sub(1).clamp(1, DEFAULT_MAX_THREADS))
        .min(cores)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vzram_store::{Codec, DeviceConfig, Pool, PoolConfig};

    /// Idle pool threads run the hook when asked, each once, with no job.
    #[test]
    fn idle_threads_run_the_hook_when_asked() {
        let pool = CompressPool::new(2, 0).unwrap();
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let r = ran.clone();
        pool.set_thread_hook(Arc::new(move || {
            r.fetch_add(1, Ordering::SeqCst);
            true
        }));
        assert!(pool.run_thread_hook(std::time::Duration::from_secs(60)));
        assert_eq!(ran.load(Ordering::SeqCst), 2);
        assert!(pool.run_thread_hook(std::time::Duration::from_secs(60)));
        assert_eq!(ran.load(Ordering::SeqCst), 2, "once per thread");
    }

    /// A 1 MiB device that stages nothing.
    fn plain_store() -> Arc<Device> {
        Pool::new(PoolConfig {
            host_mem_limit: 0,
            arena_bytes: 1 << 26,
            ..PoolConfig::default()
        })
        .unwrap()
        .create_device(DeviceConfig::new(1 << 20, Codec::Lz4))
        .unwrap()
    }

    /// A device that stages every whole-page write (1 MiB budget).
    fn staging_store() -> Arc<Device> {
        let mut dc = DeviceConfig::new(1 << 20, Codec::Lz4);
        dc.staging_bytes = 1 << 20;
        Pool::new(PoolConfig {
            host_mem_limit: 0,
            arena_bytes: 1 << 26,
            ..PoolConfig::default()
        })
        .unwrap()
        .create_device(dc)
        .unwrap()
    }

    /// Waits (30 s at most) until no page of `store` is staged.
    fn wait_compressed(store: &Device, what: &str) {
        let t0 = std::time::Instant::now();
        while store.staged_bytes() > 0 {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(30),
                "{what}: staged pages were left raw: {:?}",
                store.stats()
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// A device at its memory limit with a page staged: each pool thread
    /// tries it, puts it back and backs off for STAGED_BACKOFF. Putting it
    /// back must not wake a thread that is backing off: they would wake
    /// each other in turn, busy for as long as memory stays full. Once
    /// there is room, the next try compresses it.
    #[test]
    fn threads_backing_off_do_not_wake_each_other() {
        let store = staging_store();
        let cx = &mut Context::new(0);
        let mut page = [0u8; PAGE_SIZE];
        for (j, c) in page.chunks_exact_mut(8).enumerate() {
            c.copy_from_slice(&(j as u64 % 5).to_le_bytes());
        }
        // Staged before the pool serves the device, then no room for
        // its compressed form.
        store.write_page(cx, 0, &page).unwrap();
        assert_eq!(store.staged_bytes(), PAGE_SIZE as u64);
        store.set_mem_limit(store.stats().mem_used_total);
        let pool = CompressPool::new(4, 0).unwrap();
        assert!(pool.serve_staging(&store));
        let naps = || lock(&pool.inner.tasks).naps;
        let before = naps();
        let t0 = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_secs(1));
        let n = naps() - before;
        // Four threads backing off 100 ms at a time nap about 40 times a
        // second (a busy host makes it fewer, and a late sleep longer);
        // woken by each other they napped 3199 times.
        let window = t0.elapsed();
        let bound = 4 * 4 * (1 + (window.as_millis() / STAGED_BACKOFF.as_millis()) as u64);
        assert!(n <= bound, "{n} naps in {window:?} (at most {bound})");
        assert_eq!(store.staged_bytes(), PAGE_SIZE as u64);
        store.set_mem_limit(0);
        wait_compressed(&store, "after the limit was lifted");
    }

    /// Pages a write staged are compressed by an idle pool thread, woken
    /// by the write, until none is left; a pool of no threads refuses the
    /// job (nobody would do it).
    #[test]
    fn idle_pool_threads_compress_staged_pages() {
        let store = staging_store();
        assert!(!CompressPool::new(0, 0).unwrap().serve_staging(&store));
        let pool = CompressPool::new(1, 0).unwrap();
        assert!(pool.serve_staging(&store));
        let page = |i: u64| -> Page {
            let mut p = [0u8; PAGE_SIZE];
            for (j, c) in p.chunks_exact_mut(8).enumerate() {
                c.copy_from_slice(&(i * 7 + j as u64 % 3).to_le_bytes());
            }
            p
        };
        let cx = &mut Context::new(0);
        for round in 0..2u64 {
            // The thread sleeps between the rounds: the writes wake it.
            for i in 0..64 {
                store.write_page(cx, i, &page(i + round)).unwrap();
            }
            wait_compressed(&store, &format!("round {round}"));
            let mut out = [0u8; PAGE_SIZE];
            for i in 0..64 {
                store.read_page(cx, i, &mut out).unwrap();
                assert!(out == page(i + round), "round {round}: page {i}");
            }
            assert_eq!(store.stats().huge_pages, 0);
        }
        assert_eq!(store.stats().staged_compressed, 128);
    }

    /// Pages staged before the pool serves the device (a worker before
    /// left them; recovery queued them) are compressed by threads already
    /// asleep: no write comes to wake them.
    #[test]
    fn staged_pages_found_at_start_are_compressed() {
        let store = staging_store();
        let cx = &mut Context::new(0);
        let mut p = [0u8; PAGE_SIZE];
        for i in 0..64u64 {
            p[..8].copy_from_slice(&(i + 1).to_le_bytes());
            store.write_page(cx, i, &p).unwrap();
        }
        assert_eq!(store.staged_bytes(), 64 * PAGE_SIZE as u64);
        let pool = CompressPool::new(2, 0).unwrap();
        // Let both threads find nothing to do and sleep.
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(pool.serve_staging(&store));
        wait_compressed(&store, "found at the start");
        assert_eq!(store.stats().staged_compressed, 64);
    }

    /// A pool thread watches once per run of jobs, as long as the run
    /// took and no longer than the pool's window; not at all with a window
    /// of zero (`--poll-us 0`), nor for CONTENDED after a preempted watch.
    #[test]
    fn a_pool_thread_watches_once_per_run_of_jobs_unless_preempted() {
        let us = Duration::from_micros;
        let t0 = Instant::now();
        let mut w = Watcher::default();
        assert_eq!(w.window(t0, SPIN_MAX), None, "no job run yet");
        w.ran_job(t0);
        w.ran_job(t0 + us(5));
        assert_eq!(w.window(t0 + us(10), SPIN_MAX), Some(us(10)));
        assert_eq!(w.window(t0 + us(11), SPIN_MAX), None, "once per run");
        w.ran_job(t0);
        assert_eq!(w.window(t0 + us(500), SPIN_MAX), Some(SPIN_MAX));
        w.ran_job(t0);
        assert_eq!(w.window(t0 + us(10), Duration::ZERO), None);
        w.watched(true, t0);
        w.ran_job(t0);
        assert_eq!(w.window(t0 + us(10), SPIN_MAX), Some(us(10)));
        w.watched(false, t0);
        w.ran_job(t0);
        assert_eq!(w.window(t0 + CONTENDED / 2, SPIN_MAX), None, "preempted");
        w.ran_job(t0);
        assert_eq!(w.window(t0 + CONTENDED, SPIN_MAX), Some(SPIN_MAX));
    }

    /// A watch ends at its window, or at once when the thread was away
    /// from the CPU between two looks at the clock (here: the check itself
    /// sleeps, as a preempted thread would be gone).
    #[test]
    fn a_watch_gives_up_when_the_thread_was_preempted() {
        let t0 = Instant::now();
        // Preempted on a busy host, it may end early, and says so.
        let calm = watch(Duration::from_millis(2), || false);
        assert!(!calm || t0.elapsed() >= Duration::from_millis(2));
        let t0 = Instant::now();
        let calm = watch(Duration::from_secs(20), || {
            std::thread::sleep(PREEMPTED * 2);
            false
        });
        assert!(!calm, "a gap of {:?} went unseen", PREEMPTED * 2);
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        assert!(watch(Duration::from_secs(20), || true));
        assert!(watch(Duration::ZERO, || false));
    }

    /// A queue thread whose last jobs run on pool threads sleeps until
    /// they are done; the last one wakes it only when it counted itself as
    /// waiting, so the count and the check of `pending` must not let a
    /// wake-up fall between them. Short jobs, many rounds, all run on the
    /// pool: a lost wake-up leaves a round hanging.
    #[test]
    fn the_last_job_on_a_pool_thread_always_wakes_the_queue_thread() {
        let store = plain_store();
        let pool = CompressPool::new(2, 0).unwrap();
        pool.set_spin(Duration::ZERO);
        let batch = Batch::new(store);
        let (tx, rx) = std::sync::mpsc::channel();
        let (p, b) = (pool.clone(), batch.clone());
        std::thread::spawn(move || {
            for round in 0..20_000u32 {
                let n = 1 + round as usize % 3;
                for i in 0..n {
                    let mut job = b.job(i);
                    job.slot = i as u64;
                    job.page_mut().fill(round as u8);
                }
                p.submit(&b, 0..n);
                // Only pool threads run them: every round's last job
                // meets a waiter that counted itself, or one about to.
                b.wait_done();
                for i in 0..n {
                    assert!(matches!(b.take(i), Some(Ok(_))), "round {round} job {i}");
                }
                tx.send(round).unwrap();
            }
        });
        let mut last = None;
        while last != Some(19_999) {
            match rx.recv_timeout(Duration::from_secs(30)) {
                Ok(r) => last = Some(r),
                Err(e) => panic!("no round done for 30 s after round {last:?}: {e}"),
            }
        }
    }

    /// A queue thread that unwinds with jobs in flight finishes them when
    /// its `Held` drops, even on a pool of no threads
    /// (`--compress-threads 0`), where waiting alone would never end.
    #[test]
    fn dropping_held_finishes_the_jobs_on_a_pool_of_no_threads() {
        let store = plain_store();
        let pool = CompressPool::new(0, 0).unwrap();
        let batch = Batch::new(store);
        for i in 0..3 {
            let mut job = batch.job(i);
            job.slot = i as u64;
            job.page_mut().fill(i as u8 + 1);
        }
        pool.submit(&batch, 0..3);
        let (tx, rx) = std::sync::mpsc::channel();
        let (p, b) = (pool.clone(), batch.clone());
        std::thread::spawn(move || {
            let mut held = Held::default();
            held.keep(&p, &b, Box::new(0u8));
            drop(held);
            tx.send(()).unwrap();
        });
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("dropping Held did not finish the batch");
        for i in 0..3 {
            assert!(matches!(batch.take(i), Some(Ok(_))), "job {i}");
        }
    }
}
