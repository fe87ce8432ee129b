//! Devices added (at start-up, by `vzram add` and by a reload) and
//! removed (`vzram remove`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use vzram_store::StateSpec;

use super::error::{Error, Result};
use super::opening::{Adding, Opened};
use super::served::Served;
use super::{Supervisor, STOP_WAIT};
use crate::config::DeviceSpec;
use crate::owner::migration::{set_incoming, settle_send};
use crate::proto::addr::Addr;
use crate::proto::launch::{Report, Request};

impl Supervisor {
    /// Adds a device: one of `vzram add` or a reload, or one of the
    /// configuration at start-up (`how` says which, and brings what
    /// start-up has for it). Returns its index, and whether it recovered
    /// a state left under its name.
    pub fn add(self: &Arc<Self>, spec: DeviceSpec, how: Adding<'_>) -> Result<(usize, bool)> {
        let _one = self.registry.changing();
        if matches!(spec.incoming, Some(Addr::Tcp(_)))
            && self.env.tls.as_ref().is_none_or(|t| t.server.is_none())
        {
            return Err(Error::NoTls {
                what: "an incoming tcp: address",
                need: "server-cert.pem and server-key.pem",
            });
        }
        for (_, d) in self.devices() {
            if d.spec.name == spec.name {
                return Err(Error::NameTaken(spec.name));
            }
            if d.spec.socket == spec.socket {
                return Err(Error::SocketTaken {
                    socket: spec.socket.clone(),
                    device: d.spec.name.clone(),
                });
            }
        }
        let root = spec
            .state_dir
            .clone()
            .unwrap_or_else(|| self.env.state_dir.clone());
        let key = self.state_key(&spec, &root);
        // A configured device recovers a state unless told; one added at
        // run time refuses it unless told.
        let (requested, fresh, adopt) = match &how {
            Adding::Requested => (true, false, false),
            Adding::Configured(c) => (false, c.fresh, c.adopt),
        };
        let state = StateSpec {
            root,
            name: key,
            existing: spec.on_state.existing(requested, fresh),
            socket: Some(spec.socket_abs()),
            adopt: adopt || spec.adopt,
        };
        let Opened {
            listener,
            files,
            backing,
            store,
            incoming,
            unreachable,
            existing,
        } = match how {
            Adding::Requested => self.prepare(&spec, &state)?,
            Adding::Configured(c) => self.open_here(&spec, &state, c)?,
        };
        settle_send(&spec.name, &store);
        if spec.incoming.is_some() {
            set_incoming(&spec.name, &store);
        } else if store.cells().migration.incoming() {
            tracing::warn!(device = %spec.name, "the device waits for its pages from a migration but has no incoming address: its requests wait; vzram reset serves it empty");
        }
        drop(store);
        // Served now, so no longer left over.
        self.registry.served_again(&state.root.join(&state.name));
        let socket = spec.socket.clone();
        let mut served = match Served::new(spec, listener, files, backing) {
            Ok(s) => s.with_incoming(incoming),
            Err(e) if requested => return Err(self.unprepare(&socket, e.into())),
            Err(e) => return Err(e.into()),
        };
        served.added = requested;
        if unreachable.is_some() {
            served.migration.set_error(unreachable);
        }
        let i = self.registry.insert(served);
        self.wake();
        self.tell_status();
        if let Some(d) = self.device(i) {
            // Accepted at odds with the host limit or with a recovered
            // state's use, as `set-limit` accepts it: with a warning.
            self.device_limit_warnings(&d);
            // A configured device's listener waits for the loop, which
            // starts after the filter (see `daemon::run`).
            if requested {
                self.start_incoming(d).map_err(Error::Thread)?;
            }
        }
        Ok((i, existing))
    }

