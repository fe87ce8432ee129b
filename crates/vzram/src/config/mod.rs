//! The daemon's configuration: sizes, the TOML file, `--device` specs, and
//! the checks that turn them into a [`DaemonConfig`]. Every error here is
//! the user's input, so the binary reports it in one line and exits 2.

use std::collections::HashSet;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use vzram_blk::config::{MAX_QUEUES, SERIAL_LEN};
use vzram_store::{Codec, PAGE_SIZE};

mod de;
mod draft;
mod error;
mod file;
mod parse;
mod refusal;
mod state_dir;
#[cfg(test)]
mod tests;

pub use crate::proto::worker_spec::SeccompMode;
pub use draft::{parse_device_spec, DeviceDraft, SpecError};
pub use file::{keys as file_keys, load_file, parse_file, FileDrafts};
pub use parse::{
    default_recompress_algo, parse_bool, parse_codec, parse_duration, parse_metrics_addr,
    parse_mode, parse_size, size_text, tiny_limit, AddrFault, ValueError,
    DEFAULT_HOST_STAGING_PER_CORE, DEFAULT_QUEUES, DEFAULT_SOCKET_MODE, DEFAULT_STAGING,
    MAX_POLL_US, MIN_IDLE_AFTER,
};
use state_dir::runtime_directory;
pub use state_dir::{state_dir_from, DefaultStateDir, StateEnv, StateParent};

use crate::proto::addr::Addr;
pub use error::{ConfigError, ModeError};
pub use refusal::Refusal;

fn err<T>(r: Refusal) -> Result<T, ConfigError> {
    Err(ConfigError::Rule(r))
}

/// One device, checked and with defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    pub name: String,
    /// The name was given (`name=`, `--name`), not taken from the socket:
    /// see [`DeviceSpec::state_key`].
    pub named: bool,
    pub socket: PathBuf,
    pub size: u64,
    pub queues: u16,
    pub algo: Codec,
    pub mem_limit: u64,
    pub serial: String,
    pub readonly: bool,
    /// Segments per discard or write-zeroes request, 1..=256.
    pub discard_segments: u16,
    /// Raw staging budget in bytes (0: off).
    pub staging: u64,
    /// Where this device keeps its state, if not in the daemon's directory.
    pub state_dir: Option<PathBuf>,
    /// What a state found under its name is to it.
    pub on_state: OnState,
    /// Take a state made under another name or for another socket.
    pub adopt: bool,
    /// Tiering: the backing file, the recompression codec, the ager.
    pub tier: TierSpec,
    /// Wait for the pages from another vzram at this address.
    pub incoming: Option<Addr>,
}

/// A device's tiering settings, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierSpec {
    pub backing_file: Option<PathBuf>,
    pub recompress_algo: Codec,
    /// Run the ager (every third of this) while a frontend is connected.
    pub idle_after: Option<Duration>,
    pub auto_writeback: bool,
    pub auto_recompress: bool,
}

impl TierSpec {
    /// No backing file, no ager; recompression on request only.
    pub fn none(algo: Codec) -> TierSpec {
        TierSpec {
            backing_file: None,
            recompress_algo: default_recompress_algo(algo),
            idle_after: None,
            auto_writeback: false,
            auto_recompress: false,
        }
    }
}

/// What a device does with a state it finds under its name, as given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnState {
    /// Nothing said: a configured device recovers it, a device added at
    /// run time refuses it.
    #[default]
    Unsaid,
    /// `recover=true`.
    Recover,
    /// `recover=false`: refused at start too.
    Refuse,
    /// `fresh=true`: discarded.
    Fresh,
}

impl OnState {
    /// For a device the daemon starts with (`runtime` false) or one
    /// `vzram add` adds; `fresh`: the daemon's `--fresh` names it.
    pub fn existing(self, runtime: bool, fresh: bool) -> vzram_store::Existing {
        use vzram_store::Existing;
        match self {
            OnState::Fresh => Existing::Discard,
            _ if fresh && !runtime => Existing::Discard,
            OnState::Recover => Existing::Recover,
            OnState::Refuse => Existing::Refuse,
            OnState::Unsaid if runtime => Existing::Refuse,
            OnState::Unsaid => Existing::Recover,
        }
    }
}

