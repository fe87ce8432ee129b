//! cloud-hypervisor's vhost-user-blk frontend, message for message.
//!
//! cloud-hypervisor cannot boot a guest here, so this test plays its part
//! with the `vhost` crate's `Frontend` (the one cloud-hypervisor uses), in
//! the order, with the features and protocol features of
//! `virtio-devices/src/vhost_user/{blk.rs,vu_common_ctrl.rs,mod.rs}`
//! (cloud-hypervisor/cloud-hypervisor at ae44c2971c83, 2026-08-22):
//!
//! - `Blk::new`: connect, SET_OWNER, GET_FEATURES; GET_PROTOCOL_FEATURES and
//!   SET_PROTOCOL_FEATURES (its list and the backend's in common), every
//!   later message with NEED_REPLY once REPLY_ACK is in; GET_QUEUE_NUM
//!   (MQ); GET_CONFIG of its 60-byte `VirtioBlockConfig` with the WRITABLE
//!   flag. No SET_FEATURES yet: the guest has not acked anything.
//! - activation (`setup_vhost_user`): SET_FEATURES (what the guest acked,
//!   plus PROTOCOL_FEATURES, within the backend's), SET_MEM_TABLE,
//!   SET_VRING_NUM for every queue, then per queue SET_VRING_ADDR,
//!   SET_VRING_BASE (the avail index in guest memory), SET_VRING_CALL,
//!   SET_VRING_KICK, and at the end SET_VRING_ENABLE(1) per queue.
//!   (INFLIGHT_SHMFD and DEVICE_STATE are not offered by vzram, so no
//!   inflight or state messages; LOG_SHMFD is, but its SET_LOG_BASE comes
//!   only with a migration, which this test does not do.)
//! - reconnect, when the backend hangs up (`reinitialize_vhost_user`):
//!   connect, SET_OWNER, GET_FEATURES, SET_PROTOCOL_FEATURES with what was
//!   acked before (no GET_PROTOCOL_FEATURES), then the activation sequence
//!   with each queue's base set to its *used* index: with VIRTIO_F_IN_ORDER
//!   negotiated and no inflight area, cloud-hypervisor replays every request
//!   after the used index, and kicks each queue whose used index lags its
//!   avail index.
//!
//! The guest is this test: its RAM is memfds, two split virtqueues live in
//! it, and it writes and reads patterns. Requests are left in flight (in
//! the avail ring, not kicked) when the daemon is SIGKILLed or upgraded
//! with SIGTERM; after the reconnect they complete, in order, and every
//! byte reads back.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VringConfigData};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vzram_tests::frontend::{Ram, REPLY_TIMEOUT};
use vzram_tests::*;

// Feature bits, as cloud-hypervisor names them.
const VIRTIO_BLK_F_SIZE_MAX: u32 = 1;
const VIRTIO_BLK_F_SEG_MAX: u32 = 2;
const VIRTIO_BLK_F_GEOMETRY: u32 = 4;
const VIRTIO_BLK_F_RO: u32 = 5;
const VIRTIO_BLK_F_BLK_SIZE: u32 = 6;
const VIRTIO_BLK_F_FLUSH: u32 = 9;
const VIRTIO_BLK_F_TOPOLOGY: u32 = 10;
const VIRTIO_BLK_F_CONFIG_WCE: u32 = 11;
const VIRTIO_BLK_F_MQ: u32 = 12;
const VIRTIO_BLK_F_DISCARD: u32 = 13;
const VIRTIO_BLK_F_WRITE_ZEROES: u32 = 14;
const VIRTIO_F_RING_INDIRECT_DESC: u32 = 28;
const VIRTIO_F_RING_EVENT_IDX: u32 = 29;
const VIRTIO_F_VERSION_1: u32 = 32;
const VIRTIO_F_IN_ORDER: u32 = 35;
const VIRTIO_F_ORDER_PLATFORM: u32 = 36;
const VIRTIO_F_NOTIFICATION_DATA: u32 = 38;

