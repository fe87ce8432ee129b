//! The command line's own checks (clap's and ours).

use super::*;
use clap::CommandFactory;

/// Why a command line was refused: clap's checks or ours.
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error(transparent)]
    Clap(#[from] clap::Error),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Limit(#[from] LimitArgsError),
}

impl Refused {
    /// Whether the message the user reads says `what`.
    fn contains(&self, what: &str) -> bool {
        self.to_string().contains(what)
    }
}

fn serve(args: &[&str]) -> Result<DaemonConfig, Refused> {
    let cli = Cli::try_parse_from(["vzram", "serve"].iter().chain(args))?;
    let Command::Serve(s) = cli.command else {
        unreachable!()
    };
    Ok(s.resolve()?)
}

#[test]
fn cli_is_consistent() {
    Cli::command().debug_assert();
}

#[test]
fn single_device() {
    let c = serve(&[
        "--socket",
        "/tmp/x.sock",
        "--size",
        "8G",
        "--queues",
        "2",
        "--algo",
        "zstd:5",
        "--readonly",
    ])
    .unwrap();
    assert_eq!(c.devices.len(), 1);
    let d = &c.devices[0];
    assert_eq!((d.size, d.queues, d.readonly), (8 << 30, 2, true));
    assert_eq!(d.algo, vzram_store::Codec::Zstd { level: 5 });
}

#[test]
fn many_devices() {
    let c = serve(&[
        "--device",
        "socket=/tmp/a,size=1G",
        "--device",
        "socket=/tmp/b,size=2G,queues=1,name=b",
        "--host-mem-limit",
        "1G",
        "--socket-mode",
        "0660",
    ])
    .unwrap();
    assert_eq!(c.devices.len(), 2);
    assert_eq!(c.devices[1].name, "b");
    assert_eq!(c.host_mem_limit, 1 << 30);
    assert_eq!(c.socket_mode, 0o660);
    assert_eq!(
        c.control_mode, 0o600,
        "--socket-mode is not the control socket's"
    );
    assert_eq!(c.seccomp, SeccompMode::On);
}

/// The host's staging budget: 64M per core unless given (a device's own is
/// 128M), 0 turns staging off on every device, the flag over the file.
#[test]
fn host_staging() {
    let cores = std::thread::available_parallelism().unwrap().get() as u64;
    let c = serve(&["--socket", "/tmp/x", "--size", "1G"]).unwrap();
    assert_eq!(c.host_staging, cores * (64 << 20));
    assert_eq!(c.devices[0].staging, 128 << 20);
    let c = serve(&["--socket", "/tmp/x", "--size", "1G", "--host-staging", "0"]).unwrap();
    assert_eq!(c.host_staging, 0);
    let file = std::env::temp_dir().join(format!("vzram-host-staging-{}.toml", std::process::id()));
    std::fs::write(&file, "host-staging = \"32M\"\n").unwrap();
    let f = file.to_str().unwrap();
    let c = serve(&["--socket", "/tmp/x", "--size", "1G", "--config", f]).unwrap();
    assert_eq!(c.host_staging, 32 << 20);
    let args = ["--socket", "/tmp/x", "--size", "1G", "--config", f];
    let c = serve(&[&args[..], &["--host-staging", "1G"]].concat()).unwrap();
    assert_eq!(c.host_staging, 1 << 30);
    let e = serve(&[
        "--socket",
        "/tmp/x",
        "--size",
        "1G",
        "--host-staging",
        "lots",
    ])
    .unwrap_err();
    assert!(e.contains("--host-staging"), "{e}");
    let _ = std::fs::remove_file(&file);
}

#[test]
fn a_device_too_large_for_its_table_is_refused_before_anything() {
    let e = serve(&["--socket", "/tmp/x", "--size", "100T"]).unwrap_err();
    assert!(e.contains("over the largest device, 64T"), "{e}");
    assert!(serve(&["--socket", "/tmp/x", "--size", "64T"]).is_ok());
    let e = serve(&["--socket", "/tmp/x", "--size", "1P"]).unwrap_err();
    assert!(e.contains("unknown unit"), "{e}");
}

