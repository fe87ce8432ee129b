//! A raw vhost-user-blk frontend for the hostile-client tests.
//!
//! blkio only ever sends well-formed requests, so these tests drive the
//! daemon themselves: guest RAM is a set of memfds mapped here and handed to
//! the daemon with SET_MEM_TABLE; one split virtqueue lives in that RAM at
//! fixed addresses, and descriptors, avail entries and kicks are written by
//! hand. [`RawDev::raw`] is a second handle on the same socket for sending
//! bytes that no well-behaved frontend would.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// virtio-blk request types and status bytes.
pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
pub const T_GET_ID: u32 = 8;
pub const T_DISCARD: u32 = 11;
pub const T_WRITE_ZEROES: u32 = 13;
pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;
pub const S_UNSUPP: u8 = 2;
/// What a status byte holds before the device writes it.
pub const UNTOUCHED: u8 = 0xee;

/// Descriptor flags.
pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
pub const F_INDIRECT: u16 = 4;

/// Acked only by tests that ask for it: EVENT_IDX makes completions
/// depend on notification suppression.
const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;

pub const MIB: u64 = 1 << 20;

/// The default guest RAM: a low region holding the ring, headers and
/// status bytes, and a high region for data, with a hole in between.
pub const LOW: (u64, usize) = (0, 4 << 20);
pub const HIGH: (u64, usize) = (16 << 20, 8 << 20);
/// An address in the hole between the two regions.
pub const GAP: u64 = 8 << 20;
/// Past the end of all guest RAM.
pub const FAR: u64 = 1 << 40;

/// Where things live in guest RAM (all in the low region but DATA).
pub const DESC: u64 = 0x1000; // up to 1024 descriptors: 0x1000..0x5000
pub const AVAIL: u64 = 0x5000; // 4 + 2 * 1024 + 2 bytes
pub const USED: u64 = 0x6000; // 4 + 8 * 1024 + 2 bytes
pub const HDR: u64 = 0x9000; // request headers, 16 bytes each
pub const STATUS: u64 = 0xa000; // status bytes, 1 apart
pub const SCRATCH: u64 = 0xb000; // indirect tables, discard segments ...
pub const DATA_LO: u64 = 0x10_0000; // data in the low region (up to 3 MiB)
pub const DATA: u64 = HIGH.0; // data in the high region (8 MiB)

/// A descriptor as the guest writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

/// A descriptor whose `next` is filled in by [`RawDev::chain`].
pub fn d(addr: u64, len: u32, flags: u16) -> Desc {
    Desc {
        addr,
        len,
        flags,
        next: 0,
    }
}

/// A descriptor with its `next` given.
pub fn dn(addr: u64, len: u32, flags: u16, next: u16) -> Desc {
    Desc {
        addr,
        len,
        flags,
        next,
    }
}

/// A used-ring element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Used {
    pub id: u32,
    pub len: u32,
}

/// A guest memory region as the daemon is told about it.
pub struct RamRegion {
    pub gpa: u64,
    pub size: u64,
    pub file: File,
}

/// Guest RAM: one memfd per region, mapped here through vm-memory.
pub struct Ram {
    pub mem: GuestMemoryMmap,
    pub regions: Vec<RamRegion>,
}

/// An anonymous memory file of `size` bytes.
pub fn memfd(size: u64) -> File {
    // SAFETY: memfd_create takes a NUL-terminated name and flags, and
    // returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(c"vzram-hostile".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a new descriptor that nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).expect("size the memfd");
    f
}

impl Ram {
    /// Regions `(gpa, size)`, sorted and not overlapping.
    pub fn new(layout: &[(u64, usize)]) -> Ram {
        let regions: Vec<RamRegion> = layout
            .iter()
            .map(|&(gpa, size)| RamRegion {
                gpa,
                size: size as u64,
                file: memfd(size as u64),
            })
            .collect();
        let mem = GuestMemoryMmap::from_ranges_with_files(regions.iter().map(|r| {
            (
                GuestAddress(r.gpa),
                r.size as usize,
                Some(FileOffset::new(r.file.try_clone().expect("dup memfd"), 0)),
            )
        }))
        .expect("map guest RAM");
        Ram { mem, regions }
    }

    /// The standard two-region layout.
    pub fn standard() -> Ram {
        Ram::new(&[LOW, HIGH])
    }

