//! The Debian package, `contrib/package/deb.sh`, built from this test's
//! own daemon (`VZRAM_DEB_BIN`, so no release build here: the script makes
//! one by default), then listed, unpacked into a scratch root and used: the
//! packaged binary serves a device, the packaged example config serves as
//! the unit would run it, the manual pages, completions, sysusers file and
//! QEMU's backend descriptor are what they claim to be, and dpkg installs,
//! reinstalls and purges it in a scratch root. CI must have
//! dpkg-deb (`CI` set: a missing one fails); elsewhere the test skips with
//! a line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use vzram_tests::*;

/// Every file the package must hold, as `dpkg-deb -c` names them.
const FILES: &[&str] = &[
    "usr/bin/vzram",
    "lib/systemd/system/vzram.service",
    "lib/systemd/system/vzram.socket",
    "lib/systemd/system/vzram-control.socket",
    "lib/udev/rules.d/60-vzram.rules",
    "usr/lib/sysusers.d/vzram.conf",
    "etc/vzram/vzram.toml",
    "usr/share/man/man1/vzram.1.gz",
    "usr/share/man/man1/vzram-serve.1.gz",
    "usr/share/man/man1/vzram-stat.1.gz",
    "usr/share/bash-completion/completions/vzram",
    "usr/share/zsh/vendor-completions/_vzram",
    "usr/share/fish/vendor_completions.d/vzram.fish",
    "usr/share/qemu/vhost-user/50-vzram.json",
    "usr/share/doc/vzram/copyright",
    "usr/share/doc/vzram/README.md",
];

/// Whether `tool` runs; with `required`, in CI its absence is a failure.
fn have(tool: &str, required: bool) -> bool {
    let ok = Command::new(tool).arg("--help").output().is_ok();
    if !ok {
        assert!(
            !required || std::env::var_os("CI").is_none(),
            "{tool} is missing, and CI must run this check"
        );
        eprintln!("skipped: no {tool}");
    }
    ok
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        out.status,
        said(&out)
    );
    out
}

