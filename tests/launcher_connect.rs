//! A migration destination that never answers holds up only the migration:
//! the launcher keeps starting workers (a frontend that reconnects is
//! served, `vzram add` succeeds) while the connect waits, and the migrate
//! fails after its deadline with the device's pages all kept.

use std::net::TcpListener;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use vzram_tests::*;

const PAGES: u64 = 64;

fn dev(sock: &Path, name: &str) -> String {
    format!("socket={},size=16M,queues=1,name={name}", s(sock))
}

/// Lowers a listener's backlog to 0 (one pending connection at most).
fn backlog_zero(fd: &impl AsRawFd) {
    // SAFETY: listen() again on our own listening socket only changes its
    // backlog.
    assert_eq!(unsafe { libc::listen(fd.as_raw_fd(), 0) }, 0);
}

/// Non-blocking connects to `addr` until one would block (or 16 are
/// made); they stay open, filling the listener's backlog.
fn fill(family: libc::c_int, addr: *const libc::sockaddr, len: libc::socklen_t) -> Vec<OwnedFd> {
    let mut held = Vec::new();
    for _ in 0..16 {
        // SAFETY: a new socket, owned at once.
        let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0) };
        assert!(fd >= 0);
        // SAFETY: as above.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: `addr` points to `len` bytes of a socket address.
        let rc = unsafe { libc::connect(fd.as_raw_fd(), addr, len) };
        let errno = std::io::Error::last_os_error().raw_os_error();
        held.push(fd);
        if rc != 0 && matches!(errno, Some(libc::EAGAIN) | Some(libc::EINPROGRESS)) {
            return held;
        }
        assert_eq!(rc, 0, "connect: {errno:?}");
    }
    panic!("the backlog never filled");
}

fn unix_addr(path: &Path) -> libc::sockaddr_un {
    // SAFETY: plain data.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, b) in a.sun_path.iter_mut().zip(s(path).bytes()) {
        *d = b as libc::c_char;
    }
    a
}

/// A unix listener that never accepts, with a full backlog: one more
/// connect waits.
fn full_unix(path: &Path) -> (UnixListener, Vec<OwnedFd>) {
    let l = UnixListener::bind(path).unwrap();
    backlog_zero(&l);
    let a = unix_addr(path);
    let held = fill(
        libc::AF_UNIX,
        std::ptr::addr_of!(a).cast(),
        std::mem::size_of_val(&a) as libc::socklen_t,
    );
    (l, held)
}

/// A TCP listener on 127.0.0.1 that never accepts, with a full accept
/// queue: the kernel drops further SYNs, so a connect hangs until its
/// timeout.
fn full_tcp() -> (TcpListener, u16, Vec<OwnedFd>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    backlog_zero(&l);
    let port = l.local_addr().unwrap().port();
    // SAFETY: plain data.
    let mut a: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    a.sin_family = libc::AF_INET as libc::sa_family_t;
    a.sin_port = port.to_be();
    a.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
    let p = std::ptr::addr_of!(a).cast();
    let n = std::mem::size_of_val(&a) as libc::socklen_t;
    let mut held = fill(libc::AF_INET, p, n);
    // Let the handshakes finish, so that the accept queue is full, then
    // one more whose SYN is dropped.
    std::thread::sleep(Duration::from_millis(200));
    held.extend(fill(libc::AF_INET, p, n));
    (l, port, held)
}

/// Connects to `sock`, writes a page and reads it back, on a thread; the
/// time it took, or None if not done within `limit` (the thread is left
/// to end with the daemon).
fn served_within(sock: &Path, seed: u64, limit: Duration) -> Option<Duration> {
    let (tx, rx) = mpsc::channel();
    let path = sock.to_path_buf();
    std::thread::spawn(move || {
        let t = Instant::now();
        let r = Client::connect(&path, 1)
            .map_err(|e| e.to_string())
            .and_then(|mut c| {
                c.q(0)
                    .write(0, &pattern(seed, 0, PAGE))
                    .map_err(|e| format!("write: {e}"))?;
                let got = c.q(0).read(0, PAGE).map_err(|e| format!("read: {e}"))?;
                if got != pattern(seed, 0, PAGE) {
                    return Err("read back other data".into());
                }
                Ok(t.elapsed())
            });
        let _ = tx.send(r);
    });
    match rx.recv_timeout(limit) {
        Ok(r) => Some(r.unwrap_or_else(|e| panic!("{}: {e}", sock.display()))),
        Err(_) => None,
    }
}

struct Setup {
    dir: TempDir,
    d: Daemon,
    a: PathBuf,
    b: PathBuf,
}

fn setup(tag: &str) -> Setup {
    setup_with(tag, false)
}

