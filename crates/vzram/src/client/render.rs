//! `vzram stat` for people: tables of sizes and ratios.

use std::fmt::Write as _;

use crate::cli::Column;
use crate::proto::control::{DeviceStat, MigrationState, StatReply};

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

/// The bytes of `orig` held in memory: pages written back to the backing
/// file take none of the pool, and are no memory saved by compression.
fn in_memory(orig: u64, backed_pages: u64) -> u64 {
    orig.saturating_sub(backed_pages * 4096)
}

fn ratio(orig: u64, used: u64) -> String {
    if used == 0 {
        "-".into()
    } else {
        format!("{:.2}", orig as f64 / used as f64)
    }
}

/// How `vzram stat` prints, as zramctl's options say: sizes in bytes
/// (`--bytes`), no header lines (`--noheadings`), cells one space apart
/// with no padding (`--raw`).
#[derive(Debug, Clone, Copy)]
pub struct Style {
    pub bytes: bool,
    pub headings: bool,
    pub raw: bool,
}

impl Style {
    /// A size cell: bytes, or binary units (with no space when raw, so a
    /// cell stays one word).
    fn size(&self, n: u64) -> String {
        if self.bytes {
            n.to_string()
        } else if self.raw {
            human(n).replace(' ', "")
        } else {
            human(n)
        }
    }
}

impl Style {
    /// The default: aligned, with headers, sizes in binary units.
    #[cfg(test)]
    pub fn for_people() -> Style {
        Style {
            bytes: false,
            headings: true,
            raw: false,
        }
    }
}

/// Rows as `style` says; aligned: a left-aligned first column and
/// right-aligned numbers.
fn table_in(style: Style, header: &[&str], rows: &[Vec<String>]) -> String {
    if style.raw {
        let mut out = String::new();
        let lines = style
            .headings
            .then_some(header.iter().map(|h| h.to_string()).collect::<Vec<_>>());
        for r in lines.iter().chain(rows) {
            let cells: Vec<String> = r
                .iter()
                .map(|c| {
                    if c.is_empty() {
                        "-".into()
                    } else {
                        c.replace(' ', "_")
                    }
                })
                .collect();
            out += &cells.join(" ");
            out.push('\n');
        }
        return out;
    }
    let cols = rows
        .iter()
        .map(Vec::len)
        .chain([header.len()])
        .max()
        .unwrap_or(0);
    let mut widths: Vec<usize> = (0..cols)
        .map(|i| header.get(i).map_or(0, |h| h.len()))
        .collect();
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
    if style.headings {
        line(&mut header.iter().copied());
    }
    for r in rows {
        line(&mut r.iter().map(String::as_str));
    }
    out
}