#[test]
fn the_program_itself_takes_socket_path_and_fd() {
    let argv = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
    for (given, want) in [
        (
            vec!["vzram", "--socket-path", "/tmp/a", "--size", "1G"],
            vec!["vzram", "serve", "--socket-path", "/tmp/a", "--size", "1G"],
        ),
        (
            vec!["vzram", "--fd=3", "--size", "1G"],
            vec!["vzram", "serve", "--fd=3", "--size", "1G"],
        ),
        (
            vec!["vzram", "--size", "1G", "--socket-path=/tmp/a"],
            vec!["vzram", "serve", "--size", "1G", "--socket-path=/tmp/a"],
        ),
        (vec!["vzram", "stat"], vec!["vzram", "stat"]),
        (vec!["vzram", "--version"], vec!["vzram", "--version"]),
        (vec!["vzram"], vec!["vzram"]),
    ] {
        assert_eq!(as_backend_program(argv(&given)), argv(&want));
    }
}

/// `--help` names every key of `--device` (the device flags, read from
/// clap) and of the configuration file (read from its parser).
#[test]
fn help_names_every_key() {
    let mut cmd = Cli::command();
    let serve = cmd.find_subcommand_mut("serve").unwrap();
    let help = |id: &str| {
        serve
            .get_arguments()
            .find(|a| a.get_id() == id)
            .and_then(|a| a.get_long_help().or(a.get_help()))
            .map(|h| h.to_string())
            .unwrap()
    };
    let device = help("devices");
    let drafts = DeviceDraft::augment_args(clap::Command::new("x"));
    for a in drafts.get_arguments() {
        let key = format!("{}=", a.get_id().as_str().replace('_', "-"));
        assert!(device.contains(&key), "--device help lacks {key}: {device}");
    }
    let file = help("config");
    let keys = crate::config::file_keys();
    assert!(keys.len() > 10, "{keys:?}");
    for k in keys {
        let k = if k == "device" {
            "[[device]]".to_string()
        } else {
            k
        };
        assert!(file.contains(&k), "--config help lacks {k}: {file}");
    }
}

#[test]
fn incoming_addresses() {
    let c = serve(&[
        "--device",
        "socket=/tmp/a,size=1G,incoming=unix:/tmp/a.in",
        "--socket",
        "/tmp/b",
        "--size",
        "1G",
        "--incoming",
        "unix:/tmp/b.in",
    ])
    .unwrap();
    assert_eq!(c.devices[0].incoming, Some(Addr::Unix("/tmp/a.in".into())));
    assert_eq!(c.devices[1].incoming, Some(Addr::Unix("/tmp/b.in".into())));
    // TCP is mutual TLS: without credentials it is refused at start.
    let e = serve(&[
        "--socket",
        "/tmp/b",
        "--size",
        "1G",
        "--incoming",
        "tcp:127.0.0.1:4444",
    ])
    .unwrap_err();
    assert!(e.contains("needs --tls-creds"), "{e}");
    let e = serve(&["--device", "socket=/tmp/a,size=1G,incoming=/tmp/x"]).unwrap_err();
    assert!(e.contains("unix:PATH or tcp:HOST:PORT"), "{e}");
    let e = serve(&["--device", "socket=/tmp/a,size=1G,incoming=unix:/tmp/a"]).unwrap_err();
    assert!(e.contains("also a device or control socket"), "{e}");
    let e = serve(&[
        "--device",
        "socket=/tmp/a,size=1G,incoming=unix:/tmp/i",
        "--device",
        "socket=/tmp/b,size=1G,incoming=unix:/tmp/i",
    ])
    .unwrap_err();
    assert!(e.contains("another device's"), "{e}");
}

#[test]
fn seccomp_flag() {
    let base = ["--socket", "/tmp/x", "--size", "1G"];
    let with = |m: &str| {
        let mut a = base.to_vec();
        a.extend(["--seccomp", m]);
        serve(&a)
    };
    assert_eq!(with("off").unwrap().seccomp, SeccompMode::Off);
    assert_eq!(with("on").unwrap().seccomp, SeccompMode::On);
    assert_eq!(with("log").unwrap().seccomp, SeccompMode::Log);
    assert!(with("sometimes").is_err());
}