    /// Removes device `i` for good: its socket and its state deleted, its
    /// memory given back. A device a frontend is connected (or connecting)
    /// to is refused, naming the frontend, unless `force`: then it is cut
    /// off and its state kept, left over, so that nothing (a reload with
    /// the device still in the file) serves it again blank; `vzram add`
    /// with recover=true serves it again. Returns the command that does,
    /// when the state was kept.
    pub fn remove(&self, i: usize, force: bool) -> Result<Option<String>> {
        let Some(d) = self.device(i) else {
            return Err(Error::NoIndex(i));
        };
        let name = d.spec.name.clone();
        let frontend = {
            let ph = d.worker.phase();
            let f = d.frontend_in(&ph);
            if f.is_none() || force {
                // Under the phase lock: no frontend is admitted from here on.
                d.worker.close();
            }
            f
        };
        let Some(frontend) = frontend else {
            drop(d);
            self.remove_with(i, false)?;
            return Ok(None);
        };
        if !force {
            return Err(Error::Connected {
                device: name.clone(),
                frontend,
                advice: format!(
                    "removing it cuts its VM off its disk: stop the VM first, or `vzram remove {name} --force` to cut it off now (its state is kept, left over)"
                ),
            });
        }
        tracing::warn!(device = %name, %frontend, "remove --force of a connected device: the frontend is cut off");
        let dir = d.files.dir.clone();
        let hint = recover_hint(&state_name(&dir, &name), &d.spec.socket_abs(), d.spec.size);
        drop(d);
        self.remove_with(i, true)?;
        self.registry.cut_off(dir);
        Ok(Some(hint))
    }

    /// Stops serving device `i` but keeps its state (and what its backing
    /// file holds): a left-over state from now on, which `add ...,
    /// recover=true` serves again and `vzram forget` deletes. What a
    /// reload does with a device gone from the file: an edit of a file
    /// never deletes a VM's disk by itself.
    pub fn unserve(&self, i: usize) -> Result<()> {
        self.remove_with(i, true)
    }