/// The human-readable form of a stat reply: zram's mm_stat and io_stat,
/// one row per device and one for the whole pool.
pub fn render(reply: &StatReply, style: Style) -> String {
    let devices = &reply.devices;
    let pool = &reply.pool;
    let limit = |n: u64| {
        if n == 0 {
            "-".to_string()
        } else {
            style.size(n)
        }
    };

    // orig, compr, used, limit, max, same, huge, compacted, backed; RATIO
    // is what memory holds over the memory it takes.
    let mm_row =
        |name: &str, [orig, compr, used, lim, max, same, huge, compacted, backed]: [u64; 9]| {
            vec![
                name.to_string(),
                style.size(orig),
                style.size(compr),
                style.size(used),
                limit(lim),
                style.size(max),
                same.to_string(),
                huge.to_string(),
                compacted.to_string(),
                ratio(in_memory(orig, backed), used),
            ]
        };
    let mut mm: Vec<Vec<String>> = devices
        .iter()
        .map(|d| {
            let s = &d.stats;
            mm_row(
                &d.name,
                [
                    s.orig_data_size,
                    s.compr_data_size,
                    s.mem_used_total,
                    s.mem_limit,
                    s.mem_used_max,
                    s.same_pages,
                    s.huge_pages,
                    s.pages_compacted,
                    s.backed_pages,
                ],
            )
        })
        .collect();
    mm.push(mm_row(
        "(pool)",
        [
            pool.orig_data_size,
            pool.compr_data_size,
            pool.mem_used_total,
            pool.mem_limit,
            pool.mem_used_max,
            pool.same_pages,
            pool.huge_pages,
            pool.pages_compacted,
            devices.iter().map(|d| d.stats.backed_pages).sum(),
        ],
    ));

    let io: Vec<Vec<String>> = devices
        .iter()
        .map(|d| {
            let s = &d.stats;
            vec![
                d.name.clone(),
                style.size(d.size_bytes),
                d.algo.to_string(),
                d.queues.to_string(),
                if d.readonly { "ro" } else { "rw" }.to_string(),
                if d.connected { "yes" } else { "no" }.to_string(),
                s.reads.to_string(),
                s.writes.to_string(),
                s.discards.to_string(),
                s.failed_reads.to_string(),
                s.failed_writes.to_string(),
            ]
        })
        .collect();

    if !style.headings || style.raw {
        // For scripts: the rows alone (`-o` picks columns of one table).
        let mut out = table_in(style, &[], &mm);
        out += &table_in(style, &[], &io);
        return out;
    }
    let mut out = String::from("mm_stat\n");
    out += &table_in(
        style,
        &[
            "NAME",
            "ORIG_DATA",
            "COMPR_DATA",
            "MEM_USED",
            "MEM_LIMIT",
            "MEM_USED_MAX",
            "SAME_PAGES",
            "HUGE_PAGES",
            "COMPACTED_PAGES",
            "RATIO",
        ],
        &mm,
    );
    out += "\nio_stat\n";
    out += &table_in(
        style,
        &[
            "NAME",
            "SIZE",
            "ALGO",
            "QUEUES",
            "MODE",
            "CONNECTED",
            "READ_PAGES",
            "WRITE_PAGES",
            "DISCARD_PAGES",
            "FAILED_READ_PAGES",
            "FAILED_WRITE_PAGES",
        ],
        &io,
    );
    // zram's bd_stat and the recompression counters, for the devices that
    // tier (a backing file, or pages recompressed).
    let tiering: Vec<&DeviceStat> = devices
        .iter()
        .filter(|d| d.tier.backing.is_some() || d.stats.pages_recompressed > 0)
        .collect();
    if !tiering.is_empty() {
        let rows: Vec<Vec<String>> = tiering
            .iter()
            .map(|d| {
                let s = &d.stats;
                let b = d.tier.backing.as_ref();
                vec![
                    d.name.clone(),
                    b.map_or("-".to_string(), |b| b.blocks.to_string()),
                    s.backed_pages.to_string(),
                    match b.map(|b| b.direct_io) {
                        Some(true) => "yes",
                        Some(false) => "no",
                        None => "-",
                    }
                    .to_string(),
                    s.backed_reads.to_string(),
                    s.backed_writes.to_string(),
                    s.spills.to_string(),
                    s.pages_recompressed.to_string(),
                    style.size(s.recompress_saved_bytes),
                ]
            })
            .collect();
        out += "\nbd_stat\n";
        out += &table_in(
            style,
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
    // Raw staging, for the devices that staged pages: what waits to be
    // compressed, what the compress threads did, how long pages waited.
    let staging: Vec<&DeviceStat> = devices
        .iter()
        .filter(|d| d.stats.staged_bytes > 0 || d.stats.staged_compressed > 0)
        .collect();
    if !staging.is_empty() {
        let ms = |us: u64| format!("{:.1}ms", us as f64 / 1000.0);
        let row = |name: &str, s: [u64; 4]| {
            vec![
                name.to_string(),
                style.size(s[0]),
                s[1].to_string(),
                ms(s[2] / s[1].max(1)),
                ms(s[3]),
            ]
        };
        let mut rows: Vec<Vec<String>> = staging
            .iter()
            .map(|d| {
                let s = &d.stats;
                row(
                    &d.name,
                    [
                        s.staged_bytes,
                        s.staged_compressed,
                        s.staged_wait_micros,
                        s.staged_wait_max_micros,
                    ],
                )
            })
            .collect();
        rows.push(row(
            "(pool)",
            [
                pool.staged_bytes,
                pool.staged_compressed,
                pool.staged_wait_micros,
                pool.staged_wait_max_micros,
            ],
        ));
        out += "\nstaging\n";
        out += &table_in(
            style,
            &["NAME", "STAGED", "COMPRESSED", "WAIT_AVG", "WAIT_MAX"],
            &rows,
        );
        // What the host's budget holds, beside what the devices count: a
        // difference that stays is room no device can use.
        let _ = writeln!(
            out,
            "host staging budget: {}, {} held",
            match pool.staging_limit {
                0 => "off".to_string(),
                b => style.size(b),
            },
            style.size(pool.staging_used)
        );
    }
    for d in devices {
        let _ = write!(out, "\n{}: {}", d.name, d.socket.display());
        if let Some(b) = &d.tier.backing {
            let _ = write!(out, ", backing file {}", b.path.display());
        }
        let _ = write!(
            out,
            ", state {} ({})",
            d.state.display(),
            style.size(d.state_bytes)
        );
        if d.state_damaged {
            out += ", STATE DAMAGED (a state file lost its pages; restart the daemon)";
        }
        let w = &d.worker;
        let _ = write!(out, ", worker {}", w.state.name());
        if let Some(pid) = w.pid {
            let _ = write!(out, " (pid {pid})");
        }
        if let Some(why) = &w.last_failure {
            let _ = write!(out, ", {} failures, last: {why}", w.failures);
        }
        let m = &d.migration;
        if m.state != MigrationState::None {
            let st = m.state.name();
            let _ = write!(
                out,
                ", migration {st}: pass {}, {} in {} records",
                m.pass,
                style.size(m.bytes),
                m.records
            );
            if m.state == MigrationState::Sending {
                let _ = write!(out, ", {} dirty slots", m.dirty_slots);
            }
            if let Some(e) = &m.error {
                let _ = write!(out, ", error: {e}");
            }
        }
    }
    out.push('\n');
    if !reply.state_dir.as_os_str().is_empty() {
        let _ = writeln!(out, "\nstate dir: {}", reply.state_dir.display());
    }
    if !reply.leftovers.is_empty() {
        out += "\nleft-over states (no device serves them; each is served again or deleted by the commands below it)\n";
        let rows: Vec<Vec<String>> = reply
            .leftovers
            .iter()
            .map(|l| {
                vec![
                    l.name.clone(),
                    style.size(l.size_bytes),
                    style.size(l.state_bytes),
                    l.socket
                        .as_ref()
                        .map_or("(not recorded)".to_string(), |s| s.display().to_string()),
                    l.dir.display().to_string(),
                ]
            })
            .collect();
        out += &table_in(
            style,
            &["NAME", "SIZE", "MEM_HELD", "MADE_FOR", "STATE"],
            &rows,
        );
        for l in &reply.leftovers {
            let serve = match &l.socket {
                Some(s) => format!(
                    "`{}` serves it, ",
                    crate::proto::control::recover_command(&l.name, s, l.size_bytes)
                ),
                None => String::new(),
            };
            let _ = writeln!(
                out,
                "{}: {serve}`vzram forget {}` deletes it",
                l.name, l.name
            );
        }
    }
    out
}

/// Device `d`'s cell in column `col`.
fn cell(col: Column, d: &DeviceStat, style: Style) -> String {
    let s = &d.stats;
    match col {
        Column::Name => d.name.clone(),
        Column::Size => style.size(d.size_bytes),
        Column::Algo => d.algo.to_string(),
        Column::Queues => d.queues.to_string(),
        Column::Mode => if d.readonly { "ro" } else { "rw" }.into(),
        Column::Connected => if d.connected { "yes" } else { "no" }.into(),
        Column::OrigData => style.size(s.orig_data_size),
        Column::ComprData => style.size(s.compr_data_size),
        Column::MemUsed => style.size(s.mem_used_total),
        Column::MemLimit if s.mem_limit == 0 => "-".into(),
        Column::MemLimit => style.size(s.mem_limit),
        Column::MemUsedMax => style.size(s.mem_used_max),
        Column::SamePages => s.same_pages.to_string(),
        Column::HugePages => s.huge_pages.to_string(),
        Column::CompactedPages => s.pages_compacted.to_string(),
        Column::Ratio => ratio(
            in_memory(s.orig_data_size, s.backed_pages),
            s.mem_used_total,
        ),
        Column::ReadPages => s.reads.to_string(),
        Column::WritePages => s.writes.to_string(),
        Column::DiscardPages => s.discards.to_string(),
        Column::FailedReadPages => s.failed_reads.to_string(),
        Column::FailedWritePages => s.failed_writes.to_string(),
        Column::LimitHits => s.limit_hits.to_string(),
        Column::Socket => d.socket.display().to_string(),
        Column::State => d.state.display().to_string(),
        Column::Worker => d.worker.state.name().into(),
        Column::Migration => d.migration.state.name().into(),
    }
}

/// `vzram stat -o COLS`: one table, one row per device.
pub fn render_columns(reply: &StatReply, cols: &[Column], style: Style) -> String {
    let header: Vec<&str> = cols.iter().map(|c| c.header()).collect();
    let rows: Vec<Vec<String>> = reply
        .devices
        .iter()
        .map(|d| cols.iter().map(|&c| cell(c, d, style)).collect())
        .collect();
    table_in(style, &header, &rows)
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

    /// A device as `stat` reports it, idle and empty.
    fn device(name: &str, socket: &str) -> DeviceStat {
        DeviceStat::example(name, socket)
    }

    #[test]
    fn renders_a_table() {
        let mut d = device("vm1", "/tmp/vm1.sock");
        d.size_bytes = 1 << 30;
        d.queues = 4;
        d.connected = true;
        d.stats.orig_data_size = 8192;
        d.stats.compr_data_size = 100;
        d.stats.mem_used_total = 4096;
        d.stats.reads = 7;
        d.stats.writes = 2;
        let mut reply = StatReply {
            pool: Default::default(),
            devices: vec![d],
            metrics: None,
            state_dir: Default::default(),
            leftovers: Vec::new(),
        };
        reply.pool.orig_data_size = 8192;
        reply.pool.compr_data_size = 100;
        reply.pool.mem_used_total = 4096;
        let t = render(&reply, Style::for_people());
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
    fn the_ratio_counts_only_what_memory_holds() {
        // 10 pages stored, 8 of them on the backing file: the 2 in memory
        // take 4 KiB of pool, a ratio of 2, not 10.
        let mut d = device("vm1", "/s1");
        d.stats.orig_data_size = 10 * 4096;
        d.stats.backed_pages = 8;
        d.stats.mem_used_total = 4096;
        let mut reply = StatReply {
            pool: Default::default(),
            devices: vec![d],
            metrics: None,
            state_dir: Default::default(),
            leftovers: Vec::new(),
        };
        reply.pool.orig_data_size = 10 * 4096;
        reply.pool.mem_used_total = 4096;
        let t = render(&reply, Style::for_people());
        for name in ["vm1 ", "(pool)"] {
            let row = t.lines().find(|l| l.starts_with(name)).unwrap();
            assert!(row.trim_end().ends_with(" 2.00"), "{row}");
        }
    }

    #[test]
    fn renders_tiering() {
        use crate::proto::control::BackingStat;
        let mut vm1 = device("vm1", "/s1");
        vm1.stats.backed_pages = 12;
        vm1.stats.backed_reads = 3;
        vm1.stats.backed_writes = 20;
        vm1.stats.spills = 2;
        vm1.stats.pages_recompressed = 5;
        vm1.stats.recompress_saved_bytes = 2048;
        vm1.tier.backing = Some(BackingStat {
            path: "/var/vz/vm1.img".into(),
            blocks: 1000,
            used_blocks: 12,
            direct_io: true,
        });
        let reply = StatReply {
            pool: Default::default(),
            devices: vec![vm1, device("vm2", "/s2")],
            metrics: None,
            state_dir: Default::default(),
            leftovers: Vec::new(),
        };
        let t = render(&reply, Style::for_people());
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
