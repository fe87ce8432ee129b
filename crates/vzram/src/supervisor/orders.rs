//! Orders to a device: carried out by its worker when it has one, else
//! here, holding the device so that no worker starts meanwhile.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vzram_store::Device;

use super::error::{Error, Result};
use super::served::Served;
use super::worker_slot::Phase;
use super::Supervisor;
use crate::owner::attach::{attach, device_config};
use crate::owner::execute::{execute, execute_migration, Migrating};
use crate::proto::control::{MIGRATE_WAIT, TIER_WAIT};
use crate::proto::order::{self, Answer, Command, Order, OrderFailed};
use crate::proto::wire;
use crate::sys::socket::readable;

/// How long a compaction order may take.
const COMPACT_WAIT: Duration = Duration::from_secs(120);
/// How long an order waits for a device that a worker is just taking over
/// (or giving back) before it is refused as busy.
pub(super) const HOLD_WAIT: Duration = Duration::from_secs(5);
/// How long a compaction waits for a busy device before skipping it.
const COMPACT_PATIENCE: Duration = Duration::from_secs(1);

impl Supervisor {
    /// Compacts device `d`: through its worker when it has one, else here,
    /// holding the device so that no worker starts meanwhile.
    ///
    /// The pages given back are read from the device's shared counter: a
    /// worker that compacted and then went before it could answer (its
    /// frontend had just left) is asked again, and the second pass finds
    /// nothing left to do. The count includes any compaction the worker
    /// ran by itself meanwhile. A device that stays busy (a frontend
    /// connecting, another command holding it) for a second is skipped:
    /// 0 pages, as compaction is only ever an optimisation.
    pub fn compact(&self, d: &Served) -> Result<u64> {
        let counted = || d.cells.stats(d.spec.size).pages_compacted;
        let before = counted();
        match self.carry_out(d, &order::Compact, COMPACT_WAIT, COMPACT_PATIENCE)? {
            Some(order::Compacted { pages }) => Ok(pages.max(counted().saturating_sub(before))),
            None => {
                tracing::info!(device = %d.spec.name, "busy; not compacted");
                Ok(0)
            }
        }
    }

    /// Carries out a tiering order on device `d`: through its worker when
    /// it has one, else here, holding the device. A failure the order met
    /// (a full backing file) is an error, with what was done kept.
    pub fn tier<C: Command>(&self, d: &Served, order: &C) -> Result<C::Reply> {
        let needs_backing = matches!(order.clone().into(), Order::Writeback(_));
        if needs_backing && d.backing.is_none() {
            return Err(Error::NoBackingFile(d.spec.name.clone()));
        }
        self.carry_out(d, order, TIER_WAIT, HOLD_WAIT)?
            .ok_or_else(|| Error::Busy(d.spec.name.clone()))
    }