    /// The memory table entries for all regions, as a VMM would send them.
    pub fn table(&self) -> Vec<VhostUserMemoryRegionInfo> {
        self.mem
            .iter()
            .map(|r| VhostUserMemoryRegionInfo::from_guest_region(r).expect("file-backed region"))
            .collect()
    }

    /// This process's address of a guest address (what ring addresses are
    /// given as in vhost-user).
    pub fn host_addr(&self, gpa: u64) -> u64 {
        let r = self
            .mem
            .find_region(GuestAddress(gpa))
            .unwrap_or_else(|| panic!("{gpa:#x} is not in guest RAM"));
        r.as_ptr() as u64 + (gpa - r.start_addr().0)
    }

    pub fn write(&self, gpa: u64, data: &[u8]) {
        self.mem
            .write_slice(data, GuestAddress(gpa))
            .unwrap_or_else(|e| panic!("write guest RAM at {gpa:#x}: {e}"));
    }

    pub fn read(&self, gpa: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mem
            .read_slice(&mut v, GuestAddress(gpa))
            .unwrap_or_else(|e| panic!("read guest RAM at {gpa:#x}: {e}"));
        v
    }

    pub fn u8_at(&self, gpa: u64) -> u8 {
        self.read(gpa, 1)[0]
    }
}

/// How far [`RawDev::connect_with`] sets the device up.
#[derive(Clone, Copy)]
pub struct Setup {
    pub queue_size: u16,
    /// Send SET_VRING_ADDR.
    pub set_addr: bool,
    /// Send SET_VRING_ENABLE(1) at the end.
    pub enable: bool,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            queue_size: 256,
            set_addr: true,
            enable: true,
        }
    }
}

/// A raw vhost-user frontend with one virtqueue (queue 0).
pub struct RawDev {
    pub fe: Frontend,
    /// The same socket, for bytes the `Frontend` would never send.
    pub raw: UnixStream,
    pub ram: Ram,
    pub features: u64,
    pub queue_size: u16,
    pub kick: EventFd,
    pub call: EventFd,
    next_avail: u16,
    last_used: u16,
}

/// How long a frontend waits for the daemon before a test fails instead
/// of hanging.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to `socket`, with a read timeout on the stream.
pub fn connect_stream(socket: &Path) -> UnixStream {
    let s =
        UnixStream::connect(socket).unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
    s.set_read_timeout(Some(REPLY_TIMEOUT)).unwrap();
    s.set_write_timeout(Some(REPLY_TIMEOUT)).unwrap();
    s
}

impl RawDev {
    /// Owner, features, protocol features (CONFIG, MQ, REPLY_ACK with every
    /// message asking for an ack) and nothing more.
    pub fn handshake(socket: &Path, ram: Ram) -> RawDev {
        RawDev::handshake_with(socket, ram, false)
    }

    /// [`RawDev::handshake`], acking EVENT_IDX too if `event_idx`.
    pub fn handshake_with(socket: &Path, ram: Ram, event_idx: bool) -> RawDev {
        RawDev::handshake_acking(socket, ram, event_idx, VhostUserProtocolFeatures::empty())
    }

    /// [`RawDev::handshake_with`], also acking the protocol features
    /// `extra` (which must be offered). LOG_ALL is acked with LOG_SHMFD, as
    /// QEMU does while it migrates.
    pub fn handshake_acking(
        socket: &Path,
        ram: Ram,
        event_idx: bool,
        extra: VhostUserProtocolFeatures,
    ) -> RawDev {
        let stream = connect_stream(socket);
        let raw = stream.try_clone().expect("dup socket");
        let mut fe = Frontend::from_stream(stream, 1);
        fe.set_owner().expect("SET_OWNER");
        let offered = fe.get_features().expect("GET_FEATURES");
        assert_ne!(
            offered & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(),
            0,
            "the daemon offers PROTOCOL_FEATURES"
        );
        let features = if event_idx {
            assert_ne!(offered & VIRTIO_RING_F_EVENT_IDX, 0, "EVENT_IDX offered");
            offered
        } else {
            offered & !VIRTIO_RING_F_EVENT_IDX
        };
        let log_all = VhostUserVirtioFeatures::LOG_ALL.bits();
        let features = if extra.contains(VhostUserProtocolFeatures::LOG_SHMFD) {
            assert_ne!(offered & log_all, 0, "LOG_ALL offered");
            features
        } else {
            features & !log_all
        };
        fe.set_features(features).expect("SET_FEATURES");
        let proto = fe.get_protocol_features().expect("GET_PROTOCOL_FEATURES");
        let want = VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS;
        assert!(proto.contains(want), "protocol features {proto:?}");
        assert!(proto.contains(extra), "protocol features {proto:?}");
        fe.set_protocol_features(want | extra)
            .expect("SET_PROTOCOL_FEATURES");
        // From here on every message that has no reply of its own is acked,
        // so a refused message shows up as an error here.
        fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        RawDev {
            fe,
            raw,
            ram,
            features,
            queue_size: 0,
            kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            call: EventFd::new(EFD_NONBLOCK).unwrap(),
            next_avail: 0,
            last_used: 0,
        }
    }

