//! `--metrics ADDR:PORT`: `GET /metrics` in the Prometheus text format
//! (0.0.4), rendered at each scrape from the same stats as the control
//! socket's `stat`, so nothing on the I/O path changes.
//!
//! One thread serves up to [`MAX_CLIENTS`] scrapes at once, none of them
//! blocking another. A client gets [`REQUEST_WAIT`] in all to send at most
//! [`MAX_REQUEST`] bytes and read the reply; a slow or silent one is
//! dropped, not waited for. The listener is bound before the seccomp
//! filter; serving needs accept4, recvfrom, sendto, fcntl and epoll.

use std::fmt::Write as _;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{prometheus_text, DescriptorEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use vzram_store::{LatencySnapshot, PoolStats};

use super::clients::{self, Frame, Limits, Protocol, Reply, Timeout};
pub use super::control::Sample;
pub use super::procstat::{ProcFiles, ProcessSample};
use crate::proto::control::{DeviceStat, MigrationStat};

/// Longest request head accepted (request line and headers).
const MAX_REQUEST: usize = 8 * 1024;
/// How long one client may take, request and reply together.
const REQUEST_WAIT: Duration = Duration::from_secs(2);
/// Scrapes at once; past it the longest idle client gives way.
const MAX_CLIENTS: usize = 64;

type DevField = fn(&DeviceStat) -> u64;

/// Bytes in a page: traffic counters are exported in bytes, not pages.
const PAGE: u64 = vzram_store::PAGE_SIZE as u64;

/// The label naming a device: not `device`, which node_exporter's block
/// device series carry (a scrape of both would mix them up).
const DEVICE: &str = "vzram_device";

/// Upper bounds of the exported latency buckets, in µs: a subset of the
/// store's powers of two, around what was measured (BENCHMARKS.md): 4K
/// reads at QD1 take 17–70 µs, 32K reads at QD8 about 120 µs, a written-back
/// page a disk read, and a starved machine milliseconds. 11 buckets where
/// the store keeps 24.
const LATENCY_BOUNDS_US: [u64; 10] = [8, 16, 32, 64, 128, 256, 1 << 10, 1 << 12, 1 << 14, 1 << 17];

/// The store's histogram folded into [`LATENCY_BOUNDS_US`] (and +Inf):
/// each store bucket goes to the first exported bound at or above its own.
fn coarse(h: &LatencySnapshot) -> Vec<(f64, u64)> {
    let mut out: Vec<(f64, u64)> = LATENCY_BOUNDS_US
        .iter()
        .map(|&us| (us as f64 * 1e-6, 0))
        .chain([(f64::INFINITY, 0)])
        .collect();
    for &(bound, n) in &h.buckets {
        let i = out
            .iter()
            .position(|&(b, _)| bound <= b * (1.0 + 1e-9))
            .unwrap_or(out.len() - 1);
        out[i].1 += n;
    }
    out
}
type PoolField = fn(&PoolStats) -> u64;

/// Per-device series: name (counters get `_total` from the encoder), help,
/// type, value.
const DEVICE_METRICS: &[(&str, &str, MetricType, DevField)] = &[
    (
        "vzram_orig_data_bytes",
        "Uncompressed bytes stored",
        MetricType::Gauge,
        |d| d.stats.orig_data_size,
    ),
    (
        "vzram_compr_data_bytes",
        "Compressed bytes stored",
        MetricType::Gauge,
        |d| d.stats.compr_data_size,
    ),
    (
        "vzram_mem_used_bytes",
        "Pool memory the device uses, with fragmentation",
        MetricType::Gauge,
        |d| d.stats.mem_used_total,
    ),
    (
        "vzram_mem_used_max_bytes",
        "Highest mem_used since start",
        MetricType::Gauge,
        |d| d.stats.mem_used_max,
    ),
    (
        "vzram_mem_limit_bytes",
        "Cap on the device's memory (0 = none)",
        MetricType::Gauge,
        |d| d.stats.mem_limit,
    ),
    (
        "vzram_size_bytes",
        "Capacity the guest sees",
        MetricType::Gauge,
        |d| d.stats.size_bytes,
    ),
    (
        "vzram_meta_bytes",
        "Metadata outside the pool (slot table, span headers)",
        MetricType::Gauge,
        |d| d.stats.meta_bytes,
    ),
    (
        "vzram_same_pages",
        "Pages stored as one repeated word",
        MetricType::Gauge,
        |d| d.stats.same_pages,
    ),
    (
        "vzram_huge_pages",
        "Pages stored uncompressed",
        MetricType::Gauge,
        |d| d.stats.huge_pages,
    ),
    (
        "vzram_connected",
        "1 while a frontend is connected",
        MetricType::Gauge,
        |d| u64::from(d.connected),
    ),
    (
        "vzram_read_bytes",
        "Bytes the guest read (whole pages)",
        MetricType::Counter,
        |d| d.stats.reads * PAGE,
    ),
    (
        "vzram_write_bytes",
        "Bytes the guest wrote (whole pages)",
        MetricType::Counter,
        |d| d.stats.writes * PAGE,
    ),
    (
        "vzram_discard_bytes",
        "Bytes the guest discarded (whole pages)",
        MetricType::Counter,
        |d| d.stats.discards * PAGE,
    ),
    (
        "vzram_failed_reads",
        "Pages that failed to read",
        MetricType::Counter,
        |d| d.stats.failed_reads,
    ),
    (
        "vzram_failed_writes",
        "Pages that failed to write (a memory limit hit among them)",
        MetricType::Counter,
        |d| d.stats.failed_writes,
    ),
    (
        "vzram_limit_hits",
        "Writes refused because the device or host memory limit was reached",
        MetricType::Counter,
        |d| d.stats.limit_hits,
    ),
    (
        "vzram_pages_compacted",
        "Pages moved by compaction",
        MetricType::Counter,
        |d| d.stats.pages_compacted,
    ),
    (
        "vzram_backing_blocks",
        "Page blocks in the device's backing file (0 = no backing file)",
        MetricType::Gauge,
        |d| d.tier.backing.as_ref().map_or(0, |b| b.blocks),
    ),
    (
        "vzram_backed_pages",
        "Pages in the backing file (each holds one block)",
        MetricType::Gauge,
        |d| d.stats.backed_pages,
    ),
    (
        "vzram_backing_read_bytes",
        "Bytes read from the backing file (whole pages)",
        MetricType::Counter,
        |d| d.stats.backed_reads * PAGE,
    ),
    (
        "vzram_backing_write_bytes",
        "Bytes written to the backing file (whole pages)",
        MetricType::Counter,
        |d| d.stats.backed_writes * PAGE,
    ),
    (
        "vzram_spills",
        "Times a write found a memory limit reached and moved cold pages to the backing file",
        MetricType::Counter,
        |d| d.stats.spills,
    ),
    (
        "vzram_pool_pages",
        "Pages the compress pool's threads compressed or decompressed (those the queue threads did themselves are not counted)",
        MetricType::Counter,
        |d| d.stats.pool_pages,
    ),
    (
        "vzram_staged_bytes",
        "Bytes of pages writes stored raw (staged) that the compress threads have not compressed yet; counted in huge pages too",
        MetricType::Gauge,
        |d| d.stats.staged_bytes,
    ),
    (
        "vzram_staged_compressed_pages",
        "Staged pages the compress threads compressed in the background",
        MetricType::Counter,
        |d| d.stats.staged_compressed,
    ),
    (
        "vzram_staged_wait_microseconds",
        "Time the pages compressed in the background waited staged, summed",
        MetricType::Counter,
        |d| d.stats.staged_wait_micros,
    ),
    (
        "vzram_staged_wait_max_microseconds",
        "Longest time one page waited staged before it was compressed",
        MetricType::Gauge,
        |d| d.stats.staged_wait_max_micros,
    ),
    (
        "vzram_recompressed_pages",
        "Pages a second codec stored smaller",
        MetricType::Counter,
        |d| d.stats.pages_recompressed,
    ),
    (
        "vzram_refused_clients",
        "Clients closed before any worker was started, because their first message was not a vhost-user request",
        MetricType::Counter,
        |d| d.worker.refused_clients,
    ),
    (
        "vzram_recompress_saved_bytes",
        "Compressed bytes recompression saved",
        MetricType::Counter,
        |d| d.stats.recompress_saved_bytes,
    ),
];

/// Pool-wide series, no labels.
const POOL_METRICS: &[(&str, &str, MetricType, PoolField)] = &[
    (
        "vzram_pool_devices",
        "Devices in the pool",
        MetricType::Gauge,
        |p| p.devices,
    ),
    (
        "vzram_pool_orig_data_bytes",
        "Uncompressed bytes stored, all devices",
        MetricType::Gauge,
        |p| p.orig_data_size,
    ),
    (
        "vzram_pool_compr_data_bytes",
        "Compressed bytes stored, all devices",
        MetricType::Gauge,
        |p| p.compr_data_size,
    ),
    (
        "vzram_pool_mem_used_bytes",
        "Pool memory in use",
        MetricType::Gauge,
        |p| p.mem_used_total,
    ),
    (
        "vzram_pool_mem_used_max_bytes",
        "Highest pool memory use since start",
        MetricType::Gauge,
        |p| p.mem_used_max,
    ),
    (
        "vzram_pool_mem_limit_bytes",
        "Host-wide memory cap (0 = none)",
        MetricType::Gauge,
        |p| p.mem_limit,
    ),
    (
        "vzram_pool_staging_limit_bytes",
        "Host-wide raw staging budget (0 = no device stages)",
        MetricType::Gauge,
        |p| p.staging_limit,
    ),
    (
        "vzram_pool_staged_bytes",
        "Bytes stored raw waiting to be compressed, all devices",
        MetricType::Gauge,
        |p| p.staged_bytes,
    ),
    (
        "vzram_pool_staging_used_bytes",
        "What the host-wide staging budget holds (as vzram_pool_staged_bytes but for pages being staged or released)",
        MetricType::Gauge,
        |p| p.staging_used,
    ),
    (
        "vzram_pool_meta_bytes",
        "Metadata outside the pool, all devices",
        MetricType::Gauge,
        |p| p.meta_bytes,
    ),
];

impl Collector for Sample {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // The usual `_build_info` idiom: a constant 1 whose label says which
        // build is running, to join on or alert on mixed versions.
        enc.encode_descriptor(
            "vzram_build_info",
            "The running vzram's version (as the label); always 1",
            None,
            MetricType::Gauge,
        )?
        .encode_family(&[("version", crate::proto::VERSION)])?
        .encode_gauge(&1u64)?;
        let stat = &self.snapshot.stat;
        let devices = || stat.devices.iter().zip(&self.snapshot.extra);
        for (name, help, ty, value) in DEVICE_METRICS {
            let mut m = enc.encode_descriptor(name, help, None, *ty)?;
            for d in &stat.devices {
                let labels = [(DEVICE, d.name.as_str())];
                let mut series = m.encode_family(&labels)?;
                match ty {
                    MetricType::Counter => series
                        .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(
                            &value(d),
                            None,
                        )?,
                    _ => series.encode_gauge(&value(d))?,
                }
            }
        }
        let mut m = enc.encode_descriptor(
            "vzram_request_duration_seconds",
            "Time to serve a request (read, write, or discard and write-zeroes), from its descriptor chain to its status byte",
            None,
            MetricType::Histogram,
        )?;
        for (d, x) in devices() {
            for (op, h) in &x.latency {
                let labels = [(DEVICE, d.name.as_str()), ("op", op.name())];
                m.encode_family(&labels)?
                    .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                        h.sum_seconds,
                        h.count,
                        &coarse(h),
                        None,
                    )?;
            }
        }
        let mut m = enc.encode_descriptor(
            "vzram_worker_restarts",
            "Worker ends other than a useful clean one: short (served nothing or lived under a second), error (exit code), signal, start_failed",
            None,
            MetricType::Counter,
        )?;
        for (d, x) in devices() {
            for (reason, n) in &x.restarts {
                m.encode_family(&[(DEVICE, d.name.as_str()), ("reason", reason)])?
                    .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(n, None)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "vzram_migration_state",
            "1 for the state of the device's migration, as vzram stat names it (none, incoming, receiving, prepared, received, failed, sending, committing, sent, copied, send-failed)",
            None,
            MetricType::Gauge,
        )?;
        for d in &stat.devices {
            m.encode_family(&[
                (DEVICE, d.name.as_str()),
                ("state", d.migration.state.name()),
            ])?
            .encode_gauge(&1u64)?;
        }
        type MigField = fn(&MigrationStat) -> u64;
        const MIGRATION: [(&str, &str, MigField); 4] = [
            (
                "vzram_migration_stream_bytes",
                "Bytes of the current (or last) migration stream, sent or received",
                |m| m.bytes,
            ),
            (
                "vzram_migration_records",
                "Records of the current (or last) migration stream",
                |m| m.records,
            ),
            (
                "vzram_migration_pass",
                "Pass of the current (or last) migration stream: 1 is the full copy, then the deltas",
                |m| m.pass,
            ),
            (
                "vzram_migration_dirty_pages",
                "Pages written on the source since its current pass began (what the next delta sends)",
                |m| m.dirty_slots,
            ),
        ];
        for (name, help, value) in MIGRATION {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for d in &stat.devices {
                m.encode_family(&[(DEVICE, d.name.as_str())])?
                    .encode_gauge(&value(&d.migration))?;
            }
        }
        for (name, help, ty, value) in POOL_METRICS {
            let mut m = enc.encode_descriptor(name, help, None, *ty)?;
            m.encode_gauge(&value(&stat.pool))?;
        }
        encode_process(&self.process, &mut enc)?;
        let mut m = enc.encode_descriptor(
            "vzram_leftover_state_bytes",
            "Memory held by a device state in the state dir that no device serves (recover it with recover=true, or delete it with vzram forget)",
            None,
            MetricType::Gauge,
        )?;
        for l in &stat.leftovers {
            m.encode_family(&[("name", l.name.as_str())])?
                .encode_gauge(&l.state_bytes)?;
        }
        Ok(())
    }
}

