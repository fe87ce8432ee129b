//! Hostile vhost-user frontends against the real daemon (issue 6): the
//! vhost-user protocol itself, and inputs that used to kill or wedge the
//! whole daemon.
//! The fixture and the checks after each hostile request are in
//! `tests/support/hostile.rs`; `hostile.rs` says what every test proves.

use std::io::Write;
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::VhostUserConfigFlags;
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vzram_tests::frontend::*;
use vzram_tests::hostile::*;
use vzram_tests::*;

// ---------------------------------------------------------------------------
// The vhost-user protocol itself
// ---------------------------------------------------------------------------

/// A fresh connection, after the handshake if asked.
fn fresh(fx: &Fx, handshake: bool) -> (UnixStream, Option<RawDev>) {
    if handshake {
        let v = RawDev::handshake(&fx.victim, Ram::standard());
        (v.raw.try_clone().unwrap(), Some(v))
    } else {
        (connect_stream(&fx.victim), None)
    }
}

/// Sends `bytes` on a fresh connection (after the handshake, if asked)
/// and returns what became of it.
fn raw_conn(fx: &Fx, handshake: bool, bytes: &[u8], then_shut: bool) -> Fate {
    let (mut s, _keep) = fresh(fx, handshake);
    s.write_all(bytes).expect("send");
    if then_shut {
        let _ = s.shutdown(Shutdown::Write);
    }
    fate(&mut s, Duration::from_secs(3))
}

/// Sends `bytes` after the handshake and reads an `n`-byte reply.
fn raw_reply(fx: &Fx, bytes: &[u8], n: usize) -> Vec<u8> {
    let (mut s, _keep) = fresh(fx, true);
    s.write_all(bytes).expect("send");
    read_reply(&mut s, n).unwrap_or_else(|| panic!("no {n}-byte reply"))
}

#[test]
fn malformed_vhost_user_messages_drop_the_connection() {
    let mut fx = fixture("proto", "");
    let v1 = 1u32; // version 1, no flags
    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        (
            "SET_OWNER with a body",
            raw_msg(code::SET_OWNER, v1, 8, &[0; 8]),
            false,
        ),
        (
            "GET_FEATURES with a body",
            raw_msg(code::GET_FEATURES, v1, 4, &[0; 4]),
            false,
        ),
        (
            "size u32::MAX",
            raw_msg(code::SET_FEATURES, v1, u32::MAX, &[0; 64]),
            false,
        ),
        (
            "size past MAX_MSG_SIZE",
            raw_msg(code::SET_FEATURES, v1, 0x1001, &[0; 0x1001]),
            false,
        ),
        (
            "SET_FEATURES with 4 bytes",
            raw_msg(code::SET_FEATURES, v1, 4, &[0; 4]),
            false,
        ),
        (
            "SET_FEATURES with 16 bytes",
            raw_msg(code::SET_FEATURES, v1, 16, &[0; 16]),
            false,
        ),
        (
            "a body shorter than its size",
            raw_msg(code::SET_FEATURES, v1, 8, &[0; 4]),
            true,
        ),
        (
            "half a header",
            raw_msg(code::GET_FEATURES, v1, 0, &[])[..6].to_vec(),
            true,
        ),
        ("unknown code 0", raw_msg(0, v1, 0, &[]), false),
        ("unknown code 9999", raw_msg(9999, v1, 0, &[]), false),
        (
            "unknown code u32::MAX",
            raw_msg(u32::MAX, v1, 8, &[0; 8]),
            false,
        ),
        ("version 0", raw_msg(code::GET_FEATURES, 0, 0, &[]), false),
        ("version 3", raw_msg(code::GET_FEATURES, 3, 0, &[]), false),
        (
            "a reply sent as a request",
            raw_msg(code::GET_FEATURES, v1 | 4, 0, &[]),
            false,
        ),
        (
            "SET_VRING_NUM with 4 bytes",
            raw_msg(code::SET_VRING_NUM, v1, 4, &[0; 4]),
            false,
        ),
        // SET_MEM_TABLE: zero regions, a region but no fd, a count that
        // does not match the payload.
        (
            "SET_MEM_TABLE with 0 regions",
            raw_msg(code::SET_MEM_TABLE, v1, 8, &[0; 8]),
            false,
        ),
        (
            "SET_MEM_TABLE without fds",
            {
                let mut p = vec![1, 0, 0, 0, 0, 0, 0, 0];
                p.extend_from_slice(&region_bytes(0, 1 << 20, 0x1000_0000, 0));
                raw_msg(code::SET_MEM_TABLE, v1, p.len() as u32, &p)
            },
            false,
        ),
        (
            "SET_MEM_TABLE claiming 2 regions with 1",
            {
                let mut p = vec![2, 0, 0, 0, 0, 0, 0, 0];
                p.extend_from_slice(&region_bytes(0, 1 << 20, 0x1000_0000, 0));
                raw_msg(code::SET_MEM_TABLE, v1, p.len() as u32, &p)
            },
            false,
        ),
        (
            "SET_MEM_TABLE with 1000 regions",
            {
                let mut p = 1000u32.to_le_bytes().to_vec();
                p.extend_from_slice(&[0; 4]);
                raw_msg(code::SET_MEM_TABLE, v1, p.len() as u32, &p)
            },
            false,
        ),
    ];
    for (what, bytes, shut) in &cases {
        for handshake in [false, true] {
            match raw_conn(&fx, handshake, bytes, *shut) {
                Fate::Dropped(_) => {}
                Fate::Open(got) => {
                    panic!("{what} (handshake {handshake}): connection still open, got {got:?}")
                }
            }
        }
        fx.alive();
    }
    // The raw path itself is sound: a proper GET_FEATURES gets its reply.
    let got = raw_reply(&fx, &raw_msg(code::GET_FEATURES, v1, 0, &[]), 20);
    assert_eq!(&got[0..4], &code::GET_FEATURES.to_le_bytes());
    assert_eq!(&got[4..8], &5u32.to_le_bytes(), "version 1, reply");
    fx.check_victim();
}

