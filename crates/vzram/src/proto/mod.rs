//! What crosses a process boundary, typed end to end: the framing
//! ([`wire`]), supervisor ↔ launcher ([`launch`]), supervisor ↔ worker
//! ([`order`], [`worker_spec`]), the control socket ([`control`]),
//! migration addresses ([`addr`]) and their TLS credentials ([`tls`]). Nothing here
//! depends on the rest of the crate, so each process reads the same definitions.

pub mod addr;
pub mod codec;
pub mod control;
pub mod launch;
pub mod order;
pub mod tls;
pub mod wire;
pub mod worker_spec;

/// This build's version: logged at start, in every control reply
/// ([`control::Head`]) and in `/metrics` as `vzram_build_info`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
