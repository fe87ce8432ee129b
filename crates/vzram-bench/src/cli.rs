//! Command line (clap derive); sizes are parsed by `units`.

use crate::job::JobKind;
use crate::targets::Algo;
use crate::units::parse_size;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "vzram-bench",
    version,
    about = "Benchmark vzram against qemu-storage-daemon (a tmpfs file, or the host's \
             kernel zram) and the raw codec: same client (libblkio virtio-blk-vhost-user), \
             same data, same machine, same run."
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Run one fio-like job against one or more targets.
    Run(RunArgs),
    /// The standard comparison, shaped like a swapping guest on one queue: 4K
    /// randread and randwrite QD32, 4K randread QD1, 64K randwrite QD8 (swap-out),
    /// 32K randread QD8 and QD1 (swap-in readahead), and memory per GiB stored; for
    /// qsd, vzram and the codec ceiling (and host-zram when named in --targets).
    /// Queue counts: `scaling`.
    Compare(CompareArgs),
    /// vzram (and qsd for contrast) at 1, 2, 4... queues, up to the core count.
    Scaling(ScalingArgs),
    /// One vzram daemon with many idle devices: RSS per device, threads, fds, start-up,
    /// over the daemon's whole process tree; with --connect, also with a frontend
    /// connected to every device (one worker process each).
    Density(DensityArgs),
    /// Worker restart time: a device holding data and a connected client; SIGKILL the
    /// device's worker (pid from `vzram stat --json`) and time until a new connection
    /// completes its first 4 KiB read. Also times a clean disconnect + reconnect (a new
    /// worker without the supervisor's failure backoff). Medians and p90.
    Restart(RestartArgs),
    /// Migration stream throughput: `vzram migrate --keep` of one device holding corpus
    /// pages to a fresh incoming daemon on this host, over unix: (plain) and over
    /// tcp:127.0.0.1 (mutual TLS, certificates made for the run), interleaved; medians
    /// of the stream and guest-data MiB/s per transport and the TLS/unix ratio.
    Migrate(MigrateArgs),
    /// A guest's swap test, timed: the test guest (contrib/guest, QEMU TCG) runs the e2e
    /// swap scenario against each target in turn, interleaved; the guest's swap-test
    /// and pressure seconds, QEMU's wall and CPU time and the daemon's CPU time over
    /// the run, medians and vzram/qsd ratios.
    Guest(GuestArgs),
    /// Print the table (and draw the plot) again from a --json results file.
    Report(ReportArgs),
    /// Each codec implementation on the corpus, one 4 KiB page per call on one
    /// thread: compress and decompress ns/page (medians of passes over the
    /// corpus, implementations interleaved), ratio, speed against lz4_flex.
    Codecs(CodecsArgs),
}

#[derive(Args, Debug, Clone)]
pub struct Common {
    /// Page corpus: a flat file of 4 KiB pages [default: ../shared/data/anon-pages.bin
    /// when present, else the synthetic mix]
    #[arg(long, value_name = "FILE", conflicts_with = "synthetic")]
    pub data: Option<PathBuf>,
    /// Use the built-in synthetic page mix (deterministic, lz4 ratio ~2.5-3).
    #[arg(long)]
    pub synthetic: bool,
    /// Disk size per run (K, M, G suffixes, powers of two).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub size: u64,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 10.0)]
    pub runtime: f64,
    /// Seconds run before measuring starts.
    #[arg(long, default_value_t = 1.0)]
    pub ramp: f64,
    /// Runs per configuration, targets interleaved (A B A B...); medians are reported.
    #[arg(long)]
    pub repeat: Option<u32>,
    /// Compression algorithm for vzram and codec targets: lz4, zstd, zstd:LEVEL
    /// (host-zram is always lz4).
    #[arg(long, default_value = "lz4")]
    pub algo: Algo,
    /// Append results as JSON lines to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Draw a PNG: IOPS by queue count, memory per GiB stored.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    #[command(flatten)]
    pub daemons: Daemons,
    /// Check every read against the corpus (costs client CPU).
    #[arg(long)]
    pub verify: bool,
    /// Use libblkio poll queues (busy-polling client) instead of completion eventfds.
    #[arg(long)]
    pub poll: bool,
    /// Microseconds each queue waits after a completion before it submits
    /// the next request (fio's thinktime): a guest that does I/O now and
    /// then, to see what the daemon costs when it is not saturated.
    #[arg(long, value_name = "US", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub think_us: u64,
    /// Seconds to wait after the job before measuring memory (the first
    /// measurement, at the job's end, is kept beside it): pages a daemon
    /// staged raw are compressed in the background meanwhile.
    #[arg(long, value_name = "S", default_value_t = 0.0)]
    pub settle: f64,
}