/// The devices a daemon-wide flag (`--fresh`, `--adopt`) applies to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Devices {
    #[default]
    None,
    /// The flag without a name: every device.
    All,
    /// `--flag NAME`, once per device.
    Named(Vec<String>),
}

impl Devices {
    /// The flag's values as given: an empty one is the bare flag.
    pub fn from_flag(values: &[String]) -> Devices {
        if values.is_empty() {
            Devices::None
        } else if values.iter().any(String::is_empty) {
            Devices::All
        } else {
            Devices::Named(values.to_vec())
        }
    }

    pub fn covers(&self, name: &str) -> bool {
        match self {
            Devices::None => false,
            Devices::All => true,
            Devices::Named(n) => n.iter().any(|n| n == name),
        }
    }

    /// Whether the flag names `d`: by its name, or by its state's key
    /// (what the refusals about a state name it by).
    pub fn covers_device(&self, d: &DeviceSpec) -> bool {
        self.covers(&d.name) || self.covers(&d.state_key())
    }

    /// Every name given is a device of `cfg` (a typo must not leave the
    /// state the operator meant to discard, or take, as it is).
    pub fn check(&self, flag: &'static str, devices: &[DeviceSpec]) -> Result<(), ConfigError> {
        let Devices::Named(names) = self else {
            return Ok(());
        };
        for n in names {
            if !devices.iter().any(|d| d.name == *n || d.state_key() == *n) {
                return err(Refusal::NoSuchDevice {
                    flag,
                    name: n.clone(),
                    known: devices.iter().map(|d| d.name.clone()).collect(),
                });
            }
        }
        Ok(())
    }
}

/// A device's name when none is given: its socket's file name, less a
/// `.sock` or `.socket` suffix, with anything but letters, digits, `-`,
/// `_` and `.` made `_` (leading dots dropped), cut to 64 bytes. A stable
/// socket path is then a stable name, whatever the device's place in the
/// config, and separate daemons on separate sockets never share one.
pub fn name_from_socket(socket: &std::path::Path) -> Option<String> {
    let file = socket.file_name()?.to_string_lossy().into_owned();
    let stem = file
        .strip_suffix(".sock")
        .or_else(|| file.strip_suffix(".socket"))
        .unwrap_or(&file);
    let mut name: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect::<String>()
        .trim_start_matches('.')
        .to_string();
    name.truncate(64);
    (!name.is_empty()).then_some(name)
}

impl DeviceSpec {
    /// The socket path as the state header records it: absolute (against
    /// the daemon's working directory), not resolved through links.
    pub fn socket_abs(&self) -> PathBuf {
        std::path::absolute(&self.socket).unwrap_or_else(|_| self.socket.clone())
    }

    /// The name of this device's state directory. A named device's is its
    /// name. A device named after its socket is keyed by the whole socket
    /// path (`vm-1a2b3c4d` for `/tmp/x/vm.sock`): the same command keeps
    /// its pages, and a socket of the same name in another directory is
    /// another disk, not a refusal. [`DeviceSpec::legacy_key`] is the key
    /// such a device had before.
    pub fn state_key(&self) -> String {
        if self.named {
            return self.name.clone();
        }
        format!("{}-{:08x}", self.name, path_hash(&self.socket_abs()))
    }

    /// The key a device named after its socket had before keys carried the
    /// socket path: its name. Only a state there whose header records this
    /// very socket is still this device's.
    pub fn legacy_key(&self) -> Option<&str> {
        (!self.named).then_some(self.name.as_str())
    }

    /// The directory holding this device's state directory.
    pub fn state_root<'a>(&'a self, daemon: &'a DaemonConfig) -> &'a std::path::Path {
        self.state_dir.as_deref().unwrap_or(&daemon.state_dir)
    }
}

/// 32 bits of FNV-1a over a path's bytes: stable across builds and
/// platforms, unlike std's hasher, since state directories are named by it.
fn path_hash(p: &std::path::Path) -> u32 {
    use std::os::unix::ffi::OsStrExt;
    let h = p
        .as_os_str()
        .as_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    (h ^ (h >> 32)) as u32
}

