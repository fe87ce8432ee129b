//! vzram: compressed RAM block devices for VMs, served over vhost-user-blk.
//!
//! The daemon as a library, under a thin `main`. One folder per process:
//! `supervisor` (`vzram serve`), `launcher` (starts workers), `worker`
//! (serves one frontend), and `client` (the commands that talk to a
//! running daemon). They never import each other: what passes between
//! them is in `proto`, and what runs wherever a device is owned is in
//! `owner`. `sys` is the operating-system plumbing, `config` the user's
//! input. See ARCHITECTURE.md.
//!
//! Public: the entry points `main` calls, the command line and the
//! configuration it resolves to, and `proto`, so that the tests and the
//! bench read the control socket's replies as the client does.

pub mod cli;
pub mod config;
pub mod proto;

mod client;
mod launcher;
mod owner;
mod supervisor;
mod sys;
mod worker;

pub use client::{run as run_client, ClientError};
pub use launcher::run as run_launcher;
pub use supervisor::daemon::{run as serve, Error as ServeError};
pub use sys::logging::init as init_logging;
pub use worker::main as run_worker;
