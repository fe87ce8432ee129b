//! The vhost-user message guard: every message a frontend sends is read and
//! checked here before the `vhost` crate sees it.
//!
//! The crate trusts negotiation too much: it stores whatever protocol
//! features a frontend acks, offered or not, and acts on messages such as
//! `SET_BACKEND_REQ_FD` or `GPU_SET_SOCKET` (probing the passed fd with
//! system calls the daemon's seccomp filter forbids). One such message used
//! to kill the whole daemon. The guard sits between the frontend's socket
//! and the crate's, forwards well-formed messages that only use what was
//! negotiated, and refuses anything else by ending the connection (which is
//! also what the crate does with a message it rejects).
//!
//! [`Guard::check_header`] and [`Guard::check_message`] are pure and hold
//! the rules; [`recv_message`] and [`send_message`] move one message and its
//! file descriptors (over [`crate::fdpass`]).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::Duration;

use thiserror::Error;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};

use crate::fdpass::recv_exact;
// Re-exported: the daemon reaches them as `guard::…`.
pub use crate::fdpass::{recv_some, send_all, wait_fd, MAX_FDS};

/// vhost-user header: request code, flags, payload size (all u32, LE).
pub const HEADER_LEN: usize = 12;
/// Longest payload any message we accept carries (the crate's limit too).
pub const MAX_PAYLOAD: usize = 0x1000;

const VERSION_MASK: u32 = 0x3;
const VERSION_1: u32 = 0x1;
const REPLY_FLAG: u32 = 0x4;
const NEED_REPLY_FLAG: u32 = 0x8;

/// Frontend request codes (vhost-user spec numbering).
pub mod code {
    pub const GET_FEATURES: u32 = 1;
    pub const SET_FEATURES: u32 = 2;
    pub const SET_OWNER: u32 = 3;
    pub const RESET_OWNER: u32 = 4;
    pub const SET_MEM_TABLE: u32 = 5;
    pub const SET_LOG_BASE: u32 = 6;
    pub const SET_LOG_FD: u32 = 7;
    pub const SET_VRING_NUM: u32 = 8;
    pub const SET_VRING_ADDR: u32 = 9;
    pub const SET_VRING_BASE: u32 = 10;
    pub const GET_VRING_BASE: u32 = 11;
    pub const SET_VRING_KICK: u32 = 12;
    pub const SET_VRING_CALL: u32 = 13;
    pub const SET_VRING_ERR: u32 = 14;
    pub const GET_PROTOCOL_FEATURES: u32 = 15;
    pub const SET_PROTOCOL_FEATURES: u32 = 16;
    pub const GET_QUEUE_NUM: u32 = 17;
    pub const SET_VRING_ENABLE: u32 = 18;
    pub const SET_BACKEND_REQ_FD: u32 = 21;
    pub const GET_CONFIG: u32 = 24;
    pub const SET_CONFIG: u32 = 25;
    pub const GET_INFLIGHT_FD: u32 = 31;
    pub const SET_INFLIGHT_FD: u32 = 32;
    pub const GPU_SET_SOCKET: u32 = 33;
    pub const RESET_DEVICE: u32 = 34;
    pub const GET_MAX_MEM_SLOTS: u32 = 36;
    pub const ADD_MEM_REG: u32 = 37;
    pub const REM_MEM_REG: u32 = 38;
}

/// Why a message was refused. The connection ends; the device and its
/// data are untouched.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum Refusal {
    #[error("header flags {0:#x}: not a version-1 request")]
    BadFlags(u32),
    #[error("request {code} carries {size} bytes, more than {MAX_PAYLOAD}")]
    TooLong { code: u32, size: u32 },
    #[error("request {0} is not one this device serves")]
    Unsupported(u32),
    #[error("request {code} needs protocol feature {feature:?}, which was not negotiated")]
    NotNegotiated {
        code: u32,
        feature: VhostUserProtocolFeatures,
    },
    #[error("request {code} needs {want} bytes of payload, got {got}")]
    BadSize { code: u32, want: usize, got: usize },
    #[error("request {code} carries {fds} file descriptors, allowed {min}..={max}")]
    Fds {
        code: u32,
        fds: usize,
        min: usize,
        max: usize,
    },
    #[error("more than {MAX_FDS} file descriptors in one message")]
    TooManyFds,
    #[error("virtio features {0:#x} acked but never offered")]
    VirtioNotOffered(u64),
    #[error("protocol features {0:#x} acked but never offered")]
    ProtocolNotOffered(u64),
    #[error("dirty log of {size} bytes at offset {offset}: {why}")]
    BadLog {
        size: u64,
        offset: u64,
        why: &'static str,
    },
}

