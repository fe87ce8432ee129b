//! The code layout rules of issue 22, read from the sources under
//! `crates/*/src`: no file over 1,000 lines (nor under `tests/` and
//! `crates/*/tests`, issue 40), no import cycle between a crate's module
//! files, and the daemon's process folders never name each other (they
//! meet only in `proto/` and `owner/`).
//!
//! Paths are resolved lexically, not by rustc: see `Crate` for the limits.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 1000;
const PROCESS_FOLDERS: [&str; 4] = ["supervisor", "launcher", "worker", "client"];

type ModPath = Vec<String>;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The entries of `dir`, sorted; none if it is gone.
fn entries(dir: &Path) -> Vec<PathBuf> {
    let list = fs::read_dir(dir).into_iter().flatten();
    let mut list: Vec<PathBuf> = list.filter_map(|e| Some(e.ok()?.path())).collect();
    list.sort();
    list
}

fn crate_dirs() -> Vec<PathBuf> {
    let dirs = entries(&workspace().join("crates"));
    dirs.into_iter()
        .filter(|p| p.join("src").is_dir())
        .collect()
}

fn rs_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for p in entries(dir) {
        if p.is_dir() {
            out.extend(rs_files(&p));
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
    out
}

fn relative(path: &Path, base: &Path) -> String {
    let rel = path.strip_prefix(base).unwrap_or(path);
    rel.to_string_lossy().replace('\\', "/")
}

fn is_word(ch: char) -> bool {
    ch.is_alphanumeric() || ch == '_'
}

fn is_ident(s: &str) -> bool {
    s.starts_with(|ch: char| ch.is_alphabetic() || ch == '_')
}

/// The end of the string or char literal (plain, byte, C, raw with any
/// number of `#`) that opens at `c[i]`; None for anything else, lifetimes
/// and labels (`'a`, `'static`) included.
fn literal_end(c: &[char], i: usize) -> Option<usize> {
    let at = |j: usize| c.get(j).copied().unwrap_or('\0');
    let mut k = i + matches!(at(i), 'b' | 'c') as usize;
    if at(k) == '\'' && (k == i || at(i) == 'b') {
        return if at(k + 1) == '\\' {
            Some((k + 3..c.len()).find(|&j| c[j] == '\'').unwrap_or(c.len()) + 1)
        } else {
            (at(k + 2) == '\'').then_some(k + 3)
        };
    }
    let raw = at(k) == 'r';
    k += raw as usize;
    let hashes = (k..).take_while(|&j| at(j) == '#').count();
    k += hashes;
    if at(k) != '"' || (!raw && hashes > 0) {
        return None;
    }
    let closes = |j: usize| c[j] == '"' && (1..=hashes).all(|h| at(j + h) == '#');
    k += 1;
    while k < c.len() && !closes(k) {
        k += if !raw && c[k] == '\\' { 2 } else { 1 };
    }
    Some(k + 1 + hashes)
}

/// Blanks comments (nested ones too) and string/char literals, keeping line
/// breaks, so that words inside them are not read as paths.
fn strip(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let at = |j: usize| c.get(j).copied().unwrap_or('\0');
    let blank = |&ch: &char| if ch == '\n' { '\n' } else { ' ' };
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < c.len() {
        let start = i;
        if at(i) == '/' && at(i + 1) == '/' {
            i = (i..c.len()).find(|&j| c[j] == '\n').unwrap_or(c.len());
        } else if at(i) == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() && (depth > 0 || i == start) {
                let open = c[i..].starts_with(&['/', '*']);
                let close = c[i..].starts_with(&['*', '/']);
                depth += open as i32 - close as i32;
                i += 1 + (open || close) as usize;
            }
        } else if let Some(end) = literal_end(&c, i).filter(|_| i == 0 || !is_word(c[i - 1])) {
            i = end.min(c.len());
        } else {
            out.push(c[i]);
            i += 1;
            continue;
        }
        out.extend(c[start..i].iter().map(blank));
    }
    out
}