/// The usual `process_*` series (client_golang's names and meanings), of
/// the supervisor alone: each worker is a process of its own.
fn encode_process(p: &ProcessSample, enc: &mut DescriptorEncoder) -> std::fmt::Result {
    let gauges: [(&str, &str, Option<u64>); 4] = [
        (
            "process_resident_memory_bytes",
            "Resident memory size in bytes (the supervisor; workers are processes of their own)",
            p.resident_bytes,
        ),
        (
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes (the supervisor)",
            p.virtual_bytes,
        ),
        (
            "process_open_fds",
            "Number of open file descriptors (the supervisor)",
            p.open_fds,
        ),
        (
            "process_max_fds",
            "Maximum number of open file descriptors (the supervisor's soft limit)",
            p.max_fds,
        ),
    ];
    for (name, help, value) in gauges {
        if let Some(v) = value {
            enc.encode_descriptor(name, help, None, MetricType::Gauge)?
                .encode_gauge(&v)?;
        }
    }
    if let Some(v) = p.start_time_seconds {
        enc.encode_descriptor(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds (the supervisor)",
            None,
            MetricType::Gauge,
        )?
        .encode_gauge(&v)?;
    }
    if let Some(v) = p.cpu_seconds {
        // The encoder adds `_total`.
        enc.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds (the supervisor)",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<prometheus_client::encoding::NoLabelSet, _, f64>(&v, None)?;
    }
    Ok(())
}

