//! Results: the JSON record of a run, medians over repeats, and the markdown tables.

use crate::error::{Context, Result};
use crate::job::config_key;
use crate::units::{format_size, kilo};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

/// One run of one target; one JSON line each.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResult {
    /// "run" (other record kinds share the file: "density").
    pub record: String,
    pub target: String,
    pub target_kind: String,
    pub algo: Option<String>,
    pub job: String,
    pub bs: u64,
    pub iodepth: u32,
    pub queues: u32,
    /// `--think-us`: the wait after each completion (0 in older files).
    #[serde(default)]
    pub think_us: u64,
    pub size: u64,
    pub rep: u32,
    pub data: String,
    pub runtime_s: f64,
    pub ios: u64,
    pub reads: u64,
    pub writes: u64,
    pub iops: f64,
    /// Decimal megabytes (1e6 bytes) per second.
    pub mb_s: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_p999_us: f64,
    pub lat_mean_us: f64,
    pub lat_max_us: f64,
    pub client_cpu_s: f64,
    /// Percent of one CPU over the measured window.
    pub client_cpu_pct: f64,
    pub server_cpu_s: Option<f64>,
    pub server_cpu_pct: Option<f64>,
    /// Guest bytes written to the device (distinct 4 KiB pages).
    pub stored_bytes: u64,
    /// Host bytes the target costs (RSS, + tmpfs for qsd; ideal store for codec).
    pub host_mem_bytes: u64,
    /// host_mem_bytes / stored_bytes.
    pub mem_per_byte: Option<f64>,
    pub rss_bytes: u64,
    pub extra_mem_bytes: u64,
    pub mem_after_prefill_bytes: Option<u64>,
    /// With `--settle`: host bytes at the job's end; `host_mem_bytes` is then
    /// measured after the wait.
    #[serde(default)]
    pub mem_at_end_bytes: Option<u64>,
    pub prefill_s: Option<f64>,
    pub prefill_mb_s: Option<f64>,
    pub verify_errors: u64,
    /// Original / compressed bytes (codec: over the corpus; vzram: from its stats).
    pub codec_ratio: Option<f64>,
    pub mem_details: serde_json::Value,
    pub unix_time: u64,
    /// 1-minute load average when the run started: a noisy neighbour shows up here.
    #[serde(default)]
    pub load_1m: Option<f64>,
}

impl RunResult {
    /// Server CPU µs per request: its CPU share over the measured interval
    /// divided by the requests per second.
    pub fn server_cpu_us(&self) -> Option<f64> {
        self.server_cpu_pct
            .filter(|_| self.iops > 0.0)
            .map(|pct| pct * 1e4 / self.iops)
    }

    pub fn config_key(&self) -> String {
        config_key(&self.job, self.bs, self.iodepth, self.queues, self.think_us)
    }

    pub fn one_line(&self) -> String {
        let mem = self
            .mem_per_byte
            .map(|m| format!(", mem/data {m:.3}"))
            .unwrap_or_default();
        let load = self
            .load_1m
            .map(|l| format!(", load {l:.1}"))
            .unwrap_or_default();
        format!(
            "{} IOPS, {:.0} MB/s, p50 {:.1} p99 {:.1} µs, client CPU {:.0}%{}{mem}{load}",
            kilo(self.iops),
            self.mb_s,
            self.lat_p50_us,
            self.lat_p99_us,
            self.client_cpu_pct,
            self.server_cpu_pct
                .map(|s| format!(", server CPU {s:.0}%"))
                .unwrap_or_default()
        )
    }
}

pub struct JsonOut(File);

impl JsonOut {
    pub fn open(path: &Path) -> Result<Self> {
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .context(format!("opening {}", path.display()))?;
        Ok(JsonOut(f))
    }

    pub fn write<T: Serialize>(&mut self, v: &T) -> Result<()> {
        let mut line = serde_json::to_string(v)?;
        line.push('\n');
        self.0.write_all(line.as_bytes())?;
        Ok(())
    }
}

