//! Carries out an [`Order`] on a device, in whichever process owns it:
//! its worker while a frontend is connected, else the supervisor.

use std::os::fd::OwnedFd;
use std::time::Instant;

use vzram_store::cells::Phase;
use vzram_store::migrate::Received;
use vzram_store::Device;

use super::migration::{self, Frontend, Link};
use crate::proto::order::{
    Answer, Compacted, HandedOn, IncomingReset, MarkedIdle, Order, Receive, Recompress,
    Recompressed, Sent, Writeback, WrittenBack,
};

/// What the migration orders need besides the device: the connection
/// that came with the order, what the frontend is doing, the gate to
/// open once an incoming device has its pages, and (the supervisor's)
/// whether a receive should stop for a frontend that waits.
pub struct Migrating<'a> {
    pub conn: Option<OwnedFd>,
    pub frontend: Frontend<'a>,
    pub open_gate: &'a dyn Fn(),
    pub hand_on: Option<&'a dyn Fn() -> bool>,
}

/// Carries out a migration order on `dev`, here.
pub fn execute_migration(dev: &Device, order: &Order, m: Migrating<'_>) -> Answer {
    let failed = |error: String| Answer::Failed { error };
    let answer = match order {
        Order::Receive(_) | Order::Send(_) if m.conn.is_none() => {
            failed("no migration connection came with the order".into())
        }
        Order::Receive(Receive { within, resume }) => {
            let link = Link::plain(m.conn.expect("checked"));
            let deadline = Instant::now() + *within;
            let r = migration::receive(
                dev,
                &link,
                deadline,
                &m.frontend,
                m.hand_on,
                *resume,
                &|| {},
            );
            // Committed even if the source's confirmation was lost.
            if !dev.cells().migration.incoming() {
                (m.open_gate)();
            }
            match r {
                Ok(Received::HandedOn(resume)) => Answer::HandedOn(HandedOn { resume }),
                Ok(Received::Done(r)) => Answer::Received(crate::proto::order::Received {
                    pages: r.pages,
                    bytes: r.bytes,
                    records: r.records,
                    passes: r.passes,
                    micros: r.micros,
                }),
                Err(e) => failed(e.to_string()),
            }
        }
        Order::Send(crate::proto::order::Send { keep }) => {
            let link = Link::plain(m.conn.expect("checked"));
            match migration::send(dev, &link, &m.frontend, *keep) {
                Ok(r) => Answer::Sent(Sent {
                    pages: r.pages,
                    bytes: r.bytes,
                    records: r.records,
                    passes: r.passes,
                    final_records: r.final_records,
                    final_micros: r.final_micros,
                    total_micros: r.total_micros,
                }),
                Err(e) => failed(e.to_string()),
            }
        }
        Order::ResetIncoming => {
            let mig = &dev.cells().migration;
            if matches!(mig.phase(), Phase::Receiving | Phase::Prepared) {
                failed("a migration stream is arriving; reset it once it has failed".into())
            } else {
                let pages = dev.stats().orig_data_size / vzram_store::PAGE_SIZE as u64;
                match vzram_store::migrate::empty(dev, &mut vzram_store::Context::new(0)) {
                    Ok(()) => {
                        mig.set(Phase::None);
                        (m.open_gate)();
                        Answer::IncomingReset(IncomingReset { pages })
                    }
                    Err(e) => failed(e.to_string()),
                }
            }
        }
        o @ (Order::Compact
        | Order::MarkIdle
        | Order::Recompress { .. }
        | Order::Writeback { .. }) => execute(dev, o),
    };
    dev.stats();
    answer
}

/// Carries out an order on `dev`, here.
pub fn execute(dev: &Device, order: &Order) -> Answer {
    let answer = match order {
        Order::Compact => Answer::Compacted(Compacted {
            pages: dev.compact(),
        }),
        Order::MarkIdle => {
            let (pages, idle) = dev.mark_idle_counted();
            Answer::MarkedIdle(MarkedIdle { pages, idle })
        }
        Order::Recompress(Recompress { filter, algo }) => {
            match dev.recompress((*filter).into(), *algo) {
                Ok(r) => Answer::Recompressed(Recompressed {
                    tried: r.tried,
                    pages: r.pages,
                    saved_bytes: r.saved_bytes,
                    freed_bytes: r.freed_bytes,
                }),
                Err(e) => Answer::Failed {
                    error: e.to_string(),
                },
            }
        }
        Order::Writeback(Writeback { filter, max_pages }) => {
            match dev.writeback((*filter).into(), *max_pages) {
                Ok(r) => Answer::WrittenBack(WrittenBack {
                    pages: r.pages,
                    freed_bytes: r.freed_bytes,
                }),
                Err(e) => Answer::Failed {
                    error: e.to_string(),
                },
            }
        }
        Order::Receive(_) | Order::Send(_) | Order::ResetIncoming => {
            return execute_migration(
                dev,
                order,
                Migrating {
                    conn: None,
                    frontend: Frontend::NONE,
                    open_gate: &|| {},
                    hand_on: None,
                },
            )
        }
    };
    // The counters the supervisor shows are current once it answers.
    dev.stats();
    answer
}
