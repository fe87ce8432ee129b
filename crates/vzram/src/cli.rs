//! Command line: `vzram serve`, and the commands that talk to a running
//! daemon (`stat`, `set-limit`, `compact`, `add`, ..., `mark-idle`,
//! `recompress`, `writeback`).

use std::path::PathBuf;

use clap::{ArgGroup, Args, Parser, Subcommand};

use crate::config::{self, ConfigError, DaemonConfig, DeviceDraft, SeccompMode};
use crate::proto::addr::{parse_addr, Addr};
pub use crate::proto::worker_spec::{LogFormat, LogLevel};

#[derive(Debug, Parser)]
#[command(
    name = "vzram",
    version,
    propagate_version = true,
    about = "Compressed RAM block devices for VMs, served over vhost-user-blk"
)]
pub struct Cli {
    /// Print the backend's capabilities as JSON and exit, per QEMU's
    /// vhost-user backend-program conventions; other arguments are ignored.
    #[arg(long)]
    pub print_capabilities: bool,
    #[command(subcommand)]
    pub command: Command,
}

/// The flag QEMU's backend-program conventions (docs/interop/vhost-user.rst)
/// give every backend. It wins over everything else on the command line,
/// which is otherwise ignored, so it is looked for before clap parses.
pub const PRINT_CAPABILITIES: &str = "--print-capabilities";

/// Whether `args` (without the program name) ask for the capabilities:
/// the flag anywhere before a `--`.
pub fn wants_capabilities<I, S>(args: I) -> bool
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    args.into_iter()
        .map(|a| a.as_ref().to_owned())
        .take_while(|a| a != "--")
        .any(|a| a == PRINT_CAPABILITIES)
}

/// QEMU's backend-program convention (docs/interop/vhost-user.rst) starts
/// the program itself with `--socket-path PATH` or `--fd N`, no subcommand:
/// those arguments are `vzram serve`'s.
pub fn as_backend_program(args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let is_backend_flag = |a: &std::ffi::OsString| {
        a.to_str().is_some_and(|a| {
            ["--socket-path", "--fd"]
                .iter()
                .any(|f| a == *f || a.starts_with(&format!("{f}=")))
        })
    };
    // No subcommand (the first argument is a flag), and the convention's
    // flag anywhere: `vzram --size 1G --socket-path S` as well.
    let no_subcommand = args
        .get(1)
        .and_then(|a| a.to_str())
        .is_some_and(|a| a.starts_with("--"));
    if !no_subcommand || !args.iter().skip(1).any(is_backend_flag) {
        return args;
    }
    let mut out = args;
    out.insert(1, "serve".into());
    out
}

/// Parses a command line as `main` does, QEMU's backend-program form
/// included, without running it (the docs' examples are checked so).
pub fn parse(args: Vec<std::ffi::OsString>) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(as_backend_program(args))
}

/// What `--print-capabilities` prints: the backend type QEMU's
/// `docs/interop/vhost-user.json` calls `block`, and the block features it
/// defines that `vzram serve` has (`--read-only`; not `--blk-file`: a vzram
/// disk lives in RAM, not in a file).
pub fn capabilities() -> String {
    /// In the order of the convention's example: type first.
    #[derive(serde::Serialize)]
    struct Capabilities {
        r#type: &'static str,
        features: &'static [&'static str],
    }
    let caps = Capabilities {
        r#type: "block",
        features: &["read-only"],
    };
    let mut s = serde_json::to_string_pretty(&caps).unwrap_or_default();
    s.push('\n');
    s
}

