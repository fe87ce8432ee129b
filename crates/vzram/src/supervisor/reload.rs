//! SIGHUP (`systemctl reload`): the `--config` file is read again and
//! what can change at run time is applied: devices in the file and not
//! served added (as `vzram add` adds them, under its identity rules),
//! devices gone from the file no longer served (only while no frontend
//! is connected; their states are kept, left over), device and host memory limits (as `vzram set-limit`
//! sets them). What cannot change while serving is logged as needing a
//! restart and left as it is. A file that does not parse changes nothing.

use std::fmt::Debug;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{mpsc, Arc};

use super::error::{Error, Result};
use super::served::{Phase, Served};
use super::Supervisor;
use crate::config::{DaemonConfig, DeviceSpec, OnState, Reload};
use crate::proto::launch::{Report, Request};

/// Reloads one at a time, on a thread of their own: SIGHUPs that arrive
/// while one runs make one more reload, not one each.
pub struct Reloads {
    tx: mpsc::SyncSender<()>,
}

impl Reloads {
    /// Starts the thread that reloads `cfg` (the configuration the daemon
    /// started with) from `source`, or says there is nothing to reload.
    pub fn start(
        sup: Arc<Supervisor>,
        cfg: DaemonConfig,
        source: Option<Reload>,
    ) -> std::io::Result<Reloads> {
        let (tx, rx) = mpsc::sync_channel::<()>(1);
        let mut reloader = source.map(|source| Reloader {
            tls_dir: cfg.tls.as_ref().map(|t| t.dir.clone()),
            current: cfg,
            source,
        });
        std::thread::Builder::new()
            .name("reload".into())
            .spawn(move || {
                for () in rx {
                    match &mut reloader {
                        Some(r) => r.reload(&sup),
                        None => tracing::info!(
                            "SIGHUP: nothing to reload (vzram was started without --config); devices keep serving"
                        ),
                    }
                }
            })?;
        Ok(Reloads { tx })
    }

    /// A SIGHUP came: reload once the one running (if any) is done.
    pub fn request(&self) {
        if self.tx.try_send(()).is_err() {
            tracing::info!("SIGHUP: a reload is already waiting to run");
        }
    }
}

/// The file, and the configuration in effect: the one the daemon started
/// with, as reloads since changed it.
struct Reloader {
    source: Reload,
    current: DaemonConfig,
    tls_dir: Option<PathBuf>,
}