fn stdout(cmd: &mut Command) -> String {
    String::from_utf8_lossy(&run(cmd).stdout).into_owned()
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn the_debian_package_holds_a_working_daemon() {
    if !have("dpkg-deb", true) {
        return;
    }
    let t = TempDir::new("deb");
    let built = stdout(
        Command::new(root().join("contrib/package/deb.sh"))
            .env("VZRAM_DEB_BIN", vzram_bin())
            .env("VZRAM_DEB_OUT", t.join("out")),
    );
    let deb = PathBuf::from(built.lines().last().unwrap_or_default());
    let arch = stdout(Command::new("dpkg").arg("--print-architecture"));
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        deb,
        t.join("out")
            .join(format!("vzram_{version}_{}.deb", arch.trim())),
        "{built}"
    );

    // Every file is there, owned by root.
    let listing = stdout(Command::new("dpkg-deb").arg("-c").arg(&deb));
    let listed: Vec<&str> = listing
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .collect();
    for f in FILES {
        assert!(
            listed.contains(&format!("./{f}").as_str()),
            "{f} is not in the package:\n{listing}"
        );
    }
    assert!(
        listing.lines().all(|l| l.contains(" root/root ")),
        "{listing}"
    );

    // The control file: this version, a glibc dependency, the config a conffile.
    let field = |f: &str| stdout(Command::new("dpkg-deb").arg("-f").arg(&deb).arg(f));
    assert_eq!(field("Package").trim(), "vzram");
    assert_eq!(field("Version").trim(), version);
    let depends = field("Depends");
    assert!(depends.contains("libc6 (>= 2."), "{depends}");
    let ctrl = t.join("DEBIAN");
    run(Command::new("dpkg-deb").arg("-e").arg(&deb).arg(&ctrl));
    assert_eq!(
        read(&ctrl.join("conffiles")).trim(),
        "/etc/vzram/vzram.toml"
    );
    for script in ["postinst", "postrm"] {
        run(Command::new("sh").arg("-n").arg(ctrl.join(script)));
    }

    // Unpacked, the binary is this version and serves a device.
    let r = t.join("root");
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&r));
    let bin = r.join("usr/bin/vzram");
    assert_eq!(
        stdout(Command::new(&bin).arg("--version")).trim(),
        format!("vzram {version}")
    );
    let sock = t.join("pkg.sock");
    let control = t.join("control.sock");
    let mut cmd = Command::new(&bin);
    cmd.args(["serve", "--socket", s(&sock), "--size", "16M"])
        .args(["--control", s(&control)]);
    let d = Daemon::start_command(cmd, &control, &t.join("serve.log"), &[&sock]);
    assert_eq!(d.stat().dev("pkg").size_bytes, 16 << 20);
    d.shutdown();

    // The example config, its /run/vzram moved into the temp dir, serves
    // with the unit's command line.
    let example = read(&r.join("etc/vzram/vzram.toml"));
    assert!(example.contains("/run/vzram/vm1.sock"), "{example}");
    let config = t.join("vzram.toml");
    let run_dir = format!("{}/", t.path().display());
    std::fs::write(&config, example.replace("/run/vzram/", &run_dir)).unwrap();
    let vm1 = t.join("vm1.sock");
    let mut cmd = Command::new(&bin);
    cmd.args(["serve", "--config", s(&config), "--control", s(&control)])
        .args(["--socket-mode", "0660"]);
    let d = Daemon::start_command(cmd, &control, &t.join("example.log"), &[&vm1]);
    assert_eq!(d.stat().dev_at(&vm1).name, "vm1");
    d.shutdown();
    let service = read(&r.join("lib/systemd/system/vzram.service"));
    assert!(
        service.contains("\nExecStart=/usr/bin/vzram serve --config /etc/vzram/vzram.toml "),
        "{service}"
    );

    // The manual pages name the commands.
    let man1 = r.join("usr/share/man/man1");
    let page = stdout(Command::new("zcat").arg(man1.join("vzram.1.gz")));
    assert!(page.contains(".TH vzram 1"), "{page}");
    assert!(page.contains("vzram\\-serve(1)"), "{page}");
    let serve = stdout(Command::new("zcat").arg(man1.join("vzram-serve.1.gz")));
    assert!(serve.contains("\\-\\-mem\\-limit"), "{serve}");
    if have("man", false) {
        let shown = stdout(
            Command::new("man")
                .arg("-l")
                .arg(man1.join("vzram.1.gz"))
                .env("MANWIDTH", "80")
                .env("MAN_KEEP_FORMATTING", ""),
        );
        assert!(shown.contains("vzram-serve(1)"), "{shown}");
    }

    // The completions know the commands; bash's parses.
    for f in [
        "usr/share/bash-completion/completions/vzram",
        "usr/share/zsh/vendor-completions/_vzram",
        "usr/share/fish/vendor_completions.d/vzram.fish",
    ] {
        let text = read(&r.join(f));
        assert!(text.contains("serve") && text.contains("mem-limit"), "{f}");
    }
    run(Command::new("bash")
        .arg("-n")
        .arg(r.join("usr/share/bash-completion/completions/vzram")));

    // QEMU's backend descriptor (docs/interop/vhost-user.json) names the
    // packaged binary, whose capabilities are of the same type.
    let json: Value =
        serde_json::from_str(&read(&r.join("usr/share/qemu/vhost-user/50-vzram.json"))).unwrap();
    assert_eq!(json["type"], "block", "{json}");
    assert_eq!(json["binary"], "/usr/bin/vzram", "{json}");
    assert!(json["description"].is_string(), "{json}");
    let caps: Value =
        serde_json::from_str(&stdout(Command::new(&bin).arg("--print-capabilities"))).unwrap();
    assert_eq!(caps["type"], json["type"], "{caps}");

    // Installed by dpkg into a scratch root (its maintainer scripts run
    // here with DPKG_ROOT set, so they touch only that root): the sysusers
    // file makes the unit's user, system, no login, in kvm; a second
    // install changes nothing; a purge leaves no file behind.
    if !have("systemd-sysusers", true) {
        return;
    }
    if stdout(Command::new("id").arg("-u")).trim() != "0" {
        eprintln!("skipped: dpkg --root needs root");
        return;
    }
    let dr = t.join("dpkg-root");
    std::fs::create_dir_all(dr.join("var/lib/dpkg/info")).unwrap();
    std::fs::create_dir_all(dr.join("var/lib/dpkg/updates")).unwrap();
    std::fs::write(dr.join("var/lib/dpkg/status"), "").unwrap();
    let dpkg = |args: &[&str]| {
        stdout(
            Command::new("dpkg")
                .arg(format!("--root={}", dr.display()))
                .args(["--force-script-chrootless", "--force-depends"])
                .args(args),
        )
    };
    for _ in 0..2 {
        dpkg(&["-i", s(&deb)]);
        let passwd = read(&dr.join("etc/passwd"));
        let users: Vec<&str> = passwd.lines().filter(|l| l.starts_with("vzram:")).collect();
        assert!(
            users.len() == 1 && users[0].ends_with(":/nonexistent:/usr/sbin/nologin"),
            "{passwd}"
        );
        let group = read(&dr.join("etc/group"));
        let kvm = group
            .lines()
            .find(|l| l.starts_with("kvm:"))
            .unwrap_or_else(|| panic!("no kvm group:\n{group}"));
        assert!(kvm.ends_with(":vzram"), "{kvm}");
        assert!(dr.join("usr/bin/vzram").is_file());
    }
    // A purge keeps the device states (each a VM's disk) and says so.
    let state = dr.join("run/vzram/state/vm1");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(state.join("header"), b"VZRAMST\0").unwrap();
    std::fs::write(state.join("arena"), pattern(1, 0, 4096)).unwrap();
    let said = dpkg(&["--purge", "vzram"]);
    assert!(
        state.join("header").is_file() && state.join("arena").is_file(),
        "the purge deleted a VM's state:\n{said}"
    );
    assert!(
        said.contains("keeps the device states") && said.contains("/run/vzram/state/vm1"),
        "the purge does not say which states it keeps:\n{said}"
    );
    for f in FILES {
        assert!(!dr.join(f).exists(), "{f} is left after a purge");
    }
}