// Parsed once per run: the size of the serve variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve devices on vhost-user-blk sockets; stays in the foreground.
    Serve(ServeArgs),
    /// Print per-device and pool statistics of a running daemon.
    Stat(StatArgs),
    /// Change a device's memory limit, or the host-wide one, on a running daemon.
    SetLimit(SetLimitArgs),
    /// Compact the pool of a running daemon now.
    Compact(CompactArgs),
    /// Add a device to a running daemon (zram's hot_add).
    Add(AddArgs),
    /// Remove a device from a running daemon: deletes its socket and its
    /// state (zram's hot_remove). Refused while a frontend is connected,
    /// unless --force: then the frontend is cut off and the state kept,
    /// left over (`vzram add ...,recover=true` serves it again).
    Remove(DestroyArgs),
    /// Delete a left-over state: one in the state dir that no device
    /// serves (`vzram stat` lists them), such as a device added at run time
    /// before a restart. Its pages are gone for good.
    Forget(ForgetArgs),
    /// Backing files, without a daemon.
    #[command(subcommand)]
    Backing(BackingCommand),
    /// Drop all of a device's data; refused while a frontend is connected,
    /// unless --force (which cuts it off first).
    Reset(DestroyArgs),
    /// Restart mem_used_max from the current use (one device, or all and the host).
    ResetMax(CompactArgs),
    /// Mark every page a device stores idle (zram's `echo all > idle`); a
    /// read or write of a page clears its mark.
    MarkIdle(DeviceArgs),
    /// Recompress a device's pages with a second codec, keeping the result
    /// where it is smaller (zram's recompress): every page in memory, or
    /// those all the given filters pick.
    Recompress(RecompressArgs),
    /// Move a device's pages to its backing file (zram's writeback): every
    /// page in memory, or those all the given filters pick.
    Writeback(WritebackArgs),
    /// Send a device's pages to another vzram's incoming device while its
    /// VM migrates: everything while the guest runs, then what it wrote
    /// meanwhile, and the last delta once the frontend has stopped (QEMU
    /// does at the end of its own migration). Then drops them here.
    Migrate(MigrateArgs),
    /// Read the daemon's --config file again and apply it, as SIGHUP does
    /// (`systemctl reload vzram` runs this): prints what changed, and on
    /// stderr what needs a restart. Exit 2 when the file is refused
    /// (nothing changed then) or the daemon has no --config.
    Reload(ReloadArgs),
    /// The manual page, made from these definitions (roff): `vzram.1` on
    /// stdout, or with `--dir` one page per command written there.
    /// Hidden: for packagers (contrib/package/deb.sh).
    #[command(hide = true)]
    Man(ManArgs),
    /// Shell completions on stdout. Hidden: for packagers.
    #[command(hide = true)]
    Completions(CompletionsArgs),
}

