//! Every option of `vzram serve` once, read from the command line's own
//! definitions: the flag, its key in the configuration file and in a
//! `--device` spec, and its help text. docs/configuration.md and
//! vzram.toml(5) are both rendered from this list, so neither drifts from
//! `--help` (tests/docs.rs compares the file with what this renders).

use clap::{Arg, ArgAction, Args, CommandFactory};

use crate::cli::Cli;
use crate::config::DeviceDraft;

/// One option of `vzram serve`, or a device key that has no flag.
pub struct Opt {
    /// `--socket PATH` (empty for a key without a flag).
    pub flag: String,
    /// Other spellings of the flag: `--socket-path`.
    pub aliases: Vec<String>,
    /// The key at the top of the configuration file.
    pub file_key: Option<String>,
    /// The key in a `[[device]]` table (and, with `-`, in a `--device` spec).
    pub device_key: Option<String>,
    /// The help text, with its default and possible values.
    pub help: String,
}

/// Device keys without a flag of their own (`#[arg(skip)]` in
/// [`DeviceDraft`]), with what they do. `state_dir`, `fresh` and `adopt`
/// are also flags of the whole daemon, described there.
const DEVICE_ONLY: &[(&str, &str)] = &[(
    "recover",
    "Serve the pages a state left on disk under this device's name holds: `vzram add` refuses \
     such a state without `recover=true` (or `fresh=true`), and a configured device with \
     `recover=false` refuses to start on one.",
)];

/// Flags of the daemon that are also keys of a `[[device]]` table.
const ALSO_DEVICE_KEYS: &[&str] = &["state_dir", "fresh", "adopt"];

fn value(a: &Arg) -> String {
    let names: Vec<String> = match a.get_value_names() {
        Some(v) => v.iter().map(|n| n.to_string()).collect(),
        None if a.get_action().takes_values() => vec![a.get_id().as_str().to_uppercase()],
        None => Vec::new(),
    };
    let v = names.join(" ");
    if v.is_empty() {
        return v;
    }
    let optional = a.get_num_args().is_some_and(|n| n.min_values() == 0);
    if optional {
        format!(" [{v}]")
    } else {
        format!(" {v}")
    }
}

/// An argument's help, with its default and possible values where clap
/// keeps them apart from the text.
fn help(a: &Arg) -> String {
    let mut h = a
        .get_long_help()
        .or(a.get_help())
        .map(|s| s.to_string())
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    if !h.ends_with('.') && !h.ends_with(']') {
        h.push('.');
    }
    let possible: Vec<String> = a
        .get_possible_values()
        .iter()
        .filter(|p| !p.is_hide_set())
        .map(|p| p.get_name().to_string())
        .collect();
    if !possible.is_empty() && matches!(a.get_action(), ArgAction::Set) {
        h += &format!(" One of: {}.", possible.join(", "));
    }
    if let [d] = a.get_default_values() {
        if !h.contains("[default:") {
            h += &format!(" [default: {}]", d.to_string_lossy());
        }
    }
    h
}

/// Value names the derive leaves as the field's name (`<MEM_LIMIT>`): in
/// the pages, completions and docs the kind of value is shown instead.
const VALUE_NAMES: &[(&str, &str)] = &[
    ("mem_limit", "SIZE"),
    ("host_mem_limit", "SIZE"),
    ("host_staging", "SIZE"),
    ("queues", "N"),
    ("socket_mode", "MODE"),
    ("control_mode", "MODE"),
    ("incoming_mode", "MODE"),
    ("log_level", "LEVEL"),
    ("log_format", "FORMAT"),
];

/// The command line as the pages, completions and docs show it: no `help`
/// subcommand (`--help` stays), value names that say what they take.
pub fn command() -> clap::Command {
    let mut cmd = Cli::command().disable_help_subcommand(true);
    for sub in ["serve", "recompress"] {
        cmd = cmd.mut_subcommand(sub, |mut s| {
            for (id, name) in VALUE_NAMES {
                if s.get_arguments().any(|a| a.get_id() == *id) {
                    s = s.mut_arg(*id, |a| a.value_name(*name));
                }
            }
            s
        });
    }
    cmd
}

