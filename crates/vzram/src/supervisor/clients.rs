//! Bounded client connections, for the control socket and `/metrics`.
//!
//! One epoll thread reads and writes every connection without blocking.
//! Quick requests (`stat`, a scrape) are answered on it; requests that may
//! wait (an `add`, a `migrate`) go to a pool of threads, a few kept and more
//! started while all are busy, one per client at most. A cap bounds the
//! connections, a deadline bounds each one, and a full descriptor table
//! pauses accepting for a moment instead of spinning on `accept`.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::sys::epoll::{EventSet, Poller, Tag};

/// How long accepting pauses after the process ran out of descriptors.
pub const FULL_PAUSE: Duration = Duration::from_millis(200);
/// How long a pool thread beyond the kept ones waits for work.
const SPARE_IDLE: Duration = Duration::from_secs(30);
/// Most connections accepted per wake-up, so that a flood of connects
/// cannot starve the connections already open.
const ACCEPT_BATCH: usize = 64;
/// Most long requests at once, outside the client cap; more count
/// against it, as any request does.
const MAX_LONG: usize = 1024;

/// Where the next request in a connection's input ends.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    /// No whole request yet.
    Need,
    /// A request of this many bytes (its terminator included).
    Request(usize),
    /// Longer than the protocol accepts.
    TooLong,
}

/// What a connection is sent for one request.
pub struct Reply {
    pub bytes: Vec<u8>,
    /// Close once it is sent (HTTP without keep-alive, a fatal error).
    pub close: bool,
}

/// One protocol served over bounded connections.
pub trait Protocol: Send + Sync + 'static {
    /// A parsed request.
    type Req: Send + 'static;
    /// For logs: "control", "metrics".
    const NAME: &'static str;
    fn frame(&self, buf: &[u8]) -> Frame;
    fn parse(&self, bytes: &[u8]) -> Self::Req;
    /// Whether `req` is answered on the loop: it takes no lock that is
    /// held for long and waits on nothing.
    fn quick(&self, req: &Self::Req) -> bool;
    fn answer(&self, req: Self::Req) -> Reply;
    /// Whether `req` may run for hours (a migration's send): it gets a
    /// thread of its own and does not count against the client cap, so
    /// that it never crowds out the requests that watch or steer it.
    fn long(&self, _req: &Self::Req) -> bool {
        false
    }
    /// Answers a long request; `gone` says whether its client hung up.
    fn answer_long(&self, req: Self::Req, _gone: &(dyn Fn() -> bool + Sync)) -> Reply {
        self.answer(req)
    }
    /// The reply to a request longer than [`Protocol::frame`] accepts.
    fn too_long(&self) -> Reply;
    /// What a client is told when it is closed without an answer: refused
    /// (every slot is busy) or evicted (it was the longest idle).
    fn closing(&self, why: &str) -> Vec<u8>;
}

/// How many clients, for how long.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_clients: usize,
    pub timeout: Timeout,
    /// Threads kept for requests that are not quick (0: answer all on the
    /// loop). While every one is busy another starts, up to one per
    /// client; those beyond this many end after [`SPARE_IDLE`] unused.
    pub pool: usize,
}

/// When a connection that is not waiting for an answer is closed.
#[derive(Debug, Clone, Copy)]
pub enum Timeout {
    /// After this long with nothing read or written.
    Idle(Duration),
    /// This long after it was accepted, whatever it does.
    Whole(Duration),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tok {
    Listener,
    Wake,
    Conn(u64),
}

impl Tag for Tok {
    fn encode(self) -> u64 {
        match self {
            Tok::Listener => u64::MAX,
            Tok::Wake => u64::MAX - 1,
            Tok::Conn(id) => id,
        }
    }

    fn decode(v: u64) -> Tok {
        match v {
            u64::MAX => Tok::Listener,
            v if v == u64::MAX - 1 => Tok::Wake,
            id => Tok::Conn(id),
        }
    }
}

struct Conn {
    fd: OwnedFd,
    input: Vec<u8>,
    out: Vec<u8>,
    sent: usize,
    /// A request is with the pool: no deadline, nothing read meanwhile.
    busy: bool,
    /// That request is a long one, on a thread of its own: the connection
    /// does not count against the cap meanwhile.
    long: bool,
    /// The client sent its last byte.
    eof: bool,
    /// Close once `out` is sent.
    close_after: bool,
    deadline: Instant,
    /// Last read or write, for choosing whom to evict.
    active: Instant,
    watching: EventSet,
}

impl Conn {
    fn idle(&self) -> bool {
        !self.busy && self.sent == self.out.len()
    }

