//! Memory limits set at run time (`vzram set-limit`, a reload) and the one
//! rule for limits that disagree: a device limit above the host limit, a
//! host limit below a device's, or a limit below what is held now is
//! accepted with a warning (logged, and returned to whoever asked). Only a
//! device limit above the device's size is refused: a typo, since pages
//! never take more than their size.

use super::error::{Error, Result};
use super::served::Served;
use super::Supervisor;

/// Why a limit below what is held now changes nothing at once.
const BELOW_USE: &str = "nothing stored is dropped; writes of new pages fail (or spill to a backing file) until it holds less";

impl Supervisor {
    /// Sets device `d`'s limit (0: none); the warnings it deserves.
    pub fn set_device_limit(&self, d: &Served, bytes: u64) -> Result<Vec<String>> {
        if bytes > d.spec.size {
            return Err(Error::Invalid(format!(
                "device {}: a limit of {bytes} bytes is above its size {} (0 means no limit)",
                d.spec.name, d.spec.size
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
        let mut w = Vec::new();
        if bytes != 0 && host != 0 && bytes > host {
            w.push(format!(
                "device {}: its limit of {bytes} bytes is above the host limit of {host}: the host limit caps it first",
                d.spec.name
            ));
        }
        if bytes != 0 && used > bytes {
            w.push(format!(
                "device {}: its limit of {bytes} bytes is below the {used} bytes it holds now: {BELOW_USE}",
                d.spec.name
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
        let mut w = Vec::new();
        if bytes == 0 {
            return w;
        }
        for (_, d) in self.devices().into_iter().filter(|_| devices) {
            let limit = d.cells.budget().limit();
            if limit > bytes {
                w.push(format!(
                    "the host limit of {bytes} bytes is below device {}'s limit of {limit}: the host limit caps it first",
                    d.spec.name
                ));
            }
        }
        if used > bytes {
            w.push(format!(
                "the host limit of {bytes} bytes is below the {used} bytes the devices hold now: {BELOW_USE}"
            ));
        }
        for m in &w {
            tracing::warn!("{m}");
        }
        w
    }
}
