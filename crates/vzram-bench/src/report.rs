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
}

impl Summary {
    pub fn config_key(&self) -> String {
        config_key(&self.job, self.bs, self.iodepth, self.queues, self.think_us)
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
            r.mem_per_byte
                .map(|m| format!("{m:.3}"))
                .unwrap_or("-".into()),
            r.n
        );
    }
    println!();
    print_ratios(results, &s);
    print_before_after(results, &s);
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

/// vzram against qsd (per repeat, same run, then the median) and against the codec.
fn print_ratios(results: &[RunResult], s: &[Summary]) {
    let vz: Vec<String> = {
        let mut v: Vec<String> = s
            .iter()
            .filter(|x| x.target_kind == "vzram")
            .map(|x| x.target.clone())
            .collect();
        v.dedup();
        v
    };
    if vz.is_empty() {
        return;
    }
    let mut rows = Vec::new();
    let configs: Vec<String> = {
        let mut c: Vec<String> = Vec::new();
        for x in s {
            if !c.contains(&x.config_key()) {
                c.push(x.config_key());
            }
        }
        c
    };
    for cfg in &configs {
        for v in &vz {
            let find = |kind: &str, target: Option<&str>| {
                s.iter().find(|x| {
                    x.config_key() == *cfg
                        && x.target_kind == kind
                        && target.is_none_or(|t| x.target == t)
                })
            };
            let Some(vs) = find("vzram", Some(v)) else {
                continue;
            };
            // Per-repeat ratios against qsd, paired by repeat index.
            let per_rep: Vec<f64> = results
                .iter()
                .filter(|r| r.target == *v && r.config_key() == *cfg)
                .filter_map(|r| {
                    results
                        .iter()
                        .find(|q| {
                            q.target_kind == "qsd" && q.config_key() == *cfg && q.rep == r.rep
                        })
                        .map(|q| r.iops / q.iops)
                })
                .collect();
            let qs = find("qsd", None);
            let codec = vs
                .target
                .strip_prefix("vzram/")
                .and_then(|a| find("codec", Some(&format!("codec/{a}"))));
            let iops = if per_rep.is_empty() {
                "-".to_string()
            } else {
                let lo = per_rep.iter().cloned().fold(f64::INFINITY, f64::min);
                let hi = per_rep.iter().cloned().fold(0.0, f64::max);
                format!("{:.2}× ({:.2}–{:.2})", median(per_rep.clone()), lo, hi)
            };
            let p99 = qs
                .map(|q| format!("{:.2}×", vs.p99 / q.p99))
                .unwrap_or("-".into());
            let p50 = qs
                .map(|q| format!("{:.2}×", vs.p50 / q.p50))
                .unwrap_or("-".into());
            let cpu = match (qs.and_then(|q| q.server_cpu_us), vs.server_cpu_us) {
                (Some(q), Some(v)) => format!("{:.2}×", v / q),
                _ => "-".into(),
            };
            let mem = match (qs.and_then(|q| q.mem_per_byte), vs.mem_per_byte) {
                (Some(q), Some(v)) => format!("{:.2}×", v / q),
                _ => "-".into(),
            };
            let vs_codec = codec
                .map(|c| format!("{:.2}×", vs.mb_s / c.mb_s))
                .unwrap_or("-".into());
            rows.push(format!(
                "| {cfg} | {v} | {iops} | {p50} | {p99} | {cpu} | {mem} | {vs_codec} |"
            ));
        }
    }
    if rows.is_empty() {
        return;
    }
    println!("| config | target | IOPS vs qsd (median, min–max of runs) | p50 vs qsd | p99 vs qsd | server CPU/req vs qsd | memory vs qsd | MB/s vs codec |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        println!("{r}");
    }
    println!();
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
}
