//! A state root and everything in it are this process's user's alone: a
//! root another user made first (in a world-writable tmpfs such as
//! `/dev/shm`), a state planted in it, or one opened to others would put a
//! VM's pages where someone else reads or replaces them. Checked as sshd
//! checks its keys: by `lstat`/`fstat`, and refused with one line naming the
//! path, its owner and mode, and the fix. Nothing that is not ours is
//! ever deleted.

use std::fs::Metadata;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::Path;

use crate::error::{Result, StoreError};

/// The user whose files the state must be: the process's effective uid.
/// Asked once: the daemon asks before its seccomp filter, which does not
/// allow `geteuid`, and its user never changes.
pub fn euid() -> u32 {
    static EUID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    // SAFETY: geteuid has no preconditions and cannot fail.
    *EUID.get_or_init(|| unsafe { libc::geteuid() })
}

/// What a checked path is to a state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// The state root (`--state-dir`).
    Root,
    /// A device's state directory.
    State,
    /// A file of a state (header, table, arena, stats).
    File,
}

impl Part {
    fn what(self) -> &'static str {
        match self {
            Part::Root => "state dir",
            Part::State => "device state",
            Part::File => "state file",
        }
    }

    fn mode(self) -> u32 {
        match self {
            Part::Root | Part::State => 0o700,
            Part::File => 0o600,
        }
    }
}

/// Refuses `path` (whose metadata, not following links, is `m`) unless
/// it is a directory (or, for [`Part::File`], a regular file) owned by
/// this process's user with no access for group or others.
pub(crate) fn check(path: &Path, m: &Metadata, part: Part) -> Result<()> {
    let me = euid();
    let ft = m.file_type();
    let kind_ok = match part {
        Part::File => ft.is_file(),
        Part::Root | Part::State => ft.is_dir(),
    };
    let p = path.display();
    let what = part.what();
    if ft.is_symlink() || !kind_ok {
        let is = if ft.is_symlink() {
            "a symbolic link"
        } else {
            "not a plain directory or file"
        };
        return Err(refused(format!(
            "{what} {p} is {is}, owner uid {}, mode {:04o}: a {what} must be this user's own (uid {me}); left alone (use another --state-dir, or put the real one in its place)",
            m.uid(),
            m.mode() & 0o7777
        )));
    }
    if m.uid() != me || m.mode() & 0o077 != 0 {
        let fix = if part == Part::Root {
            format!(
                "if it is vzram's: `chown {me} {p} && chmod {:04o} {p}`, else use another --state-dir",
                part.mode()
            )
        } else {
            format!(
                "if it is this device's: `chown -R {me} {p} && chmod {:04o} {p}`",
                part.mode()
            )
        };
        return Err(refused(format!(
            "{what} {p} is owned by uid {} with mode {:04o}, not this daemon's user's alone (uid {me}, no access for group or others): another user could read or replace the VMs' pages; left alone ({fix})",
            m.uid(),
            m.mode() & 0o7777
        )));
    }
    Ok(())
}

fn refused(m: String) -> StoreError {
    StoreError::InvalidConfig(m)
}

/// [`check`] on what `path` is (not following a link).
pub(crate) fn check_path(path: &Path, part: Part) -> Result<()> {
    let m = std::fs::symlink_metadata(path).map_err(|e| StoreError::state(path.display(), e))?;
    check(path, &m, part)
}

/// Whether `path` is a directory of this user's (not a link): the only
/// kind of half made state or tombstone ever deleted.
pub(crate) fn is_ours(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir() && m.uid() == euid())
}

/// Makes `root` if missing (mode 0700), and `parent` first when given (a
/// built-in default whose parent may not exist yet, with its mode); an
/// explicit state dir whose parent is missing is a typo, refused. An
/// existing root must be this user's: one readable (not writable) by
/// others, as an older vzram made it, is closed to them with a warning;
/// anything else is refused. Returns whether the root was made here.
pub(crate) fn make_root(root: &Path, parent: Option<(&Path, u32)>) -> Result<bool> {
    if let Some((dir, mode)) = parent {
        match std::fs::DirBuilder::new().mode(mode).create(dir) {
            Ok(()) => {
                // The mode given, whatever the umask.
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
                    .map_err(|e| StoreError::state(dir.display(), e))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(StoreError::state(dir.display(), e)),
        }
    }
    let made = match std::fs::DirBuilder::new().mode(0o700).create(root) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(StoreError::InvalidConfig(format!(
                "state dir {}: its parent directory does not exist",
                root.display()
            )))
        }
        Err(e) => return Err(StoreError::state(root.display(), e)),
    };
    let m = std::fs::symlink_metadata(root).map_err(|e| StoreError::state(root.display(), e))?;
    let mode = m.mode() & 0o7777;
    if !made && m.is_dir() && m.uid() == euid() && mode & 0o077 != 0 && mode & 0o022 == 0 {
        // Ours, and nobody else could have put anything in it: only its
        // listing was open. Closed, so a new start never refuses the root
        // an older vzram made 0755.
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(mode & !0o077))
            .map_err(|e| StoreError::state(root.display(), e))?;
        tracing::warn!(state_dir = %root.display(), "the state dir had mode {mode:04o}: closed to group and others ({:04o})", mode & !0o077);
        return Ok(false);
    }
    check(root, &m, Part::Root)?;
    Ok(made)
}
