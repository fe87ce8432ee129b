//! The queue threads: one per virtqueue, each draining its own ring with
//! [`drain_queue`] on every kick (the backend calls it, holding the vring
//! lock; the fuzz harness calls it too).
//!
//! One drain loop decides when a drain ends (EVENT_IDX re-enable, polling,
//! a pass that takes nothing); a strategy decides how a pass takes and
//! completes requests: `Inline`, one at a time on this thread, or
//! `Batched`, whose multi-page writes the compress pool compresses and
//! whose multi-page reads it decompresses.

use std::io;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use vhost_user_backend::VringState;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemory};
use vzram_store::{Context, Device, Op, Page, PAGE_SIZE};

use crate::device::{BlkDevice, ExecError, STATUS_IOERR, STATUS_OK};
use crate::poll::Poller;
use crate::pool::{Batch, CompressPool, GuestPage, Held, BATCH_PAGES};
use crate::ratelimit::RateLimit;
use crate::request::{Request, RequestError, RequestType, SegmentCursor};

/// Why a queue stopped draining; the guest's doing, logged and survived.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error(transparent)]
    Ring(#[from] virtio_queue::Error),
    #[error("the ring says requests are waiting but none can be read (avail ring outside guest memory?)")]
    Unreadable,
}

/// After this many requests in one go, tell the guest about the ones done so
/// far instead of holding them back until the ring is empty.
pub const SIGNAL_EVERY: u32 = 64;

/// A virtqueue and the way to interrupt its guest: what [`drain_queue`]
/// works on.
pub trait QueueRing {
    type Queue: QueueT;
    fn queue(&mut self) -> &mut Self::Queue;
    /// Sends the used-buffer notification; [`drain_queue`] has already asked
    /// the queue whether the guest wants one.
    fn notify(&mut self) -> io::Result<()>;
}

impl<M: GuestAddressSpace> QueueRing for VringState<M> {
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
    batched: Option<BatchState>,
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
            batched: Some(BatchState {
                pool,
                batch: Batch::new(store),
                entries: Vec::new(),
                written: Vec::new(),
                reads: Vec::new(),
                ptrs: Vec::new(),
            }),
            ..Scratch::new(queue)
        }
    }
}

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
/// in that order. With a compress pool the pool compresses while this
/// thread goes on parsing, but commits and completions keep that order.
///
/// A ring that claims requests we cannot take (avail ring or entry in no
/// guest memory, an avail index too far ahead) would otherwise keep us
/// looping with the vring lock held: a pass that takes nothing although
/// the ring said, just before it, that requests were waiting ends the drain
/// with [`QueueError::Unreadable`], and the next kick tries again. A pass
/// that takes nothing because nothing was there is not that: a request the
/// guest adds just after it, before notifications are back on, was not
/// kicked, and must be taken now.
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
        drain::<Batched, _, _, _>(ring, mem, dev, event_idx, scratch, hook)
    } else {
        drain::<Inline, _, _, _>(ring, mem, dev, event_idx, scratch, hook)
    }
}

/// How a pass of [`drain_queue`] takes requests off the ring and completes
/// them; `drain` around it decides when the drain ends.
trait Strategy {
    /// Takes the next requests from the ring, runs them, writes their
    /// status bytes and adds them to the used ring, counting each in
    /// `pending` (and signalling the guest when that reaches
    /// [`SIGNAL_EVERY`]). Returns how many it took: 0 when the ring gave
    /// none. On an error, `pending` still counts what was added to the used
    /// ring and not yet signalled.
    fn step<R, A, H>(
        ring: &mut R,
        mem: &A,
        dev: &BlkDevice,
        scratch: &mut Scratch,
        hook: &mut H,
        pending: &mut u32,
    ) -> Result<u64, QueueError>
    where
        R: QueueRing,
        A: GuestAddressSpace,
        H: ChainHook;
}

