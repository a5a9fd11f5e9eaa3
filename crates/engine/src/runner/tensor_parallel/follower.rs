//! A follower rank (rank > 0) of a tensor-parallel group: it runs every
//! step rank 0 sends, over its shard of the model and a `KvReplica`, and
//! nothing else (no scheduler, no sampling).

use mlxcel_kv::KvReplica;

use super::wire::{broadcast, Plan};
use crate::config::EngineConfig;
use crate::error::{EngineError, GroupError, StepError};
use crate::loader::Opened;

/// Runs a follower rank (rank > 0) of `config.tensor_parallel`: loads its
/// shard of the model, allocates the K/V pool rank 0 announces, then runs
/// every step rank 0 broadcasts until it says stop.
///
/// # Errors
/// Loading errors; a Setup that does not match this rank's model; a
/// failed collective (rank 0 or another rank went away) or a failed step,
/// after which the group is broken: the process should exit, which closes
/// its connections so that the other ranks fail too instead of waiting.
pub fn run_follower(config: &EngineConfig) -> Result<(), EngineError> {
    let tp = config
        .tensor_parallel
        .ok_or_else(|| EngineError::Config("a follower needs --tensor-parallel".into()))?;
    let opened = Opened::open(config, Some(tp.shard))?;
    tracing::info!(
        rank = tp.shard.rank,
        ranks = tp.shard.size,
        dir = %config.model_dir.display(),
        dtype = ?opened.options.dtype,
        "tensor-parallel follower: loading its shard"
    );
    let model = opened.load()?;
    let setup = match broadcast(None)? {
        Plan::Setup(setup) => setup,
        Plan::Stop => return Ok(()),
        Plan::Step(_) => return Err(GroupError::Protocol("a step before the set-up").into()),
    };
    let c = model.config();
    if setup.model_type != c.model_type
        || setup.layers != c.num_hidden_layers
        || setup.dtype != model.dtype()
    {
        return Err(EngineError::Config(format!(
            "rank 0 serves {} ({} layers, {:?}); this rank loaded {} ({} layers, {:?}): start \
             every rank with the same model and flags",
            setup.model_type,
            setup.layers,
            setup.dtype,
            c.model_type,
            c.num_hidden_layers,
            model.dtype()
        )));
    }
    // Rank 0's KV dtype: every rank stores its heads' K/V alike, in the
    // same number of blocks.
    let kv_dtype = setup
        .kv_dtype
        .parse::<mlxcel_kv::KvCacheDtype>()
        .map_err(EngineError::Config)?;
    let layout = mlxcel_kv::KvLayout {
        kv_dtype,
        ..model.kv_layout()
    };
    let mut kv = KvReplica::new(layout, setup.num_blocks, setup.block_size)?;
    tracing::info!(
        rank = tp.shard.rank,
        num_blocks = setup.num_blocks,
        block_size = setup.block_size,
        kv_dtype = %kv_dtype,
        "tensor-parallel follower ready"
    );
    loop {
        match broadcast(None)? {
            Plan::Step(step) => {
                let rows = step.model_rows();
                let mut run = || -> Result<(), StepError> {
                    let mut view = kv.step(&step.layout)?;
                    let logits = model.build_step(&rows, None, &mut view, step.path)?.logits;
                    let mut outputs = vec![&logits];
                    outputs.extend(mlxcel_kv::AttentionKv::storage(&view));
                    mlxcel_mlx::eval(&outputs)?;
                    Ok(())
                };
                run().map_err(EngineError::FollowerStep)?;
            }
            Plan::Stop => {
                tracing::info!(rank = tp.shard.rank, "rank 0 stopped: follower exits");
                return Ok(());
            }
            Plan::Setup(_) => {
                return Err(GroupError::Protocol("a second set-up").into());
            }
        }
    }
}
