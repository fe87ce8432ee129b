//! Client commands that talk to a running daemon over its control socket:
//! `vzram stat`, `set-limit`, `compact`, `add`, `remove`, `reset`,
//! `reset-max`, `mark-idle`, `recompress`, `writeback`. Each request is
//! a [`crate::proto::control::Command`], which names its reply. And two that need no
//! daemon: `backing init`, and the packagers' `man` and `completions`
//! (`docs`).

use std::path::Path;

use serde_json::Value;

use crate::cli::{
    AddArgs, BackingCommand, Command, CompactArgs, DestroyArgs, DeviceArgs, ForgetArgs,
    LimitTarget, MigrateArgs, NameList, RecompressArgs, SetLimitArgs, StatArgs, WritebackArgs,
};
use crate::proto::control::{
    cmd, parse_reply, Client, ControlError, DeviceRef, Forgotten, Head, LeftoverStat, ReloadChange,
    StatReply,
};
use render::{human, render, render_columns, Style};

mod complete;
mod docs;
mod manual;
mod offline;
mod options;
mod render;

/// An error for the user, and the exit code it deserves.
pub struct ClientError {
    pub message: String,
    pub code: u8,
}

/// Runs a client command; `serve` is not one.
pub fn run(cmd: Command) -> Result<String, ClientError> {
    match cmd {
        Command::Stat(a) => stat(&a),
        Command::SetLimit(a) => set_limit(&a),
        Command::Compact(a) => compact(&a),
        Command::Reload(a) => reload(&a),
        Command::Add(a) => add(&a),
        Command::Remove(a) => remove(&a),
        Command::Forget(a) => forget(&a),
        Command::Backing(BackingCommand::Init { path, force }) => backing_init(&path, force),
        Command::Reset(a) => reset(&a),
        Command::ResetMax(a) => reset_max(&a),
        Command::MarkIdle(a) => mark_idle(&a),
        Command::Recompress(a) => recompress(&a),
        Command::Writeback(a) => writeback(&a),
        Command::Migrate(a) => migrate(&a),
        Command::Man(a) if a.options => Ok(options::markdown()),
        Command::Man(a) => docs::man(a.dir.as_deref()).map_err(|e| ClientError {
            message: format!("cannot write the manual pages: {e}"),
            code: 1,
        }),
        Command::Completions(a) => Ok(complete::completions(a.shell)),
        Command::Serve(_) => Err(ClientError {
            message: "serve is the daemon, not a client command".into(),
            code: 2,
        }),
    }
}

impl From<ControlError> for ClientError {
    /// A refusal's exit status is its kind's; a reply we cannot read, or
    /// no daemon, is 1.
    fn from(e: ControlError) -> ClientError {
        ClientError {
            code: e.exit_code(),
            message: e.to_string(),
        }
    }
}

pub fn stat(args: &StatArgs) -> Result<String, ClientError> {
    let mut reply = Client::new(&args.control).call_raw(&cmd::Stat {})?;
    let mut stat: StatReply = parse_reply(reply.clone()).map_err(ControlError::from)?;
    if let Some(asked) = args.target.device() {
        let i = one_device(&stat, asked)?;
        stat.devices = vec![stat.devices.swap_remove(i)];
        stat.leftovers.clear();
        // The JSON the same way: its devices are the reply's, in order.
        if let Some(Value::Array(ds)) = reply.get_mut("devices") {
            *ds = vec![ds.swap_remove(i)];
        }
        reply["leftovers"] = Value::Array(Vec::new());
    }
    if args.json {
        return Ok(format!("{reply}\n"));
    }
    match args.names {
        Some(NameList::Devices) => return Ok(lines(stat.devices.iter().map(|d| &d.name))),
        Some(NameList::Leftovers) => return Ok(lines(stat.leftovers.iter().map(|l| &l.name))),
        None => {}
    }
    let style = Style {
        bytes: args.bytes,
        headings: !args.noheadings,
        raw: args.raw,
    };
    if let Some(cols) = &args.output {
        return Ok(render_columns(&stat, &cols.0, style));
    }
    let mut out = render(&stat, style);
    if !style.headings || style.raw {
        return Ok(out);
    }
    // Absent from a daemon older than the version field.
    if let Some(v) = Head::of(&reply).and_then(|h| h.version) {
        out += &format!("daemon: vzram {v}\n");
    }
    Ok(out)
}

/// One name a line.
fn lines<'a>(names: impl Iterator<Item = &'a String>) -> String {
    names.map(|n| format!("{n}\n")).collect()
}

