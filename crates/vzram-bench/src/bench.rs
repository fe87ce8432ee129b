//! Runs: one target x one job, and plans of many with targets interleaved.

use crate::client::{run_queue, Bitmap, Conn, WorkerCfg};
use crate::data::PAGE;
use crate::error::{bail, Context, Result};
use crate::job::{JobKind, JobSpec, OpGen};
use crate::measure::{Totals, Window};
use crate::report::{JsonOut, RunResult};
use crate::sys::{interrupted, tree_cpu};
use crate::targets;
use crate::targets::codec::Compressed;
use crate::targets::{start_block, Algo, Env, Kind, Memory, TargetSpec};
use std::collections::HashMap;
use std::sync::{Barrier, OnceLock};
use std::time::{Duration, Instant, SystemTime};

/// A list of (job, targets) to run, each `repeat` times.
pub type Plan = Vec<(JobSpec, Vec<TargetSpec>)>;

/// State shared across the runs of one invocation.
pub struct Ctx<'a> {
    pub env: &'a Env,
    seq: usize,
    compressed: HashMap<Algo, Compressed>,
    pub json: Option<JsonOut>,
}

impl<'a> Ctx<'a> {
    pub fn new(env: &'a Env, json: Option<JsonOut>) -> Self {
        Ctx {
            env,
            seq: 0,
            compressed: HashMap::new(),
            json,
        }
    }
}

/// Run the plan: for each job, `repeat` rounds of every target in turn (A B A B...),
/// so drift on a noisy machine hits all targets alike. A failed run is reported and
/// the rest go on; the error is returned at the end.
pub fn run_plan(ctx: &mut Ctx, plan: &Plan, repeat: u32) -> Result<Vec<RunResult>> {
    let total: usize = plan.iter().map(|(_, t)| t.len()).sum::<usize>() * repeat as usize;
    let mut done = 0;
    let mut results = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    'outer: for (job, targets) in plan {
        for rep in 0..repeat {
            for t in targets {
                if interrupted() {
                    failures.push("interrupted".into());
                    break 'outer;
                }
                done += 1;
                let tag = format!(
                    "[{done}/{total}] {} {} rep {}/{repeat}",
                    t.label(),
                    job.key(),
                    rep + 1
                );
                eprintln!("{tag} ...");
                match run_one(ctx, t, job, rep) {
                    Ok(r) => {
                        eprintln!("{tag}: {}", r.one_line());
                        if r.verify_errors > 0 {
                            eprintln!("{tag}: WARNING: {} pages read back wrong", r.verify_errors);
                        }
                        if let Some(j) = ctx.json.as_mut() {
                            j.write(&r)?;
                        }
                        results.push(r);
                    }
                    Err(e) => {
                        eprintln!("{tag}: FAILED: {e}");
                        failures.push(format!("{tag}: {e}"));
                    }
                }
            }
        }
    }
    if !failures.is_empty() {
        crate::report::print_table(&results);
        bail!(
            "{} of {total} runs failed; first: {}",
            failures.len(),
            failures[0]
        );
    }
    Ok(results)
}

/// The plan without the targets this host cannot run (see `targets::skipped`);
/// an error if nothing is left.
pub fn without(plan: Plan, skipped: &[(TargetSpec, String)]) -> Result<Plan> {
    let plan: Plan = plan
        .into_iter()
        .map(|(job, ts)| {
            let ts: Vec<TargetSpec> = ts
                .into_iter()
                .filter(|t| skipped.iter().all(|(s, _)| s != t))
                .collect();
            (job, ts)
        })
        .filter(|(_, ts)| !ts.is_empty())
        .collect();
    if plan.is_empty() {
        bail!("no target left to run");
    }
    Ok(plan)
}

