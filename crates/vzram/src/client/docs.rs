//! What a package installs beside the binary, made from the command line's
//! own definitions so it never drifts from `--help`: the manual pages
//! (`clap_mangen` for the options, with SYNOPSIS, FILES, ENVIRONMENT, EXIT
//! STATUS, EXAMPLES and SEE ALSO of our own; vzram.toml(5) from
//! [`options`]) and shell completions (`complete`).

use std::path::Path;

use clap_mangen::roff::{bold, italic, roman, Inline, Roff};

use super::manual::{self, Page};
use super::options;

const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Help texts are written for `--help`, where `` `x` `` reads as code; a
/// page shows the text without the backticks.
fn plain(s: &str) -> String {
    s.replace('`', "")
}

/// The command with every text made [`plain`], recursively.
fn plain_command(mut cmd: clap::Command) -> clap::Command {
    if let Some(a) = cmd.get_about().map(|s| plain(&s.to_string())) {
        cmd = cmd.about(a);
    }
    if let Some(a) = cmd.get_long_about().map(|s| plain(&s.to_string())) {
        cmd = cmd.long_about(a);
    }
    let ids: Vec<clap::Id> = cmd.get_arguments().map(|a| a.get_id().clone()).collect();
    for id in ids {
        cmd = cmd.mut_arg(id, |mut a| {
            if let Some(h) = a.get_help().map(|s| plain(&s.to_string())) {
                a = a.help(h);
            }
            if let Some(h) = a.get_long_help().map(|s| plain(&s.to_string())) {
                a = a.long_help(h);
            }
            // The values' own help (a value enum's doc comments); the page
            // is never parsed with, so any parser listing them will do.
            let values: Vec<clap::builder::PossibleValue> = a
                .get_possible_values()
                .into_iter()
                .map(|v| match v.get_help().map(|h| plain(&h.to_string())) {
                    Some(h) => v.help(h),
                    None => v,
                })
                .collect();
            if !values.is_empty() {
                a = a.value_parser(clap::builder::PossibleValuesParser::new(values));
            }
            a
        });
    }
    let subs: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .collect();
    for s in subs {
        cmd = cmd.mut_subcommand(s, plain_command);
    }
    cmd
}

/// `[--socket PATH]`: an option as SYNOPSIS shows it, with its value.
fn synopsis_arg(a: &clap::Arg, line: &mut Vec<Inline>, required: bool) {
    let value = a.get_value_names().map(|v| {
        v.iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    });
    let optional_value = a.get_num_args().is_some_and(|n| n.min_values() == 0);
    if !required {
        line.push(roman("["));
    }
    if let Some(long) = a.get_long() {
        line.push(bold(format!("--{long}")));
        if let Some(v) = value.filter(|_| a.get_action().takes_values()) {
            line.push(roman(match (optional_value, a.is_require_equals_set()) {
                (true, true) => "[=",
                (true, false) => " [",
                (false, _) => " ",
            }));
            line.push(italic(v));
            if optional_value {
                line.push(roman("]"));
            }
        }
    } else {
        line.push(italic(value.unwrap_or_else(|| a.get_id().to_string())));
    }
    if !required {
        line.push(roman("]"));
    }
    line.push(roman(" "));
}

/// SYNOPSIS: the command with every option and its value, and the other
/// forms a page names (`vzram --socket-path PATH --size SIZE`).
fn synopsis(roff: &mut Roff, cmd: &clap::Command, page: &Page) {
    roff.control("SH", ["SYNOPSIS"]);
    let name = cmd
        .get_display_name()
        .unwrap_or(cmd.get_name())
        .replace('-', " ");
    let mut line = vec![bold(name), roman(" ")];
    let grouped: Vec<Vec<&clap::Arg>> = cmd
        .get_groups()
        .filter(|g| g.is_required_set())
        .map(|g| {
            g.get_args()
                .filter_map(|id| cmd.get_arguments().find(|a| a.get_id() == id))
                .collect()
        })
        .collect();
    let in_group = |a: &clap::Arg| grouped.iter().flatten().any(|g| g.get_id() == a.get_id());
    for members in &grouped {
        for (i, a) in members.iter().enumerate() {
            if i > 0 {
                line.push(roman("| "));
            }
            synopsis_arg(a, &mut line, true);
        }
    }
    let mut args: Vec<&clap::Arg> = cmd.get_arguments().collect();
    args.sort_by_key(|a| a.get_display_order());
    for a in args {
        if a.is_hide_set() || in_group(a) || ["help", "version"].contains(&a.get_id().as_str()) {
            continue;
        }
        synopsis_arg(a, &mut line, a.is_required_set());
    }
    if cmd.has_subcommands() {
        line.push(italic("COMMAND"));
        line.push(roman(" ..."));
    }
    roff.text(line);
    for form in page.other_forms {
        roff.control("br", []);
        roff.text([roman(*form)]);
    }
}

