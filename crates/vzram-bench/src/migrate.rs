//! Migration stream throughput: plain `unix:` against mutual TLS on `tcp:127.0.0.1`.
//!
//! One source daemon serves a device (`--name vm`) filled with corpus pages through a
//! client, which then disconnects (no frontend: the device is quiet, the stream is one
//! pass, and the run commits it with `vzram migrate --commit` once the source says
//! committing; the wall time includes that). Each round starts a fresh destination daemon with `vm`
//! incoming on the round's transport, runs `vzram migrate --keep` (the source keeps
//! its pages and is sent again next round) and times that command wall-clock; then
//! checks that the destination received and holds as much guest data as the source,
//! and stops it. Transports are interleaved (unix, tls, unix, tls...) so that drift of
//! a shared machine falls on both alike. Certificates (one CA, a server pair for
//! 127.0.0.1, a client pair) are made for the run with rcgen.

use crate::cli::MigrateArgs;
use crate::client::{run_queue, Bitmap, Conn, WorkerCfg, PREFILL_DEPTH};
use crate::data::PAGE;
use crate::error::{bail, Context, Result};
use crate::job::OpGen;
use crate::measure::Window;
use crate::report::JsonOut;
use crate::sys::Daemon;
use crate::targets::vzram as daemon;
use crate::targets::Env;
use crate::units::format_size;
use ::vzram::proto::control::{DeviceStat, MigrationState, StatReply};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const DEVICE: &str = "vm";
const MIB: f64 = (1u64 << 20) as f64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// `unix:PATH`, plain.
    Unix,
    /// `tcp:127.0.0.1:PORT`, mutual TLS (rustls, TLS 1.3).
    Tls,
}

impl Transport {
    fn label(self) -> &'static str {
        match self {
            Transport::Unix => "unix: (plain)",
            Transport::Tls => "tcp:127.0.0.1 (mutual TLS)",
        }
    }
}

/// One `vzram migrate`.
#[derive(Debug, Serialize)]
pub struct Round {
    pub transport: Transport,
    pub round: u32,
    /// The `vzram migrate` command, wall-clock (connect and handshake included).
    pub wall_s: f64,
    /// The sender's own time (`vzram stat`: migration `total_ms`).
    pub daemon_s: f64,
    /// Bytes of the stream (the source's migration `bytes`): the pages as stored.
    pub stream_bytes: u64,
    pub pages: u64,
    pub passes: u32,
    /// `stream_bytes` per wall second, MiB/s.
    pub stream_mib_s: f64,
    /// The guest data moved (the source's `orig_data_size`) per wall second, MiB/s.
    pub guest_mib_s: f64,
    /// What `vzram migrate` printed.
    pub output: String,
}

/// One transport's rounds, summarized.
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    pub rounds: usize,
    pub stream_median_mib_s: f64,
    pub stream_min_mib_s: f64,
    pub stream_max_mib_s: f64,
    pub guest_median_mib_s: f64,
    pub guest_min_mib_s: f64,
    pub guest_max_mib_s: f64,
    pub wall_median_s: f64,
    /// Stream bytes per second of the sender's own time, median.
    pub daemon_median_mib_s: f64,
}