#[derive(Debug, Args)]
pub struct ManArgs {
    /// Write vzram.1, a page per command (vzram-serve.1, ...) and
    /// vzram.toml.5 into this existing directory instead of printing vzram.1
    /// (into DIR/../man5 when DIR is a man1 directory).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Print the options of `serve` as docs/configuration.md lists them
    /// (Markdown) instead.
    #[arg(long, conflicts_with = "dir")]
    pub options: bool,
}

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell the script is for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// A single device (`--socket`, `--size`, ...).
    #[command(flatten)]
    pub single: DeviceDraft,
    /// That device's socket is already bound and listening at this inherited
    /// descriptor (QEMU's `--fd` convention) instead of bound by vzram.
    #[arg(long, value_name = "N", conflicts_with = "socket")]
    pub fd: Option<i32>,
    /// More devices: socket=PATH,size=SIZE[,queues=N,mem-limit=SIZE,algo=A,serial=S,readonly=true,name=N,
    /// state-dir=DIR,recover=true,fresh=true,adopt=true,backing-file=PATH,recompress-algo=A,
    /// idle-after=10m,auto-writeback=true,auto-recompress=true,incoming=ADDR,discard-segments=N,
    /// staging=SIZE]: the keys of the flags above, each at most once.
    #[arg(long = "device", value_name = "SPEC", value_parser = config::parse_device_spec)]
    pub devices: Vec<DeviceDraft>,
    /// TOML file with host_mem_limit, control, metrics, state_dir, socket_mode, control_mode,
    /// incoming_mode, tls_creds, seccomp, compress_threads, host_staging, poll_us, incoming_timeout and
    /// [[device]] tables (the keys of --device; `-` or `_` alike).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Cap on the memory of all devices together (0 = none).
    #[arg(long, value_name = "SIZE", value_parser = config::parse_size, allow_negative_numbers = true)]
    pub host_mem_limit: Option<u64>,
    /// Control socket for `vzram stat`, `set-limit`, `compact` and the
    /// other client commands [default: $VZRAM_CONTROL, else
    /// $RUNTIME_DIRECTORY/control.sock, else /run/vzram/control.sock for
    /// root, $XDG_RUNTIME_DIR/vzram/control.sock (or /tmp/vzram-UID/) for a
    /// user: made if missing; taken by another daemon, control.PID.sock
    /// beside it]. A given path's directory must exist.
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics: an IP and a
    /// port, `localhost:PORT`, or `:PORT` for every interface (port 0: any
    /// free port, shown by `vzram stat`).
    #[arg(long, value_name = "ADDR:PORT", value_parser = config::parse_metrics_addr)]
    pub metrics: Option<std::net::SocketAddr>,
    /// Permissions of the device sockets, in octal [default: 0600].
    #[arg(long, value_name = "MODE", value_parser = config::parse_mode)]
    pub socket_mode: Option<u32>,
    /// Permissions of the control socket, in octal [default: 0600]; not
    /// --socket-mode's: whoever can connect to it changes limits.
    #[arg(long, value_name = "MODE", value_parser = config::parse_mode)]
    pub control_mode: Option<u32>,
    /// Permissions of incoming devices' unix migration sockets, in octal
    /// [default: 0600]; not --socket-mode's: whoever can connect writes the
    /// device's pages before it serves.
    #[arg(long, value_name = "MODE", value_parser = config::parse_mode)]
    pub incoming_mode: Option<u32>,
    /// Directory of TLS credentials for migration streams on tcp:, laid
    /// out as QEMU's tls-creds-x509: ca-cert.pem, and server-cert.pem with
    /// server-key.pem (to receive) and/or client-cert.pem with
    /// client-key.pem (to send). Both ends must show a certificate from
    /// the CA; tcp: is refused without it.
    #[arg(long, value_name = "DIR")]
    pub tls_creds: Option<PathBuf>,
    /// System call filter once set-up is done: on, off (for debugging) or
    /// log (allow all, the kernel logs what would be refused) [default: on].
    #[arg(long, value_name = "MODE")]
    pub seccomp: Option<SeccompMode>,
    /// Where devices keep their state, so it outlives the daemon (a tmpfs
    /// directory of this user's, mode 0700) [default: $RUNTIME_DIRECTORY/state,
    /// else /run/vzram/state as root, else $XDG_RUNTIME_DIR/vzram/state,
    /// else /dev/shm/vzram-UID].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Discard device NAME's existing state (NAME: the device's name, or
    /// its state's, as refusals give it) and start it empty (repeatable;
    /// `fresh=true` on the device does the same). Each state discarded is
    /// logged at WARN with its size. Without NAME: every device's.
    #[arg(long, value_name = "NAME", num_args = 0..=1, default_missing_value = "", action = clap::ArgAction::Append)]
    pub fresh: Vec<String>,
    /// Serve a state found under device NAME's name even if it was made
    /// under another name (a renamed state directory) or for another
    /// socket, or though its socket was last served from another state dir:
    /// the header (and the marker beside the socket) then record this
    /// device's. Without it such a state stops the start (exit 2), so no
    /// guest gets another's disk by accident. Repeatable (`adopt=true` on
    /// the device does the same); without NAME: every device.
    #[arg(long, value_name = "NAME", num_args = 0..=1, default_missing_value = "", action = clap::ArgAction::Append)]
    pub adopt: Vec<String>,
    /// Threads per worker process (one per connected VM) that compress the
    /// pages of writes of 4 pages or more and decompress those of reads of
    /// 2 pages or more, beside the queue threads; capped at the number of
    /// cores [default: a core less than the host has, 1 to 4 (the queue
    /// thread does its share); 0: each queue does all its pages itself].
    #[arg(long, value_name = "N")]
    pub compress_threads: Option<usize>,
    /// Raw staging of all devices together: past it, writes compress inline
    /// on every device, each device's own `staging` applying too [default:
    /// 64M per core: what a core compresses in about 120 ms, so raw pages
    /// wait no longer than that however many VMs burst at once; 0: no
    /// device stages].
    #[arg(long, value_name = "SIZE", value_parser = config::parse_size)]
    pub host_staging: Option<u64>,
    /// Longest an incoming migration stream may take to arrive whole, from
    /// its connect to its last record (the wait for the source's commit
    /// after it is not counted) [default: 1h].
    #[arg(long, value_parser = crate::config::parse_duration, value_name = "DURATION")]
    pub incoming_timeout: Option<std::time::Duration>,
    /// Most microseconds a queue thread may watch its ring for the guest's
    /// next request after the ring ran dry, before it sleeps: up to 32 µs
    /// (as QEMU's iothreads) or as long as its last pass worked, if longer;
    /// less for a guest whose requests come seldom [default: 200; 0: never,
    /// every request waits for a kick]. A queue thread whose last pages are
    /// on compress threads watches them finish for up to 32 µs before it
    /// sleeps, and a compress thread out of work watches for more as long
    /// as its last jobs took, up to 32 µs, while the host has a core free
    /// (neither at 0). An idle queue never polls.
    #[arg(long, value_name = "US", value_parser = clap::value_parser!(u64).range(0..=crate::config::MAX_POLL_US))]
    pub poll_us: Option<u64>,
    /// Write the daemon's process id to this file once its sockets are
    /// bound; it stays locked while the daemon runs (another vzram given
    /// it is refused, exit 2) and is removed on a clean exit. For
    /// `kill -HUP $(cat PATH)` without systemd; `vzram reload` needs none.
    #[arg(long, value_name = "PATH")]
    pub pidfile: Option<PathBuf>,
    /// Least severe log messages shown; RUST_LOG, when set, wins.
    #[arg(long, value_enum, default_value_t = LogLevel::Info)]
    pub log_level: LogLevel,
    /// How log lines are written: text (under systemd, when stderr is the
    /// journal, each line starts with its syslog priority, without a
    /// timestamp of its own) or json, one object per line.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl ServeArgs {
    /// Merges the config file, `--device` specs and the single-device flags,
    /// in that order; flags on the command line win over the file.
    pub fn resolve(self) -> Result<DaemonConfig, ConfigError> {
        self.resolve_reloadable().map(|(cfg, _)| cfg)
    }

    /// [`ServeArgs::resolve`], and with `--config` what SIGHUP needs to
    /// build the configuration again from the file's new text: these same
    /// flags (which still win over the file), the socket `--fd` was bound
    /// to and the TLS credentials read now (the daemon may not read them
    /// again under its filter).
    pub fn resolve_reloadable(self) -> Result<(DaemonConfig, Option<config::Reload>), ConfigError> {
        let file = match &self.config {
            Some(p) => config::load_file(p)?,
            None => config::FileDrafts::default(),
        };
        let fd_socket = match self.fd {
            Some(fd) => Some(
                crate::sys::listen::bound_path(fd)
                    .map_err(|source| ConfigError::Fd { fd, source })?,
            ),
            None => None,
        };
        let tls_dir = self.tls_creds.clone().or(file.tls_creds.clone());
        let mut cfg = self.clone().merge(file, fd_socket.clone())?;
        cfg.fresh.check("--fresh", &cfg.devices)?;
        cfg.adopt.check("--adopt", &cfg.devices)?;
        if let Some(d) = cfg
            .devices
            .iter()
            .find(|d| cfg.fresh.covers_device(d) && cfg.adopt.covers_device(d))
        {
            return Err(ConfigError::FreshAndAdopt(d.name.clone()));
        }
        if let Some(dir) = &tls_dir {
            let creds = crate::owner::tls::load_dir(dir).map_err(ConfigError::TlsCreds)?;
            cfg.tls = Some(creds);
        }
        cfg.check_tls()?;
        let reload = match &self.config {
            None => None,
            Some(p) => {
                let path = std::path::absolute(p).unwrap_or_else(|_| p.clone());
                let tls = cfg.tls.clone();
                let args = self.clone();
                Some(config::Reload::new(
                    path,
                    Box::new(move |file| {
                        let dir = args.tls_creds.clone().or(file.tls_creds.clone());
                        let mut cfg = args.clone().merge(file, fd_socket.clone())?;
                        // The credentials in use: new ones need a restart.
                        cfg.tls = tls.clone();
                        cfg.check_tls()?;
                        Ok((cfg, dir))
                    }),
                ))
            }
        };
        Ok((cfg, reload))
    }

    /// The file's drafts and these flags as one configuration, without
    /// the TLS credentials.
    fn merge(
        self,
        file: config::FileDrafts,
        fd_socket: Option<PathBuf>,
    ) -> Result<DaemonConfig, ConfigError> {
        let mut drafts = file.devices;
        let mut single = self.single;
        if fd_socket.is_some() {
            single.socket = fd_socket;
        }
        // QEMU's backend convention passes a socket and nothing else: the
        // file's one device without a socket (its size and the rest) takes it.
        let socket_only = single.socket.is_some()
            && single
                == DeviceDraft {
                    socket: single.socket.clone(),
                    ..DeviceDraft::default()
                };
        let open: Vec<usize> = (0..drafts.len())
            .filter(|&i| drafts[i].socket.is_none())
            .collect();
        drafts.extend(self.devices);
        if socket_only && open.len() == 1 {
            drafts[open[0]].socket = single.socket.take();
        } else if single.socket.is_some() {
            drafts.push(single);
        } else if single != DeviceDraft::default() {
            return Err(ConfigError::FlagsWithoutSocket);
        }
        let mut cfg = DaemonConfig::build(
            self.host_mem_limit.or(file.host_mem_limit),
            self.control.or(file.control),
            self.socket_mode.or(file.socket_mode),
            drafts,
        )?;
        cfg.seccomp = self.seccomp.or(file.seccomp).unwrap_or_default();
        cfg.metrics = self.metrics.or(file.metrics);
        if let Some(m) = self.control_mode.or(file.control_mode) {
            cfg.control_mode = m;
        }
        if let Some(m) = self.incoming_mode.or(file.incoming_mode) {
            cfg.incoming_mode = m;
        }
        if let Some(d) = self.state_dir.or(file.state_dir) {
            cfg.state_dir = d;
            cfg.state_parent = None;
        }
        cfg.fresh = config::Devices::from_flag(&self.fresh);
        cfg.adopt = config::Devices::from_flag(&self.adopt);
        cfg.compress_threads = self.compress_threads.or(file.compress_threads);
        if let Some(b) = self.host_staging.or(file.host_staging) {
            cfg.host_staging = b;
        }
        if let Some(t) = self.incoming_timeout.or(file.incoming_timeout) {
            cfg.incoming_timeout = t;
        }
        cfg.poll_us = self.poll_us.or(file.poll_us);
        cfg.inherit_fds = self.fd.into_iter().collect();
        Ok(cfg)
    }
}

