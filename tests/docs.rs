//! The documentation against the binary: docs/configuration.md's option
//! list is what `vzram man --options` renders from the command line's own
//! definitions, and names the flags `vzram serve --help` offers, both ways;
//! README keeps its two set-up commands; no line of the docs is overlong;
//! the manual pages render with `man`.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use vzram_tests::*;

const BEGIN: &str = "<!-- BEGIN options";
const END: &str = "<!-- END options -->";

fn flags(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2 && !w.ends_with('-'))
        .map(str::to_string)
        .collect()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The generated part of docs/configuration.md, between its markers.
fn option_list(doc: &str) -> (usize, usize) {
    let b = doc
        .find(BEGIN)
        .expect("docs/configuration.md: the BEGIN options marker");
    let start = b + doc[b..].find('\n').unwrap() + 1;
    let end = doc
        .find(END)
        .expect("docs/configuration.md: the END options marker");
    (start, end)
}

#[test]
fn the_option_list_is_what_the_binary_renders() {
    let out = Vzram::new(&["man", "--options"]).output();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fresh = String::from_utf8(out.stdout).unwrap();
    let doc = read("docs/configuration.md");
    let (start, end) = option_list(&doc);
    if doc[start..end] != fresh {
        if std::env::var_os("VZRAM_BLESS").is_some() {
            let new = format!("{}{fresh}{}", &doc[..start], &doc[end..]);
            std::fs::write(root().join("docs/configuration.md"), new).unwrap();
            return;
        }
        panic!(
            "docs/configuration.md's option list differs from `vzram man --options`; \
             the fresh list (or run with VZRAM_BLESS=1 to write it):\n{fresh}"
        );
    }
}

#[test]
fn the_option_list_and_serve_help_name_the_same_flags() {
    let doc = read("docs/configuration.md");
    let (start, end) = option_list(&doc);
    // The first line of each item names the flags; the text may mention any.
    let heads: String = doc[start..end]
        .split("\n- ")
        .map(|item| item.split(":\n").next().unwrap_or_default().to_string() + "\n")
        .collect();
    let mut documented = flags(&heads);
    documented.retain(|f| f != "--device" || heads.contains("`--device SPEC`"));
    let out = Vzram::new(&["serve", "--help"]).output();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    // Only the flags' own lines: their texts mention other programs'.
    let offered: BTreeSet<String> = flags(
        &help
            .lines()
            .filter(|l| l.trim_start().starts_with('-'))
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .into_iter()
    .filter(|f| f != "--help" && f != "--version")
    .collect();
    let missing: Vec<_> = offered.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "not in docs/configuration.md's option list: {missing:?}"
    );
    // Aliases (`--read-only`, `--socket-path`) are named in their flag's text.
    let named = flags(&help);
    let stale: Vec<_> = documented.difference(&named).collect();
    assert!(
        stale.is_empty(),
        "in docs/configuration.md, not in --help: {stale:?}"
    );
}

/// README opens with the two set-up commands (the demo, the tests), and
/// the test command is the one .ci/run runs.
#[test]
fn the_readme_starts_with_the_demo_and_the_test_command() {
    let readme = read("README.md");
    let block = readme
        .split("```sh setup\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("README: a ```sh setup block");
    let cmds: Vec<&str> = block
        .lines()
        .map(|l| l.split(" #").next().unwrap_or_default().trim())
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(cmds.len(), 2, "README's set-up block: {cmds:?}");
    let demo = root().join(cmds[0]);
    assert!(demo.is_file(), "the demo {} is missing", demo.display());
    let out = Command::new("bash").arg("-n").arg(&demo).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(&demo).arg("--help").output().unwrap();
    assert!(out.status.success(), "{} --help", demo.display());
    assert!(cmds[1].starts_with("cargo test"), "{cmds:?}");
    assert!(
        read(".ci/run").contains(&format!("\n{}\n", cmds[1])),
        ".ci/run runs {}",
        cmds[1]
    );
    // The set-up block is the first thing after the title and the intro.
    let first_block = readme.find("```").unwrap();
    assert_eq!(readme[first_block..].find("```sh setup"), Some(0));
}

fn markdown_files() -> Vec<std::path::PathBuf> {
    let mut files = vec![root().join("README.md")];
    for e in std::fs::read_dir(root().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    files
}

#[test]
fn no_line_of_the_docs_is_overlong_and_every_link_resolves() {
    let mut long = Vec::new();
    for f in markdown_files() {
        let text = std::fs::read_to_string(&f).unwrap();
        for (i, l) in text.lines().enumerate() {
            // The one exception: README's set-up block, whose form CI reads.
            if l.chars().count() > 200 && !l.starts_with("contrib/qemu.sh") {
                long.push(format!("{}:{}", f.display(), i + 1));
            }
        }
        // Relative links ([x](docs/y.md#z)) name files that exist.
        for part in text.split("](").skip(1) {
            let target = part.split(')').next().unwrap_or_default();
            let path = target.split('#').next().unwrap_or_default();
            if path.is_empty() || path.contains("://") {
                continue;
            }
            let dir = f.parent().unwrap_or(Path::new("."));
            assert!(dir.join(path).exists(), "{}: link to {target}", f.display());
        }
    }
    assert!(long.is_empty(), "lines over 200 characters: {long:?}");
}

/// Every page `vzram man --dir` writes renders with man(1) without a
/// warning, with the sections an operator looks for.
#[test]
fn the_manual_pages_render() {
    if Command::new("man").arg("--version").output().is_err() {
        assert!(
            std::env::var_os("VZRAM_E2E").is_none(),
            "man is missing (apt-get install man-db groff-base)"
        );
        eprintln!("SKIP: no man(1)");
        return;
    }
    let t = TempDir::new("man");
    Vzram::new(&["man", "--dir"]).arg(t.path()).ok();
    for (page, sections) in [
        (
            "vzram.1",
            &[
                "SYNOPSIS",
                "FILES",
                "ENVIRONMENT",
                "EXIT STATUS",
                "EXAMPLES",
                "SEE ALSO",
            ][..],
        ),
        (
            "vzram-serve.1",
            &[
                "SYNOPSIS",
                "FILES",
                "ENVIRONMENT",
                "EXIT STATUS",
                "EXAMPLES",
                "SEE ALSO",
            ],
        ),
        ("vzram-stat.1", &["SYNOPSIS", "EXIT STATUS", "EXAMPLES"]),
        (
            "vzram.toml.5",
            &["GLOBAL KEYS", "DEVICE KEYS", "EXAMPLES", "SEE ALSO"],
        ),
    ] {
        let out = Command::new("man")
            .env("MANWIDTH", "80")
            .env("MAN_KEEP_FORMATTING", "")
            .arg("--warnings")
            .arg("-l")
            .arg(t.path().join(page))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && err.trim().is_empty(),
            "{page}: {err}"
        );
        for s in sections {
            assert!(text.lines().any(|l| l == *s), "{page} lacks {s}:\n{text}");
        }
        assert!(!text.contains('`'), "{page} shows backticks:\n{text}");
    }
}