impl Summary {
    fn of(rounds: &[Round], t: Transport) -> Summary {
        let rs: Vec<&Round> = rounds.iter().filter(|r| r.transport == t).collect();
        let stream: Vec<f64> = rs.iter().map(|r| r.stream_mib_s).collect();
        let guest: Vec<f64> = rs.iter().map(|r| r.guest_mib_s).collect();
        let wall: Vec<f64> = rs.iter().map(|r| r.wall_s).collect();
        let daemon: Vec<f64> = rs
            .iter()
            .map(|r| r.stream_bytes as f64 / MIB / r.daemon_s)
            .collect();
        Summary {
            rounds: rs.len(),
            stream_median_mib_s: median(&stream),
            stream_min_mib_s: min(&stream),
            stream_max_mib_s: max(&stream),
            guest_median_mib_s: median(&guest),
            guest_min_mib_s: min(&guest),
            guest_max_mib_s: max(&guest),
            wall_median_s: median(&wall),
            daemon_median_mib_s: median(&daemon),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct MigrateResult {
    pub record: String,
    pub data_bytes: u64,
    pub dev_size: u64,
    pub corpus: String,
    pub cpus: usize,
    pub fill_s: f64,
    /// The source device after the fill (`vzram stat`).
    pub orig_data_size: u64,
    pub compr_data_size: u64,
    pub mem_used_total: u64,
    pub rounds: Vec<Round>,
    pub unix: Summary,
    pub tls: Summary,
    /// TLS MiB/s over unix MiB/s of each adjacent pair (round i of each), and their
    /// median (the same for stream and guest bytes: both ends move the same data).
    pub pair_ratios: Vec<f64>,
    pub ratio_median: f64,
    /// The TLS median over the unix median.
    pub ratio_of_medians: f64,
    pub load_1m: Option<f64>,
    pub unix_time: u64,
}

/// The middle value (the mean of the two middle ones for an even count).
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().reduce(f64::min).unwrap_or(f64::NAN)
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().reduce(f64::max).unwrap_or(f64::NAN)
}

/// What `vzram migrate` prints: "device vm: migrated to ADDR: N pages, 180.3 MiB in
/// P passes, S s (R MiB/s); last delta ...".
#[derive(Debug, PartialEq)]
struct Printed {
    pages: u64,
    /// Rounded as printed (one decimal of its unit).
    bytes: u64,
    passes: u32,
    seconds: f64,
    rate_mib_s: f64,
}

/// A size as `vzram` prints it ("1023 B", "180.3 MiB").
fn parse_human(s: &str) -> Option<u64> {
    let (num, unit) = s.trim().split_once(' ')?;
    let shift = match unit {
        "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        "TiB" => 40,
        "PiB" => 50,
        _ => return None,
    };
    let v: f64 = num.parse().ok()?;
    Some((v * (1u64 << shift) as f64).round() as u64)
}

/// How far a size printed as `vzram` prints it (a tenth of its unit, "183.8 MiB")
/// may be from the exact one.
fn rounding(bytes: u64) -> u64 {
    let mut unit = 1u64;
    while bytes / unit >= 1024 && unit < 1 << 50 {
        unit <<= 10;
    }
    unit / 20 + 1
}

fn parse_printed(out: &str) -> Option<Printed> {
    // The address may hold colons; " pages, " comes once, after it.
    let at = out.find(" pages, ")?;
    let pages = out[..at].rsplit(' ').next()?.parse().ok()?;
    let rest = &out[at + " pages, ".len()..];
    let (bytes, rest) = rest.split_once(" in ")?;
    let (passes, rest) = rest.split_once(" passes, ")?;
    let (seconds, rest) = rest.split_once(" s (")?;
    let (rate, _) = rest.split_once(" MiB/s)")?;
    Some(Printed {
        pages,
        bytes: parse_human(bytes)?,
        passes: passes.trim().parse().ok()?,
        seconds: seconds.trim().parse().ok()?,
        rate_mib_s: rate.trim().parse().ok()?,
    })
}

/// Credentials directories laid out as QEMU's tls-creds-x509: `dest` holds
/// ca-cert.pem, server-cert.pem, server-key.pem; `source` holds ca-cert.pem,
/// client-cert.pem, client-key.pem.
fn make_pki(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let e = |e: rcgen::Error| crate::error::Error(format!("making test certificates: {e}"));
    let ca_key = KeyPair::generate().map_err(e)?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(e)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "vzram-bench migrate CA");
    let ca = ca.self_signed(&ca_key).map_err(e)?;
    let leaf = |names: Vec<String>| -> Result<(String, String)> {
        let key = KeyPair::generate().map_err(e)?;
        let cert = CertificateParams::new(names)
            .map_err(e)?
            .signed_by(&key, &ca, &ca_key)
            .map_err(e)?;
        Ok((cert.pem(), key.serialize_pem()))
    };
    let (server_cert, server_key) = leaf(vec!["127.0.0.1".into(), "localhost".into()])?;
    let (client_cert, client_key) = leaf(vec!["source.vzram-bench".into()])?;
    let dest = dir.join("dest");
    let source = dir.join("source");
    for (d, files) in [
        (
            &dest,
            [
                ("server-cert.pem", server_cert),
                ("server-key.pem", server_key),
            ],
        ),
        (
            &source,
            [
                ("client-cert.pem", client_cert),
                ("client-key.pem", client_key),
            ],
        ),
    ] {
        std::fs::create_dir_all(d).context(format!("creating {}", d.display()))?;
        let ca_pem = d.join("ca-cert.pem");
        std::fs::write(&ca_pem, ca.pem()).context(format!("writing {}", ca_pem.display()))?;
        for (name, text) in files {
            let p = d.join(name);
            std::fs::write(&p, text).context(format!("writing {}", p.display()))?;
        }
    }
    Ok((dest, source))
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// A `vzram serve` of one device named `vm`, with its own control socket and state.
struct Serve {
    daemon: Daemon,
    control: PathBuf,
    socket: PathBuf,
    state: PathBuf,
}

impl Serve {
    /// `extra`: `--incoming ADDR`, `--tls-creds DIR`; `wait`: paths besides the device
    /// and control sockets that must exist first (a unix incoming socket).
    fn start(
        env: &Env,
        dir: &Path,
        state: PathBuf,
        size: u64,
        extra: &[String],
        wait: &[PathBuf],
        log: PathBuf,
    ) -> Result<Serve> {
        std::fs::create_dir_all(dir).context(format!("creating {}", dir.display()))?;
        let socket = dir.join("d.sock");
        let control = dir.join("ctl");
        for p in [&socket, &control].into_iter().chain(wait) {
            let _ = std::fs::remove_file(p);
        }
        let mut cmd = Command::new(&env.vzram_bin);
        cmd.args(["serve", "--fresh", "--state-dir"])
            .arg(&state)
            .arg("--socket")
            .arg(&socket)
            .args(["--size", &format_size(size), "--name", DEVICE])
            .args(extra)
            .arg("--control")
            .arg(&control);
        let mut daemon = Daemon::spawn("vzram", &mut cmd, log)?;
        // The control socket comes last, after the devices' (and their
        // incoming listeners).
        let mut paths = vec![socket.clone()];
        paths.extend(wait.iter().cloned());
        paths.push(control.clone());
        daemon.wait_for_paths(&paths, Duration::from_secs(30))?;
        Ok(Serve {
            daemon,
            control,
            socket,
            state,
        })
    }

    fn device(&self, env: &Env) -> Result<DeviceStat> {
        let st: StatReply = daemon::stat(&env.vzram_bin, &self.control)?;
        match st.devices.into_iter().find(|d| d.name == DEVICE) {
            Some(d) => Ok(d),
            None => bail!("vzram stat shows no device {DEVICE}"),
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.daemon.stop();
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(&self.control);
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

/// Write `[0, data)` of the device with corpus pages through one client.
fn fill(env: &Env, socket: &Path, data: u64) -> Result<()> {
    let mut c = Conn::connect(socket, 1, PREFILL_DEPTH, PAGE as u64, false)?;
    let bufs = c.buffers();
    let gen = OpGen::fill_once(0, data, c.prefill_chunk);
    let cfg = WorkerCfg {
        queue_index: 0,
        iodepth: PREFILL_DEPTH,
        corpus: &env.corpus,
        verify: false,
        allow_zero: true,
        slice_start: 0,
        think: Duration::ZERO,
    };
    let mut written = Bitmap::new(data);
    run_queue(
        &mut c.queues[0],
        bufs,
        &cfg,
        gen,
        Window::exhaust(Instant::now()),
        &mut written,
    )
    .context("filling the device")?;
    if written.count() * PAGE as u64 != data {
        bail!("the fill wrote {} pages", written.count());
    }
    Ok(())
}

pub fn run(env: &Env, args: &MigrateArgs, mut json: Option<JsonOut>) -> Result<MigrateResult> {
    if args.data > args.dev_size {
        bail!(
            "--data {} does not fit a {} device (--dev-size)",
            format_size(args.data),
            format_size(args.dev_size)
        );
    }
    if args.data == 0 || args.repeat == 0 {
        bail!("--data and --repeat must be more than 0");
    }
    let base = env.work_dir.join("migrate");
    let (dest_creds, source_creds) = make_pki(&base.join("pki"))?;
    // State on tmpfs, in this run's state directory (set by main).
    let states = std::env::var_os("VZRAM_STATE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&states).context(format!("creating {}", states.display()))?;

    let src_dir = base.join("src");
    let src = Serve::start(
        env,
        &src_dir,
        states.join("migrate-src"),
        args.dev_size,
        &["--tls-creds".into(), source_creds.display().to_string()],
        &[],
        src_dir.join("vzram.log"),
    )?;
    eprintln!("migrate: filling {} ...", format_size(args.data));
    let load_1m = crate::sys::load_1m();
    let t_fill = Instant::now();
    fill(env, &src.socket, args.data)?;
    let fill_s = t_fill.elapsed().as_secs_f64();
    let before = src.device(env)?;
    let orig = before.stats.orig_data_size;
    if orig == 0 || orig > args.data {
        bail!(
            "vzram stat says {orig} bytes stored after writing {}",
            args.data
        );
    }
    eprintln!(
        "migrate: source holds {} of guest data in {} ({} compressed)",
        format_size(orig),
        format_size(before.stats.mem_used_total),
        format_size(before.stats.compr_data_size)
    );

    let dst_dir = base.join("dst");
    let incoming = dst_dir.join("in.sock");
    let mut rounds = Vec::new();
    for rep in 0..args.repeat {
        for t in [Transport::Unix, Transport::Tls] {
            if crate::sys::interrupted() {
                bail!("interrupted");
            }
            let (addr, extra, wait) = match t {
                Transport::Unix => {
                    let addr = format!("unix:{}", incoming.display());
                    (
                        addr.clone(),
                        vec!["--incoming".into(), addr],
                        vec![incoming.clone()],
                    )
                }
                Transport::Tls => {
                    let addr = format!("tcp:127.0.0.1:{}", free_port()?);
                    let extra = vec![
                        "--incoming".into(),
                        addr.clone(),
                        "--tls-creds".into(),
                        dest_creds.display().to_string(),
                    ];
                    (addr, extra, Vec::new())
                }
            };
            let what = format!("round {rep}, {:?}", t);
            let dst = Serve::start(
                env,
                &dst_dir,
                states.join("migrate-dst"),
                args.dev_size,
                &extra,
                &wait,
                dst_dir.join(format!("vzram-{rep}-{t:?}.log").to_lowercase()),
            )
            .context(format!("{what}: starting the destination"))?;
            let r = one_round(env, &src, &dst, t, rep, &addr, orig)
                .map_err(|e| crate::error::Error(format!("{what}: {}", e.0)))?;
            eprintln!(
                "migrate: {what}: {:.3} s, stream {:.1} MiB/s, guest data {:.1} MiB/s",
                r.wall_s, r.stream_mib_s, r.guest_mib_s
            );
            drop(dst);
            rounds.push(r);
        }
    }
    let after = src.device(env)?;
    if after.stats.orig_data_size != orig {
        bail!(
            "the source holds {} bytes of guest data after the rounds, {orig} before",
            after.stats.orig_data_size
        );
    }
    drop(src);

    let unix = Summary::of(&rounds, Transport::Unix);
    let tls = Summary::of(&rounds, Transport::Tls);
    let pair_ratios: Vec<f64> = rounds
        .chunks(2)
        .filter(|p| p.len() == 2)
        .map(|p| p[1].stream_mib_s / p[0].stream_mib_s)
        .collect();
    let r = MigrateResult {
        record: "migrate".into(),
        data_bytes: args.data,
        dev_size: args.dev_size,
        corpus: env.corpus.name.clone(),
        cpus: crate::sys::nproc(),
        fill_s,
        orig_data_size: orig,
        compr_data_size: before.stats.compr_data_size,
        mem_used_total: before.stats.mem_used_total,
        ratio_median: median(&pair_ratios),
        pair_ratios,
        ratio_of_medians: tls.stream_median_mib_s / unix.stream_median_mib_s,
        unix,
        tls,
        rounds,
        load_1m,
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    if let Some(j) = json.as_mut() {
        j.write(&r)?;
    }
    Ok(r)
}

fn one_round(
    env: &Env,
    src: &Serve,
    dst: &Serve,
    t: Transport,
    rep: u32,
    addr: &str,
    orig: u64,
) -> Result<Round> {
    let waiting = dst.device(env)?.migration.state;
    if waiting != MigrationState::Incoming {
        bail!("the destination is {waiting:?}, not incoming");
    }
    let t0 = Instant::now();
    let mut child = Command::new(&env.vzram_bin)
        .arg("migrate")
        .arg("--control")
        .arg(&src.control)
        .args(["--device", DEVICE, "--to", addr, "--keep"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running vzram migrate")?;
    // No frontend on either side: once the destination holds every page
    // the operator commits (nothing else says where the VM runs).
    while child.try_wait().context("vzram migrate")?.is_none() {
        if src.device(env)?.migration.state == MigrationState::Committing {
            let c = Command::new(&env.vzram_bin)
                .arg("migrate")
                .arg("--control")
                .arg(&src.control)
                .args(["--device", DEVICE, "--commit"])
                .output()
                .context("running vzram migrate --commit")?;
            if !c.status.success() {
                bail!(
                    "vzram migrate --commit failed: {}",
                    String::from_utf8_lossy(&c.stderr).trim()
                );
            }
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let out = child.wait_with_output().context("vzram migrate")?;
    let wall = t0.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() {
        bail!(
            "vzram migrate failed ({}): {} {}; destination: {}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr).trim(),
            dst.daemon.log_tail()
        );
    }
    let Some(printed) = parse_printed(&stdout) else {
        bail!("cannot read the output of vzram migrate: {stdout:?}");
    };
    let s = src.device(env)?;
    let d = dst.device(env)?;
    if s.migration.state != MigrationState::Copied {
        bail!("the source is {:?} after migrate --keep", s.migration.state);
    }
    if d.migration.state != MigrationState::Received {
        bail!(
            "the destination is {:?} after the migrate",
            d.migration.state
        );
    }
    if s.stats.orig_data_size != orig || d.stats.orig_data_size != orig {
        bail!(
            "guest data: the source holds {} bytes, the destination {}, {orig} before",
            s.stats.orig_data_size,
            d.stats.orig_data_size
        );
    }
    let bytes = s.migration.bytes;
    if bytes.abs_diff(printed.bytes) > rounding(bytes) {
        bail!(
            "vzram migrate printed {} stream bytes, vzram stat says {bytes}",
            printed.bytes
        );
    }
    let daemon_s = if s.migration.total_ms > 0.0 {
        s.migration.total_ms / 1e3
    } else {
        printed.seconds
    };
    Ok(Round {
        transport: t,
        round: rep,
        wall_s: wall,
        daemon_s,
        stream_bytes: bytes,
        pages: printed.pages,
        passes: printed.passes,
        stream_mib_s: bytes as f64 / MIB / wall,
        guest_mib_s: orig as f64 / MIB / wall,
        output: stdout,
    })
}

pub fn print_table(r: &MigrateResult) {
    let stream = r.rounds.first().map_or(0, |x| x.stream_bytes);
    println!(
        "Each migration: {} of guest data ({} pages sent), a {:.1} MiB stream; `vzram migrate \
         --keep` timed wall-clock, a fresh destination daemon each time.\n",
        format_size(r.orig_data_size),
        r.rounds.first().map_or(0, |x| x.pages),
        stream as f64 / MIB,
    );
    println!(
        "| transport | rounds | stream: median MiB/s | min–max | guest data: median MiB/s | min–max | wall: median s | sender's own time: median MiB/s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (t, s) in [(Transport::Unix, &r.unix), (Transport::Tls, &r.tls)] {
        println!(
            "| {} | {} | **{:.1}** | {:.1}–{:.1} | **{:.1}** | {:.1}–{:.1} | {:.3} | {:.1} |",
            t.label(),
            s.rounds,
            s.stream_median_mib_s,
            s.stream_min_mib_s,
            s.stream_max_mib_s,
            s.guest_median_mib_s,
            s.guest_min_mib_s,
            s.guest_max_mib_s,
            s.wall_median_s,
            s.daemon_median_mib_s,
        );
    }
    let pairs: Vec<String> = r.pair_ratios.iter().map(|x| format!("{x:.2}")).collect();
    println!(
        "\nTLS / unix: **{:.2}** (median of the {} adjacent pairs: {}); ratio of the medians {:.2}.",
        r.ratio_median,
        r.pair_ratios.len(),
        pairs.join(", "),
        r.ratio_of_medians
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_vzram_migrate_prints() {
        let out = "device vm: migrated to tcp:127.0.0.1:40123: 131072 pages, 180.3 MiB in 1 \
                   passes, 0.6 s (300.1 MiB/s); last delta 0 pages in 0.2 ms; pages kept here";
        assert_eq!(
            parse_printed(out),
            Some(Printed {
                pages: 131072,
                bytes: (180.3 * MIB).round() as u64,
                passes: 1,
                seconds: 0.6,
                rate_mib_s: 300.1,
            })
        );
        let out = "device vm: migrated to unix:/tmp/a b/in.sock: 7 pages, 1023 B in 2 passes, \
                   0.0 s (0.0 MiB/s); last delta 7 pages in 1.0 ms; pages dropped here";
        let p = parse_printed(out).unwrap();
        assert_eq!((p.pages, p.bytes, p.passes), (7, 1023, 2));
        assert_eq!(
            parse_printed("device vm: commit asked; migration sent"),
            None
        );
        assert_eq!(parse_human("1.5 KiB"), Some(1536));
        assert_eq!(parse_human("2.0 GiB"), Some(2 << 30));
        assert_eq!(parse_human("12 parsecs"), None);
        // 1.04 GiB prints as "1.0 GiB".
        let b = (1.04 * (1u64 << 30) as f64) as u64;
        assert!(b.abs_diff(parse_human("1.0 GiB").unwrap()) <= rounding(b));
        assert_eq!(rounding(1000), 1);
        assert_eq!(rounding(2000), 1024 / 20 + 1);
    }

    #[test]
    fn summaries_and_ratios() {
        let round = |t, wall: f64| Round {
            transport: t,
            round: 0,
            wall_s: wall,
            daemon_s: wall / 2.0,
            stream_bytes: 100 << 20,
            pages: 1,
            passes: 1,
            stream_mib_s: 100.0 / wall,
            guest_mib_s: 200.0 / wall,
            output: String::new(),
        };
        let rs = vec![
            round(Transport::Unix, 1.0),
            round(Transport::Tls, 2.0),
            round(Transport::Unix, 0.5),
            round(Transport::Tls, 4.0),
            round(Transport::Unix, 2.0),
        ];
        let u = Summary::of(&rs, Transport::Unix);
        assert_eq!(u.rounds, 3);
        assert_eq!(u.stream_median_mib_s, 100.0);
        assert_eq!((u.stream_min_mib_s, u.stream_max_mib_s), (50.0, 200.0));
        assert_eq!(u.guest_median_mib_s, 200.0);
        assert_eq!(u.daemon_median_mib_s, 200.0);
        let t = Summary::of(&rs, Transport::Tls);
        assert_eq!(t.stream_median_mib_s, 37.5);
        assert_eq!(t.wall_median_s, 3.0);
        assert_eq!(median(&[]).is_nan(), min(&[]).is_nan());
    }
}
