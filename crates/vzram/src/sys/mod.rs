//! Operating-system plumbing shared by the daemon's processes: sockets,
//! epoll, signals, descriptors, logging, the seccomp sandbox, sockets
//! passed in by systemd, and the service manager's notify socket.

pub mod epoll;
pub mod fault;
pub mod fds;
pub mod listen;
pub mod logging;
pub mod notify;
pub mod panic;
pub mod seccomp;
pub mod signals;
pub mod socket;