    fn remove_with(&self, i: usize, keep_state: bool) -> Result<()> {
        let Some(d) = self.device(i) else {
            return Err(Error::NoIndex(i));
        };
        // An arriving stream would hold the device until it ends.
        self.cut_arriving(&d)?;
        d.worker.close();
        self.wake();
        let deadline = Instant::now() + STOP_WAIT;
        while !d.worker.idle() {
            if Instant::now() > deadline {
                return Err(Error::WorkerStuck {
                    device: d.spec.name.clone(),
                    wait: STOP_WAIT,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.registry.remove(i);
        d.cells.release(self.pool.host_cells());
        let socket = d.spec.socket.clone();
        let socket_path = d.spec.socket_abs();
        let dir = d.files.dir.clone();
        let name = d.spec.name.clone();
        let key = state_name(&dir, &name);
        let left = vzram_store::Leftover {
            name: key.clone(),
            dir: dir.clone(),
            size_bytes: d.files.header.size_bytes,
            bytes: d.state_bytes(),
            socket: d.files.header.socket.clone(),
            creation_id: d.files.header.creation_id,
        };
        // Everyone else lets go within moments (a stat, the loop's turn);
        // the state can be deleted only once its lock is free.
        let mut d = d;
        let deadline = Instant::now() + STOP_WAIT;
        let backing;
        loop {
            match Arc::try_unwrap(d) {
                Ok(served) => {
                    backing = served.backing.as_ref().and_then(|b| b.open().ok());
                    drop(served);
                    break;
                }
                Err(again) if Instant::now() < deadline => {
                    d = again;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(_) => return Err(Error::InUse(name)),
            }
        }
        let (report, _) = self.launcher.ask(|id| Request::Remove {
            id,
            socket: Some(socket),
            state: (!keep_state).then_some(dir),
            expect: None,
        })?;
        match report {
            Report::Removed { .. } if keep_state => {
                let hint = recover_hint(
                    &key,
                    &left.socket.clone().unwrap_or(socket_path),
                    left.size_bytes,
                );
                tracing::warn!(device = %name, "no longer served; its state is kept, left over (`{hint}` serves it again, `vzram forget {key}` deletes it)");
                self.registry.leftovers().push(left);
                self.tell_status();
                Ok(())
            }
            Report::Removed { .. } => {
                // Its written-back pages went with the state: the file is
                // blank again, for any device to take.
                if let Some(b) = backing {
                    if let Err(e) = b.release() {
                        tracing::warn!(device = %name, "cannot blank the backing file's header: {e}");
                    }
                }
                tracing::warn!(device = %name, state = %left.dir.display(), size = left.size_bytes, bytes_held = left.bytes, "removed, with its state: its pages are deleted");
                self.tell_status();
                Ok(())
            }
            Report::Failed { error, .. } => Err(Error::LauncherRefused(error)),
            r => Err(Error::LauncherAnswer(format!("{r:?}"))),
        }
    }
}

impl Supervisor {
    /// Where `spec`'s state is under `root`: [`DeviceSpec::state_key`], or
    /// the name alone of a device named after its socket when a left-over
    /// state there was made for this very socket (before keys carried the
    /// socket path) and none is under the new key. The supervisor may not
    /// look at files: the left-overs it knows are what it goes by (every
    /// state no device serves is one; at start-up, every state in the
    /// state dirs until its device is added).
    pub(super) fn state_key(&self, spec: &DeviceSpec, root: &std::path::Path) -> String {
        let key = spec.state_key();
        let Some(old) = spec.legacy_key() else {
            return key;
        };
        let socket = spec.socket_abs();
        let left = self.registry.leftovers();
        let new_there = left.iter().any(|l| l.dir == root.join(&key));
        let old_ours = left
            .iter()
            .any(|l| l.dir == root.join(old) && l.socket.as_deref() == Some(socket.as_path()));
        if !new_there && old_ours {
            tracing::info!(device = %spec.name, state = %root.join(old).display(), "serving the state made for this socket under its name alone (before state names carried the socket path)");
            old.to_string()
        } else {
            key
        }
    }
}

/// What a state is left over as (`vzram forget KEY`, `name=KEY,recover=true`):
/// its directory's name, the device's own unless the device is named after
/// its socket (see [`crate::config::DeviceSpec::state_key`]).
pub(super) fn state_name(dir: &std::path::Path, device: &str) -> String {
    dir.file_name()
        .map_or_else(|| device.to_string(), |k| k.to_string_lossy().into_owned())
}

/// The command that serves a left-over state again, as hints give it;
/// `name` is the state's ([`state_name`]): the device added so finds it.
pub(super) fn recover_hint(name: &str, socket: &std::path::Path, size: u64) -> String {
    crate::proto::control::recover_command(name, socket, size)
}

impl Supervisor {
    /// Deletes a state no device serves (`vzram forget`): the launcher
    /// removes it only if it is a vzram state and no process holds it.
    pub fn forget(&self, name: &str) -> Result<vzram_store::Leftover> {
        let _one = self.registry.changing();
        if let Some((_, d)) = self
            .devices()
            .into_iter()
            .find(|(_, d)| d.spec.name == name)
        {
            return Err(match d.frontend() {
                Some(frontend) => Error::Connected {
                    device: name.to_string(),
                    frontend,
                    advice: format!(
                        "it is served, not left over: stop the VM first, or `vzram remove {name} --force` cuts it off and keeps its state, left over, for `vzram forget {}`",
                        state_name(&d.files.dir, name)
                    ),
                },
                None => Error::Served(name.to_string()),
            });
        }
        let Some(l) = self
            .registry
            .leftovers()
            .iter()
            .find(|l| l.name == name)
            .cloned()
        else {
            return Err(Error::NoLeftover(name.to_string()));
        };
        let (report, _) = self.launcher.ask(|id| Request::Remove {
            id,
            socket: None,
            state: Some(l.dir.clone()),
            expect: Some(l.creation_id),
        })?;
        match report {
            Report::Removed { .. } => {
                self.registry.served_again(&l.dir);
                tracing::warn!(state = %l.dir.display(), size = l.size_bytes, bytes_held = l.bytes, "forgotten: the left-over state is deleted, its pages with it");
                Ok(l)
            }
            Report::Failed { error, .. } => Err(Error::LauncherRefused(error)),
            r => Err(Error::LauncherAnswer(format!("{r:?}"))),
        }
    }
}