/// How a device's serial starts unless one is given: what the udev rule in
/// `contrib/udev/60-vzram.rules` matches to tell the guest the disk is not
/// rotational. A guest sees the serial as `/sys/block/vdX/serial` and
/// `/dev/disk/by-id/virtio-<serial>`.
pub const SERIAL_PREFIX: &str = "vzram-";
pub use parse::MAX_DISCARD_SEGMENTS;
/// How long an incoming stream may take by default: a 64 GiB device at
/// about 20 MiB/s.
pub const INCOMING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);

/// `vzram-<name>`, cut to the 20 bytes GET_ID has room for (at a character
/// boundary).
pub fn default_serial(name: &str) -> String {
    let mut s = format!("{SERIAL_PREFIX}{name}");
    let mut end = s.len().min(SERIAL_LEN);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s
}

/// Where state lives when no flag or file says (see [`state_dir_from`]):
/// `$VZRAM_STATE_DIR`, else systemd's runtime directory (kept across
/// restarts with `RuntimeDirectoryPreserve=yes`), else `/run/vzram/state`
/// for root, `$XDG_RUNTIME_DIR/vzram/state` or `/dev/shm/vzram-<uid>` for
/// a user. All tmpfs, where the state's pages are plain memory.
pub fn default_state_dir() -> DefaultStateDir {
    state_dir_from(StateEnv::current())
}

/// The control socket when `--control` (or `control` in the file) does not
/// say: `$VZRAM_CONTROL`, else `$RUNTIME_DIRECTORY/control.sock` (systemd),
/// else root's `/run/vzram/control.sock`, else a user's
/// `$XDG_RUNTIME_DIR/vzram/control.sock` (`/tmp/vzram-UID/control.sock`
/// without one). `vzram serve` binds it (making the last two directories
/// if missing) and the client commands look for it here, so both find
/// the same one.
pub fn default_control() -> PathBuf {
    control_from(
        std::env::var_os("VZRAM_CONTROL"),
        std::env::var_os("RUNTIME_DIRECTORY"),
        euid(),
        std::env::var_os("XDG_RUNTIME_DIR"),
    )
}

/// The effective uid, asked once (the supervisor builds configurations
/// again under its seccomp filter, which allows no geteuid).
pub fn euid() -> u32 {
    vzram_store::state::euid()
}

/// [`default_control`] from the variables' values and the effective uid.
pub fn control_from(
    vzram_control: Option<OsString>,
    runtime: Option<OsString>,
    euid: u32,
    xdg_runtime: Option<OsString>,
) -> PathBuf {
    if let Some(c) = vzram_control.filter(|c| !c.is_empty()) {
        return PathBuf::from(c);
    }
    if let Some(d) = runtime_directory(runtime) {
        return d.join("control.sock");
    }
    user_runtime_dir(euid, xdg_runtime).join("control.sock")
}

/// The daemon's own runtime directory when systemd names none: root's
/// `/run/vzram`; a user's `$XDG_RUNTIME_DIR/vzram` (a directory only that
/// user may write, made by the login manager), else `/tmp/vzram-UID`,
/// which the daemon makes 0700 or refuses if another user made it first.
pub fn user_runtime_dir(euid: u32, xdg_runtime: Option<OsString>) -> PathBuf {
    if euid == 0 {
        return PathBuf::from(DEFAULT_RUN_DIR);
    }
    match xdg_runtime.filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d).join("vzram"),
        None => PathBuf::from(format!("/tmp/vzram-{euid}")),
    }
}

/// The host's staging budget when none is given:
/// [`DEFAULT_HOST_STAGING_PER_CORE`] per core.
pub fn default_host_staging() -> u64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    DEFAULT_HOST_STAGING_PER_CORE.saturating_mul(cores as u64)
}