/// `DEFAULT_VIRTIO_FEATURES` of virtio-devices/src/vhost_user/mod.rs.
const DEFAULT_VIRTIO_FEATURES: u64 = (1 << VIRTIO_F_RING_INDIRECT_DESC)
    | (1 << VIRTIO_F_RING_EVENT_IDX)
    | (1 << VIRTIO_F_VERSION_1)
    | (1 << VIRTIO_F_IN_ORDER)
    | (1 << VIRTIO_F_ORDER_PLATFORM)
    | (1 << VIRTIO_F_NOTIFICATION_DATA)
    | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    | VhostUserVirtioFeatures::LOG_ALL.bits();

/// What `Blk::new` offers for a device with more than one queue.
fn ch_avail_features() -> u64 {
    (1 << VIRTIO_BLK_F_SIZE_MAX)
        | (1 << VIRTIO_BLK_F_SEG_MAX)
        | (1 << VIRTIO_BLK_F_GEOMETRY)
        | (1 << VIRTIO_BLK_F_RO)
        | (1 << VIRTIO_BLK_F_BLK_SIZE)
        | (1 << VIRTIO_BLK_F_FLUSH)
        | (1 << VIRTIO_BLK_F_TOPOLOGY)
        | (1 << VIRTIO_BLK_F_CONFIG_WCE)
        | (1 << VIRTIO_BLK_F_DISCARD)
        | (1 << VIRTIO_BLK_F_WRITE_ZEROES)
        | DEFAULT_VIRTIO_FEATURES
        | (1 << VIRTIO_BLK_F_MQ)
}

/// The protocol features `Blk::new` asks for.
fn ch_avail_protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::INFLIGHT_SHMFD
        | VhostUserProtocolFeatures::LOG_SHMFD
        | VhostUserProtocolFeatures::DEVICE_STATE
}

/// Transport feature bits a Linux guest driver keeps when offered
/// (`vring_transport_features`; IN_ORDER in kernels that implement it).
/// It drops the rest of bits 28..=41, PROTOCOL_FEATURES (30) among them.
fn guest_acks(offered: u64) -> u64 {
    let transport = (28..=41).fold(0u64, |m, b| m | 1 << b);
    let kept = (1 << VIRTIO_F_RING_INDIRECT_DESC)
        | (1 << VIRTIO_F_RING_EVENT_IDX)
        | (1 << VIRTIO_F_VERSION_1)
        | (1 << VIRTIO_F_IN_ORDER)
        | (1 << VIRTIO_F_ORDER_PLATFORM)
        | (1 << VIRTIO_F_NOTIFICATION_DATA);
    offered & (!transport | kept)
}

/// Bytes of cloud-hypervisor's `VirtioBlockConfig` (block/src/lib.rs).
const CH_CONFIG_LEN: usize = 60;

const NUM_QUEUES: usize = 2;
const QUEUE_SIZE: u16 = 256;
const DEV_SIZE: u64 = 64 << 20;
/// Bytes per request.
const REQ: usize = 64 << 10;
const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const S_OK: u8 = 0;
const UNTOUCHED: u8 = 0xee;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

/// Guest RAM: 4 MiB with the rings, headers and status bytes, a hole, then
/// 8 MiB of request buffers (4 MiB per queue, 64 KiB per request slot).
const LOW: (u64, usize) = (0, 4 << 20);
const HIGH: (u64, usize) = (16 << 20, 8 << 20);
const SLOTS: u16 = 64;

/// Where queue `q`'s pieces live in guest RAM.
fn ring_base(q: usize) -> u64 {
    0x10000 * (q as u64 + 1)
}
fn desc_addr(q: usize) -> u64 {
    ring_base(q)
}
fn avail_addr(q: usize) -> u64 {
    ring_base(q) + 0x1000
}
fn used_addr(q: usize) -> u64 {
    ring_base(q) + 0x2000
}
fn hdr_addr(q: usize, slot: u16) -> u64 {
    ring_base(q) + 0x4000 + 16 * u64::from(slot)
}
fn status_addr(q: usize, slot: u16) -> u64 {
    ring_base(q) + 0x5000 + u64::from(slot)
}
fn data_addr(q: usize, slot: u16) -> u64 {
    HIGH.0 + (q as u64) * (4 << 20) + u64::from(slot) * REQ as u64
}

