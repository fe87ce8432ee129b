//! A raw vhost-user-blk frontend for the hostile-client tests.
//!
//! blkio only ever sends well-formed requests, so these tests drive the
//! daemon themselves: guest RAM is a set of memfds mapped here and handed to
//! the daemon with SET_MEM_TABLE; one split virtqueue lives in that RAM at
//! fixed addresses, and descriptors, avail entries and kicks are written by
//! hand. [`RawDev::raw`] is a second handle on the same socket for sending
//! bytes that no well-behaved frontend would.
//!
//! The pieces: [`Ram`] (guest memory), [`RawDev`] (the frontend and its
//! ring), and [`raw_msg`], [`fate`] and [`code`] for protocol bytes sent
//! by hand; `ring` says where things live in guest RAM and what virtio-blk
//! calls its request types, status bytes and descriptor flags.

mod dev;
mod ram;
mod ring;
mod wire;

pub use dev::*;
pub use ram::*;
pub use ring::*;
pub use wire::*;

pub use crate::data::MIB;
