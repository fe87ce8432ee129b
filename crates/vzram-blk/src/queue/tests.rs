//! Unit tests of the drain loop and the batches, on virtio-queue's mock
//! rings.

use super::*;
use vm_memory::GuestMemoryMmap;
use vzram_store::{Codec, DeviceConfig, Pool, PoolConfig};

fn device() -> BlkDevice {
    let pool = Pool::new(PoolConfig {
        host_mem_limit: 0,
        arena_bytes: 1 << 28,
        ..PoolConfig::default()
    })
    .unwrap();
    let store = pool
        .create_device(DeviceConfig::new(1 << 20, Codec::Lz4))
        .unwrap();
    BlkDevice::new(store, 1, false, "x")
}

/// A queue the frontend has not set up is left alone: nothing read,
/// written or signalled. (The fuzz harness covers every ready queue.)
#[test]
fn drain_leaves_a_queue_that_is_not_ready_alone() {
    let dev = device();
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
        &dev,
        true,
        &mut Scratch::new(0),
        &mut (),
    );
    assert!(r.is_ok());
    assert!(!notified);
    assert_eq!((queue.next_avail(), queue.next_used()), (0, 0));
}

/// Two pages of one read on the same guest memory are not handed to the
/// pool (two threads would write them at once, where in order the later
/// page wins): the read runs on the queue thread at its turn.
#[test]
fn a_read_whose_pages_overlap_is_not_pooled() {
    let mem: GuestMemoryMmap =
        GuestMemoryMmap::from_ranges(&[(vm_memory::GuestAddress(0), 0x10000)]).unwrap();
    let batch = Batch::new(device().store().clone());
    let mut req = Request {
        kind: RequestType::In,
        writable_len: 2 * PAGE_SIZE as u64,
        ..Request::default()
    };
    let mut ptrs = Vec::new();
    for (second, pooled) in [
        (0x1800, false),
        (0x1000, false),
        (0x2000, true),
        (0x4000, true),
    ] {
        req.writable = [0x1000, second]
            .map(|a| crate::request::Segment {
                addr: vm_memory::GuestAddress(a),
                len: PAGE_SIZE as u32,
            })
            .to_vec();
        let ok = point_reads(&mem, &req, &batch, 0, 0..2, &mut ptrs);
        assert_eq!(ok, pooled, "pages at 0x1000 and {second:#x}");
    }
}

/// A page of test data, different for every `n`, not same-filled.
fn page_data(n: u64) -> Vec<u8> {
    (0..PAGE_SIZE as u64)
        .map(|i| (i.wrapping_mul(31) ^ (i >> 7) ^ n.wrapping_mul(0x9d)) as u8)
        .collect()
}

/// Records the order chains complete in and, when the FLUSH completes,
/// which of the writes' pages the store does not hold yet.
struct FlushWatch<'a> {
    store: &'a Device,
    /// (first slot, pages, first page's data number) of each write.
    writes: &'a [(u64, u64, u64)],
    ran: Vec<u16>,
    missing_at_flush: Option<Vec<u64>>,
}

impl ChainHook for FlushWatch<'_> {
    fn ran(&mut self, head: u16, req: &Request, _: &Result<u32, ChainError>, _: u32) {
        self.ran.push(head);
        if req.kind != crate::request::RequestType::Flush {
            return;
        }
        let mut cx = Context::new(0);
        let mut page = [0u8; PAGE_SIZE];
        let mut missing = Vec::new();
        for &(slot, pages, data) in self.writes {
            for p in 0..pages {
                self.store.read_page(&mut cx, slot + p, &mut page).unwrap();
                if page[..] != page_data(data + p)[..] {
                    missing.push(slot + p);
                }
            }
        }
        self.missing_at_flush = Some(missing);
    }
}

/// Where the mock requests put their headers (16 bytes each), status bytes
/// (one each) and data.
const HDR: u64 = 0x1000;
const STATUS: u64 = 0x2000;
const DATA: u64 = 0x10000;