/// The daemons under test and where they run: the same flags for every
/// subcommand that starts them.
#[derive(Args, Debug, Clone)]
pub struct Daemons {
    /// The vzram daemon [default: next to this binary, else target/release/vzram]
    #[arg(long, value_name = "PATH")]
    pub vzram_bin: Option<PathBuf>,
    /// Another vzram build, run as target `vzram-base` (e.g. `--targets
    /// vzram-base,vzram`): before/after in the same run, interleaved, with ratios.
    #[arg(long, value_name = "PATH")]
    pub vzram_base_bin: Option<PathBuf>,
    /// Extra `vzram serve` arguments for target `vzram`, split at spaces
    /// (e.g. "--compress-threads 0").
    #[arg(
        long,
        value_name = "ARGS",
        default_value = "",
        allow_hyphen_values = true
    )]
    pub vzram_args: String,
    /// Extra `vzram serve` arguments for target `vzram-base`; without
    /// --vzram-base-bin, `vzram-base` is then the same binary as `vzram`, so one
    /// build can be compared with two settings in one run.
    #[arg(
        long,
        value_name = "ARGS",
        default_value = "",
        allow_hyphen_values = true
    )]
    pub vzram_base_args: String,
    /// qemu-storage-daemon, for targets qsd and host-zram.
    #[arg(long, value_name = "PATH", default_value = "qemu-storage-daemon")]
    pub qsd_bin: PathBuf,
    /// Sockets, daemon logs (and guest consoles) [default: /tmp/vzram-bench-PID]
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
    /// tmpfs directory for qsd's disk image.
    #[arg(long, value_name = "DIR", default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[arg(value_enum)]
    pub job: JobKind,
    /// Block size: 4K or a multiple of it.
    #[arg(long, default_value = "4K", value_parser = parse_size)]
    pub bs: u64,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = 32)]
    pub iodepth: u32,
    /// Queues, one client thread each.
    #[arg(long, default_value_t = 1)]
    pub queues: u32,
    /// Write the whole region with corpus content before measuring [default: on for
    /// jobs that read, so reads do not hit never-written (zero) blocks].
    #[arg(long, overrides_with = "no_prefill")]
    pub prefill: bool,
    #[arg(long)]
    pub no_prefill: bool,
    /// Comma-separated: qsd, vzram, vzram-base (needs --vzram-base-bin), host-zram,
    /// codec; an algorithm may follow '@' (vzram@zstd:3). host-zram is a kernel
    /// zram device (lz4, hot-added, reset after the run) behind qemu-storage-daemon
    /// with O_DIRECT; it needs root and is skipped, with the reason, without zram.
    #[arg(long, default_value = "qsd,vzram,codec")]
    pub targets: String,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug)]
pub struct CompareArgs {
    /// As for `run`; qsd and host-zram, when named, also get a memory fill.
    #[arg(long, default_value = "qsd,host-zram,vzram,codec")]
    pub targets: String,
    /// Algorithms whose memory per GiB stored is measured (fill runs).
    #[arg(long, default_value = "lz4,zstd:1")]
    pub mem_algos: String,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug)]
pub struct ScalingArgs {
    /// Highest queue count [default: number of CPUs]
    #[arg(long)]
    pub max_queues: Option<u32>,
    #[arg(long, default_value = "randread,randwrite")]
    pub jobs: String,
    #[arg(long, default_value_t = 32)]
    pub iodepth: u32,
    #[arg(long, default_value = "4K", value_parser = parse_size)]
    pub bs: u64,
    /// As for `run` (qsd, vzram, vzram-base, host-zram, codec).
    #[arg(long, default_value = "vzram,qsd")]
    pub targets: String,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug)]
