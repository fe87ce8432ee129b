//! Where a device that [`Supervisor::add`] adds gets its socket, state and
//! backing file: from the launcher for `vzram add` and a reload (the
//! supervisor may bind and open nothing under its filter), or from this
//! process for the configured devices at start-up, before the filter.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vzram_store::{BackingSpec, Device, Existing, Leftover, StateFiles, StateSpec, StoreError};

use super::error::{Error, LegacyState, Result, StartError};
use super::served::BackingFile;
use super::Supervisor;
use crate::config::DeviceSpec;
use crate::owner::attach::{attach, device_config};
use crate::owner::migration::Listener;
use crate::owner::placement;
use crate::proto::launch::{PreparedFds, Report, Request};

/// How a device comes to be served: what [`Supervisor::add`] is told
/// besides the device.
pub enum Adding<'a> {
    /// `vzram add`, or a reload adding a device of the file: the launcher
    /// binds its socket and opens its state, and removes the socket when
    /// the daemon stops.
    Requested,
    /// A device of the configuration, at start-up before the filter.
    Configured(Configured<'a>),
}

/// What start-up has for a configured device, and what it asks of it.
pub struct Configured<'a> {
    /// Its socket, bound or passed in (the daemon removes those it bound).
    pub listener: UnixListener,
    /// Its migration listener, or why it has none though it has an
    /// address: then it waits, saying why in its stat.
    pub incoming: std::result::Result<Option<Listener>, String>,
    /// `--fresh` names it: a state under its name is discarded.
    pub fresh: bool,
    /// `--adopt` names it.
    pub adopt: bool,
    /// The name an older vzram gave the device in its place (`vzram0`,
    /// ...), when this one is named after its socket: see [`LegacyState`].
    pub older_name: Option<String>,
    /// The states this start made, deleted again if it fails.
    pub made: &'a mut NewStates,
}

/// A device's files, opened, and its store recovered (or made) in this
/// process to settle its counters.
pub(super) struct Opened {
    pub listener: UnixListener,
    pub files: StateFiles,
    pub backing: Option<BackingFile>,
    pub store: Arc<Device>,
    pub incoming: Option<Listener>,
    /// Why it has no migration listener though it has an address.
    pub unreachable: Option<String>,
    /// It recovered a state found under its name.
    pub existing: bool,
}

impl Supervisor {
    /// `vzram add`'s files: the launcher binds the socket and opens the
    /// state; anything failing after that removes the socket again.
    pub(super) fn prepare(&self, spec: &DeviceSpec, state: &StateSpec) -> Result<Opened> {
        let (report, fds) = self.launcher.ask(|id| Request::Prepare {
            id,
            socket: spec.socket.clone(),
            mode: self.env.socket_mode,
            state: state.clone(),
            size: spec.size,
            algo: spec.algo,
            shards: usize::from(spec.queues),
            backing: spec.tier.backing_file.clone(),
            incoming: spec.incoming.clone(),
            incoming_mode: self.env.incoming_mode,
        })?;
        let (dir, existing, replaced, prepared_backing) = match report {
            Report::Prepared {
                dir,
                existing,
                replaced,
                backing,
                ..
            } => (dir, existing, replaced, backing),
            Report::Failed { error, .. } => return Err(Error::LauncherRefused(error)),
            r => return Err(Error::LauncherAnswer(format!("{r:?}"))),
        };
        let PreparedFds {
            listener,
            lock,
            table,
            arena,
            stats,
            backing,
            incoming,
        } = PreparedFds::received(fds, prepared_backing.is_some(), spec.incoming.is_some())
            .ok_or(Error::LauncherFds)?;
        let backing = match (spec.tier.backing_file.clone(), prepared_backing, backing) {
            (Some(path), Some(b), Some(file)) => Some(BackingFile {
                file: file.into(),
                path,
                direct: b.direct,
                blocks: b.blocks,
            }),
            (None, None, None) => None,
            _ => return Err(Error::LauncherFds),
        };
        let incoming = match (&spec.incoming, incoming) {
            (Some(a), Some(fd)) => Some(Listener::new(a, fd)),
            (None, None) => None,
            _ => return Err(Error::LauncherFds),
        };
        let undo = |e: Error| self.unprepare(&spec.socket, e);
        let mut files = StateFiles::from_files(
            dir,
            lock.into(),
            table.into(),
            arena.into(),
            stats.into(),
            spec.size,
        )
        .map_err(|e| undo(e.into()))?;
        files.existing = existing;
        files.replaced = replaced;
        let opened = match &backing {
            Some(b) => Some(b.open().map_err(|e| undo(e.into()))?),
            None => None,
        };
        let dc = device_config(spec.size, spec.algo, spec.queues, spec.mem_limit);
        let store = attach(&self.pool, dc, &files, opened).map_err(|e| undo(e.into()))?;
        match store.recovery() {
            Some(r) if existing => tracing::info!(
                device = %spec.name,
                pages = r.slots,
                ms = r.micros as f64 / 1000.0,
                "added; recovered the device from its state"
            ),
            _ => tracing::info!(device = %spec.name, socket = %spec.socket.display(), "added"),
        }
        Ok(Opened {
            listener: listener.into(),
            files,
            backing,
            store,
            incoming,
            unreachable: None,
            existing,
        })
    }

