//! A panic ends the process: a thread that died would leave the others
//! running, half alive.

/// Makes a panic on any thread end the process with `code`, once the
/// default hook has printed it and `why` is logged. Installed before any
/// thread starts.
pub fn exit_on_panic(why: &'static str, code: i32) {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        tracing::error!("{why}");
        // SAFETY: _exit (exit_group, which every seccomp filter of ours
        // allows) ends the process at once, running no destructors or
        // atexit handlers that could wait on locks the panicking thread
        // holds; every device's state is in its shared files.
        unsafe { libc::_exit(code) };
    }));
}
