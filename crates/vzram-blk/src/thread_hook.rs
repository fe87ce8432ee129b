//! Work a queue or compress-pool thread does on itself before its first
//! request: the daemon narrows the thread's seccomp filter there. A
//! filter applies to the thread that installs it (and threads it starts
//! later), so it cannot be put on these threads from outside, and they
//! are started by the vhost crate before the process is sandboxed.

use std::cell::Cell;
use std::sync::Arc;

/// Run on the thread about to take work; true once the thread is set (it
/// is not called on that thread again), false to be asked again on its
/// next piece of work (too early: the process-wide filter is not in yet).
pub type ThreadHook = Arc<dyn Fn() -> bool + Send + Sync>;

thread_local! {
    static SET: Cell<bool> = const { Cell::new(false) };
}

/// Runs `hook` on this thread unless it already returned true here.
pub(crate) fn run(hook: Option<&ThreadHook>) {
    if let Some(h) = hook {
        if !SET.get() && h() {
            SET.set(true);
        }
    }
}