#[derive(Debug, Args)]
pub struct StatArgs {
    /// The daemon's control socket [default: $VZRAM_CONTROL, else
    /// $RUNTIME_DIRECTORY/control.sock, else /run/vzram/control.sock].
    #[arg(long, value_name = "PATH", default_value_os_t = config::default_control(), hide_default_value = true)]
    pub control: PathBuf,
    /// Print the daemon's JSON reply instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Print only the devices' names, one a line (for scripts and shell
    /// completion); with --names=leftovers, the left-over states'.
    #[arg(long, value_enum, value_name = "WHICH", num_args = 0..=1, require_equals = true,
          default_missing_value = "devices", conflicts_with = "json")]
    pub names: Option<NameList>,
    /// Sizes in bytes, not binary units (zramctl's --bytes).
    #[arg(short, long)]
    pub bytes: bool,
    /// One table of these columns, a row per device: a comma-separated
    /// list such as NAME,ORIG_DATA,MEM_USED,RATIO (`-o help` lists them).
    #[arg(short, long, value_name = "COLS", value_parser = parse_column_list)]
    pub output: Option<ColumnList>,
    /// No header lines (with no -o: the two tables' rows alone).
    #[arg(short, long)]
    pub noheadings: bool,
    /// Cells one space apart, unpadded, one word each (for scripts).
    #[arg(short, long)]
    pub raw: bool,
    #[command(flatten)]
    pub target: MaybeDevice,
}

