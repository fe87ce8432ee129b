//! vzram-bench: vzram vs qemu-storage-daemon vs the raw codec, side by side, one run.
//!
//! See `vzram-bench --help`. Results go to stdout as markdown, to `--json` as JSON
//! lines, to `--plot` as a PNG; progress goes to stderr. Errors exit 2.

mod bench;
mod checksum;
mod cli;
mod client;
mod codecs;
mod data;
mod density;
mod error;
mod guest;
mod hist;
mod job;
mod lz4c;
mod measure;
mod migrate;
mod plot;
mod report;
mod restart;
mod rng;
mod sys;
mod targets;
mod units;

use bench::{Ctx, Plan};
use clap::Parser;
use cli::{Cli, Cmd, Common};
use data::Corpus;
use error::{bail, Result};
use job::{JobKind, JobSpec};
use report::JsonOut;
use std::path::{Path, PathBuf};
use targets::{parse_targets, Algo, Env, Kind, TargetSpec};

fn main() {
    let cli = Cli::parse();
    sys::install_signal_handlers();
    // The daemons this starts keep their state on tmpfs, as in production,
    // in a directory of this run's (unless the caller chose one).
    let state = std::env::var_os("VZRAM_STATE_DIR").is_none().then(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("vzram-bench-state-{}", std::process::id()));
        // Set before any thread or child starts.
        std::env::set_var("VZRAM_STATE_DIR", &dir);
        dir
    });
    let r = real_main(cli);
    if let Some(dir) = state {
        let _ = std::fs::remove_dir_all(dir);
    }
    match r {
        Ok(()) => {}
        Err(e) => {
            let msg = e.0.replace('\n', " ");
            eprintln!("vzram-bench: error: {msg}");
            std::process::exit(2);
        }
    }
}

