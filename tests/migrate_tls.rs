//! Migration on `tcp:` is mutual TLS: two daemons with certificates from
//! one CA (made here) move a device intact; without credentials a `tcp:`
//! incoming or migrate is refused (exit 2); a plain-TCP peer and a peer
//! whose certificate comes from another CA get nothing, and both devices
//! keep what they had.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use vzram_tests::migrating::commit_when_ready;
use vzram_tests::pki::pki;
use vzram_tests::*;

const SIZE: &str = "32M";
const PAGES: u64 = 32 << 8;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn source(dir: &TempDir, creds: Option<&Path>) -> (Daemon, PathBuf) {
    let sock = dir.join("a.sock");
    let mut args = vec!["--socket", s(&sock), "--size", SIZE, "--name", "vm"];
    if let Some(c) = creds {
        args.extend(["--tls-creds", s(c)]);
    }
    let d = Daemon::start(dir, &args, &[&sock]);
    (d, sock)
}

/// A destination with `vm` incoming on `tcp:127.0.0.1:port`.
fn destination(dir: &TempDir, creds: &Path, port: u16) -> (Daemon, PathBuf) {
    let sock = dir.join("b.sock");
    let inc = format!("tcp:127.0.0.1:{port}");
    let d = Daemon::start(
        dir,
        &[
            "--socket",
            s(&sock),
            "--size",
            SIZE,
            "--name",
            "vm",
            "--incoming",
            &inc,
            "--tls-creds",
            s(creds),
        ],
        &[&sock],
    );
    // The listener is bound before the daemon says it is ready.
    (d, sock)
}

fn migrate_to(a: &Daemon, to: &str) -> Vzram {
    Vzram::new(&["migrate", "--device", "vm", "--to", to]).control(&a.control)
}

fn migrate(a: &Daemon, to: &str) -> Output {
    migrate_to(a, to).output()
}

/// [`migrate`] of a cold device (no frontend on either end): it waits
/// after the last delta until the operator commits.
fn migrate_committed(a: &Daemon, to: &str) -> Output {
    commit_when_ready(a, migrate_to(a, to).spawn())
}

fn write_pages(sock: &Path) {
    let mut c = Client::connect(sock, 1).expect("connect");
    for i in 0..PAGES {
        c.q(0)
            .write(i * PAGE as u64, &versioned_page_nonzero(i, 7))
            .unwrap();
    }
}

fn check_pages(sock: &Path, what: &str) {
    let mut c = Client::connect(sock, 1).expect("connect");
    check_pages_on(&mut c, what);
}

fn check_pages_on(c: &mut Client, what: &str) {
    for i in 0..PAGES {
        let got = c.q(0).read(i * PAGE as u64, PAGE).unwrap();
        assert!(
            got == versioned_page_nonzero(i, 7),
            "{what}: page {i} differs"
        );
    }
}

fn migration(d: &Daemon) -> MigrationStat {
    d.stat().devices()[0].migration.clone()
}

/// B still waits, and holds nothing.
fn still_waiting(b: &Daemon, what: &str) {
    let m = migration(b);
    assert!(
        matches!(m.state, MigrationState::Incoming | MigrationState::Failed),
        "{what}: {m:?}"
    );
    assert_eq!(b.stat().counters("vm").orig_data_size, 0, "{what}");
}

#[test]
fn a_device_migrates_over_mutual_tls() {
    let dir = TempDir::new("tlsok");
    let p = pki(&dir, "one");
    let port = free_port();
    let (b, sock_b) = destination(&dir, &p.dest, port);
    let da = TempDir::new("tlsoka");
    let (a, sock_a) = source(&da, Some(&p.source));
    write_pages(&sock_a);
    let stored = a.stat().counters("vm").orig_data_size;
    // B's VM waits for its pages; its rings running after the last delta
    // are what commits the move (said over the TLS stream).
    let mut cb = Client::connect(&sock_b, 1).expect("connect to B");
    let t0 = Instant::now();
    let out = migrate(&a, &format!("tcp:127.0.0.1:{port}"));
    eprintln!("migrate over TLS ({:?}): {}", t0.elapsed(), said(&out));
    assert!(out.status.success(), "{}\n{}", said(&out), b.log_text());
    assert_eq!(migration(&b).state, MigrationState::Received);
    assert_eq!(b.stat().counters("vm").orig_data_size, stored);
    assert_eq!(a.stat().counters("vm").orig_data_size, 0, "source dropped");
    check_pages_on(&mut cb, "destination");
}