/// Words, `::` and single punctuation characters of stripped code, each
/// with its line.
fn tokens(code: &str) -> Vec<(String, usize)> {
    let c: Vec<char> = code.chars().collect();
    let word_end = |from: usize| (from..c.len()).find(|&j| !is_word(c[j])).unwrap_or(c.len());
    let mut out = vec![];
    let (mut i, mut line) = (0, 1);
    while i < c.len() {
        let mut next = i + 1;
        if is_word(c[i]) {
            next = word_end(i);
            out.push((c[i..next].iter().collect(), line));
        } else if c[i] == ':' && c.get(i + 1) == Some(&':') {
            out.push(("::".into(), line));
            next = i + 2;
        } else if !c[i].is_whitespace() {
            out.push((c[i].to_string(), line));
        }
        line += (c[i] == '\n') as usize;
        i = next;
    }
    out
}

/// Expands one use tree into (path, name it binds, `*` for a glob).
fn use_tree(p: &[&str], pos: &mut usize, mut segs: ModPath, out: &mut Vec<(ModPath, String)>) {
    let at = |k: usize| p.get(k).copied().unwrap_or("");
    while *pos < p.len() {
        let w = at(*pos);
        *pos += 1;
        match w {
            "::" => {}
            "{" => {
                while *pos < p.len() && at(*pos) != "}" {
                    use_tree(p, pos, segs.clone(), out);
                    *pos += (at(*pos) == ",") as usize;
                }
                *pos += 1;
                return;
            }
            "*" => return out.push((segs, "*".into())),
            _ => {
                if w != "self" || segs.is_empty() {
                    segs.push(w.into());
                }
                if at(*pos) == "::" {
                    continue;
                }
                let mut name = segs.last().cloned().unwrap_or_default();
                if at(*pos) == "as" {
                    name = at(*pos + 1).into();
                    *pos += 2;
                }
                return out.push((segs, name));
            }
        }
    }
}