/// Where `asked` is in the reply's devices: by name, else by index, as
/// the daemon reads a device in a request.
fn one_device(stat: &StatReply, asked: &str) -> Result<usize, ClientError> {
    let ds = &stat.devices;
    ds.iter()
        .position(|d| d.name == asked)
        .or_else(|| {
            let i: usize = asked.parse().ok()?;
            ds.iter().position(|d| d.index == i)
        })
        .ok_or_else(|| {
            let known: Vec<String> = ds
                .iter()
                .map(|d| format!("{} ({})", d.name, d.index))
                .collect();
            ClientError {
                message: format!(
                    "no device {asked:?}; the daemon serves {}",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ),
                code: 2,
            }
        })
}

pub fn set_limit(args: &SetLimitArgs) -> Result<String, ClientError> {
    let (target, bytes) = args.target().map_err(|e| ClientError {
        message: e.to_string(),
        code: 2,
    })?;
    let what = match &target {
        LimitTarget::Device(d) => format!("device {d}"),
        LimitTarget::Host => "host".to_string(),
    };
    let req = match target {
        LimitTarget::Device(d) => cmd::SetLimit {
            device: Some(DeviceRef::named(&d)),
            host: false,
            bytes,
        },
        LimitTarget::Host => cmd::SetLimit {
            device: None,
            host: true,
            bytes,
        },
    };
    let set = Client::new(&args.control).call(&req)?;
    // Set all the same; what it is at odds with goes to stderr.
    for w in set.warnings() {
        eprintln!("warning: {w}");
    }
    let limit = if bytes == 0 {
        "none".to_string()
    } else {
        human(bytes)
    };
    Ok(format!("{what} memory limit: {limit}\n"))
}

pub fn add(args: &AddArgs) -> Result<String, ClientError> {
    // Parsed here, once: a bad spec is refused before any daemon is asked.
    let draft = crate::config::parse_device_spec(&args.device).map_err(|e| ClientError {
        message: e.to_string(),
        code: 2,
    })?;
    let reply = Client::new(&args.control).call(&cmd::Add {
        device: Box::new(draft.into()),
    })?;
    let state = if reply.recovered {
        format!("serving the pages its state {} held", reply.state.display())
    } else {
        format!("empty, new state {}", reply.state.display())
    };
    Ok(format!(
        "added device {} (index {}), {state}\n",
        reply.device, reply.index
    ))
}

/// Runs here, not in the daemon: the file's lock tells whether a device
/// holds it.
pub fn backing_init(path: &Path, force: bool) -> Result<String, ClientError> {
    let blocks = vzram_store::Backing::init(path, force).map_err(|e| ClientError {
        message: e.to_string(),
        code: 2,
    })?;
    Ok(format!(
        "{}: a blank backing file of {blocks} page blocks ({}), for any device to take\n",
        path.display(),
        human(blocks * vzram_store::PAGE_SIZE as u64)
    ))
}

pub fn forget(args: &ForgetArgs) -> Result<String, ClientError> {
    if args.state_dir.is_some() || offline::no_daemon(&args.control) {
        let root = offline::root(args.state_dir.as_deref());
        let mut out = match &args.state_dir {
            Some(_) => String::new(),
            None => format!(
                "no daemon at {}: looking in the state dir {} directly\n",
                args.control.display(),
                root.display()
            ),
        };
        let pattern = args.socket.as_deref();
        let chosen = |socket: &Path| match pattern {
            Some(p) => matches_pattern(p, &socket.to_string_lossy()),
            None => gone(socket),
        };
        let which = match args.name() {
            Some(n) => offline::Which::Named(n),
            None => offline::Which::Many {
                chosen: &chosen,
                why_kept: kept_why(pattern),
            },
        };
        out += &offline::forget(&root, which).map_err(|e| ClientError {
            message: e.to_string(),
            code: 2,
        })?;
        return Ok(out);
    }
    let Some(name) = args.name() else {
        return forget_many(&args.control, args.socket.as_deref());
    };
    let reply = Client::new(&args.control).call(&cmd::Forget {
        name: name.to_string(),
    })?;
    Ok(forgotten(&reply))
}

fn forgotten(reply: &Forgotten) -> String {
    format!(
        "forgot {}: deleted its state {} ({} device)\n",
        reply.name,
        reply.dir.display(),
        human(reply.size_bytes)
    )
}

