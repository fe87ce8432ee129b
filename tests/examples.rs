//! Every example an operator copies runs: the commands in README's first
//! screen (fenced `sh` blocks before its first `## ` heading) and in the
//! EXAMPLES of every manual page `vzram man --dir` writes, against the real
//! binary, with `/run/vzram`, `/var/lib/vzram` and `/etc/vzram` moved into
//! a temporary directory. A `vzram serve` example runs until it answers
//! `vzram stat`, then gets SIGTERM and must exit 0; the others run against
//! a daemon serving vm1 (8G, a backing file, --idle-after) and vm2 (4G),
//! and must exit 0.
//!
//! README's `sh qemu` block (the QEMU command line) runs where QEMU is
//! installed, with TCG for KVM, paused (`-S`), on the daemon README serves:
//! the device must show as connected. Checked without running:
//! vzram-migrate(1)'s examples (they need a second daemon and a VM that
//! moves): the shell parses them, and each `vzram` line parses as the
//! binary parses it. README's libvirt XML is checked
//! line by line against contrib/libvirt/vzram-swap-disk.xml, which
//! tests/contrib.rs validates. Also here: bash completion against a running
//! daemon, and the demo's last line and temporary files.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vzram_tests::*;

/// An example: where it is from, its lines, and whether it runs.
struct Example {
    from: String,
    text: String,
    run: bool,
}

/// README's first screen: its fenced blocks before the first `## `.
fn readme_blocks() -> Vec<(String, String)> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let first = readme.split("\n## ").next().unwrap();
    let mut blocks = Vec::new();
    let mut parts = first.split("```");
    parts.next();
    while let (Some(block), _) = (parts.next(), parts.next()) {
        let (info, body) = block.split_once('\n').unwrap_or((block, ""));
        blocks.push((info.trim().to_string(), body.to_string()));
    }
    blocks
}

fn readme_examples() -> Vec<Example> {
    let mut out = Vec::new();
    for (info, body) in readme_blocks() {
        match info.as_str() {
            "sh" | "sh dry" | "sh qemu" => out.push(Example {
                from: format!("README.md ```{info}"),
                text: body,
                run: info == "sh",
            }),
            // The set-up commands (tests/docs.rs), output, libvirt's XML (below).
            "sh setup" | "console" | "xml" => {}
            other => panic!("README's first screen: a ```{other} block is neither run nor checked"),
        }
    }
    out
}

/// roff text as typed: the escapes the `roff` crate writes undone.
fn unroff(l: &str) -> String {
    l.replace("\\-", "-")
        .replace("\\*(Aq", "'")
        .replace("\\(aq", "'")
        .replace("\\&", "")
        .replace("\\:", "")
        .replace("\\\\", "\\")
}

/// The manual pages' EXAMPLES (`.nf` ... `.fi` after `.SH EXAMPLES`), and
/// vzram.toml(5)'s example file.
fn man_examples(dir: &Path) -> (Vec<Example>, String) {
    let mut out = Vec::new();
    let mut toml = None;
    let mut pages: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    pages.sort();
    for page in pages {
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&page).unwrap();
        let Some(ex) = text.split(".SH EXAMPLES\n").nth(1) else {
            continue;
        };
        let ex = ex.split("\n.SH ").next().unwrap();
        for block in ex.split(".nf\n").skip(1) {
            let body: String = block
                .split("\n.fi")
                .next()
                .unwrap()
                .lines()
                .map(|l| unroff(l) + "\n")
                .collect();
            if name == "vzram.toml.5" {
                toml = Some(body);
                continue;
            }
            out.push(Example {
                from: name.clone(),
                text: body,
                run: !name.starts_with("vzram-migrate"),
            });
        }
    }
    let toml = toml.expect("vzram.toml(5) has an example file");
    (out, toml)
}

