//! `vzram forget` with no daemon to ask: a bare `vzram serve` that was
//! stopped leaves its states in the default state dir and no control
//! socket. Each state is deleted only under its own lock, so one that a
//! running vzram serves (it holds the lock) is never touched.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use vzram_store::Leftover;

use super::render::human;

/// Why nothing was deleted: the user's to fix (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("{}: a running vzram holds this state (its device); stop that daemon or forget it through its control socket", .0.display())]
    Held(PathBuf),
    #[error("no left-over state {name:?} in {}", root.display())]
    NoSuch { name: String, root: PathBuf },
    #[error(transparent)]
    Delete(#[from] DeleteError),
}

/// Why a left-over listed was not deleted.
#[derive(Debug, thiserror::Error)]
pub enum DeleteError {
    #[error("{}: not the state that was listed (made again or gone since); left alone", .0.display())]
    Changed(PathBuf),
    #[error(transparent)]
    Store(#[from] vzram_store::StoreError),
}

/// Whether nothing listens at `control` (no file, or nobody behind it):
/// the state dir is then the only place to look.
pub fn no_daemon(control: &Path) -> bool {
    match std::os::unix::net::UnixStream::connect(control) {
        Ok(_) => false,
        Err(e) => matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused),
    }
}

/// Which left-overs of `root` to delete: the one named, or those whose
/// socket matches (`chosen` says), with why the others are kept.
pub enum Which<'a> {
    Named(&'a str),
    Many {
        chosen: &'a dyn Fn(&Path) -> bool,
        why_kept: String,
    },
}

pub fn forget(root: &Path, which: Which) -> Result<String, Refused> {
    let mut out = String::new();
    match which {
        Which::Named(name) => {
            let dir = root.join(name);
            let Some(l) = vzram_store::state::leftovers(root, &[])
                .into_iter()
                .find(|l| l.dir == dir)
            else {
                return Err(match Leftover::read(&dir) {
                    Some(_) => Refused::Held(dir),
                    None => Refused::NoSuch {
                        name: name.to_string(),
                        root: root.to_path_buf(),
                    },
                });
            };
            delete(&l)?;
            out += &said(&l);
        }
        Which::Many { chosen, why_kept } => {
            let all = vzram_store::state::leftovers(root, &[]);
            let (doomed, kept): (Vec<_>, Vec<_>) = all
                .iter()
                .partition(|l| l.socket.as_deref().is_some_and(chosen));
            let mut freed = 0;
            for l in &doomed {
                match delete(l) {
                    Ok(()) => {
                        freed += l.size_bytes;
                        out += &said(l);
                    }
                    Err(e) => out += &format!("kept {}: {e}\n", l.name),
                }
            }
            out += &format!(
                "{} left-over states forgotten in {} ({} of devices); {} kept, {why_kept}\n",
                doomed.len(),
                root.display(),
                human(freed),
                kept.len()
            );
        }
    }
    Ok(out)
}

/// Deletes `l` if it is still the state that was listed.
fn delete(l: &Leftover) -> Result<(), DeleteError> {
    if Leftover::read(&l.dir).map(|x| x.creation_id) != Some(l.creation_id) {
        return Err(DeleteError::Changed(l.dir.clone()));
    }
    vzram_store::state::remove(&l.dir)?;
    // The marker beside its socket, if it still names this state (a
    // harness's /tmp would keep one per run otherwise).
    if let Some(s) = &l.socket {
        if crate::owner::placement::recorded(s).as_deref() == Some(l.dir.as_path()) {
            crate::owner::placement::forget(s);
        }
    }
    Ok(())
}

fn said(l: &Leftover) -> String {
    format!(
        "forgot {}: deleted its state {} ({} device)\n",
        l.name,
        l.dir.display(),
        human(l.size_bytes)
    )
}

/// The state dir to look in: the one given, else the default a bare
/// `vzram serve` uses.
pub fn root(given: Option<&Path>) -> PathBuf {
    given.map_or_else(
        || crate::config::default_state_dir().path,
        Path::to_path_buf,
    )
}
