//! The control server on a supervisor of two devices, no launcher.

use super::super::WorkerEnv;
use super::*;
use crate::proto::control::cmd;
use crate::proto::worker_spec::{LogLevel, SeccompMode};
use serde_json::json;
use vzram_store::cells::Phase;
use vzram_store::{Codec, DeviceConfig, Pool, PoolConfig, StateSpec};

/// One request line as the socket's server answers it.
fn handle_line(c: &Control, line: &str) -> Value {
    let r = c.answer(c.parse(line.as_bytes()));
    assert!(!r.close);
    serde_json::from_slice(&r.bytes).unwrap()
}

/// A supervisor over two devices with state in a temporary directory;
/// no launcher (nothing connects here).
fn control(root: &std::path::Path) -> Control {
    let host = tempfile_in(root, "host");
    let pool = Pool::with_host_file(
        PoolConfig {
            host_mem_limit: 0,
            arena_bytes: 1 << 28,
            host_staging: 0,
        },
        &host,
    )
    .unwrap();
    let devices = ["a", "b"]
        .iter()
        .map(|n| {
            let mut dc = DeviceConfig::new(1 << 20, Codec::Lz4);
            dc.state = Some(StateSpec {
                root: root.to_path_buf(),
                name: n.to_string(),
                existing: vzram_store::Existing::Discard,
                ..StateSpec::default()
            });
            let store = pool.create_device(dc).unwrap();
            let files = store.state_files().unwrap().try_clone().unwrap();
            let listener =
                std::os::unix::net::UnixListener::bind(root.join(format!("{n}.sock"))).unwrap();
            let spec = crate::config::DeviceSpec {
                name: n.to_string(),
                named: true,
                socket: root.join(format!("{n}.sock")),
                size: 1 << 20,
                queues: 1,
                algo: Codec::Lz4,
                mem_limit: 0,
                serial: n.to_string(),
                readonly: false,
                discard_segments: 1,
                staging: 0,
                state_dir: None,
                on_state: crate::config::OnState::Unsaid,
                adopt: false,
                tier: crate::config::TierSpec::none(Codec::Lz4),
                incoming: None,
            };
            Arc::new(Served::new(spec, listener, files, None).unwrap())
        })
        .collect();
    let (launcher, _) = crate::proto::wire::seqpacket_pair().unwrap();
    let sup = Supervisor::new(
        devices,
        pool,
        host,
        launcher,
        WorkerEnv {
            seccomp: SeccompMode::Off,
            log_level: LogLevel::Info,
            log_format: Default::default(),
            socket_mode: 0o600,
            state_dir: root.to_path_buf(),
            control: root.join("control.sock"),
            compress_threads: None,
            incoming_timeout: std::time::Duration::from_secs(3600),
            incoming_mode: 0o600,
            tls: None,
            poll_us: None,
        },
    )
    .unwrap();
    Control::new(Arc::new(sup))
}

fn tempfile_in(dir: &std::path::Path, name: &str) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join(name))
        .unwrap()
}

fn limit(c: &Control, i: usize) -> u64 {
    c.devices()[i].1.cells.budget().limit()
}

