//! A migration stream's send and receive over sockets, as the daemon's
//! owner runs them, for the migration tests.

use std::os::unix::net::UnixStream;

use vzram_store::migrate::{self, Verdict};
use vzram_store::Device;

/// The stream's send over one socket (its read timeout is the patience).
pub fn send_on(
    dev: &Device,
    s: &UnixStream,
    quiet: &dyn Fn() -> bool,
    verdict: &dyn Fn() -> Verdict,
    cancelled: &dyn Fn() -> Option<String>,
    progress: &dyn Fn(migrate::Progress),
) -> Result<migrate::SendReport, migrate::MigrateError> {
    let hooks = migrate::SendHooks {
        quiet,
        verdict: &|_| verdict(),
        cancelled,
        progress,
        patience: &|p| s.set_read_timeout(p).unwrap(),
    };
    migrate::send(dev, s, s, &hooks)
}

/// The stream's receive (the VM never runs here).
pub fn receive_on(
    dev: &Device,
    r: impl std::io::Read,
    w: impl std::io::Write,
    progress: &dyn Fn(migrate::Progress),
    prepared: &dyn Fn(),
    commit: &dyn Fn(),
) -> Result<migrate::ReceiveReport, migrate::MigrateError> {
    let hooks = migrate::ReceiveHooks {
        progress,
        prepared,
        started: &|| false,
        commit,
        patience: &|_| {},
    };
    migrate::receive(dev, r, w, &hooks)
}
