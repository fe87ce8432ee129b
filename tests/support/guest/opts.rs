//! [`GuestOpts`]: how to boot a guest (`contrib/guest/run.sh`'s options).

use std::path::{Path, PathBuf};

/// How to boot a guest.
#[derive(Clone, Debug)]
pub struct GuestOpts {
    pub socket: PathBuf,
    pub mem: String,
    pub queues: u32,
    pub tests: String,
    pub append: Vec<String>,
    /// QEMU's `reconnect=` for the vhost-user chardev, in seconds (0: off):
    /// a guest whose backend goes away stalls and resumes once a daemon
    /// serves the socket again.
    pub reconnect: u32,
    /// Appended to QEMU's command line (`-incoming ...`, `-qmp ...`).
    pub qemu_args: Vec<String>,
}

impl GuestOpts {
    pub fn new(socket: &Path, tests: &str) -> GuestOpts {
        GuestOpts {
            socket: socket.to_path_buf(),
            mem: "256M".into(),
            queues: 1,
            tests: tests.into(),
            append: Vec::new(),
            reconnect: 1,
            qemu_args: Vec::new(),
        }
    }

    /// One more QEMU argument.
    pub fn qemu_arg(mut self, a: impl Into<String>) -> Self {
        self.qemu_args.push(a.into());
        self
    }

    /// QEMU's reconnect interval in seconds; 0 turns reconnecting off.
    pub fn reconnect(mut self, secs: u32) -> Self {
        self.reconnect = secs;
        self
    }

    pub fn queues(mut self, n: u32) -> Self {
        self.queues = n;
        self
    }

    pub fn mem(mut self, m: &str) -> Self {
        self.mem = m.into();
        self
    }

    /// A kernel argument such as `vzram.seed=3`.
    pub fn arg(mut self, a: impl Into<String>) -> Self {
        self.append.push(a.into());
        self
    }
}