#[test]
fn log_level_and_default_control() {
    let parse = |a: &[&str]| {
        let Command::Serve(s) = Cli::try_parse_from(a).unwrap().command else {
            unreachable!()
        };
        s.log_level
    };
    assert_eq!(parse(&["vzram", "serve"]), LogLevel::Info);
    assert_eq!(
        parse(&["vzram", "serve", "--log-level", "debug"]),
        LogLevel::Debug
    );
    assert!(Cli::try_parse_from(["vzram", "serve", "--log-level", "loud"]).is_err());
    let Command::Stat(st) = Cli::try_parse_from(["vzram", "stat"]).unwrap().command else {
        unreachable!()
    };
    assert!(st.control.ends_with("control.sock"), "{:?}", st.control);
}

#[test]
fn bad_input() {
    assert!(serve(&["--socket", "/tmp/x", "--size", "12Q"]).is_err());
    assert!(serve(&["--size", "1G"])
        .unwrap_err()
        .contains("need --socket"));
    assert!(serve(&[]).unwrap_err().contains("no device"));
    assert!(serve(&["--socket", "/tmp/x", "--size", "1G", "--queues", "0"]).is_err());
    assert!(serve(&["--socket", "/tmp/x", "--size", "1G", "--algo", "gzip"]).is_err());
    assert!(serve(&["--socket", "/tmp/x", "--size", "1G", "--socket-mode", "999"]).is_err());
}

#[test]
fn print_capabilities() {
    assert!(wants_capabilities(["--print-capabilities"]));
    assert!(wants_capabilities([
        "serve",
        "--bogus",
        "--print-capabilities"
    ]));
    assert!(!wants_capabilities(["serve", "--", "--print-capabilities"]));
    assert!(!wants_capabilities(["stat"]));
    let v: serde_json::Value = serde_json::from_str(&capabilities()).unwrap();
    assert_eq!(v["type"], "block");
    assert_eq!(v["features"], serde_json::json!(["read-only"]));
    // The feature it lists is a flag that works.
    let c = serve(&["--socket", "/tmp/x", "--size", "1G", "--read-only"]).unwrap();
    assert!(c.devices[0].readonly);
}

#[test]
fn set_limit_needs_a_target() {
    let target = |a: &[&str]| -> Result<(LimitTarget, u64), Refused> {
        let argv = ["vzram", "set-limit", "--control", "/c"].iter().chain(a);
        match Cli::try_parse_from(argv)?.command {
            Command::SetLimit(s) => Ok(s.target()?),
            _ => unreachable!(),
        }
    };
    let e = target(&["1G"]).unwrap_err();
    assert!(e.contains("--device") && e.contains("--host"), "{e}");
    let dev = |n: &str| LimitTarget::Device(n.into());
    assert_eq!(
        target(&["--host", "1G"]).unwrap(),
        (LimitTarget::Host, 1 << 30)
    );
    assert_eq!(target(&["vm1", "1G"]).unwrap(), (dev("vm1"), 1 << 30));
    assert_eq!(
        target(&["--device", "0", "1G"]).unwrap(),
        (dev("0"), 1 << 30)
    );
    assert!(target(&["--device", "0", "--host", "1G"]).is_err());
    assert!(target(&["vm1", "--host", "1G"]).is_err());
    assert!(target(&["vm1", "1Q"]).unwrap_err().contains("unknown unit"));
    // Every device command takes NAME, or --device NAME, alike.
    for cmd in [
        "stat",
        "compact",
        "reset-max",
        "remove",
        "reset",
        "forget",
        "mark-idle",
        "recompress",
        "writeback",
    ] {
        for form in [&["vm1"][..], &["--device", "vm1"]] {
            let argv: Vec<&str> = ["vzram", cmd]
                .into_iter()
                .chain(form.iter().copied())
                .collect();
            Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{cmd} {form:?}: {e}"));
        }
    }
    for form in [&["vm1"][..], &["--device", "vm1"]] {
        let argv = ["vzram", "migrate", "--commit"].iter().chain(form);
        Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("migrate {form:?}: {e}"));
    }
}
