//! The libvirt hook, `contrib/libvirt/hooks/qemu`, called as libvirt calls
//! it (`qemu DOMAIN OP SUBOP -`, the domain XML on stdin) against a real
//! daemon; what vzram was told is read back with `vzram stat --json`. A
//! plain start leaves a device and its pages alone, `migrate begin` makes
//! it incoming and prints nothing, a failed incoming migration removes the
//! device that never got its pages, a normal stop (or one after a completed
//! migration) keeps them, and every call can come twice.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use vzram_tests::*;

const SIZE: &str = "16M";

/// How long one hook call may take: libvirt waits for it.
const HOOK_TIMEOUT: Duration = Duration::from_secs(20);

/// A host as the hook sees it: a daemon whose control socket and device
/// sockets are in the run dir, the size files, libvirt's status dir and the
/// hook's log, all in one temporary directory.
struct Host {
    dir: TempDir,
    d: Daemon,
    /// `VZRAM_HOOK_LOG`.
    log: PathBuf,
}

impl Host {
    /// A daemon serving `devices` (a vzram domain each, of [`SIZE`]).
    fn new(tag: &str, devices: &[&str]) -> Host {
        let dir = TempDir::new(tag);
        for sub in ["etc", "libvirt"] {
            std::fs::create_dir(dir.join(sub)).unwrap();
        }
        let specs: Vec<String> = devices
            .iter()
            .map(|n| format!("socket={},size={SIZE},name={n}", s(&dir.join(&sock(n)))))
            .collect();
        let mut args = vec![];
        for spec in &specs {
            args.extend(["--device", spec.as_str()]);
        }
        let socks: Vec<PathBuf> = devices.iter().map(|n| dir.join(&sock(n))).collect();
        let socks: Vec<&Path> = socks.iter().map(PathBuf::as_path).collect();
        let d = Daemon::start(&dir, &args, &socks);
        let log = dir.join("hook.log");
        let h = Host { dir, d, log };
        for n in devices {
            h.vzram_domain(n);
        }
        h
    }

    /// Makes `dom` a vzram domain for the hook: its size file.
    fn vzram_domain(&self, dom: &str) {
        std::fs::write(self.dir.join(&format!("etc/{dom}.size")), SIZE).unwrap();
    }

    fn sock(&self, dom: &str) -> PathBuf {
        self.dir.join(&sock(dom))
    }

    fn incoming(&self, dom: &str) -> PathBuf {
        self.dir.join(&format!("{dom}.migrate"))
    }

    /// libvirt's status XML of a running domain.
    fn status_xml(&self, dom: &str) -> PathBuf {
        self.dir.join(&format!("libvirt/{dom}.xml"))
    }