/// The drain loop, once for both strategies.
fn drain<S, R, A, H>(
    ring: &mut R,
    mem: &A,
    dev: &BlkDevice,
    event_idx: bool,
    scratch: &mut Scratch,
    hook: &mut H,
) -> Result<(), QueueError>
where
    S: Strategy,
    R: QueueRing,
    A: GuestAddressSpace,
    H: ChainHook,
{
    // The ring said requests were waiting when this pass began.
    let mut promised = false;
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
            match S::step(ring, mem, dev, scratch, hook, &mut pending) {
                Ok(0) => break,
                Ok(n) => taken += n,
                Err(e) => {
                    // Still tell the guest about what did complete.
                    if pending > 0 {
                        signal(ring, &*mem.memory())?;
                    }
                    return Err(e);
                }
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
            promised = true;
            continue;
        }
        if !event_idx || !ring.queue().enable_notification(m)? {
            return Ok(());
        }
        // Requests came as notifications went back on, and the guest, who
        // saw them off, did not kick: another pass takes them. A pass that
        // took nothing when the ring said there were some, or an index
        // that claims more than the ring holds (the next pass would only
        // have virtio-queue log its error again), is a ring we cannot read.
        if taken == 0 && (promised || overrun(ring.queue(), m)?) {
            return Err(QueueError::Unreadable);
        }
        promised = true;
    }
}

/// Whether the avail index claims more requests than the ring holds: none
/// can be taken.
fn overrun<Q: QueueT, M: GuestMemory>(q: &Q, m: &M) -> Result<bool, QueueError> {
    let avail = q.avail_idx(m, std::sync::atomic::Ordering::Acquire)?;
    Ok(avail.0.wrapping_sub(q.next_avail()) > q.size())
}

/// The guest memory to take the ring's next request with: none when the
/// ring has no request. A fresh snapshot per request, taken after the
/// avail index shows the request: a frontend maps the memory a request
/// uses, and has the mapping acknowledged, before it publishes the
/// request, so this snapshot covers its buffers. One taken before could
/// miss them (the request arrived meanwhile, on a loaded host): its
/// buffers would read as outside guest memory and the request fail with
/// IOERR. An avail ring we cannot read is left to the pop to report.
fn snapshot_for_next<R: QueueRing, A: GuestAddressSpace>(ring: &mut R, mem: &A) -> Option<A::T> {
    let q = ring.queue();
    let avail = q.avail_idx(&*mem.memory(), std::sync::atomic::Ordering::Acquire);
    if avail.is_ok_and(|i| i.0 == q.next_avail()) {
        return None;
    }
    Some(mem.memory())
}

/// One request at a time, start to end, on this thread.
struct Inline;

impl Strategy for Inline {
    fn step<R, A, H>(
        ring: &mut R,
        mem: &A,
        dev: &BlkDevice,
        scratch: &mut Scratch,
        hook: &mut H,
        pending: &mut u32,
    ) -> Result<u64, QueueError>
    where
        R: QueueRing,
        A: GuestAddressSpace,
        H: ChainHook,
    {
        let Some(guard) = snapshot_for_next(ring, mem) else {
            return Ok(0);
        };
        let m: &A::M = &guard;
        let Some(chain) = ring.queue().pop_descriptor_chain(m) else {
            return Ok(0);
        };
        let head = chain.head_index();
        hook.popped(&chain);
        let used = run_chain(m, dev, chain, scratch, head, hook);
        ring.queue().add_used(m, head, used)?;
        *pending += 1;
        if *pending == SIGNAL_EVERY {
            *pending = 0;
            signal(ring, m)?;
            // The notify is not the next request's time.
            scratch.clock = None;
        }
        Ok(1)
    }
}

/// Takes up to [`BATCH_REQUESTS`] chains (and [`BATCH_PAGES`] pages of
/// whole-page writes of at least [`POOL_MIN_PAGES`] and reads of at least
/// [`POOL_MIN_READ_PAGES`]) off the ring, copying each such write's pages
/// out of guest memory and handing them, and the reads' pages, to the pool
/// as it goes; then, in avail order, runs the others and commits the
/// writes, writes each status and adds each to the used ring. Completions
/// stay in the order the chains were taken (see [`drain_queue`] on why QEMU
/// needs that), and so do commits: of two writes to one slot in a batch the
/// later one wins, and a read sees every write taken before it (only reads
/// taken before any request that changes the store go to the pool: the
/// pool reads before anything commits).
struct Batched;