/// One virtqueue as the guest driver keeps it. It outlives connections:
/// the guest does not notice the backend going away.
struct Vq {
    kick: EventFd,
    call: EventFd,
    next_avail: u16,
    last_used: u16,
    /// Heads published and not yet used, in the order they were published.
    pending: Vec<u16>,
}

/// A request the guest made: where, and what it wrote or expects to read.
#[derive(Clone)]
struct Io {
    q: usize,
    slot: u16,
    write: bool,
    sector: u64,
    data: Vec<u8>,
}

/// The guest: RAM and queues.
struct Guest {
    ram: Ram,
    vqs: Vec<Vq>,
}

impl Guest {
    fn new() -> Guest {
        Guest {
            ram: Ram::new(&[LOW, HIGH]),
            vqs: (0..NUM_QUEUES)
                .map(|_| Vq {
                    kick: EventFd::new(EFD_NONBLOCK).unwrap(),
                    call: EventFd::new(EFD_NONBLOCK).unwrap(),
                    next_avail: 0,
                    last_used: 0,
                    pending: Vec::new(),
                })
                .collect(),
        }
    }

    fn load_u16(&self, gpa: u64) -> u16 {
        u16::from_le(
            self.ram
                .mem
                .load(GuestAddress(gpa), Ordering::Acquire)
                .unwrap(),
        )
    }

    fn store_u16(&self, gpa: u64, v: u16) {
        fence(Ordering::SeqCst);
        self.ram
            .mem
            .store(v.to_le(), GuestAddress(gpa), Ordering::Release)
            .unwrap();
        fence(Ordering::SeqCst);
    }

    /// The indices cloud-hypervisor reads from guest memory on a reconnect.
    fn avail_idx(&self, q: usize) -> u16 {
        self.load_u16(avail_addr(q) + 2)
    }
    fn used_idx(&self, q: usize) -> u16 {
        self.load_u16(used_addr(q) + 2)
    }