    /// The launcher removes the socket it bound for a device that then
    /// could not be served; `e` is why.
    pub(super) fn unprepare(&self, socket: &Path, e: Error) -> Error {
        let _ = self.launcher.ask(|id| Request::Remove {
            id,
            socket: Some(socket.to_path_buf()),
            state: None,
            expect: None,
        });
        e
    }

    /// A configured device's files, opened (and its state recovered) here,
    /// before the filter: a damaged or mismatched state, or a backing file
    /// missing, too small or taken, stops the start. A state it makes is
    /// in `c.made`, for the start to delete if it fails.
    pub(super) fn open_here(
        &self,
        spec: &DeviceSpec,
        state: &StateSpec,
        c: Configured<'_>,
    ) -> Result<Opened> {
        let fail = |source: StartError| Error::Start {
            device: spec.name.clone(),
            source,
        };
        let store_fail = |e: StoreError| fail(StartError::Store(e));
        let discard = state.existing == Existing::Discard;
        placement::check(
            &spec.socket,
            &state.root.join(&state.name),
            discard,
            state.adopt,
        )
        .map_err(|e| fail(StartError::Placement(e)))?;
        if let (false, Some(old)) = (discard, &c.older_name) {
            legacy_state(spec, &state.root, &state.name, old)
                .map_err(|e| fail(StartError::Legacy(e)))?;
        }
        let mut dc = device_config(spec.size, spec.algo, spec.queues, spec.mem_limit);
        dc.state = Some(state.clone());
        dc.backing = spec
            .tier
            .backing_file
            .clone()
            .map(|path| BackingSpec { path });
        let store = self.pool.create_device(dc).map_err(store_fail)?;
        store.stats();
        let Some(st) = store.state_files() else {
            unreachable!("a daemon's device always has state");
        };
        let files = st.try_clone().map_err(store_fail)?;
        let backing = match store.backing() {
            Some(b) => {
                let kept = BackingFile::of(b)
                    .map_err(|e| store_fail(StoreError::backing(b.path().display(), e)))?;
                tracing::info!(
                    device = %spec.name,
                    backing = %kept.path.display(),
                    blocks = kept.blocks,
                    used = b.used(),
                    direct_io = kept.direct,
                    "backing file ready"
                );
                Some(kept)
            }
            None => None,
        };
        let dir = files.dir.display().to_string();
        let existing = match store.recovery() {
            Some(r) => {
                tracing::info!(
                    device = %spec.name,
                    state = %dir,
                    pages = r.slots,
                    spans = r.spans,
                    cut_short = r.unlocked,
                    ms = r.micros as f64 / 1000.0,
                    "recovered the device from its state"
                );
                true
            }
            None => {
                tracing::info!(device = %spec.name, state = %dir, "new device state");
                let claimed = backing.as_ref().and_then(|b| b.open().ok());
                c.made.states.push((files.dir.clone(), claimed));
                false
            }
        };
        let (incoming, unreachable) = match c.incoming {
            Ok(l) => (l, None),
            Err(why) => (None, Some(why)),
        };
        Ok(Opened {
            listener: c.listener,
            files,
            backing,
            store,
            incoming,
            unreachable,
            existing,
        })
    }
}

/// Before names came from sockets, a device without `name=` was `vzramN`,
/// N its place in the config (`old`). A device named after its socket
/// that has no state yet, while such a state from an older vzram (no
/// socket in its header) sits in its place, is refused: after an upgrade
/// it would otherwise start blank beside its own pages.
fn legacy_state(
    spec: &DeviceSpec,
    root: &Path,
    key: &str,
    old: &str,
) -> std::result::Result<(), LegacyState> {
    if root.join(key).exists() || root.join(&spec.name).exists() {
        return Ok(());
    }
    match Leftover::read(&root.join(old)) {
        Some(l) if l.socket.is_none() => Err(LegacyState {
            dir: l.dir,
            old: old.to_string(),
            name: spec.name.clone(),
        }),
        _ => Ok(()),
    }
}

/// The states a start made; deleted on drop unless the start got through
/// (a failed start leaves no blank state that the next one would take as
/// the device's). A backing file such a state claimed is blanked again, so
/// the next start may take it, and a state dir the start made is removed.
#[derive(Default)]
pub struct NewStates {
    states: Vec<(PathBuf, Option<vzram_store::Backing>)>,
    pub roots: Vec<PathBuf>,
}

impl NewStates {
    /// The start got through: keep all.
    pub fn keep(&mut self) {
        self.states.clear();
        self.roots.clear();
    }
}

impl Drop for NewStates {
    fn drop(&mut self) {
        for (dir, backing) in self.states.drain(..) {
            if let Some(b) = backing {
                if let Err(e) = b.release() {
                    tracing::warn!(backing = %b.path().display(), "cannot blank the backing file this failed start claimed: {e}");
                }
            }
            if let Err(e) = vzram_store::state::discard(&dir) {
                tracing::warn!(state = %dir.display(), "cannot delete the state this failed start made: {e}");
            }
        }
        // Empty once its states are gone; one that is not keeps what it holds.
        for root in self.roots.drain(..).rev() {
            let _ = std::fs::remove_dir(&root);
        }
    }
}
