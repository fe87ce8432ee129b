//! What is measured: the two daemons (started and stopped here) and the raw codec.

pub mod codec;
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
        Kind::Codec => bail!("codec is not a block target"),
    })
}
