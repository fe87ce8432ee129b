//! `vzram stat` for people: tables of sizes and ratios.

use std::fmt::Write as _;

use serde_json::{json, Value};

/// Bytes in binary units, one decimal: `512 B`, `1.5 KiB`, `8.0 GiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

fn ratio(orig: u64, used: u64) -> String {
    if used == 0 {
        "-".into()
    } else {
        format!("{:.2}", orig as f64 / used as f64)
    }
}

/// Formats rows into left-aligned first column and right-aligned numbers.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut s = String::new();
        for (i, (c, w)) in cells.zip(&widths).enumerate() {
            if i == 0 {
                let _ = write!(s, "{c:<w$}");
            } else {
                let _ = write!(s, "  {c:>w$}");
            }
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for r in rows {
        line(&mut r.iter().map(String::as_str));
    }
    out
}

/// The human-readable form of a stat reply: zram's mm_stat and io_stat,
/// one row per device and one for the whole pool.
pub fn render(reply: &Value) -> String {
    let u = |v: &Value, k: &str| v[k].as_u64().unwrap_or(0);
    let empty = Vec::new();
    let devices = reply["devices"].as_array().unwrap_or(&empty);
    let pool = &reply["pool"];
    let limit = |n: u64| if n == 0 { "-".to_string() } else { human(n) };

    let mm_row = |name: String, s: &Value| {
        vec![
            name,
            human(u(s, "orig_data_size")),
            human(u(s, "compr_data_size")),
            human(u(s, "mem_used_total")),
            limit(u(s, "mem_limit")),
            human(u(s, "mem_used_max")),
            u(s, "same_pages").to_string(),
            u(s, "huge_pages").to_string(),
            u(s, "pages_compacted").to_string(),
            ratio(u(s, "orig_data_size"), u(s, "mem_used_total")),
        ]
    };
    let mut mm: Vec<Vec<String>> = devices
        .iter()
        .map(|d| mm_row(d["name"].as_str().unwrap_or("?").into(), &d["stats"]))
        .collect();
    mm.push(mm_row("(pool)".into(), pool));

    let io: Vec<Vec<String>> = devices
        .iter()
        .map(|d| {
            let s = &d["stats"];
            vec![
                d["name"].as_str().unwrap_or("?").to_string(),
                human(u(d, "size_bytes")),
                d["algo"].as_str().unwrap_or("?").to_string(),
                u(d, "queues").to_string(),
                if d["readonly"] == json!(true) {
                    "ro"
                } else {
                    "rw"
                }
                .to_string(),
                if d["connected"] == json!(true) {
                    "yes"
                } else {
                    "no"
                }
                .to_string(),
                u(s, "reads").to_string(),
                u(s, "writes").to_string(),
                u(s, "discards").to_string(),
                u(s, "failed_reads").to_string(),
                u(s, "failed_writes").to_string(),
            ]
        })
        .collect();

    let mut out = String::from("mm_stat\n");
    out += &table(
        &[
            "NAME",
            "ORIG_DATA",
            "COMPR_DATA",
            "MEM_USED",
            "MEM_LIMIT",
            "MEM_USED_MAX",
            "SAME_PAGES",
            "HUGE_PAGES",
            "COMPACTED",
            "RATIO",
        ],
        &mm,
    );
    out += "\nio_stat\n";
    out += &table(
        &[
            "NAME",
            "SIZE",
            "ALGO",
            "QUEUES",
            "MODE",
            "CONNECTED",
            "READS",
            "WRITES",
            "DISCARDS",
            "FAILED_READS",
            "FAILED_WRITES",
        ],
        &io,
    );
    // zram's bd_stat and the recompression counters, for the devices that
    // tier (a backing file, or pages recompressed).
    let tiering: Vec<&Value> = devices
        .iter()
        .filter(|d| !d["tier"]["backing"].is_null() || u(&d["stats"], "pages_recompressed") > 0)
        .collect();
    if !tiering.is_empty() {
        let rows: Vec<Vec<String>> = tiering
            .iter()
            .map(|d| {
                let s = &d["stats"];
                let b = &d["tier"]["backing"];
                let blocks = if b.is_null() {
                    "-".to_string()
                } else {
                    u(b, "blocks").to_string()
                };
                let direct = match b["direct_io"].as_bool() {
                    Some(true) => "yes",
                    Some(false) => "no",
                    None => "-",
                };
                vec![
                    d["name"].as_str().unwrap_or("?").to_string(),
                    blocks,
                    u(s, "backed_pages").to_string(),
                    direct.to_string(),
                    u(s, "backed_reads").to_string(),
                    u(s, "backed_writes").to_string(),
                    u(s, "spills").to_string(),
                    u(s, "pages_recompressed").to_string(),
                    human(u(s, "recompress_saved_bytes")),
                ]
            })
            .collect();
        out += "\nbd_stat\n";
        out += &table(
            &[
                "NAME",
                "BLOCKS",
                "USED",
                "DIRECT_IO",
                "BD_READS",
                "BD_WRITES",
                "SPILLS",
                "RECOMPRESSED",
                "RECOMP_SAVED",
            ],
            &rows,
        );
    }
    for d in devices {
        out += &format!(
            "\n{}: {}",
            d["name"].as_str().unwrap_or("?"),
            d["socket"].as_str().unwrap_or("?")
        );
        if let Some(path) = d["tier"]["backing"]["path"].as_str() {
            out += &format!(", backing file {path}");
        }
        if let Some(state) = d["state"].as_str() {
            out += &format!(", state {state} ({})", human(u(d, "state_bytes")));
        }
        let w = &d["worker"];
        if let Some(st) = w["state"].as_str() {
            out += &format!(", worker {st}");
            if let Some(pid) = w["pid"].as_u64() {
                out += &format!(" (pid {pid})");
            }
            if let Some(why) = w["last_failure"].as_str() {
                out += &format!(", {} failures, last: {why}", u(w, "failures"));
            }
        }
        let m = &d["migration"];
        match m["state"].as_str() {
            None | Some("none") => {}
            Some(st) => {
                out += &format!(
                    ", migration {st}: pass {}, {} in {} records",
                    u(m, "pass"),
                    human(u(m, "bytes")),
                    u(m, "records")
                );
                if st == "sending" {
                    out += &format!(", {} dirty slots", u(m, "dirty_slots"));
                }
                if let Some(e) = m["error"].as_str() {
                    out += &format!(", error: {e}");
                }
            }
        }
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(8 << 30), "8.0 GiB");
    }

    #[test]
    fn renders_a_table() {
        let reply = json!({
            "ok": true,
            "pool": {"orig_data_size": 8192, "compr_data_size": 100, "mem_used_total": 4096, "mem_limit": 0},
            "devices": [{"name": "vm1", "socket": "/tmp/vm1.sock", "size_bytes": 1u64 << 30, "algo": "lz4", "queues": 4,
                         "readonly": false, "connected": true,
                         "stats": {"orig_data_size": 8192, "compr_data_size": 100, "mem_used_total": 4096, "reads": 7, "writes": 2}}]
        });
        let t = render(&reply);
        assert!(t.contains("mm_stat") && t.contains("io_stat"), "{t}");
        let row = t.lines().find(|l| l.starts_with("vm1 ")).unwrap();
        assert!(row.contains("8.0 KiB") && row.contains("2.00"), "{row}");
        assert!(t.lines().any(|l| l.starts_with("(pool)")));
        assert!(t
            .lines()
            .any(|l| l.starts_with("vm1") && l.contains("1.0 GiB") && l.contains("yes")));
        assert!(!t.contains("bd_stat"), "no device tiers: {t}");
    }

    #[test]
    fn renders_tiering() {
        let reply = json!({
            "ok": true,
            "pool": {},
            "devices": [
                {"name": "vm1", "socket": "/s1", "stats": {"backed_pages": 12, "backed_reads": 3,
                  "backed_writes": 20, "spills": 2, "pages_recompressed": 5, "recompress_saved_bytes": 2048},
                 "tier": {"backing": {"path": "/var/vz/vm1.img", "blocks": 1000, "used_blocks": 12, "direct_io": true}}},
                {"name": "vm2", "socket": "/s2", "stats": {}, "tier": {"backing": null}}
            ]
        });
        let t = render(&reply);
        assert!(t.contains("bd_stat"), "{t}");
        let head = t
            .lines()
            .find(|l| l.starts_with("NAME") && l.contains("BD_READS"))
            .unwrap();
        assert!(
            head.contains("SPILLS") && head.contains("RECOMPRESSED"),
            "{head}"
        );
        let row: Vec<&str> = t
            .lines()
            .skip_while(|l| !l.starts_with("bd_stat"))
            .find(|l| l.starts_with("vm1 "))
            .unwrap()
            .split_whitespace()
            .collect();
        assert_eq!(
            row,
            ["vm1", "1000", "12", "yes", "3", "20", "2", "5", "2.0", "KiB"]
        );
        assert!(
            !t.lines()
                .skip_while(|l| !l.starts_with("bd_stat"))
                .any(|l| l.starts_with("vm2 ")),
            "vm2 does not tier: {t}"
        );
        assert!(t.contains("vm1: /s1, backing file /var/vz/vm1.img"), "{t}");
    }
}