#[test]
fn tcp_without_credentials_is_refused_at_start() {
    let dir = TempDir::new("tlsno");
    let sock = dir.join("b.sock");
    let inc = format!("tcp:127.0.0.1:{}", free_port());
    let base = ["--socket", s(&sock), "--size", SIZE, "--incoming", &inc];
    let refused = |extra: &[&str], want: &str| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let o = serve_refused(&dir, &args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!sock.exists(), "a refused start leaves no socket");
    };
    refused(&[], "needs --tls-creds");
    let p = pki(&dir, "one");
    // A source's directory has no server pair: it cannot receive.
    refused(&["--tls-creds", s(&p.source)], "needs --tls-creds");
    refused(&["--tls-creds", s(&dir.join("nowhere"))], "ca-cert.pem");
    let half = dir.join("half");
    std::fs::create_dir_all(&half).unwrap();
    std::fs::copy(p.dest.join("ca-cert.pem"), half.join("ca-cert.pem")).unwrap();
    std::fs::copy(p.dest.join("server-cert.pem"), half.join("server-cert.pem")).unwrap();
    refused(
        &["--tls-creds", s(&half)],
        "server-cert.pem without server-key.pem",
    );
    std::fs::write(half.join("server-key.pem"), "not a key\n").unwrap();
    refused(&["--tls-creds", s(&half)], "server-key.pem");

    // A source without client credentials refuses a tcp: migrate, and
    // connects nowhere.
    let da = TempDir::new("tlsnoa");
    let (a, sock_a) = source(&da, None);
    write_pages(&sock_a);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let o = migrate(&a, &format!("tcp:{}", l.local_addr().unwrap()));
    assert_eq!(o.status.code(), Some(2), "{}", said(&o));
    assert!(said(&o).contains("needs mutual TLS"), "{}", said(&o));
    assert!(l.accept().is_err(), "the source connected");
    check_pages(&sock_a, "source");
}

#[test]
fn a_plain_tcp_peer_gets_a_tls_failure_never_a_vzram_reply() {
    let dir = TempDir::new("tlsplain");
    let p = pki(&dir, "one");
    let port = free_port();
    let (b, _sock_b) = destination(&dir, &p.dest, port);
    // A plain sender: a vzram stream header, then pages.
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut body = b"VZRAMMIG".to_vec();
    body.extend_from_slice(&vzram_store::migrate::VERSION.to_le_bytes());
    body.extend(std::iter::repeat_n(0x52, 64 << 10));
    let _ = c.write_all(&body);
    let _ = c.shutdown(std::net::Shutdown::Write);
    let mut reply = Vec::new();
    let _ = c.read_to_end(&mut reply);
    // A TLS alert record (content type 21), or nothing at all.
    assert!(
        reply.is_empty() || reply[0] == 21,
        "a plain peer got {:?}",
        &reply[..reply.len().min(32)]
    );
    still_waiting(&b, "after a plain peer");
    assert!(b.log_text().contains("TLS handshake"), "{}", b.log_text());

    // A plain listener posing as the destination: the source refuses to
    // send to it and keeps every page.
    let da = TempDir::new("tlsplaina");
    let (a, sock_a) = source(&da, Some(&p.source));
    write_pages(&sock_a);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let to = format!("tcp:{}", l.local_addr().unwrap());
    // It takes every attempt (one that meets a worker on its way out is
    // made again on a new connection) until the source gives up.
    l.set_nonblocking(true).unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = done.clone();
    let fake = std::thread::spawn(move || {
        let mut firsts = Vec::new();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let Ok((mut s, _)) = l.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            s.set_nonblocking(false).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut got = [0u8; 5];
            if s.read_exact(&mut got).is_ok() {
                firsts.push(got[0]);
                // What a plain vzram destination would answer: accept.
                let _ = s.write_all(b"A");
            }
        }
        firsts
    });
    let o = migrate(&a, &to);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let firsts = fake.join().unwrap();
    assert!(
        !firsts.is_empty() && firsts.iter().all(|&b| b == 22),
        "the source opens with a TLS handshake record: {firsts:?}"
    );
    assert!(!o.status.success(), "{}", said(&o));
    assert!(said(&o).contains("TLS handshake"), "{}", said(&o));
    assert_ne!(migration(&a).state, MigrationState::Sent);
    check_pages(&sock_a, "source after a plain listener");
}