/// Shell commands, continuation lines joined.
fn commands(text: &str) -> Vec<String> {
    text.replace("\\\n", " ")
        .lines()
        .map(|l| l.split(" #").next().unwrap_or_default().trim().to_string())
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

fn is_serve(cmd: &str) -> bool {
    cmd.starts_with("vzram serve") || cmd.starts_with("vzram --socket-path")
}

/// A private /run/vzram, /var/lib/vzram and /etc/vzram, and `vzram` on PATH.
struct Env {
    dir: TempDir,
}

impl Env {
    fn new(toml: &str) -> Env {
        let dir = TempDir::new("ex");
        for d in ["run", "lib", "etc", "state", "bin"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        // `vzram` in the examples is the binary under test, whatever its name.
        std::os::unix::fs::symlink(vzram_bin(), dir.join("bin/vzram")).unwrap();
        let env = Env { dir };
        std::fs::write(env.dir.join("etc/vzram.toml"), env.rewrite(toml)).unwrap();
        let img = std::fs::File::create(env.dir.join("lib/vm1.img")).unwrap();
        img.set_len(1 << 30).unwrap();
        env
    }

    fn rewrite(&self, s: &str) -> String {
        let t = self.dir.path().display().to_string();
        s.replace("/run/vzram", &format!("{t}/run"))
            .replace("/var/lib/vzram", &format!("{t}/lib"))
            .replace("/etc/vzram", &format!("{t}/etc"))
            // A fixed port may be taken on a test machine.
            .replace("127.0.0.1:9100", "127.0.0.1:0")
    }

    fn control(&self) -> PathBuf {
        self.dir.join("run/control.sock")
    }

    fn shell(&self, cmd: &str) -> Command {
        let bin_dir = self.dir.join("bin");
        let path = format!(
            "{}:{}",
            bin_dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut c = Command::new("bash");
        c.arg("-c")
            .arg(self.rewrite(cmd))
            .env("PATH", path)
            .env("VZRAM_CONTROL", self.control())
            .env("VZRAM_STATE_DIR", self.dir.join("state"))
            .current_dir(self.dir.path())
            .stdin(Stdio::null());
        c
    }

    /// Starts `cmd` (a serve) and waits until it answers `vzram stat`.
    fn serve(&self, cmd: &str, from: &str) -> Child {
        let log = self.dir.join(&format!("serve-{}.log", rand_tag()));
        let f = std::fs::File::create(&log).unwrap();
        let mut child = self
            .shell(&format!("exec {cmd}"))
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap();
        let control = cmd
            .split_whitespace()
            .skip_while(|w| *w != "--control")
            .nth(1)
            .map(|c| PathBuf::from(self.rewrite(c)))
            .unwrap_or_else(|| self.control());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                panic!("{from}: `{cmd}` exited ({st}):\n{}", read_log(&log));
            }
            let stat = Vzram::new(&["stat", "--control"]).arg(&control).output();
            if stat.status.success() {
                return child;
            }
            assert!(
                Instant::now() < deadline,
                "{from}: `{cmd}` not answering:\n{}",
                read_log(&log)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn rand_tag() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn read_log(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

const FIXTURE: &str = "vzram serve \
    --device socket=/run/vzram/vm1.sock,size=8G,name=vm1,backing-file=/var/lib/vzram/vm1.img,idle-after=10m \
    --device socket=/run/vzram/vm2.sock,size=4G,name=vm2";

fn stop(mut child: Child, what: &str) {
    // SAFETY: kill(2) on our own child's pid, which it still is (not waited for).
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            assert!(st.success(), "{what}: exit {st} after SIGTERM");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still running 20 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs one example in a fresh environment.
fn run(ex: &Example, toml: &str) {
    let env = Env::new(toml);
    let cmds = commands(&ex.text);
    let mut daemons = Vec::new();
    if !cmds.iter().any(|c| is_serve(c)) {
        daemons.push((
            env.serve(FIXTURE, "the examples' daemon"),
            FIXTURE.to_string(),
        ));
    }
    for cmd in &cmds {
        if is_serve(cmd) {
            daemons.push((env.serve(cmd, &ex.from), cmd.clone()));
            continue;
        }
        let out = env.shell(cmd).output().unwrap();
        assert!(
            out.status.success(),
            "{}: `{cmd}` failed ({}):\n{}{}",
            ex.from,
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for (d, cmd) in daemons {
        stop(d, &format!("{}: `{cmd}`", ex.from));
    }
}

/// Checks an example that cannot run here: the shell parses it, and each
/// `vzram` command parses as the binary parses its command line.
fn dry(ex: &Example) {
    let out = Command::new("bash")
        .arg("-n")
        .arg("-c")
        .arg(&ex.text)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        ex.from,
        String::from_utf8_lossy(&out.stderr)
    );
    for cmd in commands(&ex.text)
        .iter()
        .filter(|c| c.starts_with("vzram "))
    {
        if let Err(e) = vzram::cli::parse(cmd.split_whitespace().map(Into::into).collect()) {
            panic!("{}: `{cmd}` does not parse: {e}", ex.from);
        }
    }
}

#[test]
fn every_example_in_readme_and_the_manual_runs() {
    let t = TempDir::new("pages");
    Vzram::new(&["man", "--dir"]).arg(t.path()).ok();
    let (man, toml) = man_examples(t.path());
    let mut all = readme_examples();
    all.extend(man);
    assert!(all.len() > 20, "only {} examples", all.len());
    // The config file's example is served by vzram-serve(1)'s --config one.
    assert!(all
        .iter()
        .any(|e| e.run && e.text.contains("--config /etc/vzram/vzram.toml")));
    let (mut ran, mut checked) = (0, 0);
    for ex in &all {
        if ex.run {
            run(ex, &toml);
            ran += 1;
        } else {
            dry(ex);
            checked += 1;
        }
    }
    eprintln!("{ran} examples run, {checked} parsed only");
}

#[test]
fn readme_attaches_qemu_and_libvirt_to_the_socket_it_serves() {
    let blocks = readme_blocks();
    let served: Vec<String> = blocks
        .iter()
        .filter(|(i, _)| i == "sh")
        .flat_map(|(_, b)| commands(b))
        .filter(|c| is_serve(c))
        .flat_map(|c| {
            let w: Vec<String> = c.split_whitespace().map(str::to_string).collect();
            w.windows(2)
                .filter(|p| p[0] == "--socket")
                .map(|p| p[1].clone())
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(!served.is_empty(), "README's first screen serves no socket");
    let qemu = blocks
        .iter()
        .find(|(i, _)| i == "sh qemu")
        .expect("README: the QEMU block");
    let path = qemu
        .1
        .split("path=")
        .nth(1)
        .and_then(|p| p.split([',', ' ']).next());
    assert!(
        served.iter().any(|s| Some(s.as_str()) == path),
        "QEMU connects to {path:?}, README serves {served:?}"
    );
    // Every line of the XML is contrib's, in order (tests/contrib.rs validates that file).
    let xml = &blocks
        .iter()
        .find(|(i, _)| i == "xml")
        .expect("README: the libvirt XML")
        .1;
    let contrib =
        std::fs::read_to_string(root().join("contrib/libvirt/vzram-swap-disk.xml")).unwrap();
    let mut rest = contrib.as_str();
    for l in xml.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let at = rest
            .find(l)
            .unwrap_or_else(|| panic!("README's XML line {l} is not in contrib's file (in order)"));
        rest = &rest[at + l.len()..];
    }
    assert!(xml.contains(&format!("path='{}'", served[0])), "{xml}");
    // The sample output has the real table's headers.
    let env = Env::new("");
    let d = env.serve(FIXTURE, "fixture");
    let out = env.shell("vzram stat").output().unwrap();
    let stat = String::from_utf8_lossy(&out.stdout).into_owned();
    stop(d, "fixture");
    let sample = &blocks
        .iter()
        .find(|(i, _)| i == "console")
        .expect("README: stat's output")
        .1;
    for header in sample
        .lines()
        .filter(|l| l.starts_with("NAME") || l.ends_with("_stat"))
    {
        let words: Vec<&str> = header.split_whitespace().collect();
        assert!(
            stat.lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>() == words),
            "README shows `{header}`; vzram stat prints:\n{stat}"
        );
    }
}

/// README's QEMU command line, as typed but for TCG and a paused machine
/// with a QMP monitor on stdin, connects to the device README serves.
#[test]
fn readmes_qemu_command_connects_to_the_device() {
    let qemu = "qemu-system-x86_64";
    if Command::new(qemu).arg("--version").output().is_err() {
        assert!(
            std::env::var_os("VZRAM_E2E").is_none(),
            "VZRAM_E2E is set but {qemu} is missing"
        );
        eprintln!("SKIPPED: no {qemu}");
        return;
    }
    let blocks = readme_blocks();
    let block = &blocks
        .iter()
        .find(|(i, _)| i == "sh qemu")
        .expect("README: the QEMU block")
        .1;
    let cmd = commands(block).join(" ");
    assert!(cmd.starts_with(qemu) && cmd.ends_with(" ..."), "{cmd}");
    let cmd = cmd
        .replace("accel=kvm", "accel=tcg")
        .replace(" ...", " -nodefaults -display none -S -qmp stdio");
    let env = Env::new("");
    let d = env.serve(FIXTURE, "fixture");
    let mut q = env
        .shell(&format!("exec {cmd}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = q.stdin.take().unwrap();
    use std::io::Write;
    writeln!(stdin, r#"{{"execute":"qmp_capabilities"}}"#).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let connected = loop {
        let out = env.shell("vzram stat vm1 --json").output().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if v["devices"][0]["connected"] == true {
            break true;
        }
        if Instant::now() > deadline || q.try_wait().unwrap().is_some() {
            break false;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = writeln!(stdin, r#"{{"execute":"quit"}}"#);
    drop(stdin);
    let out = q.wait_with_output().unwrap();
    assert!(
        connected,
        "README's QEMU command never connected to vm1: {cmd}\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stop(d, "fixture");
}

/// bash: `--algo <TAB>` offers the codecs, `--size <TAB>` sizes, and a
/// device command's NAME the running daemon's devices.
#[test]
fn bash_completes_codecs_sizes_and_the_daemons_devices() {
    let env = Env::new("");
    let d = env.serve(FIXTURE, "fixture");
    let script = env.dir.join("vzram.bash");
    let out = Vzram::new(&["completions", "bash"]).output();
    std::fs::write(&script, &out.stdout).unwrap();
    let complete = |words: &str| {
        let n = words.split(' ').count() - 1;
        let cmd = format!(
            "source {}; COMP_WORDS=({words}); COMP_CWORD={n}; _vzram_with_devices vzram \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            script.display()
        );
        let out = env.shell(&cmd).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let algos = complete("vzram serve --algo ''");
    assert!(
        algos.contains(&"zstd:3".to_string()) && algos.contains(&"lz4".to_string()),
        "{algos:?}"
    );
    let sizes = complete("vzram serve --size ''");
    assert!(sizes.contains(&"8G".to_string()), "{sizes:?}");
    assert_eq!(complete("vzram stat ''"), ["vm1", "vm2"]);
    assert_eq!(complete("vzram set-limit v"), ["vm1", "vm2"]);
    assert_eq!(complete("vzram mark-idle --device ''"), ["vm1", "vm2"]);
    stop(d, "fixture");
}

/// The demo ends with its verdict and leaves nothing in its temp dir.
#[test]
fn the_demo_ends_with_its_verdict_and_leaves_nothing_behind() {
    let Some(ctx) = guest::Ctx::new("demo") else {
        return;
    };
    let tmp = ctx.path("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let out = Command::new(root().join("contrib/qemu.sh"))
        .args(["--test", "info", "--mem", "128M"])
        .env("VZRAM_BIN", vzram_bin())
        .env("TMPDIR", &tmp)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or_default();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        last.starts_with("qemu.sh: PASS: "),
        "last line: {last}\n{text}"
    );
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(left.is_empty(), "the demo left {left:?}");
}
