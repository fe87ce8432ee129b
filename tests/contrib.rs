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

/// `systemctl reload vzram` runs `vzram reload` on the unit's control
/// socket (tests/reload.rs), which waits for the result: a refused file
/// fails the reload. Type=notify stays: notify-reload is systemd 253 on,
/// and Debian 12 has 252. The states live in the runtime directory, kept
/// across stops.
#[test]
fn the_service_reloads_through_the_control_socket_and_keeps_its_states() {
    let unit = std::fs::read_to_string(root().join("contrib/systemd/vzram.service")).unwrap();
    let has = |line: &str| unit.lines().any(|l| l.trim() == line);
    assert!(
        has("ExecReload=/usr/bin/vzram reload --control /run/vzram/control.sock"),
        "{unit}"
    );
    assert!(unit.contains("\nExecStart=/usr/bin/vzram serve --config /etc/vzram/vzram.toml --control /run/vzram/control.sock "));
    assert!(has("Type=notify"), "{unit}");
    assert!(has("RuntimeDirectory=vzram"), "{unit}");
    assert!(has("RuntimeDirectoryPreserve=yes"), "{unit}");
}

/// The metric and label names a scrape holds: every `# TYPE` name (a
/// histogram's with its `_bucket`, `_sum` and `_count`) and every label.
fn exported_names(body: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for l in body.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            let mut w = rest.split_whitespace();
            let (name, ty) = (w.next().unwrap(), w.next().unwrap_or_default());
            names.insert(name.to_string());
            if ty == "histogram" {
                for s in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{s}"));
                }
            }
        } else if let Some((_, labels)) = l.split_once('{') {
            for pair in labels.split(',') {
                if let Some((k, _)) = pair.split_once('=') {
                    names.insert(k.trim().to_string());
                }
            }
        }
    }
    names
}

/// The `vzram_*` and `process_*` words of `text`.
fn named_in(text: &str) -> std::collections::BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("vzram_") || w.starts_with("process_"))
        // `vzram_*` in a comment.
        .filter(|w| !w.ends_with('_'))
        .map(str::to_string)
        .collect()
}

/// contrib/prometheus: the alert rules pass `promtool check rules` and
/// their unit tests (`promtool test rules`), every
/// query of the dashboard parses (as a recording rule, through the same
/// check), and every metric and label either names is one a live daemon
/// exports on /metrics.
#[test]
fn the_prometheus_rules_and_dashboard_name_what_the_daemon_exports() {
    let dir_p = root().join("contrib/prometheus");
    let rules_path = dir_p.join("vzram.rules.yml");
    let rules = std::fs::read_to_string(&rules_path).unwrap();
    let dash_text = std::fs::read_to_string(dir_p.join("vzram-dashboard.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&dash_text).unwrap();
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    assert!(exprs.len() >= 10, "{exprs:?}");

    let tmp = TempDir::new("prom");
    if have("promtool") {
        let check = |path: &Path| {
            let o = Command::new("promtool")
                .args(["check", "rules"])
                .arg(path)
                .output()
                .unwrap();
            assert!(o.status.success(), "{}: {o:?}", path.display());
        };
        check(&rules_path);
        // The alerts fire on the series of a vzram in trouble, after their
        // `for:`, with their texts (contrib/prometheus/vzram.rules.test.yml).
        let o = Command::new("promtool")
            .args(["test", "rules", "vzram.rules.test.yml"])
            .current_dir(&dir_p)
            .output()
            .unwrap();
        assert!(o.status.success(), "promtool test rules: {}", said(&o));
        // The dashboard's queries, each a recording rule.
        let mut yml = String::from("groups:\n  - name: dashboard\n    rules:\n");
        for (i, e) in exprs.iter().enumerate() {
            yml.push_str(&format!(
                "      - record: dashboard:query{i}\n        expr: {}\n",
                serde_json::to_string(e).unwrap()
            ));
        }
        let path = tmp.join("dashboard.rules.yml");
        std::fs::write(&path, yml).unwrap();
        check(&path);
    }

    // A daemon with one device that served I/O (so that its histogram
    // has series) and one left-over state.
    let a = tmp.join("a.sock");
    let b = tmp.join("b.sock");
    let mut d = Daemon::start(
        &tmp,
        &["--device", &format!("socket={},size=16M,name=old", s(&b))],
        &[&b],
    );
    d.terminate_cleanly();
    drop(d);
    let d = Daemon::start(
        &tmp,
        &[
            "--device",
            &format!("socket={},size=16M,name=vm1", s(&a)),
            "--metrics",
            "127.0.0.1:0",
        ],
        &[&a],
    );
    let mut c = Client::connect(&a, 1).unwrap();
    c.q(0).write(0, &[7u8; 8192]).unwrap();
    c.q(0).read(0, 8192).unwrap();
    let addr: std::net::SocketAddr = d.stat().0.metrics.unwrap().parse().unwrap();
    let body = vzram_tests::metrics::scrape(addr);
    let exported = exported_names(&body);
    for (what, text) in [
        ("vzram.rules.yml", &rules),
        ("vzram-dashboard.json", &dash_text),
    ] {
        let unknown: Vec<_> = named_in(text)
            .into_iter()
            .filter(|n| !exported.contains(n))
            .collect();
        assert!(
            unknown.is_empty(),
            "{what} names what /metrics does not export: {unknown:?}\n{body}"
        );
    }
    // Not vacuous: the names the alerts are about are there.
    let in_rules = named_in(&rules);
    for n in [
        "vzram_pool_mem_used_bytes",
        "vzram_worker_restarts_total",
        "vzram_migration_state",
        "process_open_fds",
    ] {
        assert!(in_rules.contains(n), "{n}");
    }
    drop(c);
}
