//! Tiering in the background, while a worker serves: the ager, and the
//! paced writeback and recompression of what it found cold.

use std::time::Duration;

use vzram_store::{Codec, Device, Filter, StoreError};

use crate::proto::worker_spec::TierSettings;

/// Background tiering (`--auto-writeback`, `--auto-recompress`) works in
/// batches of this many pages with a pause after each: at most 4 MiB per
/// 100 ms (40 MiB/s) of writeback or recompression, so the queues keep the
/// CPU and the disk for the guest, and a write that must spill waits for
/// one batch at most.
pub const AUTO_BATCH_PAGES: u64 = 1024;
pub const AUTO_PAUSE: Duration = Duration::from_millis(100);

/// The ager and what runs after each of its passes.
pub struct AutoTier {
    writeback: bool,
    recompress: Option<Codec>,
}

impl AutoTier {
    pub fn new(t: &TierSettings) -> AutoTier {
        AutoTier {
            writeback: t.auto_writeback,
            recompress: t.auto_recompress.then_some(t.recompress_algo),
        }
    }

    /// Every `every`: one ager pass, then the paced passes over the pages
    /// it found cold. Ends with the process.
    pub fn run(&self, store: &Device, every: Duration) {
        let cold = Filter {
            cold: true,
            ..Filter::default()
        };
        // With recompression on, cold pages stay in memory in the smaller
        // codec; only those it cannot shrink go to disk.
        let to_disk = Filter {
            incompressible: self.recompress.is_some(),
            ..cold
        };
        loop {
            std::thread::sleep(every);
            let n = store.age();
            tracing::debug!(cold = n, "ager pass");
            if n == 0 {
                continue;
            }
            if let Some(codec) = self.recompress {
                let (mut pages, mut saved) = (0, 0);
                let done = paced(|| {
                    let r = store.recompress_some(cold, codec, Some(AUTO_BATCH_PAGES))?;
                    pages += r.pages;
                    saved += r.saved_bytes;
                    Ok(r.tried)
                });
                if pages > 0 {
                    tracing::info!(pages, saved_bytes = saved, "recompressed cold pages");
                }
                if let Err(e) = done {
                    tracing::warn!("background recompression stopped: {e}");
                }
            }
            if self.writeback {
                let mut pages = 0;
                let done = paced(|| {
                    let r = store.writeback(to_disk, Some(AUTO_BATCH_PAGES))?;
                    pages += r.pages;
                    Ok(r.pages)
                });
                if pages > 0 {
                    tracing::info!(pages, "wrote cold pages back");
                }
                if let Err(e) = done {
                    tracing::warn!("background writeback stopped: {e}");
                }
            }
            store.stats();
        }
    }
}

/// Runs `batch` until it does nothing (returns 0) or fails, pausing after
/// each batch that did something.
fn paced(mut batch: impl FnMut() -> Result<u64, StoreError>) -> Result<(), StoreError> {
    while batch()? > 0 {
        std::thread::sleep(AUTO_PAUSE);
    }
    Ok(())
}