    fn set_desc(&self, q: usize, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&addr.to_le_bytes());
        b[8..12].copy_from_slice(&len.to_le_bytes());
        b[12..14].copy_from_slice(&flags.to_le_bytes());
        b[14..16].copy_from_slice(&next.to_le_bytes());
        self.ram.write(desc_addr(q) + 16 * u64::from(idx), &b);
    }

    /// Builds the request (header, data, status: three descriptors at
    /// 3 * slot) and puts it in the avail ring, without a kick.
    fn submit(&mut self, io: &Io) {
        let (q, slot) = (io.q, io.slot);
        assert!(slot < SLOTS && io.data.len() <= REQ);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&(if io.write { T_OUT } else { T_IN }).to_le_bytes());
        h[8..16].copy_from_slice(&io.sector.to_le_bytes());
        self.ram.write(hdr_addr(q, slot), &h);
        self.ram.write(status_addr(q, slot), &[UNTOUCHED]);
        if io.write {
            self.ram.write(data_addr(q, slot), &io.data);
        } else {
            self.ram
                .write(data_addr(q, slot), &vec![0xa5; io.data.len()]);
        }
        let head = 3 * slot;
        let data_flags = if io.write { F_NEXT } else { F_NEXT | F_WRITE };
        self.set_desc(q, head, hdr_addr(q, slot), 16, F_NEXT, head + 1);
        self.set_desc(
            q,
            head + 1,
            data_addr(q, slot),
            io.data.len() as u32,
            data_flags,
            head + 2,
        );
        self.set_desc(q, head + 2, status_addr(q, slot), 1, F_WRITE, 0);
        let vq = &mut self.vqs[q];
        let at = avail_addr(q) + 4 + 2 * u64::from(vq.next_avail % QUEUE_SIZE);
        self.ram.write(at, &head.to_le_bytes());
        vq.next_avail = vq.next_avail.wrapping_add(1);
        vq.pending.push(head);
        let idx = vq.next_avail;
        self.store_u16(avail_addr(q) + 2, idx);
    }

    fn kick(&self, q: usize) {
        self.vqs[q].kick.write(1).unwrap();
    }

    /// Waits for every pending request of queue `q` to be used; checks that
    /// they come back in the order they were published (IN_ORDER).
    fn complete(&mut self, q: usize) {
        let deadline = Instant::now() + REPLY_TIMEOUT;
        while !self.vqs[q].pending.is_empty() {
            let vq = &self.vqs[q];
            if self.used_idx(q) != vq.last_used {
                let slot = u64::from(vq.last_used % QUEUE_SIZE);
                let e = self.ram.read(used_addr(q) + 4 + 8 * slot, 8);
                let id = u32::from_le_bytes(e[0..4].try_into().unwrap());
                let vq = &mut self.vqs[q];
                let want = vq.pending.remove(0);
                assert_eq!(id, u32::from(want), "queue {q}: used out of order");
                vq.last_used = vq.last_used.wrapping_add(1);
                // EVENT_IDX: the next completion we want an interrupt for,
                // as Linux's virtqueue_enable_cb does.
                let last = vq.last_used;
                self.store_u16(avail_addr(q) + 4 + 2 * u64::from(QUEUE_SIZE), last);
                continue;
            }
            assert!(
                Instant::now() < deadline,
                "queue {q}: {} requests still pending after {REPLY_TIMEOUT:?}",
                vq.pending.len()
            );
            let mut p = libc::pollfd {
                fd: vq.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut p, 1, 20) };
            let _ = vq.call.read();
        }
    }

    /// After completion: the status is OK and a read brought the data.
    fn check(&self, io: &Io) {
        assert_eq!(
            self.ram.u8_at(status_addr(io.q, io.slot)),
            S_OK,
            "status of the {} at sector {}",
            if io.write { "write" } else { "read" },
            io.sector
        );
        if !io.write {
            assert!(
                self.ram.read(data_addr(io.q, io.slot), io.data.len()) == io.data,
                "read at sector {} on queue {}: wrong data",
                io.sector,
                io.q
            );
        }
    }

    /// Submits `ios`, kicks, waits, checks.
    fn run(&mut self, ios: &[Io]) {
        for io in ios {
            self.submit(io);
        }
        for q in 0..NUM_QUEUES {
            self.kick(q);
        }
        for q in 0..NUM_QUEUES {
            self.complete(q);
        }
        for io in ios {
            self.check(io);
        }
    }

    fn vring_config(&self, q: usize) -> VringConfigData {
        VringConfigData {
            queue_max_size: QUEUE_SIZE,
            queue_size: QUEUE_SIZE,
            flags: 0,
            desc_table_addr: self.ram.host_addr(desc_addr(q)),
            used_ring_addr: self.ram.host_addr(used_addr(q)),
            avail_ring_addr: self.ram.host_addr(avail_addr(q)),
            log_addr: None,
        }
    }
}

/// `VhostUserHandle` after negotiation.
struct Ch {
    fe: Frontend,
    backend_features: u64,
}

/// `Frontend::connect` as cloud-hypervisor calls it in a loop (every 100 ms
/// while the socket is missing or refuses), but on a stream with timeouts
/// so that a daemon that stops answering fails the test instead of hanging.
fn connect(sock: &Path) -> Frontend {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match UnixStream::connect(sock) {
            Ok(s) => {
                s.set_read_timeout(Some(REPLY_TIMEOUT)).unwrap();
                s.set_write_timeout(Some(REPLY_TIMEOUT)).unwrap();
                return Frontend::from_stream(s, NUM_QUEUES as u64);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound
                        | std::io::ErrorKind::ConnectionRefused
                        | std::io::ErrorKind::Interrupted
                ) && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("connect {}: {e}", sock.display()),
        }
    }
}