#[test]
fn a_peer_with_a_certificate_from_another_ca_is_refused() {
    let dir = TempDir::new("tlsca");
    let good = pki(&dir, "good");
    let rogue = pki(&dir, "rogue");
    let port = free_port();
    let (b, _sock_b) = destination(&dir, &good.dest, port);
    let to = format!("tcp:127.0.0.1:{port}");

    // A source whose client certificate the destination's CA did not sign.
    let da = TempDir::new("tlscaa");
    let (a, sock_a) = source(&da, Some(&rogue.source));
    write_pages(&sock_a);
    let o = migrate(&a, &to);
    assert!(!o.status.success(), "{}", said(&o));
    still_waiting(&b, "after a rogue source");
    let log = b.log_text();
    assert!(
        log.contains("TLS handshake with the source failed"),
        "{log}"
    );
    assert_ne!(migration(&a).state, MigrationState::Sent);
    check_pages(&sock_a, "rogue source");

    // A destination whose server certificate the source's CA did not sign.
    let dc = TempDir::new("tlscac");
    let port_c = free_port();
    let (c, _sock_c) = destination(&dc, &rogue.dest, port_c);
    let de = TempDir::new("tlscae");
    let (e, sock_e) = source(&de, Some(&good.source));
    write_pages(&sock_e);
    let o = migrate(&e, &format!("tcp:127.0.0.1:{port_c}"));
    assert!(!o.status.success(), "{}", said(&o));
    assert!(
        said(&o).contains("TLS handshake with the destination"),
        "{}",
        said(&o)
    );
    assert!(
        said(&o).to_lowercase().contains("certificate"),
        "{}",
        said(&o)
    );
    still_waiting(&c, "a rogue destination");
    check_pages(&sock_e, "source refusing a rogue destination");

    // And the good pair still works after all that.
    let o = migrate_committed(&e, &to);
    assert!(o.status.success(), "{}\n{}", said(&o), b.log_text());
    assert_eq!(migration(&b).state, MigrationState::Received);
}

/// A peer that connects and trickles a record header is cut once the
/// handshake deadline (seconds) has passed, and meanwhile the real source
/// is not kept waiting behind it: handshakes run side by side, before
/// anything reaches the device.
#[test]
fn a_silent_peer_is_cut_at_the_handshake_deadline_and_blocks_no_source() {
    let dir = TempDir::new("tlssil");
    let p = pki(&dir, "one");
    let port = free_port();
    let (b, sock_b) = destination(&dir, &p.dest, port);
    let da = TempDir::new("tlssila");
    let (a, sock_a) = source(&da, Some(&p.source));
    write_pages(&sock_a);
    let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    // It trickles a record header, a byte every 2 s: never a stall.
    let mut w = silent.try_clone().unwrap();
    std::thread::spawn(move || {
        let header = [0x16u8, 0x03, 0x01, 0x40, 0x00];
        for i in 0..60 {
            let b = header.get(i).copied().unwrap_or(0);
            if w.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_secs(2));
        }
    });
    // B's VM waits for its pages (its rings running commit the move); the
    // real source starts while the trickler is connected.
    let mut cb = Client::connect(&sock_b, 1).expect("connect to B");
    let to = format!("tcp:127.0.0.1:{port}");
    let a2 = &a;
    std::thread::scope(|sc| {
        let m = sc.spawn(|| migrate(a2, &to));
        // Cut within seconds (30 s leaves a loaded machine room; the
        // stream's own limits are a minute and an hour).
        silent
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let r = silent.read(&mut [0u8; 64]);
        assert!(
            !matches!(&r, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
            "a silent peer still connected after 30 s: {r:?}"
        );
        let out = m.join().unwrap();
        assert!(out.status.success(), "{}\n{}", said(&out), b.log_text());
    });
    assert_eq!(migration(&b).state, MigrationState::Received);
    check_pages_on(&mut cb, "destination");
}

