//! The second queue: another thread drains a second queue of the same
//! device while the input runs, with whole-page reads only (so the first
//! queue's model stays exact), and every page it read must be a version
//! that page had.

use std::hash::{DefaultHasher, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vzram_blk::config::SERIAL_LEN;
use vzram_blk::device::BlkDevice;
use vzram_blk::pool::CompressPool;
use vzram_blk::queue::{drain_queue, ChainError, ChainHook, Scratch};
use vzram_blk::request::Request;
use vzram_store::PAGE_SIZE;

use super::memory::zero;
use super::shadow::page_hash;
use super::{Harness, CACHE, F_NEXT, F_WRITE, PAGE, SECTOR, ST_OK, ST_POISON};

/// Runs the input while a second thread drains a second queue of the same
/// device; then checks every page that thread read against the versions the
/// shadow went through.
pub(super) fn run_with_reader(h: &mut Harness, data: &[u8]) {
    let rmem = CACHE
        .with(|c| c.borrow_mut().reader_mem.take())
        .unwrap_or_else(|| {
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), R_MEM as usize)])
                .expect("reader memory")
        });
    zero(&rmem, 0, R_MEM);
    let dev = Arc::clone(&h.rw);
    let pages = h.dev_size / PAGE;
    let event_idx = h.event_idx;
    let pool = h.pool.clone();
    let seed = {
        let mut x = DefaultHasher::new();
        x.write(data);
        x.finish()
    };
    let stop = AtomicBool::new(false);
    let (reads, done) = std::thread::scope(|s| {
        let reader = s.spawn(|| reader(&dev, &rmem, pages, seed, event_idx, &stop, pool));
        {
            // Set even when the run panics, or the scope would wait forever.
            let _stop = StopOnDrop(&stop);
            h.run();
        }
        reader
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    });
    h.summary.second_queue += done;
    let versions = h
        .versions
        .as_ref()
        .expect("versions are kept with a reader");
    for &(slot, hash) in &reads {
        assert!(
            versions.contains(&(slot, hash)),
            "the second queue read a version of slot {slot} it never had"
        );
    }
    CACHE.with(|c| c.borrow_mut().reader_mem = Some(rmem));
}

pub(super) struct StopOnDrop<'s>(&'s AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The reader's own guest memory (so the fuzzed chains cannot scribble on
/// its ring) and its layout.
pub(super) const R_MEM: u64 = 0x40000;
pub(super) const R_QSIZE: u16 = 32;
pub(super) const R_BATCH: usize = 8;
pub(super) const R_AVAIL: u64 = 0x1000;
pub(super) const R_USED: u64 = 0x2000;
pub(super) const R_HDR: u64 = 0x3000;
pub(super) const R_STATUS: u64 = 0x3800;
pub(super) const R_DATA: u64 = 0x10000;
/// Up to 4 pages per request.
pub(super) const R_DATA_STRIDE: u64 = 0x4000;
/// Bounds: an input takes a few milliseconds, about as long as this many
/// rounds; more would only take CPU from the main thread.
pub(super) const R_ROUNDS: usize = 64;
pub(super) const R_RECORDS: usize = 1 << 14;

/// One request of the reader: type and, for IN, first slot and page count.
#[derive(Clone, Copy, Default)]
pub(super) struct RReq {
    t: u32,
    slot: u64,
    pages: u64,
}

impl RReq {
    fn payload(&self) -> u32 {
        match self.t {
            VIRTIO_BLK_T_IN => (self.pages * PAGE) as u32,
            VIRTIO_BLK_T_GET_ID => SERIAL_LEN as u32,
            _ => 0,
        }
    }
}

/// Checks each chain of the reader's queue as it completes.
pub(super) struct ReaderHook {
    batch: [RReq; R_BATCH],
    n: usize,
}

impl ChainHook for ReaderHook {
    fn ran(&mut self, head: u16, _req: &Request, result: &Result<u32, ChainError>, used: u32) {
        let i = self.n;
        self.n += 1;
        assert_eq!(usize::from(head), 3 * i, "second queue: completion order");
        let want = self.batch[i].payload();
        match result {
            Ok(n) if *n == want => {}
            other => panic!("second queue: request {i} ended {other:?}, expected Ok({want})"),
        }
        assert_eq!(used, want + 1, "second queue: used length");
    }
}

