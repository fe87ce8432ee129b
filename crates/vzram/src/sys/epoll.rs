//! Epoll sets over vmm-sys-util's `Epoll`, with typed tokens: what woke a
//! loop is an enum, never a number decoded by hand.

use std::io;
use std::marker::PhantomData;
use std::os::fd::RawFd;

pub use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent};

/// What an event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Token {
    /// The launcher's socket: a report.
    Launcher,
    /// The wake-up eventfd: the device list or a phase changed.
    Wake,
    /// Device `i`'s listening socket.
    Listener(usize),
    /// Device `i`'s connection waiting for its first message.
    Pending(usize),
}

/// A loop's token type: what it stores in an event's data word.
pub trait Tag: Copy {
    fn encode(self) -> u64;
    fn decode(v: u64) -> Self;
}

impl Tag for Token {
    fn encode(self) -> u64 {
        match self {
            Token::Launcher => u64::MAX,
            Token::Wake => u64::MAX - 1,
            Token::Listener(i) => 2 * i as u64,
            Token::Pending(i) => 2 * i as u64 + 1,
        }
    }

    fn decode(v: u64) -> Token {
        match v {
            u64::MAX => Token::Launcher,
            v if v == u64::MAX - 1 => Token::Wake,
            v if v % 2 == 0 => Token::Listener((v / 2) as usize),
            v => Token::Pending((v / 2) as usize),
        }
    }
}

pub struct Poller<T = Token> {
    ep: Epoll,
    events: Vec<EpollEvent>,
    tag: PhantomData<T>,
}

impl<T: Tag> Poller<T> {
    pub fn new() -> io::Result<Poller<T>> {
        Ok(Poller {
            ep: Epoll::new()?,
            events: vec![EpollEvent::default(); 64],
            tag: PhantomData,
        })
    }

    pub fn add(&self, fd: RawFd, t: T, events: EventSet) -> io::Result<()> {
        let ev = EpollEvent::new(events, t.encode());
        self.ep.ctl(ControlOperation::Add, fd, ev)
    }

    /// Changes what `fd` is watched for; an empty set disarms it.
    pub fn modify(&self, fd: RawFd, t: T, events: EventSet) -> io::Result<()> {
        let ev = EpollEvent::new(events, t.encode());
        self.ep.ctl(ControlOperation::Modify, fd, ev)
    }

    pub fn delete(&self, fd: RawFd) -> io::Result<()> {
        self.ep
            .ctl(ControlOperation::Delete, fd, EpollEvent::default())
    }

    /// Waits up to `timeout_ms` (-1: for ever) and returns what woke it.
    pub fn wait(&mut self, timeout_ms: i32) -> io::Result<Vec<T>> {
        let n = loop {
            match self.ep.wait(timeout_ms, &mut self.events) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        };
        Ok(self.events[..n]
            .iter()
            .map(|e| T::decode(e.data()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip() {
        for t in [
            Token::Launcher,
            Token::Wake,
            Token::Listener(0),
            Token::Pending(0),
            Token::Listener(7),
            Token::Pending(1 << 20),
        ] {
            assert_eq!(Token::decode(t.encode()), t);
        }
    }
}