/// The "run" records of a --json file (other records are skipped).
pub fn load(path: &Path) -> Result<Vec<RunResult>> {
    let f = File::open(path).context(format!("opening {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in BufReader::new(f).lines().enumerate() {
        let line = line?;
        let v: serde_json::Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => crate::error::bail!("{}:{}: {e}", path.display(), n + 1),
        };
        if v.get("record").and_then(|r| r.as_str()) == Some("run") {
            out.push(serde_json::from_value(v).context(format!("{}:{}", path.display(), n + 1))?);
        }
    }
    Ok(out)
}

pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Medians of the repeats of one (target, configuration).
#[derive(Clone, Debug)]
pub struct Summary {
    pub target: String,
    pub target_kind: String,
    pub algo: Option<String>,
    pub job: String,
    pub bs: u64,
    pub iodepth: u32,
    pub queues: u32,
    pub think_us: u64,
    pub n: usize,
    pub iops: f64,
    pub mb_s: f64,
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub client_cpu_pct: f64,
    pub server_cpu_pct: Option<f64>,
    /// The daemon's CPU time (all its processes and threads) per request, µs.
    pub server_cpu_us: Option<f64>,
    pub mem_per_byte: Option<f64>,
    /// With `--settle`: host memory per guest byte at the job's end, before the wait.
    pub mem_at_end_per_byte: Option<f64>,
    /// The client's CPU time per request, µs: for the codec target, the
    /// codec's own time.
    pub client_cpu_us: f64,
    /// The 1-minute load average when the repeats started.
    pub load_1m: Option<f64>,
}

impl Summary {
    pub fn config_key(&self) -> String {
        config_key(&self.job, self.bs, self.iodepth, self.queues, self.think_us)
    }

    /// 4 KiB pages per request (at least 1).
    fn pages(&self) -> f64 {
        (self.bs as f64 / 4096.0).max(1.0)
    }
}

fn opt_median(v: Vec<Option<f64>>) -> Option<f64> {
    let v: Vec<f64> = v.into_iter().flatten().collect();
    (!v.is_empty()).then(|| median(v))
}