/// The columns `vzram stat -o` was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnList(pub Vec<Column>);

/// A column `vzram stat -o` may show, one row per device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    Name,
    Size,
    Algo,
    Queues,
    Mode,
    Connected,
    OrigData,
    ComprData,
    MemUsed,
    MemLimit,
    MemUsedMax,
    SamePages,
    HugePages,
    CompactedPages,
    Ratio,
    ReadPages,
    WritePages,
    DiscardPages,
    FailedReadPages,
    FailedWritePages,
    LimitHits,
    Socket,
    State,
    Worker,
    Migration,
}

impl Column {
    pub const ALL: [Column; 25] = [
        Column::Name,
        Column::Size,
        Column::Algo,
        Column::Queues,
        Column::Mode,
        Column::Connected,
        Column::OrigData,
        Column::ComprData,
        Column::MemUsed,
        Column::MemLimit,
        Column::MemUsedMax,
        Column::SamePages,
        Column::HugePages,
        Column::CompactedPages,
        Column::Ratio,
        Column::ReadPages,
        Column::WritePages,
        Column::DiscardPages,
        Column::FailedReadPages,
        Column::FailedWritePages,
        Column::LimitHits,
        Column::Socket,
        Column::State,
        Column::Worker,
        Column::Migration,
    ];

