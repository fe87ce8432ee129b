//! What a target is: its name and algorithm, the environment it runs in, and what a
//! running block target offers. Apart from `targets/mod.rs` (which starts the
//! implementations) so that the implementations import this, not the module that
//! imports them.

use crate::data::Corpus;
use crate::error::{bail, Result};
use crate::sys::{Daemon, DaemonRss, ProcMem};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algo {
    Lz4,
    /// C liblz4: the codec target only (the store's lz4 is lz4_flex).
    Lz4C,
    Zstd(i32),
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Algo::Lz4 => f.write_str("lz4"),
            Algo::Lz4C => f.write_str("lz4-c"),
            Algo::Zstd(l) => write!(f, "zstd:{l}"),
        }
    }
}

impl FromStr for Algo {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.split_once(':') {
            None if s == "lz4" => Ok(Algo::Lz4),
            None if s == "lz4-c" => Ok(Algo::Lz4C),
            // zstd level 1: the level used for the codec anchors in the issue.
            None if s == "zstd" => Ok(Algo::Zstd(1)),
            Some(("zstd", l)) => l
                .parse::<i32>()
                .ok()
                .filter(|l| (-7..=22).contains(l))
                .map(Algo::Zstd)
                .ok_or_else(|| format!("bad zstd level {l:?} (want -7..=22)")),
            _ => Err(format!(
                "unknown algorithm {s:?} (want lz4, lz4-c, zstd or zstd:LEVEL)"
            )),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Qsd,
    Vzram,
    /// vzram from another binary (`--vzram-base-bin`): a build to compare against.
    VzramBase,
    /// A kernel zram device (lz4) exported by qemu-storage-daemon: what operators
    /// deploy instead of vzram.
    HostZram,
    Codec,
}

impl Kind {
    /// The name on the command line and in a result's `target_kind`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Qsd => "qsd",
            Kind::Vzram => "vzram",
            Kind::VzramBase => "vzram-base",
            Kind::HostZram => "host-zram",
            Kind::Codec => "codec",
        }
    }
}

/// A target as named on the command line: `qsd`, `vzram`, `vzram-base`, `host-zram`,
/// `codec`, optionally with its own algorithm: `vzram@zstd:3`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TargetSpec {
    pub kind: Kind,
    pub algo: Algo,
}

impl TargetSpec {
    pub fn parse(s: &str, default_algo: Algo) -> std::result::Result<Self, String> {
        let (name, algo) = match s.split_once('@') {
            Some((n, a)) => (n, Some(a.parse()?)),
            None => (s, None),
        };
        let kind = match name {
            "qsd" => Kind::Qsd,
            "vzram" => Kind::Vzram,
            "vzram-base" => Kind::VzramBase,
            "host-zram" => Kind::HostZram,
            "codec" => Kind::Codec,
            _ => {
                return Err(format!(
                    "unknown target {name:?} (want qsd, vzram, vzram-base, host-zram or codec)"
                ))
            }
        };
        // The kernel device is set up with lz4 only, whatever --algo says.
        let algo = match (kind, algo) {
            (Kind::HostZram, None | Some(Algo::Lz4)) => Algo::Lz4,
            (Kind::HostZram, Some(a)) => {
                return Err(format!("host-zram runs lz4 only, not {a}"));
            }
            (_, a) => a.unwrap_or(default_algo),
        };
        let t = TargetSpec { kind, algo };
        t.check_algo()?;
        Ok(t)
    }

    /// lz4-c is C liblz4 in-process; the daemons run the store's lz4_flex.
    pub fn check_algo(&self) -> std::result::Result<(), String> {
        if self.algo == Algo::Lz4C && self.kind != Kind::Codec {
            return Err(format!(
                "target {}: lz4-c (C liblz4) runs in the codec target only; the store's lz4 \
                 is lz4_flex (use lz4 here, or codec@lz4-c)",
                self.label()
            ));
        }
        Ok(())
    }

    pub fn label(&self) -> String {
        match self.kind {
            Kind::Qsd => "qsd".into(),
            Kind::Vzram => format!("vzram/{}", self.algo),
            Kind::VzramBase => format!("vzram-base/{}", self.algo),
            Kind::HostZram => "host-zram".into(),
            Kind::Codec => format!("codec/{}", self.algo),
        }
    }
}

/// Where things are and what to run; shared by every run of an invocation.
pub struct Env {
    pub work_dir: PathBuf,
    pub shm_dir: PathBuf,
    pub vzram_bin: PathBuf,
    /// The `vzram-base` target's binary, if any.
    pub vzram_base_bin: Option<PathBuf>,
    /// Extra `vzram serve` arguments of the `vzram` and `vzram-base` targets.
    pub vzram_args: Vec<String>,
    pub vzram_base_args: Vec<String>,
    pub qsd_bin: PathBuf,
    pub corpus: Corpus,
}

