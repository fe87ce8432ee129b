//! What is measured: the daemons (started and stopped here), a host's kernel zram
//! behind qemu-storage-daemon, and the raw codec.

pub mod codec;
pub mod host_zram;
pub mod qsd;
mod target;
pub mod vzram;

pub use target::{parse_targets, Algo, BlockTarget, Env, Kind, Memory, TargetSpec};

use crate::error::{bail, Result};

/// Start a block target with `queues` queues and a `size`-byte disk. `seq` keeps file
/// names unique within the invocation.
pub fn start_block(
    env: &Env,
    spec: &TargetSpec,
    queues: u32,
    size: u64,
    seq: usize,
) -> Result<Box<dyn BlockTarget>> {
    Ok(match spec.kind {
        Kind::Qsd => Box::new(qsd::Qsd::start(env, queues, size, seq)?),
        Kind::Vzram => Box::new(vzram::Vzram::start(
            env,
            &env.vzram_bin,
            &env.vzram_args,
            spec.algo,
            queues,
            size,
            seq,
        )?),
        Kind::VzramBase => match &env.vzram_base_bin {
            Some(bin) => Box::new(vzram::Vzram::start(
                env,
                bin,
                &env.vzram_base_args,
                spec.algo,
                queues,
                size,
                seq,
            )?),
            None => bail!("target vzram-base needs --vzram-base-bin"),
        },
        Kind::HostZram => Box::new(host_zram::HostZram::start(env, queues, size, seq)?),
        Kind::Codec => bail!("codec is not a block target"),
    })
}

/// Why this host cannot run a target, for those a run goes on without
/// (host-zram: no zram, not root, read-only sysfs).
pub fn unavailable(spec: &TargetSpec) -> Option<String> {
    match spec.kind {
        Kind::HostZram => host_zram::probe_host().err(),
        _ => None,
    }
}

/// The targets this host cannot run, each with why, once each.
pub fn skipped(targets: &[TargetSpec]) -> Vec<(TargetSpec, String)> {
    let mut out: Vec<(TargetSpec, String)> = Vec::new();
    for t in targets {
        if out.iter().all(|(s, _)| s != t) {
            if let Some(why) = unavailable(t) {
                out.push((*t, why));
            }
        }
    }
    out
}
