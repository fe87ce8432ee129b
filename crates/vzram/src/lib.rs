//! vzram: compressed RAM block devices for VMs, served over vhost-user-blk.
//!
//! The daemon as a library, under a thin `main`: the supervisor (`daemon`,
//! `supervisor`, `launcher`), the per-frontend `worker`, the `control`
//! socket and its `client`, `metrics`, configuration and the sandbox.

pub mod cli;
pub mod client;
pub mod config;
pub mod control;
pub mod daemon;
pub mod launcher;
pub mod listen;
pub mod metrics;
pub mod migration;
pub mod notify;
pub mod seccomp;
pub mod supervisor;
pub mod worker;
