use super::*;
use std::path::Path;

#[test]
fn sizes() {
    assert_eq!(parse_size("512M"), Ok(512 << 20));
    assert_eq!(parse_size("8G"), Ok(8 << 30));
    assert_eq!(parse_size("1T"), Ok(1 << 40));
    assert_eq!(parse_size("64k"), Ok(64 << 10));
    assert_eq!(parse_size("2GiB"), Ok(2 << 30));
    assert_eq!(parse_size("4096"), Ok(4096));
    assert_eq!(parse_size("0"), Ok(0));
    assert_eq!(parse_size("8Gi"), Ok(8 << 30));
    assert_eq!(parse_size("512Mi"), Ok(512 << 20));
    assert_eq!(parse_size("1.5G"), Ok(3 << 29));
    assert_eq!(parse_size("0.5M"), Ok(512 << 10));
    assert_eq!(parse_size("1.25GiB"), Ok(5 << 28));
    assert!(parse_size("1.3M")
        .unwrap_err()
        .to_string()
        .contains("multiples of 4096"));
    for bad in [
        "",
        "G",
        "12Q",
        "-1G",
        "8 G",
        "99999999999T",
        "1.G",
        ".5G",
        "1..5G",
        "1.5.G",
        "8iG",
        "100P",
        "1E",
        "1.0000000000000000000000000000000000000001G",
    ] {
        assert!(parse_size(bad).is_err(), "{bad:?} parsed");
    }
}

#[test]
fn modes() {
    assert_eq!(parse_mode("0600"), Ok(0o600));
    assert_eq!(parse_mode("660"), Ok(0o660));
    assert!(parse_mode("0800").is_err());
    assert!(parse_mode("1777").is_err());
    assert!(parse_mode("").is_err());
}

#[test]
fn device_spec() {
    let d = parse_device_spec(
        "socket=/tmp/a.sock,size=1G,queues=2,mem-limit=256M,algo=zstd:3,serial=abc,readonly=true",
    )
    .unwrap();
    assert_eq!(d.socket, Some(PathBuf::from("/tmp/a.sock")));
    assert_eq!(d.size, Some(1 << 30));
    assert_eq!(d.queues, Some(2));
    assert_eq!(d.mem_limit, Some(256 << 20));
    assert_eq!(d.algo, Some(Codec::Zstd { level: 3 }));
    assert_eq!(d.readonly, Some(true));
    assert!(parse_device_spec("socket=/a,colour=red").is_err());
    for twice in [
        "socket=/a,size=1G,socket=/b",
        "socket=/a,size=1G,size=2G",
        "socket=/a,size=1G,mem-limit=1G,mem_limit=2G",
    ] {
        let e = parse_device_spec(twice).unwrap_err().to_string();
        assert!(e.contains("given twice"), "{twice}: {e}");
    }
    assert!(parse_device_spec("socket").is_err());
    assert!(parse_device_spec("size=12Q").is_err());
    assert!(parse_device_spec("algo=gzip").is_err());
}

fn draft(sock: &str, size: u64) -> DeviceDraft {
    DeviceDraft {
        socket: Some(sock.into()),
        size: Some(size),
        ..Default::default()
    }
}

#[test]
fn default_serials() {
    assert_eq!(default_serial("vm1"), "vzram-vm1");
    // Cut to 20 bytes, not across a character.
    assert_eq!(default_serial("a-rather-long-name"), "vzram-a-rather-long-");
    assert_eq!(default_serial("abcdefghijklmé"), "vzram-abcdefghijklm");
    let named = DaemonConfig::build(
        None,
        None,
        None,
        vec![DeviceDraft {
            name: Some("a-name-far-longer-than-twenty-bytes".into()),
            ..draft("/a", 4096)
        }],
    )
    .unwrap();
    assert_eq!(named.devices[0].serial, "vzram-a-name-far-lon");
}