    /// Its header: what `-o` takes (any case, `-` for `_`), and what is
    /// printed; counts say they count pages.
    pub fn header(self) -> &'static str {
        match self {
            Column::Name => "NAME",
            Column::Size => "SIZE",
            Column::Algo => "ALGO",
            Column::Queues => "QUEUES",
            Column::Mode => "MODE",
            Column::Connected => "CONNECTED",
            Column::OrigData => "ORIG_DATA",
            Column::ComprData => "COMPR_DATA",
            Column::MemUsed => "MEM_USED",
            Column::MemLimit => "MEM_LIMIT",
            Column::MemUsedMax => "MEM_USED_MAX",
            Column::SamePages => "SAME_PAGES",
            Column::HugePages => "HUGE_PAGES",
            Column::CompactedPages => "COMPACTED_PAGES",
            Column::Ratio => "RATIO",
            Column::ReadPages => "READ_PAGES",
            Column::WritePages => "WRITE_PAGES",
            Column::DiscardPages => "DISCARD_PAGES",
            Column::FailedReadPages => "FAILED_READ_PAGES",
            Column::FailedWritePages => "FAILED_WRITE_PAGES",
            Column::LimitHits => "LIMIT_HIT_PAGES",
            Column::Socket => "SOCKET",
            Column::State => "STATE",
            Column::Worker => "WORKER",
            Column::Migration => "MIGRATION",
        }
    }
}

/// `-o`'s value is not a list of columns; both say which there are.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ColumnError {
    #[error("unknown column {:?}; the columns: {}", .0, column_names())]
    Unknown(String),
    /// `-o help`.
    #[error("the columns: {}", column_names())]
    Help,
}

fn column_names() -> String {
    let all: Vec<&str> = Column::ALL.iter().map(|c| c.header()).collect();
    all.join(",")
}

/// Parses `-o`'s list: `NAME,ORIG_DATA,mem-used` (any case, `-` or `_`).
fn parse_columns(s: &str) -> Result<Vec<Column>, ColumnError> {
    s.split(',')
        .map(|w| {
            let want = w.trim().to_ascii_uppercase().replace('-', "_");
            Column::ALL
                .into_iter()
                .find(|c| c.header() == want)
                .ok_or_else(|| ColumnError::Unknown(w.to_string()))
        })
        .collect()
}

/// `-o`'s value: the columns, or `help` for the list of them.
fn parse_column_list(s: &str) -> Result<ColumnList, ColumnError> {
    if s.trim().eq_ignore_ascii_case("help") {
        return Err(ColumnError::Help);
    }
    parse_columns(s).map(ColumnList)
}

/// What `vzram stat --names` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NameList {
    /// The devices the daemon serves.
    Devices,
    /// States in the state dir that no device serves.
    Leftovers,
}

/// `vzram set-limit NAME SIZE` (or `--device NAME SIZE`), or `--host SIZE`.
#[derive(Debug, Args)]
pub struct SetLimitArgs {
    /// The daemon's control socket [default: $VZRAM_CONTROL, else
    /// $RUNTIME_DIRECTORY/control.sock, else /run/vzram/control.sock].
    #[arg(long, value_name = "PATH", default_value_os_t = config::default_control(), hide_default_value = true)]
    pub control: PathBuf,
    /// The device (name or index), then the new limit: 512M, 8G, ... (0 =
    /// none); with --host or --device, the limit alone.
    #[arg(value_names = ["NAME", "SIZE"], num_args = 1..=2, required = true, allow_negative_numbers = true)]
    pub words: Vec<String>,
    /// The device, as a flag (the same as NAME).
    #[arg(long, value_name = "NAME", conflicts_with = "host")]
    pub device: Option<String>,
    /// Set the host-wide limit instead of a device's.
    #[arg(long)]
    pub host: bool,
}

/// `set-limit`'s words that name no target and size.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitArgsError {
    #[error("set-limit needs a device (NAME SIZE, or --device NAME SIZE) or --host SIZE")]
    NoTarget,
    #[error("set-limit takes NAME SIZE, --device NAME SIZE or --host SIZE")]
    Form,
    #[error(transparent)]
    Size(#[from] config::ValueError),
}

/// What `set-limit` sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitTarget {
    Device(String),
    Host,
}