/// `connect_vhost_user`: connect, SET_OWNER, GET_FEATURES.
fn connect_vhost_user(sock: &Path) -> Ch {
    let fe = connect(sock);
    fe.set_owner().expect("SET_OWNER");
    let backend_features = fe.get_features().expect("GET_FEATURES");
    Ch {
        fe,
        backend_features,
    }
}

/// What the first connection settled, kept for reconnects.
#[derive(Clone, Copy)]
struct Negotiated {
    /// Features the device offers the guest (cloud-hypervisor's ∩ vzram's).
    offered: u64,
    /// `acked_features` at activation: what the guest acked, and
    /// PROTOCOL_FEATURES.
    acked: u64,
    acked_protocol: VhostUserProtocolFeatures,
}

/// `Blk::new`: negotiation, GET_QUEUE_NUM, GET_CONFIG.
fn blk_new(sock: &Path) -> (Ch, Negotiated) {
    let mut ch = connect_vhost_user(sock);
    // negotiate_features_vhost_user
    let acked_features = ch_avail_features() & ch.backend_features;
    assert_ne!(
        acked_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(),
        0,
        "vzram offers PROTOCOL_FEATURES"
    );
    let backend_proto = ch
        .fe
        .get_protocol_features()
        .expect("GET_PROTOCOL_FEATURES");
    let acked_protocol = ch_avail_protocol_features() & backend_proto;
    ch.fe
        .set_protocol_features(acked_protocol)
        .expect("SET_PROTOCOL_FEATURES");
    assert!(acked_protocol.contains(VhostUserProtocolFeatures::REPLY_ACK));
    ch.fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    assert_eq!(
        acked_protocol,
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::LOG_SHMFD,
        "protocol features in common"
    );
    // MQ: the backend must have the queues the VM asks for.
    let queues = ch.fe.get_queue_num().expect("GET_QUEUE_NUM");
    assert!(queues >= NUM_QUEUES as u64, "GET_QUEUE_NUM: {queues}");
    let (_, config) = ch
        .fe
        .get_config(
            0,
            CH_CONFIG_LEN as u32,
            VhostUserConfigFlags::WRITABLE,
            &[0u8; CH_CONFIG_LEN],
        )
        .expect("GET_CONFIG");
    assert_eq!(config.len(), CH_CONFIG_LEN);
    let capacity = u64::from_le_bytes(config[0..8].try_into().unwrap());
    assert_eq!(capacity, DEV_SIZE / 512, "capacity in sectors");
    let blk_size = u32::from_le_bytes(config[20..24].try_into().unwrap());
    assert_eq!(blk_size, 4096, "blk_size");
    let config_queues = u16::from_le_bytes(config[34..36].try_into().unwrap());
    assert!(
        usize::from(config_queues) >= NUM_QUEUES,
        "num_queues {config_queues}"
    );

    // The device cloud-hypervisor shows the guest offers `acked_features`.
    // The guest acks what it knows; the VMM adds PROTOCOL_FEATURES back.
    let offered = acked_features;
    let acked =
        guest_acks(offered) | (acked_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits());
    assert_ne!(
        acked & (1 << VIRTIO_F_IN_ORDER),
        0,
        "IN_ORDER negotiated (vzram and cloud-hypervisor both offer it)"
    );
    (
        ch,
        Negotiated {
            offered,
            acked,
            acked_protocol,
        },
    )
}