#[test]
fn build_checks() {
    let ok = DaemonConfig::build(None, None, None, vec![draft("/a", 1 << 20)]).unwrap();
    assert_eq!(ok.devices[0].queues, DEFAULT_QUEUES);
    assert_eq!(ok.devices[0].name, "a");
    assert_eq!(ok.devices[0].serial, "vzram-a");
    assert_eq!(ok.socket_mode, 0o600);
    let bad = |drafts: Vec<DeviceDraft>| DaemonConfig::build(None, None, None, drafts).unwrap_err();
    bad(vec![]);
    bad(vec![draft("/a", 0)]);
    bad(vec![draft("/a", 5000)]);
    bad(vec![draft("/a", 4096), draft("/a", 4096)]);
    bad(vec![DeviceDraft {
        queues: Some(0),
        ..draft("/a", 4096)
    }]);
    bad(vec![DeviceDraft {
        queues: Some(65),
        ..draft("/a", 4096)
    }]);
    bad(vec![DeviceDraft {
        serial: Some("x".repeat(21)),
        ..draft("/a", 4096)
    }]);
    bad(vec![DeviceDraft {
        size: None,
        ..draft("/a", 4096)
    }]);
    bad(vec![
        DeviceDraft {
            name: Some("d".into()),
            ..draft("/a", 4096)
        },
        DeviceDraft {
            name: Some("d".into()),
            ..draft("/b", 4096)
        },
    ]);
    assert!(DaemonConfig::build(None, Some("/a".into()), None, vec![draft("/a", 4096)]).is_err());
    let limited = DeviceDraft {
        mem_limit: Some(2 << 20),
        ..draft("/a", 4 << 20)
    };
    // Above the host limit: accepted (the daemon warns; the host limit
    // caps it first).
    assert!(DaemonConfig::build(Some(1 << 20), None, None, vec![limited.clone()]).is_ok());
    assert!(DaemonConfig::build(Some(2 << 20), None, None, vec![limited.clone()]).is_ok());
    assert!(DaemonConfig::build(Some(0), None, None, vec![limited.clone()]).is_ok());
    // A limit above the device's size, with or without a host limit.
    let e = bad(vec![DeviceDraft {
        size: Some(1 << 20),
        ..limited.clone()
    }]);
    assert!(e.to_string().contains("above its size"), "{e}");
    let e = DaemonConfig::build(
        Some(8 << 20),
        None,
        None,
        vec![DeviceDraft {
            size: Some(1 << 20),
            ..limited.clone()
        }],
    )
    .unwrap_err();
    assert!(e.to_string().contains("above its size"), "{e}");
    // Equal to the size is allowed.
    assert!(DaemonConfig::build(
        None,
        None,
        None,
        vec![DeviceDraft {
            size: Some(2 << 20),
            ..limited
        }]
    )
    .is_ok());
}

#[test]
fn durations() {
    assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
    assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
    assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
    assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
    assert_eq!(parse_duration("1d2h3m4s"), Ok(Duration::from_secs(93784)));
    assert_eq!(parse_duration("10d"), Ok(Duration::from_secs(864000)));
    for bad in [
        "",
        "10",
        "m",
        "1.5m",
        "-1m",
        "10w",
        "10 m",
        "1m1h",
        "1h1h",
        "1h30",
        "99999999999999999999h",
        "213503982334602d",
    ] {
        assert!(parse_duration(bad).is_err(), "{bad:?} parsed");
    }
}