impl SetLimitArgs {
    /// The target and the size, from NAME SIZE, `--device NAME SIZE` or
    /// `--host SIZE`.
    pub fn target(&self) -> Result<(LimitTarget, u64), LimitArgsError> {
        let (target, size) = match (self.words.as_slice(), &self.device, self.host) {
            ([name, size], None, false) => (LimitTarget::Device(name.clone()), size),
            ([size], Some(d), false) => (LimitTarget::Device(d.clone()), size),
            ([size], None, true) => (LimitTarget::Host, size),
            ([_], None, false) => return Err(LimitArgsError::NoTarget),
            _ => return Err(LimitArgsError::Form),
        };
        Ok((target, config::parse_size(size)?))
    }
}

/// One device or all: `vzram CMD [NAME]` (or `--device NAME`).
#[derive(Debug, Args)]
pub struct MaybeDevice {
    /// Only this device (name or index).
    #[arg(value_name = "NAME")]
    pub name: Option<String>,
    /// The same, as a flag.
    #[arg(long, value_name = "NAME", conflicts_with = "name")]
    pub device: Option<String>,
}

impl MaybeDevice {
    pub fn device(&self) -> Option<&str> {
        self.name.as_deref().or(self.device.as_deref())
    }
}

#[derive(Debug, Args)]
pub struct ReloadArgs {
    /// The daemon's control socket [default: $VZRAM_CONTROL, else
    /// $RUNTIME_DIRECTORY/control.sock, else /run/vzram/control.sock].
    #[arg(long, value_name = "PATH", default_value_os_t = config::default_control(), hide_default_value = true)]
    pub control: PathBuf,
}

#[derive(Debug, Args)]
pub struct CompactArgs {
    /// The daemon's control socket [default: $VZRAM_CONTROL, else
    /// $RUNTIME_DIRECTORY/control.sock, else /run/vzram/control.sock].
    #[arg(long, value_name = "PATH", default_value_os_t = config::default_control(), hide_default_value = true)]
    pub control: PathBuf,
    #[command(flatten)]
    pub target: MaybeDevice,
}

#[derive(Debug, Args)]
pub struct AddArgs {
    /// The daemon's control socket [default: $VZRAM_CONTROL, else
    /// $RUNTIME_DIRECTORY/control.sock, else /run/vzram/control.sock].
    #[arg(long, value_name = "PATH", default_value_os_t = config::default_control(), hide_default_value = true)]
    pub control: PathBuf,
    /// The device, with the keys of `serve --device`:
    /// socket=PATH,size=SIZE[,name=N,queues=N,mem-limit=M,algo=A,serial=S,readonly=true,state-dir=D,
    /// backing-file=PATH,recompress-algo=A,idle-after=T,auto-writeback=B,auto-recompress=B].
    /// A state of that name that exists is recovered.
    #[arg(long, value_name = "SPEC")]
    pub device: String,
}

