//! Memory limits set at run time (`vzram set-limit`, a reload) and the one
//! rule for limits that disagree: a device limit above the host limit, a
//! host limit below a device's, or a limit below what is held now is
//! accepted with a warning (logged, and returned to whoever asked). Only a
//! device limit above the device's size is refused: a typo, since pages
//! never take more than their size.

use super::error::{Error, Result};
use super::served::Served;
use super::Supervisor;
use crate::config::{size_text, tiny_limit};

/// Why a limit below what is held now changes nothing at once.
const BELOW_USE: &str = "nothing stored is dropped; writes of new pages fail (or spill to a backing file) until it holds less";

impl Supervisor {
    /// Sets device `d`'s limit (0: none); the warnings it deserves.
    pub fn set_device_limit(&self, d: &Served, bytes: u64) -> Result<Vec<String>> {
        if bytes > d.spec.size {
            return Err(Error::Invalid(format!(
                "device {}: a limit of {} is above its size {} (0 means no limit)",
                d.spec.name,
                size_text(bytes),
                size_text(d.spec.size)
            )));
        }
        // The worker, if any, reads the limit from the shared cells.
        d.cells.budget().set_limit(bytes);
        tracing::info!(device = %d.spec.name, bytes, "device memory limit set");
        Ok(self.device_limit_warnings(d))
    }

    /// What is wrong with device `d`'s limit as it stands, each logged.
    pub fn device_limit_warnings(&self, d: &Served) -> Vec<String> {
        let budget = d.cells.budget();
        let (bytes, used) = (budget.limit(), budget.used());
        let host = self.pool.host_mem_limit();
        let mut w: Vec<String> = tiny_limit(&format!("device {}: a limit", d.spec.name), bytes)
            .into_iter()
            .collect();
        if bytes != 0 && host != 0 && bytes > host {
            w.push(format!(
                "device {}: its limit of {} is above the host limit of {}: the host limit caps it first",
                d.spec.name,
                size_text(bytes),
                size_text(host)
            ));
        }
        if bytes != 0 && used > bytes {
            w.push(format!(
                "device {}: its limit of {} is below the {} it holds now: {BELOW_USE}",
                d.spec.name,
                size_text(bytes),
                size_text(used)
            ));
        }
        for m in &w {
            tracing::warn!("{m}");
        }
        w
    }

    /// Sets the host limit (0: none); the warnings it deserves.
    pub fn set_host_limit(&self, bytes: u64) -> Vec<String> {
        self.pool.set_host_mem_limit(bytes);
        tracing::info!(bytes, "host memory limit set");
        self.host_limit_warnings(true)
    }

    /// What is wrong with the host limit as it stands, each logged: below
    /// what the devices hold, and with `devices`, below a device's limit.
    pub fn host_limit_warnings(&self, devices: bool) -> Vec<String> {
        let host = self.pool.host_cells().budget();
        let (bytes, used) = (host.limit(), host.used());
        if bytes == 0 {
            return Vec::new();
        }
        let mut w: Vec<String> = tiny_limit("the host limit", bytes).into_iter().collect();
        for (_, d) in self.devices().into_iter().filter(|_| devices) {
            let limit = d.cells.budget().limit();
            if limit > bytes {
                w.push(format!(
                    "the host limit of {} is below device {}'s limit of {}: the host limit caps it first",
                    size_text(bytes),
                    d.spec.name,
                    size_text(limit)
                ));
            }
        }
        if used > bytes {
            w.push(format!(
                "the host limit of {} is below the {} the devices hold now: {BELOW_USE}",
                size_text(bytes),
                size_text(used)
            ));
        }
        for m in &w {
            tracing::warn!("{m}");
        }
        w
    }
}
