//! Two vzram daemons for the QEMU migration tests, as on two hosts: A
//! serves `a` (1 GiB, 2 queues); B serves `b`, incoming on a unix socket.
//! A swapping guest's options, `vzram migrate` of A's device, and the
//! waits on a device's migration state.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use super::{Ctx, GuestOpts};
use crate::daemon::Daemon;
use crate::paths::s;
use crate::stats::{MigrationStat, MigrationState};

/// Daemon A and B, their vhost-user sockets, and B's incoming address.
pub struct Hosts {
    pub sock_a: PathBuf,
    pub sock_b: PathBuf,
    pub incoming: PathBuf,
    pub da: Daemon,
    pub db: Daemon,
}

impl Hosts {
    /// A serves `a` on `a.sock` (control `a.ctl`); B serves `b` on
    /// `b.sock` (control `b.ctl`), incoming on `b-incoming.sock`.
    pub fn start(ctx: &Ctx) -> Hosts {
        let sock_a = ctx.path("a.sock");
        let sock_b = ctx.path("b.sock");
        let incoming = ctx.path("b-incoming.sock");
        let dev = |sock: &Path, name: &str| {
            let mut v: Vec<String> = ["--socket", s(sock), "--size", "1G", "--queues", "2"]
                .map(String::from)
                .into();
            v.extend(["--name".to_string(), name.to_string()]);
            v
        };
        let da = ctx.daemon_at("a.ctl", &dev(&sock_a, "a"), &[&sock_a]);
        let mut b_args = dev(&sock_b, "b");
        b_args.extend(["--incoming".to_string(), format!("unix:{}", s(&incoming))]);
        let db = ctx.daemon_at("b.ctl", &b_args, &[&sock_b, &incoming]);
        Hosts {
            sock_a,
            sock_b,
            incoming,
            da,
            db,
        }
    }

    /// `vzram migrate` of A's device with `extra` (`--to ...`, `--commit`),
    /// its output piped, and SIGINT at its default as an operator's
    /// terminal would start it: a suite run in the background (`cmd &` in a
    /// script) inherits SIGINT ignored, and a Ctrl-C test would then wait
    /// for the move to fail on its own.
    pub fn migrate(&self, ctx: &Ctx, extra: &[&str]) -> Command {
        let mut c = Command::new(&ctx.bin);
        c.args([
            "migrate",
            "--control",
            s(&ctx.path("a.ctl")),
            "--device",
            "a",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        // SAFETY: between fork and exec only async-signal-safe calls:
        // signal(2) and sigprocmask(2) on this process's own state.
        unsafe {
            c.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGINT);
                libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
                Ok(())
            });
        }
        c
    }

    /// B's incoming address, as `--to` takes it.
    pub fn to(&self) -> String {
        format!("unix:{}", s(&self.incoming))
    }

    /// A's device's migration now.
    pub fn a(&mut self) -> MigrationStat {
        self.da.stat_cli().dev_at(&self.sock_a).migration.clone()
    }

    /// B's device's migration now.
    pub fn b(&mut self) -> MigrationStat {
        self.db.stat_cli().dev_at(&self.sock_b).migration.clone()
    }
}

/// A guest swapping on `sock` (256 MiB of RAM, 2 queues) for `rounds`
/// pressure rounds, with QMP on `qmp`.
pub fn swapping(sock: &Path, qmp: &Path, rounds: u32) -> GuestOpts {
    GuestOpts::new(sock, "swap")
        .queues(2)
        .mem("256M")
        .arg(format!("vzram.rounds={rounds}"))
        .qemu_arg("-qmp")
        .qemu_arg(format!("unix:{},server=on,wait=off", s(qmp)))
}

/// Waits until `d`'s device at `sock` is in migration state `want`.
pub fn wait_migration(
    d: &mut Daemon,
    sock: &Path,
    want: MigrationState,
    limit: Duration,
) -> MigrationStat {
    let start = Instant::now();
    let deadline = start + limit;
    loop {
        let m = d.stat_cli().dev_at(sock).migration.clone();
        if m.state == want {
            // Where a slow run's time went, should a later step fail.
            eprintln!(
                "  {} {want:?} after {:.1}s",
                sock.display(),
                start.elapsed().as_secs_f64()
            );
            return m;
        }
        ensure!(
            Instant::now() < deadline,
            "not {want:?} after {limit:?}: {m:?}"
        );
        thread::sleep(Duration::from_millis(100));
    }
}
