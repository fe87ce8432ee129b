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
    "usr/share/man/man1/vzram-reload.1.gz",
    "usr/share/man/man5/vzram.toml.5.gz",
    "usr/share/bash-completion/completions/vzram",
    "usr/share/zsh/vendor-completions/_vzram",
    "usr/share/fish/vendor_completions.d/vzram.fish",
    "usr/share/qemu/vhost-user/50-vzram.json",
    "usr/share/doc/vzram/copyright",
    "usr/share/doc/vzram/README.md",
    "usr/share/doc/vzram/SECURITY.md",
    "usr/share/doc/vzram/docs/configuration.md",
    "usr/share/doc/vzram/docs/migration.md",
    "usr/share/doc/vzram/changelog.Debian.gz",
    "usr/share/doc/vzram/examples/libvirt/vzram-swap-disk.xml",
    "usr/share/doc/vzram/examples/libvirt/hooks/qemu",
    "usr/share/doc/vzram/examples/cloud-hypervisor/run.sh",
    "usr/share/doc/vzram/examples/migration/qemu-migrate.sh",
    "usr/share/doc/vzram/examples/systemd/vzram.service",
    "usr/share/doc/vzram/examples/systemd/vzram.socket",
    "usr/share/doc/vzram/examples/systemd/vzram-control.socket",
    "usr/share/doc/vzram/examples/prometheus/vzram.rules.yml",
    "usr/share/doc/vzram/examples/prometheus/vzram-dashboard.json",
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
    // Debian revision 1: not a native package.
    let deb_version = format!("{version}-1");
    assert_eq!(
        deb,
        t.join("out")
            .join(format!("vzram_{deb_version}_{}.deb", arch.trim())),
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
    assert_eq!(field("Version").trim(), deb_version);
    let depends = field("Depends");
    assert!(depends.contains("libc6 (>= 2."), "{depends}");
    let ctrl = t.join("DEBIAN");
    run(Command::new("dpkg-deb").arg("-e").arg(&deb).arg(&ctrl));
    assert_eq!(
        read(&ctrl.join("conffiles")).trim(),
        "/etc/vzram/vzram.toml"
    );
    for script in ["postinst", "prerm", "postrm"] {
        run(Command::new("sh").arg("-n").arg(ctrl.join(script)));
    }

    // Unpacked, every file but the conffile has its right md5sum, and
    // the changelog is this version's.
    let r = t.join("root");
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&r));
    let sums = read(&ctrl.join("md5sums"));
    let summed: Vec<&str> = sums.lines().filter_map(|l| l.split("  ").nth(1)).collect();
    for f in FILES.iter().filter(|f| !f.starts_with("etc/")) {
        assert!(summed.contains(f), "{f} is not in md5sums:\n{sums}");
    }
    run(Command::new("md5sum")
        .args(["--check", "--quiet"])
        .arg(ctrl.join("md5sums"))
        .current_dir(&r));
    let changelog =
        stdout(Command::new("zcat").arg(r.join("usr/share/doc/vzram/changelog.Debian.gz")));
    assert!(
        changelog.starts_with(&format!("vzram ({deb_version}) unstable; urgency=medium\n")),
        "{changelog}"
    );
    if have("lintian", true) {
        // No error; the warnings left are listed in deb.sh.
        let o = Command::new("lintian")
            .args(["--fail-on", "error"])
            .arg(&deb)
            .output()
            .unwrap();
        let text = said(&o);
        assert!(
            o.status.success() && !text.lines().any(|l| l.starts_with("E: ")),
            "lintian: {}\n{text}",
            o.status
        );
        // And no warning but the one deb.sh explains.
        let warned: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("W: ") && !l.contains(" initial-upload-closes-no-bugs "))
            .collect();
        assert!(warned.is_empty(), "new lintian warnings: {warned:?}");
    }

    // The binary is this version and serves a device.
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
        let o = run(Command::new("dpkg")
            .arg(format!("--root={}", dr.display()))
            .args(["--force-script-chrootless", "--force-depends"])
            .args(args));
        String::from_utf8_lossy(&o.stderr).into_owned()
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
    // A purge keeps the device states (each a VM's disk) and says so on
    // stderr, with the command that deletes each: it runs, and deletes
    // that one only.
    let state = dr.join("run/vzram/state/vm1");
    let other = dr.join("run/vzram/state/vm2");
    for st in [&state, &other] {
        std::fs::create_dir_all(st).unwrap();
        std::fs::write(st.join("header"), b"VZRAMST\0").unwrap();
        std::fs::write(st.join("arena"), pattern(1, 0, 4096)).unwrap();
    }
    let said = dpkg(&["--purge", "vzram"]);
    assert!(
        state.join("header").is_file() && state.join("arena").is_file(),
        "the purge deleted a VM's state:\n{said}"
    );
    assert!(
        said.contains("keeps the device states") && said.contains("/run/vzram/state/vm1"),
        "the purge does not say on stderr which states it keeps:\n{said}"
    );
    let cmd = said
        .lines()
        .find(|l| l.contains("/vm1"))
        .and_then(|l| l.split_once("delete it with: "))
        .map(|(_, c)| c.to_string())
        .unwrap_or_else(|| panic!("no command for vm1 in:\n{said}"));
    run(Command::new("sh").arg("-c").arg(&cmd));
    assert!(!state.exists(), "{cmd}");
    assert!(other.join("header").is_file(), "{cmd} deleted vm2 too");
    for f in FILES {
        assert!(!dr.join(f).exists(), "{f} is left after a purge");
    }
}