pub struct DensityArgs {
    /// Device counts to try, one daemon each.
    #[arg(long, default_value = "100,500,1000", value_delimiter = ',')]
    pub devices: Vec<usize>,
    /// Size of each (idle) device.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub dev_size: u64,
    #[arg(long, default_value_t = 1)]
    pub queues: u32,
    /// Pass the devices as a TOML [[device]] file (--config) instead of --device flags.
    #[arg(long)]
    pub config: bool,
    /// Seconds to wait for all sockets.
    #[arg(long, default_value_t = 120.0)]
    pub timeout: f64,
    /// After start-up, connect a client (1 queue, one 4 KiB buffer) to every device,
    /// write and read back 4 KiB on each, and measure again with all of them still
    /// connected: each worker's RSS split into RssAnon/RssFile/RssShmem, its RSS without
    /// the guest RAM it maps, the supervisor's RSS.
    #[arg(long)]
    pub connect: bool,
    #[arg(long, value_name = "PATH")]
    pub vzram_bin: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct RestartArgs {
    /// Data written to the device before the kills, one daemon per size.
    #[arg(long, default_value = "64M,512M", value_delimiter = ',', value_parser = parse_size)]
    pub data: Vec<u64>,
    /// Kills per size (and as many clean reconnects).
    #[arg(long, default_value_t = 10)]
    pub repeat: u32,
    /// Device size; must hold the largest --data.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub dev_size: u64,
    /// Page corpus written [default: ../shared/data/anon-pages.bin when present, else
    /// the synthetic mix]
    #[arg(long, value_name = "FILE", conflicts_with = "synthetic")]
    pub corpus: Option<PathBuf>,
    /// Write the built-in synthetic page mix instead.
    #[arg(long)]
    pub synthetic: bool,
    #[arg(long, value_name = "PATH")]
    pub vzram_bin: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// Data written to the source device (corpus pages from offset 0).
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    pub data: u64,
    /// Migrations per transport, transports interleaved (unix, tls, unix, tls...).
    #[arg(long, default_value_t = 5)]
    pub repeat: u32,
    /// Device size (both ends); must hold --data.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub dev_size: u64,
    /// Page corpus written [default: ../shared/data/anon-pages.bin when present, else
    /// the synthetic mix]
    #[arg(long, value_name = "FILE", conflicts_with = "synthetic")]
    pub corpus: Option<PathBuf>,
    /// Write the built-in synthetic page mix instead.
    #[arg(long)]
    pub synthetic: bool,
    #[arg(long, value_name = "PATH")]
    pub vzram_bin: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Defaults are those of the e2e swap test (`tests/e2e.rs`, `swap_under_pressure`):
/// a 1 GiB lz4 disk with 2 queues, a 256 MiB guest, 2 pressure rounds.
#[derive(Args, Debug)]
pub struct GuestArgs {
    /// Comma-separated: vzram, qsd, vzram-base (needs --vzram-base-bin or
    /// --vzram-base-args), host-zram; an algorithm may follow '@' (vzram@zstd:3).
    #[arg(long, default_value = "vzram,qsd")]
    pub targets: String,
    /// Boots per target, targets interleaved (A B A B...); medians are reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// Pressure rounds in the guest (`vzram.rounds=`).
    #[arg(long, default_value_t = 2)]
    pub rounds: u32,
    /// Guest RAM; the pressure is 1.5x what the guest sees of it.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub mem: u64,
    /// Queues of the disk and of QEMU's vhost-user-blk device.
    #[arg(long, default_value_t = 2)]
    pub queues: u32,
    /// Disk size (the guest swaps on all of it).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub size: u64,
    /// Compression algorithm for vzram targets.
    #[arg(long, default_value = "lz4")]
    pub algo: Algo,
    /// Seconds one boot may take before QEMU is killed and the run fails.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    /// The guest's boot script [default: contrib/guest/run.sh in the current
    /// directory, else in the source tree this was built from]
    #[arg(long, value_name = "PATH")]
    pub run_sh: Option<PathBuf>,
    /// Append results as JSON lines to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub daemons: Daemons,
}

#[derive(Args, Debug)]
pub struct CodecsArgs {
    /// Comma-separated: lz4 and zstd:LEVEL (vzram-store's own codec functions:
    /// lz4_flex, libzstd), codec@lz4 (lz4_flex compiled into the codec target),
    /// lz4-c (C liblz4, state reused with fastReset), lz4-c/full (liblz4, state
    /// zeroed per page).
    #[arg(
        long,
        default_value = "lz4,lz4-c,lz4-c/full,codec@lz4,zstd:-5,zstd:-1,zstd:1,zstd:3,zstd:9"
    )]
    pub codecs: String,
    /// Timed passes over the corpus per implementation; medians are reported.
    #[arg(long, default_value_t = 5)]
    pub repeat: u32,
    /// Page corpus [default: ../shared/data/anon-pages.bin when present, else the
    /// synthetic mix]
    #[arg(long, value_name = "FILE", conflicts_with = "synthetic")]
    pub data: Option<PathBuf>,
    /// Use the built-in synthetic page mix.
    #[arg(long)]
    pub synthetic: bool,
    /// Append results as JSON lines (record "codecs") to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Also time a checksum (CRC32C, CRC32) over each page's lz4 object
    /// against lz4's decode and encode of it (records "checksum").
    #[arg(long)]
    pub checksums: bool,
}

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// A file written with --json.
    pub input: PathBuf,
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_args() {
        let cli = Cli::try_parse_from([
            "vzram-bench",
            "run",
            "randread",
            "--bs",
            "8k",
            "--iodepth",
            "32",
            "--queues",
            "2",
            "--runtime",
            "5",
            "--targets",
            "qsd,host-zram,codec",
            "--synthetic",
            "--algo",
            "zstd:3",
        ])
        .unwrap();
        let Cmd::Run(r) = cli.cmd else { panic!() };
        assert_eq!(r.job, JobKind::Randread);
        assert_eq!((r.bs, r.iodepth, r.queues), (8192, 32, 2));
        assert_eq!(r.common.runtime, 5.0);
        assert_eq!(r.common.algo, Algo::Zstd(3));
        assert!(r.common.synthetic);
        assert!(!r.prefill);
        assert_eq!(r.targets, "qsd,host-zram,codec");
    }

    #[test]
    fn bad_args_are_rejected() {
        for args in [
            &["vzram-bench", "run", "randfoo"][..],
            &["vzram-bench", "run", "read", "--bs", "4X"],
            &["vzram-bench", "run", "read", "--algo", "gzip"],
            &["vzram-bench", "run", "read", "--data", "x", "--synthetic"],
        ] {
            assert!(Cli::try_parse_from(args).is_err(), "{args:?}");
        }
        let d = Cli::try_parse_from(["vzram-bench", "density", "--devices", "1,5"]).unwrap();
        let Cmd::Density(d) = d.cmd else { panic!() };
        assert_eq!(d.devices, vec![1, 5]);
        assert!(!d.connect);
        let r = Cli::try_parse_from(["vzram-bench", "restart", "--data", "1M,2G"]).unwrap();
        let Cmd::Restart(r) = r.cmd else { panic!() };
        assert_eq!(r.data, vec![1 << 20, 2 << 30]);
        assert_eq!(r.repeat, 10);
        let m = Cli::try_parse_from(["vzram-bench", "migrate"]).unwrap();
        let Cmd::Migrate(m) = m.cmd else { panic!() };
        assert_eq!((m.data, m.dev_size, m.repeat), (512 << 20, 1 << 30, 5));
        let m = Cli::try_parse_from(["vzram-bench", "migrate", "--data", "64M", "--repeat", "2"])
            .unwrap();
        let Cmd::Migrate(m) = m.cmd else { panic!() };
        assert_eq!((m.data, m.repeat), (64 << 20, 2));
        assert!(Cli::try_parse_from(["vzram-bench", "migrate", "--data", "1M,2M"]).is_err());
        let c = Cli::try_parse_from(["vzram-bench", "codecs", "--repeat", "3"]).unwrap();
        let Cmd::Codecs(c) = c.cmd else { panic!() };
        assert_eq!(c.repeat, 3);
        assert!(c.codecs.starts_with("lz4,lz4-c,"));
    }

    #[test]
    fn guest_args() {
        let g = Cli::try_parse_from(["vzram-bench", "guest"]).unwrap();
        let Cmd::Guest(g) = g.cmd else { panic!() };
        assert_eq!(g.targets, "vzram,qsd");
        assert_eq!((g.repeat, g.rounds, g.queues), (3, 2, 2));
        assert_eq!((g.mem, g.size, g.algo), (256 << 20, 1 << 30, Algo::Lz4));
        let g = Cli::try_parse_from([
            "vzram-bench",
            "guest",
            "--targets",
            "qsd",
            "--repeat",
            "5",
            "--rounds",
            "3",
            "--mem",
            "512M",
            "--vzram-args",
            "--compress-threads 2",
        ])
        .unwrap();
        let Cmd::Guest(g) = g.cmd else { panic!() };
        assert_eq!((g.repeat, g.rounds, g.mem), (5, 3, 512 << 20));
        assert_eq!(g.daemons.vzram_args, "--compress-threads 2");
        assert!(Cli::try_parse_from(["vzram-bench", "guest", "--mem", "lots"]).is_err());
    }
}
