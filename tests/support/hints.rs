//! The commands a refusal advises, run as an operator would: every hint
//! in backticks that starts with `vzram ` is a command that must run.

use std::path::Path;
use std::process::Output;

use crate::cli::Vzram;

/// The `vzram ...` commands quoted in backticks in `msg`, in order.
pub fn hints(msg: &str) -> Vec<String> {
    msg.split('`')
        .skip(1)
        .step_by(2)
        .filter(|h| h.starts_with("vzram "))
        .map(str::to_string)
        .collect()
}

/// The flags (`--fresh NAME`, ...) quoted in backticks in `msg`: what a
/// refusal of `serve` advises to start with.
pub fn flag_hints(msg: &str) -> Vec<String> {
    msg.split('`')
        .skip(1)
        .step_by(2)
        .filter(|h| h.starts_with("--"))
        .map(str::to_string)
        .collect()
}

/// Runs `line` (`vzram CMD ARGS...`, words split on blanks) against the
/// daemon at `control`, given as the environment gives it
/// (`$VZRAM_CONTROL`), so the command runs exactly as advised.
pub fn run_hint(control: &Path, line: &str) -> Output {
    let mut words = line.split_whitespace();
    assert_eq!(words.next(), Some("vzram"), "not a vzram command: {line}");
    Vzram::new(&[])
        .args(words)
        .env("VZRAM_CONTROL", control)
        .output()
}

/// [`run_hint`] for a command that must succeed; its stdout.
pub fn run_hint_ok(control: &Path, line: &str) -> String {
    let o = run_hint(control, line);
    assert!(
        o.status.success(),
        "the advised `{line}` does not run: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The one line a refused command printed on stderr, with exit code 2.
pub fn refusal(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).trim_end().to_string();
    assert_eq!(
        o.status.code(),
        Some(2),
        "not refused: {}{err}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert_eq!(err.lines().count(), 1, "not one line: {err}");
    err
}
