//! What runs wherever a device is owned: in its worker while a frontend
//! is connected, in the supervisor when it has none. Orders are carried
//! out here ([`execute`]), migrations run here ([`migration`]), and the
//! background tiering a worker runs ([`autotier`]).

pub mod attach;
pub mod autotier;
pub mod commit;
pub mod execute;
pub mod migration;
pub mod placement;
pub mod tls;