fn section(roff: &mut Roff, title: &str, items: &[(&str, &str)]) {
    if items.is_empty() {
        return;
    }
    roff.control("SH", [title]);
    for (term, text) in items {
        roff.control("TP", []);
        roff.text([bold(*term)]);
        roff.text([roman(*text)]);
    }
}

/// EXAMPLES: each a sentence, then its commands as they are typed
/// (tests/examples.rs runs them).
fn examples(roff: &mut Roff, page: &Page) {
    if page.examples.is_empty() {
        return;
    }
    roff.control("SH", ["EXAMPLES"]);
    for (what, lines) in page.examples {
        roff.control("PP", []);
        roff.text([roman(*what)]);
        roff.control("PP", []);
        roff.control("RS", ["4"]);
        roff.control("nf", []);
        for l in lines.lines() {
            roff.text([roman(l)]);
        }
        roff.control("fi", []);
        roff.control("RE", []);
    }
}

/// The page of `cmd` (its display name: `vzram-serve`).
fn render(cmd: clap::Command) -> std::io::Result<Vec<u8>> {
    let name = cmd.get_display_name().unwrap_or(cmd.get_name()).to_string();
    let page = manual::page(&name);
    let man = clap_mangen::Man::new(cmd.clone())
        .source(format!("vzram {VERSION}"))
        .manual("vzram manual");
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    let mut roff = Roff::default();
    synopsis(&mut roff, &cmd, &page);
    out.extend(roff.to_roff().into_bytes());
    man.render_description_section(&mut out)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut out)?;
    }
    if cmd.get_subcommands().any(|s| !s.is_hide_set()) {
        man.render_subcommands_section(&mut out)?;
    }
    let mut roff = Roff::default();
    section(&mut roff, "FILES", page.files);
    section(&mut roff, "ENVIRONMENT", page.environment);
    section(&mut roff, "EXIT STATUS", manual::EXIT_STATUS);
    examples(&mut roff, &page);
    roff.control("SH", ["SEE ALSO"]);
    roff.text([roman(page.see_also)]);
    out.extend(roff.to_roff().into_bytes());
    Ok(breakable(&String::from_utf8_lossy(&out)).into_bytes())
}

/// A long word (a `--device` spec) may break after its commas: `\:` is
/// roff's zero-width break point. Without it man cannot fill the line and
/// warns ("cannot adjust line").
fn breakable(page: &str) -> String {
    let mut out = String::with_capacity(page.len());
    // Examples (`.nf` ... `.fi`) are not filled: left as typed.
    let mut nofill = false;
    for line in page.lines() {
        if line.starts_with(".nf") || line.starts_with(".fi") {
            nofill = line.starts_with(".nf");
        }
        if line.starts_with('.') || nofill {
            out += line;
            // Ragged right: a spec broken after a comma leaves a line too
            // short to justify, and man would warn about each.
            if line.starts_with(".TH ") {
                out += "\n.na";
            }
        } else {
            let words: Vec<String> = line
                .split(' ')
                .map(|w| {
                    if w.chars().count() > 40 {
                        w.replace(',', ",\\:")
                    } else {
                        w.to_string()
                    }
                })
                .collect();
            out += &words.join(" ");
        }
        out.push('\n');
    }
    out
}

