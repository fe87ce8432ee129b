//! Supervisor ↔ worker: the orders the supervisor sends a worker on its
//! control channel, and the answers. Whichever process owns a device
//! carries them out (see `owner::execute`).

use serde::{Deserialize, Serialize};
use vzram_store::migrate::Resume;
use vzram_store::{Codec, Filter};

use super::codec;

/// Which pages a writeback or recompression takes ([`Filter`], as it
/// travels).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierFilter {
    pub idle: bool,
    pub cold: bool,
    pub huge: bool,
    pub incompressible: bool,
}

impl From<TierFilter> for Filter {
    fn from(f: TierFilter) -> Filter {
        Filter {
            idle: f.idle,
            cold: f.cold,
            huge: f.huge,
            incompressible: f.incompressible,
        }
    }
}

/// Messages on the control channel, supervisor to worker. The supervisor
/// runs the same orders itself (`owner::execute`) on a device no worker serves.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Order {
    Compact,
    MarkIdle,
    Recompress {
        filter: TierFilter,
        #[serde(with = "codec")]
        algo: Codec,
    },
    Writeback {
        filter: TierFilter,
        max_pages: Option<u64>,
    },
    /// Receive the device's pages from the migration connection sent along
    /// (a unix socket, or the plain end of the supervisor's TLS relay: no
    /// key ever travels in an order); the stream must be whole within
    /// `within_secs` of the order. With `resume`, the stream was begun by
    /// the device's owner before (the supervisor, holding a device no VM
    /// used yet): carry on from there.
    Receive {
        within_secs: u64,
        resume: Option<Resume>,
    },
    /// Send the device's pages over the migration connection sent along
    /// (as for `Receive`), until the frontend stops; commit on evidence
    /// that the VM runs on the destination (`owner::commit`), then drop
    /// them unless `keep`.
    Send {
        keep: bool,
    },
    /// An incoming device gives up waiting: it starts empty and serves.
    ResetIncoming,
}

/// And back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    Compacted {
        pages: u64,
    },
    MarkedIdle {
        /// Newly marked.
        pages: u64,
        /// Idle in memory after the mark, those marked before included.
        #[serde(default)]
        idle: u64,
    },
    Recompressed {
        tried: u64,
        pages: u64,
        saved_bytes: u64,
        freed_bytes: u64,
    },
    WrittenBack {
        pages: u64,
        freed_bytes: u64,
    },
    Received {
        pages: u64,
        bytes: u64,
        records: u64,
        passes: u32,
        micros: u64,
    },
    /// The receive stopped at a record boundary for a frontend that
    /// connected meanwhile: its worker carries on from `resume` (only the
    /// supervisor hands a stream on).
    HandedOn {
        resume: Resume,
    },
    Sent {
        pages: u64,
        bytes: u64,
        records: u64,
        passes: u32,
        final_records: u64,
        final_micros: u64,
        total_micros: u64,
    },
    IncomingReset {
        pages: u64,
    },
    /// The order was carried out as far as it went and failed there (a
    /// full backing file, an I/O error): what was done stays done.
    Failed {
        error: String,
    },
}