impl Reloader {
    fn reload(&mut self, sup: &Arc<Supervisor>) {
        let path = self.source.path.clone();
        tracing::info!(config = %path.display(), "SIGHUP: reading the configuration file again");
        let text = match sup.read_config(&path) {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(config = %path.display(), "reload: {e}; nothing changed, the devices keep serving");
                return;
            }
        };
        let (new, tls_dir) = match self.source.build(&text) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(config = %path.display(), "reload: {e}; nothing changed, the devices keep serving");
                return;
            }
        };
        let mut changes = 0;
        let mut restart = 0;
        self.daemon_wide(&new, &tls_dir, &mut restart);
        // Removed first: a device renamed in the file frees its socket
        // for its new name.
        let mut kept = Vec::new();
        for old in &self.current.devices {
            if new.devices.iter().any(|d| d.name == old.name) {
                continue;
            }
            if remove(sup, old) {
                changes += 1;
            } else if sup.devices().iter().any(|(_, d)| d.spec.name == old.name) {
                kept.push(old.clone());
            }
        }
        if new.host_mem_limit != self.current.host_mem_limit {
            sup.set_host_limit(new.host_mem_limit);
            tracing::info!(
                bytes = new.host_mem_limit,
                "reload: host memory limit changed in the file, set"
            );
            changes += 1;
        }
        let mut devices = Vec::with_capacity(new.devices.len() + kept.len());
        for spec in &new.devices {
            let served = sup
                .devices()
                .into_iter()
                .find(|(_, d)| d.spec.name == spec.name);
            match served {
                // New in the file, or removed (`vzram remove`) since.
                None => {
                    if add(sup, spec) {
                        changes += 1;
                        devices.push(spec.clone());
                    }
                }
                Some((_, d)) => {
                    // As the file had it, or as `vzram add` added it.
                    let was = match self.current.devices.iter().find(|o| o.name == spec.name) {
                        Some(o) => o.clone(),
                        None => d.spec.clone(),
                    };
                    let (spec, changed) = same_device(sup, &d, &was, spec, &mut restart);
                    changes += usize::from(changed);
                    devices.push(spec);
                }
            }
        }
        devices.extend(kept);
        self.current.devices = devices;
        self.current.host_mem_limit = new.host_mem_limit;
        tracing::info!(
            config = %path.display(),
            changes,
            need_restart = restart,
            "reload done"
        );
    }

    /// Settings of the whole daemon: none can change while it serves.
    fn daemon_wide(&self, new: &DaemonConfig, tls_dir: &Option<PathBuf>, restart: &mut usize) {
        let old = &self.current;
        let mut needs = |what: &str, was: &dyn Debug, now: &dyn Debug| {
            let (was, now) = (format!("{was:?}"), format!("{now:?}"));
            if was != now {
                tracing::warn!("reload: {what} changed in the file ({was} -> {now}): needs a restart; left as it is");
                *restart += 1;
            }
        };
        needs("control", &old.control, &new.control);
        needs("control_mode", &old.control_mode, &new.control_mode);
        needs("socket_mode", &old.socket_mode, &new.socket_mode);
        needs("incoming_mode", &old.incoming_mode, &new.incoming_mode);
        needs("metrics", &old.metrics, &new.metrics);
        needs("seccomp", &old.seccomp, &new.seccomp);
        needs("state_dir", &old.state_dir, &new.state_dir);
        needs(
            "compress_threads",
            &old.compress_threads,
            &new.compress_threads,
        );
        needs("poll_us", &old.poll_us, &new.poll_us);
        needs(
            "incoming_timeout",
            &old.incoming_timeout,
            &new.incoming_timeout,
        );
        needs("tls_creds", &self.tls_dir, tls_dir);
    }
}

/// A device served and in the file: its limit set if the file changed
/// it (from `old`, the file's before, or the device as added), the rest
/// logged as needing a restart. What the daemon serves from now on as the
/// file's (`old` with the new limit), and whether anything changed.
fn same_device(
    sup: &Supervisor,
    d: &Served,
    old: &DeviceSpec,
    new: &DeviceSpec,
    restart: &mut usize,
) -> (DeviceSpec, bool) {
    let name = &old.name;
    let mut needs = |what: &str, was: &dyn Debug, now: &dyn Debug| {
        let (was, now) = (format!("{was:?}"), format!("{now:?}"));
        if was != now {
            tracing::warn!(device = %name, "reload: {what} changed in the file ({was} -> {now}): needs a restart; left as it is");
            *restart += 1;
        }
    };
    needs("socket", &old.socket, &new.socket);
    needs("size", &old.size, &new.size);
    needs("queues", &old.queues, &new.queues);
    needs("algo", &old.algo, &new.algo);
    needs("serial", &old.serial, &new.serial);
    needs("readonly", &old.readonly, &new.readonly);
    needs(
        "discard_segments",
        &old.discard_segments,
        &new.discard_segments,
    );
    needs("state_dir", &old.state_dir, &new.state_dir);
    needs("tiering", &old.tier, &new.tier);
    needs("incoming", &old.incoming, &new.incoming);
    let mut kept = old.clone();
    if old.mem_limit == new.mem_limit {
        return (kept, false);
    }
    // A limit above the size is refused when the file is read; the size
    // compared here is the one served.
    match sup.set_device_limit(d, new.mem_limit) {
        Ok(_) => {
            tracing::info!(device = %name, bytes = new.mem_limit, "reload: mem_limit changed in the file, set");
            kept.mem_limit = new.mem_limit;
            (kept, true)
        }
        Err(e) => {
            tracing::error!(device = %name, "reload: mem_limit not set: {e}");
            (kept, false)
        }
    }
}

