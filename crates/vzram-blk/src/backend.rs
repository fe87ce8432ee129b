//! The vhost-user-backend glue: one worker thread per virtqueue, which
//! drains its ring with [`crate::queue`] on every kick.
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
use std::time::Duration;

use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringT};
use vm_memory::{
    Address, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap,
    GuestMemoryRegion,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::config::{self, MAX_QUEUE_SIZE};
use crate::device::BlkDevice;
use crate::dirty::{carry_log, LogBitmap};
use crate::poll::Poller;
use crate::pool::CompressPool;
use crate::queue::{drain_queue, QueueError, Scratch};
use crate::ratelimit::RateLimit;
use crate::thread_hook::ThreadHook;
use crate::vring::BlkVring;

/// Guest memory as the framework hands it to us. Every region carries a
/// dirty bitmap that SET_LOG_BASE points at the frontend's log: our writes
/// (read data, status bytes, used rings) go through vm-memory, which marks
/// it, so a migrating frontend copies those pages again.
pub type GuestMem = GuestMemoryAtomic<GuestMemoryMmap<LogBitmap>>;
/// Signals each new call fd once (SET_VRING_CALL); see [`crate::vring`].
type Vring = BlkVring<GuestMem>;

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
    /// Run on each queue thread before its first request.
    thread_hook: Option<ThreadHook>,
}

/// The queues kicked while the gate was closed, to drain when it opens.
#[derive(Default)]
struct Gate {
    closed: bool,
    parked: Vec<(usize, Vring)>,
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
            thread_hook: None,
            dev,
        }
    }

    /// Queue threads watch their ring for up to `max` after it ran dry
    /// before they sleep ([`Poller`]); zero: never.
    pub fn with_poll(mut self, max: Duration) -> BlkBackend {
        self.poll = max;
        self
    }

    /// Each queue thread runs `hook` on itself on its first event, before
    /// it touches its ring (see [`crate::thread_hook`]).
    pub fn with_thread_hook(mut self, hook: ThreadHook) -> BlkBackend {
        self.thread_hook = Some(hook);
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
        // Checked under the lock SET_VRING_ENABLE takes: vhost-user-backend
        // checks it at a kick, but a ring it has just registered (enabled) is
        // handed to us again without a kick, and a disable can land between
        // that hand-over and this lock (a loaded CI run served a request
        // posted after the disable was acknowledged).
        if !state.is_enabled() {
            return Ok(());
        }
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
        crate::thread_hook::run(self.thread_hook.as_ref());
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
            ..PoolConfig::default()
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

    /// A ring the frontend disabled is not drained, even when its event
    /// reaches the backend without vhost-user-backend's kick-time check (a
    /// ring it has just registered comes that way); enabled, it is.
    #[test]
    fn a_disabled_ring_is_never_drained() {
        use virtio_queue::mock::MockSplitQueue;
        use vm_memory::{GuestAddress, GuestMemoryMmap};
        let mut b = backend(1, false);
        let m: GuestMemoryMmap<LogBitmap> =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        b.mem = GuestMemoryAtomic::new(m.clone());
        let mq = MockSplitQueue::new(&m, 16);
        // One request in the ring (its descriptor is garbage: it fails, but
        // only a drain takes it off the ring).
        mq.avail().ring().ref_at(0).unwrap().store(0);
        mq.avail().idx().store(1);
        let vring = Vring::new(b.mem.clone(), 16).unwrap();
        vring.set_queue_size(16);
        vring
            .set_queue_info(mq.desc_table_addr().0, mq.avail_addr().0, mq.used_addr().0)
            .unwrap();
        vring.set_queue_ready(true);
        let kick = |b: &BlkBackend| {
            b.handle_event(0, EventSet::IN, std::slice::from_ref(&vring), 0)
                .unwrap()
        };
        kick(&b);
        assert_eq!(vring.queue_next_avail(), 0, "a disabled ring was drained");
        vring.set_enabled(true);
        kick(&b);
        assert_eq!(
            vring.queue_next_avail(),
            1,
            "an enabled ring was not drained"
        );
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
