//! Logging, set up the same way in every process of the daemon.

use std::fmt;
use std::io::{self, IsTerminal};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

use crate::proto::worker_spec::{LogFormat, LogLevel};

/// Logs go to stderr; `RUST_LOG`, when set, filters them, else `level`.
pub fn init(level: LogLevel, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level.as_str()));
    let journal = format == LogFormat::Text && stderr_is_the_journal();
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(move || Lossy { format, journal });
    match format {
        LogFormat::Json => b.with_ansi(false).json().init(),
        // journald stamps each line itself, and takes `<N>` as the
        // priority: without it every line is info, and
        // `journalctl -p warning` misses the warnings.
        LogFormat::Text if journal => b
            .with_ansi(false)
            .event_format(Journal(
                tracing_subscriber::fmt::format()
                    .without_time()
                    .with_ansi(false),
            ))
            .init(),
        // No colour codes in log files.
        LogFormat::Text => b.with_ansi(std::io::stderr().is_terminal()).init(),
    }
}

/// Log lines that could not be written, not yet said.
static LOST: AtomicU64 = AtomicU64::new(0);

/// stderr that never fails a logging thread. A line that cannot be
/// written (the disk under a log file full, the journal gone) is lost and
/// counted; the next one that can be says how many were. The formatter
/// writes an event in one call, so a call is a line. Failing instead, the
/// formatter would report it with `eprintln!`, which panics when stderr
/// fails: a worker would exit mid-request, a supervisor thread would die.
struct Lossy {
    format: LogFormat,
    journal: bool,
}

impl Lossy {
    /// The line that says `lost` lines were lost, in the log's format.
    fn note(&self, lost: u64) -> String {
        let what = format!("{lost} log lines could not be written");
        match self.format {
            LogFormat::Json => format!(
                "{{\"level\":\"WARN\",\"fields\":{{\"message\":\"{what}\"}},\"target\":\"vzram\"}}\n"
            ),
            LogFormat::Text if self.journal => format!("<4>WARN vzram: {what}\n"),
            LogFormat::Text => format!("WARN vzram: {what}\n"),
        }
    }
}

impl io::Write for Lossy {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut err = io::stderr().lock();
        let lost = LOST.load(Relaxed);
        if lost > 0 && err.write_all(self.note(lost).as_bytes()).is_ok() {
            LOST.fetch_sub(lost, Relaxed);
        }
        if err.write_all(buf).is_err() {
            LOST.fetch_add(1, Relaxed);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let _ = io::stderr().flush();
        Ok(())
    }
}

/// systemd sets `JOURNAL_STREAM` to the device and inode of the stream it
/// connected; only if stderr is still that stream is it the journal (a
/// child whose stderr was redirected inherits the variable too).
fn stderr_is_the_journal() -> bool {
    let Some(v) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = v.to_str().and_then(|s| s.split_once(':')) else {
        return false;
    };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else {
        return false;
    };
    // SAFETY: fstat fills in a stat buffer we own, for our own stderr.
    let st = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(std::io::stderr().as_raw_fd(), &mut st) != 0 {
            return false;
        }
        st
    };
    st.st_dev == dev && st.st_ino == ino
}

/// sd-daemon(3)'s priority of a level: `<3>` error to `<7>` debug.
fn priority(level: Level) -> u8 {
    match level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        Level::DEBUG | Level::TRACE => 7,
    }
}

/// Each line prefixed with its priority, the rest as `F` writes it.
struct Journal<F>(F);

impl<S, N, F> FormatEvent<S, N> for Journal<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        write!(w, "<{}>", priority(*event.metadata().level()))?;
        self.0.format_event(ctx, w, event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The note of lost lines reads as a line of the log's own format.
    #[test]
    fn the_note_of_lost_lines_is_a_line_of_the_log() {
        let note = |format, journal| Lossy { format, journal }.note(3);
        let json: serde_json::Value =
            serde_json::from_str(note(LogFormat::Json, false).trim_end()).unwrap();
        assert_eq!(json["level"], "WARN");
        assert_eq!(
            json["fields"]["message"],
            "3 log lines could not be written"
        );
        assert!(note(LogFormat::Text, true).starts_with("<4>"));
        assert!(note(LogFormat::Text, false).ends_with("could not be written\n"));
    }

    #[test]
    fn priorities_follow_sd_daemon() {
        assert_eq!(priority(Level::ERROR), 3);
        assert_eq!(priority(Level::WARN), 4);
        assert_eq!(priority(Level::INFO), 6);
        assert_eq!(priority(Level::DEBUG), 7);
    }
}
