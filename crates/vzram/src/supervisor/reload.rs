//! SIGHUP (`systemctl reload`) or `vzram reload` (the control socket):
//! the `--config` file is read again and
//! what can change at run time is applied: devices in the file and not
//! served added (as `vzram add` adds them, under its identity rules),
//! devices gone from the file no longer served (only while no frontend
//! is connected; their states are kept, left over), device and host memory limits (as `vzram set-limit`
//! sets them). What cannot change while serving is logged as needing a
//! restart and left as it is. A file that does not parse changes nothing.
//! The service manager hears `RELOADING=1` before and `READY=1` after.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};

use super::error::{Error, Result};
use super::opening::Adding;
use super::served::Served;
use super::worker_slot::Phase;
use super::Supervisor;
use crate::config::{DaemonConfig, DeviceSpec, OnState, Reload};
use crate::proto::control::{ReloadChange, Reloaded};
use crate::proto::launch::{Report, Request};

/// Reloads one at a time: SIGHUPs that arrive while one runs make one
/// more reload (on a thread of their own), not one each; `vzram reload`
/// waits for the one running, then runs its own.
pub struct Reloads {
    tx: mpsc::SyncSender<()>,
    sup: Arc<Supervisor>,
    /// None: started without `--config`, nothing to reload.
    reloader: Mutex<Option<Reloader>>,
}

/// What asked for a reload, as the log says it.
#[derive(Debug, Clone, Copy)]
pub enum Cause {
    Sighup,
    Control,
}

impl Cause {
    fn name(self) -> &'static str {
        match self {
            Cause::Sighup => "SIGHUP",
            Cause::Control => "reload (control socket)",
        }
    }
}

impl Reloads {
    /// Starts the thread that reloads `cfg` (the configuration the daemon
    /// started with) from `source` on SIGHUP; without `source` there is
    /// nothing to reload.
    pub fn start(
        sup: Arc<Supervisor>,
        cfg: DaemonConfig,
        source: Option<Reload>,
    ) -> std::io::Result<Arc<Reloads>> {
        let (tx, rx) = mpsc::sync_channel::<()>(1);
        let reloader = source.map(|source| Reloader {
            tls_dir: cfg.tls.as_ref().map(|t| t.dir.clone()),
            current: cfg,
            source,
        });
        let reloads = Arc::new(Reloads {
            tx,
            sup,
            reloader: Mutex::new(reloader),
        });
        let r = reloads.clone();
        std::thread::Builder::new()
            .name("reload".into())
            .spawn(move || {
                for () in rx {
                    // Logged: a signal has nobody to answer.
                    let _ = r.now(Cause::Sighup);
                }
            })?;
        Ok(reloads)
    }

    /// A SIGHUP came: reload once the one running (if any) is done.
    pub fn request(&self) {
        if self.tx.try_send(()).is_err() {
            tracing::info!("SIGHUP: a reload is already waiting to run");
        }
    }

    /// Reloads now (after the one running, if any): what changed, or why
    /// nothing did. The service manager is told `RELOADING=1` (with the
    /// time, as `Type=notify-reload` wants) before and `READY=1` after,
    /// whatever the outcome: the devices serve either way.
    pub fn now(&self, cause: Cause) -> Result<Reloaded> {
        let mut guard = self.reloader.lock().unwrap_or_else(|e| e.into_inner());
        self.sup
            .notify(&format!("RELOADING=1\nMONOTONIC_USEC={}", monotonic_usec()));
        let r = match guard.as_mut() {
            Some(r) => r.reload(&self.sup, cause),
            None => {
                tracing::info!(
                    "{}: nothing to reload (vzram was started without --config); devices keep serving",
                    cause.name()
                );
                Err(Error::Invalid(
                    "nothing to reload: vzram was started without --config".into(),
                ))
            }
        };
        self.sup
            .notify(&format!("READY=1\n{}", self.sup.status_line()));
        r
    }
}

/// CLOCK_MONOTONIC in µs, the clock systemd compares `MONOTONIC_USEC` with.
fn monotonic_usec() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000
}