    /// What epoll should report for it now.
    fn interest(&self) -> EventSet {
        if self.sent < self.out.len() {
            EventSet::OUT
        } else if self.busy || self.eof || self.close_after {
            EventSet::empty()
        } else {
            EventSet::IN
        }
    }
}

/// Requests for the pool, and its answers for the loop.
struct Pool<P: Protocol> {
    jobs: Mutex<Jobs<P>>,
    ready: Condvar,
    done: Mutex<Vec<(u64, Reply)>>,
    wake: EventFd,
}

struct Jobs<P: Protocol> {
    queue: VecDeque<(u64, P::Req)>,
    threads: usize,
    idle: usize,
}

impl<P: Protocol> Pool<P> {
    /// Queues a request; starts a thread if none is free (there are never
    /// more threads than clients, as each has one request at a time).
    fn push(self: &Arc<Self>, proto: &Arc<P>, id: u64, req: P::Req, limits: &Limits) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.queue.push_back((id, req));
        if jobs.idle >= jobs.queue.len() || jobs.threads >= limits.max_clients {
            drop(jobs);
            self.ready.notify_one();
            return;
        }
        let spare = jobs.threads >= limits.pool;
        jobs.threads += 1;
        drop(jobs);
        let (pool, proto) = (self.clone(), proto.clone());
        let started = std::thread::Builder::new()
            .name(format!("{}-pool", P::NAME))
            .spawn(move || pool.work(&proto, spare));
        if let Err(e) = started {
            // The threads there are take it in turn.
            tracing::warn!("{}: cannot start a thread: {e}", P::NAME);
            self.jobs.lock().unwrap_or_else(|e| e.into_inner()).threads -= 1;
            self.ready.notify_one();
        }
    }

    /// Runs a long request on a thread of its own, told whether its
    /// client (`fd`, a copy of its socket) hung up.
    fn push_long(self: &Arc<Self>, proto: &Arc<P>, id: u64, req: P::Req, fd: OwnedFd) {
        let (pool, p) = (self.clone(), proto.clone());
        let started = std::thread::Builder::new()
            .name(format!("{}-long", P::NAME))
            .spawn(move || {
                let reply = p.answer_long(req, &|| hung_up(&fd));
                pool.finished(id, reply);
            });
        if let Err(e) = started {
            tracing::warn!("{}: cannot start a thread: {e}", P::NAME);
            self.finished(
                id,
                Reply {
                    bytes: proto.closing(&format!("refused: no thread for the request ({e})")),
                    close: true,
                },
            );
        }
    }

    fn finished(&self, id: u64, reply: Reply) {
        self.done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, reply));
        // Only fails when the counter is full, and then a wake-up is due.
        let _ = self.wake.write(1);
    }

    fn work(&self, proto: &P, spare: bool) {
        loop {
            let (id, req) = {
                let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(j) = jobs.queue.pop_front() {
                        break j;
                    }
                    jobs.idle += 1;
                    let (j, timeout) = if spare {
                        let (j, t) = self
                            .ready
                            .wait_timeout(jobs, SPARE_IDLE)
                            .unwrap_or_else(|e| e.into_inner());
                        (j, t.timed_out())
                    } else {
                        (
                            self.ready.wait(jobs).unwrap_or_else(|e| e.into_inner()),
                            false,
                        )
                    };
                    jobs = j;
                    jobs.idle -= 1;
                    if timeout && jobs.queue.is_empty() {
                        jobs.threads -= 1;
                        return;
                    }
                }
            };
            let reply = proto.answer(req);
            self.finished(id, reply);
        }
    }
}

/// Whether the client on `fd` has closed its end (a half-close, its
/// request sent, is not a hang-up).
fn hung_up(fd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: 0,
        revents: 0,
    };
    // SAFETY: one pollfd of ours, valid for the call; no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR) != 0
}