/// Drains a second queue of `dev` in rounds of `R_BATCH` requests (whole-page
/// IN, FLUSH, GET_ID) until `stop`; returns (slot, hash) of every page read
/// and the number of requests completed.
pub(super) fn reader(
    dev: &BlkDevice,
    mem: &GuestMemoryMmap,
    pages: u64,
    seed: u64,
    event_idx: bool,
    stop: &AtomicBool,
    pool: Option<Arc<CompressPool>>,
) -> (Vec<(u64, u64)>, u64) {
    let mut queue = Queue::new(R_QSIZE).expect("queue");
    queue.set_desc_table_address(Some(0), Some(0));
    queue.set_avail_ring_address(Some(R_AVAIL as u32), Some(0));
    queue.set_used_ring_address(Some(R_USED as u32), Some(0));
    queue.set_event_idx(event_idx);
    queue.set_ready(true);
    assert!(queue.is_valid(mem), "reader queue layout");
    // The second queue: its own store context, on the other shard index;
    // in the pool mode it shares the first queue's pool, as queues do.
    let mut scratch = match pool {
        Some(p) => Scratch::with_pool(1, p, dev.store().clone()),
        None => Scratch::new(1),
    };
    let mut x = seed | 1;
    let mut reads = Vec::new();
    let mut done = 0u64;
    let mut avail = 0u16;
    let mut page = vec![0u8; PAGE_SIZE];
    for round in 0..R_ROUNDS {
        // At least one round, so every such input reaches the second queue.
        if round > 0 && stop.load(Ordering::Relaxed) {
            break;
        }
        let mut hook = ReaderHook {
            batch: [RReq::default(); R_BATCH],
            n: 0,
        };
        for (i, r) in hook.batch.iter_mut().enumerate() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *r = match x % 8 {
                6 => RReq {
                    t: VIRTIO_BLK_T_FLUSH,
                    ..RReq::default()
                },
                7 => RReq {
                    t: VIRTIO_BLK_T_GET_ID,
                    ..RReq::default()
                },
                _ => {
                    let n = (x >> 8) % 4 + 1;
                    RReq {
                        t: VIRTIO_BLK_T_IN,
                        slot: (x >> 16) % (pages - n + 1),
                        pages: n,
                    }
                }
            };
            let (hdr, status) = (R_HDR + 16 * i as u64, R_STATUS + i as u64);
            let h = Harness::header_bytes(r.t, 0, r.slot * (PAGE / SECTOR));
            mem.write_slice(&h, GuestAddress(hdr)).expect("header");
            mem.write_obj(ST_POISON, GuestAddress(status))
                .expect("status");
            let d = 3 * i as u16;
            let mut descs = vec![Descriptor::new(hdr, 16, F_NEXT, d + 1)];
            if r.payload() > 0 {
                let data = R_DATA + R_DATA_STRIDE * i as u64;
                descs.push(Descriptor::new(data, r.payload(), F_NEXT | F_WRITE, d + 2));
            }
            descs.push(Descriptor::new(status, 1, F_WRITE, 0));
            for (k, desc) in descs.into_iter().enumerate() {
                mem.write_obj(desc, GuestAddress(16 * u64::from(d + k as u16)))
                    .expect("descriptor");
            }
            let slot = R_AVAIL + 4 + 2 * u64::from(avail % R_QSIZE);
            mem.write_obj(d, GuestAddress(slot)).expect("avail ring");
            avail = avail.wrapping_add(1);
        }
        mem.write_obj(avail, GuestAddress(R_AVAIL + 2))
            .expect("avail index");
        let r = drain_queue(
            &mut (&mut queue, || Ok(())),
            &mem,
            dev,
            event_idx,
            &mut scratch,
            &mut hook,
        );
        assert!(r.is_ok(), "second queue: drain failed: {r:?}");
        assert_eq!(hook.n, R_BATCH, "second queue: chains taken");
        done += R_BATCH as u64;
        let used: u16 = mem.read_obj(GuestAddress(R_USED + 2)).expect("used index");
        assert_eq!(used, avail, "second queue: used index");
        for (i, r) in hook.batch.iter().enumerate() {
            let st: u8 = mem
                .read_obj(GuestAddress(R_STATUS + i as u64))
                .expect("status");
            assert_eq!(st, ST_OK, "second queue: status of request {i}");
            for p in 0..r.pages {
                if reads.len() == R_RECORDS {
                    break;
                }
                let at = R_DATA + R_DATA_STRIDE * i as u64 + p * PAGE;
                mem.read_slice(&mut page, GuestAddress(at)).expect("data");
                reads.push((r.slot + p, page_hash(&page)));
            }
        }
    }
    (reads, done)
}