/// [`setup`]; with `tls`, the daemon has client credentials (a migration
/// on `tcp:` is mutual TLS, refused without them).
fn setup_with(tag: &str, tls: bool) -> Setup {
    let dir = TempDir::new(tag);
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    let (da, db) = (dev(&a, "a"), dev(&b, "b"));
    let mut args = vec!["--device", da.as_str(), "--device", db.as_str()];
    let creds = tls.then(|| vzram_tests::pki::pki(&dir, "lc").source);
    if let Some(c) = &creds {
        args.extend(["--tls-creds", s(c)]);
    }
    let d = Daemon::start(&dir, &args, &[&a, &b]);
    Setup { dir, d, a, b }
}

/// While `vzram migrate a --to <to>` waits on a destination that never
/// answers: b's frontend goes away and comes back and is served, and a
/// device is added and served, all before that connect's 10 s deadline
/// (a launcher the connect held would serve them only after it). Then the
/// migrate fails, having waited about its deadline, and a holds all its
/// pages.
fn launcher_free_while_connecting(st: &mut Setup, to: &str) {
    let mut ca = Client::connect(&st.a, 1).unwrap();
    for i in 0..PAGES {
        ca.q(0)
            .write(i * PAGE as u64, &versioned_page_nonzero(i, 1))
            .unwrap();
    }
    // b's frontend serves a while (a worker that served nothing, or less
    // than a second, would make its successor wait).
    let mut cb = Client::connect(&st.b, 1).unwrap();
    cb.q(0).write(0, &versioned_page_nonzero(0, 2)).unwrap();
    let t0 = Instant::now();
    let m = Vzram::new(&["migrate", "--device", "a", "--to", to])
        .control(&st.d.control)
        .spawn();
    // Long enough for the connect to be under way, and for b's worker to
    // have been worth its start.
    std::thread::sleep(Duration::from_millis(1100));

    // The connect began after t0 and waits 10 s.
    let connecting_until = t0 + Duration::from_secs(9);
    let left = || {
        connecting_until
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    drop(cb);
    let took = served_within(&st.b, 2, left());
    assert!(
        took.is_some(),
        "b's frontend reconnected and was not served while the migration connects\n{}",
        st.d.log_text()
    );
    eprintln!("b served again in {:?}", took.unwrap());

    let c = st.dir.join("c.sock");
    let t = Instant::now();
    let add = Vzram::new(&["add", "--device", &dev(&c, "c")])
        .control(&st.d.control)
        .spawn()
        .finish(left())
        .unwrap_or_else(|| {
            panic!(
                "vzram add did not finish while the migration connects\n{}",
                st.d.log_text()
            )
        });
    assert!(add.status.success(), "vzram add: {}", said(&add));
    eprintln!("vzram add took {:?}", t.elapsed());
    assert!(
        served_within(&c, 3, left()).is_some(),
        "the added device is not served while the migration connects"
    );

    let out = m
        .finish(Duration::from_secs(20))
        .expect("the migrate still runs after 20 s");
    let waited = t0.elapsed();
    eprintln!("migrate failed after {waited:?}: {}", said(&out));
    assert!(!out.status.success(), "{}", said(&out));
    assert!(
        said(&out).contains("cannot connect to") && said(&out).contains("no connection within"),
        "{}",
        said(&out)
    );
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(14),
        "the migrate gave up after {waited:?}, not its 10 s deadline"
    );
    for i in 0..PAGES {
        let got = ca.q(0).read(i * PAGE as u64, PAGE).unwrap();
        assert!(got == versioned_page_nonzero(i, 1), "page {i} of a differs");
    }
    drop(ca);
    let mut ca = Client::connect_retrying(&st.a, 1, &st.d);
    assert_eq!(
        ca.q(0).read(0, PAGE).unwrap(),
        versioned_page_nonzero(0, 1),
        "a's pages after reconnecting"
    );
    // The connecting helper is gone (reaped, not left a zombie).
    let helpers: Vec<u32> = process_tree(st.d.pid())
        .into_iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.trim() == "vzram-connect")
        })
        .collect();
    assert!(helpers.is_empty(), "connecting helpers left: {helpers:?}");
}

#[test]
fn a_full_backlog_migration_target_while_another_device_reconnects() {
    let mut st = setup("lc-unix");
    let target = st.dir.join("target.sock");
    let (_l, _held) = full_unix(&target);
    let to = format!("unix:{}", target.display());
    launcher_free_while_connecting(&mut st, &to);
    st.d.shutdown();
}

#[test]
fn a_tcp_target_that_drops_syns_fails_by_the_deadline() {
    let mut st = setup_with("lc-tcp", true);
    let (_l, port, _held) = full_tcp();
    let to = format!("tcp:127.0.0.1:{port}");
    launcher_free_while_connecting(&mut st, &to);
    st.d.shutdown();
}