/// Group by (target, config) in first-seen order and take medians.
pub fn summarize(results: &[RunResult]) -> Vec<Summary> {
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in results {
        let k = (r.target.clone(), r.config_key());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.into_iter()
        .map(|(t, c)| {
            let rs: Vec<&RunResult> = results
                .iter()
                .filter(|r| r.target == t && r.config_key() == c)
                .collect();
            let f = |g: fn(&RunResult) -> f64| median(rs.iter().map(|r| g(r)).collect());
            let r0 = rs[0];
            Summary {
                target: t,
                target_kind: r0.target_kind.clone(),
                algo: r0.algo.clone(),
                job: r0.job.clone(),
                bs: r0.bs,
                iodepth: r0.iodepth,
                queues: r0.queues,
                think_us: r0.think_us,
                n: rs.len(),
                iops: f(|r| r.iops),
                mb_s: f(|r| r.mb_s),
                p50: f(|r| r.lat_p50_us),
                p99: f(|r| r.lat_p99_us),
                p999: f(|r| r.lat_p999_us),
                client_cpu_pct: f(|r| r.client_cpu_pct),
                server_cpu_pct: opt_median(rs.iter().map(|r| r.server_cpu_pct).collect()),
                server_cpu_us: opt_median(rs.iter().map(|r| r.server_cpu_us()).collect()),
                mem_per_byte: opt_median(rs.iter().map(|r| r.mem_per_byte).collect()),
                mem_at_end_per_byte: opt_median(
                    rs.iter()
                        .map(|r| {
                            r.mem_at_end_bytes
                                .filter(|_| r.stored_bytes > 0)
                                .map(|m| m as f64 / r.stored_bytes as f64)
                        })
                        .collect(),
                ),
                client_cpu_us: f(|r| {
                    if r.iops > 0.0 {
                        r.client_cpu_pct * 1e4 / r.iops
                    } else {
                        f64::NAN
                    }
                }),
                load_1m: opt_median(rs.iter().map(|r| r.load_1m).collect()),
            }
        })
        .collect()
}

fn us(x: f64) -> String {
    if x >= 1000.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

/// The main table: one row per (target, config), medians over repeats.
pub fn print_table(results: &[RunResult]) {
    let s = summarize(results);
    if s.is_empty() {
        return;
    }
    println!(
        "| target | job | bs | qd | queues | IOPS | MB/s | p50 µs | p99 µs | p99.9 µs | client CPU | server CPU | server CPU µs/req | host mem / guest byte | n |"
    );
    println!("|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &s {
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.0} | {} | {} | {} | {:.0}% | {} | {} | {} | {} |",
            r.target,
            r.job,
            format_size(r.bs),
            r.iodepth,
            r.queues,
            kilo(r.iops),
            r.mb_s,
            us(r.p50),
            us(r.p99),
            us(r.p999),
            r.client_cpu_pct,
            r.server_cpu_pct
                .map(|c| format!("{c:.0}%"))
                .unwrap_or("-".into()),
            r.server_cpu_us
                .map(|c| format!("{c:.2}"))
                .unwrap_or("-".into()),
            match (r.mem_per_byte, r.mem_at_end_per_byte) {
                (Some(m), Some(e)) => format!("{m:.3} (at the end {e:.3})"),
                (Some(m), None) => format!("{m:.3}"),
                _ => "-".into(),
            },
            r.n
        );
    }
    println!();
    print_ratios(results, &s);
    print_before_after(results, &s);
    let cpu = cpu_rows(&s);
    if !cpu.is_empty() {
        println!(
            "CPU per 4 KiB page: each server's CPU (all its threads) against the codec's own \
             time on the same pages, one thread, in the same run. This moves much less from \
             one machine to another than the IOPS ratios:\n"
        );
        println!("| config | target | server CPU µs/page | codec µs/page | server − codec µs | load (1 min) |");
        println!("|---|---|---:|---:|---:|---:|");
        for r in cpu {
            println!("{r}");
        }
        println!();
    }
}

/// One row per server run with a CPU figure: its CPU per page, the codec's
/// time per page for the same algorithm and job (compress for writes,
/// decompress for reads), and their difference: what is not the codec.
fn cpu_rows(s: &[Summary]) -> Vec<String> {
    let servers = ["vzram", "vzram-base", "qsd", "host-zram"];
    let mut rows = Vec::new();
    for x in s
        .iter()
        .filter(|x| servers.contains(&x.target_kind.as_str()))
    {
        let Some(cpu) = x.server_cpu_us else {
            continue;
        };
        let per_page = cpu / x.pages();
        // qsd stores pages as they are; host zram's lz4 is the kernel's.
        let codec = x
            .algo
            .as_ref()
            .filter(|_| x.target_kind != "qsd")
            .and_then(|a| {
                let label = format!("codec/{a}");
                s.iter()
                    .find(|c| c.target == label && c.config_key() == x.config_key())
            })
            .map(|c| c.client_cpu_us / c.pages())
            .filter(|c| c.is_finite());
        rows.push(format!(
            "| {} | {} | {:.2} | {} | {} | {} |",
            x.config_key(),
            x.target,
            per_page,
            codec.map_or("-".into(), |c| format!("{c:.2}")),
            codec.map_or("-".into(), |c| format!("{:+.2}", per_page - c)),
            x.load_1m.map_or("-".into(), |l| format!("{l:.2}")),
        ));
    }
    rows
}