/// One `VhostUserMemoryRegion` as bytes.
fn region_bytes(gpa: u64, size: u64, user: u64, offset: u64) -> Vec<u8> {
    [gpa, size, user, offset]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect()
}

#[test]
fn garbage_mid_stream_with_requests_in_flight() {
    let mut fx = fixture("midstream", "");
    let mut v = fx.raw();
    let data = noise(71, PAGE);
    assert_eq!(v.write(16, &data), S_OK);
    // Requests queued and kicked, then junk on the socket.
    for i in 0..16u16 {
        v.header(HDR + 16 * u64::from(i), T_OUT, 100 + 8 * u64::from(i));
        v.chain(
            3 * i,
            &[
                d(HDR + 16 * u64::from(i), 16, 0),
                d(DATA, 4096, 0),
                d(STATUS + u64::from(i), 1, F_WRITE),
            ],
        );
        v.publish(3 * i);
    }
    v.kick();
    v.send_raw(&raw_msg(0x7777, 1, 3, &[1, 2, 3]));
    assert!(matches!(
        fate(&mut v.raw, Duration::from_secs(3)),
        Fate::Dropped(_)
    ));
    drop(v);
    fx.check_victim();
    let mut v = fx.raw();
    assert_eq!(sector_data(&mut v, 16, PAGE), data);
}