/// `setup_vhost_user`: features, memory table, rings, enable.
fn setup_vhost_user(ch: &mut Ch, guest: &Guest, acked: u64, bases: Option<&[u16]>) {
    ch.fe
        .set_features(acked & ch.backend_features)
        .expect("SET_FEATURES");
    ch.fe
        .set_mem_table(&guest.ram.table())
        .expect("SET_MEM_TABLE");
    for q in 0..NUM_QUEUES {
        ch.fe.set_vring_num(q, QUEUE_SIZE).expect("SET_VRING_NUM");
    }
    for q in 0..NUM_QUEUES {
        ch.fe
            .set_vring_addr(q, &guest.vring_config(q))
            .expect("SET_VRING_ADDR");
        let base = match bases {
            Some(b) => b[q],
            None => guest.avail_idx(q),
        };
        ch.fe.set_vring_base(q, base).expect("SET_VRING_BASE");
        ch.fe
            .set_vring_call(q, &guest.vqs[q].call)
            .expect("SET_VRING_CALL");
        ch.fe
            .set_vring_kick(q, &guest.vqs[q].kick)
            .expect("SET_VRING_KICK");
    }
    for q in 0..NUM_QUEUES {
        ch.fe.set_vring_enable(q, true).expect("SET_VRING_ENABLE");
    }
}

/// `reconnect_inner` → `connect_vhost_user` → `reinitialize_vhost_user`.
/// Returns, per queue, whether it was kicked because requests were left
/// between the used and the avail index.
fn reconnect(sock: &Path, guest: &Guest, n: &Negotiated) -> (Ch, Vec<bool>) {
    let mut ch = connect_vhost_user(sock);
    // set_protocol_features_vhost_user: no GET_PROTOCOL_FEATURES first.
    ch.fe
        .set_protocol_features(n.acked_protocol)
        .expect("SET_PROTOCOL_FEATURES");
    ch.fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    // IN_ORDER and no inflight area: replay from the used index.
    assert_ne!(n.acked & (1 << VIRTIO_F_IN_ORDER), 0);
    let bases: Vec<u16> = (0..NUM_QUEUES).map(|q| guest.used_idx(q)).collect();
    let lagging: Vec<bool> = (0..NUM_QUEUES)
        .map(|q| guest.used_idx(q) != guest.avail_idx(q))
        .collect();
    setup_vhost_user(&mut ch, guest, n.acked, Some(&bases));
    for (q, &lag) in lagging.iter().enumerate() {
        if lag {
            guest.kick(q);
        }
    }
    (ch, lagging)
}

fn io(q: usize, slot: u16, write: bool, sector: u64, data: Vec<u8>) -> Io {
    Io {
        q,
        slot,
        write,
        sector,
        data,
    }
}

/// The sector of request `slot` on queue `q` in round `round`: every
/// (round, queue, slot) has its own 64 KiB.
fn sector_of(round: u64, q: usize, slot: u16) -> u64 {
    ((round * NUM_QUEUES as u64 + q as u64) * u64::from(SLOTS) + u64::from(slot))
        * (REQ as u64 / 512)
}

fn data_of(round: u64, q: usize, slot: u16) -> Vec<u8> {
    let seed = round << 16 | (q as u64) << 8 | u64::from(slot);
    // Half compressible, half not, as swap is.
    if slot.is_multiple_of(2) {
        pattern(seed, 0, REQ)
    } else {
        noise(seed, REQ)
    }
}

fn writes(round: u64, slots: std::ops::Range<u16>) -> Vec<Io> {
    (0..NUM_QUEUES)
        .flat_map(|q| slots.clone().map(move |s| (q, s)))
        .map(|(q, s)| io(q, s, true, sector_of(round, q, s), data_of(round, q, s)))
        .collect()
}

/// Reads of what `writes(round, from)` wrote, into slots starting at `at`.
fn reads(round: u64, from: std::ops::Range<u16>, at: u16) -> Vec<Io> {
    (0..NUM_QUEUES)
        .flat_map(|q| from.clone().map(move |s| (q, s)))
        .map(|(q, s)| {
            io(
                q,
                at + (s - from.start),
                false,
                sector_of(round, q, s),
                data_of(round, q, s),
            )
        })
        .collect()
}

