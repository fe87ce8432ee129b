//! What the launcher may remove and where it may make states, on its own
//! evidence rather than on the word of the order: the supervisor that
//! sends orders runs under a filter because what it reads (clients,
//! frontends, migration peers) is not trusted, and the launcher, which
//! has no filter, must not become its way to any file.
//!
//! - A socket or a state is removed only if the daemon bound or opened it
//!   at start (told once, in [`Request::Started`](crate::proto::launch::Request::Started),
//!   before the supervisor read anything a client sent) or the launcher
//!   prepared it since; once removed, it is forgotten.
//! - A state is made or opened only under a root given at start or named
//!   as a `state_dir` in the configuration file the launcher was started
//!   with (read by the launcher itself, for devices a reload adds).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Why the launcher refused an order's path.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refused {
    #[error(transparent)]
    Store(#[from] vzram_store::StoreError),
    /// A path the daemon neither bound nor opened at start and the
    /// launcher did not prepare.
    #[error("{}: not a {what} this daemon made or serves; left alone", path.display())]
    NotHeld { what: &'static str, path: PathBuf },
    #[error(
        "state dir {} is not one this daemon was started with or its configuration file names: \
         add the device without state-dir= (its state goes in {}), or name the directory as the \
         device's state_dir in the configuration file and run `vzram reload`",
        root.display(),
        default.display()
    )]
    UnknownRoot { root: PathBuf, default: PathBuf },
}