/// The exposition text for one scrape.
pub fn render(sample: Sample) -> String {
    let mut reg = Registry::default();
    reg.register_collector(Box::new(sample));
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_text::encode(&mut out, &reg);
    out
}

/// Serves scrapes for ever.
pub fn serve(listener: TcpListener, sample: impl Fn() -> Sample + Send + Sync + 'static) {
    let limits = Limits {
        max_clients: MAX_CLIENTS,
        timeout: Timeout::Whole(REQUEST_WAIT),
        // A scrape is rendered on the loop: it reads counters only.
        pool: 0,
    };
    if let Err(e) = clients::serve(listener.into(), Arc::new(Scrapes(sample)), limits) {
        tracing::error!("metrics endpoint: {e}; no more scrapes are answered");
    }
}

/// The HTTP side of `/metrics`, over bounded connections.
struct Scrapes<F>(F);

impl<F: Fn() -> Sample + Send + Sync + 'static> Protocol for Scrapes<F> {
    type Req = String;
    const NAME: &'static str = "metrics";

    fn frame(&self, buf: &[u8]) -> Frame {
        let within = &buf[..buf.len().min(MAX_REQUEST)];
        match within.windows(4).position(|w| w == b"\r\n\r\n") {
            Some(end) => Frame::Request(end + 4),
            None if buf.len() >= MAX_REQUEST => Frame::TooLong,
            None => Frame::Need,
        }
    }

    fn parse(&self, bytes: &[u8]) -> String {
        String::from_utf8_lossy(bytes).into_owned()
    }

    fn quick(&self, _: &String) -> bool {
        true
    }

    fn answer(&self, head: String) -> Reply {
        let (status, ctype, body) = route(&head, || render((self.0)()));
        response(status, ctype, &body)
    }

    fn too_long(&self) -> Reply {
        response("400 Bad Request", TEXT, "request too long\n")
    }

    fn closing(&self, why: &str) -> Vec<u8> {
        response("503 Service Unavailable", TEXT, &format!("{why}\n")).bytes
    }
}