/// Lets the queue threads finish their last look at the rings. A device
/// may take requests it was not kicked for (with EVENT_IDX it looks once
/// more after re-enabling kicks), so requests published right after a
/// completion could run before the daemon goes away; after a pause they
/// stay in the avail ring and the reconnect has something to replay. The
/// test holds either way: whatever ran or not, every request completes.
fn quiesce() {
    std::thread::sleep(Duration::from_millis(100));
}

fn start_daemon(dir: &TempDir, sock: &Path) -> Daemon {
    Daemon::start(
        dir,
        &[
            "--socket",
            sock.to_str().unwrap(),
            "--size",
            "64M",
            "--queues",
            "2",
            "--name",
            "ch",
        ],
        &[sock],
    )
}

#[test]
fn cloud_hypervisor_sequence_io_and_reconnects() {
    let dir = TempDir::new("chv");
    let sock = dir.join("ch.sock");
    let d = start_daemon(&dir, &sock);
    let mut guest = Guest::new();

    // Boot: Blk::new, the guest's feature ack, activation.
    let (mut ch, n) = blk_new(&sock);
    assert_ne!(
        n.offered & (1 << VIRTIO_BLK_F_DISCARD),
        0,
        "discard offered to the guest"
    );
    setup_vhost_user(&mut ch, &guest, n.acked, None);

    // Round 0: 8 writes per queue, then read them back.
    guest.run(&writes(0, 0..8));
    guest.run(&reads(0, 0..8, 8));
    let st = d.stat();
    assert_eq!(
        st.counters("ch").failed_writes + st.counters("ch").failed_reads,
        0
    );

    // Round 1 in flight when the daemon is SIGKILLed: writes of new data and
    // reads of round 0, published but not kicked (the guest does not know
    // the backend is gone).
    let mut inflight = writes(1, 0..4);
    inflight.extend(reads(0, 0..4, 4));
    quiesce();
    for io in &inflight {
        guest.submit(io);
    }
    drop(d); // SIGKILL
    drop(ch); // cloud-hypervisor sees the hang-up
    let mut d = start_daemon(&dir, &sock);
    let (ch2, lagging) = reconnect(&sock, &guest, &n);
    ch = ch2;
    assert!(lagging.contains(&true), "nothing left to replay");
    for q in 0..NUM_QUEUES {
        guest.complete(q);
    }
    for io in &inflight {
        guest.check(io);
    }
    // What the replayed writes wrote, and round 0, read back.
    guest.run(&reads(1, 0..4, 8));
    guest.run(&reads(0, 0..8, 16));

    // Round 2 in flight across an upgrade (SIGTERM, a new daemon): more
    // writes, and reads of round 1.
    let mut inflight = writes(2, 0..6);
    inflight.extend(reads(1, 0..4, 6));
    quiesce();
    for io in &inflight {
        guest.submit(io);
    }
    let st = d.terminate();
    assert!(st.success(), "SIGTERM: {st}\n{}", d.log_text());
    drop(ch);
    let d = start_daemon(&dir, &sock);
    let (_ch, lagging) = reconnect(&sock, &guest, &n);
    assert!(lagging.contains(&true), "nothing left to replay");
    for q in 0..NUM_QUEUES {
        guest.complete(q);
    }
    for io in &inflight {
        guest.check(io);
    }
    // Everything ever written reads back.
    guest.run(&reads(0, 0..8, 16));
    guest.run(&reads(1, 0..4, 24));
    guest.run(&reads(2, 0..6, 32));
    let st = d.stat();
    assert_eq!(
        st.counters("ch").failed_writes + st.counters("ch").failed_reads,
        0
    );
}