#[test]
fn tiering_keys() {
    let d = parse_device_spec(
        "socket=/a,size=1G,backing-file=/var/lib/vz/a.img,recompress-algo=zstd:5,idle-after=10m,auto-writeback=true,auto-recompress=yes",
    )
    .unwrap();
    assert_eq!(d.backing_file, Some(PathBuf::from("/var/lib/vz/a.img")));
    assert_eq!(d.recompress_algo, Some(Codec::Zstd { level: 5 }));
    assert_eq!(d.idle_after, Some(Duration::from_secs(600)));
    assert_eq!(
        (d.auto_writeback, d.auto_recompress),
        (Some(true), Some(true))
    );
    let c = DaemonConfig::build(None, None, None, vec![d]).unwrap();
    let t = &c.devices[0].tier;
    assert!(t.auto_writeback && t.auto_recompress);
    assert_eq!(t.recompress_algo, Codec::Zstd { level: 5 });

    // Defaults: zstd:3 for lz4, zstd:9 (or its own, higher) for zstd.
    let plain = DaemonConfig::build(None, None, None, vec![draft("/a", 4096)]).unwrap();
    assert_eq!(plain.devices[0].tier, TierSpec::none(Codec::Lz4));
    assert_eq!(
        plain.devices[0].tier.recompress_algo,
        Codec::Zstd { level: 3 }
    );
    assert_eq!(
        default_recompress_algo(Codec::Zstd { level: 1 }),
        Codec::Zstd { level: 9 }
    );
    assert_eq!(
        default_recompress_algo(Codec::Zstd { level: 15 }),
        Codec::Zstd { level: 15 }
    );

    let bad = |drafts: Vec<DeviceDraft>| {
        DaemonConfig::build(None, None, None, drafts)
            .unwrap_err()
            .to_string()
    };
    let with = |f: fn(&mut DeviceDraft)| {
        let mut d = draft("/a", 4096);
        d.name = Some("vm1".into());
        f(&mut d);
        d
    };
    let e = bad(vec![with(|d| d.auto_writeback = Some(true))]);
    assert!(e.contains("vm1") && e.contains("backing-file"), "{e}");
    let e = bad(vec![with(|d| {
        d.auto_writeback = Some(true);
        d.backing_file = Some("/b".into());
    })]);
    assert!(e.contains("idle-after"), "{e}");
    let e = bad(vec![with(|d| d.auto_recompress = Some(true))]);
    assert!(e.contains("auto-recompress needs idle-after"), "{e}");
    // Recompression alone needs no backing file.
    assert!(DaemonConfig::build(
        None,
        None,
        None,
        vec![with(|d| {
            d.auto_recompress = Some(true);
            d.idle_after = Some(Duration::from_secs(60));
        })]
    )
    .is_ok());
    let e = bad(vec![with(|d| d.idle_after = Some(Duration::from_secs(2)))]);
    assert!(e.contains("idle-after 2s"), "{e}");
    let e = bad(vec![with(|d| d.recompress_algo = Some(Codec::Lz4))]);
    assert!(e.contains("own algo"), "{e}");
    let e = bad(vec![
        with(|d| d.backing_file = Some("/b".into())),
        DeviceDraft {
            backing_file: Some("/b".into()),
            ..draft("/c", 4096)
        },
    ]);
    assert!(
        e.contains("backing file /b") && e.contains("vm1") && e.contains("devices vm1 and c"),
        "{e}"
    );
    assert!(parse_device_spec("socket=/a,idle-after=10").is_err());
    assert!(parse_device_spec("socket=/a,auto-writeback=maybe").is_err());
    assert!(parse_device_spec("socket=/a,recompress-algo=gzip").is_err());

    let f = parse_file(
        "[[device]]\nsocket = \"/a\"\nsize = \"1G\"\nbacking_file = \"/b\"\nidle_after = \"1h\"\nauto_writeback = true\nrecompress_algo = \"zstd:7\"\n",
    )
    .unwrap();
    let d = &f.devices[0];
    assert_eq!(d.backing_file, Some(PathBuf::from("/b")));
    assert_eq!(d.idle_after, Some(Duration::from_secs(3600)));
    assert_eq!(d.auto_writeback, Some(true));
    let e = parse_file("[[device]]\nidle_after = 600\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("duration"), "{e}");
}

#[test]
fn toml_file() {
    let f = parse_file(
        r#"
        host_mem_limit = "16G"
        control = "/run/vzram/control.sock"
        socket_mode = "0660"

        [[device]]
        socket = "/run/vzram/vm1.sock"
        size = "8G"
        queues = 2
        algo = "zstd"
        mem_limit = 1073741824
        serial = "vm1-swap"

        [[device]]
        name = "scratch"
        socket = "/run/vzram/vm2.sock"
        size = 4194304
        readonly = true
        "#,
    )
    .unwrap();
    assert_eq!(f.host_mem_limit, Some(16 << 30));
    assert_eq!(f.socket_mode, Some(0o660));
    assert_eq!(f.devices.len(), 2);
    assert_eq!(f.devices[0].mem_limit, Some(1 << 30));
    assert_eq!(f.devices[1].readonly, Some(true));
    let e = parse_file("[[device]]\nsocket = \"/a\"\nsise = \"1G\"\n").unwrap_err();
    assert!(
        e.to_string().contains("sise") && e.to_string().starts_with("line 3"),
        "{e}"
    );
    assert!(!e.to_string().contains('\n'));
    assert!(parse_file("host_mem_limit = \"lots\"").is_err());
    assert!(parse_file("[[device]]\nsize = \"8X\"").is_err());
    let mode = |text: &str| {
        parse_file(text)
            .map(|f| f.socket_mode.unwrap())
            .map_err(|e| e.to_string())
    };
    // A TOML integer is the mode as written, in octal; a string is
    // octal text.
    assert_eq!(mode("socket_mode = 0o600"), Ok(0o600));
    assert_eq!(mode("socket_mode = 0o660"), Ok(0o660));
    assert_eq!(mode("socket_mode = 0o0"), Ok(0));
    assert_eq!(mode("socket_mode = 0x1b0"), Ok(0o660));
    assert_eq!(mode("socket_mode = \"0660\""), Ok(0o660));
    assert_eq!(mode("socket_mode = \"660\""), Ok(0o660));
    assert_eq!(mode("socket_mode = \"0o660\""), Ok(0o660));
    assert_eq!(mode("socket-mode = '0640'"), Ok(0o640));
    // Neither 0o1130 nor a guess at 0o600: refused, with a hint.
    let e = mode("\n\nsocket_mode = 600").unwrap_err().to_string();
    assert!(e.starts_with("line 3: socket_mode = 600 "), "{e}");
    assert!(e.contains("0o600") && e.contains("\"0600\""), "{e}");
    // 400 would be 0o620 (the group may connect): refused too.
    let e = mode("socket_mode = 400").unwrap_err().to_string();
    assert!(e.contains("0o400") && e.contains("\"0400\""), "{e}");
    let e = mode("socket_mode = 384").unwrap_err().to_string();
    assert!(e.contains("decimal") && e.contains("0o600"), "{e}");
    for bad in [
        "socket_mode = 0",
        "socket_mode = -1",
        "socket_mode = 0o1777",
        "socket_mode = 0o4600",
        "socket_mode = 0x10000",
        "socket_mode = 99999999999",
        "socket_mode = \"999\"",
        "socket_mode = \"0o1777\"",
        "socket_mode = \"\"",
        "socket_mode = true",
    ] {
        let e = mode(bad).unwrap_err().to_string();
        assert!(
            e.contains("socket_mode") || e.contains("socket mode"),
            "{bad}: {e}"
        );
        assert!(!e.contains('\n'), "{bad}: {e}");
    }
    assert_eq!(
        parse_file("seccomp = false").unwrap().seccomp,
        Some(SeccompMode::Off)
    );
    assert_eq!(
        parse_file("seccomp = \"log\"").unwrap().seccomp,
        Some(SeccompMode::Log)
    );
    assert_eq!(parse_file("").unwrap().seccomp, None);
    assert_eq!(
        parse_file("host_staging = \"256M\"").unwrap().host_staging,
        Some(256 << 20)
    );
    let e = parse_file("host_staging = \"lots\"")
        .unwrap_err()
        .to_string();
    assert!(e.contains("host_staging") && !e.contains('\n'), "{e}");
    assert_eq!(parse_file("poll_us = 50").unwrap().poll_us, Some(50));
    assert_eq!(parse_file("poll-us = 0").unwrap().poll_us, Some(0));
    assert_eq!(parse_file("").unwrap().poll_us, None);
    let e = parse_file("poll_us = 1000001").unwrap_err().to_string();
    assert!(e.contains("poll_us") && !e.contains('\n'), "{e}");
    assert!(parse_file("seccomp = \"sometimes\"").is_err());
    assert_eq!(
        parse_file("metrics = \"127.0.0.1:9100\"").unwrap().metrics,
        Some("127.0.0.1:9100".parse().unwrap())
    );
    assert!(parse_file("metrics = \"localhost\"")
        .unwrap_err()
        .to_string()
        .contains("metrics"));
    let f = parse_file("socket_mode = 0o660\ncontrol_mode = \"0640\"").unwrap();
    assert_eq!((f.socket_mode, f.control_mode), (Some(0o660), Some(0o640)));
    let e = parse_file("control_mode = 600").unwrap_err().to_string();
    assert!(e.contains("control_mode = 0o600"), "{e}");
}

#[test]
fn a_device_is_named_by_its_socket_not_its_place() {
    for (socket, name) in [
        ("/run/vzram/vm1.sock", Some("vm1")),
        ("/run/vzram/vm1.socket", Some("vm1")),
        ("relative/disk-2", Some("disk-2")),
        ("/tmp/a b\u{e9}.sock", Some("a_b_")),
        ("/tmp/..hidden.sock", Some("hidden")),
        ("/tmp/.sock", None),
        ("/", None),
    ] {
        assert_eq!(
            name_from_socket(Path::new(socket)).as_deref(),
            name,
            "{socket}"
        );
    }
    let two = |a: &str, b: &str| {
        DaemonConfig::build(None, None, None, vec![draft(a, 1 << 20), draft(b, 1 << 20)])
    };
    let ab = two("/x/a.sock", "/x/b.sock").unwrap();
    let ba = two("/x/b.sock", "/x/a.sock").unwrap();
    // Reordered, each socket keeps its name (and so its state).
    assert_eq!(ab.devices[0].name, ba.devices[1].name);
    assert_eq!(ab.devices[1].name, ba.devices[0].name);
    let e = two("/x/vm.sock", "/y/vm.sock").unwrap_err().to_string();
    assert!(e.contains("used twice") && e.contains("name="), "{e}");
    let e = DaemonConfig::build(None, None, None, vec![draft("/x/.sock", 1 << 20)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("gives no name"), "{e}");
}

#[test]
fn recover_fresh_and_adopt_in_a_spec() {
    let d = parse_device_spec("socket=/a,size=1M,recover=true,adopt=true").unwrap();
    let c = DaemonConfig::build(None, None, None, vec![d]).unwrap();
    assert_eq!(c.devices[0].on_state, OnState::Recover);
    assert!(c.devices[0].adopt);
    let d = parse_device_spec("socket=/a,size=1M,recover=true,fresh=true").unwrap();
    let e = DaemonConfig::build(None, None, None, vec![d])
        .unwrap_err()
        .to_string();
    assert!(e.contains("exclude each other"), "{e}");
    use vzram_store::Existing;
    assert_eq!(OnState::Unsaid.existing(true, false), Existing::Refuse);
    assert_eq!(OnState::Unsaid.existing(false, false), Existing::Recover);
    assert_eq!(OnState::Unsaid.existing(false, true), Existing::Discard);
    assert_eq!(OnState::Recover.existing(true, false), Existing::Recover);
    assert_eq!(OnState::Refuse.existing(false, false), Existing::Refuse);
    assert_eq!(OnState::Fresh.existing(true, false), Existing::Discard);
}

#[test]
fn control_socket_order() {
    use super::{control_from, DEFAULT_CONTROL};
    let os = |s: &str| Some(std::ffi::OsString::from(s));
    assert_eq!(
        control_from(None, None, 0, None),
        PathBuf::from(DEFAULT_CONTROL)
    );
    assert_eq!(
        control_from(os(""), os(""), 0, os("/run/user/0")),
        PathBuf::from(DEFAULT_CONTROL)
    );
    assert_eq!(
        control_from(None, os("/run/a:/run/b"), 1000, None),
        PathBuf::from("/run/a/control.sock")
    );
    assert_eq!(
        control_from(os("/x/c.sock"), os("/run/a"), 0, None),
        PathBuf::from("/x/c.sock")
    );
    // An ordinary user: the login manager's runtime dir, else one in /tmp.
    assert_eq!(
        control_from(None, None, 1000, os("/run/user/1000")),
        PathBuf::from("/run/user/1000/vzram/control.sock")
    );
    assert_eq!(
        control_from(None, os(""), 1000, os("")),
        PathBuf::from("/tmp/vzram-1000/control.sock")
    );
}

#[test]
fn an_unnamed_device_is_keyed_by_its_whole_socket_path() {
    let cfg = |dev: &str| {
        DaemonConfig::build(None, None, None, vec![parse_device_spec(dev).unwrap()])
            .unwrap()
            .devices
            .remove(0)
    };
    let a = cfg("socket=/run/vzram/vm1.sock,size=1M");
    assert_eq!(a.name, "vm1");
    // Fixed: state directories on disk are named by it, across builds.
    assert_eq!(a.state_key(), "vm1-01b7950a");
    assert_eq!(a.legacy_key(), Some("vm1"));
    let b = cfg("socket=/tmp/x/vm1.sock,size=1M");
    assert_eq!(b.name, "vm1");
    assert_ne!(a.state_key(), b.state_key());
    // A given name is the key, whatever the socket.
    let n = cfg("socket=/tmp/x/vm1.sock,size=1M,name=db");
    assert_eq!((n.state_key().as_str(), n.legacy_key()), ("db", None));
}

/// The typed errors print what the text errors printed, byte for byte.
#[test]
fn typed_errors_keep_their_text() {
    assert_eq!(
        parse_size("1.3M").unwrap_err().to_string(),
        "bad size \"1.3M\": not a whole number of bytes (sizes are multiples of 4096)"
    );
    assert_eq!(
        parse_size("12Q").unwrap_err().to_string(),
        "bad size \"12Q\": unknown unit 'Q' (use K, M, G or T)"
    );
    assert_eq!(
        parse_metrics_addr("foo:1").unwrap_err().to_string(),
        "bad metrics address \"foo:1\": a host name other than localhost (give its IP address); expected IP:PORT, localhost:PORT or :PORT, such as 127.0.0.1:9100"
    );
    assert_eq!(
        parse_file("\nsocket_mode = 400").unwrap_err().to_string(),
        "line 2: socket_mode = 400 is a decimal number; write the mode in octal: socket_mode = 0o400 or socket_mode = \"0400\""
    );
    assert_eq!(
        parse_file("host_mem_limit = \"lots\"")
            .unwrap_err()
            .to_string(),
        "host_mem_limit: bad size \"lots\": unknown unit 's' (use K, M, G or T)"
    );
    let e = load_file(Path::new("/nonexistent/v.toml")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "cannot read /nonexistent/v.toml: No such file or directory (os error 2)"
    );
    assert!(
        std::error::Error::source(&e).is_some(),
        "the io error is its source"
    );
    assert_eq!(
        parse_device_spec("socket").unwrap_err().to_string(),
        "bad device option \"socket\": expected key=value"
    );
}
