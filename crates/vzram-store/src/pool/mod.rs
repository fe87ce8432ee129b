//! The pool's memory machinery: size classes, each device's arena and heap,
//! and what all devices share ([`Shared`]: the classes and the host-wide
//! budget). Each device's objects live in its own arena, so each device's
//! state can be its own files. The registry of devices is [`crate::Pool`].

pub(crate) mod arena;
pub mod class;
pub(crate) mod heap;

use crate::limits::Budget;

/// Default cap on the address space one device's arena may reserve. It
/// costs nothing until used.
pub const DEFAULT_ARENA_BYTES: u64 = 1 << 40;

#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Host-wide cap on pool memory, in bytes; 0 = unlimited.
    pub host_mem_limit: u64,
    /// Most address space one device's arena may reserve (each reserves
    /// what its size can need, up to this).
    pub arena_bytes: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            host_mem_limit: 0,
            arena_bytes: DEFAULT_ARENA_BYTES,
        }
    }
}

/// What every device of a pool shares: the size classes and the host budget.
pub(crate) struct Shared {
    pub(crate) arena_cap: u64,
    pub(crate) host: Budget,
    pub(crate) classes: [class::Class; class::NUM_CLASSES],
}

impl Shared {
    pub(crate) fn new(cfg: &PoolConfig) -> Shared {
        Shared {
            arena_cap: cfg.arena_bytes.min(crate::slot::MAX_ARENA_BYTES),
            host: Budget::new(cfg.host_mem_limit),
            classes: class::classes(),
        }
    }
}
