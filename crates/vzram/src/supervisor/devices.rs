//! Devices added and removed while the daemon runs (`vzram add`,
//! `vzram remove`).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vzram_store::StateFiles;

use super::error::{Error, Result};
use super::served::{BackingFile, Phase, Served};
use super::{Supervisor, STOP_WAIT};
use crate::config::DeviceSpec;
use crate::owner::attach::{attach, device_config};
use crate::owner::migration::{set_incoming, Listener};
use crate::proto::launch::{Report, Request};

impl Supervisor {
    /// Adds a device at run time; returns its index.
    pub fn add(self: &Arc<Self>, spec: DeviceSpec) -> Result<usize> {
        let _one = self.adding.lock().unwrap_or_else(|e| e.into_inner());
        for (_, d) in self.devices() {
            if d.spec.name == spec.name {
                return Err(Error::NameTaken(spec.name));
            }
            if d.spec.socket == spec.socket {
                return Err(Error::SocketTaken {
                    socket: spec.socket.display().to_string(),
                    device: d.spec.name.clone(),
                });
            }
        }
        let root = spec
            .state_dir
            .clone()
            .unwrap_or_else(|| self.env.state_dir.clone());
        let (report, fds) = self.ask(|id| Request::Prepare {
            id,
            socket: spec.socket.clone(),
            mode: self.env.socket_mode,
            root,
            name: spec.name.clone(),
            size: spec.size,
            algo: spec.algo,
            shards: usize::from(spec.queues),
            backing: spec.tier.backing_file.clone(),
            incoming: spec.incoming.clone(),
        })?;
        let (dir, existing, prepared_backing) = match report {
            Report::Prepared {
                dir,
                existing,
                backing,
                ..
            } => (dir, existing, backing),
            Report::Failed { error, .. } => return Err(Error::LauncherRefused(error)),
            r => return Err(Error::LauncherAnswer(format!("{r:?}"))),
        };
        let mut fds = fds.into_iter();
        let mut next = || fds.next().ok_or(Error::LauncherFds);
        let (listener, lock, table, arena, stats) = (next()?, next()?, next()?, next()?, next()?);
        let backing = match (spec.tier.backing_file.clone(), prepared_backing) {
            (Some(path), Some(b)) => Some(BackingFile {
                file: next()?.into(),
                path,
                direct: b.direct,
                blocks: b.blocks,
            }),
            (None, None) => None,
            _ => return Err(Error::LauncherFds),
        };
        let incoming = match &spec.incoming {
            Some(a) => Some(Listener::new(a, next()?)),
            None => None,
        };
        let socket = spec.socket.clone();
        let undo = |e: Error| {
            let _ = self.ask(|id| Request::Remove {
                id,
                socket: Some(socket.clone()),
                state: None,
            });
            e
        };
        let files = StateFiles::from_files(
            dir,
            lock.into(),
            table.into(),
            arena.into(),
            stats.into(),
            spec.size,
        )
        .map_err(|e| undo(e.into()))?;
        let opened = match &backing {
            Some(b) => Some(b.open().map_err(|e| undo(e.into()))?),
            None => None,
        };
        let dc = device_config(spec.size, spec.algo, spec.queues, spec.mem_limit);
        let dev = attach(&self.pool, dc, &files, opened).map_err(|e| undo(e.into()))?;
        match dev.recovery() {
            Some(r) if existing => tracing::info!(
                device = %spec.name,
                pages = r.slots,
                ms = r.micros as f64 / 1000.0,
                "added; recovered the device from its state"
            ),
            _ => tracing::info!(device = %spec.name, socket = %spec.socket.display(), "added"),
        }
        if spec.incoming.is_some() {
            set_incoming(&spec.name, &dev);
        }
        drop(dev);
        let mut served = Served::new(spec, listener.into(), files, backing)
            .map_err(|e| undo(e.into()))?
            .with_incoming(incoming);
        served.added = true;
        let i = {
            let mut list = self.devices.write().unwrap_or_else(|e| e.into_inner());
            list.push(Some(Arc::new(served)));
            list.len() - 1
        };
        self.wake();
        self.tell_status();
        if let Some(d) = self.device(i) {
            self.start_incoming(d).map_err(Error::Thread)?;
        }
        Ok(i)
    }

    /// Removes device `i` for good: its frontend is disconnected, its
    /// socket and its state deleted, its memory given back.
    pub fn remove(&self, i: usize) -> Result<()> {
        let Some(d) = self.device(i) else {
            return Err(Error::NoIndex(i));
        };
        d.removing.store(true, Relaxed);
        self.wake();
        let deadline = Instant::now() + STOP_WAIT;
        while !matches!(*d.phase(), Phase::Idle) {
            if Instant::now() > deadline {
                return Err(Error::WorkerStuck {
                    device: d.spec.name.clone(),
                    wait: STOP_WAIT,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.devices.write().unwrap_or_else(|e| e.into_inner())[i] = None;
        d.cells.release(self.pool.host_cells());
        let socket = d.spec.socket.clone();
        let dir = d.files.dir.clone();
        let name = d.spec.name.clone();
        // Everyone else lets go within moments (a stat, the loop's turn);
        // the state can be deleted only once its lock is free.
        let mut d = d;
        let deadline = Instant::now() + STOP_WAIT;
        loop {
            match Arc::try_unwrap(d) {
                Ok(served) => {
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
        let (report, _) = self.ask(|id| Request::Remove {
            id,
            socket: Some(socket),
            state: Some(dir),
        })?;
        match report {
            Report::Removed { .. } => {
                tracing::info!(device = %name, "removed, with its state");
                self.tell_status();
                Ok(())
            }
            Report::Failed { error, .. } => Err(Error::LauncherRefused(error)),
            r => Err(Error::LauncherAnswer(format!("{r:?}"))),
        }
    }
}
