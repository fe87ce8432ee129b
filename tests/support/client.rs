//! A `blkio` client (driver `virtio-blk-vhost-user`) on one vzram device,
//! one queue per thread, each with its own slice of the shared buffer.

use std::mem::MaybeUninit;
use std::path::Path;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

use crate::daemon::Daemon;

/// Bytes of the shared buffer each queue gets.
pub const QUEUE_BUF: usize = 4 << 20;

/// How long one request may take before a test fails instead of hanging.
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// A blkio connection to one vzram device.
pub struct Client {
    pub queues: Vec<Queue>,
    // Dropped after the queues: it owns the connection and the buffers.
    pub blkio: Blkio,
    _region: MemoryRegion,
}

/// One virtqueue with its own slice of the shared buffer.
pub struct Queue {
    q: Blkioq,
    buf: *mut u8,
    len: usize,
}

// SAFETY: `buf` points into a memory region that lives as long as the Blkio
// that owns it, which outlives every Queue; each Queue has its own slice.
unsafe impl Send for Queue {}

impl Client {
    pub fn connect(socket: &Path, num_queues: usize) -> Result<Client, blkio::Error> {
        Client::connect_with(socket, num_queues, false)
    }

    /// [`Client::connect`], retried for up to 30 s while the device is not
    /// there yet (a daemon restarting, a worker coming back); the failure
    /// shows `d`'s log.
    pub fn connect_retrying(socket: &Path, num_queues: usize, d: &Daemon) -> Client {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match Client::connect(socket, num_queues) {
                Ok(c) => return c,
                Err(e) if Instant::now() > deadline => {
                    panic!("cannot connect for 30 s: {e}\n{}", d.log_text())
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    pub fn connect_with(
        socket: &Path,
        num_queues: usize,
        read_only: bool,
    ) -> Result<Client, blkio::Error> {
        let mut b = Blkio::new("virtio-blk-vhost-user")?;
        b.set_str("path", socket.to_str().expect("utf-8 path"))?;
        b.set_bool("read-only", read_only)?;
        b.connect()?;
        b.set_i32("num-queues", num_queues as i32)?;
        let started = b.start()?;
        let region = b.alloc_mem_region(QUEUE_BUF * num_queues)?;
        b.map_mem_region(&region)?;
        let queues = started
            .queues
            .into_iter()
            .enumerate()
            .map(|(i, q)| Queue {
                q,
                // SAFETY: the offset stays inside the region just allocated.
                buf: unsafe { (region.addr as *mut u8).add(i * QUEUE_BUF) },
                len: QUEUE_BUF,
            })
            .collect();
        Ok(Client {
            queues,
            blkio: b,
            _region: region,
        })
    }

    pub fn capacity(&self) -> u64 {
        self.blkio.get_u64("capacity").expect("capacity")
    }

    pub fn q(&mut self, i: usize) -> &mut Queue {
        &mut self.queues[i]
    }
}

/// A completed request's result: 0 or a negative errno (-EIO for IOERR,
/// -ENOTSUP for UNSUPP).
pub type IoResult = Result<(), i32>;

impl Queue {
    /// Its part of the shared buffer.
    pub fn buf(&mut self) -> &mut [u8] {
        // SAFETY: see `unsafe impl Send`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.buf, self.len) }
    }

    pub fn buf_ptr(&self) -> *mut u8 {
        self.buf
    }

    pub fn raw(&mut self) -> &mut Blkioq {
        &mut self.q
    }

    /// Waits for one completion; returns (user_data, ret).
    pub fn wait_one(&mut self) -> (usize, i32) {
        let mut c = [MaybeUninit::<Completion>::uninit()];
        let mut timeout = IO_TIMEOUT;
        let n = self
            .q
            .do_io(&mut c, 1, Some(&mut timeout), None)
            .expect("blkio do_io");
        assert_eq!(n, 1, "no completion within {IO_TIMEOUT:?}");
        // SAFETY: do_io filled in one completion.
        let c = unsafe { c[0].assume_init_read() };
        (c.user_data, c.ret)
    }

    fn sync(&mut self) -> IoResult {
        match self.wait_one().1 {
            0 => Ok(()),
            e => Err(e),
        }
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) -> IoResult {
        assert!(data.len() <= self.len);
        self.buf()[..data.len()].copy_from_slice(data);
        self.q
            .write(offset, self.buf, data.len(), 0, ReqFlags::empty());
        self.sync()
    }

    pub fn read(&mut self, offset: u64, len: usize) -> Result<Vec<u8>, i32> {
        assert!(len <= self.len);
        self.buf()[..len].fill(0xa5);
        self.q.read(offset, self.buf, len, 0, ReqFlags::empty());
        self.sync()?;
        Ok(self.buf()[..len].to_vec())
    }

    /// A write from several separate pieces of the buffer (one descriptor each).
    pub fn writev(&mut self, offset: u64, pieces: &[&[u8]]) -> IoResult {
        let mut iov = Vec::new();
        let mut at = 0;
        for p in pieces {
            // Leave gaps between the pieces so they really are separate.
            self.buf()[at..at + p.len()].copy_from_slice(p);
            iov.push(libc::iovec {
                // SAFETY: inside our slice of the region (checked by the copy above).
                iov_base: unsafe { self.buf.add(at) }.cast(),
                iov_len: p.len(),
            });
            at += p.len() + 512;
        }
        self.q
            .writev(offset, iov.as_ptr(), iov.len() as u32, 0, ReqFlags::empty());
        self.sync()
    }

    pub fn discard(&mut self, offset: u64, len: u64) -> IoResult {
        self.q.discard(offset, len, 0, ReqFlags::empty());
        self.sync()
    }

    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> IoResult {
        self.q.write_zeroes(offset, len, 0, ReqFlags::empty());
        self.sync()
    }

    pub fn flush(&mut self) -> IoResult {
        self.q.flush(0, ReqFlags::empty());
        self.sync()
    }
}
