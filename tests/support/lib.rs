//! Helpers shared by the integration and end-to-end tests in `tests/`,
//! the root package's library:
//!
//! - [`paths`]: the repository, the `vzram` binary (built when stale), a
//!   test's temporary directory and the daemon state kept for it, `s()`.
//! - [`cli`]: the `vzram` command line as a test runs it ([`Vzram`]).
//! - [`daemon`]: a running `vzram serve` ([`Daemon`]) and its control socket.
//! - [`stats`]: a stat reply ([`Stats`]), by device name or socket.
//! - [`client`]: a `blkio` client on one device ([`Client`], [`Queue`]).
//! - [`data`]: test data (patterns, noise, a seeded RNG, versioned pages).
//! - [`hints`]: the commands a refusal advises, run as advised.
//! - [`procs`]: the daemon's process tree and `/proc/PID/status`.
//! - [`hostile`]: two devices, one for a hostile raw frontend, one for
//!   a well-behaved client, for `tests/hostile*.rs`.
//! - [`frontend`]: a raw vhost-user-blk frontend that writes its virtqueue
//!   by hand, for the hostile-client and protocol tests.
//! - [`guest`]: the end-to-end harness: QEMU guests, QMP, hang dumps.
//! - [`migrating`]: two daemons, one migrating to the other.
//!
//! Everything but `frontend` and `guest` is also at the root, for
//! `use vzram_tests::*`.

/// Fails the test with a message when `cond` is false; in an end-to-end
/// test, [`guest::Ctx`] then prints the logs.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        let ok: bool = $cond;
        if !ok {
            panic!("{}: {}", stringify!($cond), format!($($fmt)+));
        }
    };
}

pub mod cli;
pub mod client;
pub mod daemon;
pub mod data;
pub mod frontend;
pub mod guest;
pub mod hints;
pub mod hostile;
pub mod metrics;
pub mod migrating;
pub mod paths;
pub mod pki;
pub mod procs;
pub mod stats;

pub use cli::*;
pub use client::*;
pub use daemon::*;
pub use data::*;
pub use hints::*;
pub use paths::*;
pub use procs::*;
pub use stats::*;

pub use serde_json::json;