/// A message header as received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub code: u32,
    pub flags: u32,
    pub size: u32,
}

impl Header {
    pub fn parse(b: &[u8; HEADER_LEN]) -> Header {
        let word = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        Header {
            code: word(0),
            flags: word(4),
            size: word(8),
        }
    }
}

/// What each request needs: a payload size (None: checked by the crate,
/// variable), the protocol feature that must be negotiated, and how many
/// descriptors it may carry.
struct Rule {
    size: Option<usize>,
    feature: Option<VhostUserProtocolFeatures>,
    fds: (usize, usize),
}

const fn rule(
    size: Option<usize>,
    feature: Option<VhostUserProtocolFeatures>,
    fds: (usize, usize),
) -> Rule {
    Rule { size, feature, fds }
}

/// The requests a vhost-user-blk device serves. Everything else (net,
/// crypto, postcopy, inflight, GPU, status, shared objects, device state)
/// belongs to features we never offer, and is refused.
///
/// SET_LOG_FD (an eventfd to signal after logging) is refused although it
/// shares LOG_SHMFD with SET_LOG_BASE: the `vhost` crate cannot serve it,
/// and QEMU never sends it.
fn rule_for(c: u32) -> Option<Rule> {
    use code::*;
    use VhostUserProtocolFeatures as P;
    const U64: Option<usize> = Some(8);
    const STATE: Option<usize> = Some(8); // vring index + value
    const NONE: Option<P> = None;
    Some(match c {
        GET_FEATURES | SET_OWNER | RESET_OWNER | GET_PROTOCOL_FEATURES => {
            rule(Some(0), NONE, (0, 0))
        }
        SET_FEATURES | SET_PROTOCOL_FEATURES => rule(U64, NONE, (0, 0)),
        SET_MEM_TABLE => rule(None, NONE, (1, MAX_FDS)),
        SET_VRING_NUM | SET_VRING_BASE | GET_VRING_BASE | SET_VRING_ENABLE => {
            rule(STATE, NONE, (0, 0))
        }
        SET_VRING_ADDR => rule(Some(40), NONE, (0, 0)),
        // The fd is optional: bit 8 of the payload says "none, poll".
        SET_VRING_KICK | SET_VRING_CALL | SET_VRING_ERR => rule(U64, NONE, (0, 1)),
        GET_QUEUE_NUM => rule(Some(0), Some(P::MQ), (0, 0)),
        GET_CONFIG | SET_CONFIG => rule(None, Some(P::CONFIG), (0, 0)),
        GET_MAX_MEM_SLOTS => rule(Some(0), Some(P::CONFIGURE_MEM_SLOTS), (0, 0)),
        ADD_MEM_REG => rule(Some(40), Some(P::CONFIGURE_MEM_SLOTS), (1, 1)),
        // The spec lets old frontends attach an fd, which we close unused.
        REM_MEM_REG => rule(Some(40), Some(P::CONFIGURE_MEM_SLOTS), (0, 1)),
        // Needs a feature we never offer, so it can never be negotiated:
        // listed so the refusal names the feature.
        SET_BACKEND_REQ_FD => rule(Some(0), Some(P::BACKEND_REQ), (1, 1)),
        GET_INFLIGHT_FD | SET_INFLIGHT_FD => rule(None, Some(P::INFLIGHT_SHMFD), (0, 1)),
        RESET_DEVICE => rule(Some(0), Some(P::RESET_DEVICE), (0, 0)),
        // {mmap_size, mmap_offset} of the log in the one fd; see `check_log`.
        SET_LOG_BASE => rule(Some(LOG_PAYLOAD), Some(P::LOG_SHMFD), (1, 1)),
        _ => return None,
    })
}

/// SET_LOG_BASE's payload: mmap_size and mmap_offset (u64 each, LE).
pub const LOG_PAYLOAD: usize = 16;
/// Largest dirty log we map: one bit per 4 KiB page of guest address space,
/// so 1 GiB covers 32 TiB, past the highest address any VM we serve uses.
pub const MAX_LOG_BYTES: u64 = 1 << 30;
const LOG_ALIGN: u64 = 4096;

