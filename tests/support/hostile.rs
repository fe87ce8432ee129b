//! Two devices in one daemon for the hostile-frontend tests
//! (`tests/hostile*.rs`): `victim`, driven by a raw frontend
//! ([`crate::frontend`]) that sends what no VMM should, and `other`, driven
//! by the well-behaved blkio client the whole time ([`Fx`]). After each
//! hostile request, [`Fx::check`] and [`Fx::check_victim`] prove the
//! daemon alive, `other` untouched, and `victim` serving a fresh frontend
//! with its data intact.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::frontend::*;
use crate::*;

pub const DEV_SIZE: u64 = 16 * MIB;
pub const SECTORS: u64 = DEV_SIZE / 512;
/// How long "nothing happens" is watched for.
pub const QUIET: Duration = Duration::from_millis(300);

/// A blkio connection. Its first request comes right after the ADD_MEM_REG
/// of its buffer, and is served with that region: the queue thread takes
/// a fresh snapshot of guest memory for each request
/// (`requests_after_a_mem_table_change_see_the_new_table`).
pub fn blkio(sock: &Path) -> Client {
    Client::connect(sock, 1).unwrap_or_else(|e| panic!("blkio connect: {e}"))
}

/// The well-behaved device and what it should hold.
pub struct Other {
    sock: PathBuf,
    c: Option<Client>,
    /// (byte offset, data) written so far.
    written: Vec<(u64, Vec<u8>)>,
    round: u64,
}

impl Other {
    pub fn new(sock: &Path) -> Other {
        let c = blkio(sock);
        let mut o = Other {
            sock: sock.to_path_buf(),
            c: Some(c),
            written: Vec::new(),
            round: 0,
        };
        // Compressible and incompressible pages, so both kinds of slot exist.
        o.put(0, pattern(0xb0b, 0, 16 * PAGE));
        o.put(64 * PAGE as u64, noise(0xb0b, 8 * PAGE));
        o
    }

    pub fn c(&mut self) -> &mut Client {
        self.c.as_mut().expect("connected")
    }

    /// Drops the blkio connection; checks with a raw frontend (which times
    /// out instead of hanging) that the socket takes a new one and serves
    /// the data; then connects blkio again.
    pub fn reconnect(&mut self) {
        self.c = None;
        let mut v = RawDev::connect(&self.sock);
        let (off, data) = self.written[0].clone();
        assert_eq!(
            v.read(off / 512, data.len()),
            (S_OK, data),
            "other, reconnected"
        );
        drop(v);
        self.c = Some(blkio(&self.sock));
    }

    pub fn put(&mut self, off: u64, data: Vec<u8>) {
        self.c()
            .q(0)
            .write(off, &data)
            .unwrap_or_else(|e| panic!("other: write at {off}: {e}"));
        self.written.push((off, data));
    }

    /// Everything written reads back, and a new write works.
    pub fn verify(&mut self) {
        for (off, data) in &self.written {
            let got = self
                .c
                .as_mut()
                .expect("connected")
                .q(0)
                .read(*off, data.len())
                .unwrap_or_else(|e| panic!("other: read at {off}: {e}"));
            assert!(got == *data, "other: data at byte {off} changed");
        }
        self.round += 1;
        let off = (1024 + self.round * 2) * PAGE as u64;
        self.put(off, noise(0xb0b ^ self.round, PAGE));
        let last = self.written.last().unwrap().clone();
        assert_eq!(self.c().q(0).read(last.0, last.1.len()).unwrap(), last.1);
    }
}

pub struct Fx {
    _dir: TempDir,
    pub d: Daemon,
    pub victim: PathBuf,
    pub other: Other,
}

/// What the victim holds from the start (written by a well-behaved raw
/// frontend): sector VICTIM_SECTOR, one page.
pub const VICTIM_SECTOR: u64 = 1024;

pub fn victim_page() -> Vec<u8> {
    pattern(0xa11ce, VICTIM_SECTOR * 512, PAGE)
}

