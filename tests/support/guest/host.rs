//! The programs the harness needs from the host: QEMU, and gdb for hang
//! dumps.

use std::fs;
use std::path::Path;

/// `$QEMU`, else `qemu-system-x86_64`.
pub(super) fn qemu_binary() -> String {
    std::env::var("QEMU").unwrap_or_else(|_| "qemu-system-x86_64".to_string())
}

/// Whether `prog` names an executable file, directly or on `PATH`.
pub(super) fn on_path(prog: &str) -> bool {
    let is_exe = |p: &Path| fs::metadata(p).map(|m| m.is_file()).unwrap_or(false);
    if prog.contains('/') {
        return is_exe(Path::new(prog));
    }
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|d| is_exe(&d.join(prog))))
        .unwrap_or(false)
}