/// Checks the log area of a SET_LOG_BASE payload against the size of the
/// file it is in. The crate maps it and writes to it from the queue
/// threads: a log that runs past the end of its file would be SIGBUS on
/// the first page we dirty, and an unaligned offset fails in mmap.
pub fn check_log(payload: &[u8], file_len: u64) -> Result<(), Refusal> {
    let word = |i: usize| u64::from_le_bytes(payload[i..i + 8].try_into().unwrap());
    let (size, offset) = (word(0), word(8));
    let bad = |why| Err(Refusal::BadLog { size, offset, why });
    if size == 0 {
        return bad("empty");
    }
    if size > MAX_LOG_BYTES {
        return bad("larger than any guest needs");
    }
    if !offset.is_multiple_of(LOG_ALIGN) {
        return bad("offset not page aligned");
    }
    if offset.checked_add(size).is_none_or(|end| end > file_len) {
        return bad("runs past the end of its file");
    }
    Ok(())
}

/// Per-connection negotiation state.
#[derive(Debug, Clone)]
pub struct Guard {
    offered_virtio: u64,
    offered_protocol: u64,
    acked_protocol: u64,
}

impl Guard {
    /// A guard for a device that offers these features.
    pub fn new(offered_virtio: u64, offered_protocol: VhostUserProtocolFeatures) -> Guard {
        Guard {
            offered_virtio,
            offered_protocol: offered_protocol.bits(),
            acked_protocol: 0,
        }
    }

    /// Checks a header before its payload is read: a refused header's
    /// payload is never read, so a huge size costs nothing.
    pub fn check_header(&self, h: &Header) -> Result<(), Refusal> {
        if h.flags & VERSION_MASK != VERSION_1
            || h.flags & REPLY_FLAG != 0
            || h.flags & !(VERSION_MASK | NEED_REPLY_FLAG) != 0
        {
            return Err(Refusal::BadFlags(h.flags));
        }
        if h.size as usize > MAX_PAYLOAD {
            return Err(Refusal::TooLong {
                code: h.code,
                size: h.size,
            });
        }
        let rule = rule_for(h.code).ok_or(Refusal::Unsupported(h.code))?;
        // GET/SET_PROTOCOL_FEATURES exist only if the device offers them.
        let protocol = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if matches!(
            h.code,
            code::GET_PROTOCOL_FEATURES | code::SET_PROTOCOL_FEATURES
        ) && self.offered_virtio & protocol == 0
        {
            return Err(Refusal::Unsupported(h.code));
        }
        if let Some(f) = rule.feature {
            if self.acked_protocol & f.bits() == 0 {
                return Err(Refusal::NotNegotiated {
                    code: h.code,
                    feature: f,
                });
            }
        }
        if let Some(want) = rule.size {
            if h.size as usize != want {
                return Err(Refusal::BadSize {
                    code: h.code,
                    want,
                    got: h.size as usize,
                });
            }
        }
        Ok(())
    }

    /// Checks a whole message (header already passed [`Self::check_header`])
    /// and records what it negotiates.
    pub fn check_message(&mut self, h: &Header, payload: &[u8], fds: usize) -> Result<(), Refusal> {
        self.check_header(h)?;
        let rule = rule_for(h.code).ok_or(Refusal::Unsupported(h.code))?;
        if payload.len() != h.size as usize {
            return Err(Refusal::BadSize {
                code: h.code,
                want: h.size as usize,
                got: payload.len(),
            });
        }
        if fds < rule.fds.0 || fds > rule.fds.1 {
            return Err(Refusal::Fds {
                code: h.code,
                fds,
                min: rule.fds.0,
                max: rule.fds.1,
            });
        }
        let value = || u64::from_le_bytes(payload[..8].try_into().unwrap());
        match h.code {
            code::SET_FEATURES => {
                let extra = value() & !self.offered_virtio;
                if extra != 0 {
                    return Err(Refusal::VirtioNotOffered(extra));
                }
            }
            code::SET_PROTOCOL_FEATURES => {
                let extra = value() & !self.offered_protocol;
                if extra != 0 {
                    return Err(Refusal::ProtocolNotOffered(extra));
                }
                self.acked_protocol = value();
            }
            _ => {}
        }
        Ok(())
    }
}