fn real_main(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Run(a) => {
            let targets = parse_targets(&a.targets, a.common.algo)?;
            let prefill = a.prefill || (!a.no_prefill && a.job.reads());
            let job = job_spec(&a.common, a.job, a.bs, a.iodepth, a.queues, prefill);
            job.validate()?;
            run_plan(&a.common, vec![(job, targets)], 1)
        }
        Cmd::Compare(a) => {
            let c = &a.common;
            let targets = parse_targets(&a.targets, c.algo)?;
            let mut plan: Plan = Vec::new();
            // What a swapping guest does, one queue: 4K pages at depth and
            // alone, swap-out as the 64K writes Linux batches, swap-in as the
            // 32K reads of its page-cluster readahead (8 pages).
            for (kind, bs, qd) in [
                (JobKind::Randread, 4096, 32),
                (JobKind::Randwrite, 4096, 32),
                (JobKind::Randread, 4096, 1),
                (JobKind::Randwrite, 65536, 8),
                (JobKind::Randread, 32768, 8),
                (JobKind::Randread, 32768, 1),
            ] {
                // The codec has no queue depth: its QD1 run would repeat the deep one.
                let t: Vec<TargetSpec> = targets
                    .iter()
                    .filter(|t| qd > 1 || t.kind != Kind::Codec)
                    .copied()
                    .collect();
                plan.push((job_spec(c, kind, bs, qd, 1, true), t));
            }
            // Memory per GiB stored, per algorithm: one sequential fill each.
            let mut fill_targets: Vec<TargetSpec> = Vec::new();
            for name in ["qsd", "host-zram"] {
                let t = TargetSpec::parse(name, c.algo)?;
                if targets.iter().any(|x| x.kind == t.kind) {
                    fill_targets.push(t);
                }
            }
            for algo in a.mem_algos.split(',').filter(|s| !s.is_empty()) {
                let algo: Algo = algo.trim().parse()?;
                for kind in [Kind::VzramBase, Kind::Vzram, Kind::Codec] {
                    if targets.iter().any(|t| t.kind == kind) {
                        fill_targets.push(TargetSpec { kind, algo });
                    }
                }
            }
            if !fill_targets.is_empty() {
                plan.push((job_spec(c, JobKind::Fill, 65536, 8, 1, false), fill_targets));
            }
            run_plan(c, plan, 3)
        }
        Cmd::Scaling(a) => {
            let c = &a.common;
            let targets = parse_targets(&a.targets, c.algo)?;
            let max = a.max_queues.unwrap_or(sys::nproc() as u32).max(1);
            let mut counts: Vec<u32> = std::iter::successors(Some(1u32), |q| Some(q * 2))
                .take_while(|&q| q <= max)
                .collect();
            if counts.last() != Some(&max) {
                counts.push(max);
            }
            let mut plan: Plan = Vec::new();
            for j in a.jobs.split(',').filter(|s| !s.is_empty()) {
                let kind = <JobKind as clap::ValueEnum>::from_str(j.trim(), true)
                    .map_err(|e| format!("--jobs: {e}"))?;
                for &q in &counts {
                    plan.push((job_spec(c, kind, a.bs, a.iodepth, q, true), targets.clone()));
                }
            }
            run_plan(c, plan, 1)
        }
        Cmd::Density(a) => {
            let work = WorkDir::new(a.work_dir.clone())?;
            let env = Env {
                work_dir: work.path.clone(),
                shm_dir: "/dev/shm".into(),
                vzram_bin: vzram_bin(a.vzram_bin.clone()),
                vzram_base_bin: None,
                vzram_args: Vec::new(),
                vzram_base_args: Vec::new(),
                qsd_bin: "qemu-storage-daemon".into(),
                corpus: Corpus::synthetic(1, 0),
            };
            env.check(&[TargetSpec::parse("vzram", Algo::Lz4)?])?;
            let json = a.json.as_deref().map(JsonOut::open).transpose()?;
            let rs = density::run(&env, &a, json);
            let rs = work.finish(rs)?;
            density::print_table(&rs);
            if !density::all_ok(&rs) {
                bail!(
                    "density: some devices did not answer or the daemon logged errors (see the table)"
                );
            }
            Ok(())
        }
        Cmd::Restart(a) => {
            let work = WorkDir::new(a.work_dir.clone())?;
            let env = Env {
                work_dir: work.path.clone(),
                shm_dir: "/dev/shm".into(),
                vzram_bin: vzram_bin(a.vzram_bin.clone()),
                vzram_base_bin: None,
                vzram_args: Vec::new(),
                vzram_base_args: Vec::new(),
                qsd_bin: "qemu-storage-daemon".into(),
                corpus: Corpus::resolve(a.corpus.as_deref(), a.synthetic)?,
            };
            env.check(&[TargetSpec::parse("vzram", Algo::Lz4)?])?;
            let json = a.json.as_deref().map(JsonOut::open).transpose()?;
            let rs = restart::run(&env, &a, json);
            let rs = work.finish(rs)?;
            println!(
                "Data: {} ({} pages), {} CPUs.\n",
                env.corpus.name,
                env.corpus.len(),
                sys::nproc()
            );
            restart::print_table(&rs);
            Ok(())
        }
        Cmd::Migrate(a) => {
            let work = WorkDir::new(a.work_dir.clone())?;
            let env = Env {
                work_dir: work.path.clone(),
                shm_dir: "/dev/shm".into(),
                vzram_bin: vzram_bin(a.vzram_bin.clone()),
                vzram_base_bin: None,
                vzram_args: Vec::new(),
                vzram_base_args: Vec::new(),
                qsd_bin: "qemu-storage-daemon".into(),
                corpus: Corpus::resolve(a.corpus.as_deref(), a.synthetic)?,
            };
            env.check(&[TargetSpec::parse("vzram", Algo::Lz4)?])?;
            let json = a.json.as_deref().map(JsonOut::open).transpose()?;
            let r = migrate::run(&env, &a, json);
            let r = work.finish(r)?;
            println!(
                "Data: {} ({} pages), {} written to a {} device, {} migrations per transport \
                 (interleaved), {} CPUs.\n",
                env.corpus.name,
                env.corpus.len(),
                units::format_size(a.data),
                units::format_size(a.dev_size),
                a.repeat,
                sys::nproc()
            );
            migrate::print_table(&r);
            Ok(())
        }
        Cmd::Guest(a) => {
            // The guest writes its own pages; no corpus is read.
            let (work, env) = daemons_env(&a.daemons, Corpus::synthetic(1, 0))?;
            let json = a.json.as_deref().map(JsonOut::open).transpose()?;
            let rs = guest::run(&env, &a, json);
            let rs = work.finish(rs)?;
            println!(
                "Guest: swap test, {} rounds, {} RAM, TCG 2 vCPUs; disk {} ({} queues); {} \
                 boot(s) per target, interleaved; {} host CPUs.\n",
                a.rounds,
                units::format_size(a.mem),
                units::format_size(a.size),
                a.queues,
                a.repeat.max(1),
                sys::nproc()
            );
            guest::print_table(&rs);
            Ok(())
        }
        Cmd::Codecs(a) => codecs::run(&a),
        Cmd::Report(a) => {
            let rs = report::load(&a.input)?;
            report::print_table(&rs);
            guest::print_table(&guest::load(&a.input)?);
            if let Some(p) = &a.plot {
                plot::draw(&rs, p)?;
            }
            Ok(())
        }
    }
}

