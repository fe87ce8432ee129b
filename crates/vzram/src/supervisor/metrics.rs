//! `--metrics ADDR:PORT`: `GET /metrics` in the Prometheus text format
//! (0.0.4), rendered at each scrape from the same stats as the control
//! socket's `stat`, so nothing on the I/O path changes.
//!
//! One thread serves one request at a time. A client gets [`REQUEST_WAIT`]
//! in all to send at most [`MAX_REQUEST`] bytes and read the reply; a slow
//! or silent one is dropped, not waited for. The listener is bound before
//! the seccomp filter; serving needs accept, read, write, fcntl and poll.

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{prometheus_text, DescriptorEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use vzram_store::{DeviceStats, LatencySnapshot, Op, PoolStats};

/// Longest request head accepted (request line and headers).
const MAX_REQUEST: usize = 8 * 1024;
/// How long one client may take, request and reply together.
const REQUEST_WAIT: Duration = Duration::from_secs(5);

/// One device's numbers at scrape time.
#[derive(Debug)]
pub struct DeviceSample {
    pub name: String,
    pub connected: bool,
    pub stats: DeviceStats,
    /// Request latencies by operation.
    pub latency: Vec<(Op, LatencySnapshot)>,
    /// Page blocks in its backing file (0: none).
    pub backing_blocks: u64,
    /// Worker restarts by reason (`Restart::name`).
    pub restarts: Vec<(&'static str, u64)>,
    /// Clients closed before a worker: their first message was not vhost-user.
    pub refused_clients: u64,
}

/// Everything one scrape reports.
#[derive(Debug)]
pub struct Sample {
    pub pool: PoolStats,
    pub devices: Vec<DeviceSample>,
    /// States no device serves: name, memory their files hold.
    pub leftovers: Vec<(String, u64)>,
}

type DevField = fn(&DeviceSample) -> u64;
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
    ("vzram_reads", "Pages read", MetricType::Counter, |d| {
        d.stats.reads
    }),
    ("vzram_writes", "Pages written", MetricType::Counter, |d| {
        d.stats.writes
    }),
    (
        "vzram_discards",
        "Pages discarded",
        MetricType::Counter,
        |d| d.stats.discards,
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
        |d| d.backing_blocks,
    ),
    (
        "vzram_backed_pages",
        "Pages in the backing file (each holds one block)",
        MetricType::Gauge,
        |d| d.stats.backed_pages,
    ),
    (
        "vzram_backed_reads",
        "Pages read from the backing file",
        MetricType::Counter,
        |d| d.stats.backed_reads,
    ),
    (
        "vzram_backed_writes",
        "Pages written to the backing file",
        MetricType::Counter,
        |d| d.stats.backed_writes,
    ),
    (
        "vzram_spills",
        "Times a write found a memory limit reached and moved cold pages to the backing file",
        MetricType::Counter,
        |d| d.stats.spills,
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
        |d| d.refused_clients,
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
        "vzram_pool_meta_bytes",
        "Metadata outside the pool, all devices",
        MetricType::Gauge,
        |p| p.meta_bytes,
    ),
];

impl Collector for Sample {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, ty, value) in DEVICE_METRICS {
            let mut m = enc.encode_descriptor(name, help, None, *ty)?;
            for d in &self.devices {
                let labels = [("device", d.name.as_str())];
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
        for d in &self.devices {
            for (op, h) in &d.latency {
                let labels = [("device", d.name.as_str()), ("op", op.name())];
                m.encode_family(&labels)?
                    .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                        h.sum_seconds,
                        h.count,
                        &h.buckets,
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
        for d in &self.devices {
            for (reason, n) in &d.restarts {
                m.encode_family(&[("device", d.name.as_str()), ("reason", reason)])?
                    .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(n, None)?;
            }
        }
        for (name, help, ty, value) in POOL_METRICS {
            let mut m = enc.encode_descriptor(name, help, None, *ty)?;
            m.encode_gauge(&value(&self.pool))?;
        }
        let mut m = enc.encode_descriptor(
            "vzram_leftover_state_bytes",
            "Memory held by a device state in the state dir that no device serves (recover it with recover=true, or delete it with vzram forget)",
            None,
            MetricType::Gauge,
        )?;
        for (name, bytes) in &self.leftovers {
            m.encode_family(&[("name", name.as_str())])?
                .encode_gauge(bytes)?;
        }
        Ok(())
    }
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

/// Serves scrapes forever, one at a time.
pub fn serve(listener: TcpListener, sample: impl Fn() -> Sample) {
    loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                if let Err(e) = handle(stream, &sample) {
                    tracing::debug!(%peer, "metrics request: {e}");
                }
            }
            Err(e) => {
                tracing::warn!("metrics accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn handle(mut stream: TcpStream, sample: &impl Fn() -> Sample) -> io::Result<()> {
    // Non-blocking plus poll bounds every read and write by the deadline
    // (SO_RCVTIMEO would need setsockopt, which the filter refuses).
    set_nonblocking(&stream)?;
    let deadline = Instant::now() + REQUEST_WAIT;
    let head = match read_head(&mut stream, deadline)? {
        Some(h) => h,
        None => {
            return respond(
                &mut stream,
                deadline,
                "400 Bad Request",
                TEXT,
                "request too long or incomplete\n",
            )
        }
    };
    let (status, ctype, body) = route(&head, || render(sample()));
    respond(&mut stream, deadline, status, ctype, &body)
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

/// Reads up to the blank line ending the head; None if it does not come
/// within [`MAX_REQUEST`] bytes, or the client closes first.
fn read_head(stream: &mut TcpStream, deadline: Instant) -> io::Result<Option<String>> {
    let mut buf = vec![0u8; MAX_REQUEST];
    let mut len = 0;
    while len < buf.len() {
        match stream.read(&mut buf[len..]) {
            Ok(0) => return Ok(None),
            Ok(n) => {
                len += n;
                if let Some(end) = buf[..len].windows(4).position(|w| w == b"\r\n\r\n") {
                    return Ok(Some(String::from_utf8_lossy(&buf[..end]).into_owned()));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                wait(stream, libc::POLLIN, deadline)?
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

fn respond(
    stream: &mut TcpStream,
    deadline: Instant,
    status: &str,
    ctype: &str,
    body: &str,
) -> io::Result<()> {
    let mut msg = String::with_capacity(body.len() + 128);
    let _ = write!(
        msg,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut rest = msg.as_bytes();
    while !rest.is_empty() {
        match stream.write(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                wait(stream, libc::POLLOUT, deadline)?
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    Ok(())
}

/// Waits until `stream` is ready for `events`, or fails at the deadline.
fn wait(stream: &TcpStream, events: libc::c_short, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    let mut p = [libc::pollfd {
        fd: stream.as_raw_fd(),
        events,
        revents: 0,
    }];
    // SAFETY: one valid pollfd owned by this frame for the whole call.
    let rc = unsafe { libc::poll(p.as_mut_ptr(), 1, left.as_millis().max(1) as i32) };
    match rc {
        0 => Err(io::ErrorKind::TimedOut.into()),
        n if n > 0 => Ok(()),
        _ => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                Ok(())
            } else {
                Err(e)
            }
        }
    }
}

fn set_nonblocking(stream: &TcpStream) -> io::Result<()> {
    let fd = stream.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own; F_GETFL/F_SETFL only read and
    // set its status flags.
    let rc = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 {
            flags
        } else {
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
        }
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Sample {
        Sample {
            pool: PoolStats {
                devices: 1,
                mem_used_total: 8192,
                ..PoolStats::default()
            },
            leftovers: vec![("old-vm".into(), 65536)],
            devices: vec![DeviceSample {
                name: "vm1".into(),
                connected: true,
                stats: DeviceStats {
                    orig_data_size: 12288,
                    reads: 7,
                    writes: 3,
                    backed_pages: 4,
                    spills: 2,
                    pages_recompressed: 9,
                    ..DeviceStats::default()
                },
                backing_blocks: 100,
                restarts: vec![("short", 5), ("signal", 1)],
                refused_clients: 3,
                latency: vec![(
                    Op::Read,
                    LatencySnapshot {
                        buckets: vec![(1e-6, 2), (2e-6, 3), (f64::INFINITY, 1)],
                        count: 6,
                        sum_seconds: 0.5,
                    },
                )],
            }],
        }
    }

    #[test]
    fn renders_labelled_series() {
        let t = render(sample());
        for line in [
            "vzram_orig_data_bytes{device=\"vm1\"} 12288",
            "vzram_reads_total{device=\"vm1\"} 7",
            "vzram_writes_total{device=\"vm1\"} 3",
            "vzram_connected{device=\"vm1\"} 1",
            "vzram_backing_blocks{device=\"vm1\"} 100",
            "vzram_backed_pages{device=\"vm1\"} 4",
            "vzram_spills_total{device=\"vm1\"} 2",
            "vzram_recompressed_pages_total{device=\"vm1\"} 9",
            "vzram_backed_reads_total{device=\"vm1\"} 0",
            "# TYPE vzram_recompress_saved_bytes_total counter",
            "# TYPE vzram_reads_total counter",
            "# TYPE vzram_mem_used_bytes gauge",
            "vzram_pool_mem_used_bytes 8192",
            "vzram_pool_devices 1",
            "# TYPE vzram_request_duration_seconds histogram",
            "vzram_request_duration_seconds_bucket{device=\"vm1\",op=\"read\",le=\"2e-06\"} 5",
            "vzram_request_duration_seconds_bucket{device=\"vm1\",op=\"read\",le=\"+Inf\"} 6",
            "vzram_request_duration_seconds_count{device=\"vm1\",op=\"read\"} 6",
            "# TYPE vzram_worker_restarts_total counter",
            "vzram_worker_restarts_total{device=\"vm1\",reason=\"short\"} 5",
            "vzram_worker_restarts_total{device=\"vm1\",reason=\"signal\"} 1",
            "vzram_refused_clients_total{device=\"vm1\"} 3",
        ] {
            assert!(t.lines().any(|l| l == line), "no {line:?} in\n{t}");
        }
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
