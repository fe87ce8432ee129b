//! Two daemons for the migration tests: A serves `vm` (64 MiB), B waits
//! for it on a unix socket; `vzram migrate` between them, and waits on
//! their migration states.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::*;

pub const SIZE: &str = "64M";
pub const PAGES: u64 = 64 << 8;

pub struct Ends {
    pub da: TempDir,
    pub db: TempDir,
    pub a: Daemon,
    pub b: Daemon,
    pub sock_a: PathBuf,
    pub sock_b: PathBuf,
    pub incoming: PathBuf,
}

/// Daemon A serves `vm` (64 MiB); daemon B serves `vm` of `size_b`,
/// incoming on a unix socket.
pub fn ends(tag: &str, size_b: &str) -> Ends {
    ends_with(tag, size_b, &[])
}

/// [`ends`], with more arguments for B.
pub fn ends_with(tag: &str, size_b: &str, extra_b: &[&str]) -> Ends {
    let da = TempDir::new(&format!("{tag}a"));
    let db = TempDir::new(&format!("{tag}b"));
    let sock_a = da.join("a.sock");
    let sock_b = db.join("b.sock");
    let incoming = db.join("in.sock");
    let a = Daemon::start(
        &da,
        &[
            "--socket",
            s(&sock_a),
            "--size",
            SIZE,
            "--name",
            "vm",
            "--queues",
            "2",
        ],
        &[&sock_a],
    );
    let inc = format!("unix:{}", incoming.display());
    let mut args_b = vec![
        "--socket",
        s(&sock_b),
        "--size",
        size_b,
        "--name",
        "vm",
        "--queues",
        "2",
        "--incoming",
        &inc,
    ];
    args_b.extend_from_slice(extra_b);
    let b = Daemon::start(&db, &args_b, &[&sock_b, &incoming]);
    Ends {
        da,
        db,
        a,
        b,
        sock_a,
        sock_b,
        incoming,
    }
}

/// `vzram migrate` of A's device to `to`.
pub fn migrate_cmd(e: &Ends, to: &Path) -> Command {
    let mut c = Command::new(vzram_bin());
    c.args([
        "migrate",
        "--control",
        s(&e.a.control),
        "--device",
        "vm",
        "--to",
    ])
    .arg(format!("unix:{}", to.display()));
    c
}

pub fn migrate(e: &Ends, extra: &[&str]) -> Output {
    migrate_cmd(e, &e.incoming).args(extra).output().unwrap()
}

pub fn migration(d: &Daemon) -> MigrationStat {
    d.stat().devices()[0].migration.clone()
}

pub fn write_all(sock: &Path, v: u64) {
    let mut c = Client::connect(sock, 2).expect("connect");
    for i in (0..PAGES).step_by(2) {
        c.q((i % 2) as usize)
            .write(i * PAGE as u64, &versioned_page_nonzero(i, v))
            .unwrap_or_else(|e| panic!("write page {i}: {e}"));
    }
}

pub fn check_all(c: &mut Client, want: impl Fn(u64) -> Vec<u8>, what: &str) {
    for i in 0..PAGES {
        let got = c.q(0).read(i * PAGE as u64, PAGE).unwrap();
        assert!(got == want(i), "{what}: page {i} differs");
    }
}

pub fn expected(i: u64, v: u64) -> Vec<u8> {
    if i.is_multiple_of(2) {
        versioned_page_nonzero(i, v)
    } else {
        vec![0; PAGE]
    }
}

/// The destination's migration once it shows a failure: the state is the
/// device's and the error the supervisor's, set a moment later.
pub fn wait_failed(d: &Daemon, what: &str) -> MigrationStat {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = migration(d);
        if m.state == MigrationState::Failed && m.error.is_some() {
            return m;
        }
        assert!(Instant::now() < deadline, "{what}: {m:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn wait_state(d: &Daemon, want: MigrationState, limit: Duration) -> MigrationStat {
    let deadline = Instant::now() + limit;
    loop {
        let m = migration(d);
        if m.state == want {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "not {want:?} after {limit:?}: {m:?}\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until A has no worker: a migrate that meets one that is going
/// tries again on a new connection, which a one-shot fake would not take.
pub fn no_worker(d: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.stat().worker("vm").pid.is_some() {
        assert!(Instant::now() < deadline, "the worker stays");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn spawn_migrate(e: &Ends, to: &Path) -> std::process::Child {
    migrate_cmd(e, to)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// `vzram migrate --commit` (or `--cancel`) of A's device.
pub fn ask(e: &Ends, what: &str) -> Output {
    ask_at(&e.a, what)
}

/// `vzram migrate --commit` (or `--cancel`) of `vm` on `d`.
pub fn ask_at(d: &Daemon, what: &str) -> Output {
    Vzram::new(&["migrate", "--device", "vm", what])
        .control(&d.control)
        .output()
}

/// A migration with no frontend on either side (a cold move): it waits
/// after the last delta for evidence that the VM runs on B; the operator
/// gives it (`--commit`), and the migrate's output is returned.
pub fn migrate_committed(e: &Ends, extra: &[&str]) -> Output {
    let m = Vzram::new(&["migrate", "--device", "vm", "--to"])
        .arg(format!("unix:{}", e.incoming.display()))
        .control(&e.a.control)
        .args(extra)
        .spawn();
    commit_when_ready(&e.a, m)
}

/// `m`, a `vzram migrate` of `vm` on `a`, once `a` waits for the commit:
/// `--commit` given, its output. Returned at once, or after 60 s, if it
/// exits before that.
pub fn commit_when_ready(a: &Daemon, mut m: Running) -> Output {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = migration(a).state;
        if st == MigrationState::Committing {
            break;
        }
        // Failed before the last delta (a state left from an earlier send
        // is not this one's: its process tells).
        if !m.running() || Instant::now() > deadline {
            return m.output();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let c = ask_at(a, "--commit");
    assert!(c.status.success(), "{}", said(&c));
    m.output()
}
