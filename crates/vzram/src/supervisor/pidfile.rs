//! `--pidfile PATH`: the supervisor's process id, for init systems and
//! scripts without systemd (`kill -HUP $(cat PATH)` signals this daemon
//! and no other, where `pidof vzram` finds every one).
//!
//! The file is locked (flock) for the daemon's life: a second daemon given
//! the same path is refused while the first runs, and a file left by one
//! that was killed (unlocked) is taken over. It is written once the
//! sockets are bound, and removed on a clean exit with `unlinkat` relative
//! to its directory, which the seccomp filter allows (as for the sockets).

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Why `--pidfile PATH` cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum PidFileError {
    #[error("--pidfile {}: not a file name", .0.display())]
    NoName(PathBuf),
    #[error("--pidfile {}: {source}", path.display())]
    NulInName {
        path: PathBuf,
        #[source]
        source: std::ffi::NulError,
    },
    #[error("--pidfile {}: its directory: {source}", path.display())]
    Dir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("--pidfile {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Another live process holds its lock.
    #[error("--pidfile {}: {holder}", path.display())]
    Held { path: PathBuf, holder: Holder },
    #[error("--pidfile {}: it keeps being replaced; is another daemon starting?", .0.display())]
    Replaced(PathBuf),
}

/// Who holds a locked pid file, by the pid it holds (if it reads as one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    Vzram(u32),
    Other(u32),
    Unknown,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holder::Vzram(pid) => write!(
                f,
                "another vzram (pid {pid}) holds it; stop that one first, or give another path"
            ),
            Holder::Other(pid) => write!(
                f,
                "another process (pid {pid}) holds it; stop that one first, or give another path"
            ),
            Holder::Unknown => f.write_str(
                "another process holds it (locked); stop that one first, or give another path",
            ),
        }
    }
}

/// A pid file this daemon holds (locked), removed when dropped.
pub struct PidFile {
    path: PathBuf,
    dir: OwnedFd,
    name: CString,
    file: File,
}

impl PidFile {
    /// Opens (or makes) `path` and locks it; refused when another live
    /// process holds it. Nothing is written yet ([`PidFile::write`]).
    pub fn take(path: &Path) -> Result<PidFile, PidFileError> {
        let at = || path.to_path_buf();
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let name = path
            .file_name()
            .ok_or_else(|| PidFileError::NoName(at()))
            .and_then(|n| {
                CString::new(n.as_bytes())
                    .map_err(|source| PidFileError::NulInName { path: at(), source })
            })?;
        let dir_fd: OwnedFd = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
            .open(dir)
            .map_err(|source| PidFileError::Dir { path: at(), source })?
            .into();
        // Twice at most: a daemon exiting removes the file between our
        // open and our lock, and the lock taken is on a file nobody sees.
        for _ in 0..2 {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .mode(0o644)
                .custom_flags(libc::O_NOFOLLOW)
                .open(path)
                .map_err(|source| PidFileError::Open { path: at(), source })?;
            // SAFETY: flock on a descriptor we own; no memory involved.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::WouldBlock {
                    return Err(PidFileError::Open {
                        path: at(),
                        source: e,
                    });
                }
                return Err(PidFileError::Held {
                    path: at(),
                    holder: held_by(file),
                });
            }
            let same = match (file.metadata(), std::fs::symlink_metadata(path)) {
                (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
                _ => false,
            };
            if same {
                return Ok(PidFile {
                    path: path.to_path_buf(),
                    dir: dir_fd,
                    name,
                    file,
                });
            }
        }
        Err(PidFileError::Replaced(at()))
    }

    /// Writes this process's id (and a newline), replacing what was there.
    pub fn write(&self) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let text = format!("{}\n", std::process::id());
        self.file.set_len(0)?;
        self.file.write_all_at(text.as_bytes(), 0)
    }

    /// Its directory, for the seccomp filter's `unlinkat`.
    pub fn dir_fd(&self) -> RawFd {
        self.dir.as_raw_fd()
    }
}

/// Who holds a locked pid file.
fn held_by(mut file: File) -> Holder {
    let mut text = String::new();
    let _ = file.read_to_string(&mut text);
    match text.trim().parse::<u32>() {
        Ok(pid) => {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == "vzram" {
                Holder::Vzram(pid)
            } else {
                Holder::Other(pid)
            }
        }
        Err(_) => Holder::Unknown,
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        // SAFETY: the descriptor is an open directory we own and `name` a
        // NUL-terminated file name in it.
        let rc = unsafe { libc::unlinkat(self.dir.as_raw_fd(), self.name.as_ptr(), 0) };
        if rc != 0 {
            tracing::warn!(
                "cannot remove the pid file {}: {}",
                self.path.display(),
                io::Error::last_os_error()
            );
        }
    }
}