/// `vzram/A` against `vzram-base/A` (another build), per configuration: IOPS ratios
/// per repeat (paired by repeat index, same run), and the ratios of the medians of
/// latency, CPU and memory. Above 1 means the `vzram` build has more of it.
fn print_before_after(results: &[RunResult], s: &[Summary]) {
    let mut rows = Vec::new();
    for base in s.iter().filter(|x| x.target_kind == "vzram-base") {
        let Some(algo) = base.target.strip_prefix("vzram-base/") else {
            continue;
        };
        let target = format!("vzram/{algo}");
        let cfg = base.config_key();
        let Some(new) = s
            .iter()
            .find(|x| x.target == target && x.config_key() == cfg)
        else {
            continue;
        };
        let per_rep: Vec<f64> = results
            .iter()
            .filter(|r| r.target == target && r.config_key() == cfg)
            .filter_map(|r| {
                results
                    .iter()
                    .find(|b| b.target == base.target && b.config_key() == cfg && b.rep == r.rep)
                    .map(|b| r.iops / b.iops)
            })
            .collect();
        if per_rep.is_empty() {
            continue;
        }
        let lo = per_rep.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = per_rep.iter().cloned().fold(0.0, f64::max);
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.3}×", a / b),
            _ => "-".into(),
        };
        rows.push(format!(
            "| {cfg} | {target} | {} | {} | {:.3}× ({lo:.2}–{hi:.2}) | {} | {} | {} | {} |",
            kilo(base.iops),
            kilo(new.iops),
            median(per_rep.clone()),
            ratio(Some(new.p50), Some(base.p50)),
            ratio(Some(new.p99), Some(base.p99)),
            ratio(new.server_cpu_us, base.server_cpu_us),
            ratio(new.mem_per_byte, base.mem_per_byte),
        ));
    }
    if rows.is_empty() {
        return;
    }
    println!("vzram against vzram-base (--vzram-base-bin), same run, interleaved:\n");
    println!("| config | target | base IOPS | IOPS | IOPS / base (median, min–max of runs) | p50 / base | p99 / base | server CPU per request / base | memory / base |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        println!("{r}");
    }
    println!();
}

/// The compressed targets against qsd and the codec; vzram against host-zram (the
/// kernel's zram) when it ran.
fn print_ratios(results: &[RunResult], s: &[Summary]) {
    let qsd = ratio_rows(results, s, "qsd", &["vzram", "host-zram"], true);
    if !qsd.is_empty() {
        print_ratio_table("qsd", true, &qsd);
    }
    let zram = ratio_rows(results, s, "host-zram", &["vzram"], false);
    if !zram.is_empty() {
        println!(
            "vzram against host-zram (kernel zram, lz4, behind qemu-storage-daemon), same run, \
             interleaved:\n"
        );
        print_ratio_table("host-zram", false, &zram);
    }
}

fn print_ratio_table(base: &str, with_codec: bool, rows: &[String]) {
    let codec = if with_codec { " MB/s vs codec |" } else { "" };
    println!(
        "| config | target | IOPS vs {base} (median, min–max of runs) | p50 vs {base} | \
         p99 vs {base} | server CPU/req vs {base} | memory vs {base} |{codec}"
    );
    let codec = if with_codec { "---:|" } else { "" };
    println!("|---|---|---:|---:|---:|---:|---:|{codec}");
    for r in rows {
        println!("{r}");
    }
    println!();
}