/// Runs maintainer script `script` with `args` in a mount namespace whose
/// /run is a fresh tmpfs (holding /run/systemd/system when `systemd`, as a
/// host booted with systemd has it), with stand-ins for the tools it calls
/// first on PATH. Returns the calls they recorded, one line each, and the
/// script's stderr. `prepare` runs first in that /run (a shell command).
fn maintainer_script(
    t: &TempDir,
    script: &Path,
    args: &[&str],
    systemd: bool,
    prepare: &str,
) -> (Vec<String>, String) {
    let fake = t.join("fake-bin");
    let log = t.join("calls.log");
    std::fs::create_dir_all(&fake).unwrap();
    for tool in [
        "deb-systemd-invoke",
        "deb-systemd-helper",
        "systemctl",
        "systemd-sysusers",
        "udevadm",
        "useradd",
        "groupadd",
    ] {
        let p = fake.join(tool);
        std::fs::write(&p, format!("#!/bin/sh\necho \"{tool} $*\" >>\"$CALLS\"\n")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let _ = std::fs::remove_file(&log);
    std::fs::write(&log, "").unwrap();
    let inner = format!(
        "mount -t tmpfs vzram-test /run && {} {prepare} && exec sh \"$0\" \"$@\"",
        if systemd {
            "mkdir -p /run/systemd/system &&"
        } else {
            ""
        }
    );
    let o = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &inner])
        .arg(script)
        .args(args)
        .env(
            "PATH",
            format!("{}:{}", fake.display(), std::env::var("PATH").unwrap()),
        )
        .env("CALLS", &log)
        .env_remove("DPKG_ROOT")
        .output()
        .unwrap();
    assert!(o.status.success(), "{script:?} {args:?}: {}", said(&o));
    let calls = read(&log).lines().map(str::to_string).collect();
    (calls, String::from_utf8_lossy(&o.stderr).into_owned())
}

/// The maintainer scripts, run as dpkg runs them, call systemd's Debian
/// helpers as dh_installsystemd's would: a first install enables and
/// starts nothing; an upgrade restarts a running daemon (try-restart) and
/// stops nothing first; a removal stops the service and its sockets and
/// masks them; a purge forgets them and lists the states it keeps. With
/// no systemd running (a container) nothing is stopped or started.
#[test]
fn the_maintainer_scripts_call_the_debian_helpers() {
    if !have("dpkg-deb", true) {
        return;
    }
    if stdout(Command::new("id").arg("-u")).trim() != "0" {
        eprintln!("skipped: a private /run needs root (unshare --mount)");
        return;
    }
    let t = TempDir::new("deb-scripts");
    let pkg = root().join("contrib/package");
    let units = ["vzram.service", "vzram.socket", "vzram-control.socket"];
    let each = |verbs: &[&str]| -> Vec<String> {
        units
            .iter()
            .flat_map(|u| {
                verbs
                    .iter()
                    .map(move |v| format!("deb-systemd-helper {v} {u}"))
            })
            .collect()
    };
    let mut configure = vec!["systemd-sysusers vzram.conf".to_string()];
    configure.extend(each(&["unmask", "update-state"]));

    // A first install: the user, the helpers' records, a daemon-reload.
    let (calls, _) = maintainer_script(&t, &pkg.join("postinst"), &["configure"], true, "true");
    let mut want = configure.clone();
    want.push("systemctl --system daemon-reload".into());
    assert_eq!(calls, want);
    // An upgrade: the same, and a running daemon restarted.
    let (calls, _) = maintainer_script(
        &t,
        &pkg.join("postinst"),
        &["configure", "0.0.9-1"],
        true,
        "true",
    );
    want.push("deb-systemd-invoke try-restart vzram.service".into());
    assert_eq!(calls, want);
    // Nothing stops before an upgrade.
    let (calls, _) = maintainer_script(
        &t,
        &pkg.join("prerm"),
        &["upgrade", "0.1.1-1"],
        true,
        "true",
    );
    assert_eq!(calls, Vec::<String>::new());
    // A removal stops the service and its sockets, then masks them.
    let (calls, _) = maintainer_script(&t, &pkg.join("prerm"), &["remove"], true, "true");
    assert_eq!(
        calls,
        ["deb-systemd-invoke stop vzram.service vzram.socket vzram-control.socket"]
    );
    let (calls, _) = maintainer_script(&t, &pkg.join("postrm"), &["remove"], true, "true");
    let mut want = each(&["mask"]);
    want.push("systemctl --system daemon-reload".into());
    assert_eq!(calls, want);
    // A purge forgets them, keeps the states and says which, on stderr.
    let prepare =
        "mkdir -p /run/vzram/state/vm1 /run/vzram/state/tmp && : >/run/vzram/state/vm1/header";
    let (calls, err) = maintainer_script(&t, &pkg.join("postrm"), &["purge"], true, prepare);
    assert_eq!(calls, each(&["purge", "unmask"]));
    assert!(
        err.contains("vzram: purge keeps the device states in /run/vzram/state")
            && err.contains("rm -r -- '/run/vzram/state/vm1'")
            && !err.contains("state/tmp"),
        "{err}"
    );

    // No systemd running: the records only, nothing stopped or started.
    let (calls, _) = maintainer_script(
        &t,
        &pkg.join("postinst"),
        &["configure", "0.0.9-1"],
        false,
        "true",
    );
    assert_eq!(calls, configure);
    let (calls, _) = maintainer_script(&t, &pkg.join("prerm"), &["remove"], false, "true");
    assert_eq!(calls, Vec::<String>::new());
    let (calls, _) = maintainer_script(&t, &pkg.join("postrm"), &["remove"], false, "true");
    assert_eq!(calls, each(&["mask"]));
}
