//! What the engine thread builds, decided from the configuration before
//! the model loads: the worker's options and the KV cache's sizing (one
//! pool per KV group, from the memory budget).

use mlxcel_kv::{
    Admission, GroupAdmission, KvCache, KvCacheConfig, KvCacheDtype, KvGroupConfig, KvLayout,
    LayerState, PrefixCacheConfig, RecurrentConfig, StorageBackend,
};
use mlxcel_model::Model;

use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::scheduler::SchedulerConfig;
use crate::worker::WorkerConfig;

/// What the engine thread builds after loading, decided from the config.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EnginePlan {
    /// The worker's options.
    pub(crate) worker: WorkerConfig,
    /// Tokens per KV block.
    block_size: usize,
    /// KV cache budget in bytes (`None`: auto).
    budget: Option<usize>,
    backend: StorageBackend,
    /// How K/V are stored.
    kv_dtype: KvCacheDtype,
    /// Prefix cache: (extra key, capacity in blocks) when on (paged
    /// storage only).
    prefix: Option<(u64, Option<usize>)>,
    /// Under `--tensor-parallel` (one KV group only).
    tensor_parallel: bool,
}

/// What the engine thread reports once ready.
pub(crate) struct Loaded {
    /// KV storage in use.
    pub(crate) backend: StorageBackend,
    /// Blocks in the KV pools (every group's together).
    pub(crate) blocks: usize,
    /// Tokens per block.
    pub(crate) block_size: usize,
    /// Prompt plus completion tokens one request may hold.
    pub(crate) max_request_tokens: usize,
    /// The admission rule per KV group.
    pub(crate) admission: GroupAdmission,
}

impl EnginePlan {
    /// The plan of `config` on this device; `extra_key` identifies the
    /// model in the prefix cache.
    ///
    /// # Errors
    /// A zero `--parallel`, `--kv-block-size` or `--prefill-chunk-size`.
    pub(crate) fn new(
        config: &EngineConfig,
        gpu: bool,
        extra_key: u64,
    ) -> Result<Self, EngineError> {
        if config.parallel == 0 || config.kv_block_size == 0 || config.prefill_chunk_size == 0 {
            return Err(EngineError::Config(
                "--parallel, --kv-block-size and --prefill-chunk-size must be at least 1".into(),
            ));
        }
        let tile = config
            .prefill_tile
            .unwrap_or_else(|| crate::platform::auto_prefill_tile(gpu));
        let quantized = config.kv_cache_dtype.bits().is_some();
        let backend = config.storage_backend.unwrap_or(
            if config.parallel > 1 || quantized || config.deterministic {
                StorageBackend::Paged
            } else {
                StorageBackend::Dense
            },
        );
        if config.deterministic {
            Self::check_deterministic(config, gpu, backend)?;
        }
        if quantized && backend == StorageBackend::Dense {
            return Err(EngineError::Config(format!(
                "--kv-cache-dtype {} stores quantized blocks in the paged pool; \
                 drop --decode-storage-backend dense",
                config.kv_cache_dtype
            )));
        }
        Ok(EnginePlan {
            worker: WorkerConfig {
                scheduler: SchedulerConfig {
                    snapshot_block: 0,
                    prefill_chunk_size: config.prefill_chunk_size,
                    prefill_tile: tile,
                },
                parallel: config.parallel,
                attention_path: config.attention_path,
                check_invariants: config.check_invariants,
                max_kv_size: config.max_kv_size,
                pipeline: config.pipeline,
                pipelined_verification: config.pipelined_verification,
                speculative: config.speculative,
                batch_invariant: config
                    .deterministic
                    .then(|| mlxcel_model::invariant::Chunking::for_device(gpu)),
                #[cfg(feature = "fault-injection")]
                fault: config.fault,
            },
            block_size: config.kv_block_size,
            budget: config.kv_cache_budget,
            kv_dtype: config.kv_cache_dtype,
            backend,
            // Several KV groups force paged storage (`kv_cache`), so the
            // prefix cache is decided with the cache.
            prefix: config
                .prefix_cache
                .then_some((extra_key, config.prefix_cache_capacity)),
            tensor_parallel: config.tensor_parallel.is_some(),
        })
    }

