//! Model-based tests. Random operation sequences run against two devices
//! that share one pool (device and host limits) and against plain copies in
//! memory. Device 0 always has a small backing file, device 1 sometimes:
//! a write past a limit spills pages to it, and the tiering operations
//! (idle marks, the ager, writeback, recompression) move pages there or
//! shrink them. Besides each page's content the model knows where the page
//! is and what its slot word says (idle, age, tried, codec and length)
//! wherever the store's choices are predictable. A spill picks its victims
//! by a policy of its own, so after one, the pages it could have moved are
//! "in the pool or in the file" until a read or the counts tell which.
//! After every step the content, the limits and the statistics are checked
//! against the model (its operations in `model/ops.rs`, the model in
//! `model/harness.rs` and `model/tiering.rs`). A concurrent variant is in
//! `concurrent.rs`. `PROPTEST_CASES` sets the number of sequences per
//! codec.

use std::sync::Arc;

use proptest::prelude::*;
use vzram_store::codec::{CodecState, MAX_COMPRESSED};
use vzram_store::device::DEFAULT_HUGE_THRESHOLD;
use vzram_store::encode_fill;
use vzram_store::pool::class::class_of;
use vzram_store::{
    BackingSpec, Codec, Context, Device, DeviceConfig, DeviceStats, Filter, Page, Pool, PoolConfig,
    StoreError, PAGE_SIZE,
};

mod common;
use common::{xorshift, BackingFile};

#[path = "model/harness.rs"]
mod harness;
#[path = "model/ops.rs"]
mod ops;
#[path = "model/tiering.rs"]
mod tiering;

use harness::*;
use ops::*;

const P: u64 = PAGE_SIZE as u64;
/// Different sizes, so a slot mixed up between the devices shows.
const SLOTS: [u64; 2] = [64, 40];
/// A write allocates at most one span, and a span has at most 8 pages.
const MAX_SPAN: u64 = 8 * P;

fn run(
    codec: Codec,
    init: (u64, u64, u64),
    backing: [Option<u64>; 2],
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let mut h = Harness::new(codec, [init.0, init.1], init.2, backing);
    for (step, op) in ops.iter().enumerate() {
        h.step(op, step)?;
    }
    h.finish()
}

/// Backing files of a few blocks, so they fill up: device 0 always has
/// one, device 1 half the time.
fn backing() -> impl Strategy<Value = [Option<u64>; 2]> {
    let blocks = || prop_oneof![1..8u64, 8..32u64, 32..=64u64];
    (blocks(), prop_oneof![Just(None), blocks().prop_map(Some)]).prop_map(|(a, b)| [Some(a), b])
}

#[allow(clippy::type_complexity)]
fn case() -> impl Strategy<Value = ((u64, u64, u64), [Option<u64>; 2], Vec<Op>)> {
    (
        (limit_pages(), limit_pages(), limit_pages()),
        backing(),
        prop::collection::vec(op(), 1..300),
    )
}

proptest! {
    // No config override: ProptestConfig::default() reads PROPTEST_CASES.

    #[test]
    fn lz4_matches_model((init, backing, ops) in case()) {
        run(Codec::Lz4, init, backing, ops)?;
    }

    #[test]
    fn zstd_matches_model((init, backing, ops) in case()) {
        run(Codec::Zstd { level: 3 }, init, backing, ops)?;
    }
}
