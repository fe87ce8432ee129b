//! The vhost-user-backend glue: one worker thread per virtqueue.
//!
//! We implement the `&self` trait [`VhostUserBackend`], not
//! `VhostUserBackendMut`: the framework wraps a `Mut` backend in a
//! `Mutex`/`RwLock` and takes it for every queue event, which would put all
//! queues of a device behind one lock. Here a queue thread touches only its
//! own vring (whose lock nobody else takes while the device runs), atomics,
//! thread-local scratch space, and the store's per-slot locks.
//!
//! A backend lives for one frontend connection. The [`BlkDevice`] it serves
//! outlives it, so a frontend that reconnects finds its data.

use std::cell::RefCell;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{
    Address, Bytes, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap,
    GuestMemoryRegion,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};
use vzram_store::{Page, PAGE_SIZE};

use crate::config::{self, MAX_QUEUE_SIZE};
use crate::device::{BlkDevice, STATUS_IOERR, STATUS_OK};
use crate::request::Request;

/// Why a queue stopped draining; the guest's doing, logged and survived.
#[derive(Debug, thiserror::Error)]
enum QueueError {
    #[error(transparent)]
    Ring(#[from] virtio_queue::Error),
    #[error("the ring says requests are waiting but none can be read (avail ring outside guest memory?)")]
    Unreadable,
}

/// Guest memory as the framework hands it to us.
pub type GuestMem = GuestMemoryAtomic<GuestMemoryMmap>;
type Vring = VringRwLock<GuestMem>;

/// After this many requests in one go, tell the guest about the ones done so
/// far instead of holding them back until the ring is empty.
const SIGNAL_EVERY: u32 = 64;

thread_local! {
    /// Per queue thread: the request being parsed and the bounce page.
    /// Reused for every request, so the I/O path does not allocate.
    static SCRATCH: RefCell<(Request, Box<Page>)> = RefCell::new((Request::default(), Box::new([0; PAGE_SIZE])));
}

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
        BlkBackend {
            dev,
            mem: GuestMemoryAtomic::new(GuestMemoryMmap::new()),
            event_idx: AtomicBool::new(false),
            acked_features: AtomicU64::new(0),
            exit_consumers: Mutex::new(Vec::new()),
            queue_errors: RateLimit::new(Duration::from_secs(1)),
        }
    }

    pub fn device(&self) -> &Arc<BlkDevice> {
        &self.dev
    }

    /// Features the frontend acknowledged.
    pub fn acked_features(&self) -> u64 {
        self.acked_features.load(Ordering::Relaxed)
    }

    /// Drains one virtqueue. With EVENT_IDX, guest notifications stay off
    /// while we work and are turned back on only when the ring is empty;
    /// then we look once more, since the guest may have added a request
    /// just before we re-enabled them.
    ///
    /// Requests complete in the order they were taken from the ring: after
    /// a backend restart QEMU rewinds the avail index to the used index and
    /// submits again from there, which is exact only in that order.
    ///
    /// A ring that claims requests we cannot take (avail ring or entry in
    /// no guest memory, a queue not ready) would otherwise keep us looping
    /// with the vring lock held: a pass that takes nothing ends the drain,
    /// and the next kick tries again.
    fn process_queue(&self, vring: &Vring) -> Result<(), QueueError> {
        let event_idx = self.event_idx.load(Ordering::Relaxed);
        let mut state = vring.get_mut();
        if !state.get_queue().ready() {
            // Nothing to do until the frontend sets the ring up; not worth a log line.
            return Ok(());
        }
        loop {
            if event_idx {
                state
                    .get_queue_mut()
                    .disable_notification(&*self.mem.memory())?;
            }
            let mut pending = 0u32;
            let mut taken = 0u64;
            loop {
                // A fresh snapshot per request: one published after a memory
                // table change must be served with the new table.
                let mem = self.mem.memory();
                let mem: &GuestMemoryMmap = &mem;
                let Some(chain) = state.get_queue_mut().pop_descriptor_chain(mem) else {
                    break;
                };
                taken += 1;
                let head = chain.head_index();
                let used = SCRATCH.with(|s| {
                    let (req, bounce) = &mut *s.borrow_mut();
                    self.handle_chain(mem, chain, req, bounce)
                });
                if let Err(e) = state.get_queue_mut().add_used(mem, head, used) {
                    // Still tell the guest about what did complete.
                    if pending > 0 {
                        self.signal(&mut state, mem)?;
                    }
                    return Err(e.into());
                }
                pending += 1;
                if pending == SIGNAL_EVERY {
                    self.signal(&mut state, mem)?;
                    pending = 0;
                }
            }
            let mem = self.mem.memory();
            let mem: &GuestMemoryMmap = &mem;
            if pending > 0 {
                self.signal(&mut state, mem)?;
            }
            if !event_idx || !state.get_queue_mut().enable_notification(mem)? {
                return Ok(());
            }
            if taken == 0 {
                return Err(QueueError::Unreadable);
            }
        }
    }

    fn signal(
        &self,
        state: &mut vhost_user_backend::VringState<GuestMem>,
        mem: &GuestMemoryMmap,
    ) -> Result<(), QueueError> {
        if state.get_queue_mut().needs_notification(mem)? {
            if let Err(e) = state.signal_used_queue() {
                tracing::warn!("cannot signal the guest: {e}");
            }
        }
        Ok(())
    }

    /// Parses and runs one chain; returns the used length (bytes written to
    /// the guest, status included).
    fn handle_chain(
        &self,
        mem: &GuestMemoryMmap,
        chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
        req: &mut Request,
        bounce: &mut Page,
    ) -> u32 {
        let (status, written) = match req.parse(chain) {
            Ok(()) => match self.dev.execute(mem, req, bounce) {
                Ok(n) => (STATUS_OK, n),
                Err(e) => {
                    tracing::debug!(kind = ?req.kind, sector = req.sector, "request failed: {e}");
                    (e.status(), 0)
                }
            },
            Err(e) => {
                tracing::debug!("malformed request: {e}");
                (STATUS_IOERR, 0)
            }
        };
        match req.status {
            Some(addr) if mem.write_obj(status, addr).is_ok() => written.saturating_add(1),
            _ => 0,
        }
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
pub fn check_memory(mem: &GuestMemoryMmap) -> io::Result<()> {
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
    type Bitmap = ();
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
        check_memory(&map).map_err(|e| {
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
        // With one queue per thread the event is always 0, the thread's only vring.
        let Some(vring) = vrings.get(usize::from(device_event)) else {
            tracing::warn!(device_event, "event for an unknown vring");
            return Ok(());
        };
        // An error here would end the worker thread for good; a broken ring
        // is the guest's problem, so log it and keep serving.
        if let Err(e) = self.process_queue(vring) {
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
