//! Logging, set up the same way in every process of the daemon.

use std::io::IsTerminal;

use crate::proto::worker_spec::LogLevel;

/// Logs go to stderr; `RUST_LOG`, when set, filters them, else `level`.
pub fn init(level: LogLevel) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level.as_str()));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // No colour codes in log files and journald.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