/// A device no longer in the file: no longer served, unless a frontend is
/// connected; its state is kept as a left-over one (a file edited by
/// mistake, a device renamed, must not delete a VM's disk: `vzram forget`
/// does that on purpose). Whether it was taken out.
fn remove(sup: &Supervisor, spec: &DeviceSpec) -> bool {
    let Some((i, d)) = sup
        .devices()
        .into_iter()
        .find(|(_, d)| d.spec.name == spec.name)
    else {
        tracing::info!(device = %spec.name, "reload: no longer in the file, and already removed");
        return false;
    };
    // Under the phase lock: with no frontend, or one connecting, none is
    // admitted from here on.
    let busy = {
        let ph = d.phase();
        let busy = !matches!(*ph, Phase::Idle) || d.connected.load(Relaxed);
        if !busy {
            d.removing.store(true, Relaxed);
        }
        busy
    };
    if busy {
        tracing::warn!(
            device = %spec.name,
            "reload: no longer in the file, but a frontend is connected: still served (a device busy with a compaction or reset is kept too); stop the VM and reload again, or `vzram remove {} --force` (its state is kept, left over)",
            spec.name
        );
        return false;
    }
    // Removing waits for every other hold on the device to go.
    drop(d);
    match sup.unserve(i) {
        Ok(()) => {
            tracing::info!(device = %spec.name, "reload: no longer in the file: no longer served, its state kept as a left-over one");
            true
        }
        Err(e) => {
            // Still served: frontends are welcome again.
            if let Some(d) = sup.device(i) {
                d.removing.store(false, Relaxed);
            }
            tracing::error!(device = %spec.name, "reload: no longer in the file, but not removed: {e}");
            false
        }
    }
}

/// A device in the file that is not served: added as `vzram add` adds
/// it (a state left under its name is served only with recover=true,
/// replaced only with fresh=true). Whether it was added.
fn add(sup: &Arc<Supervisor>, spec: &DeviceSpec) -> bool {
    // A device cut off its VM (`remove --force`) keeps its pages until
    // the operator says otherwise, whatever the file says.
    let root = spec.state_dir.as_deref().unwrap_or(sup.state_dir());
    let key = sup.state_key(spec, root);
    let dir = root.join(&key);
    if spec.on_state == OnState::Fresh && sup.cut_off_mut().contains(&dir) {
        tracing::error!(
            device = %spec.name,
            state = %dir.display(),
            "reload: in the file with fresh=true, but it was removed while connected and its state is kept: not added; `{}` serves its pages, `vzram forget {}` deletes them",
            super::devices::recover_hint(&key, &spec.socket_abs(), spec.size),
            key
        );
        return false;
    }
    match sup.add(spec.clone()) {
        Ok((_, recovered)) => {
            tracing::info!(device = %spec.name, socket = %spec.socket.display(), recovered, "reload: in the file and not served: added");
            true
        }
        Err(e) => {
            tracing::error!(device = %spec.name, "reload: in the file and not served, but not added: {e}");
            false
        }
    }
}

impl Supervisor {
    /// The configuration file's text, opened by the launcher (the filter
    /// lets this process open nothing) and read here.
    fn read_config(&self, path: &Path) -> Result<String> {
        let (report, fds) = self.ask(|id| Request::Open {
            id,
            path: path.to_path_buf(),
        })?;
        let fd = match report {
            Report::Opened { .. } => fds.into_iter().next().ok_or(Error::LauncherFds)?,
            Report::Failed { error, .. } => return Err(Error::LauncherRefused(error)),
            r => return Err(Error::LauncherAnswer(format!("{r:?}"))),
        };
        let mut text = String::new();
        std::fs::File::from(fd)
            .read_to_string(&mut text)
            .map_err(|e| Error::Invalid(format!("cannot read {}: {e}", path.display())))?;
        Ok(text)
    }
}
