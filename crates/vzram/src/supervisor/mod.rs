//! The supervisor (`vzram serve`): owns every device's listening socket
//! and locked state, and serves each connected frontend with a worker
//! process of its own.
//!
//! One thread runs an epoll loop ([`admission`]) over the listening
//! sockets, connections waiting for their first message, the launcher's
//! reports (worker starts and exits) and a wake-up eventfd. It never reads
//! what a frontend sends: it only waits until a connection has something
//! to say, and hands it over. A worker that dies costs its VM a reconnect;
//! the others notice nothing. A device whose workers keep dying waits
//! longer each time (capped) and shows as failing in `vzram stat`.
//!
//! The rest: orders to devices ([`orders`]), migration ([`migrate`]),
//! devices added and removed at run time ([`devices`]), memory limits
//! ([`limits`]), the configuration read again on SIGHUP or `vzram reload`
//! ([`reload`]),
//! requests to the
//! launcher ([`launch`]), the control socket ([`control`]), `/metrics`
//! ([`metrics`]) and start-up ([`daemon`]).

use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vzram_store::Pool;

use crate::proto::launch::Request;
use crate::proto::worker_spec::{LogFormat, LogLevel, SeccompMode};
use crate::sys::notify::Notifier;
use served::Served;

mod admission;
mod clients;
pub mod control;
pub mod daemon;
mod devices;
pub mod error;
mod launch;
mod limits;
pub mod metrics;
mod migrate;
mod opening;
mod orders;
mod pidfile;
mod procstat;
mod registry;
pub mod reload;
pub mod served;
pub mod worker_slot;

/// How long stopping waits for workers to go.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// What the daemon passes every worker besides its device.
#[derive(Clone)]
pub struct WorkerEnv {
    pub seccomp: SeccompMode,
    pub log_level: LogLevel,
    pub log_format: LogFormat,
    /// For devices added at run time: their sockets' mode, and where their
    /// state goes unless they say.
    pub socket_mode: u32,
    pub state_dir: PathBuf,
    /// The control socket, which no device added may take.
    pub control: PathBuf,
    /// `--compress-threads`; None: a core less than the host has, 1 to 4.
    pub compress_threads: Option<usize>,
    /// `--poll-us`; None: the default.
    pub poll_us: Option<u64>,
    /// `--incoming-timeout`.
    pub incoming_timeout: std::time::Duration,
    /// `--incoming-mode`, for devices added at run time.
    pub incoming_mode: u32,
    /// `--tls-creds`, read at start: the workers may open no files.
    pub tls: Option<Arc<crate::proto::tls::CredsDir>>,
}

/// Supervisor state shared by its loop, the control server and `run`.
pub struct Supervisor {
    /// The devices and the states no device serves.
    registry: registry::Registry,
    pub pool: Arc<Pool>,
    host_file: std::fs::File,
    launcher: launch::Launcher,
    wake: EventFd,
    env: WorkerEnv,
    stopping: AtomicBool,
    /// The service manager, told how many devices are connected.
    notifier: Mutex<Option<Arc<Notifier>>>,
    /// The loop ended with an error: the daemon exits non-zero.
    loop_failed: AtomicBool,
}

impl Supervisor {
    pub fn new(
        devices: Vec<Arc<Served>>,
        pool: Arc<Pool>,
        host_file: std::fs::File,
        launcher: OwnedFd,
        env: WorkerEnv,
    ) -> io::Result<Supervisor> {
        Ok(Supervisor {
            registry: registry::Registry::new(devices),
            pool,
            host_file,
            launcher: launch::Launcher::new(launcher),
            wake: EventFd::new(EFD_NONBLOCK)?,
            env,
            stopping: AtomicBool::new(false),
            notifier: Mutex::new(None),
            loop_failed: AtomicBool::new(false),
        })
    }

    /// The loop failed (the launcher is gone, say): nothing is served.
    pub fn loop_failed(&self) -> bool {
        self.loop_failed.load(Relaxed)
    }

    /// The daemon's own state dir (a device may name another).
    pub fn state_dir(&self) -> &std::path::Path {
        &self.env.state_dir
    }

    /// The daemon's control socket.
    pub fn control(&self) -> &std::path::Path {
        &self.env.control
    }

    /// Device `i`, if it exists (and was not removed).
    pub fn device(&self, i: usize) -> Option<Arc<Served>> {
        self.registry.get(i)
    }

    /// Every device, with its index.
    pub fn devices(&self) -> Vec<(usize, Arc<Served>)> {
        self.registry.all()
    }

    /// Status lines for the service manager from now on.
    pub fn set_notifier(&self, n: Option<Arc<Notifier>>) {
        *self.notifier.lock().unwrap_or_else(|e| e.into_inner()) = n;
        // The loop starts its watchdog clock on its next turn.
        self.wake();
    }

    /// `STATUS=` for systemd: devices, and how many have a frontend.
    fn tell_status(&self) {
        self.notify(&self.status_line());
    }

    /// The `STATUS=` line: devices, and how many have a frontend.
    fn status_line(&self) -> String {
        let all = self.devices();
        let connected = all.iter().filter(|(_, d)| d.worker.connected()).count();
        format!(
            "STATUS=serving {} devices, {connected} connected",
            all.len()
        )
    }

    /// Tells the service manager, if there is one; a lost message is
    /// only worth a debug line (the devices serve either way).
    fn notify(&self, msg: &str) {
        let n = self
            .notifier
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(n) = n {
            if let Err(e) = n.send(msg) {
                tracing::debug!("cannot tell the service manager ({msg}): {e}");
            }
        }
    }

    pub fn wake(&self) {
        // Only fails when the counter is full, and then a wake-up is due.
        let _ = self.wake.write(1);
    }

    /// Stops every worker (closing its control channel ends it) and waits
    /// a little for them to go, so their state locks are free for whoever
    /// starts next.
    pub fn stop(&self) {
        // Sockets added at run time are the launcher's to remove, while
        // it is still there to ask.
        for (_, d) in self.devices() {
            if d.added {
                let _ = self.launcher.ask(|id| Request::Remove {
                    id,
                    socket: Some(d.spec.socket.clone()),
                    state: None,
                    expect: None,
                });
            }
        }
        self.stopping.store(true, Relaxed);
        let all = self.devices();
        for (_, d) in &all {
            d.worker.end_channel();
        }
        self.wake();
        let deadline = Instant::now() + STOP_WAIT;
        while Instant::now() < deadline && all.iter().any(|(_, d)| d.worker.running()) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