fn response(status: &str, ctype: &str, body: &str) -> Reply {
    let mut msg = String::with_capacity(body.len() + 128);
    let _ = write!(
        msg,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    Reply {
        bytes: msg.into_bytes(),
        close: true,
    }
}

const TEXT: &str = "text/plain; charset=utf-8";

/// Status, content type and body for a request head.
fn route(head: &str, metrics: impl FnOnce() -> String) -> (&'static str, &'static str, String) {
    let line = head.lines().next().unwrap_or_default();
    let parts: Vec<&str> = line.split(' ').collect();
    let [method, target, version] = parts[..] else {
        return ("400 Bad Request", TEXT, "bad request line\n".into());
    };
    if !version.starts_with("HTTP/1.") {
        return ("400 Bad Request", TEXT, "bad request line\n".into());
    }
    if method != "GET" {
        return ("405 Method Not Allowed", TEXT, "only GET\n".into());
    }
    match target.split('?').next() {
        Some("/metrics") => ("200 OK", prometheus_text::CONTENT_TYPE, metrics()),
        _ => ("404 Not Found", TEXT, "see /metrics\n".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::control::{DeviceExtra, Snapshot};
    use super::*;

    fn sample() -> Sample {
        let mut d = DeviceStat::example("vm1", "/vm1.sock");
        d.connected = true;
        d.stats = vzram_store::DeviceStats {
            orig_data_size: 12288,
            reads: 7,
            writes: 3,
            backed_pages: 4,
            spills: 2,
            pages_recompressed: 9,
            pool_pages: 11,
            staged_bytes: 8192,
            staged_compressed: 5,
            staged_wait_micros: 700,
            staged_wait_max_micros: 300,
            ..Default::default()
        };
        d.tier.backing = Some(crate::proto::control::BackingStat {
            path: "/vm1.img".into(),
            blocks: 100,
            used_blocks: 4,
            direct_io: true,
        });
        d.worker.refused_clients = 3;
        d.migration.state = crate::proto::control::MigrationState::Sending;
        d.migration.bytes = 4096;
        d.migration.records = 9;
        d.migration.pass = 2;
        d.migration.dirty_slots = 3;
        let stat = crate::proto::control::StatReply {
            pool: PoolStats {
                devices: 1,
                mem_used_total: 8192,
                ..PoolStats::default()
            },
            devices: vec![d],
            metrics: None,
            state_dir: "/state".into(),
            leftovers: vec![crate::proto::control::LeftoverStat {
                name: "old-vm".into(),
                dir: "/state/old-vm".into(),
                size_bytes: 1 << 20,
                state_bytes: 65536,
                socket: None,
            }],
        };
        let extra = DeviceExtra {
            restarts: vec![("short", 5), ("signal", 1)],
            latency: vec![(
                vzram_store::Op::Read,
                LatencySnapshot {
                    buckets: vec![
                        (1e-6, 2),
                        (2e-6, 3),
                        (16e-6, 4),
                        (32e-6, 1),
                        (512e-6, 7),
                        (f64::INFINITY, 1),
                    ],
                    count: 18,
                    sum_seconds: 0.5,
                },
            )],
        };
        Sample {
            snapshot: Snapshot {
                stat,
                extra: vec![extra],
            },
            process: ProcessSample {
                resident_bytes: Some(5 << 20),
                virtual_bytes: Some(64 << 20),
                open_fds: Some(17),
                max_fds: Some(65536),
                start_time_seconds: Some(1_700_000_000.5),
                cpu_seconds: Some(0.25),
            },
        }
    }

    #[test]
    fn renders_labelled_series() {
        let t = render(sample());
        let build = format!(
            "vzram_build_info{{version=\"{}\"}} 1",
            crate::proto::VERSION
        );
        for line in [
            "vzram_orig_data_bytes{vzram_device=\"vm1\"} 12288",
            "vzram_read_bytes_total{vzram_device=\"vm1\"} 28672",
            "vzram_write_bytes_total{vzram_device=\"vm1\"} 12288",
            "vzram_connected{vzram_device=\"vm1\"} 1",
            "vzram_backing_blocks{vzram_device=\"vm1\"} 100",
            "vzram_backed_pages{vzram_device=\"vm1\"} 4",
            "vzram_spills_total{vzram_device=\"vm1\"} 2",
            "vzram_recompressed_pages_total{vzram_device=\"vm1\"} 9",
            "vzram_pool_pages_total{vzram_device=\"vm1\"} 11",
            "vzram_staged_bytes{vzram_device=\"vm1\"} 8192",
            "vzram_staged_compressed_pages_total{vzram_device=\"vm1\"} 5",
            "vzram_staged_wait_microseconds_total{vzram_device=\"vm1\"} 700",
            "vzram_staged_wait_max_microseconds{vzram_device=\"vm1\"} 300",
            "vzram_backing_read_bytes_total{vzram_device=\"vm1\"} 0",
            "# TYPE vzram_recompress_saved_bytes_total counter",
            "# TYPE vzram_read_bytes_total counter",
            "# TYPE vzram_mem_used_bytes gauge",
            "vzram_pool_mem_used_bytes 8192",
            "vzram_pool_devices 1",
            "# TYPE vzram_request_duration_seconds histogram",
            // 1 and 2 µs fold into 8 µs; 512 µs into 1024 µs.
            "vzram_request_duration_seconds_bucket{vzram_device=\"vm1\",op=\"read\",le=\"8e-06\"} 5",
            "vzram_request_duration_seconds_bucket{vzram_device=\"vm1\",op=\"read\",le=\"1.6e-05\"} 9",
            "vzram_request_duration_seconds_bucket{vzram_device=\"vm1\",op=\"read\",le=\"3.2e-05\"} 10",
            "vzram_request_duration_seconds_bucket{vzram_device=\"vm1\",op=\"read\",le=\"0.000256\"} 10",
            "vzram_request_duration_seconds_bucket{vzram_device=\"vm1\",op=\"read\",le=\"0.001024\"} 17",
            "vzram_request_duration_seconds_bucket{vzram_device=\"vm1\",op=\"read\",le=\"+Inf\"} 18",
            "vzram_request_duration_seconds_count{vzram_device=\"vm1\",op=\"read\"} 18",
            "# TYPE vzram_worker_restarts_total counter",
            "vzram_worker_restarts_total{vzram_device=\"vm1\",reason=\"short\"} 5",
            "vzram_worker_restarts_total{vzram_device=\"vm1\",reason=\"signal\"} 1",
            "vzram_refused_clients_total{vzram_device=\"vm1\"} 3",
            "vzram_migration_state{vzram_device=\"vm1\",state=\"sending\"} 1",
            "vzram_migration_stream_bytes{vzram_device=\"vm1\"} 4096",
            "vzram_migration_records{vzram_device=\"vm1\"} 9",
            "vzram_migration_pass{vzram_device=\"vm1\"} 2",
            "vzram_migration_dirty_pages{vzram_device=\"vm1\"} 3",
            "# TYPE vzram_build_info gauge",
            "process_resident_memory_bytes 5242880",
            "process_virtual_memory_bytes 67108864",
            "process_open_fds 17",
            "process_max_fds 65536",
            "process_start_time_seconds 1700000000.5",
            "# TYPE process_cpu_seconds_total counter",
            "process_cpu_seconds_total 0.25",
            "vzram_leftover_state_bytes{name=\"old-vm\"} 65536",
            build.as_str(),
        ] {
            assert!(t.lines().any(|l| l == line), "no {line:?} in\n{t}");
        }
        // 11 buckets, a sum and a count per operation; no `device` label.
        assert_eq!(
            t.lines()
                .filter(|l| l.starts_with("vzram_request_duration_seconds_bucket"))
                .count(),
            11
        );
        assert!(!t.contains("{device="), "{t}");
    }

    #[test]
    fn frames_and_answers_heads() {
        let p = Scrapes(sample);
        assert_eq!(p.frame(b"GET /metrics HTTP/1.1\r\n"), Frame::Need);
        assert_eq!(
            p.frame(b"GET / HTTP/1.1\r\nA: b\r\n\r\nrest"),
            Frame::Request(24)
        );
        assert_eq!(p.frame(&vec![b'a'; MAX_REQUEST]), Frame::TooLong);
        let r = p.answer(p.parse(b"GET /metrics HTTP/1.1\r\n\r\n"));
        let text = String::from_utf8(r.bytes).unwrap();
        assert!(r.close);
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(text.contains("vzram_pool_devices 1"), "{text}");
        let busy = String::from_utf8(p.closing("refused")).unwrap();
        assert!(busy.starts_with("HTTP/1.1 503 "), "{busy}");
    }

    #[test]
    fn routes() {
        let m = || "x".to_string();
        assert_eq!(route("GET /metrics HTTP/1.1", m).0, "200 OK");
        assert_eq!(route("GET /metrics?x=1 HTTP/1.0\r\nHost: a", m).0, "200 OK");
        assert_eq!(route("GET / HTTP/1.1", m).0, "404 Not Found");
        assert_eq!(
            route("POST /metrics HTTP/1.1", m).0,
            "405 Method Not Allowed"
        );
        assert_eq!(route("hello", m).0, "400 Bad Request");
        assert_eq!(route("GET /metrics SMTP", m).0, "400 Bad Request");
        assert_eq!(route("", m).0, "400 Bad Request");
    }
}
