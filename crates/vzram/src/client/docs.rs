//! What a package installs beside the binary, made from the command line's
//! own definitions so it never drifts from `--help`: the manual pages
//! (`clap_mangen`) and shell completions (`clap_complete`).

use std::path::Path;

use clap::CommandFactory;

use crate::cli::Cli;

/// The command line as the pages show it: no `help` subcommand (`--help`
/// stays), hidden commands left out by the generators.
fn command() -> clap::Command {
    Cli::command().disable_help_subcommand(true)
}

/// `vzram.1` as roff; with `dir`, every page (`vzram.1`, `vzram-serve.1`,
/// ...) written there and a line naming them returned.
pub fn man(dir: Option<&Path>) -> std::io::Result<String> {
    let cmd = command();
    if let Some(dir) = dir {
        clap_mangen::generate_to(cmd, dir)?;
        return Ok(format!("manual pages written to {}\n", dir.display()));
    }
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd).render(&mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// The completion script for `shell`.
pub fn completions(shell: clap_complete::Shell) -> String {
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut command(), "vzram", &mut out);
    String::from_utf8_lossy(&out).into_owned()
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
    fn every_shell_completes_serve() {
        for shell in [
            clap_complete::Shell::Bash,
            clap_complete::Shell::Zsh,
            clap_complete::Shell::Fish,
        ] {
            let script = completions(shell);
            assert!(script.contains("serve"), "{shell}: {script}");
            assert!(script.contains("mem-limit"), "{shell}: {script}");
        }
    }
}