/// A peer with no client certificate is refused in the handshake; it never
/// reaches the device (no header it sends is answered).
#[test]
fn a_peer_without_a_client_certificate_is_refused() {
    let dir = TempDir::new("tlsnocert");
    let p = pki(&dir, "one");
    let port = free_port();
    let (b, _sock_b) = destination(&dir, &p.dest, port);
    let mut hello = b"VZRAMMIG".to_vec();
    hello.extend_from_slice(&[0u8; 40]);
    let mut c = Command::new("openssl")
        .args(["s_client", "-quiet", "-tls1_3", "-connect"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("-CAfile")
        .arg(p.dest.join("ca-cert.pem"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("openssl");
    let mut stdin = c.stdin.take().unwrap();
    let _ = stdin.write_all(&hello);
    std::thread::sleep(Duration::from_secs(2));
    drop(stdin);
    let out = c.wait_with_output().unwrap();
    let got = &out.stdout;
    assert!(
        !got.contains(&b'A') && !got.contains(&b'X'),
        "a peer with no certificate got an answer: {got:?}"
    );
    let log = b.log_text();
    assert!(
        log.contains("TLS handshake with the source failed"),
        "{log}"
    );
    still_waiting(&b, "a peer with no certificate");
}

/// The source checks the destination's name: a certificate from the right
/// CA for another name is refused, and the source keeps every page.
#[test]
fn a_destination_certificate_for_another_name_is_refused() {
    let dir = TempDir::new("tlsname");
    let p = vzram_tests::pki::pki_naming(&dir, "one", &["other.example"]);
    let port = free_port();
    let (b, _sock_b) = destination(&dir, &p.dest, port);
    let da = TempDir::new("tlsnamea");
    let (a, sock_a) = source(&da, Some(&p.source));
    write_pages(&sock_a);
    let o = migrate(&a, &format!("tcp:127.0.0.1:{port}"));
    let text = said(&o);
    eprintln!("a certificate for another name: {text}");
    assert!(!o.status.success(), "{text}");
    assert!(
        text.contains("TLS handshake with the destination"),
        "{text}"
    );
    assert!(text.to_lowercase().contains("name"), "{text}");
    still_waiting(&b, "a destination of another name");
    check_pages(&sock_a, "source refusing a misnamed destination");
}

/// An incoming address that cannot be had (in use here; under the shipped
/// systemd unit, no network) stops only that device's migration: the
/// daemon starts, the other devices serve, and the device says why.
#[test]
fn an_incoming_address_in_use_stops_only_its_device() {
    let dir = TempDir::new("tlsbusy");
    let p = pki(&dir, "one");
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let (sock_vm, sock_other) = (dir.join("vm.sock"), dir.join("other.sock"));
    let vm = format!(
        "socket={},size={SIZE},name=vm,incoming=tcp:127.0.0.1:{port}",
        s(&sock_vm)
    );
    let other = format!("socket={},size={SIZE},name=other", s(&sock_other));
    let d = Daemon::start(
        &dir,
        &[
            "--device",
            &vm,
            "--device",
            &other,
            "--tls-creds",
            s(&p.dest),
        ],
        &[&sock_vm, &sock_other],
    );
    write_pages(&sock_other);
    check_pages(&sock_other, "the other device");
    let st = d.stat();
    let m = &st.dev("vm").migration;
    assert_eq!(m.state, MigrationState::Incoming, "{m:?}");
    assert!(
        m.error
            .as_deref()
            .unwrap_or_default()
            .contains("cannot listen"),
        "{m:?}"
    );
}