/// Serves `listener` (a listening socket, unix or TCP) for ever; returns
/// only if epoll itself fails.
pub fn serve<P: Protocol>(listener: OwnedFd, proto: Arc<P>, limits: Limits) -> io::Result<()> {
    set_nonblocking(listener.as_raw_fd())?;
    let pool = Arc::new(Pool::<P> {
        jobs: Mutex::new(Jobs {
            queue: VecDeque::new(),
            threads: 0,
            idle: 0,
        }),
        ready: Condvar::new(),
        done: Mutex::new(Vec::new()),
        wake: EventFd::new(EFD_NONBLOCK)?,
    });
    let mut server = Server {
        ep: Poller::new()?,
        listener,
        proto,
        limits,
        pool,
        conns: HashMap::new(),
        next_id: 0,
        paused_until: None,
        full_logged: false,
        turned_away: 0,
        turned_away_logged: None,
    };
    server.run()
}

struct Server<P: Protocol> {
    ep: Poller<Tok>,
    listener: OwnedFd,
    proto: Arc<P>,
    limits: Limits,
    pool: Arc<Pool<P>>,
    conns: HashMap<u64, Conn>,
    next_id: u64,
    /// Accepting is paused (out of descriptors) until then.
    paused_until: Option<Instant>,
    /// Whether this run of full descriptor tables was logged.
    full_logged: bool,
    /// Clients refused or evicted at the cap, and when that was last logged.
    turned_away: u64,
    turned_away_logged: Option<Instant>,
}

impl<P: Protocol> Server<P> {
    fn run(&mut self) -> io::Result<()> {
        self.ep
            .add(self.listener.as_raw_fd(), Tok::Listener, EventSet::IN)?;
        self.ep
            .add(self.pool.wake.as_raw_fd(), Tok::Wake, EventSet::IN)?;
        loop {
            let timeout = self.next_timeout();
            for t in self.ep.wait(timeout)? {
                match t {
                    Tok::Listener => self.accept()?,
                    Tok::Wake => self.answered(),
                    Tok::Conn(id) => self.on_conn(id),
                }
            }
            self.on_timers()?;
        }
    }

    /// Milliseconds to the nearest deadline, or -1 if none.
    fn next_timeout(&self) -> i32 {
        let next = self
            .conns
            .values()
            .filter(|c| !c.busy)
            .map(|c| c.deadline)
            .chain(self.paused_until)
            .min();
        match next {
            None => -1,
            Some(t) => {
                let left = t.saturating_duration_since(Instant::now());
                // Round up, so that the loop does not wake just before.
                (left.as_micros().div_ceil(1000)).min(i32::MAX as u128) as i32
            }
        }
    }

