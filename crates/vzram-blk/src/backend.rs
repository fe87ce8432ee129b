//! The vhost-user-backend glue: one worker thread per virtqueue.
//!
//! We implement the `&self` trait [`VhostUserBackend`], not
//! `VhostUserBackendMut`: the framework wraps a `Mut` backend in a
//! `Mutex`/`RwLock` and takes it for every queue event, which would put all
//! queues of a device behind one lock. Here a queue thread touches only its
//! own vring and its own scratch space (whose locks nobody else takes while
//! the device runs), atomics, and the store's per-slot locks.
//!
//! A backend lives for one frontend connection. The [`BlkDevice`] it serves
//! outlives it, so a frontend that reconnects finds its data.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringState, VringT};
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{
    Address, GuestAddressSpace, GuestMemory, GuestMemoryAtomic, GuestMemoryBackend,
    GuestMemoryMmap, GuestMemoryRegion,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};
use vzram_store::{Context, Device, Op, Page, PAGE_SIZE};

use crate::config::{self, MAX_QUEUE_SIZE};
use crate::device::{BlkDevice, ExecError, STATUS_IOERR, STATUS_OK};
use crate::dirty::{carry_log, LogBitmap};
use crate::poll::Poller;
use crate::pool::{Batch, CompressPool, BATCH_PAGES};
use crate::request::{Request, RequestError, SegmentCursor};
use crate::vring::BlkVring;

/// Why a queue stopped draining; the guest's doing, logged and survived.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error(transparent)]
    Ring(#[from] virtio_queue::Error),
    #[error("the ring says requests are waiting but none can be read (avail ring outside guest memory?)")]
    Unreadable,
}

/// Guest memory as the framework hands it to us. Every region carries a
/// dirty bitmap that SET_LOG_BASE points at the frontend's log: our writes
/// (read data, status bytes, used rings) go through vm-memory, which marks
/// it, so a migrating frontend copies those pages again.
pub type GuestMem = GuestMemoryAtomic<GuestMemoryMmap<LogBitmap>>;
/// Signals each new call fd once (SET_VRING_CALL); see [`crate::vring`].
type Vring = BlkVring<GuestMem>;

/// After this many requests in one go, tell the guest about the ones done so
/// far instead of holding them back until the ring is empty.
pub const SIGNAL_EVERY: u32 = 64;

/// vhost-user-blk backend for one connection.
pub struct BlkBackend {
    dev: Arc<BlkDevice>,
    /// The guest memory the queue threads use. The framework maps a new
    /// table in its own `GuestMemoryAtomic` before telling us; we publish it
    /// here only after checking it (see [`check_memory`]).
    mem: GuestMem,
    event_idx: AtomicBool,
    acked_features: AtomicU64,
    /// Read ends of the worker exit events. The framework takes them with
    /// `into_raw_fd` and never closes them; we close them once every worker
    /// and its epoll are gone, i.e. when the last reference to us drops.
    exit_consumers: Mutex<Vec<RawFd>>,
    queue_errors: RateLimit,
    /// Each queue's scratch space, made on its first kick. Only the queue's
    /// own worker thread takes its lock, so it is never contended.
    scratch: Box<[Mutex<Option<Scratch>>]>,
    /// Where the queues' writes are compressed; None: on the queue thread.
    pool: Option<Arc<CompressPool>>,
    /// How long a queue thread may watch its ring after it ran dry.
    poll: Duration,
    /// Closed while the device waits for its pages (an incoming migration):
    /// requests stay in their rings until [`BlkBackend::open_gate`].
    gate_closed: AtomicBool,
    gate: Mutex<Gate>,
}

/// The queues kicked while the gate was closed, to drain when it opens.
#[derive(Default)]
struct Gate {
    closed: bool,
    parked: Vec<(usize, Vring)>,
}

/// Lets one event through per interval and counts the rest.
struct RateLimit {
    start: Instant,
    interval: Duration,
    /// Nanoseconds since `start` before which events are only counted.
    next: AtomicU64,
    suppressed: AtomicU64,
}