    /// A fully set-up device on the standard RAM layout.
    pub fn connect(socket: &Path) -> RawDev {
        RawDev::connect_with(socket, Ram::standard(), Setup::default())
    }

    pub fn connect_with(socket: &Path, ram: Ram, setup: Setup) -> RawDev {
        let mut dev = RawDev::handshake(socket, ram);
        let table = dev.ram.table();
        dev.fe.set_mem_table(&table).expect("SET_MEM_TABLE");
        dev.setup_vring(setup);
        dev
    }

    /// The ring addresses as this process sees them.
    pub fn vring_config(&self, size: u16) -> VringConfigData {
        VringConfigData {
            queue_max_size: size,
            queue_size: size,
            flags: 0,
            desc_table_addr: self.ram.host_addr(DESC),
            used_ring_addr: self.ram.host_addr(USED),
            avail_ring_addr: self.ram.host_addr(AVAIL),
            log_addr: None,
        }
    }

    pub fn setup_vring(&mut self, setup: Setup) {
        self.queue_size = setup.queue_size;
        self.fe
            .set_vring_num(0, setup.queue_size)
            .expect("SET_VRING_NUM");
        if setup.set_addr {
            let cfg = self.vring_config(setup.queue_size);
            self.fe.set_vring_addr(0, &cfg).expect("SET_VRING_ADDR");
        }
        self.fe.set_vring_base(0, 0).expect("SET_VRING_BASE");
        self.fe
            .set_vring_call(0, &self.call)
            .expect("SET_VRING_CALL");
        self.fe
            .set_vring_kick(0, &self.kick)
            .expect("SET_VRING_KICK");
        if setup.enable {
            self.fe.set_vring_enable(0, true).expect("SET_VRING_ENABLE");
        }
    }

    // ---- the ring, by hand ----