/// Runs `contrib/cloud-hypervisor/run.sh KERNEL ROOTFS` with `env`, and a
/// stub `cloud-hypervisor` first on PATH that records whether the disk's
/// socket was there when it started, and its arguments. Fails the test if
/// the script is still running after 30 s.
fn run_sh(dir: &TempDir, env: &[(&str, &Path)]) -> (std::process::ExitStatus, String, Duration) {
    use std::os::unix::fs::PermissionsExt;
    let stubs = dir.join("bin");
    std::fs::create_dir_all(&stubs).unwrap();
    let ch = stubs.join("cloud-hypervisor");
    std::fs::write(
        &ch,
        "#!/bin/sh\n\
         for a; do case \"$a\" in *socket=*) s=${a#*socket=}; s=${s%%,*};; esac; done\n\
         if [ -S \"$s\" ]; then echo \"served $s\"; else echo \"no socket $s\"; fi >\"$CH_OUT\"\n\
         echo \"$@\" >>\"$CH_OUT\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&ch, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        stubs.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let start = Instant::now();
    let mut cmd = std::process::Command::new("bash");
    cmd.arg(root().join("contrib/cloud-hypervisor/run.sh"))
        .args(["/boot/vmlinuz-test", "/var/lib/rootfs-test.img"])
        .env("PATH", path)
        .env("CH_OUT", dir.join("ch.out"))
        .env("VZRAM_STATE_DIR", state_dir_for(dir.path()))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("run run.sh");
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("contrib/cloud-hypervisor/run.sh still running after 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
        start.elapsed(),
    )
}

/// contrib/cloud-hypervisor/run.sh starts cloud-hypervisor once the daemon
/// serves the disk, and gives up (exit 1, one line) instead of waiting
/// forever when the daemon exits early or never becomes ready.
#[test]
fn run_sh_starts_the_vmm_once_the_disk_is_served_and_waits_boundedly() {
    let dir = TempDir::new("chrun");
    let sock = dir.join("ch.sock");
    let bin = vzram_bin();

    let (st, err, _) = run_sh(&dir, &[("VZRAM", &bin), ("VZRAM_SOCK", &sock)]);
    assert!(st.success(), "run.sh: {st}: {err}");
    let out = std::fs::read_to_string(dir.join("ch.out")).expect("cloud-hypervisor ran");
    assert!(
        out.starts_with(&format!("served {}", sock.display())),
        "the socket was not served when cloud-hypervisor started: {out}"
    );
    assert!(out.contains("shared=on"), "{out}");
    assert!(!sock.exists(), "the daemon was not stopped with the VM");
    // The device is named after the VM's root image, and so is its state.
    let state = state_dir_for(dir.path()).join("ch-rootfs-test");
    assert!(
        state.join("header").exists(),
        "no state at {}",
        state.display()
    );
    // The next boot starts it again, --fresh: never an earlier VM's pages.
    let (st, err, _) = run_sh(&dir, &[("VZRAM", &bin), ("VZRAM_SOCK", &sock)]);
    assert!(st.success(), "run.sh again: {st}: {err}");

    // A daemon that exits at once (here: refused flags).
    let fails = dir.join("bin/vzram-fails");
    std::fs::write(&fails, "#!/bin/sh\nexit 2\n").unwrap();
    let exec = std::fs::Permissions::from_mode(0o755);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fails, exec.clone()).unwrap();
    let _ = std::fs::remove_file(dir.join("ch.out"));
    let (st, err, took) = run_sh(&dir, &[("VZRAM", &fails), ("VZRAM_SOCK", &sock)]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("exited"), "{err}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(
        !dir.join("ch.out").exists(),
        "cloud-hypervisor started anyway"
    );

    // A daemon that never becomes ready: given up after VZRAM_WAIT.
    let hangs = dir.join("bin/vzram-hangs");
    std::fs::write(
        &hangs,
        "#!/bin/sh\n[ \"$1\" = serve ] && exec sleep 60\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&hangs, exec).unwrap();
    let (st, err, took) = run_sh(
        &dir,
        &[
            ("VZRAM", &hangs),
            ("VZRAM_SOCK", &sock),
            ("VZRAM_WAIT", Path::new("1")),
        ],
    );
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("not ready after 1s"), "{err}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(
        !dir.join("ch.out").exists(),
        "cloud-hypervisor started anyway"
    );
}