/// Adds request `i` to `descs`: its header at `HDR + 16 i` (type `kind`,
/// sector `sector`), `data` (guest address, length, whether the device
/// writes it) if any, and its status byte at `STATUS + i`.
fn push_request(
    mem: &GuestMemoryMmap,
    descs: &mut Vec<virtio_queue::desc::split::Descriptor>,
    i: usize,
    (kind, sector): (u8, u64),
    data: Option<(u64, u64, bool)>,
) {
    use virtio_queue::desc::split::Descriptor;
    use vm_memory::{Bytes, GuestAddress};
    let mut h = [0u8; 16];
    h[0] = kind;
    h[8..].copy_from_slice(&sector.to_le_bytes());
    let hdr = HDR + 16 * i as u64;
    mem.write_slice(&h, GuestAddress(hdr)).unwrap();
    let d = descs.len() as u16;
    descs.push(Descriptor::new(hdr, 16, 1, d + 1));
    if let Some((addr, len, device_writes)) = data {
        let flags = if device_writes { 3 } else { 1 };
        descs.push(Descriptor::new(addr, len as u32, flags, d + 2));
    }
    descs.push(Descriptor::new(STATUS + i as u64, 1, 2, 0));
}

/// Pooled writes then a FLUSH in one batch: the FLUSH's used entry comes
/// after the writes' and, when it completes, their pages are in the
/// store. A guest's fsync must not be acknowledged before its data is
/// stored, even though FLUSH itself has nothing to do.
#[test]
fn a_flush_completes_after_the_pooled_writes_taken_before_it() {
    use virtio_queue::desc::RawDescriptor;
    use vm_memory::{Bytes, GuestAddress};
    let page = PAGE_SIZE as u64;
    let dev = device();
    let mem: GuestMemoryMmap = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x80000)]).unwrap();
    let mq = virtio_queue::mock::MockSplitQueue::new(&mem, 16);
    // (first slot, pages, data): big enough for the pool, and distinct.
    let min = POOL_MIN_PAGES as u64;
    let writes = [(0, min, 0), (2 * min, 2 * min, 100)];
    let mut descs = Vec::new();
    let mut buf = DATA;
    for (i, &(slot, pages, data)) in writes.iter().enumerate() {
        for p in 0..pages {
            mem.write_slice(&page_data(data + p), GuestAddress(buf + p * page))
                .unwrap();
        }
        let out = (1, slot * page / 512);
        push_request(&mem, &mut descs, i, out, Some((buf, pages * page, false)));
        buf += pages * page;
    }
    push_request(&mem, &mut descs, writes.len(), (4, 0), None);
    let raw: Vec<RawDescriptor> = descs.into_iter().map(RawDescriptor::from).collect();
    mq.add_desc_chains(&raw, 0).unwrap();
    let heads = [0u16, 3, 6];

    let mut queue: Queue = mq.create_queue().unwrap();
    let pool = CompressPool::new(2, 1).unwrap();
    let mut scratch = Scratch::with_pool(0, pool, dev.store().clone());
    let mut watch = FlushWatch {
        store: dev.store(),
        writes: &writes,
        ran: Vec::new(),
        missing_at_flush: None,
    };
    let r = drain_queue(
        &mut (&mut queue, || Ok(())),
        &&mem,
        &dev,
        false,
        &mut scratch,
        &mut watch,
    );
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(
        watch.missing_at_flush,
        Some(vec![]),
        "slots of writes taken before the FLUSH not stored when it completed"
    );
    assert_eq!(watch.ran, heads, "completion order");
    assert_eq!(mq.used().idx().load(), 3);
    let used: Vec<u32> = (0..3)
        .map(|i| mq.used().ring().ref_at(i).unwrap().load().id())
        .collect();
    assert_eq!(used, heads.map(u32::from), "used ring order");
    for i in 0..3 {
        let st: u8 = mem.read_obj(GuestAddress(STATUS + i)).unwrap();
        assert_eq!(st, STATUS_OK, "status of request {i}");
    }
}