    fn on_timers(&mut self) -> io::Result<()> {
        let now = Instant::now();
        if self.paused_until.is_some_and(|t| now >= t) {
            self.paused_until = None;
            self.ep
                .modify(self.listener.as_raw_fd(), Tok::Listener, EventSet::IN)?;
        }
        let late: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| !c.busy && now >= c.deadline)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            tracing::debug!("{} client timed out", P::NAME);
            self.close(id);
        }
        Ok(())
    }

    fn accept(&mut self) -> io::Result<()> {
        for _ in 0..ACCEPT_BATCH {
            // SAFETY: accept4 on our listening socket with no address
            // buffers; a descriptor it returns is ours alone.
            let fd = unsafe {
                libc::accept4(
                    self.listener.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                )
            };
            if fd < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EAGAIN) => return Ok(()),
                    Some(libc::EINTR | libc::ECONNABORTED | libc::EPROTO) => continue,
                    _ => return self.pause(e),
                }
            }
            // SAFETY: accept4 just returned this descriptor to us.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            if self.full_logged {
                tracing::info!("{}: descriptors are free again; accepting", P::NAME);
                self.full_logged = false;
            }
            self.admit(fd)?;
        }
        Ok(())
    }

    /// Stops watching the listener for a moment: a level-triggered epoll
    /// would report the waiting connection again at once, for ever.
    fn pause(&mut self, e: io::Error) -> io::Result<()> {
        if !self.full_logged {
            tracing::warn!(
                "{} socket accept: {e}; not accepting for {FULL_PAUSE:?} at a time until it succeeds",
                P::NAME
            );
            self.full_logged = true;
        }
        self.paused_until = Some(Instant::now() + FULL_PAUSE);
        self.ep
            .modify(self.listener.as_raw_fd(), Tok::Listener, EventSet::empty())
    }

    /// Takes a new client in; at the cap, the longest-idle client that is
    /// owed nothing gives way, or if every one is owed something, the
    /// newcomer is refused.
    fn admit(&mut self, fd: OwnedFd) -> io::Result<()> {
        let counted = self.conns.values().filter(|c| !c.long).count();
        if counted >= self.limits.max_clients {
            let oldest = self
                .conns
                .iter()
                .filter(|(_, c)| c.idle())
                .min_by_key(|(_, c)| c.active)
                .map(|(id, _)| *id);
            self.turned_away();
            match oldest {
                Some(id) => {
                    if let Some(c) = self.conns.get(&id) {
                        let msg = self.proto.closing(&format!(
                            "closed: {} clients are connected and this one was the longest idle",
                            self.limits.max_clients
                        ));
                        send_once(c.fd.as_raw_fd(), &msg);
                    }
                    self.close(id);
                }
                None => {
                    let msg = self.proto.closing(&format!(
                        "refused: {} clients are connected and each is being answered; try again",
                        self.limits.max_clients
                    ));
                    send_once(fd.as_raw_fd(), &msg);
                    return Ok(());
                }
            }
        }
        let now = Instant::now();
        let id = self.next_id;
        self.next_id += 1;
        let deadline = match self.limits.timeout {
            Timeout::Idle(d) | Timeout::Whole(d) => now + d,
        };
        self.ep.add(fd.as_raw_fd(), Tok::Conn(id), EventSet::IN)?;
        self.conns.insert(
            id,
            Conn {
                fd,
                input: Vec::new(),
                out: Vec::new(),
                sent: 0,
                busy: false,
                long: false,
                eof: false,
                close_after: false,
                deadline,
                active: now,
                watching: EventSet::IN,
            },
        );
        Ok(())
    }

    /// Logs clients turned away at the cap: the first, then at most once a
    /// minute with the count.
    fn turned_away(&mut self) {
        self.turned_away += 1;
        let due = self
            .turned_away_logged
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(60));
        if due {
            tracing::warn!(
                "{}: {} clients connected, the most allowed: the longest idle gives way to a newcomer, or the newcomer is refused if none is idle ({} so far)",
                P::NAME,
                self.limits.max_clients,
                self.turned_away,
            );
            self.turned_away_logged = Some(Instant::now());
        }
    }

    fn on_conn(&mut self, id: u64) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        // Nothing is watched while the pool answers, so this is a hang-up
        // or an error, which epoll reports regardless (level-triggered:
        // again and again until the descriptor goes).
        let broken = if c.watching.is_empty() {
            true
        } else if c.sent < c.out.len() {
            flush(c).is_err()
        } else {
            read_some(c).is_err()
        };
        if broken {
            self.close(id);
            return;
        }
        self.advance(id);
    }

    /// Answers what it can of a connection's input, sends what it can, and
    /// closes it or sets what it waits for next.
    fn advance(&mut self, id: u64) {
        loop {
            let Some(c) = self.conns.get_mut(&id) else {
                return;
            };
            if c.sent < c.out.len() {
                if flush(c).is_err() {
                    break self.close(id);
                }
                if c.sent < c.out.len() {
                    break self.rearm(id);
                }
            }
            c.out.clear();
            c.sent = 0;
            if c.close_after {
                break self.close(id);
            }
            if c.busy {
                break self.rearm(id);
            }
            let n = match self.proto.frame(&c.input) {
                Frame::Need if c.eof => break self.close(id),
                Frame::Need => break self.rearm(id),
                Frame::TooLong => {
                    let r = self.proto.too_long();
                    c.out = r.bytes;
                    c.close_after = true;
                    continue;
                }
                Frame::Request(n) => n,
            };
            let bytes: Vec<u8> = c.input.drain(..n.min(c.input.len())).collect();
            let req = self.proto.parse(&bytes);
            let longs = self.conns.values().filter(|c| c.long).count();
            let Some(c) = self.conns.get_mut(&id) else {
                return;
            };
            if self.limits.pool > 0 && longs < MAX_LONG && self.proto.long(&req) {
                if let Ok(fd) = c.fd.try_clone() {
                    c.busy = true;
                    c.long = true;
                    self.pool.push_long(&self.proto, id, req, fd);
                    continue;
                }
            }
            if self.limits.pool > 0 && !self.proto.quick(&req) {
                c.busy = true;
                self.pool.push(&self.proto, id, req, &self.limits);
                continue;
            }
            let r = self.proto.answer(req);
            self.reply(id, r);
        }
    }

    /// Queues a reply on a connection (flushed by the caller's loop).
    fn reply(&mut self, id: u64, r: Reply) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        c.out = r.bytes;
        c.sent = 0;
        c.close_after |= r.close;
        c.busy = false;
        c.long = false;
        c.active = Instant::now();
        if let Timeout::Idle(d) = self.limits.timeout {
            c.deadline = c.active + d;
        }
    }

    /// The pool's answers.
    fn answered(&mut self) {
        let _ = self.pool.wake.read();
        let done = std::mem::take(&mut *self.pool.done.lock().unwrap_or_else(|e| e.into_inner()));
        for (id, r) in done {
            // A client that timed out or was closed meanwhile is gone.
            if self.conns.contains_key(&id) {
                self.reply(id, r);
                self.advance(id);
            }
        }
    }

    fn rearm(&mut self, id: u64) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let want = c.interest();
        if want != c.watching {
            if self
                .ep
                .modify(c.fd.as_raw_fd(), Tok::Conn(id), want)
                .is_err()
            {
                return self.close(id);
            }
            c.watching = want;
        }
    }

    fn close(&mut self, id: u64) {
        if let Some(c) = self.conns.remove(&id) {
            let _ = self.ep.delete(c.fd.as_raw_fd());
            // SAFETY: shutdown on a socket we own; it only ends the stream,
            // so that the client sees EOF after the last reply.
            unsafe { libc::shutdown(c.fd.as_raw_fd(), libc::SHUT_WR) };
            if c.busy {
                // Its answer, when it comes, is dropped in `answered`.
                tracing::debug!("{} client closed while it was being answered", P::NAME);
            }
        }
    }
}

