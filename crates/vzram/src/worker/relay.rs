//! The relay: every message between the frontend and the `vhost` crate's
//! handler passes the guard here, and what the rings are doing is read off
//! them on the way (a migration sender's "quiet").

use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

use vhost::vhost_user::Listener;
use vzram_blk::guard::{self, Guard, Message, Received};

use crate::sys::socket::sockaddr_un;

/// How long a frontend may take to finish a message it has started.
const MESSAGE_WAIT: Duration = Duration::from_secs(5);

/// Which rings the frontend has started and not stopped, as the relay sees
/// its messages: a sender's "quiet". A ring is stopped once the handler has
/// answered its GET_VRING_BASE (it drains what it holds first).
#[derive(Default)]
pub struct Rings {
    pub disconnected: std::sync::atomic::AtomicBool,
    active: std::sync::atomic::AtomicU64,
    stopping: std::sync::atomic::AtomicU64,
    /// Rings started (SET_VRING_KICK) so far.
    starts: std::sync::atomic::AtomicU64,
}

impl Rings {
    /// How many times a ring was started.
    pub fn starts(&self) -> u64 {
        self.starts.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The frontend has gone.
    pub fn gone(&self) -> bool {
        self.disconnected.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Nothing can write: no frontend, or no ring running.
    pub fn quiet(&self) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        self.disconnected.load(SeqCst) || self.active.load(SeqCst) == 0
    }

    fn message(&self, m: &Message) {
        use std::sync::atomic::Ordering::SeqCst;
        let index = |n: usize| {
            m.payload
                .get(..n)
                .map(|b| b.iter().rev().fold(0u64, |a, &x| a << 8 | u64::from(x)))
        };
        match m.header.code {
            guard::code::SET_VRING_KICK => {
                if let Some(i) = index(8).map(|v| v & 0xff).filter(|&i| i < 64) {
                    self.starts.fetch_add(1, SeqCst);
                    self.active.fetch_or(1 << i, SeqCst);
                }
            }
            guard::code::GET_VRING_BASE => {
                if let Some(i) = index(4).filter(|&i| i < 64) {
                    self.stopping.fetch_or(1 << i, SeqCst);
                }
            }
            _ => {}
        }
    }

    /// The handler answered: the rings asked to stop are stopped.
    fn replied(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        let s = self.stopping.swap(0, SeqCst);
        if s != 0 {
            self.active.fetch_and(!s, SeqCst);
        }
    }
}

/// The socket the `vhost` crate accepts from. Only this worker connects to
/// it, through `/proc/self/fd`: its file is unlinked before it listens.
pub struct InnerSocket {
    pub listener: Listener,
    path: PathBuf,
    _file: OwnedFd,
}

impl InnerSocket {
    pub fn new() -> io::Result<InnerSocket> {
        let mut dir = std::env::temp_dir();
        let name = format!(".vzram-w{}-{:x}", std::process::id(), nanos());
        if dir.join(&name).as_os_str().len() > 100 {
            dir = PathBuf::from("/tmp");
        }
        let path = dir.join(name);
        // SAFETY: a new socket; its result is checked.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: we own the descriptor just created.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        let addr = sockaddr_un(&path)?;
        // SAFETY: addr is a valid sockaddr_un of the given length.
        let rc = unsafe {
            libc::bind(
                sock.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH)
            .open(&path);
        let _ = std::fs::remove_file(&path);
        let file: OwnedFd = file?.into();
        // Listening starts only now that the name is gone.
        // SAFETY: a bound socket we own.
        if unsafe { libc::listen(sock.as_raw_fd(), 1) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(InnerSocket {
            listener: Listener::from(UnixListener::from(sock)),
            path: PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd())),
            _file: file,
        })
    }

    pub fn connect(&self) -> io::Result<UnixStream> {
        UnixStream::connect(&self.path)
    }
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// Reads one frontend message through the guard; None when the frontend
/// is gone or was refused (logged here).
pub fn guarded_recv(frontend: &UnixStream, guard: &mut Guard) -> Option<Message> {
    match guard::recv_message(frontend, guard, MESSAGE_WAIT) {
        Ok(Received::Message(m)) => Some(m),
        Ok(Received::Closed) => None,
        Ok(Received::Refused(r)) => {
            tracing::warn!("refused a frontend message and closed the connection: {r}");
            None
        }
        Err(e) => {
            tracing::info!("frontend connection: {e}");
            None
        }
    }
}

/// Moves messages both ways until either side closes; returns why it ended.
pub fn relay(
    frontend: &UnixStream,
    to_crate: &UnixStream,
    guard: &mut Guard,
    first: Message,
    rings: &Rings,
) -> &'static str {
    rings.message(&first);
    if guard::send_message(to_crate, &first).is_err() {
        return "handler gone";
    }
    drop(first);
    let mut buf = [0u8; guard::MAX_PAYLOAD + guard::HEADER_LEN];
    loop {
        let mut p = [frontend.as_raw_fd(), to_crate.as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: two pollfds we own for the whole call.
        let rc = unsafe { libc::poll(p.as_mut_ptr(), 2, -1) };
        if rc < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return "poll failed";
        }
        if p[1].revents != 0 {
            // Replies carry no descriptors for the features we offer.
            match (&*to_crate).read(&mut buf) {
                Ok(0) | Err(_) => return "handler closed the connection",
                Ok(n) => {
                    rings.replied();
                    if guard::send_all(frontend.as_raw_fd(), &buf[..n], &[], Some(MESSAGE_WAIT))
                        .is_err()
                    {
                        return "frontend stopped reading";
                    }
                }
            }
        }
        if p[0].revents != 0 {
            match guarded_recv(frontend, guard) {
                Some(m) => {
                    rings.message(&m);
                    if guard::send_message(to_crate, &m).is_err() {
                        return "handler closed the connection";
                    }
                }
                None => return "frontend closed or refused",
            }
        }
    }
}