/// One row per (configuration, target of a kind in `kinds`): IOPS against the
/// `base` kind's run of the same repeat (then the median), medians' ratios of the
/// rest, and MB/s against the codec of the same algorithm when `with_codec`. No
/// rows when neither `base` nor (with_codec) a codec ran.
fn ratio_rows(
    results: &[RunResult],
    s: &[Summary],
    base: &str,
    kinds: &[&str],
    with_codec: bool,
) -> Vec<String> {
    let has = |kind: &str| s.iter().any(|x| x.target_kind == kind);
    if !(has(base) || (with_codec && has("codec"))) {
        return Vec::new();
    }
    let mut rows = Vec::new();
    let mut configs: Vec<String> = Vec::new();
    for x in s {
        if !configs.contains(&x.config_key()) {
            configs.push(x.config_key());
        }
    }
    for cfg in &configs {
        let here = |x: &&Summary| x.config_key() == *cfg;
        let bs = s.iter().filter(here).find(|x| x.target_kind == base);
        for vs in s
            .iter()
            .filter(here)
            .filter(|x| kinds.contains(&x.target_kind.as_str()))
        {
            // Per-repeat ratios against the base, paired by repeat index.
            let per_rep: Vec<f64> = results
                .iter()
                .filter(|r| r.target == vs.target && r.config_key() == *cfg)
                .filter_map(|r| {
                    results
                        .iter()
                        .find(|q| q.target_kind == base && q.config_key() == *cfg && q.rep == r.rep)
                        .map(|q| r.iops / q.iops)
                })
                .collect();
            let iops = if per_rep.is_empty() {
                "-".to_string()
            } else {
                let lo = per_rep.iter().cloned().fold(f64::INFINITY, f64::min);
                let hi = per_rep.iter().cloned().fold(0.0, f64::max);
                format!("{:.2}× ({:.2}–{:.2})", median(per_rep.clone()), lo, hi)
            };
            let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) => format!("{:.2}×", a / b),
                _ => "-".into(),
            };
            let p50 = ratio(Some(vs.p50), bs.map(|b| b.p50));
            let p99 = ratio(Some(vs.p99), bs.map(|b| b.p99));
            let cpu = ratio(vs.server_cpu_us, bs.and_then(|b| b.server_cpu_us));
            let mem = ratio(vs.mem_per_byte, bs.and_then(|b| b.mem_per_byte));
            let mut row = format!(
                "| {cfg} | {} | {iops} | {p50} | {p99} | {cpu} | {mem} |",
                vs.target
            );
            if with_codec {
                let codec = vs.algo.as_ref().and_then(|a| {
                    let label = format!("codec/{a}");
                    s.iter().filter(here).find(|x| x.target == label)
                });
                let c = ratio(Some(vs.mb_s), codec.map(|c| c.mb_s));
                row.push_str(&format!(" {c} |"));
            }
            rows.push(row);
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(vec![]).is_nan());
    }

    /// A 4K randread result of `target` with `iops` and memory per byte `mem`.
    fn run(target: &str, rep: u32, iops: f64, mem: f64) -> RunResult {
        let kind = target.split('/').next().unwrap();
        let algo = match kind {
            "qsd" => None,
            "host-zram" => Some("lz4".to_string()),
            _ => target.split('/').nth(1).map(str::to_string),
        };
        RunResult {
            record: "run".into(),
            target: target.into(),
            target_kind: kind.into(),
            algo,
            job: "randread".into(),
            bs: 4096,
            iodepth: 32,
            queues: 1,
            think_us: 0,
            size: 1 << 30,
            rep,
            data: "synthetic".into(),
            runtime_s: 5.0,
            ios: 0,
            reads: 0,
            writes: 0,
            iops,
            mb_s: iops * 4096.0 / 1e6,
            lat_p50_us: 1e6 / iops,
            lat_p99_us: 2e6 / iops,
            lat_p999_us: 3e6 / iops,
            lat_mean_us: 1e6 / iops,
            lat_max_us: 4e6 / iops,
            client_cpu_s: 1.0,
            client_cpu_pct: 20.0,
            server_cpu_s: Some(5.0),
            server_cpu_pct: Some(100.0),
            stored_bytes: 1 << 30,
            host_mem_bytes: (mem * (1u64 << 30) as f64) as u64,
            mem_per_byte: Some(mem),
            rss_bytes: 0,
            extra_mem_bytes: 0,
            mem_after_prefill_bytes: None,
            mem_at_end_bytes: None,
            prefill_s: None,
            prefill_mb_s: None,
            verify_errors: 0,
            codec_ratio: None,
            mem_details: serde_json::Value::Null,
            unix_time: 0,
            load_1m: None,
        }
    }

    #[test]
    fn ratios_against_qsd_and_host_zram() {
        let mut rs = Vec::new();
        for rep in 0..3 {
            let f = 1.0 + rep as f64 / 10.0;
            rs.push(run("qsd", rep, 100e3 * f, 1.0));
            rs.push(run("host-zram", rep, 50e3 * f, 0.4));
            rs.push(run("vzram/lz4", rep, 200e3 * f, 0.3));
        }
        let s = summarize(&rs);
        assert_eq!(s[1].algo.as_deref(), Some("lz4"));
        let qsd = ratio_rows(&rs, &s, "qsd", &["vzram", "host-zram"], true);
        assert_eq!(qsd.len(), 2);
        assert!(
            qsd[0].starts_with("| randread 4K qd32 q1 | host-zram | 0.50× (0.50–0.50) | 2.00× |"),
            "{}",
            qsd[0]
        );
        assert!(qsd[0].ends_with("| 0.40× | - |"), "{}", qsd[0]);
        assert!(
            qsd[1].contains("| vzram/lz4 | 2.00× (2.00–2.00) | 0.50× | 0.50× |"),
            "{}",
            qsd[1]
        );
        let zram = ratio_rows(&rs, &s, "host-zram", &["vzram"], false);
        assert_eq!(zram.len(), 1);
        assert!(
            zram[0].contains("| vzram/lz4 | 4.00× (4.00–4.00) | 0.25× | 0.25× |"),
            "{}",
            zram[0]
        );
        assert!(zram[0].ends_with("| 0.75× |"), "{}", zram[0]);
        // No host-zram in the run: no such table; no qsd nor codec: no qsd table.
        let no_zram: Vec<RunResult> = rs
            .iter()
            .filter(|r| r.target != "host-zram")
            .cloned()
            .collect();
        assert!(ratio_rows(
            &no_zram,
            &summarize(&no_zram),
            "host-zram",
            &["vzram"],
            false
        )
        .is_empty());
        let no_qsd: Vec<RunResult> = rs.iter().filter(|r| r.target != "qsd").cloned().collect();
        assert!(ratio_rows(&no_qsd, &summarize(&no_qsd), "qsd", &["vzram"], true).is_empty());
    }

    #[test]
    fn cpu_per_page_against_the_codec() {
        let mut rs = Vec::new();
        for rep in 0..3 {
            let mut q = run("qsd", rep, 100e3, 1.0);
            q.server_cpu_pct = Some(60.0);
            q.bs = 32768;
            q.load_1m = Some(0.25);
            rs.push(q);
            let mut v = run("vzram/lz4", rep, 100e3, 0.3);
            v.server_cpu_pct = Some(200.0);
            v.bs = 32768;
            rs.push(v);
            // The codec: one thread at 100% doing 50k 32K requests a second.
            let mut c = run("codec/lz4", rep, 50e3, 0.3);
            c.target_kind = "codec".into();
            c.server_cpu_pct = None;
            c.client_cpu_pct = 100.0;
            c.bs = 32768;
            rs.push(c);
        }
        let rows = cpu_rows(&summarize(&rs));
        assert_eq!(rows.len(), 2, "{rows:?}");
        // qsd: 60% of a CPU over 100k req/s = 6 µs a request, 0.75 µs a page.
        assert_eq!(
            rows[0],
            "| randread 32K qd32 q1 | qsd | 0.75 | - | - | 0.25 |"
        );
        // vzram: 20 µs a request, 2.5 a page; the codec 20 µs per 8 pages.
        assert_eq!(
            rows[1],
            "| randread 32K qd32 q1 | vzram/lz4 | 2.50 | 2.50 | +0.00 | - |"
        );
    }
}