    /// What `--deterministic` needs: paged storage, on a GPU the paged
    /// attention path (its kernel attends every query), and one process.
    ///
    /// # Errors
    /// [`EngineError::Config`] naming the flag in the way.
    fn check_deterministic(
        config: &EngineConfig,
        gpu: bool,
        backend: StorageBackend,
    ) -> Result<(), EngineError> {
        if config.tensor_parallel.is_some() {
            return Err(EngineError::Config(
                "--deterministic does not run with --tensor-parallel yet".into(),
            ));
        }
        if backend == StorageBackend::Dense {
            return Err(EngineError::Config(
                "--deterministic attends from the paged KV pool; drop \
                 --decode-storage-backend dense"
                    .into(),
            ));
        }
        if gpu && config.attention_path != mlxcel_model::AttentionPath::PagedDecode {
            return Err(EngineError::Config(
                "--deterministic attends every query through the paged-attention kernel \
                 on a GPU; drop --attention-path"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The KV cache: the model's layers grouped by window into KV groups
    /// (`mlxcel_kv::KvGroupConfig`), sized from the budget (auto: `parallel`
    /// full contexts of the full-attention layers plus the window groups'
    /// share, at most a quarter of physical memory). Each window group gets
    /// room for `parallel` sequences at their worst (its keep plus a chunk:
    /// `Admission::blocks_for`) twice over, half for running sequences and
    /// half for the prefix cache; the first group (full attention, when the
    /// model has such layers) gets the rest. Several groups need paged
    /// storage, and can't run under tensor parallelism.
    pub(crate) fn kv_cache(&self, model: &dyn Model) -> Result<KvCache, EngineError> {
        let layout = KvLayout {
            kv_dtype: self.kv_dtype,
            ..model.kv_layout()
        };
        let states = model.layer_states();
        let recurrent = self.recurrent_config(&states)?;
        let windows: Vec<Option<usize>> = states.iter().map(LayerState::window).collect();
        let mut groups = KvGroupConfig::from_layer_windows(&windows, self.worker.max_kv_size);
        // Recurrent layers keep no K/V, nor do layers that read another
        // layer's: they leave the attention groups.
        let shared = LayerState::shared_layers(&states);
        for g in &mut groups {
            g.layers
                .retain(|l| !recurrent.layers.contains(l) && !shared.iter().any(|s| s.0 == *l));
        }
        if groups.len() > 1 {
            groups.retain(|g| !g.layers.is_empty());
        }
        let mut backend = self.backend;
        if groups.len() > 1 {
            if self.tensor_parallel {
                return Err(EngineError::Config(format!(
                    "--tensor-parallel serves models whose layers share one attention window; \
                     this one has {} KV groups (sliding-window and full layers)",
                    groups.len()
                )));
            }
            if backend == StorageBackend::Dense {
                tracing::info!("KV groups need paged storage: using it");
                backend = StorageBackend::Paged;
            }
        }
        let bs = self.block_size;
        let group_bytes = |g: &KvGroupConfig| {
            KvLayout {
                layers: g.layers.len(),
                ..layout
            }
            .bytes_per_token()
                * bs
        };
        let (tile, chunk) = (
            self.worker.scheduler.prefill_tile,
            self.worker.scheduler.prefill_chunk_size,
        );
        // Window groups after the first: fixed room; the first takes the rest.
        // The recurrent state (entries of running sequences, snapshots) is
        // fixed room too.
        let mut fixed_bytes = recurrent.bytes_total(self.worker.parallel);
        for g in groups.iter_mut().skip(1) {
            let worst = Admission::new(bs, tile, g.keep, chunk).blocks_for(usize::MAX);
            g.num_blocks = 2 * self.worker.parallel * worst;
            fixed_bytes += g.num_blocks * group_bytes(g);
        }
        let first_bytes = group_bytes(&groups[0]).max(1);
        let per_seq = model.config().max_position_embeddings * first_bytes / bs;
        let budget = self.budget.unwrap_or_else(|| {
            (per_seq * self.worker.parallel + fixed_bytes)
                .min(crate::platform::physical_memory_bytes() / 4)
        });
        groups[0].num_blocks = budget.saturating_sub(fixed_bytes) / first_bytes;
        let num_blocks = groups.iter().map(|g| g.num_blocks).sum();
        let prefix = self.prefix.map(|(extra_key, cap)| PrefixCacheConfig {
            extra_key,
            capacity_blocks: cap.unwrap_or(num_blocks),
        });
        let config = KvCacheConfig {
            layout,
            block_size: bs,
            num_blocks,
            backend,
            prefix: prefix.filter(|_| backend == StorageBackend::Paged),
        };
        for g in &groups {
            let slack = Admission::new(bs, tile, g.keep, chunk).slack();
            if g.num_blocks <= slack {
                return Err(EngineError::Config(format!(
                    "a KV cache budget of {budget} bytes holds {} blocks of {bs} tokens \
                     for the layers {:?}; at least {} are needed",
                    g.num_blocks,
                    g.layers,
                    slack + 1
                )));
            }
            tracing::info!(
                layers = g.layers.len(),
                window = ?g.window,
                keep = ?g.keep,
                blocks = g.num_blocks,
                bytes = g.num_blocks * group_bytes(g),
                "KV group"
            );
        }
        tracing::info!(budget_bytes = budget, blocks = num_blocks, groups = groups.len(), backend = %backend, "allocating KV cache");
        Ok(KvCache::with_shared_layers(
            config, groups, recurrent, &shared,
        )?)
    }

    /// The recurrent layers of a model whose layers keep `states`: their
    /// per-sequence state bytes (float32 bound) and the prefix cache's
    /// snapshots (`2 × --parallel + 2`, none without a prefix cache).
    ///
    /// # Errors
    /// Recurrent layers under `--tensor-parallel`.
    fn recurrent_config(&self, states: &[LayerState]) -> Result<RecurrentConfig, EngineError> {
        let mut config = RecurrentConfig::default();
        for (layer, state) in states.iter().enumerate() {
            if let LayerState::Recurrent { shapes } = state {
                config.layers.push(layer);
                config.bytes_per_sequence += shapes
                    .iter()
                    .map(|s| s.iter().product::<usize>() * 4)
                    .sum::<usize>();
            }
        }
        if config.layers.is_empty() {
            return Ok(config);
        }
        if self.tensor_parallel {
            return Err(EngineError::Config(format!(
                "--tensor-parallel does not split recurrent layers yet (layer {} keeps a \
                 recurrent state)",
                config.layers[0]
            )));
        }
        if self.prefix.is_some() {
            config.snapshots = 2 * self.worker.parallel + 2;
        }
        tracing::info!(
            layers = config.layers.len(),
            bytes_per_sequence = config.bytes_per_sequence,
            sequence_entries = mlxcel_kv::ENTRIES_KEPT,
            snapshots = config.snapshots,
            "recurrent state (besides the KV budget)"
        );
        Ok(config)
    }

    /// The draft model's KV cache (`--speculative draft`): room for as
    /// many tokens as the target's first KV group holds in `target`, with
    /// its own prefix cache.
    ///
    /// # Errors
    /// As [`EnginePlan::kv_cache`].
    pub(crate) fn draft_kv_cache(
        &self,
        draft: &dyn Model,
        target: &KvCache,
    ) -> Result<KvCache, EngineError> {
        let tokens = target.group_pool(0).map_or(0, |p| p.counts().total) * self.block_size;
        let plan = EnginePlan {
            // As the draft's K/V are stored (the same --kv-cache-dtype).
            budget: Some(
                tokens
                    * KvLayout {
                        kv_dtype: self.kv_dtype,
                        ..draft.kv_layout()
                    }
                    .bytes_per_token(),
            ),
            ..*self
        };
        let kv = plan.kv_cache(draft)?;
        if let Some(&layer) = kv.recurrent().layers.first() {
            return Err(EngineError::Config(format!(
                "the draft model's layer {layer} keeps a recurrent state, which cannot \
                 rewind rejected drafts; use a draft model of attention layers only"
            )));
        }
        Ok(kv)
    }

    /// What the engine reports once `kv` is built.
    pub(crate) fn loaded(&self, kv: &KvCache) -> Loaded {
        let c = kv.config();
        Loaded {
            backend: c.backend,
            blocks: c.num_blocks,
            block_size: c.block_size,
            // With a KV window a request holds at most the window plus a
            // chunk, whatever its length.
            max_request_tokens: self.worker.admission(kv).max_request_tokens(),
            admission: self.worker.admission(kv),
        }
    }
}