/// Reads what is there (up to the frame limit the protocol applies);
/// Err when the connection is broken.
fn read_some(c: &mut Conn) -> io::Result<()> {
    let mut buf = [0u8; 16 * 1024];
    loop {
        // SAFETY: recv into a buffer owned by this frame, at most its length.
        let n = unsafe {
            libc::recv(
                c.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => {
                c.eof = true;
                return Ok(());
            }
            n if n > 0 => {
                c.input.extend_from_slice(&buf[..n as usize]);
                c.active = Instant::now();
                // One buffer's worth per wake-up: a client that streams
                // cannot keep the loop to itself, and the protocol's frame
                // limit is checked before the next read.
                return Ok(());
            }
            _ => {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => {}
                    io::ErrorKind::WouldBlock => return Ok(()),
                    _ => return Err(e),
                }
            }
        }
    }
}

/// Sends what the socket takes of `c.out`; Err when it is broken.
fn flush(c: &mut Conn) -> io::Result<()> {
    while c.sent < c.out.len() {
        let rest = &c.out[c.sent..];
        // SAFETY: send from a buffer owned by `c`, at most its length;
        // MSG_NOSIGNAL turns a gone peer into EPIPE, not SIGPIPE.
        let n = unsafe {
            libc::send(
                c.fd.as_raw_fd(),
                rest.as_ptr().cast(),
                rest.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n > 0 {
            c.sent += n as usize;
            c.active = Instant::now();
            continue;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => {}
            io::ErrorKind::WouldBlock => return Ok(()),
            _ => return Err(e),
        }
    }
    Ok(())
}

/// Best effort: what fits in the socket now, never a wait.
fn send_once(fd: RawFd, msg: &[u8]) {
    // SAFETY: send from a slice borrowed for the call, at most its length.
    unsafe {
        libc::send(
            fd,
            msg.as_ptr().cast(),
            msg.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns; F_GETFL/F_SETFL only
    // read and set its status flags.
    let rc = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 {
            flags
        } else {
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
        }
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip() {
        for t in [Tok::Listener, Tok::Wake, Tok::Conn(0), Tok::Conn(1 << 40)] {
            assert_eq!(Tok::decode(t.encode()), t);
        }
    }
}