impl Strategy for Batched {
    fn step<R, A, H>(
        ring: &mut R,
        mem: &A,
        dev: &BlkDevice,
        scratch: &mut Scratch,
        hook: &mut H,
        pending: &mut u32,
    ) -> Result<u64, QueueError>
    where
        R: QueueRing,
        A: GuestAddressSpace,
        H: ChainHook,
    {
        let mut held = Held::default();
        let n = take_batch(ring, mem, dev, scratch, hook, &mut held);
        if n > 0 {
            complete_batch(ring, mem, dev, scratch, hook, n, pending)?;
        }
        Ok(n as u64)
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

/// One warning a second for requests the host failed: a process serves
/// one VM, so this is that VM's.
fn host_failures() -> &'static RateLimit {
    static LIMIT: OnceLock<RateLimit> = OnceLock::new();
    LIMIT.get_or_init(|| RateLimit::new(Duration::from_secs(1)))
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
            if !e.host_side() {
                tracing::debug!(kind = ?req.kind, sector = req.sector, "request failed: {e}");
            } else if let Some(suppressed) = host_failures().allow() {
                tracing::warn!(kind = ?req.kind, sector = req.sector, suppressed, "request failed: {e}");
            }
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

/// A queue's batch: the requests taken from the ring, in avail order, and
/// the pool jobs of their pages.
struct BatchState {
    pool: Arc<CompressPool>,
    batch: Arc<Batch>,
    /// Reused from batch to batch (with their requests' vectors); only the
    /// first `len` of a batch are live.
    entries: Vec<Entry>,
    /// Guest memory the requests taken so far write at their turn (data
    /// and status bytes), as [start, end) guest addresses: a read into any
    /// of it runs at its turn too, so that what lands there last is what
    /// the later request wrote.
    written: Vec<(u64, u64)>,
    /// Read jobs pointed at guest memory, handed to the pool once the
    /// batch is taken: the writes taken after them copy their pages first,
    /// as they would had the reads run at their turn.
    reads: Vec<std::ops::Range<usize>>,
    /// Where the pages of the read being pointed lie ([`point_reads`]).
    ptrs: Vec<usize>,
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
    /// A read of whole pages, jobs `first..first + n`, each decompressed
    /// straight into its page of guest memory.
    PooledRead {
        first: usize,
        n: usize,
    },
}

/// Requests one batch takes from the ring before it completes them.
const BATCH_REQUESTS: usize = 128;
/// Pages a write must carry to go to the pool. Handing a page over (a copy
/// out of guest memory, a wake-up, another CPU's cache) costs about what
/// compressing it does, so a small write is cheaper on this thread; a
/// guest's swap-out is mostly writes of 16 pages and more (BENCHMARKS.md,
/// swap-out), which the pool spreads over its threads once the device's
/// staging budget is full (until then this thread stores them raw).
pub const POOL_MIN_PAGES: usize = 4;
/// The most pool threads with which a multi-page write the staging budgets
/// have room for is staged on this thread rather than compressed by the
/// pool. With one pool thread (a 2-core host), staging a page here costs
/// this thread less than the pool's compression costs the two cores: the
/// 256 MiB burst of 64K writes went 1.3x (BENCHMARKS.md, swap-out bursts
/// stored raw). One thread writing pages to the arena file is bounded by
/// the file's lock, while more pool threads compress in parallel: with
/// more, unmeasured, the pool keeps these writes.
pub const STAGE_HERE_MAX_POOL_THREADS: usize = 1;
/// Pages a read must carry to go to the pool. A read hands over no copy,
/// only a pointer, and its pages are written where the guest wants them:
/// even 8K reads gain (BENCHMARKS.md, swap-in).
pub const POOL_MIN_READ_PAGES: usize = 2;

/// Pops and parses up to a batch of chains, submitting whole-page writes to
/// the pool as they come. Returns how many were taken.
fn take_batch<R, A, H>(
    ring: &mut R,
    mem: &A,
    dev: &BlkDevice,
    scratch: &mut Scratch,
    hook: &mut H,
    held: &mut Held<A::T>,
) -> usize
where
    R: QueueRing,
    A: GuestAddressSpace,
    H: ChainHook,
{
    let b = scratch.batched.as_mut().expect("callers check");
    b.written.clear();
    // Left over only if the last take unwound: never submit those.
    b.reads.clear();
    let mut n = 0;
    let mut pages = 0;
    let mut read_pages = 0;
    // Whether a request taken so far may change the store: reads after it
    // run at their turn, after it.
    let mut mutated = false;
    while n < BATCH_REQUESTS && pages < BATCH_PAGES {
        let Some(guard) = snapshot_for_next(ring, mem) else {
            break;
        };
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
        let parsed = e.req.parse(chain);
        // Where the requests so far write, which pooled reads must not; only
        // reads before any store change are pooled: no need after one.
        let before = b.written.len();
        if !mutated {
            b.written.extend(
                e.req
                    .writable
                    .iter()
                    .map(|s| (s.addr.0, s.addr.0.saturating_add(u64::from(s.len))))
                    .chain(e.req.status.map(|a| (a.0, a.0.saturating_add(1)))),
            );
        }
        if let Err(err) = parsed {
            e.state = State::Malformed(err);
            continue;
        }
        // Random slots are cache misses: start loading the word now, and
        // the object one request ahead of its turn (`complete_batch`).
        e.slot = dev.first_slot(&e.req);
        dev.prefetch_slot(e.slot);
        // A 4K read, the commonest request, skips the range and overlap checks.
        let poolable = !mutated && e.req.writable_len >= (POOL_MIN_READ_PAGES * PAGE_SIZE) as u64;
        let read = poolable
            .then(|| dev.whole_page_read(&e.req))
            .flatten()
            .filter(|_| !crate::request::overlaps(&b.written[..before], &e.req.writable));
        mutated |= !matches!(
            e.req.kind,
            RequestType::In | RequestType::Flush | RequestType::GetId
        );
        if let Some((slot, count)) = read {
            let first = read_pages;
            if (POOL_MIN_READ_PAGES..=BATCH_PAGES - read_pages).contains(&count)
                && point_reads(m, &e.req, &b.batch, slot, first..first + count, &mut b.ptrs)
            {
                held.keep(&b.pool, &b.batch, guard.clone());
                b.reads.push(first..first + count);
                read_pages += count;
                e.since = Instant::now();
                e.state = State::PooledRead { first, n: count };
                continue;
            }
        }
        e.state = match dev.whole_page_write(&e.req) {
            // One that does not fit in what is left of the batch runs on
            // this thread at its turn.
            // So does one the staging budgets have room for, with a pool
            // of one thread: storing a page raw costs less than handing it
            // over (`STAGE_HERE_MAX_POOL_THREADS`).
            Some((slot, count))
                if (POOL_MIN_PAGES..=BATCH_PAGES - pages).contains(&count)
                    && !(b.pool.threads() <= STAGE_HERE_MAX_POOL_THREADS && dev.stages(count)) =>
            {
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
    for r in b.reads.drain(..) {
        b.pool.submit_reads(&b.batch, r);
    }
    n
}

/// Points a read's jobs at its pages of guest memory. False when a page is
/// not one piece of one region, or overlaps another page of the read (two
/// threads would write it at once; in order, the later page wins): the
/// read then runs on this thread, at its turn, and the jobs are not
/// submitted. `ptrs` is scratch space.
fn point_reads<M: GuestMemory>(
    mem: &M,
    req: &Request,
    batch: &Batch,
    first_slot: u64,
    jobs: std::ops::Range<usize>,
    ptrs: &mut Vec<usize>,
) -> bool {
    let mut out = SegmentCursor::new(&req.writable);
    ptrs.clear();
    for (k, i) in jobs.enumerate() {
        let Some(ptr) = out
            .next_whole(PAGE_SIZE)
            .and_then(|a| crate::guest::ptr_mut(mem, a, PAGE_SIZE))
        else {
            return false;
        };
        let p = ptr.as_ptr() as usize;
        if ptrs.iter().any(|&q| p.abs_diff(q) < PAGE_SIZE) {
            return false;
        }
        ptrs.push(p);
        // SAFETY: PAGE_SIZE bytes of one region (ptr_mut checked them),
        // kept mapped by the snapshot `mem` derefs from, which the caller
        // holds (`Held`) until the batch's jobs are done; the pool writes
        // them only with read_page, as `guest::with_mut`'s contract asks.
        batch.read_job(i, first_slot + k as u64, unsafe { GuestPage::new(ptr) });
    }
    true
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
        input.read(mem, &mut job.page_mut()[..])?;
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
            State::PooledRead { first, n } => {
                let mut r = Ok(e.req.writable_len as u32);
                for i in first..first + n {
                    match (b.batch.take_read(i), &r) {
                        (Some(Ok(())), _) | (_, Err(_)) => {}
                        (Some(Err(err)), Ok(_)) => r = Err(ChainError::Exec(err.into())),
                        (None, Ok(_)) => r = Err(ChainError::Exec(ExecError::Lost)),
                    }
                }
                // Every page was written, even after a failed one.
                let mut out = SegmentCursor::new(&e.req.writable);
                while let Some(a) = out.next_whole(PAGE_SIZE) {
                    crate::guest::mark_dirty(m, a, PAGE_SIZE);
                }
                dev.record_latency(Op::Read, cx.shard(), e.since);
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

#[cfg(test)]
mod tests;
