//! Descriptor chains over fake guest memory through the queue threads' own
//! drain loop (`vzram_blk::drain_queue`), parsing, execution and the page
//! store. The harness and its checks live in
//! `crates/vzram-blk/tests/fuzz_harness/` (entry `mod.rs`), shared with the
//! corpus replay test that runs on every `cargo test`.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/vzram-blk/tests/fuzz_harness/mod.rs"]
mod harness;

fuzz_target!(|data: &[u8]| {
    harness::run(data);
});