/// Every option of `vzram serve` in `--help`'s order, then the device keys
/// that have no flag.
pub fn options() -> Vec<Opt> {
    let cmd = command();
    let serve = cmd.find_subcommand("serve").expect("serve");
    let drafts = DeviceDraft::augment_args(clap::Command::new("x"));
    let device_ids: Vec<&str> = drafts
        .get_arguments()
        .map(|a| a.get_id().as_str())
        .collect();
    let file_keys = crate::config::file_keys();
    let mut out = Vec::new();
    // `mut_arg` moves an argument to the end; --help's order is the display order.
    let mut args: Vec<&Arg> = serve.get_arguments().collect();
    args.sort_by_key(|a| a.get_display_order());
    for a in args {
        let id = a.get_id().as_str();
        let Some(long) = a.get_long() else { continue };
        if a.is_hide_set() || id == "help" || id == "version" {
            continue;
        }
        let (file_key, device_key) = if device_ids.contains(&id) {
            (None, Some(id.to_string()))
        } else if id == "devices" {
            (Some("[[device]]".to_string()), None)
        } else {
            let file = file_keys.iter().find(|k| *k == id).cloned();
            let dev = ALSO_DEVICE_KEYS.contains(&id).then(|| id.to_string());
            (file, dev)
        };
        out.push(Opt {
            flag: format!("--{long}{}", value(a)),
            aliases: a
                .get_all_aliases()
                .unwrap_or_default()
                .into_iter()
                .map(|s| format!("--{s}"))
                .collect(),
            file_key,
            device_key,
            help: help(a),
        });
    }
    for (key, text) in DEVICE_ONLY {
        out.push(Opt {
            flag: String::new(),
            aliases: Vec::new(),
            file_key: None,
            device_key: Some(key.to_string()),
            help: text.to_string(),
        });
    }
    out
}

/// Where an option is set, as a Markdown line: the flag, its aliases, the
/// file's key, the device key.
fn places(o: &Opt) -> String {
    let mut p = Vec::new();
    if !o.flag.is_empty() {
        p.push(format!("`{}`", o.flag));
    }
    for a in &o.aliases {
        p.push(format!("`{a}`"));
    }
    if let Some(k) = &o.file_key {
        p.push(match k.as_str() {
            "[[device]]" => "`[[device]]` tables in the file".to_string(),
            _ => format!("`{k}` in the file"),
        });
    }
    if let Some(k) = &o.device_key {
        let spec = k.replace('_', "-");
        let val =
            if o.flag.contains("[BOOL]") || ["fresh", "adopt", "recover"].contains(&k.as_str()) {
                "=true".to_string()
            } else {
                "=".to_string()
            };
        p.push(format!(
            "`{k}` in `[[device]]`, `{spec}{val}` in `--device`/`vzram add`"
        ));
    }
    p.join(" · ")
}

/// Breaks `text` into lines of at most `width` characters (a word longer
/// than that gets a line of its own), each after `indent`.
pub fn wrap(text: &str, width: usize, indent: &str) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for w in text.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + w.chars().count() > width {
            out += &format!("{indent}{line}\n");
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(w);
    }
    if !line.is_empty() {
        out += &format!("{indent}{line}\n");
    }
    out
}

/// The options as a Markdown list: what docs/configuration.md holds
/// between its `options` markers.
pub fn markdown() -> String {
    let mut out = String::new();
    for o in options() {
        out += &wrap(&format!("- {}:", places(&o)), 100, "");
        // Continuation lines of a list item are indented.
        let body = wrap(&o.help.replace('*', "\\*"), 98, "  ");
        out += &body;
    }
    // The first line of each item starts with "- ", the rest with "  ":
    // a continuation of the first line needs the indent too.
    out.lines()
        .map(|l| {
            if l.starts_with("- ") || l.starts_with("  ") {
                l.to_string()
            } else {
                format!("  {l}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key the file and a device spec take is documented, and each
    /// once: the parsers' own lists against [`options`].
    #[test]
    fn every_key_is_documented_once() {
        let opts = options();
        for k in crate::config::file_keys() {
            let k = if k == "device" {
                "[[device]]".into()
            } else {
                k
            };
            let n = opts
                .iter()
                .filter(|o| o.file_key.as_deref() == Some(&k))
                .count();
            assert_eq!(n, 1, "file key {k}");
        }
        let e = crate::config::parse_device_spec("no_such_key=1")
            .err()
            .unwrap()
            .to_string();
        let list = e.split("expected one of").nth(1).unwrap();
        let keys: Vec<String> = list
            .split(',')
            .map(|k| k.trim().trim_matches('`').replace('-', "_"))
            .collect();
        assert!(keys.len() > 10, "{e}");
        for k in keys {
            let n = opts
                .iter()
                .filter(|o| o.device_key.as_deref() == Some(&k))
                .count();
            // Aliases (`path`, `ro`, `num_queues`, ...) are not keys of their own.
            let alias = ["path", "ro", "num_queues", "read_only", "comp_algorithm"];
            assert!(n == 1 || alias.contains(&k.as_str()), "device key {k}: {n}");
        }
    }

    #[test]
    fn lines_stay_short() {
        for l in markdown().lines() {
            assert!(l.chars().count() <= 200, "{l}");
        }
    }
}
