//! The vhost-user-blk client: libblkio's `virtio-blk-vhost-user` driver, one thread per
//! queue, each with its own `Blkioq` and its own slots in one shared memory region.

use crate::data::{Corpus, PAGE};
use crate::error::{bail, Context, Result};
use crate::job::{Dir, Op, OpGen};
use crate::measure::{Phase, Window, WorkerStats};
use blkio::{Blkio, Blkioq, Completion, Errno, MemoryRegion, ReqFlags};
use std::mem::MaybeUninit;
use std::path::Path;
use std::time::{Duration, Instant};

/// Largest request used to prefill (fewer, bigger writes fill faster).
const PREFILL_CHUNK: u64 = 128 * 1024;
/// Requests in flight per queue while prefilling.
pub const PREFILL_DEPTH: u32 = 16;

pub struct Conn {
    /// Dropped before the region is unmapped (see `Drop`).
    pub queues: Vec<Blkioq>,
    blkio: Blkio,
    region: MemoryRegion,
    /// Bytes of buffer per in-flight slot.
    pub slot_bytes: usize,
    pub slots_per_queue: u32,
    pub capacity: u64,
    pub prefill_chunk: u64,
}

/// Each queue's slots live at `base + (queue * slots + slot) * slot_bytes`.
#[derive(Clone, Copy)]
pub struct Buffers {
    base: usize,
    slot_bytes: usize,
    slots_per_queue: usize,
}

impl Conn {
    pub fn connect(socket: &Path, queues: u32, iodepth: u32, bs: u64, poll: bool) -> Result<Conn> {
        Self::connect_sized(socket, queues, iodepth, bs, poll, None)
    }

    /// One queue and one 4 KiB buffer: what a frontend that stays connected but idle
    /// needs (density, restart), so the guest memory a worker maps stays small.
    pub fn connect_small(socket: &Path) -> Result<Conn> {
        Self::connect_sized(socket, 1, 1, PAGE as u64, false, Some((1, PAGE)))
    }

    /// `buffers`: (slots per queue, bytes per slot) instead of the benchmark's sizes.
    fn connect_sized(
        socket: &Path,
        queues: u32,
        iodepth: u32,
        bs: u64,
        poll: bool,
        buffers: Option<(u32, usize)>,
    ) -> Result<Conn> {
        let mut b = Blkio::new("virtio-blk-vhost-user")?;
        b.set_str("path", &socket.to_string_lossy())?;
        // The daemon creates its socket (bind) a moment before it listens, so a refused
        // connection right after start-up is retried briefly.
        let t0 = Instant::now();
        loop {
            match b.connect() {
                Ok(()) => break,
                Err(e)
                    if e.errno() == Errno::CONNREFUSED && t0.elapsed() < Duration::from_secs(5) =>
                {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e).context(format!("connecting to {}", socket.display())),
            }
        }
        let max_queues = b.get_i32("max-queues").unwrap_or(1);
        if queues as i32 > max_queues {
            bail!("target offers {max_queues} queues, {queues} requested");
        }
        if poll {
            b.set_i32("num-queues", 0)?;
            b.set_i32("num-poll-queues", queues as i32)?;
        } else {
            b.set_i32("num-queues", queues as i32)?;
        }
        // Each request takes 3 descriptors (header, data, status) with no indirect
        // descriptors, so a 256-entry ring holds 85 requests; grow it for deeper queues.
        let depth = buffers.map_or(iodepth.max(PREFILL_DEPTH), |(slots, _)| slots);
        let want = (3 * depth).next_power_of_two().max(256);
        if want > 256 {
            b.set_i32("queue-size", want.min(1024) as i32)?;
        }
        let capacity = b.get_u64("capacity")?;
        // Respect the device's segment size for the big prefill writes.
        let max_seg = b.get_i32("max-segment-len").unwrap_or(0).max(0) as u64;
        let mut prefill_chunk = PREFILL_CHUNK.max(bs);
        if max_seg >= PAGE as u64 {
            prefill_chunk = prefill_chunk
                .min(max_seg & !(PAGE as u64 - 1))
                .max(bs.min(max_seg));
        }
        let out = b.start()?;
        let qs = if poll { out.poll_queues } else { out.queues };
        let (slots_per_queue, slot_bytes) =
            buffers.unwrap_or((iodepth.max(PREFILL_DEPTH), prefill_chunk.max(bs) as usize));
        let align = b.get_u64("mem-region-alignment")?.max(PAGE as u64) as usize;
        let len = (slot_bytes * slots_per_queue as usize * queues as usize).div_ceil(align) * align;
        let region = b.alloc_mem_region(len)?;
        b.map_mem_region(&region)?;
        Ok(Conn {
            queues: qs,
            blkio: b,
            region,
            slot_bytes,
            slots_per_queue,
            capacity,
            prefill_chunk,
        })
    }

