//! What operators copy from contrib/ as it is: every libvirt XML validates
//! against libvirt's schemas, the systemd units verify, and the units keep
//! the control socket private and stop retrying a configuration error.
//! CI installs the tools (`CI` set: a missing tool fails); elsewhere a
//! missing tool skips its check with a line.

use std::path::{Path, PathBuf};
use std::process::Command;

use vzram_tests::*;

/// Whether `tool` runs; in CI its absence is a failure.
fn have(tool: &str) -> bool {
    let ok = Command::new(tool).arg("--help").output().is_ok();
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "{tool} is missing, and CI must run this check (.ci/run installs it)"
        );
        eprintln!("skipped: no {tool}");
    }
    ok
}

fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, ext, out);
        } else if p.extension().is_some_and(|x| x == ext) {
            out.push(p);
        }
    }
}

#[test]
fn every_libvirt_xml_in_contrib_validates() {
    let mut xml = Vec::new();
    files(&root().join("contrib"), "xml", &mut xml);
    assert!(!xml.is_empty(), "no XML in contrib/");
    if !have("virt-xml-validate") {
        return;
    }
    for f in xml {
        let out = Command::new("virt-xml-validate").arg(&f).output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}{}",
            f.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn unit(name: &str) -> String {
    std::fs::read_to_string(root().join("contrib/systemd").join(name)).unwrap()
}

/// `systemd-analyze verify` in a scratch root laid out as the units expect
/// (the binary at /usr/bin/vzram, where the package puts it, /bin/kill
/// for `ExecReload=`, systemd's own units beside them):
/// any line it prints, a warning included, fails.
#[test]
fn the_systemd_units_verify() {
    if !have("systemd-analyze") {
        return;
    }
    let r = TempDir::new("units");
    let sys = r.join("etc/systemd/system");
    std::fs::create_dir_all(&sys).unwrap();
    std::fs::create_dir_all(r.join("usr/bin")).unwrap();
    std::fs::copy(vzram_bin(), r.join("usr/bin/vzram")).unwrap();
    // For ExecReload=: the host's /bin/kill (procps).
    std::fs::create_dir_all(r.join("bin")).unwrap();
    std::fs::copy("/bin/kill", r.join("bin/kill")).expect("/bin/kill (procps) for ExecReload=");
    std::fs::create_dir_all(r.join("usr/lib/systemd")).unwrap();
    let st = Command::new("cp")
        .args(["-a", "/lib/systemd/system"])
        .arg(r.join("usr/lib/systemd/"))
        .status()
        .unwrap();
    assert!(st.success(), "cannot copy systemd's units");
    let mut units = Vec::new();
    for e in std::fs::read_dir(root().join("contrib/systemd")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, sys.join(p.file_name().unwrap())).unwrap();
        units.push(p.file_name().unwrap().to_string_lossy().into_owned());
    }
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(format!("--root={}", r.path().display()))
        .args(&units)
        .output()
        .unwrap();
    let said = said(&out);
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify {units:?}: {}\n{said}",
        out.status
    );
}

#[test]
fn the_units_keep_the_control_socket_private_and_do_not_retry_a_bad_config() {
    let service = unit("vzram.service");
    assert!(
        service.lines().any(|l| l == "RestartPreventExitStatus=2"),
        "vzram.service retries a configuration error for ever"
    );
    let devices = unit("vzram.socket");
    assert!(
        !devices
            .lines()
            .any(|l| l.starts_with("ListenStream=") && l.ends_with("/control.sock")),
        "the control socket shares the device sockets' mode in vzram.socket"
    );
    let control = unit("vzram-control.socket");
    assert!(control.contains("ListenStream=/run/vzram/control.sock"));
    assert!(control.lines().any(|l| l == "SocketMode=0600"));
    assert!(!control.contains("SocketGroup="));
    // The service's --control is the socket the unit passes.
    assert!(service.contains("--control /run/vzram/control.sock"));
}

/// `systemctl reload vzram` sends SIGHUP, which reads the config again
/// (tests/reload.rs), instead of failing for want of `ExecReload=`.
#[test]
fn the_service_reloads_with_sighup() {
    let unit = std::fs::read_to_string(root().join("contrib/systemd/vzram.service")).unwrap();
    assert!(
        unit.lines()
            .any(|l| l.trim() == "ExecReload=/bin/kill -HUP $MAINPID"),
        "{unit}"
    );
}