/// What the client sends is what the daemon reads, field for field.
#[test]
fn typed_requests_round_trip() {
    let cases: [(Request, &str); 9] = [
        (cmd::Stat {}.into(), r#"{"cmd":"stat"}"#),
        (
            cmd::SetLimit {
                device: None,
                host: true,
                bytes: 5,
            }
            .into(),
            r#"{"cmd":"set-limit","host":true,"bytes":5}"#,
        ),
        (
            cmd::SetLimit {
                device: Some(DeviceRef::named("vm1")),
                host: false,
                bytes: 5,
            }
            .into(),
            r#"{"cmd":"set-limit","device":"vm1","bytes":5}"#,
        ),
        (cmd::Compact { device: None }.into(), r#"{"cmd":"compact"}"#),
        (
            cmd::ResetMax {
                device: Some(DeviceRef::Index(2)),
            }
            .into(),
            r#"{"cmd":"reset-max","device":2}"#,
        ),
        (
            cmd::Add {
                device: Box::new(crate::proto::control::NewDevice {
                    socket: Some("/a".into()),
                    size: Some(1 << 20),
                    algo: Some(Codec::Zstd { level: 3 }),
                    ..Default::default()
                }),
            }
            .into(),
            r#"{"cmd":"add","device":{"socket":"/a","size":1048576,"algo":"zstd:3"}}"#,
        ),
        (
            cmd::MarkIdle {
                device: DeviceRef::named("vm1"),
            }
            .into(),
            r#"{"cmd":"mark-idle","device":"vm1"}"#,
        ),
        (
            cmd::Recompress {
                device: DeviceRef::named("vm1"),
                idle: true,
                huge: false,
                algo: Some(Codec::Zstd { level: 3 }),
            }
            .into(),
            r#"{"cmd":"recompress","device":"vm1","idle":true,"algo":"zstd:3"}"#,
        ),
        (
            cmd::Writeback {
                device: DeviceRef::Index(0),
                idle: false,
                cold: true,
                huge: false,
                incompressible: true,
                max_pages: Some(10),
            }
            .into(),
            r#"{"cmd":"writeback","device":0,"cold":true,"incompressible":true,"max_pages":10}"#,
        ),
    ];
    for (req, wire) in cases {
        assert_eq!(serde_json::to_string(&req).unwrap(), wire);
        let back: Request = serde_json::from_str(wire).unwrap();
        assert_eq!(serde_json::to_string(&back).unwrap(), wire);
    }
}

#[test]
fn requests() {
    let root = std::env::temp_dir().join(format!("vzram-control-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let c = control(&root);
    // Framing: a line at a time, each no longer than MAX_LINE.
    assert_eq!(c.frame(b"{\"cmd\":"), Frame::Need);
    assert_eq!(c.frame(b"{}\n{}\n"), Frame::Request(3));
    assert_eq!(c.frame(&vec![b' '; MAX_LINE]), Frame::TooLong);
    let mut long = vec![b' '; MAX_LINE];
    long.push(b'\n');
    assert_eq!(c.frame(&long), Frame::TooLong);
    assert!(matches!(c.parse(b"  \n"), Line::Blank));
    assert!(c.answer(c.parse(b"\n")).bytes.is_empty());
    assert!(matches!(c.parse(b"\xff\n"), Line::Bad(_)));
    // Only what never waits is answered on the loop.
    assert!(c.quick(&c.parse(b"{\"cmd\":\"stat\"}\n")));
    assert!(c.quick(&c.parse(b"nonsense\n")));
    assert!(!c.quick(&c.parse(b"{\"cmd\":\"compact\"}\n")));
    assert!(c.too_long().close);
    let s = handle_line(&c, r#"{"cmd":"stat"}"#);
    assert_eq!(s["ok"], true);
    // Every reply says which daemon answered, refusals and bad lines too.
    assert_eq!(s["version"], crate::proto::VERSION, "{s}");
    for bad in [r#"{"cmd":"remove","device":"nope"}"#, "nonsense"] {
        let r = handle_line(&c, bad);
        assert_eq!(
            (&r["ok"], &r["version"]),
            (&json!(false), &json!(crate::proto::VERSION)),
            "{r}"
        );
    }
    assert_eq!(s["devices"].as_array().unwrap().len(), 2);
    assert_eq!(s["devices"][1]["name"], "b");
    assert_eq!(s["pool"]["devices"], 2);

    let r = handle_line(&c, r#"{"cmd":"set-limit","device":"b","bytes":65536}"#);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(limit(&c, 1), 65536);
    let r = handle_line(&c, r#"{"cmd":"set-limit","device":0,"bytes":4096}"#);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(limit(&c, 0), 4096);
    let r = handle_line(&c, r#"{"cmd":"set-limit","device":"1","bytes":8192}"#);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(limit(&c, 1), 8192);
    // Above the device's size (1 MiB): refused, the limit unchanged.
    let r = handle_line(&c, r#"{"cmd":"set-limit","device":"b","bytes":2097152}"#);
    assert!(
        r["error"].as_str().unwrap().contains("above its size"),
        "{r}"
    );
    assert_eq!(limit(&c, 1), 8192);
    let r = handle_line(&c, r#"{"cmd":"set-limit","host":true,"bytes":1048576}"#);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(c.sup.pool.host_mem_limit(), 1 << 20);
    let r = handle_line(&c, r#"{"cmd":"compact"}"#);
    assert_eq!(r["ok"], true, "{r}");
    // Tiering on a device no worker serves: done here.
    let r = handle_line(&c, r#"{"cmd":"mark-idle","device":"a"}"#);
    assert_eq!(
        (&r["ok"], &r["pages_marked"]),
        (&json!(true), &json!(0)),
        "{r}"
    );
    let r = handle_line(&c, r#"{"cmd":"recompress","device":"a","idle":true}"#);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["algo"], "zstd:3", "the default for an lz4 device: {r}");
    let r = handle_line(&c, r#"{"cmd":"recompress","device":"a","algo":"lz4"}"#);
    assert!(
        r["error"].as_str().unwrap().contains("another codec"),
        "{r}"
    );
    let r = handle_line(&c, r#"{"cmd":"recompress","device":"a","algo":"gzip"}"#);
    assert!(r["error"].as_str().unwrap().contains("gzip"), "{r}");
    let r = handle_line(&c, r#"{"cmd":"writeback","device":"b","idle":true}"#);
    assert_eq!(
        r["error"], "device b has no backing file (give it backing-file=PATH)",
        "{r}"
    );
    let s = handle_line(&c, r#"{"cmd":"stat"}"#);
    assert_eq!(s["devices"][0]["tier"]["backing"], Value::Null, "{s}");
    assert_eq!(s["devices"][0]["stats"]["backed_pages"], 0, "{s}");

    // Each refusal says its kind, which the client's exit status follows.
    for (bad, kind) in [
        ("nonsense", "bad-request"),
        (r#"{"cmd":"reboot"}"#, "bad-request"),
        (r#"{"cmd":"set-limit","bytes":1}"#, "bad-request"),
        (
            r#"{"cmd":"set-limit","device":"zz","bytes":1}"#,
            "not-found",
        ),
        (r#"{"cmd":"set-limit","device":5,"bytes":1}"#, "not-found"),
        (
            r#"{"cmd":"set-limit","device":"a","host":true,"bytes":1}"#,
            "bad-request",
        ),
        (r#"{"cmd":"stat","extra":1}"#, "bad-request"),
        (r#"{"cmd":"compact","device":"a","extra":1}"#, "bad-request"),
        (
            r#"{"cmd":"writeback","device":"b","idle":true}"#,
            "conflict",
        ),
    ] {
        let r = handle_line(&c, bad);
        assert_eq!(r["ok"], false, "{bad} → {r}");
        assert!(r["error"].is_string());
        assert_eq!(r["kind"], kind, "{bad} → {r}");
    }
    let r = handle_line(&c, r#"{"cmd":"compact","device":"vm9"}"#);
    assert_eq!(
        r["error"],
        "no device \"vm9\"; devices (by name or index): a (0), b (1)"
    );
    let r = handle_line(&c, r#"{"cmd":"compact","device":7}"#);
    assert!(r["error"]
        .as_str()
        .unwrap()
        .starts_with("no device 7; devices (by name or index): a (0), b (1)"));
    drop(c);
    std::fs::remove_dir_all(&root).unwrap();
}

/// A move its owner marked failed is shown under way until this process
/// has its reason: `stat` never says failed without saying why.
#[test]
fn a_failed_move_shows_with_its_reason_or_as_under_way() {
    let root = std::env::temp_dir().join(format!("vzram-control-mf-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let c = control(&root);
    let d = c.devices()[0].1.clone();
    let state =
        |c: &Control| handle_line(c, r#"{"cmd":"stat"}"#)["devices"][0]["migration"].clone();
    let (ours, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    d.migration.set_arriving(Some(ours.into()));
    d.cells.migration.set(Phase::Failed);
    let m = state(&c);
    assert_eq!(
        (&m["state"], &m["error"]),
        (&json!("receiving"), &Value::Null),
        "{m}"
    );
    d.migration.set_error(Some("cut".into()));
    d.migration.set_arriving(None);
    let m = state(&c);
    assert_eq!(
        (&m["state"], &m["error"]),
        (&json!("failed"), &json!("cut")),
        "{m}"
    );
    // The same for a send, while its owner's outcome is not recorded; a
    // `vzram migrate` still connecting shows the last one as it was.
    let sending = d.migration.begin_send().unwrap();
    d.cells.migration.set(Phase::SendFailed);
    assert_eq!(state(&c)["state"], "send-failed");
    let settling = d.migration.settle();
    assert_eq!(state(&c)["state"], "sending");
    drop(settling);
    assert_eq!(state(&c)["state"], "send-failed");
    drop(sending);
    let _ = std::fs::remove_dir_all(&root);
}
