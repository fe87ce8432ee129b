//! Protocol bytes sent by hand, and what the daemon did about them.

use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::dev::REPLY_TIMEOUT;

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
