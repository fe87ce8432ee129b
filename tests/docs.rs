//! README's option table and `vzram serve --help` name the same flags, both
//! ways: an option added to one and not the other fails here.

use std::collections::BTreeSet;
use std::process::Command;

use vzram_tests::*;

fn flags(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2 && !w.ends_with('-'))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_readme_option_table_and_serve_help_name_the_same_flags() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let table: String = readme
        .split("### Options")
        .nth(1)
        .expect("an Options section")
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        // The first column names the flags; the others may mention any.
        .map(|l| l.split('|').nth(1).unwrap_or_default().to_string() + "\n")
        .collect();
    let documented = flags(&table);
    let out = Command::new(vzram_bin())
        .args(["serve", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    // Only the flags' own lines: their texts mention other programs'.
    let offered = flags(
        &help
            .lines()
            .filter(|l| l.trim_start().starts_with('-'))
            .collect::<Vec<_>>()
            .join("\n"),
    );
    let mut offered: BTreeSet<String> = offered
        .into_iter()
        .filter(|f| f != "--help" && f != "--version")
        .collect();
    // A flag of the program itself, before any subcommand.
    offered.insert("--print-capabilities".into());
    let missing: Vec<_> = offered.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "not in README's option table: {missing:?}"
    );
    // Aliases (`--read-only`, `--socket-path`) are named in their flag's text.
    let mut named = flags(&help);
    named.insert("--print-capabilities".into());
    let stale: Vec<_> = documented.difference(&named).collect();
    assert!(
        stale.is_empty(),
        "in README's table, not in --help: {stale:?}"
    );
}