#[derive(Debug, Subcommand)]
pub enum BackingCommand {
    /// Make an existing file (or block device) a blank backing file that a
    /// device may take: its first 4 KiB are zeroed, giving up the pages of
    /// the device that had it. Refused while a device uses it (naming the
    /// process that holds it), for a device state's files, and, without
    /// --force, for a file that is neither blank (zeros or holes; a block
    /// device's first 64 MiB) nor a vzram backing file.
    Init {
        /// The file, at least 8 KiB (e.g. made with `fallocate -l 4G PATH`).
        path: PathBuf,
        /// Also a file that holds other data: its first 4 KiB are lost.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("what").required(true).args(["name", "device", "gone", "socket"])))]
pub struct ForgetArgs {
    /// The daemon's control socket [default: $VZRAM_CONTROL, else
    /// $RUNTIME_DIRECTORY/control.sock, else /run/vzram/control.sock].
    #[arg(long, value_name = "PATH", default_value_os_t = config::default_control(), hide_default_value = true)]
    pub control: PathBuf,
    /// The left-over state's name.
    #[arg(value_name = "NAME")]
    pub name: Option<String>,
    /// The same, as a flag.
    #[arg(long, value_name = "NAME", conflicts_with = "name")]
    pub device: Option<String>,
    /// Every left-over state whose socket's directory is gone (a test
    /// harness's temporary directory, a removed VM's): nothing can serve
    /// it again by the same command. Each is named with its size.
    #[arg(long)]
    pub gone: bool,
    /// Every left-over state made for a socket matching PATTERN, where `*`
    /// stands for any characters (`'/tmp/qtest-*'`: a test run's).
    #[arg(long, value_name = "PATTERN")]
    pub socket: Option<String>,
    /// Look in this state dir directly, not through a daemon. Without it,
    /// and with no daemon at the control socket (a bare `vzram serve` that
    /// was stopped), the default state dir is looked in. A state a running
    /// vzram serves is never touched (it holds the state's lock).
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
}

impl ForgetArgs {
    /// The one state named (NAME or --device NAME), if one is.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref().or(self.device.as_deref())
    }
}

/// The device a command acts on: `vzram CMD NAME`, or `--device NAME` as
/// before (kept for scripts), the same in every command.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("which").required(true).args(["name", "device"])))]
pub struct DeviceArgs {
    /// The daemon's control socket [default: $VZRAM_CONTROL, else
    /// $RUNTIME_DIRECTORY/control.sock, else /run/vzram/control.sock].
    #[arg(long, value_name = "PATH", default_value_os_t = config::default_control(), hide_default_value = true)]
    pub control: PathBuf,
    /// The device: its name or index.
    #[arg(value_name = "NAME")]
    pub name: Option<String>,
    /// The device, as a flag (the same as NAME).
    #[arg(long, value_name = "NAME", conflicts_with = "name")]
    pub device: Option<String>,
}

impl DeviceArgs {
    /// The device named, as NAME or `--device` (clap requires one).
    pub fn device(&self) -> &str {
        self.name
            .as_deref()
            .or(self.device.as_deref())
            .unwrap_or_default()
    }
}

/// `vzram remove` and `vzram reset`: a device, and whether to act on one
/// a VM is connected to.
#[derive(Debug, Args)]
pub struct DestroyArgs {
    #[command(flatten)]
    pub target: DeviceArgs,
    /// Also when a frontend (a VM) is connected: it is cut off. Without
    /// it that is refused, naming the frontend.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Args)]
pub struct RecompressArgs {
    #[command(flatten)]
    pub target: DeviceArgs,
    /// Only pages marked idle (and not read or written since).
    #[arg(long)]
    pub idle: bool,
    /// Only huge pages (stored uncompressed).
    #[arg(long)]
    pub huge: bool,
    /// The codec to try [default: the device's recompress-algo].
    #[arg(long, value_parser = config::parse_codec, value_name = "ALGO")]
    pub algo: Option<vzram_store::Codec>,
}

#[derive(Debug, Args)]
pub struct WritebackArgs {
    #[command(flatten)]
    pub target: DeviceArgs,
    /// Only pages marked idle (and not read or written since).
    #[arg(long)]
    pub idle: bool,
    /// Only cold pages (idle for the device's --idle-after, by the ager).
    #[arg(long)]
    pub cold: bool,
    /// Only huge pages (stored uncompressed).
    #[arg(long)]
    pub huge: bool,
    /// Only huge pages that recompression could not shrink either.
    #[arg(long)]
    pub incompressible: bool,
    /// Move at most this many pages.
    #[arg(long, value_name = "N")]
    pub max_pages: Option<u64>,
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub target: DeviceArgs,
    /// The destination device's incoming address: unix:PATH (tunnel it over
    /// SSH between hosts) or tcp:HOST:PORT (mutual TLS: the daemon needs
    /// --tls-creds with client-cert.pem and client-key.pem).
    #[arg(
        long,
        value_parser = parse_addr,
        value_name = "ADDR",
        required_unless_present_any = ["commit", "cancel"]
    )]
    pub to: Option<Addr>,
    /// Keep the pages here once the destination has them.
    #[arg(long, conflicts_with_all = ["commit", "cancel"])]
    pub keep: bool,
    /// Commit a migration under way now: the VM has moved, and its VMM
    /// keeps the source process (QEMU's source exits or closes the socket
    /// after a completed migration, which commits by itself).
    #[arg(long, conflicts_with_all = ["to", "cancel"])]
    pub commit: bool,
    /// Call off a migration under way: the VMM's own migration was
    /// cancelled or failed and the guest runs here. The sender aborts (at
    /// once, also in pre-copy), the destination drops its copy and waits
    /// again, and every page stays here.
    #[arg(long, conflicts_with = "to")]
    pub cancel: bool,
}

#[cfg(test)]
mod tests;
