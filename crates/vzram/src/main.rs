//! `vzram`: the command line over the `vzram` library (daemon, client).

use std::io::Write;
use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::Parser;

use vzram::cli::{self, Cli, Command};

/// Exit code for bad input: flags, config files, requests the daemon
/// refuses, and what `serve` finds wrong before serving (a socket path it
/// cannot bind, a port in use): a restart would fail the same way.
const EXIT_USAGE: u8 = 2;
/// Exit code for failures at run time (a daemon not running, the supervisor's loop failing).
const EXIT_FAILURE: u8 = 1;

fn main() -> ExitCode {
    // The daemon's own processes, started by it with descriptors in place;
    // not for people (hidden from --help).
    let mut args = std::env::args();
    match args.nth(1).as_deref() {
        Some("__launcher") => {
            // `__launcher [CONFIG]`: the one file it opens for reading.
            let config = std::env::args_os().nth(2).map(std::path::PathBuf::from);
            return match vzram::run_launcher(config) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("vzram launcher: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        Some("__worker") => {
            let spec = args.next().unwrap_or_default();
            return ExitCode::from(vzram::run_worker(&spec) as u8);
        }
        _ => {}
    }
    if cli::wants_capabilities(std::env::args_os().skip(1)) {
        return print_capabilities();
    }
    let argv = cli::as_backend_program(std::env::args_os().collect());
    let cli = match Cli::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            e.exit()
        }
        Err(e) => {
            // clap's message spans several paragraphs (what is wrong, usage,
            // hints); the first one, on one line, says what is wrong.
            let text = e.render().to_string();
            let first = text.trim_start().split("\n\n").next().unwrap_or_default();
            eprintln!("{}", one_line(first));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if cli.print_capabilities {
        return print_capabilities();
    }
    match cli.command {
        Command::Serve(args) => {
            let (log_level, log_format) = (args.log_level, args.log_format);
            let pidfile = args.pidfile.clone();
            let (cfg, reload) = match args.resolve_reloadable() {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {}", one_line(&e.to_string()));
                    return ExitCode::from(EXIT_USAGE);
                }
            };
            vzram::init_logging(log_level, log_format);
            match vzram::serve(cfg, log_level, log_format, reload, pidfile.as_deref()) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    // Once, on stderr (the log's stream too): not also as a log line.
                    eprintln!("error: {}", one_line(&e.to_string()));
                    if e.is_config() {
                        ExitCode::from(EXIT_USAGE)
                    } else {
                        ExitCode::from(EXIT_FAILURE)
                    }
                }
            }
        }
        other => client(vzram::run_client(other)),
    }
}

/// `--print-capabilities`: the JSON on stdout, exit 0, nothing else done.
fn print_capabilities() -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(cli::capabilities().as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::from(EXIT_FAILURE),
    }
}

fn client(r: Result<String, vzram::ClientError>) -> ExitCode {
    match r {
        Ok(out) => {
            let mut stdout = std::io::stdout().lock();
            // A closed pipe (`vzram stat | head`) is not worth a panic.
            let _ = stdout
                .write_all(out.as_bytes())
                .and_then(|()| stdout.flush());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {}", one_line(&e.message));
            ExitCode::from(e.code)
        }
    }
}

/// Input errors are promised on one line; some libraries' messages span several.
fn one_line(msg: &str) -> String {
    let mut out = String::new();
    for l in msg.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if !out.is_empty() {
            out.push_str(if out.ends_with(':') { " " } else { "; " });
        }
        out.push_str(l);
    }
    out
}
