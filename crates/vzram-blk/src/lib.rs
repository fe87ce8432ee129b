//! virtio-blk over vhost-user for vzram.
//!
//! Data flows one way: a queue thread ([`backend`]) pops a descriptor chain,
//! [`request`] parses it without side effects, and [`device`] executes it
//! against the page store. [`config`] holds what the guest is told.

pub mod backend;
pub mod config;
pub mod device;
pub mod dirty;
pub mod guard;
pub mod guest;
pub mod poll;
pub mod pool;
pub mod request;
pub mod vring;

pub use backend::{
    drain_queue, BlkBackend, ChainError, ChainHook, GuestMem, QueueError, QueueRing, Scratch,
};
pub use device::{BlkDevice, ExecError};
pub use pool::CompressPool;
pub use request::{Request, RequestError, RequestType};
