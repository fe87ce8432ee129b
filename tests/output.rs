//! What an operator reads and types, as zramctl's users expect: `vzram
//! stat`'s `--bytes`, `-o COLS`, `--noheadings` and `--raw`, counts that
//! say they count pages, sizes in messages as they are typed (`8M`, not
//! 8388608), a warning for a limit too small to work, and clear lines for
//! the usual slips (a negative size, `[device]` for `[[device]]`, a space
//! after a comma in `--device`, `--metrics :PORT`, `serve --version`).

use std::process::Output;

use vzram_tests::cli::Vzram;
use vzram_tests::client::Client;
use vzram_tests::daemon::Daemon;
use vzram_tests::data::pattern;
use vzram_tests::paths::{s, TempDir};

/// `vzram ARGS` with its state and default control socket in `state`,
/// where no daemon runs.
fn run(args: &[&str], state: &TempDir) -> Output {
    Vzram::new(args)
        .env("VZRAM_STATE_DIR", state.join("state"))
        .env("VZRAM_CONTROL", state.join("none.sock"))
        .output()
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn stat_prints_bytes_chosen_columns_and_bare_rows() {
    let dir = TempDir::new("out-stat");
    let sock = dir.join("vm1.sock");
    let d = Daemon::start(
        &dir,
        &[
            "--socket",
            s(&sock),
            "--size",
            "64M",
            "--name",
            "vm1",
            "--queues",
            "1",
        ],
        &[&sock],
    );
    let mut c = Client::connect(&sock, 1).unwrap();
    for p in 0..64u64 {
        c.q(0).write(p * 4096, &pattern(p, p * 4096, 4096)).unwrap();
    }
    drop(c);
    let ctl = s(&d.control);
    let stat = |extra: &[&str]| {
        let o = run(&[&["stat", "--control", ctl], extra].concat(), &dir);
        let (out, err) = text(&o);
        assert!(o.status.success(), "stat {extra:?}: {err}");
        out
    };
    // Counts say they are pages.
    let table = stat(&[]);
    for col in [
        "READ_PAGES",
        "WRITE_PAGES",
        "DISCARD_PAGES",
        "COMPACTED_PAGES",
    ] {
        assert!(table.contains(col), "no {col}:\n{table}");
    }
    // Chosen columns, sizes in bytes.
    let out = stat(&["-b", "-o", "name,size,orig-data,WRITE_PAGES"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    let words: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(words, ["NAME", "SIZE", "ORIG_DATA", "WRITE_PAGES"], "{out}");
    let words: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(words, ["vm1", "67108864", "262144", "64"], "{out}");
    // No headings, raw: one word a cell, one space apart.
    let out = stat(&["-n", "-r", "-o", "NAME,SIZE,MEM_LIMIT"]);
    assert_eq!(out, "vm1 64.0MiB -\n");
    // Without -o: the two tables' rows alone.
    let out = stat(&["--noheadings", "--bytes"]);
    assert!(
        out.lines()
            .all(|l| !l.contains("NAME") && !l.contains("mm_stat")),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("vm1") && l.contains("67108864")),
        "{out}"
    );
    // An unknown column: exit 2, naming the columns.
    let o = run(&["stat", "--control", ctl, "-o", "NAME,NOPE"], &dir);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("NOPE") && err.contains("ORIG_DATA"), "{err}");

    // A limit too small to work is set, with a warning that says so.
    let o = run(&["set-limit", "vm1", "512", "--control", ctl], &dir);
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("512 bytes holds at most 0 pages") && err.contains("did you mean 512M"),
        "{err}"
    );
    // Messages give sizes as they are typed.
    let o = run(&["set-limit", "vm1", "1G", "--control", ctl], &dir);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2));
    assert!(err.contains("a limit of 1G is above its size 64M"), "{err}");
    let o = run(&["set-limit", "vm1", "-1", "--control", ctl], &dir);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2));
    assert!(err.contains("cannot be negative"), "{err}");
}

#[test]
fn the_usual_slips_get_a_line_that_says_what_to_do() {
    let dir = TempDir::new("out-slips");
    let sock = dir.join("x.sock");
    let one_table = dir.join("one.toml");
    std::fs::write(
        &one_table,
        format!("[device]\nsocket = \"{}\"\nsize = \"8M\"\n", s(&sock)),
    )
    .unwrap();
    let spaced = format!("socket={}, size=8M, mem-limit=16M", s(&sock));
    for (args, needle) in [
        (
            vec!["serve", "--socket", s(&sock), "--size", "-1"],
            "cannot be negative",
        ),
        (vec!["serve", "--config", s(&one_table)], "[[device]]"),
        // The spaces are no part of the keys: the check after them speaks.
        (
            vec!["serve", "--device", &spaced],
            "mem-limit 16M is above its size 8M",
        ),
        (
            vec![
                "serve",
                "--socket",
                s(&sock),
                "--size",
                "8M",
                "--metrics",
                "example.com:9100",
            ],
            "localhost:PORT or :PORT",
        ),
    ] {
        let o = run(&args, &dir);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    let o = run(&["serve", "--version"], &dir);
    assert!(o.status.success() && text(&o).0.contains("0."), "{o:?}");
    // `--metrics :0` and `localhost:0` serve.
    for m in [":0", "localhost:0"] {
        let sock = dir.join(&format!("m{}.sock", m.len()));
        let mut d = Daemon::start(
            &dir,
            &["--socket", s(&sock), "--size", "8M", "--metrics", m],
            &[&sock],
        );
        let st = d.stat();
        assert!(st.0.metrics.is_some(), "{m}: no metrics address in stat");
        d.terminate_cleanly();
    }
}