/// `vzram forget --gone` (no `pattern`): the left-overs whose socket's
/// directory no longer exists; `vzram forget --socket PATTERN`: those made
/// for a socket that matches. Each is forgotten by name (the daemon still
/// refuses one that is served or held). One whose socket is unrecorded is
/// kept, and with `--gone` one whose directory is there: its command could
/// serve it again.
fn forget_many(control: &Path, pattern: Option<&str>) -> Result<String, ClientError> {
    let client = Client::new(control);
    let stat = client.call(&cmd::Stat {})?;
    let chosen = |l: &LeftoverStat| {
        let Some(socket) = l.socket.as_deref() else {
            return false;
        };
        match pattern {
            Some(p) => matches_pattern(p, &socket.to_string_lossy()),
            None => gone(socket),
        }
    };
    let (doomed, kept): (Vec<_>, Vec<_>) = stat.leftovers.iter().partition(|l| chosen(l));
    let mut out = String::new();
    let mut freed = 0;
    for l in &doomed {
        let reply = client.call(&cmd::Forget {
            name: l.name.clone(),
        })?;
        freed += l.state_bytes;
        out += &forgotten(&reply);
    }
    let why = kept_why(pattern);
    out += &format!(
        "{} left-over states forgotten ({} of memory given back); {} kept, {why}\n",
        doomed.len(),
        human(freed),
        kept.len()
    );
    Ok(out)
}

/// Whether `socket`'s directory is gone: nothing can serve its state again
/// by the same command.
fn gone(socket: &Path) -> bool {
    socket
        .parent()
        .is_some_and(|d| !d.as_os_str().is_empty() && !d.exists())
}

fn kept_why(pattern: Option<&str>) -> String {
    match pattern {
        Some(p) => format!("their socket does not match {p}"),
        None => "their socket's directory still there".to_string(),
    }
}

/// Whether `text` matches `pattern`, in which `*` stands for any run of
/// characters (`/` included) and everything else for itself.
fn matches_pattern(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, rest) = (parts[0], &parts[1..]);
    let Some(mut left) = text.strip_prefix(first) else {
        return false;
    };
    let Some((last, middle)) = rest.split_last() else {
        return left.is_empty();
    };
    for p in middle {
        match left.find(p) {
            Some(i) => left = &left[i + p.len()..],
            None => return false,
        }
    }
    left.len() >= last.len() && left.ends_with(last)
}

pub fn remove(args: &DestroyArgs) -> Result<String, ClientError> {
    let t = &args.target;
    let r = Client::new(&t.control).call(&cmd::Remove {
        device: DeviceRef::named(t.device()),
        force: args.force,
    })?;
    Ok(match r.kept {
        Some(hint) => format!(
            "removed device {}, cut off its frontend; its state is kept, left over: `{hint}` serves it again, `vzram forget {}` deletes it\n",
            r.device, r.device
        ),
        None => format!("removed device {} and its state\n", r.device),
    })
}

pub fn reset(args: &DestroyArgs) -> Result<String, ClientError> {
    let t = &args.target;
    let reply = Client::new(&t.control).call(&cmd::Reset {
        device: DeviceRef::named(t.device()),
        force: args.force,
    })?;
    Ok(format!(
        "reset device {}: {} pages dropped\n",
        reply.device, reply.pages_dropped
    ))
}

/// `vzram reload`: what the reload applied on stdout, what it left (needs
/// a restart, a device still connected) on stderr.
pub fn reload(args: &crate::cli::ReloadArgs) -> Result<String, ClientError> {
    let r = Client::new(&args.control).call(&cmd::Reload {})?;
    for w in &r.not_applied {
        eprintln!("warning: {w}");
    }
    let mut out = format!(
        "reloaded {}: {} change{}\n",
        r.config.display(),
        r.changes.len(),
        if r.changes.len() == 1 { "" } else { "s" }
    );
    let limit = |b: u64| if b == 0 { "none".into() } else { human(b) };
    for c in &r.changes {
        let line = match c {
            ReloadChange::Added { device, recovered } => format!(
                "added {device} ({})",
                if *recovered {
                    "its left-over state recovered"
                } else {
                    "empty"
                }
            ),
            ReloadChange::Removed { device } => {
                format!("removed {device} (its state kept, left over)")
            }
            ReloadChange::DeviceLimit { device, mem_limit } => {
                format!("device {device} memory limit: {}", limit(*mem_limit))
            }
            ReloadChange::HostLimit { host_mem_limit } => {
                format!("host memory limit: {}", limit(*host_mem_limit))
            }
            ReloadChange::HostStaging { host_staging: 0 } => {
                "host staging: off (no device stages)".to_string()
            }
            ReloadChange::HostStaging { host_staging } => {
                format!("host staging: {}", human(*host_staging))
            }
        };
        out.push_str(&format!("  {line}\n"));
    }
    Ok(out)
}