/// One message with its descriptors.
pub struct Message {
    pub header: Header,
    pub(crate) raw_header: [u8; HEADER_LEN],
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// What reading a message produced.
pub enum Received {
    Message(Message),
    /// The peer closed the connection between messages.
    Closed,
    Refused(Refusal),
}

/// Reads one message from a frontend and checks it. A refused message is
/// not read further: the caller ends the connection. A frontend that stops
/// in the middle of a message for `timeout` is an error: it must not hold
/// the device.
pub fn recv_message(
    sock: &impl AsRawFd,
    guard: &mut Guard,
    timeout: Duration,
) -> io::Result<Received> {
    let fd = sock.as_raw_fd();
    let mut raw = [0u8; HEADER_LEN];
    let mut fds = Vec::new();
    let mut truncated = false;
    let got = recv_exact(fd, &mut raw, &mut fds, &mut truncated, timeout)?;
    if got == 0 && fds.is_empty() {
        return Ok(Received::Closed);
    }
    if got < HEADER_LEN {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("connection closed after {got} bytes of a header"),
        ));
    }
    let header = Header::parse(&raw);
    if let Err(r) = guard.check_header(&header) {
        return Ok(Received::Refused(r));
    }
    let mut payload = vec![0u8; header.size as usize];
    let got = recv_exact(fd, &mut payload, &mut fds, &mut truncated, timeout)?;
    if got < payload.len() {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "connection closed after {got} of {} payload bytes",
                payload.len()
            ),
        ));
    }
    if truncated || fds.len() > MAX_FDS {
        return Ok(Received::Refused(Refusal::TooManyFds));
    }
    if let Err(r) = guard.check_message(&header, &payload, fds.len()) {
        return Ok(Received::Refused(r));
    }
    if header.code == code::SET_LOG_BASE {
        // One fd, checked above. A socket or pipe has no length and fails.
        let len = std::fs::File::from(fds[0].try_clone()?).metadata()?.len();
        if let Err(r) = check_log(&payload, len) {
            return Ok(Received::Refused(r));
        }
    }
    Ok(Received::Message(Message {
        header,
        raw_header: raw,
        payload,
        fds,
    }))
}