#[test]
fn get_config_with_odd_offsets_and_sizes() {
    let mut fx = fixture("config", "");
    let get_config = |offset: u32, size: u32, payload_len: usize, hdr_size: Option<u32>| {
        let mut p = Vec::new();
        p.extend_from_slice(&offset.to_le_bytes());
        p.extend_from_slice(&size.to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        p.extend(std::iter::repeat_n(0u8, payload_len));
        let sz = hdr_size.unwrap_or(p.len() as u32);
        raw_msg(code::GET_CONFIG, 1, sz, &p)
    };
    // Well-formed: the capacity, and zeros past the config space.
    let got = raw_reply(&fx, &get_config(0, 60, 60, None), 12 + 12 + 60);
    assert_eq!(&got[16..20], &60u32.to_le_bytes(), "config size");
    let capacity = |got: &[u8]| u64::from_le_bytes(got[24..32].try_into().unwrap());
    assert_eq!(capacity(&got), SECTORS);
    // Past our 96 bytes of config space, up to the vhost-user limit: zeros.
    let got = raw_reply(&fx, &get_config(0x100, 8, 8, None), 12 + 12 + 8);
    assert_eq!(&got[24..], &[0; 8]);
    let got = raw_reply(&fx, &get_config(0xff0, 0x10, 0x10, None), 12 + 12 + 0x10);
    assert_eq!(&got[24..], &[0; 0x10]);
    // The largest GET_CONFIG a message can carry (MAX_MSG_SIZE is 4096
    // bytes after the header: 12 of VhostUserConfig, the rest config).
    let big = 0x1000 - 12;
    let got = raw_reply(
        &fx,
        &get_config(0, big, big as usize, None),
        12 + 12 + big as usize,
    );
    assert_eq!(capacity(&got), SECTORS);
    assert!(got[24 + 96..].iter().all(|&b| b == 0));

    for (what, msg) in [
        ("size 0", get_config(0, 0, 0, None)),
        (
            "size larger than the payload",
            get_config(0, 0xff0, 0xff0 - 12, Some(0xff0)),
        ),
        (
            "offset + size overflows",
            get_config(u32::MAX - 4, 8, 8, None),
        ),
        (
            "size past the config limit",
            get_config(0, 0x1000, 0x1000 - 12, None),
        ),
        (
            "offset past the config limit",
            get_config(0x1000, 8, 8, None),
        ),
        ("a payload shorter than size", get_config(0, 60, 4, None)),
        ("a payload longer than size", get_config(0, 8, 60, None)),
        ("a header size that lies", get_config(0, 60, 60, Some(12))),
        ("unknown flags", {
            let mut m = get_config(0, 8, 8, None);
            m[20..24].copy_from_slice(&0xffu32.to_le_bytes());
            m
        }),
    ] {
        match raw_conn(&fx, true, &msg, false) {
            Fate::Dropped(_) => {}
            Fate::Open(got) => {
                // An answer is only allowed as an error: config size 0.
                assert!(
                    got.len() == 24 && got[16..20] == [0; 4],
                    "GET_CONFIG {what}: answered {got:?}"
                )
            }
        }
        fx.alive();
    }
    // Through the library too: the config stays right.
    let mut v = RawDev::handshake(&fx.victim, Ram::standard());
    let (_, cfg) =
        v.fe.get_config(0, 8, VhostUserConfigFlags::empty(), &[0; 8])
            .unwrap();
    assert_eq!(u64::from_le_bytes(cfg[..8].try_into().unwrap()), SECTORS);
    drop(v);
    fx.check_victim();
}

// ---------------------------------------------------------------------------
// Part 7: inputs that used to kill or wedge the whole daemon
// ---------------------------------------------------------------------------

/// Sends `bytes` with `fd` attached (if any) and waits briefly for the
/// daemon to act on it: the connection dropped, or nothing more to read.
fn send_and_settle(s: &mut UnixStream, bytes: &[u8], fd: Option<&UnixStream>) {
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    let sent = match fd {
        Some(f) => s.send_with_fd(bytes, f.as_raw_fd()).map(|_| ()),
        None => s.write_all(bytes).map_err(Into::into),
    };
    if sent.is_err() {
        return; // already dropped
    }
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 512];
    while let Ok(n) = std::io::Read::read(s, &mut buf) {
        if n == 0 {
            break;
        }
    }
}

/// Every request code 1..=60, with payloads of 0, 8, 12, 40 and 256 bytes,
/// with and without a descriptor (a unix socket: what GPU_SET_SOCKET and
/// SET_BACKEND_REQ_FD expect), on a fresh connection and after the
/// handshake, under the seccomp filter. Codes whose feature was never
/// offered used to make the vhost crate call getsockopt, which the filter
/// forbids: one message killed every device.
#[test]
fn every_request_code_with_odd_payloads_and_descriptors() {
    let mut fx = fixture("scan", "");
    let (sock_fd, _peer) = UnixStream::pair().unwrap();
    for c in 1..=60u32 {
        for len in [0usize, 8, 12, 40, 256] {
            for with_fd in [false, true] {
                for handshake in [false, true] {
                    let (mut s, _keep) = fresh(&fx, handshake);
                    let msg = raw_msg(c, 1, len as u32, &vec![0; len]);
                    send_and_settle(&mut s, &msg, with_fd.then_some(&sock_fd));
                }
            }
        }
        fx.alive();
    }
    fx.check_victim();
}

/// Acking a protocol feature the daemon never offered (BACKEND_REQ), then
/// using it (SET_BACKEND_REQ_FD with a socket): refused at the ack, and
/// the daemon stays.
#[test]
fn unoffered_protocol_features_are_refused() {
    let mut fx = fixture("proto2", "");
    let backend_req = 1u64 << 5;
    let hello = |s: &mut UnixStream| {
        s.write_all(&raw_msg(code::SET_OWNER, 1, 0, &[])).unwrap();
        s.write_all(&raw_msg(code::GET_FEATURES, 1, 0, &[]))
            .unwrap();
        read_reply(s, 20).expect("GET_FEATURES reply");
    };
    let mut s = connect_stream(&fx.victim);
    hello(&mut s);
    let ack = raw_msg(
        code::SET_PROTOCOL_FEATURES,
        1,
        8,
        &(backend_req | 1 << 9).to_le_bytes(),
    );
    s.write_all(&ack).unwrap();
    assert!(
        matches!(fate(&mut s, Duration::from_secs(3)), Fate::Dropped(_)),
        "an ack of a feature never offered was accepted"
    );
    fx.alive();
    // The rest of the sequence, on a connection where the ack was refused
    // and on one that never acked anything.
    for ack_first in [true, false] {
        let mut s = connect_stream(&fx.victim);
        hello(&mut s);
        if ack_first {
            send_and_settle(&mut s, &ack, None);
        }
        let (a, _b) = UnixStream::pair().unwrap();
        send_and_settle(
            &mut s,
            &raw_msg(code::SET_BACKEND_REQ_FD, 1, 0, &[]),
            Some(&a),
        );
        send_and_settle(&mut s, &raw_msg(code::GPU_SET_SOCKET, 1, 0, &[]), Some(&a));
        fx.alive();
    }
    assert!(
        fx.d.log_text().contains("never offered"),
        "the refusal is not logged:\n{}",
        fx.d.log_text()
    );
    fx.check_victim();
}

