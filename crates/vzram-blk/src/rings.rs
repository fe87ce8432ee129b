//! Which rings a frontend has running, read off the vhost-user messages the
//! guard passes on: the daemon's relay feeds it every message and every
//! reply, and asks it whether the device is quiet (nothing can write).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use crate::guard::{code, Message};

/// Which rings the frontend has started and not stopped, as the relay sees
/// its messages: a sender's "quiet". A ring is stopped once the handler has
/// answered its GET_VRING_BASE (it drains what it holds first).
#[derive(Default)]
pub struct Rings {
    pub disconnected: AtomicBool,
    active: AtomicU64,
    stopping: AtomicU64,
}

impl Rings {
    /// Nothing can write: no frontend, or no ring running.
    pub fn quiet(&self) -> bool {
        self.disconnected.load(SeqCst) || self.active.load(SeqCst) == 0
    }

    /// A message on its way to the handler: SET_VRING_KICK starts its ring,
    /// GET_VRING_BASE asks its ring to stop.
    pub fn message(&self, m: &Message) {
        // The payload's first `n` bytes as a little-endian number.
        let index = |n: usize| {
            m.payload
                .get(..n)
                .map(|b| b.iter().rev().fold(0u64, |a, &x| a << 8 | u64::from(x)))
        };
        match m.header.code {
            code::SET_VRING_KICK => {
                // The index is the low byte; bit 8 says "no fd".
                if let Some(i) = index(8).map(|v| v & 0xff).filter(|&i| i < 64) {
                    self.active.fetch_or(1 << i, SeqCst);
                }
            }
            code::GET_VRING_BASE => {
                if let Some(i) = index(4).filter(|&i| i < 64) {
                    self.stopping.fetch_or(1 << i, SeqCst);
                }
            }
            _ => {}
        }
    }

    /// The handler answered: the rings asked to stop are stopped.
    pub fn replied(&self) {
        let s = self.stopping.swap(0, SeqCst);
        if s != 0 {
            self.active.fetch_and(!s, SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guard::{Header, HEADER_LEN};

    fn message(code: u32, payload: &[u8]) -> Message {
        let mut raw = [0u8; HEADER_LEN];
        raw[0..4].copy_from_slice(&code.to_le_bytes());
        raw[4..8].copy_from_slice(&1u32.to_le_bytes());
        raw[8..12].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        Message {
            header: Header::parse(&raw),
            raw_header: raw,
            payload: payload.to_vec(),
            fds: Vec::new(),
        }
    }

    #[test]
    fn a_ring_runs_from_its_kick_until_its_base_is_answered() {
        let r = Rings::default();
        assert!(r.quiet());
        // Ring 1 kicked with "no fd" (bit 8): still started.
        r.message(&message(code::SET_VRING_KICK, &(0x101u64).to_le_bytes()));
        r.message(&message(code::SET_VRING_KICK, &3u64.to_le_bytes()));
        assert!(!r.quiet());
        // Index 64 and up, or a short payload, name no ring.
        r.message(&message(code::SET_VRING_KICK, &64u64.to_le_bytes()));
        r.message(&message(code::GET_VRING_BASE, &[1, 0]));
        r.message(&message(code::GET_VRING_BASE, &[1, 0, 0, 0, 0, 0, 0, 0]));
        assert!(!r.quiet(), "stopped only once answered");
        r.replied();
        assert!(!r.quiet(), "ring 3 still runs");
        r.message(&message(code::GET_VRING_BASE, &[3, 0, 0, 0, 0, 0, 0, 0]));
        r.replied();
        assert!(r.quiet());
        r.message(&message(code::SET_VRING_KICK, &0u64.to_le_bytes()));
        r.disconnected.store(true, SeqCst);
        assert!(r.quiet(), "no frontend, nothing writes");
    }
}