/// The file, and the configuration in effect: the one the daemon started
/// with, as reloads since changed it.
struct Reloader {
    source: Reload,
    current: DaemonConfig,
    tls_dir: Option<PathBuf>,
}

/// What one reload did, and what it left.
#[derive(Default)]
struct Outcome {
    changes: Vec<ReloadChange>,
    not_applied: Vec<String>,
    /// Of `not_applied`, those that need a restart.
    restart: usize,
}

impl Outcome {
    /// A setting that changed in the file but only takes at a restart.
    fn needs(&mut self, device: Option<&str>, what: &str, was: &dyn Shown, now: &dyn Shown) {
        let (was, now) = (was.shown(), now.shown());
        if was == now {
            return;
        }
        let msg =
            format!("{what} changed in the file ({was} -> {now}): needs a restart; left as it is");
        match device {
            Some(d) => {
                tracing::warn!(device = %d, "reload: {msg}");
                self.not_applied.push(format!("device {d}: {msg}"));
            }
            None => {
                tracing::warn!("reload: {msg}");
                self.not_applied.push(msg);
            }
        }
        self.restart += 1;
    }
}

impl Reloader {
    fn reload(&mut self, sup: &Arc<Supervisor>, cause: Cause) -> Result<Reloaded> {
        let path = self.source.path.clone();
        tracing::info!(config = %path.display(), "{}: reading the configuration file again", cause.name());
        let refused = |e: &dyn std::fmt::Display| {
            tracing::error!(config = %path.display(), "reload: {e}; nothing changed, the devices keep serving");
            Error::Invalid(format!("{e}; nothing changed, the devices keep serving"))
        };
        let text = sup.read_config(&path).map_err(|e| refused(&e))?;
        let (new, tls_dir) = self.source.build(&text).map_err(|e| refused(&e))?;
        let mut out = Outcome::default();
        self.daemon_wide(&new, &tls_dir, &mut out);
        // Removed first: a device renamed in the file frees its socket
        // for its new name.
        let mut kept = Vec::new();
        for old in &self.current.devices {
            if new.devices.iter().any(|d| d.name == old.name) {
                continue;
            }
            if remove(sup, old, &mut out) {
                out.changes.push(ReloadChange::Removed {
                    device: old.name.clone(),
                });
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
            out.changes.push(ReloadChange::HostLimit {
                host_mem_limit: new.host_mem_limit,
            });
        }
        if new.host_staging != self.current.host_staging {
            sup.pool.set_host_staging(new.host_staging);
            tracing::info!(
                bytes = new.host_staging,
                "reload: host staging changed in the file, set"
            );
            out.changes.push(ReloadChange::HostStaging {
                host_staging: new.host_staging,
            });
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
                    if let Some(recovered) = add(sup, spec, &mut out) {
                        out.changes.push(ReloadChange::Added {
                            device: spec.name.clone(),
                            recovered,
                        });
                        devices.push(spec.clone());
                    }
                }
                Some((_, d)) => {
                    // As the file had it, or as `vzram add` added it.
                    let was = match self.current.devices.iter().find(|o| o.name == spec.name) {
                        Some(o) => o.clone(),
                        None => d.spec.clone(),
                    };
                    devices.push(same_device(sup, &d, &was, spec, &mut out));
                }
            }
        }
        devices.extend(kept);
        self.current.devices = devices;
        self.current.host_mem_limit = new.host_mem_limit;
        self.current.host_staging = new.host_staging;
        tracing::info!(
            config = %path.display(),
            changes = out.changes.len(),
            need_restart = out.restart,
            "reload done"
        );
        Ok(Reloaded {
            config: path,
            changes: out.changes,
            not_applied: out.not_applied,
        })
    }

    /// Settings of the whole daemon: none can change while it serves.
    fn daemon_wide(&self, new: &DaemonConfig, tls_dir: &Option<PathBuf>, out: &mut Outcome) {
        let old = &self.current;
        let mut needs =
            |what: &str, was: &dyn Shown, now: &dyn Shown| out.needs(None, what, was, now);
        needs("control", &old.control, &new.control);
        needs(
            "control_mode",
            &Mode(old.control_mode),
            &Mode(new.control_mode),
        );
        needs(
            "socket_mode",
            &Mode(old.socket_mode),
            &Mode(new.socket_mode),
        );
        needs(
            "incoming_mode",
            &Mode(old.incoming_mode),
            &Mode(new.incoming_mode),
        );
        needs("metrics", &old.metrics, &new.metrics);
        needs("seccomp", &old.seccomp, &new.seccomp);
        needs("state_dir", &old.state_dir, &new.state_dir);
        needs(
            "compress_threads",
            &old.compress_threads,
            &new.compress_threads,
        );
        needs("poll_us", &old.poll_us.map(Us), &new.poll_us.map(Us));
        needs(
            "incoming_timeout",
            &old.incoming_timeout,
            &new.incoming_timeout,
        );
        needs("tls_creds", &self.tls_dir, tls_dir);
    }
}

