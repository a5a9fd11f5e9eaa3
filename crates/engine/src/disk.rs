//! The prefix cache's disk tier at start-up (`--prompt-cache-dir`): the
//! model's fingerprint, and opening the tier on the engine's KV cache
//! (`mlxcel_kv::disk`).

use std::path::Path;
use std::time::UNIX_EPOCH;

use mlxcel_kv::disk::DiskError;
use mlxcel_kv::{DiskTierConfig, KvCache};

use crate::config::EngineConfig;
use crate::error::EngineError;

/// A hash of what identifies a checkpoint's files: the bytes of its
/// `config.json`, and the name, size and modification time of each of
/// its weight and JSON files (`*.safetensors`, `*.gguf`, `*.json`); for a
/// GGUF file, its name, size and modification time. A checkpoint
/// replaced or touched at the same path gets a new fingerprint, so the
/// disk tier never serves blocks computed by other weights (copying a
/// model costs its disk cache). Files it can't read count as absent.
pub(crate) fn model_fingerprint(path: &Path) -> u64 {
    let mut text = String::new();
    let mut describe = |p: &Path| {
        if let Ok(m) = std::fs::metadata(p) {
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            text.push_str(&format!("{name:?}|{}|{mtime};", m.len()));
        }
    };
    if path.is_dir() {
        let mut files: Vec<_> = std::fs::read_dir(path)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.extension()
                    .is_some_and(|e| e == "safetensors" || e == "gguf" || e == "json")
            })
            .collect();
        files.sort();
        for f in &files {
            describe(f);
        }
        if let Ok(config) = std::fs::read_to_string(path.join("config.json")) {
            text.push_str(&config);
        }
    } else {
        describe(path);
    }
    crate::platform::stable_hash(&text)
}

/// Checks `--prompt-cache-dir` against the rest of `config` before the
/// model loads.
///
/// # Errors
/// With tensor parallelism (the other ranks' pools would not get the
/// blocks read from disk) or without the prefix cache.
pub(crate) fn check(config: &EngineConfig) -> Result<(), EngineError> {
    if config.prompt_cache_dir.is_none() {
        return Ok(());
    }
    if config.tensor_parallel.is_some() {
        return Err(EngineError::Config(
            "--prompt-cache-dir does not run with --tensor-parallel".into(),
        ));
    }
    if !config.prefix_cache {
        return Err(EngineError::Config(
            "--prompt-cache-dir needs the prefix cache (drop --no-prompt-cache)".into(),
        ));
    }
    Ok(())
}

/// The disk tier `config` asks for, if any.
pub(crate) fn tier_config(config: &EngineConfig) -> Option<DiskTierConfig> {
    config.prompt_cache_dir.as_ref().map(|dir| DiskTierConfig {
        dir: dir.clone(),
        max_bytes: config.prompt_cache_disk_size,
        fingerprint: model_fingerprint(&config.model_dir),
    })
}

/// Opens `tier` on `kv`. A directory that can't be created or locked for
/// I/O reasons (read-only, missing permissions) leaves the cache in RAM
/// only, with one warning.
///
/// # Errors
/// Another server holds the directory; the cache has no prefix cache
/// (dense KV storage: `--parallel 1` picks it unless
/// `--decode-storage-backend paged`).
pub(crate) fn open(kv: &mut KvCache, tier: Option<&DiskTierConfig>) -> Result<(), EngineError> {
    let Some(tier) = tier else {
        return Ok(());
    };
    match kv.open_disk_tier(tier) {
        Ok(()) => {
            let s = kv.disk_stats().unwrap_or_default();
            tracing::info!(
                dir = %tier.dir.display(),
                blocks = s.blocks,
                bytes = s.bytes,
                capacity_bytes = s.capacity_bytes,
                foreign_files = s.foreign,
                "prompt cache disk tier open"
            );
            Ok(())
        }
        Err(e @ DiskError::Io { .. }) => {
            tracing::warn!(error = %e, "the prompt cache's disk tier is off; RAM only");
            Ok(())
        }
        Err(e) => Err(EngineError::Config(e.to_string())),
    }
}
