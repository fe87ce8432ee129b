//! Unix-socket plumbing with file descriptors attached (SCM_RIGHTS): the
//! message guard moves vhost-user messages with it, and the daemon its own
//! process-to-process messages.

use std::io;
use std::mem::size_of;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Most descriptors one message may carry: SET_MEM_TABLE's regions, as
/// many as the `vhost` crate accepts (QEMU sends at most 8).
pub const MAX_FDS: usize = 32;
/// Control buffer for MAX_FDS descriptors, in u64s so it is aligned for
/// cmsghdr: a 16-byte header and 4 bytes per descriptor, with room to spare.
const CONTROL_WORDS: usize = 2 + MAX_FDS / 2 + 2;

/// Reads up to `buf.len()` bytes, appending any descriptors that came with
/// them to `fds`. Returns how many (0 at end of stream), and whether the
/// kernel cut descriptors off (more than [`MAX_FDS`]).
pub fn recv_some(sock: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<(usize, bool)> {
    let mut control = [0u64; CONTROL_WORDS];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; the fields we need are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure size computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<RawFd>()) as u32) } as _;
    debug_assert!(msg.msg_controllen <= std::mem::size_of_val(&control));
    let n = loop {
        // SAFETY: msg points at a live iovec over `buf` and a control buffer
        // of msg_controllen bytes, both owned by this frame.
        let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // Take ownership of every descriptor received first, so that none leaks
    // whatever happens next.
    // SAFETY: msg was filled in by recvmsg; CMSG_FIRSTHDR/NXTHDR walk the
    // control buffer it describes.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: cmsg points at a header inside `control`.
        let c = unsafe { &*cmsg };
        if c.cmsg_level == libc::SOL_SOCKET && c.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: the data of an SCM_RIGHTS message is an array of ints
            // filling cmsg_len minus the header.
            let (data, len) = unsafe { (libc::CMSG_DATA(cmsg), libc::CMSG_LEN(0) as usize) };
            let count = (c.cmsg_len as usize - len) / size_of::<RawFd>();
            for i in 0..count {
                // SAFETY: within the array above; unaligned read is fine.
                let fd = unsafe { (data as *const RawFd).add(i).read_unaligned() };
                // SAFETY: the kernel just installed this descriptor for us.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
        // SAFETY: as above.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    Ok((n, msg.msg_flags & libc::MSG_CTRUNC != 0))
}

/// Waits until `fd` is ready for `events` (POLLIN, POLLOUT); false on
/// timeout. Hang-ups and errors count as ready: the next call reports them.
pub fn wait_fd(fd: RawFd, events: i16, timeout: Option<Duration>) -> io::Result<bool> {
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd owned by this frame.
        let rc = unsafe { libc::poll(&mut p, 1, ms) };
        if rc >= 0 {
            return Ok(rc > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn timed_out(what: &str, t: Duration) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("{what} not done within {t:?}"),
    )
}

/// Fills `buf`, each read waiting at most `timeout`; returns fewer bytes
/// only if the stream ended. `truncated` is set if descriptors were cut off.
pub fn recv_exact(
    sock: RawFd,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    truncated: &mut bool,
    timeout: Duration,
) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        if !wait_fd(sock, libc::POLLIN, Some(timeout))? {
            return Err(timed_out("reading a message", timeout));
        }
        let (n, t) = recv_some(sock, &mut buf[got..], fds)?;
        *truncated |= t;
        if n == 0 {
            break;
        }
        got += n;
    }
    Ok(got)
}

/// Writes all of `bytes` (descriptors on the first byte), each write
/// waiting at most `timeout` for room: a peer that stops reading must not
/// block us for ever.
pub fn send_all(
    sock: RawFd,
    bytes: &[u8],
    raw: &[RawFd],
    timeout: Option<Duration>,
) -> io::Result<()> {
    assert!(raw.len() <= MAX_FDS);
    let mut sent = 0;
    while sent < bytes.len() {
        let mut control = [0u64; CONTROL_WORDS];
        let mut iov = libc::iovec {
            iov_base: bytes[sent..].as_ptr() as *mut libc::c_void,
            iov_len: bytes.len() - sent,
        };
        // SAFETY: msghdr is plain data; the fields we need are set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if sent == 0 && !raw.is_empty() {
            let data_len = std::mem::size_of_val(raw);
            msg.msg_control = control.as_mut_ptr().cast();
            // SAFETY: pure size computation; raw.len() <= MAX_FDS fits `control`.
            msg.msg_controllen = unsafe { libc::CMSG_SPACE(data_len as u32) } as _;
            // SAFETY: msg_control points at `control`, which has room for one
            // header and MAX_FDS descriptors.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(data_len as u32) as _;
                std::ptr::copy_nonoverlapping(
                    raw.as_ptr().cast::<u8>(),
                    libc::CMSG_DATA(c),
                    data_len,
                );
            }
        }
        if let Some(t) = timeout {
            if !wait_fd(sock, libc::POLLOUT, Some(t))? {
                return Err(timed_out("writing a reply", t));
            }
        }
        let flags = libc::MSG_NOSIGNAL
            | if timeout.is_some() {
                libc::MSG_DONTWAIT
            } else {
                0
            };
        // SAFETY: msg describes buffers owned by this frame; MSG_NOSIGNAL
        // turns a closed peer into EPIPE instead of a signal.
        let n = unsafe { libc::sendmsg(sock, &msg, flags) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if matches!(
                e.kind(),
                io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
            ) {
                continue;
            }
            return Err(e);
        }
        sent += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn bytes_and_descriptors_cross_a_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let (keep, _other) = UnixStream::pair().unwrap();
        send_all(a.as_raw_fd(), b"hello", &[keep.as_raw_fd()], None).unwrap();
        assert!(wait_fd(b.as_raw_fd(), libc::POLLIN, Some(Duration::ZERO)).unwrap());
        let mut buf = [0u8; 5];
        let mut fds = Vec::new();
        let mut truncated = false;
        let n = recv_exact(
            b.as_raw_fd(),
            &mut buf,
            &mut fds,
            &mut truncated,
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!((n, &buf, fds.len(), truncated), (5, b"hello", 1, false));
        // Nothing more to read: the wait times out, and a closed peer is
        // the end of the stream.
        assert!(!wait_fd(b.as_raw_fd(), libc::POLLIN, Some(Duration::ZERO)).unwrap());
        drop(a);
        assert_eq!(
            recv_some(b.as_raw_fd(), &mut buf, &mut fds).unwrap(),
            (0, false)
        );
    }
}