/// A setting as an operator reads it in "X changed in the file (was ->
/// now)": as the file writes it, not as Rust's Debug would.
trait Shown {
    fn shown(&self) -> String;
}

/// Shown as they print.
macro_rules! shown_as_displayed {
    ($($t:ty),*) => {$(
        impl Shown for $t {
            fn shown(&self) -> String {
                self.to_string()
            }
        }
    )*};
}
shown_as_displayed!(
    u16,
    u64,
    usize,
    bool,
    String,
    vzram_store::Codec,
    crate::config::SeccompMode,
    crate::proto::addr::Addr,
    std::net::SocketAddr
);

impl Shown for PathBuf {
    fn shown(&self) -> String {
        self.display().to_string()
    }
}

impl<T: Shown> Shown for Option<T> {
    fn shown(&self) -> String {
        self.as_ref().map_or_else(|| "none".into(), Shown::shown)
    }
}

impl Shown for std::time::Duration {
    fn shown(&self) -> String {
        format!("{} s", self.as_secs_f64())
    }
}

/// A size, in bytes.
struct Bytes(u64);
/// A file mode, in octal.
struct Mode(u32);
/// Microseconds.
struct Us(u64);

impl Shown for Bytes {
    fn shown(&self) -> String {
        format!("{} bytes", self.0)
    }
}

impl Shown for Mode {
    fn shown(&self) -> String {
        format!("{:04o}", self.0)
    }
}

impl Shown for Us {
    fn shown(&self) -> String {
        format!("{} µs", self.0)
    }
}

impl Shown for crate::config::TierSpec {
    fn shown(&self) -> String {
        format!(
            "backing_file={}, recompress_algo={}, idle_after={}, auto_writeback={}, auto_recompress={}",
            self.backing_file.shown(),
            self.recompress_algo,
            self.idle_after.shown(),
            self.auto_writeback,
            self.auto_recompress
        )
    }
}

/// A device served and in the file: its limit set if the file changed
/// it (from `old`, the file's before, or the device as added), the rest
/// logged as needing a restart. What the daemon serves from now on as the
/// file's (`old` with the new limit).
fn same_device(
    sup: &Supervisor,
    d: &Served,
    old: &DeviceSpec,
    new: &DeviceSpec,
    out: &mut Outcome,
) -> DeviceSpec {
    let name = &old.name;
    let mut needs =
        |what: &str, was: &dyn Shown, now: &dyn Shown| out.needs(Some(name), what, was, now);
    needs("socket", &old.socket, &new.socket);
    needs("size", &Bytes(old.size), &Bytes(new.size));
    needs("queues", &old.queues, &new.queues);
    needs("algo", &old.algo, &new.algo);
    needs("serial", &old.serial, &new.serial);
    needs("readonly", &old.readonly, &new.readonly);
    needs(
        "discard_segments",
        &old.discard_segments,
        &new.discard_segments,
    );
    needs("staging", &Bytes(old.staging), &Bytes(new.staging));
    needs("state_dir", &old.state_dir, &new.state_dir);
    needs("tiering", &old.tier, &new.tier);
    needs("incoming", &old.incoming, &new.incoming);
    let mut kept = old.clone();
    if old.mem_limit == new.mem_limit {
        return kept;
    }
    // A limit above the size is refused when the file is read; the size
    // compared here is the one served.
    match sup.set_device_limit(d, new.mem_limit) {
        Ok(_) => {
            tracing::info!(device = %name, bytes = new.mem_limit, "reload: mem_limit changed in the file, set");
            kept.mem_limit = new.mem_limit;
            out.changes.push(ReloadChange::DeviceLimit {
                device: name.clone(),
                mem_limit: new.mem_limit,
            });
        }
        Err(e) => {
            tracing::error!(device = %name, "reload: mem_limit not set: {e}");
            out.not_applied
                .push(format!("device {name}: mem_limit not set: {e}"));
        }
    }
    kept
}