/// Paths compared as the daemon names them, made absolute (lexically:
/// `..` is kept, so it never matches a root that lacks it).
fn key(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

#[derive(Debug, Default)]
pub(super) struct Held {
    /// No more [`Held::start`] once any request came.
    sealed: bool,
    /// The daemon's state root, for the advice of a refusal.
    state_dir: Option<PathBuf>,
    roots: Vec<PathBuf>,
    sockets: HashSet<PathBuf>,
    states: HashSet<PathBuf>,
    /// The configuration file (`__launcher CONFIG`).
    config: Option<PathBuf>,
}

impl Held {
    pub(super) fn new(config: Option<PathBuf>) -> Held {
        Held {
            config,
            ..Held::default()
        }
    }

    /// What the daemon made at start; false (and nothing taken) unless it
    /// is the first request.
    pub(super) fn start(
        &mut self,
        state_dir: &Path,
        roots: &[PathBuf],
        sockets: &[PathBuf],
        states: &[PathBuf],
    ) -> bool {
        if std::mem::replace(&mut self.sealed, true) {
            return false;
        }
        self.state_dir = Some(state_dir.to_path_buf());
        self.roots = std::iter::once(state_dir)
            .chain(roots.iter().map(PathBuf::as_path))
            .map(key)
            .collect();
        self.sockets = sockets.iter().map(|p| key(p)).collect();
        self.states = states.iter().map(|p| key(p)).collect();
        true
    }

    /// Any other request: from now on nothing is added but what the
    /// launcher prepares itself.
    pub(super) fn seal(&mut self) {
        self.sealed = true;
    }

    /// Refuses a state root the launcher does not know.
    pub(super) fn check_root(&mut self, root: &Path) -> Result<(), Refused> {
        // Said first, as the store says it at start.
        vzram_store::state::check_root_place(root)?;
        let k = key(root);
        if self.roots.contains(&k) {
            return Ok(());
        }
        // A device a reload adds may name its own; only the file says so.
        if let Some(f) = self
            .config
            .as_deref()
            .and_then(|c| crate::config::load_file(c).ok())
        {
            let named = f
                .state_dir
                .into_iter()
                .chain(f.devices.into_iter().filter_map(|d| d.state_dir))
                .map(|p| key(&p));
            for r in named {
                if !self.roots.contains(&r) {
                    self.roots.push(r);
                }
            }
            if self.roots.contains(&k) {
                return Ok(());
            }
        }
        Err(Refused::UnknownRoot {
            root: root.to_path_buf(),
            default: self.state_dir.clone().unwrap_or_default(),
        })
    }

    /// Refuses to remove what the daemon neither made at start nor had
    /// the launcher prepare.
    pub(super) fn check_remove(
        &self,
        socket: Option<&Path>,
        state: Option<&Path>,
    ) -> Result<(), Refused> {
        if let Some(p) = socket.filter(|p| !self.sockets.contains(&key(p))) {
            return Err(Refused::NotHeld {
                what: "socket",
                path: p.to_path_buf(),
            });
        }
        if let Some(p) = state.filter(|p| !self.states.contains(&key(p))) {
            return Err(Refused::NotHeld {
                what: "state",
                path: p.to_path_buf(),
            });
        }
        Ok(())
    }

    /// A `Prepare` done: its socket and state may be removed.
    pub(super) fn prepared(&mut self, socket: &Path, state: &Path) {
        self.sockets.insert(key(socket));
        self.states.insert(key(state));
    }

    /// Removed: not again.
    pub(super) fn removed(&mut self, socket: Option<&Path>, state: Option<&Path>) {
        if let Some(p) = socket {
            self.sockets.remove(&key(p));
        }
        if let Some(p) = state {
            self.states.remove(&key(p));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_was_made_at_start_or_prepared_is_removed() {
        let mut h = Held::new(None);
        let (a, sa) = (PathBuf::from("/r/a.sock"), PathBuf::from("/s/a"));
        assert!(h.start(
            Path::new("/s"),
            &[],
            std::slice::from_ref(&a),
            std::slice::from_ref(&sa)
        ));
        assert!(!h.start(Path::new("/t"), &[], &[PathBuf::from("/etc")], &[]));
        assert!(h.check_remove(Some(&a), Some(&sa)).is_ok());
        assert!(h.check_remove(Some(Path::new("/r/b.sock")), None).is_err());
        assert!(h.check_remove(None, Some(Path::new("/s/../s/a"))).is_err());
        assert!(h.check_remove(None, Some(Path::new("/etc"))).is_err());
        h.removed(Some(&a), None);
        assert!(h.check_remove(Some(&a), None).is_err(), "removed once");
        assert!(h.check_remove(None, Some(&sa)).is_ok(), "kept, left over");
        let (b, sb) = (PathBuf::from("/r/b.sock"), PathBuf::from("/s/b"));
        h.prepared(&b, &sb);
        assert!(h.check_remove(Some(&b), Some(&sb)).is_ok());
    }

    #[test]
    fn a_late_start_adds_nothing() {
        let mut h = Held::new(None);
        h.seal();
        assert!(!h.start(Path::new("/s"), &[], &[PathBuf::from("/r/a.sock")], &[]));
        assert!(h.check_remove(Some(Path::new("/r/a.sock")), None).is_err());
        assert!(h.check_root(Path::new("/s")).is_err());
    }

    #[test]
    fn states_are_made_only_under_known_roots() {
        let dir = std::env::temp_dir().join(format!("vzram-held-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("vzram.toml");
        let named = dir.join("named");
        std::fs::write(
            &cfg,
            format!(
                "[[device]]\nsocket = \"/r/x.sock\"\nsize = \"16M\"\nstate_dir = {:?}\n",
                named.display().to_string()
            ),
        )
        .unwrap();
        let mut h = Held::new(Some(cfg));
        let root = dir.join("root");
        assert!(h.start(&root, &[dir.join("other")], &[], &[]));
        assert!(h.check_root(&root).is_ok());
        assert!(h.check_root(&dir.join("other")).is_ok());
        assert!(h.check_root(&named).is_ok(), "named by the file");
        assert!(h.check_root(&root.join("..").join("root")).is_err());
        assert!(h.check_root(&dir).is_err());
        assert!(h.check_root(Path::new("/etc")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
