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
/// runs the same orders itself (`owner::execute`) on a device no worker
/// serves. Each is a struct that names its answer ([`Command`]); this is
/// what travels.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Order {
    Compact,
    MarkIdle,
    Recompress(Recompress),
    Writeback(Writeback),
    Receive(Receive),
    Send(Send),
    /// An incoming device gives up waiting: it starts empty and serves.
    ResetIncoming,
}

/// An order that names its answer: what the supervisor sends, and what
/// [`Answer::reply`] reads back.
pub trait Command: Clone + Into<Order> {
    type Reply: TryFrom<Answer, Error = Answer>;
}

/// Compact the device's pool.
#[derive(Debug, Clone, Copy)]
pub struct Compact;

/// Mark every page in memory idle.
#[derive(Debug, Clone, Copy)]
pub struct MarkIdle;

/// An incoming device gives up waiting: it starts empty and serves.
#[derive(Debug, Clone, Copy)]
pub struct ResetIncoming;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recompress {
    pub filter: TierFilter,
    #[serde(with = "codec")]
    pub algo: Codec,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Writeback {
    pub filter: TierFilter,
    pub max_pages: Option<u64>,
}

/// Receive the device's pages from the migration connection sent along
/// (a unix socket, or the plain end of the supervisor's TLS relay: no key
/// ever travels in an order); the stream must be whole `within` the
/// order's arrival (to the millisecond: whole seconds cut up to one off
/// the operator's `--incoming-timeout`). With `resume`, the stream was begun by the
/// device's owner before (the supervisor, holding a device no VM used
/// yet): carry on from there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receive {
    pub within: std::time::Duration,
    pub resume: Option<Resume>,
}

/// Send the device's pages over the migration connection sent along (as
/// for [`Receive`]), until the frontend stops; commit on evidence that the
/// VM runs on the destination (`owner::commit`), then drop them unless
/// `keep`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Send {
    pub keep: bool,
}

/// And back: the answer its order names, or the failure it met.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    Compacted(Compacted),
    MarkedIdle(MarkedIdle),
    Recompressed(Recompressed),
    WrittenBack(WrittenBack),
    Received(Received),
    HandedOn(HandedOn),
    Sent(Sent),
    IncomingReset(IncomingReset),
    /// The order was carried out as far as it went and failed there (a
    /// full backing file, an I/O error): what was done stays done.
    Failed {
        error: String,
    },
}

/// An order that failed where it was carried out, in the owner's words
/// (they crossed a process boundary as text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct OrderFailed(pub String);