/// vzram.toml(5): every key of the file, from [`options::options`].
fn config_page() -> Vec<u8> {
    let page = manual::page("vzram.toml");
    let mut roff = Roff::default();
    roff.control(
        "TH",
        [
            "vzram.toml",
            "5",
            "",
            &format!("vzram {VERSION}"),
            "vzram manual",
        ],
    );
    roff.control("SH", ["NAME"]);
    roff.text([roman("vzram.toml - configuration file of vzram serve")]);
    roff.control("SH", ["SYNOPSIS"]);
    roff.text([bold("vzram serve --config"), roman(" "), italic("FILE")]);
    roff.control("SH", ["DESCRIPTION"]);
    for p in manual::CONFIG_DESCRIPTION {
        roff.control("PP", []);
        roff.text([roman(*p)]);
    }
    let opts = options::options();
    roff.control("SH", ["GLOBAL KEYS"]);
    for o in opts
        .iter()
        .filter(|o| o.file_key.is_some() && o.device_key.is_none())
    {
        let key = o.file_key.as_deref().unwrap_or_default();
        if key == "[[device]]" {
            continue;
        }
        roff.control("TP", []);
        roff.text([bold(key), roman(format!(" (--{})", key.replace('_', "-")))]);
        roff.text([roman(plain(&o.help))]);
    }
    roff.control("SH", ["DEVICE KEYS"]);
    roff.text([roman(
        "Each [[device]] table is one device. The same keys, with - for _, make a --device spec \
         (socket=PATH,size=SIZE,...) and a vzram add spec.",
    )]);
    for o in opts.iter().filter(|o| o.device_key.is_some()) {
        let key = o.device_key.as_deref().unwrap_or_default();
        roff.control("TP", []);
        let flag = if o.flag.is_empty() {
            String::new()
        } else {
            format!(" ({})", o.flag.split(' ').next().unwrap_or_default())
        };
        roff.text([bold(key), roman(flag)]);
        roff.text([roman(plain(&o.help))]);
    }
    examples(&mut roff, &page);
    section(&mut roff, "FILES", page.files);
    roff.control("SH", ["SEE ALSO"]);
    roff.text([roman(page.see_also)]);
    roff.render().into_bytes()
}

/// Every visible command, depth first: `vzram`, `vzram-serve`, ...
fn commands(cmd: &clap::Command, out: &mut Vec<clap::Command>) {
    for s in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        commands(s, out);
    }
    out.push(cmd.clone());
}

/// `vzram.1` as roff; with `dir`, every page (`vzram.1`, `vzram-serve.1`,
/// ..., `vzram.toml.5`) written there (a directory named `man1` gets the
/// section-5 page in `man5` beside it) and a line naming them returned.
pub fn man(dir: Option<&Path>) -> std::io::Result<String> {
    let mut cmd = plain_command(options::command());
    cmd.build();
    let Some(dir) = dir else {
        return Ok(String::from_utf8_lossy(&render(cmd)?).into_owned());
    };
    let mut all = Vec::new();
    commands(&cmd, &mut all);
    for c in all {
        let name = c.get_display_name().unwrap_or(c.get_name()).to_string();
        std::fs::write(dir.join(format!("{name}.1")), render(c)?)?;
    }
    // A package's man1 directory: the section-5 page goes to man5 beside it.
    let dir5 = match (dir.file_name(), dir.parent()) {
        (Some(n), Some(parent)) if n == "man1" => parent.join("man5"),
        _ => dir.to_path_buf(),
    };
    std::fs::create_dir_all(&dir5)?;
    std::fs::write(dir5.join("vzram.toml.5"), config_page())?;
    Ok(format!("manual pages written to {}\n", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_manual_names_the_commands_and_hides_the_packagers_ones() {
        let page = man(None).unwrap();
        assert!(page.contains(".TH vzram 1"), "{page}");
        assert!(page.contains("vzram\\-serve(1)"), "{page}");
        assert!(!page.contains("completions"), "{page}");
    }

    #[test]
    fn every_page_has_its_sections_values_in_synopsis_and_no_backticks() {
        let dir = std::env::temp_dir().join(format!("vzram-man-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        man(Some(&dir)).unwrap();
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        let serve = read("vzram-serve.1");
        for s in [
            "SYNOPSIS",
            "FILES",
            "ENVIRONMENT",
            "EXIT STATUS",
            "EXAMPLES",
            "SEE ALSO",
        ] {
            assert!(
                serve.contains(&format!(".SH \"{s}\"")) || serve.contains(&format!(".SH {s}")),
                "{s}"
            );
            assert!(read("vzram.1").contains(s), "vzram.1: {s}");
        }
        assert!(
            serve.contains("\\fB\\-\\-socket\\fR \\fIPATH\\fR"),
            "{serve}"
        );
        assert!(serve.contains(&format!("\"vzram {VERSION}\"")), "{serve}");
        let toml = read("vzram.toml.5");
        for k in [
            "host_mem_limit",
            "mem_limit",
            "recover",
            "poll_us",
            "backing_file",
        ] {
            assert!(toml.contains(k), "{k}");
        }
        for f in std::fs::read_dir(&dir).unwrap() {
            let text = std::fs::read_to_string(f.unwrap().path()).unwrap();
            assert!(!text.contains('`'), "{text}");
        }
        // A package's man1 directory: vzram.toml.5 goes to man5 beside it.
        let man1 = dir.join("man1");
        std::fs::create_dir_all(&man1).unwrap();
        man(Some(&man1)).unwrap();
        assert!(man1.join("vzram-serve.1").is_file());
        assert!(!man1.join("vzram.toml.5").exists());
        assert!(dir.join("man5/vzram.toml.5").is_file());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