impl RateLimit {
    fn new(interval: Duration) -> RateLimit {
        RateLimit {
            start: Instant::now(),
            interval,
            next: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Some(events suppressed since the last one let through), or None.
    fn allow(&self) -> Option<u64> {
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

impl BlkBackend {
    pub fn new(dev: Arc<BlkDevice>) -> BlkBackend {
        BlkBackend::with_pool(dev, None)
    }

    /// A backend whose queues hand their writes' compression to `pool`
    /// (shared with every other backend of the process).
    pub fn with_pool(dev: Arc<BlkDevice>, pool: Option<Arc<CompressPool>>) -> BlkBackend {
        let pool = pool.filter(|p| p.threads() > 0);
        BlkBackend {
            pool,
            poll: Duration::ZERO,
            mem: GuestMemoryAtomic::new(GuestMemoryMmap::new()),
            event_idx: AtomicBool::new(false),
            acked_features: AtomicU64::new(0),
            exit_consumers: Mutex::new(Vec::new()),
            queue_errors: RateLimit::new(Duration::from_secs(1)),
            scratch: (0..dev.num_queues()).map(|_| Mutex::new(None)).collect(),
            gate_closed: AtomicBool::new(false),
            gate: Mutex::new(Gate::default()),
            dev,
        }
    }

    /// Queue threads watch their ring for up to `max` after it ran dry
    /// before they sleep ([`Poller`]); zero: never.
    pub fn with_poll(mut self, max: Duration) -> BlkBackend {
        self.poll = max;
        self
    }

    /// A backend that takes no request until [`BlkBackend::open_gate`]: the
    /// frontend connects and sets up its rings, and what it submits waits.
    pub fn new_gated(dev: Arc<BlkDevice>, pool: Option<Arc<CompressPool>>) -> BlkBackend {
        let b = BlkBackend::with_pool(dev, pool);
        b.gate_closed.store(true, Ordering::SeqCst);
        b.gate.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        b
    }

    pub fn gated(&self) -> bool {
        self.gate_closed.load(Ordering::SeqCst)
    }

    /// Lets requests through, and drains now the queues that were kicked
    /// while the gate was closed (their kicks are spent).
    pub fn open_gate(&self) {
        let parked = {
            let mut g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
            g.closed = false;
            self.gate_closed.store(false, Ordering::SeqCst);
            std::mem::take(&mut g.parked)
        };
        for (q, vring) in parked {
            if let Err(e) = self.process_queue(&vring, q) {
                tracing::warn!(queue = q, "virtqueue error: {e}");
            }
        }
    }

    /// Whether the gate holds this kick back (and parks its queue).
    fn held(&self, vring: &Vring, queue: usize) -> bool {
        if !self.gate_closed.load(Ordering::Relaxed) {
            return false;
        }
        let mut g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        if !g.closed {
            return false;
        }
        if !g.parked.iter().any(|(q, _)| *q == queue) {
            g.parked.push((queue, vring.clone()));
        }
        true
    }

    pub fn device(&self) -> &Arc<BlkDevice> {
        &self.dev
    }

    /// Features the frontend acknowledged.
    pub fn acked_features(&self) -> u64 {
        self.acked_features.load(Ordering::Relaxed)
    }

    /// Drains virtqueue `queue` with [`drain_queue`], holding its vring lock.
    fn process_queue(&self, vring: &Vring, queue: usize) -> Result<(), QueueError> {
        let event_idx = self.event_idx.load(Ordering::Relaxed);
        let mut scratch = self.scratch[queue]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let scratch = scratch.get_or_insert_with(|| {
            let mut s = match &self.pool {
                Some(p) => Scratch::with_pool(queue, p.clone(), self.dev.store().clone()),
                None => Scratch::new(queue),
            };
            s.poller = Poller::new(self.poll);
            s
        });
        let mut state = vring.get_mut();
        drain_queue(
            &mut *state,
            &self.mem,
            &self.dev,
            event_idx,
            scratch,
            &mut (),
        )
    }
}

/// A virtqueue and the way to interrupt its guest: what [`drain_queue`]
/// works on.
pub trait QueueRing {
    type Queue: QueueT;
    fn queue(&mut self) -> &mut Self::Queue;
    /// Sends the used-buffer notification; [`drain_queue`] has already asked
    /// the queue whether the guest wants one.
    fn notify(&mut self) -> io::Result<()>;
}

impl QueueRing for VringState<GuestMem> {
    type Queue = Queue;
    fn queue(&mut self) -> &mut Queue {
        self.get_queue_mut()
    }
    fn notify(&mut self) -> io::Result<()> {
        self.signal_used_queue()
    }
}

/// A bare queue and a notify callback, for tests and the fuzz harness.
impl<Q: QueueT, F: FnMut() -> io::Result<()>> QueueRing for (&mut Q, F) {
    type Queue = Q;
    fn queue(&mut self) -> &mut Q {
        self.0
    }
    fn notify(&mut self) -> io::Result<()> {
        (self.1)()
    }
}

/// One queue's scratch space: the request being parsed, the bounce page and
/// the store context, reused for every request so the I/O path does not
/// allocate.
pub struct Scratch {
    pub req: Request,
    pub bounce: Box<Page>,
    pub cx: Context,
    /// When the last request of this pass over the ring ended (see
    /// [`BlkDevice::execute_chained`]).
    clock: Option<std::time::Instant>,
    /// With a compress pool: the batch in flight.
    batched: Option<Batched>,
    /// Watches the ring after it ran dry (off unless the backend says).
    pub poller: Poller,
}

impl Scratch {
    /// Scratch space for queue `queue`; its store context takes the queue's
    /// allocator shard, so a device's queues never share one.
    pub fn new(queue: usize) -> Scratch {
        Scratch {
            req: Request::default(),
            bounce: Box::new([0; PAGE_SIZE]),
            cx: Context::new(queue),
            clock: None,
            batched: None,
            poller: Poller::new(Duration::ZERO),
        }
    }

    /// Scratch space for a queue of device `store` that compresses its
    /// writes on `pool`.
    pub fn with_pool(queue: usize, pool: Arc<CompressPool>, store: Arc<Device>) -> Scratch {
        Scratch {
            batched: Some(Batched {
                pool,
                batch: Batch::new(store),
                entries: Vec::new(),
            }),
            ..Scratch::new(queue)
        }
    }
}

/// A queue's batch: the requests taken from the ring, in avail order, and
/// the pool jobs of their pages.
struct Batched {
    pool: Arc<CompressPool>,
    batch: Arc<Batch>,
    /// Reused from batch to batch (with their requests' vectors); only the
    /// first `len` of a batch are live.
    entries: Vec<Entry>,
}

struct Entry {
    head: u16,
    req: Request,
    since: Instant,
    state: State,
    /// The slot a read or write starts in: its word and object are
    /// prefetched ahead of running it.
    slot: Option<u64>,
}

enum State {
    /// Runs on the queue thread when its turn comes.
    Inline,
    Malformed(RequestError),
    /// Failed before any of it ran (its pages could not be read).
    Failed(ExecError),
    /// Whole pages, jobs `first..first + n` of the batch.
    Pooled {
        first: usize,
        n: usize,
    },
}

/// Requests one batch takes from the ring before it completes them.
const BATCH_REQUESTS: usize = 128;
/// Pages a write must carry to go to the pool. Handing a page over (a copy
/// out of guest memory, a wake-up, another CPU's cache) costs about what
/// compressing it does, so a small write is cheaper on this thread; a
/// guest's swap-out is mostly writes of 16 pages and more (BENCHMARKS.md
/// §8.4), which the pool spreads over its threads.
pub const POOL_MIN_PAGES: usize = 4;

/// Why a chain got an error status.
#[derive(Debug)]
pub enum ChainError {
    /// Not a valid request (IOERR).
    Malformed(RequestError),
    /// Parsed, but the device refused or failed it (its status).
    Exec(ExecError),
}

/// Watches the chains [`drain_queue`] runs, for the fuzz harness. The
/// backend passes `()`, whose empty methods compile to nothing.
pub trait ChainHook {
    /// `chain` was taken from the ring; nothing of it has run yet.
    fn popped<M: GuestMemory>(&mut self, _chain: &DescriptorChain<&M>) {}
    /// The chain ran: `req` as parsed, `result` the payload bytes written or
    /// why it failed, `used` the length about to go to `add_used` (0: no
    /// status byte was written).
    fn ran(&mut self, _head: u16, _req: &Request, _result: &Result<u32, ChainError>, _used: u32) {}
}

impl ChainHook for () {}

/// Drains one virtqueue: pop a chain, parse it, execute it, write its status
/// byte, add it to the used ring; tell the guest every [`SIGNAL_EVERY`]
/// requests and when the ring is empty. A queue that is not ready is left
/// alone. The queue threads and the fuzz harness both run this.
///
/// With EVENT_IDX, guest notifications stay off while we work and are turned
/// back on only when the ring is empty; then we look once more, since the
/// guest may have added a request just before we re-enabled them.
///
/// Requests run one at a time on this thread and complete in the order they
/// were taken from the ring: after a backend restart QEMU rewinds the avail
/// index to the used index and submits again from there, which is exact only
/// in that order.
///
/// A ring that claims requests we cannot take (avail ring or entry in no
/// guest memory, an avail index too far ahead) would otherwise keep us
/// looping with the vring lock held: a pass that takes nothing ends the
/// drain with [`QueueError::Unreadable`], and the next kick tries again.
pub fn drain_queue<R, A, H>(
    ring: &mut R,
    mem: &A,
    dev: &BlkDevice,
    event_idx: bool,
    scratch: &mut Scratch,
    hook: &mut H,
) -> Result<(), QueueError>
where
    R: QueueRing,
    A: GuestAddressSpace,
    H: ChainHook,
{
    if !ring.queue().ready() {
        // Nothing to do until the frontend sets the ring up; not worth a log line.
        return Ok(());
    }
    scratch.poller.woke();
    if scratch.batched.is_some() {
        return drain_batched(ring, mem, dev, event_idx, scratch, hook);
    }
    loop {
        if event_idx {
            ring.queue().disable_notification(&*mem.memory())?;
        }
        // The thread may have slept since the last request ended.
        scratch.clock = None;
        let pass = Instant::now();
        let mut pending = 0u32;
        let mut taken = 0u64;
        loop {
            // A fresh snapshot per request: one published after a memory
            // table change must be served with the new table.
            let guard = mem.memory();
            let m: &A::M = &guard;
            let Some(chain) = ring.queue().pop_descriptor_chain(m) else {
                break;
            };
            taken += 1;
            let head = chain.head_index();
            hook.popped(&chain);
            let used = run_chain(m, dev, chain, scratch, head, hook);
            if let Err(e) = ring.queue().add_used(m, head, used) {
                // Still tell the guest about what did complete.
                if pending > 0 {
                    signal(ring, m)?;
                }
                return Err(e.into());
            }
            pending += 1;
            if pending == SIGNAL_EVERY {
                signal(ring, m)?;
                pending = 0;
                // The notify is not the next request's time.
                scratch.clock = None;
            }
        }
        let guard = mem.memory();
        let m: &A::M = &guard;
        if pending > 0 {
            signal(ring, m)?;
        }
        // The guest often submits again within microseconds: catching that
        // here saves it a kick and us a wake-up.
        if taken > 0 && scratch.poller.poll(ring.queue(), m, pass.elapsed()) {
            continue;
        }
        if !event_idx || !ring.queue().enable_notification(m)? {
            return Ok(());
        }
        if taken == 0 {
            return Err(QueueError::Unreadable);
        }
    }
}

fn signal<R: QueueRing, M: GuestMemory>(ring: &mut R, mem: &M) -> Result<(), QueueError> {
    if ring.queue().needs_notification(mem)? {
        if let Err(e) = ring.notify() {
            tracing::warn!("cannot signal the guest: {e}");
        }
    }
    Ok(())
}

/// Parses and runs one chain and writes its status byte; returns the used
/// length (bytes written to the guest, status included).
fn run_chain<M: GuestMemory, H: ChainHook>(
    mem: &M,
    dev: &BlkDevice,
    chain: DescriptorChain<&M>,
    scratch: &mut Scratch,
    head: u16,
    hook: &mut H,
) -> u32 {
    let Scratch {
        req,
        bounce,
        cx,
        clock,
        ..
    } = scratch;
    let result = match req.parse(chain) {
        Ok(()) => dev
            .execute_chained(mem, req, bounce, cx, clock)
            .map_err(ChainError::Exec),
        Err(e) => Err(ChainError::Malformed(e)),
    };
    finish_chain(mem, req, result, head, hook)
}

/// Writes a chain's status byte; returns the used length.
fn finish_chain<M: GuestMemory, H: ChainHook>(
    mem: &M,
    req: &Request,
    result: Result<u32, ChainError>,
    head: u16,
    hook: &mut H,
) -> u32 {
    let (status, written) = match &result {
        Ok(n) => (STATUS_OK, *n),
        Err(ChainError::Exec(e)) => {
            tracing::debug!(kind = ?req.kind, sector = req.sector, "request failed: {e}");
            (e.status(), 0)
        }
        Err(ChainError::Malformed(e)) => {
            tracing::debug!("malformed request: {e}");
            (STATUS_IOERR, 0)
        }
    };
    let used = match req.status {
        Some(addr) if crate::guest::write(mem, addr, &[status]).is_ok() => {
            written.saturating_add(1)
        }
        _ => 0,
    };
    hook.ran(head, req, &result, used);
    used
}

/// [`drain_queue`] with a compress pool. Takes up to [`BATCH_REQUESTS`]
/// chains (and [`BATCH_PAGES`] pages of whole-page writes of at least
/// [`POOL_MIN_PAGES`]) off the ring, copying each such write's pages out of
/// guest memory and handing them to the pool as it goes; then, in avail
/// order, runs the others and commits the writes, writes each status and
/// adds each to the used ring. Completions
/// stay in the order the chains were taken (see [`drain_queue`] on why QEMU
/// needs that), and so do commits: of two writes to one slot in a batch the
/// later one wins, and a read sees every write taken before it.
fn drain_batched<R, A, H>(
    ring: &mut R,
    mem: &A,
    dev: &BlkDevice,
    event_idx: bool,
    scratch: &mut Scratch,
    hook: &mut H,
) -> Result<(), QueueError>
where
    R: QueueRing,
    A: GuestAddressSpace,
    H: ChainHook,
{
    loop {
        if event_idx {
            ring.queue().disable_notification(&*mem.memory())?;
        }
        let pass = Instant::now();
        let mut pending = 0u32;
        let mut taken = 0u64;
        loop {
            let n = take_batch(ring, mem, dev, scratch, hook);
            if n == 0 {
                break;
            }
            taken += n as u64;
            if let Err(e) = complete_batch(ring, mem, dev, scratch, hook, n, &mut pending) {
                // Still tell the guest about what did complete.
                if pending > 0 {
                    signal(ring, &*mem.memory())?;
                }
                return Err(e);
            }
        }
        let guard = mem.memory();
        let m: &A::M = &guard;
        if pending > 0 {
            signal(ring, m)?;
        }
        // The guest often submits again within microseconds: catching that
        // here saves it a kick and us a wake-up.
        if taken > 0 && scratch.poller.poll(ring.queue(), m, pass.elapsed()) {
            continue;
        }
        if !event_idx || !ring.queue().enable_notification(m)? {
            return Ok(());
        }
        if taken == 0 {
            return Err(QueueError::Unreadable);
        }
    }
}

/// Pops and parses up to a batch of chains, submitting whole-page writes to
/// the pool as they come. Returns how many were taken.
fn take_batch<R, A, H>(
    ring: &mut R,
    mem: &A,
    dev: &BlkDevice,
    scratch: &mut Scratch,
    hook: &mut H,
) -> usize
where
    R: QueueRing,
    A: GuestAddressSpace,
    H: ChainHook,
{
    let b = scratch.batched.as_mut().expect("callers check");
    let mut n = 0;
    let mut pages = 0;
    while n < BATCH_REQUESTS && pages < BATCH_PAGES {
        // A fresh snapshot per request, as in `drain_queue`.
        let guard = mem.memory();
        let m: &A::M = &guard;
        let Some(chain) = ring.queue().pop_descriptor_chain(m) else {
            break;
        };
        if b.entries.len() == n {
            b.entries.push(Entry {
                head: 0,
                req: Request::default(),
                since: Instant::now(),
                state: State::Inline,
                slot: None,
            });
        }
        let e = &mut b.entries[n];
        n += 1;
        e.head = chain.head_index();
        hook.popped(&chain);
        e.slot = None;
        if let Err(err) = e.req.parse(chain) {
            e.state = State::Malformed(err);
            continue;
        }
        // Random slots are cache misses: start loading the word now, and
        // the object one request ahead of its turn (`complete_batch`).
        e.slot = dev.first_slot(&e.req);
        dev.prefetch_slot(e.slot);
        e.state = match dev.whole_page_write(&e.req) {
            // One that does not fit in what is left of the batch runs on
            // this thread at its turn.
            Some((slot, count)) if (POOL_MIN_PAGES..=BATCH_PAGES - pages).contains(&count) => {
                e.since = Instant::now();
                let first = pages;
                match copy_pages(m, &e.req, &b.batch, slot, first..first + count) {
                    Ok(()) => {
                        b.pool.submit(&b.batch, first..first + count);
                        pages += count;
                        State::Pooled { first, n: count }
                    }
                    Err(err) => State::Failed(err),
                }
            }
            _ => State::Inline,
        };
    }
    n
}

/// Copies a write's payload into the batch's job pages: the guest may change
/// its buffers while the pool compresses, the store needs stable pages.
fn copy_pages<M: GuestMemory>(
    mem: &M,
    req: &Request,
    batch: &Batch,
    first_slot: u64,
    jobs: std::ops::Range<usize>,
) -> Result<(), ExecError> {
    let mut input = SegmentCursor::new(&req.readable);
    for (k, i) in jobs.enumerate() {
        let mut job = batch.job(i);
        job.slot = first_slot + k as u64;
        input.read(mem, &mut job.page[..])?;
    }
    Ok(())
}

/// Waits for the batch's pages, then runs, commits and completes its `n`
/// requests in the order they were taken.
fn complete_batch<R, A, H>(
    ring: &mut R,
    mem: &A,
    dev: &BlkDevice,
    scratch: &mut Scratch,
    hook: &mut H,
    n: usize,
    pending: &mut u32,
) -> Result<(), QueueError>
where
    R: QueueRing,
    A: GuestAddressSpace,
    H: ChainHook,
{
    let Scratch {
        bounce,
        cx,
        batched,
        clock,
        ..
    } = scratch;
    let b = batched.as_mut().expect("callers check");
    b.pool.wait(&b.batch, cx);
    // Requests run here back to back share clock reads, as in `drain_queue`.
    *clock = None;
    // An entry that cannot be added to the used ring (a head index past
    // the queue) fails alone: the chains taken after it were taken, so they
    // still run and complete. The first error is returned at the end.
    let mut broken: Option<QueueError> = None;
    if let Some(e) = b.entries.first() {
        dev.prefetch_object(e.slot);
    }
    for i in 0..n {
        if let Some(next) = b.entries[..n].get(i + 1) {
            dev.prefetch_object(next.slot);
        }
        let e = &mut b.entries[i];
        let state = std::mem::replace(&mut e.state, State::Inline);
        let guard = mem.memory();
        let m: &A::M = &guard;
        let result = match state {
            State::Inline => dev
                .execute_chained(m, &e.req, bounce, cx, clock)
                .map_err(ChainError::Exec),
            State::Malformed(err) => Err(ChainError::Malformed(err)),
            State::Failed(err) => Err(ChainError::Exec(err)),
            State::Pooled { first, n } => {
                // Page by page, as `execute` writes them: a page that failed
                // ends the request there, the pages before it stay written.
                let mut r = Ok(0);
                for i in first..first + n {
                    match (b.batch.take(i), &r) {
                        (Some(Ok(p)), Ok(_)) => p.commit(),
                        (Some(Err(err)), Ok(_)) => r = Err(ChainError::Exec(err.into())),
                        (None, Ok(_)) => r = Err(ChainError::Exec(ExecError::Lost)),
                        // After a failure the rest are dropped, which frees them.
                        (_, Err(_)) => {}
                    }
                }
                dev.record_latency(Op::Write, cx.shard(), e.since);
                *clock = None;
                r
            }
        };
        let used = finish_chain(m, &e.req, result, e.head, hook);
        if let Err(err) = ring.queue().add_used(m, e.head, used) {
            broken.get_or_insert(err.into());
            continue;
        }
        *pending += 1;
        if *pending == SIGNAL_EVERY {
            *pending = 0;
            if let Err(err) = signal(ring, m) {
                broken.get_or_insert(err);
            }
            *clock = None;
        }
    }
    match broken {
        Some(err) => Err(err),
        None => Ok(()),
    }
}

/// Regions one frontend may map: QEMU's CONFIGURE_MEM_SLOTS maximum.
pub const MAX_MEM_REGIONS: usize = 509;
/// Bytes one frontend may map; far above any VM's RAM, far below the
/// address space the other devices of this process need.
pub const MAX_MAPPED_BYTES: u64 = 16 << 40;

/// Refuses a memory table the queue threads must not touch: a region that
/// runs past the end of its file (the first access would be SIGBUS, killing
/// every VM on this daemon), or more regions or bytes than any VM needs.
pub fn check_memory<B: vm_memory::bitmap::Bitmap>(mem: &GuestMemoryMmap<B>) -> io::Result<()> {
    let bad = |msg: String| io::Error::new(io::ErrorKind::InvalidInput, msg);
    let mut total = 0u64;
    for (n, r) in mem.iter().enumerate() {
        if n >= MAX_MEM_REGIONS {
            return Err(bad(format!("more than {MAX_MEM_REGIONS} regions")));
        }
        total = total.saturating_add(r.len());
        if total > MAX_MAPPED_BYTES {
            return Err(bad(format!(
                "more than {MAX_MAPPED_BYTES} bytes of regions"
            )));
        }
        let Some(fo) = r.file_offset() else {
            return Err(bad(format!(
                "region at {:#x} has no file",
                r.start_addr().raw_value()
            )));
        };
        let size = fo.file().metadata()?.len();
        let end = fo.start().checked_add(r.len());
        if end.is_none_or(|e| e > size) {
            return Err(bad(format!(
                "region at {:#x} maps {} bytes at file offset {} but the file has {size}",
                r.start_addr().raw_value(),
                r.len(),
                fo.start()
            )));
        }
    }
    Ok(())
}

impl Drop for BlkBackend {
    fn drop(&mut self) {
        let fds = std::mem::take(
            self.exit_consumers
                .get_mut()
                .unwrap_or_else(|e| e.into_inner()),
        );
        for fd in fds {
            // SAFETY: each fd was the read end of an exit event that the
            // framework took over with `into_raw_fd` and registered in a
            // worker's epoll; nothing else owns or closes it. Every worker
            // holds a clone of the `Arc` around us, so when we drop all
            // workers have been joined and their epolls closed.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = LogBitmap;
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        usize::from(self.dev.num_queues())
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        config::virtio_features(self.dev.readonly())
    }

    fn acked_features(&self, features: u64) {
        self.acked_features.store(features, Ordering::Relaxed);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        config::protocol_features()
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        self.dev.config().read(offset, size)
    }

    fn set_config(&self, _offset: u32, _buf: &[u8]) -> io::Result<()> {
        // Nothing in virtio-blk's config space is writable for us (no WCE).
        Err(io::Error::from_raw_os_error(libc::EPERM))
    }

    fn update_memory(&self, mem: GuestMem) -> io::Result<()> {
        let map = mem.memory();
        check_memory(&map)
            .and_then(|()| carry_log(&self.mem.memory(), &map))
            .map_err(|e| {
                tracing::warn!("refusing a guest memory table: {e}");
                e
            })?;
        self.mem
            .lock()
            .map_err(|_| io::Error::other("guest memory lock poisoned"))?
            .replace((*map).clone());
        Ok(())
    }

    /// One worker thread per queue: bit i of entry i.
    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.num_queues()).map(|i| 1u64 << i).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        match new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC) {
            Ok((consumer, notifier)) => {
                self.exit_consumers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(consumer.as_raw_fd());
                Some((consumer, notifier))
            }
            Err(e) => {
                tracing::error!("cannot create a worker exit event: {e}");
                None
            }
        }
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        if !evset.contains(EventSet::IN) {
            tracing::warn!(?evset, "unexpected event on queue {thread_id}");
            return Ok(());
        }
        // With one queue per thread the event is always 0, the thread's only
        // vring, and the thread's index is the queue's.
        let Some(vring) = vrings.get(usize::from(device_event)) else {
            tracing::warn!(device_event, "event for an unknown vring");
            return Ok(());
        };
        if thread_id >= self.scratch.len() {
            tracing::warn!(thread_id, "event for an unknown queue");
            return Ok(());
        }
        if self.held(vring, thread_id) {
            return Ok(());
        }
        // An error here would end the worker thread for good; a broken ring
        // is the guest's problem, so log it and keep serving.
        if let Err(e) = self.process_queue(vring, thread_id) {
            // A guest can fail every kick: one line a second, not one a kick.
            if let Some(suppressed) = self.queue_errors.allow() {
                tracing::warn!(queue = thread_id, suppressed, "virtqueue error: {e}");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vzram_store::{Codec, DeviceConfig, Pool, PoolConfig};

    fn backend(queues: u16, readonly: bool) -> BlkBackend {
        let pool = Pool::new(PoolConfig {
            host_mem_limit: 0,
            arena_bytes: 1 << 28,
        })
        .unwrap();
        let store = pool
            .create_device(DeviceConfig::new(1 << 20, Codec::Lz4))
            .unwrap();
        let dev = Arc::new(BlkDevice::new(store, queues, readonly, "x"));
        BlkBackend::new(dev)
    }

    /// A queue the frontend has not set up is left alone: nothing read,
    /// written or signalled. (The fuzz harness covers every ready queue.)
    #[test]
    fn drain_leaves_a_queue_that_is_not_ready_alone() {
        let b = backend(1, false);
        let mem: GuestMemoryMmap =
            GuestMemoryMmap::from_ranges(&[(vm_memory::GuestAddress(0), 0x10000)]).unwrap();
        let mut queue = Queue::new(16).unwrap();
        let mut notified = false;
        let r = drain_queue(
            &mut (&mut queue, || {
                notified = true;
                Ok(())
            }),
            &&mem,
            b.device(),
            true,
            &mut Scratch::new(0),
            &mut (),
        );
        assert!(r.is_ok());
        assert!(!notified);
        assert_eq!((queue.next_avail(), queue.next_used()), (0, 0));
    }

    /// Moves the avail index far past the ring once the first chain ran:
    /// a guest that does so while the queue thread polls.
    struct JumpAvail<'a, 'm>(&'a virtio_queue::mock::MockSplitQueue<'m, GuestMemoryMmap>);

    impl ChainHook for JumpAvail<'_, '_> {
        fn ran(&mut self, _: u16, _: &Request, _: &Result<u32, ChainError>, _: u32) {
            self.0.avail().idx().store(u16::to_le(0x8000));
        }
    }

    /// A poll that sees an avail index no ring can hold reports a new
    /// request; the next pass takes none, and the drain ends there instead
    /// of polling the same index again for ever with the vring lock held.
    #[test]
    fn a_poll_that_sees_an_impossible_avail_index_ends_the_drain() {
        use virtio_queue::desc::{split::Descriptor, RawDescriptor};
        use vm_memory::{Bytes, GuestAddress};
        for event_idx in [false, true] {
            let (tx, rx) = std::sync::mpsc::channel();
            // Its own thread: a drain that never ends fails the test
            // instead of hanging it.
            std::thread::spawn(move || {
                let b = backend(1, false);
                let mem: GuestMemoryMmap =
                    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
                let mq = virtio_queue::mock::MockSplitQueue::new(&mem, 16);
                // One flush: a header (type 4) and a status byte.
                let mut flush = [0u8; 16];
                flush[0] = 4;
                mem.write_slice(&flush, GuestAddress(0x8000)).unwrap();
                mem.write_obj(0xffu8, GuestAddress(0x9000)).unwrap();
                let chain = [
                    RawDescriptor::from(Descriptor::new(0x8000, 16, 1, 1)),
                    RawDescriptor::from(Descriptor::new(0x9000, 1, 2, 0)),
                ];
                mq.add_desc_chains(&chain, 0).unwrap();
                let mut queue: Queue = mq.create_queue().unwrap();
                queue.set_event_idx(event_idx);
                let mut scratch = Scratch::new(0);
                scratch.poller = Poller::new(Duration::from_secs(2));
                let r = drain_queue(
                    &mut (&mut queue, || Ok(())),
                    &&mem,
                    b.device(),
                    event_idx,
                    &mut scratch,
                    &mut JumpAvail(&mq),
                );
                let status = mem.read_obj::<u8>(GuestAddress(0x9000)).unwrap();
                let _ = tx.send((format!("{r:?}"), queue.next_used(), status));
            });
            let (r, used, status) = rx
                .recv_timeout(Duration::from_secs(5))
                .unwrap_or_else(|_| panic!("event_idx {event_idx}: the drain polls on"));
            assert_eq!((used, status), (1, STATUS_OK), "the flush completed");
            if event_idx {
                assert!(r.contains("Unreadable"), "{r}");
            }
        }
    }

    /// Each queue gets scratch space of its own on its first kick, with a
    /// store context on its own shard; queues never kicked get none.
    #[test]
    fn scratch_per_queue_on_first_kick() {
        let b = backend(4, false);
        let vring = Vring::new(b.mem.clone(), 16).unwrap();
        for q in [2, 1, 2] {
            b.handle_event(0, EventSet::IN, std::slice::from_ref(&vring), q)
                .unwrap();
        }
        // An event for a queue the device does not have is ignored.
        b.handle_event(0, EventSet::IN, std::slice::from_ref(&vring), 9)
            .unwrap();
        let shards: Vec<_> = b
            .scratch
            .iter()
            .map(|s| s.lock().unwrap().as_ref().map(|s| s.cx.shard()))
            .collect();
        assert_eq!(shards, [None, Some(1), Some(2), None]);
    }

    /// A gated backend takes nothing from a kicked queue (its scratch is
    /// never made) until the gate opens; then the parked queue is drained.
    #[test]
    fn a_closed_gate_parks_kicked_queues_until_it_opens() {
        let b = BlkBackend::new_gated(backend(2, false).dev.clone(), None);
        let vring = Vring::new(b.mem.clone(), 16).unwrap();
        for _ in 0..3 {
            b.handle_event(0, EventSet::IN, std::slice::from_ref(&vring), 1)
                .unwrap();
        }
        let made = |b: &BlkBackend| -> Vec<bool> {
            b.scratch
                .iter()
                .map(|s| s.lock().unwrap().is_some())
                .collect()
        };
        assert!(b.gated());
        assert_eq!(made(&b), [false, false]);
        assert_eq!(b.gate.lock().unwrap().parked.len(), 1, "parked once");
        b.open_gate();
        assert!(!b.gated());
        assert_eq!(made(&b), [false, true]);
        b.handle_event(0, EventSet::IN, std::slice::from_ref(&vring), 0)
            .unwrap();
        assert_eq!(made(&b), [true, true]);
    }

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

    #[test]
    fn one_thread_per_queue() {
        let b = backend(4, false);
        assert_eq!(b.queues_per_thread(), vec![0b1, 0b10, 0b100, 0b1000]);
        assert_eq!(b.num_queues(), 4);
        let b = backend(64, false);
        assert_eq!(b.queues_per_thread().last(), Some(&(1u64 << 63)));
    }

    #[test]
    fn features_and_config() {
        let b = backend(2, true);
        assert_ne!(
            b.features() & (1 << virtio_bindings::virtio_blk::VIRTIO_BLK_F_RO),
            0
        );
        assert!(b
            .protocol_features()
            .contains(VhostUserProtocolFeatures::CONFIG));
        assert_eq!(b.get_config(0, 60).len(), 60);
        assert_eq!(b.get_config(34, 2), 2u16.to_le_bytes().to_vec());
    }
}