fn job_spec(
    c: &Common,
    kind: JobKind,
    bs: u64,
    iodepth: u32,
    queues: u32,
    prefill: bool,
) -> JobSpec {
    JobSpec {
        kind,
        bs,
        iodepth,
        queues,
        size: c.size,
        runtime_s: c.runtime,
        ramp_s: c.ramp,
        prefill,
        verify: c.verify,
        poll: c.poll,
        think_us: c.think_us,
        settle_s: c.settle,
    }
}

/// Next to this binary (target/release/), else target/release/vzram from the cwd.
fn vzram_bin(arg: Option<PathBuf>) -> PathBuf {
    if let Some(p) = arg {
        return p;
    }
    if let Some(p) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("vzram")))
        .filter(|p| p.is_file())
    {
        return p;
    }
    PathBuf::from("target/release/vzram")
}

/// Sockets and logs; removed on success, kept (and named) when something failed.
struct WorkDir {
    path: PathBuf,
    remove: bool,
}

impl WorkDir {
    fn new(arg: Option<PathBuf>) -> Result<WorkDir> {
        let (path, remove) = match arg {
            Some(p) => (p, false),
            None => (
                std::env::temp_dir().join(format!("vzram-bench-{}", std::process::id())),
                true,
            ),
        };
        std::fs::create_dir_all(&path).map_err(|e| format!("creating {}: {e}", path.display()))?;
        Ok(WorkDir { path, remove })
    }

    fn finish<T>(self, r: Result<T>) -> Result<T> {
        match r {
            Ok(v) => {
                if self.remove {
                    let _ = std::fs::remove_dir_all(&self.path);
                }
                Ok(v)
            }
            Err(e) if self.path.read_dir().is_ok_and(|mut d| d.next().is_some()) => Err(
                error::Error(format!("{} (logs in {})", e.0, self.path.display())),
            ),
            Err(e) => Err(e),
        }
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        // Only succeeds when empty: a failure with logs keeps them.
        if self.remove {
            let _ = std::fs::remove_dir(&self.path);
        }
    }
}

/// The work directory and the targets' environment from the daemon flags.
fn daemons_env(d: &cli::Daemons, corpus: Corpus) -> Result<(WorkDir, Env)> {
    let work = WorkDir::new(d.work_dir.clone())?;
    let env = Env {
        work_dir: work.path.clone(),
        shm_dir: d.shm_dir.clone(),
        vzram_bin: vzram_bin(d.vzram_bin.clone()),
        vzram_base_bin: d.vzram_base_bin.clone().or_else(|| {
            (!d.vzram_base_args.trim().is_empty()).then(|| vzram_bin(d.vzram_bin.clone()))
        }),
        vzram_args: split_args(&d.vzram_args),
        vzram_base_args: split_args(&d.vzram_base_args),
        qsd_bin: d.qsd_bin.clone(),
        corpus,
    };
    Ok((work, env))
}

fn run_plan(c: &Common, plan: Plan, default_repeat: u32) -> Result<()> {
    let all: Vec<TargetSpec> = plan.iter().flat_map(|(_, t)| t.iter().copied()).collect();
    let skipped = targets::skipped(&all);
    for (t, why) in &skipped {
        eprintln!("{}: skipped: {why}", t.label());
    }
    let plan = bench::without(plan, &skipped)?;
    let all: Vec<TargetSpec> = plan.iter().flat_map(|(_, t)| t.iter().copied()).collect();
    let (work, env) = daemons_env(&c.daemons, Corpus::resolve(c.data.as_deref(), c.synthetic)?)?;
    env.check(&all)?;
    let repeat = c.repeat.unwrap_or(default_repeat).max(1);
    eprintln!(
        "corpus {} ({} pages), {} runs, work dir {}",
        env.corpus.name,
        env.corpus.len(),
        plan.iter().map(|(_, t)| t.len()).sum::<usize>() * repeat as usize,
        env.work_dir.display()
    );
    let json = c.json.as_deref().map(JsonOut::open).transpose()?;
    let mut ctx = Ctx::new(&env, json);
    let results = work.finish(bench::run_plan(&mut ctx, &plan, repeat))?;
    println!(
        "Data: {} ({} pages); {} per run, {} s measured after {} s ramp, {} repeat(s), {} CPUs.\n",
        env.corpus.name,
        env.corpus.len(),
        units::format_size(c.size),
        c.runtime,
        c.ramp,
        repeat,
        sys::nproc()
    );
    for (t, why) in &skipped {
        println!("{}: skipped: {why}\n", t.label());
    }
    report::print_table(&results);
    if let Some(p) = &c.plot {
        plot::draw(&results, p)?;
        eprintln!("plot written to {}", display(p));
    }
    Ok(())
}

fn split_args(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

fn display(p: &Path) -> String {
    p.display().to_string()
}
