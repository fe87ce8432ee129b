//! Where device state lives when no flag or file says: never a directory
//! another local user could make first (a state root in a world-writable
//! tmpfs is checked for owner and mode, see `vzram_store::state`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// systemd's runtime directory: the first of `$RUNTIME_DIRECTORY`'s
/// ':'-separated paths (a unit may name several), if set.
pub(super) fn runtime_directory(var: Option<OsString>) -> Option<PathBuf> {
    let d = var.filter(|d| !d.is_empty())?;
    let first = d.to_string_lossy().split(':').next()?.to_string();
    (!first.is_empty()).then(|| PathBuf::from(first))
}

/// A parent of the default state root that the daemon makes itself when
/// missing (`/run/vzram` for root), with its mode. A state dir given on
/// the command line or in the file gets none: its parent must exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateParent {
    pub dir: PathBuf,
    pub mode: u32,
}

/// The default state root, and the parent to make for it if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefaultStateDir {
    pub path: PathBuf,
    pub parent: Option<StateParent>,
}

/// What [`state_dir_from`] decides by.
#[derive(Debug, Clone, Default)]
pub struct StateEnv {
    pub vzram_state_dir: Option<OsString>,
    pub runtime_directory: Option<OsString>,
    /// `$XDG_RUNTIME_DIR`, only when it is a directory of this user's.
    pub xdg_runtime_dir: Option<PathBuf>,
    pub euid: u32,
}

impl StateEnv {
    /// This process's environment and user.
    pub fn current() -> StateEnv {
        let euid = vzram_store::state::euid();
        let xdg = std::env::var_os("XDG_RUNTIME_DIR")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .filter(|d| owned_dir(d, euid));
        StateEnv {
            vzram_state_dir: std::env::var_os("VZRAM_STATE_DIR"),
            runtime_directory: std::env::var_os("RUNTIME_DIRECTORY"),
            xdg_runtime_dir: xdg,
            euid,
        }
    }
}

fn owned_dir(d: &Path, uid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(d).is_ok_and(|m| m.is_dir() && m.uid() == uid)
}

/// `$VZRAM_STATE_DIR`, else `$RUNTIME_DIRECTORY/state` (systemd), else for
/// root `/run/vzram/state` (making `/run/vzram`, 0755), else
/// `$XDG_RUNTIME_DIR/vzram/state` when that is this user's (making
/// `$XDG_RUNTIME_DIR/vzram`, 0700), else `/dev/shm/vzram-<uid>`, which
/// another user could make first: the daemon refuses it then.
pub fn state_dir_from(env: StateEnv) -> DefaultStateDir {
    let plain = |path: PathBuf| DefaultStateDir { path, parent: None };
    if let Some(d) = env.vzram_state_dir.filter(|d| !d.is_empty()) {
        return plain(PathBuf::from(d));
    }
    if let Some(d) = runtime_directory(env.runtime_directory) {
        return plain(d.join("state"));
    }
    let made = |dir: PathBuf, mode: u32| DefaultStateDir {
        path: dir.join("state"),
        parent: Some(StateParent { dir, mode }),
    };
    if env.euid == 0 {
        return made(PathBuf::from("/run/vzram"), 0o755);
    }
    if let Some(x) = env.xdg_runtime_dir {
        return made(x.join("vzram"), 0o700);
    }
    plain(PathBuf::from(format!("/dev/shm/vzram-{}", env.euid)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_state_dir_is_never_one_another_user_makes_first() {
        let os = |s: &str| Some(OsString::from(s));
        let env = |euid| StateEnv {
            euid,
            ..StateEnv::default()
        };
        let at = |d: DefaultStateDir| (d.path, d.parent.map(|p| (p.dir, p.mode)));
        assert_eq!(
            at(state_dir_from(StateEnv {
                vzram_state_dir: os("/x"),
                runtime_directory: os("/run/a"),
                ..env(0)
            })),
            (PathBuf::from("/x"), None)
        );
        assert_eq!(
            at(state_dir_from(StateEnv {
                vzram_state_dir: os(""),
                runtime_directory: os("/run/a:/run/b"),
                ..env(1000)
            })),
            (PathBuf::from("/run/a/state"), None)
        );
        assert_eq!(
            at(state_dir_from(env(0))),
            (
                PathBuf::from("/run/vzram/state"),
                Some((PathBuf::from("/run/vzram"), 0o755))
            )
        );
        // Root ignores XDG_RUNTIME_DIR: /run/vzram is root's to make.
        let xdg = Some(PathBuf::from("/run/user/1000"));
        assert_eq!(
            at(state_dir_from(StateEnv {
                xdg_runtime_dir: xdg.clone(),
                ..env(0)
            }))
            .0,
            PathBuf::from("/run/vzram/state")
        );
        assert_eq!(
            at(state_dir_from(StateEnv {
                xdg_runtime_dir: xdg,
                ..env(1000)
            })),
            (
                PathBuf::from("/run/user/1000/vzram/state"),
                Some((PathBuf::from("/run/user/1000/vzram"), 0o700))
            )
        );
        assert_eq!(
            at(state_dir_from(env(1000))),
            (PathBuf::from("/dev/shm/vzram-1000"), None)
        );
    }
}