    pub fn set_desc(&self, idx: u16, desc: Desc) {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&desc.addr.to_le_bytes());
        b[8..12].copy_from_slice(&desc.len.to_le_bytes());
        b[12..14].copy_from_slice(&desc.flags.to_le_bytes());
        b[14..16].copy_from_slice(&desc.next.to_le_bytes());
        self.ram.write(DESC + 16 * u64::from(idx), &b);
    }

    /// Writes `descs` into the table at `base..`, each linked to the next
    /// (F_NEXT set, `next` = its index + 1); the last keeps its own flags
    /// and `next`. Returns the head index.
    pub fn chain(&self, base: u16, descs: &[Desc]) -> u16 {
        for (i, desc) in descs.iter().enumerate() {
            let idx = base + i as u16;
            let mut desc = *desc;
            if i + 1 < descs.len() {
                desc.flags |= F_NEXT;
                desc.next = idx + 1;
            }
            self.set_desc(idx, desc);
        }
        base
    }

    /// Writes an indirect table at `at`, chained like [`RawDev::chain`].
    pub fn indirect_table(&self, at: u64, descs: &[Desc]) {
        for (i, desc) in descs.iter().enumerate() {
            let mut desc = *desc;
            if i + 1 < descs.len() {
                desc.flags |= F_NEXT;
                desc.next = i as u16 + 1;
            }
            let mut b = [0u8; 16];
            b[0..8].copy_from_slice(&desc.addr.to_le_bytes());
            b[8..12].copy_from_slice(&desc.len.to_le_bytes());
            b[12..14].copy_from_slice(&desc.flags.to_le_bytes());
            b[14..16].copy_from_slice(&desc.next.to_le_bytes());
            self.ram.write(at + 16 * i as u64, &b);
        }
    }

    /// Puts `head` in the avail ring without kicking.
    pub fn publish(&mut self, head: u16) {
        let slot = u64::from(self.next_avail % self.queue_size.max(1));
        self.ram.write(AVAIL + 4 + 2 * slot, &head.to_le_bytes());
        self.next_avail = self.next_avail.wrapping_add(1);
        fence(Ordering::SeqCst);
        self.set_avail_idx(self.next_avail);
    }

    /// Writes the avail ring's idx field, whatever it was.
    pub fn set_avail_idx(&self, idx: u16) {
        self.ram
            .mem
            .store(idx.to_le(), GuestAddress(AVAIL + 2), Ordering::Release)
            .unwrap();
        fence(Ordering::SeqCst);
    }

    pub fn avail_idx(&self) -> u16 {
        self.next_avail
    }

    pub fn kick(&self) {
        self.kick.write(1).expect("kick");
    }

    pub fn used_idx(&self) -> u16 {
        u16::from_le(
            self.ram
                .mem
                .load(GuestAddress(USED + 2), Ordering::Acquire)
                .unwrap(),
        )
    }

    /// The next used element, or None after `timeout`.
    pub fn wait_for(&mut self, timeout: Duration) -> Option<Used> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.used_idx() != self.last_used {
                let slot = u64::from(self.last_used % self.queue_size);
                let e = self.ram.read(USED + 4 + 8 * slot, 8);
                self.last_used = self.last_used.wrapping_add(1);
                return Some(Used {
                    id: u32::from_le_bytes(e[0..4].try_into().unwrap()),
                    len: u32::from_le_bytes(e[4..8].try_into().unwrap()),
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let mut p = libc::pollfd {
                fd: self.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, 20) as i32;
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut p, 1, ms) };
            let _ = self.call.read();
        }
    }

    /// The next used element; fails the test after [`REPLY_TIMEOUT`].
    pub fn wait(&mut self) -> Used {
        self.wait_for(REPLY_TIMEOUT)
            .unwrap_or_else(|| panic!("no completion within {REPLY_TIMEOUT:?}"))
    }

    /// True if nothing completes within `t`.
    pub fn quiet_for(&mut self, t: Duration) -> bool {
        std::thread::sleep(t);
        self.used_idx() == self.last_used
    }

    /// Chains `descs` at index 0, publishes, kicks and waits.
    pub fn run(&mut self, descs: &[Desc]) -> Used {
        let head = self.chain(0, descs);
        self.publish(head);
        self.kick();
        let u = self.wait();
        assert_eq!(u.id, u32::from(head), "used id");
        u
    }

    // ---- requests ----

    pub fn header(&self, at: u64, t: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&t.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.ram.write(at, &h);
    }

    /// A request with the header at HDR, `payload` in between and the status
    /// byte at STATUS. Returns (status byte, used length).
    pub fn req(&mut self, t: u32, sector: u64, payload: &[Desc]) -> (u8, u32) {
        self.header(HDR, t, sector);
        self.ram.write(STATUS, &[UNTOUCHED]);
        let mut descs = vec![d(HDR, 16, 0)];
        descs.extend_from_slice(payload);
        descs.push(d(STATUS, 1, F_WRITE));
        let u = self.run(&descs);
        (self.ram.u8_at(STATUS), u.len)
    }

    /// OUT of `data` (staged at DATA) at `sector`; returns the status.
    pub fn write(&mut self, sector: u64, data: &[u8]) -> u8 {
        self.ram.write(DATA, data);
        let (st, len) = self.req(T_OUT, sector, &[d(DATA, data.len() as u32, 0)]);
        if st == S_OK {
            assert_eq!(len, 1, "used length of a write");
        }
        st
    }

    /// IN of `len` bytes at `sector` into DATA; returns (status, data).
    pub fn read(&mut self, sector: u64, len: usize) -> (u8, Vec<u8>) {
        self.ram.write(DATA, &vec![0xa5; len]);
        let (st, used) = self.req(T_IN, sector, &[d(DATA, len as u32, F_WRITE)]);
        if st == S_OK {
            assert_eq!(used as usize, len + 1, "used length of a read");
        }
        (st, self.ram.read(DATA, len))
    }

    /// Shrinks the high memory region's file to nothing (after the daemon
    /// checked and mapped it) and kicks a write whose data lies there: the
    /// daemon's next access to it faults with SIGBUS.
    pub fn truncate_memory_and_kick(&mut self) {
        self.ram.regions[1].file.set_len(0).unwrap();
        self.header(HDR, T_OUT, 0);
        self.ram.write(STATUS, &[UNTOUCHED]);
        let head = self.chain(0, &[d(HDR, 16, 0), d(DATA, 4096, 0), d(STATUS, 1, F_WRITE)]);
        self.publish(head);
        self.kick();
    }

    /// Reads `len` bytes at byte offset `off`, in chunks, asserting OK.
    pub fn read_all(&mut self, off: u64, len: usize) -> Vec<u8> {
        const CHUNK: usize = 1 << 20;
        let mut out = Vec::with_capacity(len);
        let mut pos = 0;
        while pos < len {
            let n = CHUNK.min(len - pos);
            let (st, data) = self.read((off + pos as u64) / 512, n);
            assert_eq!(st, S_OK, "read at byte {}", off + pos as u64);
            out.extend_from_slice(&data);
            pos += n;
        }
        out
    }

    /// Writes `data` at byte offset `off`, in chunks, asserting OK.
    pub fn write_all(&mut self, off: u64, data: &[u8]) {
        const CHUNK: usize = 1 << 20;
        for (i, c) in data.chunks(CHUNK).enumerate() {
            let at = off + (i * CHUNK) as u64;
            assert_eq!(self.write(at / 512, c), S_OK, "write at byte {at}");
        }
    }

    /// DISCARD or WRITE_ZEROES with segments (sector, num_sectors, flags),
    /// staged at SCRATCH; returns the status.
    pub fn dwz(&mut self, t: u32, segs: &[(u64, u32, u32)]) -> u8 {
        let mut b = Vec::with_capacity(16 * segs.len());
        for &(sector, num, flags) in segs {
            b.extend_from_slice(&sector.to_le_bytes());
            b.extend_from_slice(&num.to_le_bytes());
            b.extend_from_slice(&flags.to_le_bytes());
        }
        self.ram.write(SCRATCH, &b);
        self.req(t, 0, &[d(SCRATCH, b.len() as u32, 0)]).0
    }

    // ---- raw protocol bytes ----

    /// Sends bytes as they are on the socket.
    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.raw.write_all(bytes).expect("send raw bytes");
    }
}