impl Env {
    /// Fail early, with the fix in the message, if a target's program is missing.
    pub fn check(&self, targets: &[TargetSpec]) -> Result<()> {
        for t in targets {
            t.check_algo()?;
            match t.kind {
                Kind::Qsd | Kind::HostZram if crate::sys::find_program(&self.qsd_bin).is_none() => {
                    bail!(
                        "{} not found (pass --qsd-bin, or leave {} out of --targets)",
                        self.qsd_bin.display(),
                        t.kind.name()
                    )
                }
                Kind::VzramBase => match &self.vzram_base_bin {
                    None => bail!("target vzram-base needs --vzram-base-bin"),
                    Some(b) if !b.is_file() => {
                        bail!("--vzram-base-bin {} not found", b.display())
                    }
                    Some(_) => {}
                },
                Kind::Vzram if !self.vzram_bin.is_file() => bail!(
                    "vzram binary {} not found (build it with `cargo build --release -p vzram`, \
                     pass --vzram-bin, or leave vzram out of --targets)",
                    self.vzram_bin.display()
                ),
                _ => {}
            }
        }
        Ok(())
    }
}

/// Host memory attributed to a target.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Memory {
    /// What the host pays: RSS of the daemon's processes without the guest RAM they
    /// map, plus the tmpfs file for qsd, the zram device for host-zram.
    pub host_bytes: u64,
    pub proc: ProcMem,
    /// Memory outside the process (the tmpfs image for qsd, the kernel's zram
    /// device for host-zram).
    pub extra_bytes: u64,
    /// Every process of the daemon (vzram: supervisor, launcher, workers), with the
    /// guest RAM they map, which `host_bytes` leaves out.
    pub tree: DaemonRss,
    /// Target-specific numbers (vzram's own stats, zram's mm_stat).
    pub details: serde_json::Value,
    /// vzram's stat or zram's mm_stat byte counts; None for another target, or
    /// when the stat failed (its error is in `details`).
    #[serde(skip)]
    pub stat_sizes: Option<StatSizes>,
}

/// vzram's daemon-wide byte counts (its stat's pool), or a zram device's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatSizes {
    pub mem_used_total: u64,
    pub compr_data_size: u64,
    pub orig_data_size: u64,
}

/// A running vhost-user-blk daemon.
pub trait BlockTarget {
    fn socket(&self) -> &Path;
    fn daemon(&mut self) -> &mut Daemon;
    fn memory(&mut self) -> Result<Memory>;
}

/// `--targets`: comma-separated names, each with `algo` unless it names its own.
pub fn parse_targets(s: &str, algo: Algo) -> Result<Vec<TargetSpec>> {
    let v: Vec<TargetSpec> = s
        .split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| TargetSpec::parse(t.trim(), algo))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| format!("--targets: {e}"))?;
    if v.is_empty() {
        bail!("--targets: empty");
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_and_algo_parsing() {
        let t = TargetSpec::parse("vzram@zstd:3", Algo::Lz4).unwrap();
        assert_eq!((t.kind, t.algo), (Kind::Vzram, Algo::Zstd(3)));
        assert_eq!(t.label(), "vzram/zstd:3");
        assert_eq!(TargetSpec::parse("qsd", Algo::Lz4).unwrap().label(), "qsd");
        assert_eq!("zstd".parse::<Algo>().unwrap(), Algo::Zstd(1));
        assert!("zstd:99".parse::<Algo>().is_err());
        assert!(TargetSpec::parse("nbd", Algo::Lz4).is_err());
        let c = TargetSpec::parse("codec@lz4-c", Algo::Lz4).unwrap();
        assert_eq!((c.algo, c.label()), (Algo::Lz4C, "codec/lz4-c".into()));
        for t in ["vzram@lz4-c", "vzram-base@lz4-c", "qsd@lz4-c"] {
            let e = TargetSpec::parse(t, Algo::Lz4).unwrap_err();
            assert!(e.contains("codec target only"), "{t}: {e}");
        }
        // The default algorithm too, for a target that names none.
        assert!(TargetSpec::parse("vzram", Algo::Lz4C).is_err());
        assert!(parse_targets("codec", Algo::Lz4C).is_ok());
        let b = TargetSpec::parse("vzram-base", Algo::Lz4).unwrap();
        assert_eq!(
            (b.kind, b.label()),
            (Kind::VzramBase, "vzram-base/lz4".into())
        );
    }

    #[test]
    fn host_zram_is_lz4_whatever_the_default() {
        for s in ["host-zram", "host-zram@lz4"] {
            let t = TargetSpec::parse(s, Algo::Zstd(3)).unwrap();
            assert_eq!((t.kind, t.algo), (Kind::HostZram, Algo::Lz4), "{s}");
            assert_eq!(t.label(), "host-zram");
            assert_eq!(t.kind.name(), "host-zram");
        }
        let e = TargetSpec::parse("host-zram@zstd", Algo::Lz4).unwrap_err();
        assert!(e.contains("lz4 only"), "{e}");
        let v = parse_targets("qsd, host-zram,vzram", Algo::Zstd(1)).unwrap();
        let kinds: Vec<Kind> = v.iter().map(|t| t.kind).collect();
        assert_eq!(kinds, [Kind::Qsd, Kind::HostZram, Kind::Vzram]);
        assert_eq!(v[2].algo, Algo::Zstd(1));
        let names: Vec<&str> = [Kind::Qsd, Kind::Vzram, Kind::VzramBase, Kind::Codec]
            .iter()
            .map(|k| k.name())
            .collect();
        assert_eq!(names, ["qsd", "vzram", "vzram-base", "codec"]);
    }
}
