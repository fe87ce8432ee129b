//! virtio-blk over vhost-user for vzram.
//!
//! Data flows one way: the message guard ([`guard`]) checks what the
//! frontend sends before vhost-user-backend ([`backend`]) sees it; a queue
//! thread ([`queue`]) pops a descriptor chain, [`request`] parses it without
//! side effects, and [`device`] executes it against the page store.
//! [`config`] holds what the guest is told.

pub mod backend;
pub mod config;
pub mod device;
pub mod dirty;
pub mod fdpass;
pub mod guard;
pub mod guest;
pub mod poll;
pub mod pool;
pub mod queue;
mod ratelimit;
pub mod request;
pub mod rings;
pub mod thread_hook;
pub mod vring;

pub use backend::{BlkBackend, GuestMem};
pub use device::{BlkDevice, ExecError};
pub use pool::CompressPool;
pub use queue::{drain_queue, ChainError, ChainHook, QueueError, QueueRing, Scratch};
pub use request::{Request, RequestError, RequestType};
pub use thread_hook::ThreadHook;