    pub fn buffers(&self) -> Buffers {
        Buffers {
            base: self.region.addr,
            slot_bytes: self.slot_bytes,
            slots_per_queue: self.slots_per_queue as usize,
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Queues first: the region must stay mapped while requests can be in flight.
        self.queues.clear();
        self.blkio.unmap_mem_region(&self.region);
    }
}

struct Slot {
    op: Op,
    at: Instant,
}

pub struct WorkerCfg<'a> {
    pub queue_index: u32,
    pub iodepth: u32,
    pub corpus: &'a Corpus,
    /// Check read data against the corpus.
    pub verify: bool,
    /// Reads of never-written blocks return zeros; accept those when verifying.
    pub allow_zero: bool,
    /// First byte of this queue's slice, to index the written-page bitmap.
    pub slice_start: u64,
    /// Wait after a completion before submitting the next request.
    pub think: Duration,
}

/// Run `gen` on `q` within `window`, keeping `iodepth` requests in flight.
pub fn run_queue(
    q: &mut Blkioq,
    bufs: Buffers,
    cfg: &WorkerCfg,
    mut gen: OpGen,
    window: Window,
    written: &mut Bitmap,
) -> Result<WorkerStats> {
    let depth = cfg.iodepth as usize;
    if depth > bufs.slots_per_queue {
        bail!(
            "iodepth {depth} exceeds the {} buffers per queue",
            bufs.slots_per_queue
        );
    }
    let slot_base = bufs.base + cfg.queue_index as usize * bufs.slots_per_queue * bufs.slot_bytes;
    let buf_ptr = |slot: usize| (slot_base + slot * bufs.slot_bytes) as *mut u8;
    let mut slots: Vec<Option<Slot>> = (0..depth).map(|_| None).collect();
    let mut completions: Vec<MaybeUninit<Completion>> =
        (0..depth).map(|_| MaybeUninit::uninit()).collect();
    let mut stats = WorkerStats::default();
    let mut phase = Phase::new(window);
    let mut inflight = 0usize;

    let submit = |q: &mut Blkioq, slot: usize, op: Op, slots: &mut Vec<Option<Slot>>| {
        let ptr = buf_ptr(slot);
        match op.dir {
            Dir::Write => {
                // SAFETY: slot buffers are disjoint `slot_bytes`-sized pieces of the mapped
                // region, op.len <= slot_bytes, and this slot has no request in flight.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr, op.len) };
                cfg.corpus.fill(op.offset, buf);
                slots[slot] = Some(Slot {
                    op,
                    at: Instant::now(),
                });
                q.write(op.offset, ptr, op.len, slot, ReqFlags::empty());
            }
            Dir::Read => {
                // libblkio's read/write take raw pointers: the device owns this slot's
                // buffer until its completion, and a slot is only reused after that.
                slots[slot] = Some(Slot {
                    op,
                    at: Instant::now(),
                });
                q.read(op.offset, ptr, op.len, slot, ReqFlags::empty());
            }
        }
    };

    for slot in 0..depth {
        match gen.next_op() {
            Some(op) => {
                submit(q, slot, op, &mut slots);
                inflight += 1;
            }
            None => break,
        }
    }

    let mut idle = Duration::ZERO;
    while inflight > 0 {
        let mut timeout = Duration::from_millis(500);
        let n = match q.do_io(&mut completions, 1, Some(&mut timeout), None) {
            Ok(n) => n,
            Err(e) if e.errno() == Errno::TIME || e.errno() == Errno::INTR => {
                idle += Duration::from_millis(500);
                if idle >= Duration::from_secs(30) {
                    bail!(
                        "queue {}: no completion for 30 s, target hung",
                        cfg.queue_index
                    );
                }
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        idle = Duration::ZERO;
        let now = Instant::now();
        let counted = phase.tick(now, &mut stats);
        for c in &completions[..n] {
            // SAFETY: do_io initialised the first `n` completions.
            let c = unsafe { c.assume_init_ref() };
            let slot = c.user_data;
            let Some(s) = slots[slot].take() else {
                bail!("queue {}: completion for idle slot {slot}", cfg.queue_index);
            };
            inflight -= 1;
            if c.ret != 0 {
                let msg = if c.error_msg.is_null() {
                    String::new()
                } else {
                    // SAFETY: libblkio's error messages are static NUL-terminated strings.
                    unsafe { std::ffi::CStr::from_ptr(c.error_msg) }
                        .to_string_lossy()
                        .into_owned()
                };
                bail!(
                    "queue {}: {:?} at offset {} len {} failed: {} {msg}",
                    cfg.queue_index,
                    s.op.dir,
                    s.op.offset,
                    s.op.len,
                    Errno::from_raw_os_error(-c.ret)
                );
            }
            if s.op.dir == Dir::Write {
                written.set_range(s.op.offset - cfg.slice_start, s.op.len as u64);
            }
            if counted {
                stats.ios += 1;
                stats.bytes += s.op.len as u64;
                match s.op.dir {
                    Dir::Read => stats.reads += 1,
                    Dir::Write => stats.writes += 1,
                }
                stats
                    .hist
                    .record(now.saturating_duration_since(s.at).as_nanos() as u64);
            }
            if cfg.verify && s.op.dir == Dir::Read {
                // SAFETY: the read into this slot's buffer has completed.
                let buf = unsafe { std::slice::from_raw_parts(buf_ptr(slot), s.op.len) };
                stats.verify_errors += cfg.corpus.mismatches(s.op.offset, buf, cfg.allow_zero);
            }
            if phase.submitting() {
                if !cfg.think.is_zero() {
                    std::thread::sleep(cfg.think);
                }
                if let Some(op) = gen.next_op() {
                    submit(q, slot, op, &mut slots);
                    inflight += 1;
                }
            }
        }
        if inflight == 0 {
            phase.finish(now, &mut stats);
        }
    }
    Ok(stats)
}

/// Which 4 KiB pages of a slice have been written, to know how much data is stored.
pub struct Bitmap {
    bits: Vec<u64>,
}

impl Bitmap {
    pub fn new(len: u64) -> Self {
        let pages = len.div_ceil(PAGE as u64);
        Bitmap {
            bits: vec![0; pages.div_ceil(64) as usize],
        }
    }

    fn set_range(&mut self, off: u64, len: u64) {
        let first = off / PAGE as u64;
        for p in first..first + len.div_ceil(PAGE as u64) {
            self.bits[(p / 64) as usize] |= 1 << (p % 64);
        }
    }

    pub fn count(&self) -> u64 {
        self.bits.iter().map(|w| w.count_ones() as u64).sum()
    }
}

/// One 4 KiB request on queue 0 through slot 0's buffer, waited for: a write of
/// `data` or a read into it.
pub fn page_io(conn: &mut Conn, write: bool, offset: u64, data: &mut [u8; PAGE]) -> Result<()> {
    if conn.slot_bytes < PAGE || conn.queues.is_empty() {
        bail!("page_io: the connection has no 4 KiB buffer");
    }
    let ptr = conn.buffers().base as *mut u8;
    let q = &mut conn.queues[0];
    if write {
        // SAFETY: slot 0 is at least PAGE bytes of the mapped region and no request is
        // in flight on this connection (every request here is waited for).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, PAGE) };
        q.write(offset, ptr, PAGE, 0, ReqFlags::empty());
    } else {
        q.read(offset, ptr, PAGE, 0, ReqFlags::empty());
    }
    let mut c = [MaybeUninit::<Completion>::uninit()];
    let mut timeout = Duration::from_secs(10);
    let n = q.do_io(&mut c, 1, Some(&mut timeout), None)?;
    if n != 1 {
        bail!("no completion within 10 s");
    }
    // SAFETY: do_io returned 1, so the first completion is initialised.
    let ret = unsafe { c[0].assume_init_ref() }.ret;
    if ret != 0 {
        bail!(
            "{} at {offset} failed: {}",
            if write { "write" } else { "read" },
            Errno::from_raw_os_error(-ret)
        );
    }
    if !write {
        // SAFETY: the read into slot 0 (PAGE bytes) has completed.
        unsafe { std::ptr::copy_nonoverlapping(ptr, data.as_mut_ptr(), PAGE) };
    }
    Ok(())
}

/// Connect, read the first 4 KiB, disconnect: proves a device is actually served.
pub fn probe(socket: &Path) -> Result<()> {
    let mut conn = Conn::connect(socket, 1, 1, PAGE as u64, false)?;
    let mut buf = [0u8; PAGE];
    page_io(&mut conn, false, 0, &mut buf).context(format!("probe of {}", socket.display()))
}
