//! Messages between the daemon's processes: JSON, one per
//! `SOCK_SEQPACKET` datagram, with descriptors as `SCM_RIGHTS`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use serde::{de::DeserializeOwned, Serialize};

/// Where the launcher and each worker find their inherited descriptors.
pub const FIRST_FD: RawFd = 3;

/// The biggest message either side sends.
const MAX_MESSAGE: usize = 64 << 10;

/// A connected `SOCK_SEQPACKET` pair, close-on-exec.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: socketpair fills the two ints we own; checked below.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created for us.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Sends one message with descriptors.
pub fn send(sock: &impl AsRawFd, msg: &impl Serialize, fds: &[RawFd]) -> io::Result<()> {
    let bytes = serde_json::to_vec(msg).map_err(io::Error::other)?;
    vzram_blk::guard::send_all(sock.as_raw_fd(), &bytes, fds, None)
}

/// Receives one message and its descriptors; None once the peer is gone.
pub fn recv<T: DeserializeOwned>(sock: &impl AsRawFd) -> io::Result<Option<(T, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut fds = Vec::new();
    let (n, _) = vzram_blk::guard::recv_some(sock.as_raw_fd(), &mut buf, &mut fds)?;
    if n == 0 {
        return Ok(None);
    }
    let msg = serde_json::from_slice(&buf[..n]).map_err(io::Error::other)?;
    Ok(Some((msg, fds)))
}