/// One flush (a header of type 4 at 0x8000, its status byte at 0x9000,
/// set to 0xff) written into `mem`: its two descriptors.
fn flush_chain(mem: &GuestMemoryMmap) -> [virtio_queue::desc::RawDescriptor; 2] {
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use vm_memory::{Bytes, GuestAddress};
    let mut flush = [0u8; 16];
    flush[0] = 4;
    mem.write_slice(&flush, GuestAddress(0x8000)).unwrap();
    mem.write_obj(0xffu8, GuestAddress(0x9000)).unwrap();
    [
        RawDescriptor::from(Descriptor::new(0x8000, 16, 1, 1)),
        RawDescriptor::from(Descriptor::new(0x9000, 1, 2, 0)),
    ]
}

/// A queue's scratch space, with a pool of one thread or none.
fn scratch_for(dev: &BlkDevice, pooled: bool) -> Scratch {
    match pooled {
        false => Scratch::new(0),
        true => {
            let pool = CompressPool::new(1, 1).unwrap();
            Scratch::with_pool(0, pool, dev.store().clone())
        }
    }
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
/// Both strategies run the same loop; both are tried.
#[test]
fn a_poll_that_sees_an_impossible_avail_index_ends_the_drain() {
    use vm_memory::{Bytes, GuestAddress};
    for (event_idx, pooled) in [(false, false), (true, false), (false, true), (true, true)] {
        let (tx, rx) = std::sync::mpsc::channel();
        // Its own thread: a drain that never ends fails the test
        // instead of hanging it.
        std::thread::spawn(move || {
            let dev = device();
            let mem: GuestMemoryMmap =
                GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
            let mq = virtio_queue::mock::MockSplitQueue::new(&mem, 16);
            let chain = flush_chain(&mem);
            mq.add_desc_chains(&chain, 0).unwrap();
            let mut queue: Queue = mq.create_queue().unwrap();
            queue.set_event_idx(event_idx);
            let mut scratch = scratch_for(&dev, pooled);
            scratch.poller = Poller::new(Duration::from_secs(2));
            let r = drain_queue(
                &mut (&mut queue, || Ok(())),
                &&mem,
                &dev,
                event_idx,
                &mut scratch,
                &mut JumpAvail(&mq),
            );
            let status = mem.read_obj::<u8>(GuestAddress(0x9000)).unwrap();
            let _ = tx.send((format!("{r:?}"), queue.next_used(), status));
        });
        let (r, used, status) = rx.recv_timeout(Duration::from_secs(5)).unwrap_or_else(|_| {
            panic!("event_idx {event_idx}, pooled {pooled}: the drain polls on")
        });
        assert_eq!((used, status), (1, STATUS_OK), "the flush completed");
        if event_idx {
            assert!(r.contains("Unreadable"), "{r}");
        }
    }
}

/// A ring whose guest submits `chain` as the drain looks at the queue for
/// the `at`-th time (from 1), before the drain's call on it runs; with
/// `map`, it first maps the memory the chain uses (publishes that table).
struct SubmitAt<'a, 'm> {
    queue: &'a mut Queue,
    mq: &'a virtio_queue::mock::MockSplitQueue<'m, GuestMemoryMmap>,
    chain: &'a [virtio_queue::desc::RawDescriptor],
    map: Option<(
        &'a vm_memory::GuestMemoryAtomic<GuestMemoryMmap>,
        GuestMemoryMmap,
    )>,
    at: usize,
    looks: usize,
}

impl QueueRing for SubmitAt<'_, '_> {
    type Queue = Queue;
    fn queue(&mut self) -> &mut Queue {
        self.looks += 1;
        if self.looks == self.at {
            if let Some((mem, table)) = &self.map {
                mem.lock().unwrap().replace(table.clone());
            }
            self.mq.add_desc_chains(self.chain, 0).unwrap();
        }
        self.queue
    }
    fn notify(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// With EVENT_IDX a guest kicks only when its avail index passes the
/// avail event the drain last wrote. A drain woken with nothing to take
/// (a spurious kick, or one for requests its last poll took) whose guest
/// submits before notifications are back on got no kick for it: the drain
/// must take it, not end on it as an unreadable ring (the queue would
/// wait for a kick that never comes). Whenever the request arrives before
/// the drain's last look at the ring, the drain completes it.
#[test]
fn a_request_submitted_as_an_empty_drain_ends_is_taken() {
    use vm_memory::{Bytes, GuestAddress};
    for pooled in [false, true] {
        for at in 1..=12 {
            let dev = device();
            let mem: GuestMemoryMmap =
                GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
            let mq = virtio_queue::mock::MockSplitQueue::new(&mem, 16);
            let chain = flush_chain(&mem);
            let mut queue: Queue = mq.create_queue().unwrap();
            queue.set_event_idx(true);
            let mut scratch = scratch_for(&dev, pooled);
            let mut ring = SubmitAt {
                queue: &mut queue,
                mq: &mq,
                chain: &chain,
                map: None,
                at,
                looks: 0,
            };
            let r = drain_queue(&mut ring, &&mem, &dev, true, &mut scratch, &mut ());
            if ring.looks < at {
                // Submitted after the drain: the guest saw the avail event
                // it left and kicks.
                continue;
            }
            let status = mem.read_obj::<u8>(GuestAddress(0x9000)).unwrap();
            assert!(r.is_ok(), "pooled {pooled}, submitted at look {at}: {r:?}");
            assert_eq!(
                (queue.next_used(), status),
                (1, STATUS_OK),
                "pooled {pooled}, submitted at look {at}: the flush completed"
            );
        }
    }
}

/// A request whose buffer lies in memory the frontend mapped just before
/// submitting it is served, whenever in the drain it arrives: the drain
/// takes each request with a memory snapshot from after it saw the
/// request, never one from before (its buffer would be outside that
/// snapshot and the write would fail with IOERR, as the first write of a
/// freshly connected client did now and then on a loaded host).
#[test]
fn a_request_on_memory_mapped_just_before_it_is_served() {
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use vm_memory::{Bytes, GuestAddress, GuestRegionMmap, MmapRegion};
    for pooled in [false, true] {
        for at in 1..=12 {
            let dev = device();
            let base: GuestMemoryMmap =
                GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
            let buf = GuestRegionMmap::new(MmapRegion::new(0x1000).unwrap(), GuestAddress(0x10000))
                .unwrap();
            let mapped = base.insert_region(std::sync::Arc::new(buf)).unwrap();
            mapped
                .write_slice(&[0x5a; 0x1000], GuestAddress(0x10000))
                .unwrap();
            let mq = virtio_queue::mock::MockSplitQueue::new(&base, 16);
            // A one-page write at sector 8 from the buffer.
            let mut hdr = [0u8; 16];
            hdr[0] = 1;
            hdr[8] = 8;
            base.write_slice(&hdr, GuestAddress(0x8000)).unwrap();
            base.write_obj(0xffu8, GuestAddress(0x9000)).unwrap();
            let chain = [
                RawDescriptor::from(Descriptor::new(0x8000, 16, 1, 1)),
                RawDescriptor::from(Descriptor::new(0x10000, 0x1000, 1, 2)),
                RawDescriptor::from(Descriptor::new(0x9000, 1, 2, 0)),
            ];
            let mut queue: Queue = mq.create_queue().unwrap();
            queue.set_event_idx(true);
            let mut scratch = scratch_for(&dev, pooled);
            let mem = vm_memory::GuestMemoryAtomic::new(base.clone());
            let mut ring = SubmitAt {
                queue: &mut queue,
                mq: &mq,
                chain: &chain,
                map: Some((&mem, mapped)),
                at,
                looks: 0,
            };
            let r = drain_queue(&mut ring, &mem, &dev, true, &mut scratch, &mut ());
            if ring.looks < at {
                continue;
            }
            let status = base.read_obj::<u8>(GuestAddress(0x9000)).unwrap();
            let what = format!("pooled {pooled}, mapped and submitted at look {at}: {r:?}");
            assert!(r.is_ok(), "{what}");
            assert_eq!((queue.next_used(), status), (1, STATUS_OK), "{what}");
            let mut page = [0u8; PAGE_SIZE];
            dev.store()
                .read_page(&mut Context::new(0), 1, &mut page)
                .unwrap();
            assert!(
                page.iter().all(|&b| b == 0x5a),
                "{what}: the page was not stored"
            );
        }
    }
}

/// Panics when the `at`-th chain (from 0) is taken from the ring.
struct PanicAt {
    at: usize,
    seen: usize,
}

impl ChainHook for PanicAt {
    fn popped<M: GuestMemory>(&mut self, _: &DescriptorChain<&M>) {
        self.seen += 1;
        assert!(self.seen <= self.at, "a bug while taking a chain");
    }
}

/// A queue thread that unwinds half-way through taking a batch (a bug, the
/// backend recovers its scratch space) leaves read jobs pointed at guest
/// memory but never handed over. The next batch must not hand them over:
/// they would write pages into memory the guest has since reused, through
/// a memory snapshot nobody holds any more.
#[test]
fn read_jobs_of_a_batch_that_unwound_are_never_run() {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use virtio_queue::desc::RawDescriptor;
    use vm_memory::{Bytes, GuestAddress};
    let page = PAGE_SIZE as u64;
    let dev = device();
    let mut cx = Context::new(0);
    for slot in 0..4u64 {
        let p: Page = page_data(slot).try_into().unwrap();
        dev.store()
            .prepare_write(&mut cx, slot, &p)
            .unwrap()
            .commit();
    }
    let mem: GuestMemoryMmap = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x80000)]).unwrap();
    let mq = virtio_queue::mock::MockSplitQueue::new(&mem, 16);
    // Three reads: 2 pages (pooled), then 1 page twice.
    let reads = [(0u64, 2u64), (2, 1), (3, 1)];
    let mut descs = Vec::new();
    for (i, &(slot, pages)) in reads.iter().enumerate() {
        let buf = DATA + 4 * page * i as u64;
        let read = (0, slot * page / 512);
        push_request(&mem, &mut descs, i, read, Some((buf, pages * page, true)));
    }
    let raw: Vec<RawDescriptor> = descs.into_iter().map(RawDescriptor::from).collect();
    mq.add_desc_chains(&raw, 0).unwrap();
    let mut queue: Queue = mq.create_queue().unwrap();
    let pool = CompressPool::new(2, 1).unwrap();
    let mut scratch = Scratch::with_pool(0, pool, dev.store().clone());

    // The second chain's take unwinds: the first read was pointed, not run.
    let unwound = catch_unwind(AssertUnwindSafe(|| {
        let mut hook = PanicAt { at: 1, seen: 0 };
        drain_queue(
            &mut (&mut queue, || Ok(())),
            &&mem,
            &dev,
            false,
            &mut scratch,
            &mut hook,
        )
    }));
    assert!(unwound.is_err());
    // The guest reuses the first read's buffer (it never completed).
    mem.write_slice(&[0xa5; 2 * PAGE_SIZE], GuestAddress(DATA))
        .unwrap();
    let r = drain_queue(
        &mut (&mut queue, || Ok(())),
        &&mem,
        &dev,
        false,
        &mut scratch,
        &mut (),
    );
    assert!(r.is_ok(), "{r:?}");
    let mut got = vec![0u8; 2 * PAGE_SIZE];
    mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert!(
        got.iter().all(|&b| b == 0xa5),
        "a read job of the unwound batch ran"
    );
    // The third read ran, and only it.
    let mut third = vec![0u8; PAGE_SIZE];
    mem.read_slice(&mut third, GuestAddress(DATA + 8 * page))
        .unwrap();
    assert_eq!(third, page_data(3));
    assert_eq!(mq.used().idx().load(), 1);
    let st: u8 = mem.read_obj(GuestAddress(STATUS + 2)).unwrap();
    assert_eq!(st, STATUS_OK);
}
