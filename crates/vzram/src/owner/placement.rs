//! Where a device's state is, and whether that is where it was: a marker
//! beside the device's socket records the state directory that socket was
//! last served from, so a state dir that changed between runs (an
//! environment variable lost in a restart, a socket activator that passes
//! none) stops the start instead of serving a blank disk while the real
//! one sits in the old place. Also what kind of file system the state
//! dir is, and how much room it has.

use std::ffi::OsString;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// `<socket dir>/.<socket file>.vzram-state`.
pub fn marker_path(socket: &Path) -> Option<PathBuf> {
    let file = socket.file_name()?;
    let mut name = OsString::from(".");
    name.push(file);
    name.push(".vzram-state");
    Some(socket.with_file_name(name))
}

/// The state directory the marker beside `socket` names, if any.
pub fn recorded(socket: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(marker_path(socket)?).ok()?;
    let line = text.lines().next()?.trim_end();
    (!line.is_empty()).then(|| PathBuf::from(line))
}

/// Refuses a state dir other than the one `socket` was last served from,
/// while that one still holds a state: the caller starts empty only on
/// `--fresh` (`discard`), and serves a state `dir` holds with `--adopt`
/// (`adopt`): after a start in the wrong state dir, the right one's pages
/// must have a way back that deletes nothing.
pub fn check(socket: &Path, dir: &Path, discard: bool, adopt: bool) -> Result<(), PlacementError> {
    let Some(was) = recorded(socket) else {
        return Ok(());
    };
    let now = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let here = vzram_store::state::is_state_dir(&now);
    if vzram_store::state::same_path(&was, &now)
        || discard
        || (adopt && here)
        || !vzram_store::state::is_state_dir(&was)
    {
        return Ok(());
    }
    let root = was.parent().unwrap_or(&was);
    let renamed = now
        .parent()
        .is_some_and(|n| vzram_store::state::same_path(n, root));
    Err(PlacementError {
        socket: socket.to_path_buf(),
        was,
        now,
        state_here: here,
        renamed,
    })
}

/// A socket last served from a state that is still there, elsewhere than
/// this run would serve it from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct PlacementError {
    pub socket: PathBuf,
    /// The state the marker names.
    pub was: PathBuf,
    /// The state this run would serve (absolute).
    pub now: PathBuf,
    /// `now` holds a state too: which of the two is the disk is the
    /// operator's call, and either way keeps the other.
    pub state_here: bool,
    /// Same state dir, another name (rather than another state dir).
    pub renamed: bool,
}

impl std::fmt::Display for PlacementError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (socket, was, now) = (&self.socket, &self.was, &self.now);
        let name = now.file_name().unwrap_or_default().to_string_lossy();
        let adopt_hint = if self.state_here {
            format!(
                ", `--adopt {name}` to serve the state {} instead (the marker then records it)",
                now.display()
            )
        } else {
            String::new()
        };
        if self.renamed {
            let old = was.file_name().unwrap_or_default().to_string_lossy();
            return write!(
                f,
                "socket {} was last served from the state {} (device name {old}), and it is still there, but this run names the device otherwise: \
                 give it name={old} to keep serving those pages{adopt_hint}, or start with `--fresh {name}` to start it empty",
                socket.display(),
                was.display(),
            );
        }
        let root = was.parent().unwrap_or(was);
        write!(
            f,
            "socket {} was last served from the state {}, and it is still there, but this run's state dir would give {}: \
             start with `--state-dir {}` (or state-dir= on the device) to serve it{adopt_hint}, or `--fresh {name}` to start empty (the marker {} says where it was)",
            socket.display(),
            was.display(),
            now.display(),
            root.display(),
            marker_path(socket).unwrap_or_default().display()
        )
    }
}

/// Records that `socket` is served from the state `dir` (written to a
/// temporary file and renamed, so a reader sees the old or the new).
pub fn record(socket: &Path, dir: &Path) -> std::io::Result<()> {
    let Some(m) = marker_path(socket) else {
        return Ok(());
    };
    let dir = std::path::absolute(dir)?;
    if recorded(socket).as_deref() == Some(dir.as_path()) {
        return Ok(());
    }
    let mut tmp = m.clone().into_os_string();
    tmp.push(format!(".{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)?;
    let mut text = dir.into_os_string().into_encoded_bytes();
    text.push(b'\n');
    f.write_all(&text)?;
    drop(f);
    std::fs::rename(&tmp, &m).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Forgets where `socket` was served from (its device was removed).
pub fn forget(socket: &Path) {
    if let Some(m) = marker_path(socket) {
        let _ = std::fs::remove_file(m);
    }
}

/// What the state dir is: its file system, and the room left on it.
#[derive(Debug, Clone, Copy)]
pub struct Room {
    /// tmpfs or ramfs: the state's pages are plain memory.
    pub in_memory: bool,
    pub free_bytes: u64,
}

pub fn room(dir: &Path) -> std::io::Result<Room> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: an all-zero statfs is a valid value for the kernel to fill.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `s` a statfs we own.
    if unsafe { libc::statfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    let magic = s.f_type as i64;
    let bsize = s.f_bsize as u64;
    Ok(Room {
        in_memory: magic == libc::TMPFS_MAGIC || magic == RAMFS_MAGIC,
        free_bytes: s.f_bavail as u64 * bsize,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_refuses_a_moved_state_dir_while_the_old_state_is_there() {
        let d = std::env::temp_dir().join(format!("vzram-marker-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("old/vm")).unwrap();
        let sock = d.join("vm.sock");
        assert_eq!(recorded(&sock), None);
        check(&sock, &d.join("new/vm"), false, false).unwrap();
        record(&sock, &d.join("old/vm")).unwrap();
        assert_eq!(recorded(&sock), Some(d.join("old/vm")));
        // The old place holds no state: moving is harmless.
        check(&sock, &d.join("new/vm"), false, false).unwrap();
        std::fs::write(d.join("old/vm/header"), b"VZRAMST\0rest").unwrap();
        let e = check(&sock, &d.join("new/vm"), false, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--state-dir") && e.contains("old"), "{e}");
        // --adopt serves only a state that is there.
        check(&sock, &d.join("new/vm"), false, true).unwrap_err();
        std::fs::create_dir_all(d.join("new/vm")).unwrap();
        std::fs::write(d.join("new/vm/header"), b"VZRAMST\0rest").unwrap();
        let e = check(&sock, &d.join("new/vm"), false, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`--adopt vm`"), "{e}");
        check(&sock, &d.join("new/vm"), false, true).unwrap();
        check(&sock, &d.join("new/vm"), true, false).unwrap();
        check(&sock, &d.join("old/vm"), false, false).unwrap();
        forget(&sock);
        assert_eq!(recorded(&sock), None);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