/// The path from the crate root that `segs` names in `scope` (the module
/// path of the file plus its inline modules around the path), when it
/// starts at `crate`, `self` or `super`.
fn absolute(scope: &[String], segs: &[String]) -> Option<ModPath> {
    let (mut base, mut rest) = match segs.first()?.as_str() {
        "crate" => (vec![], &segs[1..]),
        "self" => (scope.to_vec(), &segs[1..]),
        "super" => (scope.to_vec(), segs),
        _ => return None,
    };
    while rest.first().is_some_and(|s| s == "super") {
        base.pop()?;
        rest = &rest[1..];
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// A path in a file that starts at `crate`, `self`, `super`, a child module
/// or a name a `use` bound: a leaf of a `use` (braces expanded) or a path
/// in code.
struct Ref {
    line: usize,
    text: String,
    abs: Option<ModPath>,
}

/// A name a `use` or `#[macro_export]` binds: (module it is bound in, name),
/// the path it leads to (None: out of the crate), and whether it is `pub`,
/// `pub(crate)` or `pub(super)`.
type Bind = ((ModPath, String), Option<ModPath>, bool);

struct Scan {
    rel: String,
    module: ModPath,
    refs: Vec<Ref>,
    binds: Vec<Bind>,
}

fn scan(rel: String, module: ModPath, src: &str) -> Scan {
    let toks = tokens(&strip(src));
    let t = |i: usize| toks.get(i).map_or("", |t| t.0.as_str());
    // The child modules and the names `use`s bound so far, so that
    // `proto::wire::X` after `use crate::proto;` leads to wire.rs (the whole
    // file taken as one scope).
    let mut imported: HashMap<String, ModPath> = HashMap::new();
    for i in (0..toks.len()).filter(|&i| t(i) == "mod" && t(i + 2) == ";") {
        let name = t(i + 1).to_string();
        imported.insert(name.clone(), [&module[..], &[name]].concat());
    }
    // Each path, with the name it re-exports if it is a `pub use`.
    let (mut refs, mut binds): (Vec<(Option<String>, Ref)>, _) = (vec![], vec![]);
    // Every word outside `use` items and `mod` names.
    let mut words = BTreeSet::new();
    // The inline modules open around the cursor, each with its brace depth.
    let mut inline: Vec<(String, usize)> = vec![];
    let (mut depth, mut i) = (0usize, 0);
    while i < toks.len() {
        let (w, line) = (t(i), toks[i].1);
        let prev = if i > 0 { t(i - 1) } else { "" };
        let names = inline.iter().map(|(n, _)| n.clone());
        let scope: ModPath = module.iter().cloned().chain(names).collect();
        let abs = |segs: &[String]| {
            let via_use = || Some([&imported.get(&segs[0])?[..], &segs[1..]].concat());
            absolute(&scope, segs).or_else(via_use)
        };
        let new_ref = |segs: &[String]| {
            let (text, abs) = (segs.join("::"), abs(segs));
            Ref { line, text, abs }
        };
        if is_ident(w) && w != "use" && prev != "mod" {
            words.insert(w.to_string());
        }
        // Not the tail of a longer path, nor `pub(in crate::x)`.
        let pub_in = prev == "in" && i >= 2 && t(i - 2) == "(";
        let path = matches!(w, "crate" | "self" | "super") || imported.contains_key(w);
        let path = path && t(i + 1) == "::" && prev != "::" && !pub_in;
        match w {
            "{" => depth += 1,
            // Saturating: a file caught mid-edit may close more than it opens.
            "}" => {
                depth = depth.saturating_sub(1);
                while inline.last().is_some_and(|&(_, d)| d > depth) {
                    inline.pop();
                }
            }
            "mod" if t(i + 2) == "{" => inline.push((t(i + 1).to_string(), depth + 1)),
            // A `#[macro_export]` macro is named at the root, defined here.
            "macro_rules" if t(i + 1) == "!" && !module.is_empty() => {
                let attrs = (i.saturating_sub(12)..i).rev().map(t);
                let mut attrs = attrs.take_while(|w| !matches!(*w, ";" | "}" | "{"));
                if attrs.any(|w| w == "macro_export") {
                    let name = t(i + 2).to_string();
                    let to = [&module[..], std::slice::from_ref(&name)].concat();
                    binds.push(((vec![], name), Some(to), false));
                }
            }
            "use" => {
                let paren = (i.saturating_sub(8)..i).any(|k| t(k) == "pub" && t(k + 1) == "(");
                let export = prev == "pub" || (prev == ")" && paren);
                let end = (i..toks.len()).find(|&k| t(k) == ";").unwrap_or(toks.len());
                let parts: Vec<&str> = (i + 1..end).map(t).collect();
                let (mut leaves, mut bound) = (vec![], vec![]);
                use_tree(&parts, &mut 0, vec![], &mut leaves);
                for (segs, name) in leaves {
                    // A lone name (`use bail;`) is an item of this module.
                    let here = || [&module[..], &segs].concat();
                    let to = abs(&segs).or_else(|| (segs.len() == 1).then(here));
                    if name != "*" && name != "_" {
                        bound.extend(to.clone().map(|to| (name.clone(), to)));
                        binds.push(((scope.clone(), name.clone()), to, export));
                    }
                    refs.push((export.then_some(name), new_ref(&segs)));
                }
                imported.extend(bound);
                i = end;
            }
            _ if path => {
                let mut segs = vec![w.to_string()];
                while t(i + 1) == "::" && is_ident(t(i + 2)) {
                    segs.push(t(i + 2).to_string());
                    i += 2;
                }
                if segs.len() > 1 {
                    refs.push((None, new_ref(&segs)));
                }
            }
            _ => {}
        }
        i += 1;
    }
    // A re-export is an edge only where its own file uses the name.
    refs.retain(|(n, _)| n.as_ref().is_none_or(|n| words.contains(n)));
    let refs = refs.into_iter().map(|(_, r)| r).collect();
    Scan {
        rel,
        module,
        refs,
        binds,
    }
}

/// One crate's module files and the names their `use`s bind.
///
/// Limits: names a glob (`use x::*`) brings in are not followed; a name a
/// `use` binds holds for its whole file; paths in strings (`#[serde(with =
/// "..")]`), raw identifiers and `#[path]` files are not seen; in a crate
/// with a lib.rs, main.rs is left out (it reaches the lib only by the
/// crate's name: it closes no cycle).
struct Crate {
    name: String,
    files: Vec<Scan>,
    modules: HashMap<ModPath, usize>,
    aliases: HashMap<(ModPath, String), Option<ModPath>>,
}

impl Crate {
    fn load(dir: &Path) -> Crate {
        let src = dir.join("src");
        let has_lib = src.join("lib.rs").is_file();
        let mut files = vec![];
        for path in rs_files(&src) {
            let rel = relative(&path, &src);
            if (has_lib && rel == "main.rs") || rel.starts_with("bin/") {
                continue;
            }
            let module = rel.trim_end_matches(".rs").split('/').map(String::from);
            let mut module: ModPath = module.collect();
            if module.last().is_some_and(|m| m == "mod") || rel == "lib.rs" || rel == "main.rs" {
                module.pop();
            }
            // A file moved away since the listing is skipped.
            if let Ok(text) = fs::read_to_string(&path) {
                files.push(scan(rel, module, &text));
            }
        }
        let modules = files.iter().map(|f| f.module.clone()).zip(0..).collect();
        let mut aliases = HashMap::new();
        for (key, to, export) in files.iter().flat_map(|f| f.binds.iter().cloned()) {
            // What a module re-exports wins over what it imports.
            if export || !aliases.contains_key(&key) {
                aliases.insert(key, to);
            }
        }
        let name = format!("crates/{}", dir.file_name().unwrap().to_string_lossy());
        Crate {
            name,
            files,
            modules,
            aliases,
        }
    }

    /// The file holding what `abs` names: its longest prefix that is a
    /// module file, following the names `use`s bind on the way.
    fn resolve(&self, abs: &[String], hops: usize) -> Option<usize> {
        let mut cur: ModPath = vec![];
        for (k, seg) in abs.iter().enumerate() {
            let next: ModPath = cur.iter().chain([seg]).cloned().collect();
            if self.modules.contains_key(&next) {
                cur = next;
                continue;
            }
            match self.aliases.get(&(cur.clone(), seg.clone())) {
                Some(None) => return None,
                // A name bound to itself is an item of `cur`.
                Some(Some(to)) if hops < 16 && *to != next => {
                    let p: ModPath = to.iter().chain(&abs[k + 1..]).cloned().collect();
                    return self.resolve(&p, hops + 1);
                }
                _ => break,
            }
        }
        self.modules.get(&cur).copied()
    }

    /// Edges between files, each with its references.
    fn edges(&self) -> BTreeMap<(usize, usize), Vec<&Ref>> {
        let mut edges: BTreeMap<_, Vec<_>> = BTreeMap::new();
        for (a, f) in self.files.iter().enumerate() {
            for r in &f.refs {
                let b = r.abs.as_ref().and_then(|p| self.resolve(p, 0));
                if let Some(b) = b.filter(|&b| b != a) {
                    edges.entry((a, b)).or_default().push(r);
                }
            }
        }
        edges
    }
}

/// Breadth-first from `from` through the nodes `keep` allows: each node
/// reached in one step or more, in order, with its predecessor.
fn bfs(adj: &[Vec<usize>], from: usize, keep: &dyn Fn(usize) -> bool) -> Vec<(usize, usize)> {
    let mut order: Vec<(usize, usize)> = vec![];
    let mut queue = VecDeque::from([from]);
    while let Some(v) = queue.pop_front() {
        for &w in adj[v].iter().filter(|&&w| keep(w)) {
            if !order.iter().any(|&(x, _)| x == w) {
                order.push((w, v));
                queue.push_back(w);
            }
        }
    }
    order
}

/// The strongly connected components of more than one file: the graphs are
/// small, so each node's reach is simply computed.
fn components(adj: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let reach =
        |v: usize| -> BTreeSet<usize> { bfs(adj, v, &|_| true).iter().map(|p| p.0).collect() };
    let reach: Vec<BTreeSet<usize>> = (0..adj.len()).map(reach).collect();
    let mut out: Vec<Vec<usize>> = vec![];
    for v in 0..adj.len() {
        let both = |w: &usize| *w == v || reach[v].contains(w) && reach[*w].contains(&v);
        let comp: Vec<usize> = (0..adj.len()).filter(both).collect();
        if comp.len() > 1 && comp[0] == v {
            out.push(comp);
        }
    }
    out
}

/// A closed walk through every file of a component, each time to the
/// nearest file not yet seen, so that every step shown is a real edge.
fn cycle_walk(comp: &[usize], adj: &[Vec<usize>]) -> Vec<usize> {
    let mut walk = vec![comp[0]];
    loop {
        let from = *walk.last().unwrap();
        let order = bfs(adj, from, &|w| comp.contains(&w));
        let unseen = order.iter().find(|p| !walk.contains(&p.0));
        let to = unseen.map_or(comp[0], |p| p.0);
        let pred = |v: usize| order.iter().find(|p| p.0 == v).map(|p| p.1);
        let mut steps = vec![to];
        while let Some(p) = pred(*steps.last().unwrap()).filter(|&p| p != from) {
            steps.push(p);
        }
        walk.extend(steps.into_iter().rev());
        if to == comp[0] {
            return walk;
        }
    }
}

fn cycle_report(krate: &Crate) -> Vec<String> {
    let edges = krate.edges();
    let mut adj = vec![vec![]; krate.files.len()];
    for &(a, b) in edges.keys() {
        adj[a].push(b);
    }
    let rel = |i: usize| krate.files[i].rel.as_str();
    let show = |(a, b): (usize, usize)| {
        let refs = &edges[&(a, b)];
        let (n, r, a, b) = (refs.len(), refs[0], rel(a), rel(b));
        format!("{a} -> {b} ({}, line {}; {n} refs)", r.text, r.line)
    };
    let mut out = vec![];
    for comp in components(&adj) {
        let walk = cycle_walk(&comp, &adj);
        let chain: Vec<&str> = walk.iter().map(|&i| rel(i)).collect();
        let mut text = format!("{}: {} files in a cycle: ", krate.name, comp.len());
        text += &chain.join(" -> ");
        let steps: BTreeSet<(usize, usize)> = walk.windows(2).map(|w| (w[0], w[1])).collect();
        text.extend(steps.iter().map(|&e| format!("\n    {}", show(e))));
        let inside = |e: &&(usize, usize)| comp.contains(&e.0) && comp.contains(&e.1);
        let others = edges.keys().filter(inside).filter(|e| !steps.contains(e));
        text.extend(others.map(|&e| format!("\n    also {}", show(e))));
        out.push(text);
    }
    out
}

fn fail_if_any(what: &str, found: &[String]) {
    assert!(found.is_empty(), "{what} (issue 22):\n{}", found.join("\n"));
}

/// The folders whose `.rs` files the line limit covers: each crate's
/// `src/`, `tests/` and `benches/`, and the workspace's `tests/` (with its
/// support library).
fn limited_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![workspace().join("tests")];
    for d in crate_dirs() {
        dirs.push(d.join("src"));
        dirs.push(d.join("tests"));
        dirs.push(d.join("benches"));
    }
    dirs
}

#[test]
fn no_source_file_over_1000_lines() {
    let (mut offenders, mut checked) = (vec![], 0);
    let mut tests = 0;
    for path in limited_dirs().iter().flat_map(|d| rs_files(d)) {
        let lines = fs::read_to_string(&path).map(|t| t.lines().count());
        checked += lines.is_ok() as usize;
        let rel = relative(&path, &workspace());
        tests += (lines.is_ok() && rel.split('/').any(|c| c == "tests")) as usize;
        if let Some(n) = lines.ok().filter(|&n| n > MAX_LINES) {
            offenders.push((n, rel));
        }
    }
    assert!(checked > tests, "no source files under crates/*/src");
    assert!(tests > 0, "no test files under tests/ or crates/*/tests");
    offenders.sort_by(|a, b| b.cmp(a));
    let line = |(n, f): &(usize, String)| format!("  {f}: {n} lines");
    let list: Vec<String> = offenders.iter().map(line).collect();
    println!("{checked} files checked, {} too long", list.len());
    fail_if_any(&format!("files over {MAX_LINES} lines"), &list);
}

#[test]
fn no_import_cycles() {
    let mut report = vec![];
    for dir in crate_dirs() {
        let krate = Crate::load(&dir);
        let cycles = cycle_report(&krate);
        let (name, files, edges) = (&krate.name, krate.files.len(), krate.edges().len());
        println!(
            "{name}: {files} files, {edges} edges, {} cycles",
            cycles.len()
        );
        report.extend(cycles);
    }
    fail_if_any("import cycles between module files", &report);
}

#[test]
fn process_folders_never_name_each_other() {
    let dir = workspace().join("crates/vzram");
    let krate = Crate::load(&dir);
    let is_dir = |f: &&&str| dir.join("src").join(f).is_dir();
    let (present, absent): (Vec<&str>, Vec<&str>) = PROCESS_FOLDERS.iter().partition(is_dir);
    if !absent.is_empty() {
        let absent = absent.join(",");
        println!("note: no src/{{{absent}}}/ yet; checking {present:?}");
    }
    if !dir.join("src/proto").is_dir() {
        println!("note: no src/proto/ yet");
    }
    let (mut bad, mut checked) = (vec![], 0);
    for f in &krate.files {
        let folder = present.iter().find(|p| f.rel.starts_with(&format!("{p}/")));
        let in_proto = f.rel.starts_with("proto/");
        if folder.is_none() && !in_proto {
            continue;
        }
        checked += 1;
        for r in &f.refs {
            // Both what the path names and the file it leads to.
            let target = r.abs.as_ref().and_then(|p| krate.resolve(p, 0));
            let target = target.map(|b| krate.files[b].module.clone());
            for p in [r.abs.clone(), target].iter().flatten() {
                let head = p.first().map_or("", String::as_str);
                let other = PROCESS_FOLDERS.contains(&head) && folder != Some(&head);
                if (folder.is_some() && other) || (in_proto && head != "proto") {
                    let (rel, line, text, to) = (&f.rel, r.line, &r.text, p.join("::"));
                    bad.push(format!("  {rel}:{line} {text} (reaches crate::{to})"));
                    break;
                }
            }
        }
    }
    println!("{checked} files checked in the process folders and proto/");
    let what = "a process folder names another, or proto/ imports the crate";
    fail_if_any(what, &bad);
}

#[test]
fn the_scanner_skips_comments_strings_and_lifetimes() {
    let src = r####"//! crate::a::Doc
        use crate::{b::{self, X}, c::Y as Z};
        fn f<'a>(x: &'a str) -> char { let _ = ("crate::d", r#"crate::e"#, b'"'); '{' }
        /* crate::f /* nested */ crate::g */ mod tests { use super::super::h::Q; }
        fn after() { crate::k::L }"####;
    let refs = scan("a.rs".into(), vec!["a".into()], src).refs;
    let show = |r: &Ref| format!("{:?}", r.abs.clone().unwrap_or_default());
    let got: Vec<String> = refs.iter().map(show).collect();
    let want = r#"["b"] ["b", "X"] ["c", "Y"] ["h", "Q"] ["k", "L"]"#;
    assert_eq!(got.join(" "), want);
}