impl Answer {
    /// The reply order `C` names, or the failure it met; the answer itself
    /// if it is neither (one to another order).
    pub fn reply<C: Command>(self) -> Result<Result<C::Reply, OrderFailed>, Answer> {
        if let Answer::Failed { error } = self {
            return Ok(Err(OrderFailed(error)));
        }
        C::Reply::try_from(self).map(Ok)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Compacted {
    pub pages: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkedIdle {
    /// Newly marked.
    pub pages: u64,
    /// Idle in memory after the mark, those marked before included.
    #[serde(default)]
    pub idle: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recompressed {
    pub tried: u64,
    pub pages: u64,
    pub saved_bytes: u64,
    pub freed_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrittenBack {
    pub pages: u64,
    pub freed_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Received {
    pub pages: u64,
    pub bytes: u64,
    pub records: u64,
    pub passes: u32,
    pub micros: u64,
}

/// The receive stopped at a record boundary for a frontend that connected
/// meanwhile: its worker carries on from `resume` (only the supervisor
/// hands a stream on).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandedOn {
    pub resume: Resume,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sent {
    pub pages: u64,
    pub bytes: u64,
    pub records: u64,
    pub passes: u32,
    pub final_records: u64,
    pub final_micros: u64,
    pub total_micros: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncomingReset {
    pub pages: u64,
}

/// What a [`Receive`] ends in: every page here, or the stream handed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arrival {
    Received(Received),
    HandedOn(HandedOn),
}

impl TryFrom<Answer> for Arrival {
    type Error = Answer;
    fn try_from(a: Answer) -> Result<Arrival, Answer> {
        match a {
            Answer::Received(r) => Ok(Arrival::Received(r)),
            Answer::HandedOn(h) => Ok(Arrival::HandedOn(h)),
            Answer::Compacted(_)
            | Answer::MarkedIdle(_)
            | Answer::Recompressed(_)
            | Answer::WrittenBack(_)
            | Answer::Sent(_)
            | Answer::IncomingReset(_)
            | Answer::Failed { .. } => Err(a),
        }
    }
}

/// Each order: its [`Order`], and its answer (read back from the
/// [`Answer`] variant of the same name).
macro_rules! orders {
    ($($order:ident => $reply:ident;)*) => {$(
        impl Command for $order {
            type Reply = $reply;
        }
    )*};
}

/// Unit orders travel as their bare name (`"Compact"`), the others with
/// their fields (`{"Recompress":{...}}`).
macro_rules! into_order {
    (unit $($name:ident),*) => {$(
        impl From<$name> for Order {
            fn from(_: $name) -> Order {
                Order::$name
            }
        }
    )*};
    (fields $($name:ident),*) => {$(
        impl From<$name> for Order {
            fn from(o: $name) -> Order {
                Order::$name(o)
            }
        }
    )*};
}

/// An answer that is the one variant of [`Answer`] of its own name.
macro_rules! answers {
    ($($name:ident),*) => {$(
        impl TryFrom<Answer> for $name {
            type Error = Answer;
            fn try_from(a: Answer) -> Result<$name, Answer> {
                if let Answer::$name(r) = a {
                    Ok(r)
                } else {
                    Err(a)
                }
            }
        }
    )*};
}

into_order!(unit Compact, MarkIdle, ResetIncoming);
into_order!(fields Recompress, Writeback, Receive, Send);
answers!(
    Compacted,
    MarkedIdle,
    Recompressed,
    WrittenBack,
    Sent,
    IncomingReset
);
orders! {
    Compact => Compacted;
    MarkIdle => MarkedIdle;
    Recompress => Recompressed;
    Writeback => WrittenBack;
    Receive => Arrival;
    Send => Sent;
    ResetIncoming => IncomingReset;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Orders and answers travel as they did before each was a struct.
    #[test]
    fn the_wire_is_unchanged() {
        let cases: [(Order, &str); 4] = [
            (Compact.into(), r#""Compact""#),
            (ResetIncoming.into(), r#""ResetIncoming""#),
            (Send { keep: true }.into(), r#"{"Send":{"keep":true}}"#),
            (
                Writeback {
                    filter: TierFilter::default(),
                    max_pages: Some(3),
                }
                .into(),
                r#"{"Writeback":{"filter":{"idle":false,"cold":false,"huge":false,"incompressible":false},"max_pages":3}}"#,
            ),
        ];
        for (o, wire) in cases {
            assert_eq!(serde_json::to_string(&o).unwrap(), wire);
        }
        let a = Answer::Compacted(Compacted { pages: 3 });
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            r#"{"Compacted":{"pages":3}}"#
        );
        let f = Answer::Failed {
            error: "full".into(),
        };
        assert_eq!(
            serde_json::to_string(&f).unwrap(),
            r#"{"Failed":{"error":"full"}}"#
        );
    }

    /// An answer reads back as its order's reply, a failure as its error,
    /// and another order's answer as itself.
    #[test]
    fn answers_read_back_typed() {
        let a = Answer::Compacted(Compacted { pages: 3 });
        assert_eq!(a.clone().reply::<Compact>(), Ok(Ok(Compacted { pages: 3 })));
        assert_eq!(a.clone().reply::<MarkIdle>(), Err(a));
        let f = Answer::Failed {
            error: "full".into(),
        };
        assert_eq!(
            f.reply::<Writeback>(),
            Ok(Err(OrderFailed("full".to_string())))
        );
    }
}