    /// Runs the hook as libvirt does, with every path it knows pointed
    /// into the test's directory and nothing else from the environment.
    fn hook(&self, dom: &str, op: &str, sub: &str) -> Output {
        let mut cmd = Command::new(root().join("contrib/libvirt/hooks/qemu"));
        cmd.args([dom, op, sub, "-"])
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("VZRAM", vzram_bin())
            .env("VZRAM_RUN_DIR", self.dir.path())
            .env("VZRAM_ETC_DIR", self.dir.join("etc"))
            .env("VZRAM_CONTROL", &self.d.control)
            .env("VZRAM_HOOK_LOG", &self.log)
            .env("VZRAM_LIBVIRT_RUN", self.dir.join("libvirt"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("run the hook");
        let pid = child.id();
        // Read only on "migrate begin"; a hook gone already is no error.
        let _ = child
            .stdin
            .take()
            .unwrap()
            .write_all(domain_xml(dom, &self.sock(dom)).as_bytes());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(child.wait_with_output()));
        match rx.recv_timeout(HOOK_TIMEOUT) {
            Ok(out) => out.expect("wait for the hook"),
            Err(_) => {
                // SAFETY: a signal to our own child, not reaped yet.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                panic!("hook {dom} {op} {sub} still running after {HOOK_TIMEOUT:?}");
            }
        }
    }

    /// A hook call that must succeed and print nothing on stdout.
    fn ok(&self, dom: &str, op: &str, sub: &str) {
        let out = self.hook(dom, op, sub);
        assert!(
            out.status.success(),
            "hook {dom} {op} {sub}: {}\n{}\nhook log:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            self.hook_log()
        );
        assert!(
            out.stdout.is_empty(),
            "hook {dom} {op} {sub} printed on stdout: {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
    }

    /// What libvirt runs on every start, the incoming QEMU's included. Its
    /// status XML is there once QEMU runs.
    fn start(&self, dom: &str) {
        self.ok(dom, "prepare", "begin");
        self.ok(dom, "start", "begin");
        std::fs::write(self.status_xml(dom), domain_xml(dom, &self.sock(dom))).unwrap();
        self.ok(dom, "started", "begin");
    }

    /// What libvirt runs once QEMU has gone, after a shutdown or a failed
    /// start or incoming migration.
    fn stop(&self, dom: &str) {
        let _ = std::fs::remove_file(self.status_xml(dom));
        self.ok(dom, "stopped", "end");
        self.ok(dom, "release", "end");
    }

    fn mark(&self, dom: &str) -> PathBuf {
        self.dir.join(&format!("{dom}.hook-incoming"))
    }

    fn hook_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The device's migration state as `vzram stat --json` shows it, or
    /// None when there is no such device.
    fn state(&mut self, dom: &str) -> Option<MigrationState> {
        let st = self.d.stat_cli();
        st.find(dom).map(|d| d.migration.state)
    }

    fn stat(&mut self) -> Stats {
        self.d.stat_cli()
    }

    /// A frontend just connected: waits until the daemon says so.
    fn wait_connected(&mut self, dom: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.stat().dev(dom).connected {
            assert!(Instant::now() < deadline, "{dom} never connected");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn sock(dom: &str) -> String {
    format!("{dom}.sock")
}

/// A domain's XML as libvirt hands it to the hook, its disk on vzram.
fn domain_xml(dom: &str, sock: &Path) -> String {
    format!(
        "<domain type='kvm'>\n  <name>{dom}</name>\n  <memory unit='MiB'>512</memory>\n  \
         <devices>\n    <disk type='vhostuser' device='disk' snapshot='no'>\n      \
         <driver name='qemu' type='raw'/>\n      \
         <source type='unix' path='{}'><reconnect enabled='yes' timeout='1'/></source>\n      \
         <target dev='vdb' bus='virtio'/>\n    </disk>\n  </devices>\n</domain>\n",
        sock.display()
    )
}

/// Pages 0 and 100 of `seed`, as the guest left them.
fn write_pages(sock: &Path, seed: u64) {
    let mut c = Client::connect(sock, 1).expect("connect");
    for i in [0u64, 100] {
        c.q(0)
            .write(i * PAGE as u64, &noise(seed + i, PAGE))
            .unwrap();
    }
}

/// Checks pages 0 and 100 against [`write_pages`]. Only on a device that
/// serves: an incoming one holds the read until its pages come.
fn check_pages(sock: &Path, seed: u64, what: &str) {
    let mut c = Client::connect(sock, 1).expect("connect");
    for i in [0u64, 100] {
        let got = c.q(0).read(i * PAGE as u64, PAGE).unwrap();
        assert!(got == noise(seed + i, PAGE), "{what}: page {i} differs");
    }
}

/// A stored page that is not zero: what `orig_data_size` counts.
fn stored(h: &mut Host, dom: &str) -> u64 {
    h.stat().counters(dom).orig_data_size
}

#[test]
fn a_plain_start_leaves_the_device_and_its_pages_alone() {
    let mut h = Host::new("hook-start", &["vm1"]);
    write_pages(&h.sock("vm1"), 1);
    let before = stored(&mut h, "vm1");
    assert_eq!(before, 2 * PAGE as u64);

    h.start("vm1");
    let st = h.stat();
    let dev = st.dev("vm1");
    // Checked before reading: an incoming device would hold the read.
    assert_eq!(
        dev.migration.state,
        MigrationState::None,
        "a plain start made the device incoming: {st}\n{}",
        h.hook_log()
    );
    assert_eq!(dev.migration.incoming, None, "{st}");
    assert_eq!(dev.stats.orig_data_size, before, "{st}");
    assert!(!h.mark("vm1").exists(), "a plain start left a mark");
    assert!(
        !h.incoming("vm1").exists(),
        "an incoming socket on a plain start"
    );
    check_pages(&h.sock("vm1"), 1, "after a plain start");
}

#[test]
fn migrate_begin_makes_the_device_incoming_and_prints_nothing() {
    // vm2 exists but is not there yet; vm3 has an old device, not in use.
    let mut h = Host::new("hook-mig", &["other", "vm3"]);
    write_pages(&h.sock("other"), 2);
    write_pages(&h.sock("vm3"), 3);
    h.vzram_domain("vm2");
    for dom in ["vm2", "vm3"] {
        // ok() checks stdout: libvirt would take it as the new domain XML.
        h.ok(dom, "migrate", "begin");
        let st = h.stat();
        let dev = st.dev(dom);
        assert_eq!(dev.migration.state, MigrationState::Incoming, "{st}");
        let want = format!("unix:{}", h.incoming(dom).display());
        assert_eq!(dev.migration.incoming.as_deref(), Some(&*want), "{st}");
        assert_eq!(dev.socket, h.sock(dom), "{st}");
        assert_eq!(dev.size_bytes, 16 << 20, "{st}");
        // Fresh: the old vm3's pages are the source's to send.
        assert_eq!(dev.stats.orig_data_size, 0, "{st}");
        assert!(h.incoming(dom).exists(), "no incoming socket for {dom}");
        assert!(h.mark(dom).exists(), "no mark for {dom}");
    }
    // Its frontend may connect at once, as the incoming QEMU does.
    let c = Client::connect(&h.sock("vm2"), 1).expect("connect to an incoming device");
    drop(c);
    assert_eq!(stored(&mut h, "other"), 2 * PAGE as u64);
    check_pages(&h.sock("other"), 2, "another device");
    // The vzram CLI's output went to the log, not to stdout; with no log
    // to write, to stderr.
    let log = h.hook_log();
    assert!(log.contains("added device vm2"), "{log}");
    assert!(
        log.contains("vm2 migrate begin: device vm2 incoming"),
        "{log}"
    );
    h.log = PathBuf::from("/nonexistent/vzram-hook.log");
    h.vzram_domain("vm2b");
    let out = h.hook("vm2b", "migrate", "begin");
    assert!(out.status.success(), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("added device vm2b"), "{err}");
    assert_eq!(h.state("vm2b"), Some(MigrationState::Incoming));
}

#[test]
fn migrate_begin_leaves_alone_a_domain_not_on_vzram_or_running_here() {
    let mut h = Host::new("hook-refuse", &["vm4", "vm5"]);
    write_pages(&h.sock("vm4"), 4);
    // No size file: not a vzram domain, nothing to do.
    h.ok("plain", "migrate", "begin");
    assert!(h.stat().find("plain").is_none(), "{}", h.stat());

    // Running here (libvirt's status XML): refused, device as it was.
    h.start("vm4");
    let out = h.hook("vm4", "migrate", "begin");
    assert!(!out.status.success(), "a running domain's device replaced");
    assert!(out.stdout.is_empty());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("runs here"),
        "{out:?}"
    );
    assert_eq!(h.state("vm4"), Some(MigrationState::None));
    assert!(!h.mark("vm4").exists(), "a refusal left a mark");
    // Its stop afterwards (a refused migration) keeps the pages.
    h.stop("vm4");
    check_pages(&h.sock("vm4"), 4, "after a refused migrate begin");

    // A frontend connected: refused too, even with no status XML.
    write_pages(&h.sock("vm5"), 5);
    let c = Client::connect(&h.sock("vm5"), 1).unwrap();
    h.wait_connected("vm5");
    let out = h.hook("vm5", "migrate", "begin");
    assert!(!out.status.success(), "a connected device replaced");
    assert_eq!(h.state("vm5"), Some(MigrationState::None));
    drop(c);
    check_pages(&h.sock("vm5"), 5, "after a refused migrate begin");
}

#[test]
fn a_failed_incoming_migration_removes_the_device_that_got_no_pages() {
    let mut h = Host::new("hook-fail", &["other"]);
    write_pages(&h.sock("other"), 6);
    h.vzram_domain("vm6");
    h.ok("vm6", "migrate", "begin");
    h.start("vm6");
    // The incoming QEMU connects, then dies before any page came.
    let c = Client::connect(&h.sock("vm6"), 1).unwrap();
    assert_eq!(h.state("vm6"), Some(MigrationState::Incoming));
    drop(c);
    h.stop("vm6");
    assert_eq!(h.state("vm6"), None, "device left: {}", h.hook_log());
    assert!(!h.sock("vm6").exists(), "socket left behind");
    assert!(!h.mark("vm6").exists(), "mark left behind");
    check_pages(&h.sock("other"), 6, "another device");

    // A retry starts clean.
    h.ok("vm6", "migrate", "begin");
    assert_eq!(h.state("vm6"), Some(MigrationState::Incoming));
}

#[test]
fn a_stream_that_failed_leaves_nothing_behind_either() {
    let mut h = Host::new("hook-failst", &["other"]);
    h.vzram_domain("vm7");
    h.ok("vm7", "migrate", "begin");
    // A source of another size: refused by the destination, which fails.
    let src = TempDir::new("hook-failsrc");
    let src_sock = src.join("src.sock");
    let spec = format!("socket={},size=32M,name=vm7", s(&src_sock));
    let a = Daemon::start(&src, &["--device", &spec], &[&src_sock]);
    let out = Vzram::new(&["migrate", "--control", s(&a.control), "--device", "vm7"])
        .arg("--to")
        .arg(format!("unix:{}", h.incoming("vm7").display()))
        .output();
    assert!(!out.status.success(), "a size mismatch migrated: {out:?}");
    // The source hears the refusal before the destination has recorded it.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = h.stat();
        if st.dev("vm7").migration.state == MigrationState::Failed {
            break;
        }
        assert!(Instant::now() < deadline, "{st}");
        std::thread::sleep(Duration::from_millis(20));
    }
    h.stop("vm7");
    assert_eq!(h.state("vm7"), None, "device left: {}", h.hook_log());
    assert!(!h.mark("vm7").exists(), "mark left behind");
}

#[test]
fn every_call_twice_is_harmless() {
    let mut h = Host::new("hook-twice", &["vm8"]);
    write_pages(&h.sock("vm8"), 8);
    h.start("vm8");
    h.start("vm8");
    h.stop("vm8");
    h.stop("vm8");
    assert_eq!(h.state("vm8"), Some(MigrationState::None));
    check_pages(&h.sock("vm8"), 8, "after two starts and stops");

    // A second migrate begin while the incoming QEMU is connected keeps
    // the device and its connection (it is not replaced, nor refused).
    h.vzram_domain("vm9");
    h.ok("vm9", "migrate", "begin");
    let c = Client::connect(&h.sock("vm9"), 1).unwrap();
    h.wait_connected("vm9");
    h.ok("vm9", "migrate", "begin");
    let st = h.stat();
    let dev = st.dev("vm9");
    assert_eq!(dev.migration.state, MigrationState::Incoming, "{st}");
    assert!(dev.connected, "the frontend was cut off: {st}");
    assert_eq!(dev.connections, 1, "{st}");
    drop(c);
    // stopped end, release end, and both again: removed once, then nothing.
    h.stop("vm9");
    h.stop("vm9");
    assert_eq!(h.state("vm9"), None);
    check_pages(&h.sock("vm8"), 8, "another device");
}

#[test]
fn a_normal_stop_keeps_the_pages() {
    let mut h = Host::new("hook-stop", &["vm10"]);
    h.start("vm10");
    write_pages(&h.sock("vm10"), 10);
    h.stop("vm10");
    let st = h.stat();
    assert_eq!(st.dev("vm10").migration.state, MigrationState::None, "{st}");
    assert_eq!(st.counters("vm10").orig_data_size, 2 * PAGE as u64, "{st}");
    check_pages(&h.sock("vm10"), 10, "after a normal stop");
}

#[test]
fn a_stop_after_a_completed_migration_keeps_the_pages() {
    // The device this hook made incoming, now holding every page: the
    // mark is there, and the stop still must not remove it.
    let src = TempDir::new("hook-src");
    let src_sock = src.join("src.sock");
    let spec = format!("socket={},size={SIZE},name=vm11", s(&src_sock));
    let a = Daemon::start(&src, &["--device", &spec], &[&src_sock]);
    write_pages(&src_sock, 11);
    let mut h = Host::new("hook-dst", &["other"]);
    h.vzram_domain("vm11");
    h.ok("vm11", "migrate", "begin");
    let m = Vzram::new(&["migrate", "--control", s(&a.control), "--device", "vm11"])
        .arg("--to")
        .arg(format!("unix:{}", h.incoming("vm11").display()))
        .spawn();
    // No frontend on either side: the operator commits after the last
    // delta (nothing else says where the VM runs).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while a.stat().devices()[0].migration.state != MigrationState::Committing {
        assert!(std::time::Instant::now() < deadline, "never committing");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let c = Vzram::new(&["migrate", "--control", s(&a.control), "--device", "vm11"])
        .arg("--commit")
        .output();
    assert!(c.status.success(), "{c:?}");
    let out = m.output();
    assert!(
        out.status.success(),
        "migrate: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    h.start("vm11");
    assert_eq!(h.state("vm11"), Some(MigrationState::Received));
    check_pages(&h.sock("vm11"), 11, "migrated");
    h.stop("vm11");
    assert_eq!(
        h.state("vm11"),
        Some(MigrationState::Received),
        "{}",
        h.hook_log()
    );
    check_pages(&h.sock("vm11"), 11, "after the stop");
    // Its next start and stop leave it alone too.
    h.start("vm11");
    h.stop("vm11");
    check_pages(&h.sock("vm11"), 11, "after a second start and stop");
}

/// The source side: `vzram-send` backgrounds the sender; the VMM's
/// migration fails while the guest runs here (its rings never stop), and
/// `vzram-cancel` calls the send off: the source keeps every page, the
/// destination drops what it took and waits again. A second cancel, with
/// nothing under way, is harmless.
#[test]
fn a_send_called_off_by_vzram_cancel_keeps_every_page_on_the_source() {
    use vzram_tests::frontend::RawDev;
    let mut h = Host::new("hook-src", &["vm12"]);
    write_pages(&h.sock("vm12"), 12);
    let dst = TempDir::new("hook-dst12");
    let dst_sock = dst.join("vm12.sock");
    let dst_in = dst.join("vm12.migrate");
    let spec = format!(
        "socket={},size={SIZE},name=vm12,incoming=unix:{}",
        s(&dst_sock),
        s(&dst_in)
    );
    let b = Daemon::start(&dst, &["--device", &spec], &[&dst_sock, &dst_in]);
    // The guest runs: a frontend with its ring started.
    let v = RawDev::connect(&h.sock("vm12"));
    h.ok("vm12", "vzram-send", &format!("unix:{}", s(&dst_in)));
    let deadline = Instant::now() + Duration::from_secs(20);
    while h.state("vm12") != Some(MigrationState::Sending) {
        assert!(Instant::now() < deadline, "never sending: {}", h.hook_log());
        std::thread::sleep(Duration::from_millis(20));
    }
    h.ok("vm12", "vzram-cancel", "");
    assert_eq!(h.state("vm12"), Some(MigrationState::SendFailed));
    let deadline = Instant::now() + Duration::from_secs(20);
    while b.stat().devices()[0].migration.state != MigrationState::Failed {
        assert!(Instant::now() < deadline, "the destination did not drop it");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(b.stat().counters("vm12").orig_data_size, 0);
    h.ok("vm12", "vzram-cancel", "");
    assert!(h.hook_log().contains("no migration of vm12 to cancel"));
    drop(v);
    check_pages(&h.sock("vm12"), 12, "the source after the cancel");
}

/// The hook is POSIX sh; shellcheck reads it when installed.
#[test]
fn the_hook_passes_shellcheck() {
    let hook = root().join("contrib/libvirt/hooks/qemu");
    match Command::new("shellcheck").arg(&hook).output() {
        Ok(out) => assert!(
            out.status.success(),
            "shellcheck {}:\n{}",
            hook.display(),
            String::from_utf8_lossy(&out.stdout)
        ),
        Err(e) => eprintln!("skipped: no shellcheck ({e})"),
    }
}
