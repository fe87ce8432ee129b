//! [`RawDev`]: the vhost-user handshake, one split virtqueue written by
//! hand in guest RAM, and virtio-blk requests on it.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VringConfigData};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::ram::Ram;
use super::ring::*;

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