pub fn run_one(ctx: &mut Ctx, spec: &TargetSpec, job: &JobSpec, rep: u32) -> Result<RunResult> {
    job.validate()?;
    ctx.seq += 1;
    let load = crate::sys::load_1m();
    let mut r = match spec.kind {
        Kind::Codec => run_codec(ctx, spec, job, rep),
        Kind::Qsd | Kind::Vzram | Kind::VzramBase | Kind::HostZram => {
            run_block(ctx, spec, job, rep)
        }
    }?;
    r.load_1m = load;
    Ok(r)
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn sleep_until(t: Instant) {
    while !interrupted() {
        let now = Instant::now();
        if now >= t {
            break;
        }
        std::thread::sleep((t - now).min(Duration::from_millis(100)));
    }
}

fn base_result(spec: &TargetSpec, job: &JobSpec, rep: u32, ctx: &Ctx, t: &Totals) -> RunResult {
    let wall = t.wall.as_secs_f64();
    RunResult {
        record: "run".into(),
        target: spec.label(),
        target_kind: spec.kind.name().into(),
        algo: (spec.kind != Kind::Qsd).then(|| spec.algo.to_string()),
        job: job.kind.name().into(),
        bs: job.bs,
        iodepth: job.iodepth,
        queues: job.queues,
        think_us: job.think_us,
        size: job.size,
        rep,
        data: ctx.env.corpus.name.clone(),
        runtime_s: wall,
        ios: t.ios,
        reads: t.reads,
        writes: t.writes,
        iops: t.iops,
        mb_s: t.bytes_per_s / 1e6,
        lat_p50_us: t.hist.quantile(0.5) as f64 / 1e3,
        lat_p99_us: t.hist.quantile(0.99) as f64 / 1e3,
        lat_p999_us: t.hist.quantile(0.999) as f64 / 1e3,
        lat_mean_us: t.hist.mean() / 1e3,
        lat_max_us: t.hist.max() as f64 / 1e3,
        client_cpu_s: t.cpu.as_secs_f64(),
        client_cpu_pct: if wall > 0.0 {
            100.0 * t.cpu.as_secs_f64() / wall
        } else {
            0.0
        },
        server_cpu_s: None,
        server_cpu_pct: None,
        stored_bytes: 0,
        host_mem_bytes: 0,
        mem_per_byte: None,
        rss_bytes: 0,
        extra_mem_bytes: 0,
        mem_after_prefill_bytes: None,
        mem_at_end_bytes: None,
        prefill_s: None,
        prefill_mb_s: None,
        verify_errors: t.verify_errors,
        codec_ratio: None,
        mem_details: serde_json::Value::Null,
        unix_time: unix_time(),
        load_1m: None,
    }
}

fn run_codec(ctx: &mut Ctx, spec: &TargetSpec, job: &JobSpec, rep: u32) -> Result<RunResult> {
    if !ctx.compressed.contains_key(&spec.algo) {
        let c = Compressed::new(&ctx.env.corpus, spec.algo)?;
        ctx.compressed.insert(spec.algo, c);
    }
    let comp = &ctx.compressed[&spec.algo];
    let totals = targets::codec::run(&ctx.env.corpus, comp, spec.algo, job)?;
    let mut r = base_result(spec, job, rep, ctx, &totals);
    // An ideal store of this data: what the codec alone would need.
    r.stored_bytes = job.size;
    r.mem_per_byte = Some(comp.ideal_per_byte());
    r.host_mem_bytes = (comp.ideal_per_byte() * job.size as f64) as u64;
    r.codec_ratio = Some(comp.ratio());
    r.mem_details = serde_json::json!({
        "corpus_pages": ctx.env.corpus.len(),
        "compressed_bytes": comp.compressed_bytes,
        "ideal_bytes": comp.ideal_bytes,
    });
    Ok(r)
}

struct QueueOutcome {
    prefill: Option<crate::measure::WorkerStats>,
    stats: crate::measure::WorkerStats,
    written_pages: u64,
}

fn run_block(ctx: &mut Ctx, spec: &TargetSpec, job: &JobSpec, rep: u32) -> Result<RunResult> {
    let env = ctx.env;
    let mut target = start_block(env, spec, job.queues, job.size, ctx.seq)?;
    let conn = Conn::connect(target.socket(), job.queues, job.iodepth, job.bs, job.poll);
    let mut conn = match conn {
        Ok(c) => c,
        Err(e) => {
            target.daemon().check_alive()?;
            return Err(e);
        }
    };
    if conn.capacity < job.size {
        bail!(
            "{} reports {} bytes, job needs {}",
            spec.label(),
            conn.capacity,
            job.size
        );
    }
    let bufs = conn.buffers();
    let prefill_chunk = conn.prefill_chunk;
    let prefill = job.prefill && job.kind != JobKind::Fill;
    let nq = job.queues as usize;
    let after_prefill = Barrier::new(nq + 1);
    let go = Barrier::new(nq + 1);
    let window: OnceLock<Window> = OnceLock::new();
    let corpus = &env.corpus;
    let pid = target.daemon().pid();

    let mut mem_after_prefill = None;
    let mut prefill_wall = Duration::ZERO;
    let mut server_cpu = None;
    let mut outcomes = Vec::with_capacity(nq);
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = conn
            .queues
            .iter_mut()
            .enumerate()
            .map(|(i, q)| {
                let (after_prefill, go, window) = (&after_prefill, &go, &window);
                s.spawn(move || -> Result<QueueOutcome> {
                    let (start, len) = job.slice(i as u32);
                    let mut written = Bitmap::new(len);
                    let mut cfg = WorkerCfg {
                        queue_index: i as u32,
                        iodepth: crate::client::PREFILL_DEPTH,
                        corpus,
                        verify: false,
                        allow_zero: !prefill,
                        slice_start: start,
                        think: Duration::ZERO,
                    };
                    let pre = if prefill {
                        let w = Window::exhaust(Instant::now());
                        let g = OpGen::fill_once(start, len, prefill_chunk);
                        Some(run_queue(q, bufs, &cfg, g, w, &mut written))
                    } else {
                        None
                    };
                    // Always meet the barriers, even after an error, or the others hang.
                    after_prefill.wait();
                    go.wait();
                    let pre = pre.transpose().context("prefill")?;
                    cfg.iodepth = job.iodepth;
                    cfg.verify = job.verify;
                    cfg.think = Duration::from_micros(job.think_us);
                    let g = OpGen::for_job(job, i as u32, 0x5eed);
                    let stats = run_queue(q, bufs, &cfg, g, *window.get().unwrap(), &mut written)?;
                    Ok(QueueOutcome {
                        prefill: pre,
                        stats,
                        written_pages: written.count(),
                    })
                })
            })
            .collect();
        let t_prefill = Instant::now();
        after_prefill.wait();
        prefill_wall = t_prefill.elapsed();
        if prefill {
            mem_after_prefill = target.memory().ok().map(|m| m.host_bytes);
        }
        let start = Instant::now();
        let w = Window::for_job(job, start);
        window.set(w).unwrap();
        go.wait();
        // Sample the daemon's CPU (all its processes) over the same window the workers
        // measure.
        if let Some(end) = w.end {
            sleep_until(w.ramp_end);
            let c0 = tree_cpu(pid).ok();
            sleep_until(end);
            let c1 = tree_cpu(pid).ok();
            if let (Some(a), Some(b)) = (c0, c1) {
                server_cpu = Some((b.saturating_sub(a), end - w.ramp_end));
            }
        } else {
            let c0 = tree_cpu(pid).ok();
            let t0 = Instant::now();
            while !handles.iter().all(|h| h.is_finished()) {
                std::thread::sleep(Duration::from_millis(2));
            }
            if let (Some(a), Ok(b)) = (c0, tree_cpu(pid)) {
                server_cpu = Some((b.saturating_sub(a), t0.elapsed()));
            }
        }
        for h in handles {
            outcomes.push(h.join().map_err(|_| "client worker panicked")?);
        }
        Ok(())
    })?;
    let mut totals = Totals::default();
    let mut pre_totals = Totals::default();
    let mut written_pages = 0;
    let mut first_err = None;
    for o in outcomes {
        match o {
            Ok(o) => {
                totals.add(&o.stats);
                if let Some(p) = &o.prefill {
                    pre_totals.add(p);
                }
                written_pages += o.written_pages;
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        // A dead daemon explains a failed request better than the request does.
        target.daemon().check_alive()?;
        return Err(e);
    }
    let mut mem: Memory = target.memory()?;
    // Idle, connected, as a guest that stopped swapping: what the daemon
    // does in the background shows in the second measurement.
    let mut mem_at_end = None;
    if job.settle_s > 0.0 {
        mem_at_end = Some(mem.host_bytes);
        std::thread::sleep(Duration::from_secs_f64(job.settle_s));
        mem = target.memory()?;
    }
    drop(conn);
    let mut r = base_result(spec, job, rep, ctx, &totals);
    if let Some((cpu, wall)) = server_cpu {
        r.server_cpu_s = Some(cpu.as_secs_f64());
        r.server_cpu_pct = Some(100.0 * cpu.as_secs_f64() / wall.as_secs_f64().max(1e-9));
    }
    if prefill {
        r.prefill_s = Some(prefill_wall.as_secs_f64());
        r.prefill_mb_s = Some(pre_totals.bytes as f64 / prefill_wall.as_secs_f64().max(1e-9) / 1e6);
    }
    r.stored_bytes = written_pages * PAGE as u64;
    r.host_mem_bytes = mem.host_bytes;
    r.rss_bytes = mem.proc.rss;
    r.extra_mem_bytes = mem.extra_bytes;
    r.mem_after_prefill_bytes = mem_after_prefill;
    r.mem_at_end_bytes = mem_at_end;
    if r.stored_bytes > 0 {
        r.mem_per_byte = Some(mem.host_bytes as f64 / r.stored_bytes as f64);
    }
    // vzram's stat or zram's mm_stat numbers; other targets (and a failed stat)
    // have none.
    if let Some(sizes) = mem.stat_sizes {
        let (orig, compr) = (sizes.orig_data_size, sizes.compr_data_size);
        if orig > 0 && compr > 0 {
            r.codec_ratio = Some(orig as f64 / compr as f64);
        }
    }
    r.mem_details = serde_json::to_value(&mem)?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(kind: JobKind) -> JobSpec {
        JobSpec {
            kind,
            bs: 4096,
            iodepth: 1,
            queues: 1,
            size: 1 << 20,
            runtime_s: 1.0,
            ramp_s: 0.0,
            prefill: false,
            verify: false,
            poll: false,
            think_us: 0,
            settle_s: 0.0,
        }
    }

    #[test]
    fn skipped_targets_leave_the_plan() {
        let t = |s: &str| TargetSpec::parse(s, Algo::Lz4).unwrap();
        let plan: Plan = vec![
            (
                job(JobKind::Randread),
                vec![t("qsd"), t("host-zram"), t("vzram")],
            ),
            (job(JobKind::Fill), vec![t("host-zram")]),
        ];
        let skipped = vec![(t("host-zram"), "no zram".to_string())];
        let left = without(plan.clone(), &skipped).unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].1, vec![t("qsd"), t("vzram")]);
        assert_eq!(without(plan.clone(), &[]).unwrap().len(), 2);
        let only = vec![(job(JobKind::Fill), vec![t("host-zram")])];
        assert!(without(only, &skipped).is_err());
    }
}