/// Root's runtime directory: the one contrib's units name.
pub const DEFAULT_RUN_DIR: &str = "/run/vzram";
/// Root's control socket when nothing else says: the path contrib's units use.
pub const DEFAULT_CONTROL: &str = "/run/vzram/control.sock";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonConfig {
    /// Pool-wide cap on memory; 0 = none.
    pub host_mem_limit: u64,
    /// The control socket; always one ([`default_control`] unless given).
    pub control: PathBuf,
    /// No flag, file or variable named the control socket: the daemon
    /// may make its directory, and takes another name beside it when a
    /// second daemon already listens there.
    pub control_defaulted: bool,
    pub socket_mode: u32,
    /// The control socket's own mode: it changes limits, so it stays the
    /// admin's even when the VMM's group may reach the device sockets.
    pub control_mode: u32,
    /// Where to serve `/metrics`, if anywhere.
    pub metrics: Option<SocketAddr>,
    /// The sandbox; [`DaemonConfig::build`] leaves it on.
    pub seccomp: SeccompMode,
    /// Directory of the devices' state ([`default_state_dir`] unless given).
    pub state_dir: PathBuf,
    /// The default state dir's parent, made if missing; None for one given.
    pub state_parent: Option<StateParent>,
    /// The devices whose existing state is discarded at start (`--fresh`).
    pub fresh: Devices,
    /// The devices that may take a state made under another name or for
    /// another socket (`--adopt`).
    pub adopt: Devices,
    /// Listening sockets passed in (`--fd`), besides systemd's.
    pub inherit_fds: Vec<std::os::fd::RawFd>,
    /// Compress-pool threads per worker; None: a core less than the host has, 1 to 4.
    pub compress_threads: Option<usize>,
    /// Raw staging of all devices together, in bytes (0: none stages).
    pub host_staging: u64,
    /// Longest poll of a ring that ran dry, in µs; None: the default.
    pub poll_us: Option<u64>,
    /// Longest an incoming migration stream may take to arrive whole.
    pub incoming_timeout: std::time::Duration,
    /// The mode of incoming devices' unix migration sockets: whoever can
    /// connect writes the device, so not --socket-mode's.
    pub incoming_mode: u32,
    /// Credentials for migration streams on TCP (`--tls-creds`).
    pub tls: Option<crate::proto::tls::CredsDir>,
    pub devices: Vec<DeviceSpec>,
}