    /// Carries out `order` on `d`: through its worker when it has one, else
    /// here, holding the device. A worker that is going (its frontend had
    /// just left) or starting is asked again, never skipped: an order that
    /// met a device in transition used to report nothing done. None if
    /// the device was neither served nor free to hold for `patience`.
    pub(super) fn carry_out<C: Command>(
        &self,
        d: &Served,
        order: &C,
        wait: Duration,
        patience: Duration,
    ) -> Result<Option<C::Reply>> {
        let order = &order.clone().into();
        let deadline = Instant::now() + patience;
        let answer = loop {
            match self.order_worker(d, order, wait) {
                Some(Ok(a)) => break a,
                Some(Err(Asked::Silent)) => return Err(Error::WorkerSilent),
                // The worker was going (its frontend had just left) or died:
                // whatever it did is in the device, and every tiering order
                // can run again; whoever holds the device next takes it.
                Some(Err(Asked::Gone(e))) => {
                    tracing::info!(device = %d.spec.name, "worker went away during an order ({e}); asking again")
                }
                None => {}
            }
            if let Some(a) = self.hold(d, |dev| execute(dev, order))? {
                break a;
            }
            // A worker is being started or is going: ask again soon.
            if Instant::now() > deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        match answer.reply::<C>().map_err(unexpected)? {
            Ok(r) => Ok(Some(r)),
            Err(error) => Err(failed(d, error)),
        }
    }

    /// Sends `order` to `d`'s worker and waits for its answer; None if no
    /// worker serves `d`. A worker that cannot be asked loses its channel,
    /// which ends it (its frontend reconnects to a new one).
    pub(super) fn order_worker(
        &self,
        d: &Served,
        order: &Order,
        wait: Duration,
    ) -> Option<Result<Answer, Asked>> {
        self.order_worker_with(d, order, wait, &mut None)
    }

    /// [`Supervisor::order_worker`], handing the worker `fd` with the
    /// order (taken out of it only if there is a worker to send it to).
    pub(super) fn order_worker_with(
        &self,
        d: &Served,
        order: &Order,
        wait: Duration,
        fd: &mut Option<OwnedFd>,
    ) -> Option<Result<Answer, Asked>> {
        let _one = d.worker.one_order();
        let c = d.worker.channel()?;
        let fd = fd.take();
        let raw: Vec<RawFd> = fd.iter().map(AsRawFd::as_raw_fd).collect();
        let r = ask_worker(&c, order, &raw, wait);
        drop(fd);
        if r.is_err() {
            d.worker.end_channel_if(&c);
        }
        Some(r)
    }

    /// Drops every page of `d`; refused while a frontend is connected
    /// (naming it) unless `force`, which cuts the frontend off first; and
    /// unless the device waits for its pages (incoming): then it gives up
    /// waiting and serves, empty, whether a frontend is connected or not.
    pub fn reset(&self, d: &Served, force: bool) -> Result<u64> {
        let m = &d.cells.migration;
        if m.incoming() {
            // A stream under way is cut first: it empties the device.
            self.cut_arriving(d)?;
            let (answer, _) = self.on_owner(d, &order::ResetIncoming, None, HOLD_WAIT)?;
            return match answer {
                Ok(order::IncomingReset { pages }) => {
                    d.migration.set_error(None);
                    tracing::warn!(device = %d.spec.name, "incoming device reset: it serves, empty");
                    Ok(pages)
                }
                Err(error) => Err(failed(d, error)),
            };
        }
        if d.migration.sending() {
            return Err(Error::MigrationRunning(d.spec.name.clone()));
        }
        let _cut = match d.frontend() {
            Some(frontend) if !force => {
                let name = &d.spec.name;
                return Err(Error::Connected {
                    device: name.clone(),
                    frontend,
                    advice: format!(
                        "a reset drops every page under its running VM: stop the VM first, or `vzram reset {name} --force` to cut it off and reset now"
                    ),
                });
            }
            Some(frontend) => {
                tracing::warn!(device = %d.spec.name, %frontend, "reset --force of a connected device: the frontend is cut off");
                Some(self.cut_frontend(d)?)
            }
            None => None,
        };
        let dropped = self.hold(d, |dev| {
            let pages = dev.stats().orig_data_size / 4096;
            let r = dev.discard(&mut vzram_store::Context::new(0), 0..dev.num_slots());
            dev.compact();
            // As zram's reset: a new start for the counters too (the
            // discard above is not the guest's).
            d.cells.zero_counters();
            // A device sent away may be migrated again once reset.
            use vzram_store::cells::Phase;
            m.shift(
                &[Phase::Sent, Phase::Copied, Phase::SendFailed],
                Phase::None,
            );
            r.map(|()| pages)
        })?;
        match dropped {
            Some(r) => Ok(r?),
            None => Err(match d.frontend() {
                Some(frontend) => Error::Connected {
                    device: d.spec.name.clone(),
                    frontend,
                    advice: format!(
                        "stop the VM first, or `vzram reset {} --force`",
                        d.spec.name
                    ),
                },
                None => Error::Busy(d.spec.name.clone()),
            }),
        }
    }

    /// Ends the worker of `d` and admits no frontend until the returned
    /// guard goes.
    fn cut_frontend<'a>(&'a self, d: &'a Served) -> Result<Uncut<'a>> {
        d.worker.close();
        let guard = Uncut { sup: self, d };
        self.wake();
        let deadline = Instant::now() + super::STOP_WAIT;
        while !d.worker.idle() {
            if Instant::now() > deadline {
                return Err(Error::WorkerStuck {
                    device: d.spec.name.clone(),
                    wait: super::STOP_WAIT,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(guard)
    }

    /// Carries out a migration order where the device's allocator is: its
    /// worker, or here (holding the device) when it has none. `fd` goes
    /// with the order. Waits up to `hold_wait` for a worker that is just
    /// starting or going. Gives its reply, or the failure it met (Err);
    /// also says whether a worker took the order.
    pub(super) fn on_owner<C: Command>(
        &self,
        d: &Served,
        order: &C,
        fd: Option<OwnedFd>,
        hold_wait: Duration,
    ) -> Result<(Result<C::Reply, OrderFailed>, bool)> {
        let (answer, by_worker) = self.on_owner_answer(d, &order.clone().into(), fd, hold_wait)?;
        Ok((answer.reply::<C>().map_err(unexpected)?, by_worker))
    }

    /// [`Supervisor::on_owner`], the answer as it came.
    fn on_owner_answer(
        &self,
        d: &Served,
        order: &Order,
        fd: Option<OwnedFd>,
        hold_wait: Duration,
    ) -> Result<(Answer, bool)> {
        let mut fd = fd;
        let deadline = Instant::now() + hold_wait;
        loop {
            if let Some(r) = self.order_worker_with(d, order, MIGRATE_WAIT, &mut fd) {
                return r.map(|a| (a, true)).map_err(Error::from);
            }
            let here = self.hold(d, |dev| {
                let open = || {};
                // A frontend that connects meanwhile waits in the backlog
                // (the loop leaves a held device's listener alone): a
                // receive stops for it, and its worker takes the stream on.
                let waits = || readable(d.listener.as_raw_fd());
                execute_migration(
                    dev,
                    order,
                    Migrating {
                        conn: fd.take(),
                        frontend: crate::owner::migration::Frontend::NONE,
                        open_gate: &open,
                        hand_on: Some(&waits),
                    },
                )
            })?;
            if let Some(a) = here {
                return Ok((a, false));
            }
            if Instant::now() > deadline {
                return Err(Error::Busy(d.spec.name.clone()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `f` on device `d` in this process, if no worker serves it (None
    /// if one does); no worker starts meanwhile.
    pub(super) fn hold<T>(&self, d: &Served, f: impl FnOnce(&Device) -> T) -> Result<Option<T>> {
        {
            let mut ph = d.worker.phase();
            match *ph {
                Phase::Idle => *ph = Phase::Busy,
                Phase::Pending { .. } | Phase::Running { .. } | Phase::Busy => return Ok(None),
            }
        }
        let r = self.attach(d).map(|dev| {
            let out = f(&dev);
            dev.stats();
            out
        });
        *d.worker.phase() = Phase::Idle;
        self.wake();
        r.map(Some)
    }

    /// The device of `d`, recovered in this process from its state.
    pub(super) fn attach(&self, d: &Served) -> Result<Arc<Device>> {
        let backing = d.backing.as_ref().map(|b| b.open()).transpose()?;
        let s = &d.spec;
        let dc = device_config(s.size, s.algo, s.queues, d.cells.budget().limit());
        Ok(attach(&self.pool, dc, &d.files, backing)?)
    }
}

/// Frontends are admitted again to a device [`Supervisor::cut_frontend`]
/// cut off, once this goes.
struct Uncut<'a> {
    sup: &'a Supervisor,
    d: &'a Served,
}

impl Drop for Uncut<'_> {
    fn drop(&mut self) {
        self.d.worker.reopen();
        self.sup.wake();
    }
}

/// Why a worker gave no answer to an order.
#[derive(Debug)]
pub(super) enum Asked {
    /// Its channel broke: it was exiting (its frontend had left) or died.
    Gone(String),
    /// It did not answer within the wait.
    Silent,
}

impl From<Asked> for Error {
    fn from(a: Asked) -> Error {
        match a {
            Asked::Gone(e) => Error::WorkerGone(e),
            Asked::Silent => Error::WorkerSilent,
        }
    }
}

/// Sends a worker an order and waits up to `wait` for its answer.
fn ask_worker(
    c: &UnixStream,
    order: &Order,
    fds: &[RawFd],
    wait: Duration,
) -> Result<Answer, Asked> {
    wire::send(c, order, fds).map_err(|e| Asked::Gone(e.to_string()))?;
    match vzram_blk::guard::wait_fd(c.as_raw_fd(), libc::POLLIN, Some(wait)) {
        Ok(true) => {}
        Ok(false) => return Err(Asked::Silent),
        Err(e) => return Err(Asked::Gone(e.to_string())),
    }
    match wire::recv::<Answer>(c) {
        Ok(Some((a, _))) => Ok(a),
        Ok(None) => Err(Asked::Gone("it went away".into())),
        Err(e) => Err(Asked::Gone(e.to_string())),
    }
}

/// An answer to another order than the one asked.
fn unexpected(a: Answer) -> Error {
    Error::WorkerAnswer(format!("{a:?}"))
}

/// The worker (or this process) carried the order out as far as it went.
pub(super) fn failed(d: &Served, error: impl std::fmt::Display) -> Error {
    Error::Failed {
        device: d.spec.name.clone(),
        error: error.to_string(),
    }
}