/// With EVENT_IDX, an avail index far ahead of what the ring can hold made
/// the queue thread spin: the ring "has work" but no request can be taken.
/// It held the vring lock at 100% CPU, logged a line per turn, and
/// GET_VRING_BASE (what a frontend sends to stop a ring) hung.
#[test]
fn event_idx_with_an_unreadable_ring_does_not_spin() {
    let mut fx = fixture("spin", "");
    let mut v = RawDev::handshake_with(&fx.victim, Ram::standard(), true);
    v.fe.set_mem_table(&v.ram.table()).unwrap();
    v.setup_vring(Setup::default());
    // The ring works with EVENT_IDX first.
    assert_eq!(v.write(0, &noise(5, PAGE)), S_OK);
    assert_eq!(v.read(0, PAGE), (S_OK, noise(5, PAGE)));
    let log_before = fx.d.log_text().len();
    let ticks_before = cpu_ticks(fx.d.pid());
    let t0 = Instant::now();
    // 0x8000 requests "waiting" on a 256-entry ring.
    v.set_avail_idx(v.avail_idx().wrapping_add(0x8000));
    for _ in 0..20 {
        v.kick();
        std::thread::sleep(Duration::from_millis(50));
    }
    let secs = t0.elapsed().as_secs_f64();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let busy = (cpu_ticks(fx.d.pid()) - ticks_before) as f64 / hz / secs;
    assert!(
        busy < 0.5,
        "the daemon used {:.0}% of a CPU after the bad kick",
        busy * 100.0
    );
    let log = fx.d.log_text();
    let logged = log.len() - log_before;
    assert!(
        logged < 4096,
        "{logged} bytes of log for 20 bad kicks:\n{}",
        &log[log_before..]
    );
    // Stopping the ring is answered, not blocked behind a spinning thread.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|sc| {
        sc.spawn(|| tx.send(v.fe.get_vring_base(0).is_ok()).unwrap());
        assert!(
            rx.recv_timeout(Duration::from_secs(5)).is_ok(),
            "GET_VRING_BASE got no answer"
        );
    });
    drop(v);
    // A queue that is not ready, with EVENT_IDX: kicks are ignored.
    let mut v = RawDev::handshake_with(&fx.victim, Ram::standard(), true);
    v.fe.set_mem_table(&v.ram.table()).unwrap();
    v.setup_vring(Setup {
        set_addr: false,
        ..Setup::default()
    });
    v.set_avail_idx(7);
    v.kick();
    assert!(v.quiet_for(QUIET));
    drop(v);
    fx.check_victim();
}

/// A frontend's memory file truncated under the daemon kills the worker
/// serving that frontend with SIGBUS, and the supervisor names it. The
/// daemon lives on, and the device, with its data, serves the next one.
#[test]
fn a_sigbus_from_guest_memory_is_named_and_contained() {
    let dir = TempDir::new("bus");
    let sock = dir.join("v.sock");
    let spec = format!("socket={},size={DEV_SIZE}", s(&sock));
    let mut daemon = Daemon::start(&dir, &["--device", &spec], &[&sock]);
    let mut v = RawDev::connect(&sock);
    assert_eq!(v.write(0, &noise(1, PAGE)), S_OK);
    v.truncate_memory_and_kick();
    let deadline = Instant::now() + Duration::from_secs(10);
    while daemon.stat().sole().worker.failures != 1 {
        assert!(Instant::now() < deadline, "{}", daemon.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        daemon.wait_exit(Duration::ZERO).is_none(),
        "the daemon died:\n{}",
        daemon.log_text()
    );
    let st = daemon.stat();
    let w = &st.sole().worker;
    assert!(
        w.last_failure.as_deref().unwrap().contains("SIGBUS"),
        "{w:?}"
    );
    assert!(
        daemon.log_text().contains("killed by SIGBUS"),
        "{}",
        daemon.log_text()
    );
    drop(v);
    let mut again = RawDev::connect(&sock);
    assert_eq!(again.read_all(0, PAGE), noise(1, PAGE));
}