/// A device no longer in the file: no longer served, unless a frontend is
/// connected; its state is kept as a left-over one (a file edited by
/// mistake, a device renamed, must not delete a VM's disk: `vzram forget`
/// does that on purpose). Whether it was taken out.
fn remove(sup: &Supervisor, spec: &DeviceSpec, out: &mut Outcome) -> bool {
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
        let ph = d.worker.phase();
        let busy = !matches!(*ph, Phase::Idle) || d.worker.connected();
        if !busy {
            d.worker.close();
        }
        busy
    };
    if busy {
        let msg = format!(
            "no longer in the file, but a frontend is connected: still served (a device busy with a compaction or reset is kept too); stop the VM and reload again, or `vzram remove {} --force` (its state is kept, left over)",
            spec.name
        );
        tracing::warn!(device = %spec.name, "reload: {msg}");
        out.not_applied.push(format!("device {}: {msg}", spec.name));
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
                d.worker.reopen();
            }
            tracing::error!(device = %spec.name, "reload: no longer in the file, but not removed: {e}");
            out.not_applied.push(format!(
                "device {}: no longer in the file, but not removed: {e}",
                spec.name
            ));
            false
        }
    }
}

/// A device in the file that is not served: added as `vzram add` adds
/// it (a state left under its name is served only with recover=true,
/// replaced only with fresh=true). Whether it was added, and if so
/// whether it recovered a state.
fn add(sup: &Arc<Supervisor>, spec: &DeviceSpec, out: &mut Outcome) -> Option<bool> {
    // A device cut off its VM (`remove --force`) keeps its pages until
    // the operator says otherwise, whatever the file says.
    let root = spec.state_dir.as_deref().unwrap_or(sup.state_dir());
    let key = sup.state_key(spec, root);
    let dir = root.join(&key);
    if spec.on_state == OnState::Fresh && sup.registry.was_cut_off(&dir) {
        let msg = format!(
            "in the file with fresh=true, but it was removed while connected and its state {} is kept: not added; `{}` serves its pages, `vzram forget {}` deletes them",
            dir.display(),
            super::devices::recover_hint(&key, &spec.socket_abs(), spec.size),
            key
        );
        tracing::error!(device = %spec.name, "reload: {msg}");
        out.not_applied.push(format!("device {}: {msg}", spec.name));
        return None;
    }
    match sup.add(spec.clone(), Adding::Requested) {
        Ok((_, recovered)) => {
            tracing::info!(device = %spec.name, socket = %spec.socket.display(), recovered, "reload: in the file and not served: added");
            Some(recovered)
        }
        Err(e) => {
            tracing::error!(device = %spec.name, "reload: in the file and not served, but not added: {e}");
            out.not_applied.push(format!(
                "device {}: in the file and not served, but not added: {e}",
                spec.name
            ));
            None
        }
    }
}

impl Supervisor {
    /// The configuration file's text, opened by the launcher (the filter
    /// lets this process open nothing) and read here. `path` is the file
    /// the launcher was started with (see [`super::launch::start`]).
    fn read_config(&self, path: &Path) -> Result<String> {
        let (report, fds) = self.launcher.ask(|id| Request::OpenConfig { id })?;
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