/// Sends a message, header and payload in one go with its descriptors
/// attached to the first byte, as a frontend does.
pub fn send_message(sock: &impl AsRawFd, m: &Message) -> io::Result<()> {
    let raw: Vec<RawFd> = m.fds.iter().map(|f| f.as_raw_fd()).collect();
    let bytes: Vec<u8> = m.raw_header.iter().chain(&m.payload).copied().collect();
    send_all(sock.as_raw_fd(), &bytes, &raw, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn guard() -> Guard {
        Guard::new(
            crate::config::virtio_features(false),
            crate::config::protocol_features(),
        )
    }

    fn hdr(code: u32, size: u32) -> Header {
        Header {
            code,
            flags: VERSION_1,
            size,
        }
    }

    #[test]
    fn unnegotiated_and_unknown_requests_are_refused() {
        let mut g = guard();
        // Before SET_PROTOCOL_FEATURES nothing that needs one passes.
        assert!(matches!(
            g.check_header(&hdr(code::GET_CONFIG, 12)),
            Err(Refusal::NotNegotiated { .. })
        ));
        for c in [
            0,
            7,
            19,
            20,
            22,
            23,
            26,
            33,
            35,
            39,
            40,
            41,
            44,
            60,
            u32::MAX,
        ] {
            assert_eq!(g.check_header(&hdr(c, 0)), Err(Refusal::Unsupported(c)));
        }
        // Acking a feature we never offered is refused and changes nothing.
        let backend_req = VhostUserProtocolFeatures::BACKEND_REQ.bits();
        assert_eq!(
            g.check_message(
                &hdr(code::SET_PROTOCOL_FEATURES, 8),
                &backend_req.to_le_bytes(),
                0
            ),
            Err(Refusal::ProtocolNotOffered(backend_req))
        );
        assert!(matches!(
            g.check_header(&hdr(code::SET_BACKEND_REQ_FD, 0)),
            Err(Refusal::NotNegotiated { .. })
        ));
        let all = crate::config::protocol_features().bits();
        g.check_message(&hdr(code::SET_PROTOCOL_FEATURES, 8), &all.to_le_bytes(), 0)
            .unwrap();
        g.check_header(&hdr(code::GET_CONFIG, 12)).unwrap();
        // Still never offered, so still refused.
        assert!(g.check_header(&hdr(code::SET_BACKEND_REQ_FD, 0)).is_err());
        assert!(g.check_header(&hdr(code::GET_INFLIGHT_FD, 0)).is_err());
        let bad_virtio = 1u64 << 63;
        assert_eq!(
            g.check_message(&hdr(code::SET_FEATURES, 8), &bad_virtio.to_le_bytes(), 0),
            Err(Refusal::VirtioNotOffered(bad_virtio))
        );
    }

    #[test]
    fn flags_sizes_and_descriptors() {
        let g = guard();
        for flags in [0, 2, 3, VERSION_1 | REPLY_FLAG, VERSION_1 | 0x100] {
            let h = Header {
                code: code::GET_FEATURES,
                flags,
                size: 0,
            };
            assert_eq!(g.check_header(&h), Err(Refusal::BadFlags(flags)));
        }
        let need_reply = Header {
            flags: VERSION_1 | NEED_REPLY_FLAG,
            ..hdr(code::GET_FEATURES, 0)
        };
        g.check_header(&need_reply).unwrap();
        assert!(matches!(
            g.check_header(&hdr(code::SET_FEATURES, u32::MAX)),
            Err(Refusal::TooLong { .. })
        ));
        assert!(matches!(
            g.check_header(&hdr(code::SET_FEATURES, 4)),
            Err(Refusal::BadSize { .. })
        ));
        let mut g = guard();
        assert!(matches!(
            g.check_message(&hdr(code::GET_FEATURES, 0), &[], 1),
            Err(Refusal::Fds { .. })
        ));
        assert!(matches!(
            g.check_message(&hdr(code::SET_MEM_TABLE, 8), &[0; 8], 0),
            Err(Refusal::Fds { .. })
        ));
        g.check_message(&hdr(code::SET_VRING_CALL, 8), &[0; 8], 1)
            .unwrap();
        let no_protocol = Guard::new(0, crate::config::protocol_features());
        assert_eq!(
            no_protocol.check_header(&hdr(code::GET_PROTOCOL_FEATURES, 0)),
            Err(Refusal::Unsupported(code::GET_PROTOCOL_FEATURES))
        );
    }

    fn log_payload(size: u64, offset: u64) -> Vec<u8> {
        [size.to_le_bytes(), offset.to_le_bytes()].concat()
    }

    /// SET_LOG_BASE passes only once LOG_SHMFD is negotiated, with its
    /// 16-byte payload and exactly one fd; SET_LOG_FD never does.
    #[test]
    fn log_base_needs_log_shmfd_one_fd_and_its_payload() {
        let mut g = guard();
        let h = hdr(code::SET_LOG_BASE, LOG_PAYLOAD as u32);
        let p = log_payload(4096, 0);
        assert!(matches!(
            g.check_message(&h, &p, 1),
            Err(Refusal::NotNegotiated {
                feature: VhostUserProtocolFeatures::LOG_SHMFD,
                ..
            })
        ));
        let others =
            (crate::config::protocol_features() - VhostUserProtocolFeatures::LOG_SHMFD).bits();
        g.check_message(
            &hdr(code::SET_PROTOCOL_FEATURES, 8),
            &others.to_le_bytes(),
            0,
        )
        .unwrap();
        assert!(matches!(
            g.check_message(&h, &p, 1),
            Err(Refusal::NotNegotiated { .. })
        ));
        let all = crate::config::protocol_features().bits();
        g.check_message(&hdr(code::SET_PROTOCOL_FEATURES, 8), &all.to_le_bytes(), 0)
            .unwrap();
        g.check_message(&h, &p, 1).unwrap();
        for fds in [0, 2] {
            assert!(matches!(
                g.check_message(&h, &p, fds),
                Err(Refusal::Fds { .. })
            ));
        }
        for size in [0, 8, 24] {
            assert!(matches!(
                g.check_header(&hdr(code::SET_LOG_BASE, size)),
                Err(Refusal::BadSize { .. })
            ));
        }
        assert_eq!(
            g.check_header(&hdr(code::SET_LOG_FD, 8)),
            Err(Refusal::Unsupported(code::SET_LOG_FD))
        );
    }

    /// The log must lie inside its file, page aligned, and not be absurd.
    #[test]
    fn log_area_is_checked_against_its_file() {
        check_log(&log_payload(4096, 0), 4096).unwrap();
        check_log(&log_payload(100, 8192), 8292).unwrap();
        for (size, offset, file) in [
            (0, 0, 4096),
            (4097, 0, 4096),
            (4096, 4096, 4096),
            (10, 1, 4096),
            (MAX_LOG_BYTES + 1, 0, u64::MAX),
            (4096, u64::MAX - 4095, u64::MAX),
        ] {
            assert!(
                matches!(
                    check_log(&log_payload(size, offset), file),
                    Err(Refusal::BadLog { .. })
                ),
                "{size} at {offset} in {file}"
            );
        }
    }

    /// LOG_ALL is offered, so a frontend may ack it with the rest.
    #[test]
    fn log_all_may_be_acked() {
        let mut g = guard();
        let features = crate::config::virtio_features(false);
        assert_ne!(features & VhostUserVirtioFeatures::LOG_ALL.bits(), 0);
        g.check_message(&hdr(code::SET_FEATURES, 8), &features.to_le_bytes(), 0)
            .unwrap();
    }

    /// Through a socket: a log in a file too short for it, or in a socket,
    /// is refused; one that fits passes.
    #[test]
    fn log_base_fd_is_measured() {
        let send = |payload: Vec<u8>, fd: OwnedFd| {
            let (a, b) = UnixStream::pair().unwrap();
            let mut raw_header = [0u8; HEADER_LEN];
            raw_header[0..4].copy_from_slice(&code::SET_LOG_BASE.to_le_bytes());
            raw_header[4..8].copy_from_slice(&VERSION_1.to_le_bytes());
            raw_header[8..12].copy_from_slice(&(LOG_PAYLOAD as u32).to_le_bytes());
            let m = Message {
                header: Header::parse(&raw_header),
                raw_header,
                payload,
                fds: vec![fd],
            };
            send_message(&a, &m).unwrap();
            let mut g = guard();
            let all = crate::config::protocol_features().bits();
            g.check_message(&hdr(code::SET_PROTOCOL_FEATURES, 8), &all.to_le_bytes(), 0)
                .unwrap();
            recv_message(&b, &mut g, Duration::from_secs(5)).unwrap()
        };
        let file = |len: u64| -> OwnedFd {
            let f = tempfile_in_tmp();
            f.set_len(len).unwrap();
            f.into()
        };
        assert!(matches!(
            send(log_payload(4096, 0), file(4096)),
            Received::Message(_)
        ));
        assert!(matches!(
            send(log_payload(4096, 0), file(100)),
            Received::Refused(Refusal::BadLog { .. })
        ));
        let (sock, _other) = UnixStream::pair().unwrap();
        assert!(matches!(
            send(log_payload(4096, 0), sock.into()),
            Received::Refused(Refusal::BadLog { .. })
        ));
    }

    fn tempfile_in_tmp() -> std::fs::File {
        let path = std::env::temp_dir().join(format!(
            "vzram-guard-log-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    #[test]
    fn messages_and_descriptors_cross_a_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let (keep, _other) = UnixStream::pair().unwrap();
        let fd: OwnedFd = keep.into();
        let mut payload = 1u64.to_le_bytes().to_vec();
        payload.truncate(8);
        let mut raw_header = [0u8; HEADER_LEN];
        raw_header[0..4].copy_from_slice(&code::SET_VRING_CALL.to_le_bytes());
        raw_header[4..8].copy_from_slice(&VERSION_1.to_le_bytes());
        raw_header[8..12].copy_from_slice(&8u32.to_le_bytes());
        let m = Message {
            header: Header::parse(&raw_header),
            raw_header,
            payload,
            fds: vec![fd],
        };
        send_message(&a, &m).unwrap();
        let mut g = guard();
        match recv_message(&b, &mut g, Duration::from_secs(5)).unwrap() {
            Received::Message(got) => {
                assert_eq!(got.header, m.header);
                assert_eq!(got.payload, m.payload);
                assert_eq!(got.fds.len(), 1);
            }
            _ => panic!("message not received"),
        }
        drop(a);
        assert!(matches!(
            recv_message(&b, &mut g, Duration::from_secs(5)).unwrap(),
            Received::Closed
        ));
    }
}
