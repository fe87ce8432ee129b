//! Shell completions: clap_complete's scripts from the command line's own
//! definitions, with the values a flag takes (codecs, sizes, durations,
//! modes), and in bash and fish the running daemon's device names
//! (`vzram stat --names`) where a command takes a device.

use clap::builder::PossibleValue;

use super::options;

const CODECS: &[(&str, &str)] = &[
    ("lz4", "fast, the default"),
    ("zstd", "smaller pages, zstd level 3"),
    ("zstd:1", "zstd, fastest level"),
    ("zstd:3", "zstd level 3"),
    ("zstd:9", "zstd level 9"),
    ("zstd:19", "zstd level 19, slowest"),
];
const SIZES: &[&str] = &["512M", "1G", "2G", "4G", "8G", "16G", "64G", "1T"];
const DURATIONS: &[&str] = &["90s", "10m", "1h", "1h30m"];
const MODES: &[&str] = &["0600", "0660"];
const SECCOMP: &[&str] = &["on", "off", "log"];

/// The values each argument (by id) is offered.
fn values(id: &str) -> Option<Vec<PossibleValue>> {
    let plain = |v: &'static [&'static str]| v.iter().map(|s| PossibleValue::new(*s)).collect();
    Some(match id {
        "algo" | "recompress_algo" => CODECS
            .iter()
            .map(|(n, h)| PossibleValue::new(*n).help(*h))
            .collect(),
        "size" | "mem_limit" | "host_mem_limit" | "host_staging" => plain(SIZES),
        "idle_after" | "incoming_timeout" => plain(DURATIONS),
        "socket_mode" | "control_mode" | "incoming_mode" => plain(MODES),
        "seccomp" => plain(SECCOMP),
        _ => return None,
    })
}

/// The command with [`values`] as each argument's possible values (only
/// for completion: the real parsers take any size, level or duration).
fn with_values(mut cmd: clap::Command) -> clap::Command {
    let ids: Vec<String> = cmd
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect();
    for id in ids {
        if let Some(v) = values(&id) {
            cmd = cmd.mut_arg(id, |a| {
                a.value_parser(clap::builder::PossibleValuesParser::new(v))
            });
        }
    }
    let subs: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .collect();
    for s in subs {
        cmd = cmd.mut_subcommand(s, with_values);
    }
    cmd
}

/// Commands whose NAME (or `--device NAME`) is a device of the daemon.
const DEVICE_COMMANDS: &str =
    "stat set-limit compact remove forget reset reset-max mark-idle recompress writeback migrate";

/// Bash: clap's function, behind one that offers the daemon's device names
/// for a command's first word and after `--device` (not `add --device`,
/// which takes a spec). `--control` given on the line is asked.
const BASH_DEVICES: &str = r#"
_vzram_devices() {
    local i ctl=()
    for ((i = 1; i < ${#COMP_WORDS[@]} - 1; i++)); do
        [[ ${COMP_WORDS[i]} == --control ]] && ctl=(--control "${COMP_WORDS[i + 1]}")
    done
    vzram stat "${ctl[@]}" --names 2>/dev/null
}

_vzram_with_devices() {
    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD - 1]}" cmd="${COMP_WORDS[1]}"
    case " @COMMANDS@ " in
    *" $cmd "*)
        if [[ $prev == --device || ($COMP_CWORD -eq 2 && $cur != -*) ]]; then
            COMPREPLY=($(compgen -W "$(_vzram_devices)" -- "$cur"))
            return 0
        fi
        ;;
    esac
    _vzram "$@"
}
"#;

/// The completion script for `shell`.
pub fn completions(shell: clap_complete::Shell) -> String {
    let mut cmd = with_values(options::command());
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd, "vzram", &mut out);
    let script = String::from_utf8_lossy(&out).into_owned();
    match shell {
        clap_complete::Shell::Bash => {
            let wrapper = BASH_DEVICES.replace("@COMMANDS@", DEVICE_COMMANDS);
            // Register the wrapper instead of clap's function.
            let script = script.replace("complete -F _vzram ", "complete -F _vzram_with_devices ");
            match script.find("\nif [[ \"${BASH_VERSINFO") {
                Some(i) => format!("{}{wrapper}{}", &script[..i], &script[i..]),
                None => script + &wrapper,
            }
        }
        clap_complete::Shell::Fish => {
            let mut s = script;
            for c in DEVICE_COMMANDS.split(' ') {
                s += &format!(
                    "complete -c vzram -n \"__fish_seen_subcommand_from {c}\" -f -a \"(vzram stat --names 2>/dev/null)\"\n"
                );
            }
            s
        }
        clap_complete::Shell::Zsh => zsh_devices(&script),
        _ => script,
    }
}

/// zsh: a device's NAME (the positional, or `--device NAME`) is completed
/// from `vzram stat --names` instead of as a file.
fn zsh_devices(script: &str) -> String {
    let mut out = String::new();
    for l in script.lines() {
        let device_flag = l.contains("--device=[") && l.contains(":NAME:_default'");
        let positional = l.starts_with("':name -- ") || l.starts_with("'::name -- ");
        if l.starts_with("if [ \"$funcstack[1]\" = \"_vzram\" ]") {
            out += ZSH_DEVICES;
        }
        if device_flag || positional {
            out += &l.replace(":_default'", ":_vzram_devices'");
        } else {
            out += l;
        }
        out.push('\n');
    }
    out
}

const ZSH_DEVICES: &str = r#"(( $+functions[_vzram_devices] )) ||
_vzram_devices() {
    local -a names
    names=(${(f)"$(vzram stat --names 2>/dev/null)"})
    compadd -a names
}

"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shell_completes_serve_and_offers_codecs() {
        for shell in [
            clap_complete::Shell::Bash,
            clap_complete::Shell::Zsh,
            clap_complete::Shell::Fish,
        ] {
            let script = completions(shell);
            assert!(script.contains("serve"), "{shell}: {script}");
            assert!(script.contains("mem-limit"), "{shell}: {script}");
            assert!(
                script.replace('\\', "").contains("zstd:3"),
                "{shell}: {script}"
            );
            assert!(script.contains("512M"), "{shell}: {script}");
        }
        let zsh = completions(clap_complete::Shell::Zsh);
        assert!(zsh.contains("_vzram_devices() {"), "{zsh}");
        assert!(
            zsh.contains("(the same as NAME)]:NAME:_vzram_devices'"),
            "{zsh}"
        );
        assert!(
            zsh.contains("'::name -- Only this device (name or index):_vzram_devices'"),
            "{zsh}"
        );
        let bash = completions(clap_complete::Shell::Bash);
        assert!(bash.contains("stat \"${ctl[@]}\" --names"), "{bash}");
        assert!(bash.contains("complete -F _vzram_with_devices"), "{bash}");
        assert!(!bash.contains("complete -F _vzram -o"), "{bash}");
    }
}