pub fn fixture(tag: &str, victim_opts: &str) -> Fx {
    let dir = TempDir::new(tag);
    let victim = dir.join("victim.sock");
    let other_sock = dir.join("other.sock");
    let a = format!(
        "socket={},size={DEV_SIZE},name=victim{victim_opts}",
        s(&victim)
    );
    let b = format!("socket={},size={DEV_SIZE},name=other", s(&other_sock));
    let d = Daemon::start(
        &dir,
        &["--device", &a, "--device", &b],
        &[&victim, &other_sock],
    );
    let other = std::panic::catch_unwind(|| Other::new(&other_sock))
        .unwrap_or_else(|_| panic!("the other device fails from the start:\n{}", d.log_text()));
    let fx = Fx {
        _dir: dir,
        d,
        victim,
        other,
    };
    if !victim_opts.contains("readonly") {
        let mut v = RawDev::connect(&fx.victim);
        assert_eq!(v.write(VICTIM_SECTOR, &victim_page()), S_OK);
    }
    fx
}

impl Fx {
    /// The daemon process is alive and answers on its control socket.
    pub fn alive(&self) {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.d.pid())).unwrap_or_default();
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("gone");
        assert!(
            state != "Z" && state != "gone" && UnixStream::connect(&self.d.control).is_ok(),
            "the daemon died (state {state}):\n{}",
            self.d.log_text()
        );
        // The control socket answers (asked here rather than through
        // `Daemon::stat`, to fail with the daemon's log).
        let answer = (|| -> std::io::Result<String> {
            let mut c = UnixStream::connect(&self.d.control)?;
            c.set_read_timeout(Some(Duration::from_secs(10)))?;
            c.write_all(b"{\"cmd\":\"stat\"}\n")?;
            let mut line = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(c), &mut line)?;
            Ok(line)
        })();
        let serves_both = |line: &str| {
            serde_json::from_str(line)
                .ok()
                .and_then(|v| parse_reply::<StatReply>(v).ok())
                .is_some_and(|st| {
                    ["victim", "other"]
                        .iter()
                        .all(|n| st.devices.iter().any(|d| d.name == *n))
                })
        };
        match answer {
            Ok(line) if serves_both(&line) => {}
            other => panic!(
                "the control socket does not answer ({other:?}):\n{}",
                self.d.log_text()
            ),
        }
    }

    /// The daemon is alive and `other` is untouched and still serving.
    pub fn check(&mut self) {
        self.alive();
        self.other.verify();
    }

    /// Also: a well-behaved frontend on the victim's socket finds its data
    /// and can write. Drop every hostile connection first: a socket serves
    /// one frontend at a time.
    pub fn check_victim(&mut self) {
        self.check();
        let mut v = RawDev::connect(&self.victim);
        let (st, got) = v.read(VICTIM_SECTOR, PAGE);
        assert_eq!(st, S_OK);
        assert!(got == victim_page(), "victim's data changed");
        let fresh = noise(77, PAGE);
        assert_eq!(v.write(2048, &fresh), S_OK);
        assert_eq!(v.read(2048, PAGE), (S_OK, fresh));
    }

    pub fn raw(&self) -> RawDev {
        RawDev::connect(&self.victim)
    }
}

/// A chain that must not be carried out: returned with nothing written
/// (used length 0, status untouched) or with IOERR in its last byte.
pub fn assert_refused(u: Used, status: u8, what: &str) {
    assert!(
        (u.len == 0 && status == UNTOUCHED) || (u.len == 1 && status == S_IOERR),
        "{what}: used length {}, status {status:#x}",
        u.len
    );
}

/// The sector's current content through the same frontend.
pub fn sector_data(v: &mut RawDev, sector: u64, len: usize) -> Vec<u8> {
    let (st, data) = v.read(sector, len);
    assert_eq!(st, S_OK, "reading sector {sector}");
    data
}

/// A write of one page at `sector`, published and kicked, not waited for.
pub fn post_write(v: &mut RawDev, sector: u64, data: &[u8]) {
    v.ram.write(DATA, data);
    v.header(HDR, T_OUT, sector);
    v.ram.write(STATUS, &[UNTOUCHED]);
    let head = v.chain(
        0,
        &[
            d(HDR, 16, 0),
            d(DATA, data.len() as u32, 0),
            d(STATUS, 1, F_WRITE),
        ],
    );
    v.publish(head);
    v.kick();
}

/// A refused message: the daemon answers with an error and drops the
/// connection (vhost-user-backend ends a connection on any failed request).
pub fn assert_refused_msg<T: std::fmt::Debug>(v: &mut RawDev, res: vhost::Result<T>, what: &str) {
    assert!(res.is_err(), "{what} was accepted: {res:?}");
    let f = fate(&mut v.raw, Duration::from_secs(3));
    assert!(
        matches!(f, Fate::Dropped(_)),
        "{what}: refused ({res:?}), but the connection stays open: {f:?}"
    );
}