/// A vhost-user message header (version 1 unless `flags` says otherwise)
/// followed by `payload`; `size` is what the header claims.
pub fn raw_msg(code: u32, flags: u32, size: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(12 + payload.len());
    v.extend_from_slice(&code.to_le_bytes());
    v.extend_from_slice(&flags.to_le_bytes());
    v.extend_from_slice(&size.to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// What became of a connection after something was sent on it.
#[derive(Debug, PartialEq, Eq)]
pub enum Fate {
    /// The daemon closed it; these bytes came before the end.
    Dropped(Vec<u8>),
    /// Still open after the wait; these bytes came.
    Open(Vec<u8>),
}

/// Reads until the daemon closes the stream or `wait` passes.
pub fn fate(s: &mut UnixStream, wait: Duration) -> Fate {
    let deadline = Instant::now() + wait;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Fate::Open(got);
        }
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        match s.read(&mut buf) {
            Ok(0) => return Fate::Dropped(got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Fate::Open(got)
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // ECONNRESET and the like: gone.
            Err(_) => return Fate::Dropped(got),
        }
    }
}

/// Reads exactly `n` bytes (a reply of known size); None if the daemon
/// closed the connection or sent nothing in time.
pub fn read_reply(s: &mut UnixStream, n: usize) -> Option<Vec<u8>> {
    s.set_read_timeout(Some(REPLY_TIMEOUT)).unwrap();
    let mut v = vec![0; n];
    s.read_exact(&mut v).ok().map(|_| v)
}

/// vhost-user request codes used raw.
pub mod code {
    pub const GET_FEATURES: u32 = 1;
    pub const SET_FEATURES: u32 = 2;
    pub const SET_OWNER: u32 = 3;
    pub const SET_MEM_TABLE: u32 = 5;
    pub const SET_VRING_NUM: u32 = 8;
    pub const SET_PROTOCOL_FEATURES: u32 = 16;
    pub const SET_BACKEND_REQ_FD: u32 = 21;
    pub const GET_CONFIG: u32 = 24;
    pub const GPU_SET_SOCKET: u32 = 33;
}