pub fn reset_max(args: &CompactArgs) -> Result<String, ClientError> {
    let req = cmd::ResetMax {
        device: args.target.device().map(DeviceRef::named),
    };
    Client::new(&args.control).call(&req)?;
    Ok("mem_used_max reset\n".to_string())
}

pub fn compact(args: &CompactArgs) -> Result<String, ClientError> {
    let req = cmd::Compact {
        device: args.target.device().map(DeviceRef::named),
    };
    let reply = Client::new(&args.control).call(&req)?;
    let pages = reply.pages_compacted;
    Ok(format!(
        "compacted: {pages} pages ({}) given back\n",
        human(pages * 4096)
    ))
}

pub fn mark_idle(args: &DeviceArgs) -> Result<String, ClientError> {
    let req = cmd::MarkIdle {
        device: DeviceRef::named(args.device()),
    };
    let reply = Client::new(&args.control).call(&req)?;
    Ok(format!(
        "device {}: {} pages marked idle; {} pages idle in all (marked before and not used since included: what writeback --idle takes)\n",
        reply.device,
        reply.pages_marked,
        reply.pages_idle
    ))
}

pub fn recompress(args: &RecompressArgs) -> Result<String, ClientError> {
    let req = cmd::Recompress {
        device: DeviceRef::named(args.target.device()),
        idle: args.idle,
        huge: args.huge,
        algo: args.algo,
    };
    let r = Client::new(&args.target.control).call(&req)?;
    Ok(format!(
        "device {}: recompressed {} of {} pages tried with {}, {} smaller; {} of memory given back\n",
        args.target.device(),
        r.pages_recompressed,
        r.pages_tried,
        r.algo,
        human(r.saved_bytes),
        human(r.freed_bytes),
    ))
}

pub fn writeback(args: &WritebackArgs) -> Result<String, ClientError> {
    let req = cmd::Writeback {
        device: DeviceRef::named(args.target.device()),
        idle: args.idle,
        cold: args.cold,
        huge: args.huge,
        incompressible: args.incompressible,
        max_pages: args.max_pages,
    };
    let r = Client::new(&args.target.control).call(&req)?;
    let pages = r.pages_written;
    Ok(format!(
        "device {}: wrote {pages} pages ({}) to the backing file; {} of memory given back\n",
        args.target.device(),
        human(pages * 4096),
        human(r.freed_bytes),
    ))
}

pub fn migrate(args: &MigrateArgs) -> Result<String, ClientError> {
    let Some(to) = &args.to else {
        let device = DeviceRef::named(args.target.device());
        let client = Client::new(&args.target.control);
        let (r, what) = if args.cancel {
            (client.call(&cmd::CancelMigration { device })?, "cancel")
        } else {
            (client.call(&cmd::CommitMigration { device })?, "commit")
        };
        return Ok(format!(
            "device {}: {what} asked; migration {}\n",
            r.device,
            r.state.name()
        ));
    };
    let req = cmd::Migrate {
        device: DeviceRef::named(args.target.device()),
        to: to.clone(),
        keep: args.keep,
    };
    let r = Client::new(&args.target.control).call(&req)?;
    Ok(format!(
        "device {}: migrated to {}: {} pages, {} in {} passes, {:.1} s ({:.1} MiB/s); last delta {} pages in {:.1} ms; {}\n",
        args.target.device(),
        to,
        r.pages,
        human(r.bytes),
        r.passes,
        r.seconds,
        r.rate_mib_s,
        r.final_records,
        r.final_ms,
        if args.keep { "pages kept here" } else { "pages dropped here" },
    ))
}

#[cfg(test)]
mod tests {
    use super::matches_pattern;

    #[test]
    fn star_patterns() {
        for (p, t, want) in [
            ("/tmp/qtest-*", "/tmp/qtest-1-sock.ab", true),
            ("/tmp/qtest-*", "/tmp/other", false),
            ("*", "", true),
            ("/a/*/x.sock", "/a/b/c/x.sock", true),
            ("/a/*/x.sock", "/a/x.sock", false),
            ("exact", "exact", true),
            ("exact", "exactly", false),
            ("*ab*ab", "xabab", true),
            ("*ab*ab", "xab", false),
        ] {
            assert_eq!(matches_pattern(p, t), want, "{p} ~ {t}");
        }
    }
}