impl DaemonConfig {
    /// A device that receives on TCP needs the server credentials: a
    /// stream anyone who reaches the port could write is refused.
    pub fn check_tls(&self) -> Result<(), ConfigError> {
        let server = self.tls.as_ref().is_some_and(|t| t.server.is_some());
        for d in &self.devices {
            if let Some(a @ Addr::Tcp(_)) = &d.incoming {
                if !server {
                    return err(Refusal::IncomingNeedsTls {
                        name: d.name.clone(),
                        addr: a.clone(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Fills in defaults and checks everything that can be checked before
    /// touching the system.
    pub fn build(
        host_mem_limit: Option<u64>,
        control: Option<PathBuf>,
        socket_mode: Option<u32>,
        drafts: Vec<DeviceDraft>,
    ) -> Result<DaemonConfig, ConfigError> {
        if drafts.is_empty() {
            return err(Refusal::NoDevice);
        }
        let mut devices = Vec::with_capacity(drafts.len());
        let mut taken = Taken::default();
        for (i, d) in drafts.into_iter().enumerate() {
            devices.push(DeviceSpec::check(i, d, &mut taken)?);
        }
        let control_defaulted =
            control.is_none() && std::env::var_os("VZRAM_CONTROL").is_none_or(|c| c.is_empty());
        let control = control.unwrap_or_else(default_control);
        for d in &devices {
            d.incoming_apart(|p| taken.sockets.contains(p) || control == *p)?;
        }
        if taken.sockets.contains(&control) {
            return err(Refusal::ControlIsDevice(control));
        }
        let default_state = default_state_dir();
        Ok(DaemonConfig {
            host_mem_limit: host_mem_limit.unwrap_or(0),
            control,
            control_defaulted,
            socket_mode: socket_mode.unwrap_or(DEFAULT_SOCKET_MODE),
            control_mode: DEFAULT_SOCKET_MODE,
            metrics: None,
            seccomp: SeccompMode::default(),
            state_dir: default_state.path,
            state_parent: default_state.parent,
            fresh: Devices::None,
            adopt: Devices::None,
            inherit_fds: Vec::new(),
            compress_threads: None,
            host_staging: default_host_staging(),
            poll_us: None,
            incoming_timeout: INCOMING_TIMEOUT,
            incoming_mode: DEFAULT_SOCKET_MODE,
            tls: None,
            devices,
        })
    }
}

/// What the devices checked so far hold that the next may not share.
#[derive(Debug, Default)]
pub struct Taken {
    sockets: HashSet<PathBuf>,
    names: HashSet<String>,
    /// Backing files, with their devices.
    backing: Vec<(PathBuf, String)>,
    incoming: HashSet<Addr>,
}

impl DeviceSpec {
    /// The device `d` (the `index`th given) with its defaults filled in,
    /// checked on its own and against the devices before it (`taken`,
    /// which it joins).
    pub fn check(
        index: usize,
        d: DeviceDraft,
        taken: &mut Taken,
    ) -> Result<DeviceSpec, ConfigError> {
        let derived = d.name.is_none();
        let Some(name) = d
            .name
            .clone()
            .or_else(|| d.socket.as_deref().and_then(name_from_socket))
        else {
            return err(match &d.socket {
                None => Refusal::NoSocketAt { index },
                Some(s) => Refusal::NoNameFrom {
                    index,
                    socket: s.clone(),
                },
            });
        };
        // The name is also the state directory's name.
        if name.is_empty()
            || name.len() > 64
            || name.starts_with('.')
            || name.contains('/')
            || name.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return err(Refusal::BadName { index, name });
        }
        let algo = d.algo.unwrap_or(Codec::Lz4);
        let tier = tier_spec(&name, algo, &d, &mut taken.backing)?;
        let Some(socket) = d.socket else {
            return err(Refusal::NoSocket { name });
        };
        if socket.as_os_str().is_empty() {
            return err(Refusal::EmptySocket { name });
        }
        let Some(size) = d.size else {
            return err(Refusal::NoSize { name });
        };
        if size == 0 || size % PAGE_SIZE as u64 != 0 {
            return err(Refusal::SizeNotPages { name, size });
        }
        if size > parse::MAX_DEVICE_SIZE {
            return err(Refusal::SizeTooLarge { name, size });
        }
        let queues = d.queues.unwrap_or(DEFAULT_QUEUES);
        if !(1..=MAX_QUEUES).contains(&usize::from(queues)) {
            return err(Refusal::Queues { name, queues });
        }
        let discard_segments = d.discard_segments.unwrap_or(MAX_DISCARD_SEGMENTS);
        if !(1..=MAX_DISCARD_SEGMENTS).contains(&discard_segments) {
            return err(Refusal::DiscardSegments {
                name,
                segments: discard_segments,
            });
        }
        let serial = d.serial.unwrap_or_else(|| default_serial(&name));
        if serial.len() > SERIAL_LEN {
            return err(Refusal::SerialTooLong { name, serial });
        }
        if !taken.sockets.insert(socket.clone()) {
            return err(Refusal::SocketTwice(socket));
        }
        if !taken.names.insert(name.clone()) {
            return err(Refusal::NameTwice {
                name,
                from: derived.then_some(socket),
            });
        }
        let on_state = match (d.recover, d.fresh) {
            (Some(true), Some(true)) => return err(Refusal::RecoverAndFresh { name }),
            (_, Some(true)) => OnState::Fresh,
            (Some(true), _) => OnState::Recover,
            (Some(false), _) => OnState::Refuse,
            (None, _) => OnState::Unsaid,
        };
        if let Some(a) = &d.incoming {
            if !taken.incoming.insert(a.clone()) {
                return err(Refusal::IncomingTwice {
                    name,
                    addr: a.clone(),
                });
            }
        }
        let mem_limit = d.mem_limit.unwrap_or(0);
        if mem_limit > size {
            // Compressed pages take at most a page each: a limit above
            // the size is a typo, or meant for another device.
            return err(Refusal::MemLimitAboveSize {
                name,
                mem_limit,
                size,
            });
        }
        // One above the host limit is accepted, with a warning when
        // the daemon starts (the host limit caps it first).
        Ok(DeviceSpec {
            name,
            named: !derived,
            socket,
            size,
            queues,
            algo,
            mem_limit,
            serial,
            readonly: d.readonly.unwrap_or(false),
            discard_segments,
            staging: d.staging.unwrap_or(DEFAULT_STAGING),
            state_dir: d.state_dir,
            on_state,
            adopt: d.adopt.unwrap_or(false),
            tier,
            incoming: d.incoming,
        })
    }

    /// The checks [`DaemonConfig::build`] makes of its sockets, for a
    /// device added to a daemon whose control socket is `control` (its
    /// name and socket against the other devices' are the daemon's to
    /// check).
    pub fn check_beside(&self, control: &std::path::Path) -> Result<(), ConfigError> {
        self.incoming_apart(|p| *p == self.socket || p == control)?;
        if self.socket == control {
            return err(Refusal::ControlIsDevice(control.to_path_buf()));
        }
        Ok(())
    }

    /// An incoming unix socket that is not a socket of the daemon's
    /// (`is_socket`: a device's or the control socket).
    pub fn incoming_apart(&self, is_socket: impl Fn(&PathBuf) -> bool) -> Result<(), ConfigError> {
        if let Some(Addr::Unix(p)) = &self.incoming {
            if is_socket(p) {
                return err(Refusal::IncomingIsSocket {
                    name: self.name.clone(),
                    socket: p.clone(),
                });
            }
        }
        Ok(())
    }
}

/// Checks a draft's tiering keys. `taken` holds the backing files of the
/// devices checked so far (path, device): two devices may not share one.
fn tier_spec(
    name: &str,
    algo: Codec,
    d: &DeviceDraft,
    taken: &mut Vec<(PathBuf, String)>,
) -> Result<TierSpec, ConfigError> {
    let backing_file = d.backing_file.clone();
    if let Some(p) = &backing_file {
        if p.as_os_str().is_empty() {
            return err(Refusal::EmptyBacking { name: name.into() });
        }
        if let Some((_, other)) = taken.iter().find(|(q, _)| q == p) {
            return err(Refusal::BackingShared {
                path: p.clone(),
                other: other.clone(),
                name: name.into(),
            });
        }
        taken.push((p.clone(), name.to_string()));
    }
    let recompress_algo = d
        .recompress_algo
        .unwrap_or_else(|| default_recompress_algo(algo));
    if d.recompress_algo == Some(algo) {
        return err(Refusal::RecompressOwnAlgo {
            name: name.into(),
            algo: recompress_algo,
        });
    }
    if let Some(t) = d.idle_after {
        if t < MIN_IDLE_AFTER {
            return err(Refusal::IdleAfterShort {
                name: name.into(),
                idle_after: t,
                least: MIN_IDLE_AFTER,
            });
        }
    }
    let auto_writeback = d.auto_writeback.unwrap_or(false);
    let auto_recompress = d.auto_recompress.unwrap_or(false);
    if auto_writeback && backing_file.is_none() {
        return err(Refusal::WritebackWithoutBacking { name: name.into() });
    }
    if (auto_writeback || auto_recompress) && d.idle_after.is_none() {
        return err(Refusal::AutoWithoutIdle {
            name: name.into(),
            writeback: auto_writeback,
        });
    }
    Ok(TierSpec {
        backing_file,
        recompress_algo,
        idle_after: d.idle_after,
        auto_writeback,
        auto_recompress,
    })
}

/// How the configuration is built again from the file's new text, as at
/// start (the command line's flags still win over the file).
type Rebuild =
    dyn Fn(FileDrafts) -> Result<(DaemonConfig, Option<PathBuf>), ConfigError> + Send + Sync;

/// What SIGHUP needs: the `--config` file (absolute) and how to turn its
/// text into a configuration.
pub struct Reload {
    pub path: PathBuf,
    rebuild: Box<Rebuild>,
}

impl Reload {
    /// `rebuild` returns the configuration and the TLS credentials
    /// directory it names (the credentials themselves are the ones read
    /// at start).
    pub fn new(path: PathBuf, rebuild: Box<Rebuild>) -> Reload {
        Reload { path, rebuild }
    }

    /// The configuration the file's `text` gives, and its TLS directory.
    pub fn build(&self, text: &str) -> Result<(DaemonConfig, Option<PathBuf>), ConfigError> {
        let file = parse_file(text).map_err(|e| ConfigError::File {
            path: self.path.clone(),
            source: Box::new(e),
        })?;
        (self.rebuild)(file)
    }
}
