//! The disk tier of a [`KvCache`]'s prefix cache (crate::disk): cached
//! blocks evicted from a pool are saved before their new holder writes
//! them, every cached block is saved at a clean stop, and a prompt lookup
//! that runs past what RAM holds first loads the blocks it needs from
//! disk into the pools, registered as if they had been computed here.
//!
//! Everything runs on the engine thread, synchronously: a save reads the
//! blocks' K/V back from the pool arrays (one gather per layer for every
//! block evicted by one allocation), a load reads and checks the files (on
//! several threads, [`DiskStore::get_many`]) and writes them in (one
//! scatter per layer for every block one lookup loads).
//!
//! A model with recurrent layers resumes only where a state snapshot is
//! kept (crate::recurrent): snapshots evicted from the snapshot store, and
//! every snapshot at a clean stop, are saved too, and a lookup that would
//! end at a boundary whose snapshot is on disk only reads it back with the
//! blocks.

use std::path::PathBuf;
use std::rc::Rc;

use mlxcel_mlx::Array;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{Group, KvCache};
use crate::disk::format::{self, BlockMeta, StateArray, FORMAT_VERSION};
use crate::disk::{DiskError, DiskStore, DiskTierStats};
use crate::error::KvError;
use crate::hash::{BlockHash, BLOCK_HASH_SEED};
use crate::pool::BlockId;
use crate::prefix::{extend_hashes, hold_from};
use crate::recurrent::{RecurrentConfig, Snapshot};
use crate::storage::KvLayout;
use crate::StorageBackend;

/// Blocks saved per gather at a clean stop (bounds the host memory one
/// batch takes: `SAVE_BATCH × block bytes` as stored).
const SAVE_BATCH: usize = 64;

/// How to open the disk tier ([`KvCache::open_disk_tier`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskTierConfig {
    /// The directory (created if missing).
    pub dir: PathBuf,
    /// Most bytes of files (blocks and snapshots) kept there for this
    /// configuration.
    pub max_bytes: u64,
    /// Identity of the model's files (its config and weights), so blocks
    /// of a changed checkpoint at the same path are never served.
    pub fingerprint: u64,
}

/// The open disk tier of a cache.
#[derive(Debug)]
pub(crate) struct DiskTier {
    store: DiskStore,
}

impl KvCache {
    /// The tier key of this cache for a model of `fingerprint`: a hash of
    /// everything a block's K/V depend on besides its tokens (the model
    /// fingerprint, the prefix cache's key, dtype, block size, heads, head
    /// dimension, each KV group's layers and window, the recurrent layers,
    /// the storage layout, the file format version). Blocks and snapshots
    /// are only ever served to a cache of the same key.
    pub fn disk_tier_key(&self, fingerprint: u64) -> u64 {
        let extra = self.prefix.as_ref().map_or(0, |(_, c)| c.extra_key);
        let l = self.config.layout;
        let groups: Vec<(&[usize], Option<usize>)> = self
            .groups
            .iter()
            .map(|g| (g.config.layers.as_slice(), g.config.window))
            .collect();
        let text = format!(
            "format={FORMAT_VERSION}|fingerprint={fingerprint:016x}|extra={extra:016x}|\
             dtype={:?}|kv_dtype={}|block_size={}|kv_heads={}|head_dim={}|storage=paged|\
             groups={groups:?}",
            l.dtype, l.kv_dtype, self.config.block_size, l.kv_heads, l.head_dim
        );
        // (Absent for a model without recurrent layers: their keys, and
        // files, stay those of earlier versions.)
        let text = match &self.recurrent.layers[..] {
            [] => text,
            layers => format!("{text}|recurrent={layers:?}"),
        };
        xxh3_64_with_seed(text.as_bytes(), BLOCK_HASH_SEED)
    }

    /// Opens the disk tier in `config.dir` (see crate::disk) and turns on
    /// the pools' eviction logs.
    ///
    /// # Errors
    /// [`DiskError::Unsupported`] without a prefix cache (it needs paged
    /// storage); [`DiskError::Locked`] when another server holds the
    /// directory; [`DiskError::Io`] when it can't be created or read.
    pub fn open_disk_tier(&mut self, config: &DiskTierConfig) -> Result<(), DiskError> {
        if self.prefix.is_none() || self.config.backend != StorageBackend::Paged {
            return Err(DiskError::Unsupported(
                "the prompt cache's disk tier needs the prefix cache (paged KV storage)".into(),
            ));
        }
        let key = self.disk_tier_key(config.fingerprint);
        let store = DiskStore::open(&config.dir, key, config.max_bytes)?;
        for g in &mut self.groups {
            g.pool.log_evictions(true);
        }
        self.disk = Some(DiskTier { store });
        Ok(())
    }

    /// Test-only: every later disk write fails with OS error `errno`.
    #[cfg(feature = "fault-injection")]
    pub fn fail_disk_writes_with(&mut self, errno: i32) {
        if let Some(t) = &mut self.disk {
            t.store.fail_writes_with(errno);
        }
    }

    /// The disk tier's counters, `None` when it is off.
    pub fn disk_stats(&self) -> Option<DiskTierStats> {
        self.disk.as_ref().map(|t| t.store.stats())
    }

    /// Deletes every block file of this cache's key; returns (files,
    /// bytes) removed (zero without a disk tier).
    pub fn reset_disk_tier(&mut self) -> (u64, u64) {
        self.disk.as_mut().map_or((0, 0), |t| t.store.clear())
    }

    /// Saves every cached block (held or not) and every recurrent-state
    /// snapshot that is not on disk yet: a clean stop. Returns how many
    /// files were written; failures are logged.
    pub fn save_to_disk(&mut self) -> usize {
        let Some(tier) = &mut self.disk else { return 0 };
        let mut written = 0;
        for (g, group) in self.groups.iter().enumerate() {
            let todo: Vec<(BlockId, BlockHash)> = group
                .pool
                .cached_entries()
                .into_iter()
                .filter(|&(_, h)| !tier.store.contains(h, g as u32))
                .collect();
            for batch in todo.chunks(SAVE_BATCH) {
                written += save_blocks(tier, &self.config.layout, g, group, batch);
            }
        }
        // Snapshots last: the newest files, so the size bound removes them
        // after the blocks they need.
        let bs = self.config.block_size;
        for (&hash, snapshot) in self.snapshots.iter() {
            written += usize::from(save_snapshot(tier, bs, hash, snapshot));
        }
        written
    }
}

/// The header fields of group `g`'s blocks.
fn meta_of(key: u64, layout: &KvLayout, g: usize, group: &Group, hash: BlockHash) -> BlockMeta {
    BlockMeta {
        key,
        hash,
        group: g as u32,
        block_size: group.pool.block_size() as u32,
        layers: group.config.layers.len() as u32,
        kv_heads: layout.kv_heads as u32,
        head_dim: layout.head_dim as u32,
        // The floats stored: the K/V of float storage (a cast one in its
        // own dtype), the scales and biases of quantized storage.
        dtype: layout.kv_dtype.float_dtype(layout.dtype) as i32 as u32,
        bits: layout.quant().map_or(0, |q| q.bits as u32),
        group_size: layout.quant().map_or(0, |q| q.group_size as u32),
    }
}

/// Saves the blocks group `g`'s pool evicted since the last call (their
/// K/V are still in the pool arrays). Call it after every allocation,
/// before anything writes into the allocated blocks.
pub(super) fn save_evicted(
    disk: &mut Option<DiskTier>,
    layout: &KvLayout,
    g: usize,
    group: &mut Group,
) {
    let evicted = group.pool.take_evicted();
    if let Some(tier) = disk {
        save_evicted_to(tier, layout, g, group, evicted);
    }
}

/// [`save_evicted`] of `evicted` into an open tier.
fn save_evicted_to(
    tier: &mut DiskTier,
    layout: &KvLayout,
    g: usize,
    group: &Group,
    evicted: Vec<(BlockId, BlockHash)>,
) {
    let todo: Vec<(BlockId, BlockHash)> = evicted
        .into_iter()
        .filter(|&(_, h)| !tier.store.contains(h, g as u32))
        .collect();
    if !todo.is_empty() && tier.store.writable() {
        save_blocks(tier, layout, g, group, &todo);
    }
}

/// Writes `blocks` of group `g` to disk; returns how many were written.
fn save_blocks(
    tier: &mut DiskTier,
    layout: &KvLayout,
    g: usize,
    group: &Group,
    blocks: &[(BlockId, BlockHash)],
) -> usize {
    if blocks.is_empty() || !tier.store.writable() {
        return 0;
    }
    let ids: Vec<BlockId> = blocks.iter().map(|&(b, _)| b).collect();
    let payloads = match read_blocks(group, &ids) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "reading KV blocks back for the disk tier failed");
            return 0;
        }
    };
    let key = tier.store.key();
    blocks
        .iter()
        .zip(&payloads)
        .filter(|(&(_, hash), payload)| {
            tier.store
                .put(&meta_of(key, layout, g, group, hash), payload)
        })
        .count()
}

/// Saves `evicted` snapshots (those not on disk yet) when the tier is on.
pub(super) fn save_snapshots(
    disk: &mut Option<DiskTier>,
    block_size: usize,
    evicted: Vec<(BlockHash, Snapshot)>,
) {
    if let Some(tier) = disk {
        for (hash, snapshot) in evicted {
            save_snapshot(tier, block_size, hash, &snapshot);
        }
    }
}

/// Writes `snapshot` under `hash` unless it is on disk already; returns
/// whether it was written.
fn save_snapshot(
    tier: &mut DiskTier,
    block_size: usize,
    hash: BlockHash,
    snapshot: &Snapshot,
) -> bool {
    if !tier.store.writable() || tier.store.contains(hash, format::SNAPSHOT_GROUP) {
        return false;
    }
    let arrays = snapshot
        .layers
        .iter()
        .map(|layer| {
            layer
                .iter()
                .map(|a| {
                    Ok(StateArray {
                        dtype: a.dtype(),
                        shape: a.shape().iter().map(|&d| d as usize).collect(),
                        bytes: a.to_bytes()?,
                    })
                })
                .collect::<Result<Vec<_>, mlxcel_mlx::Error>>()
        })
        .collect::<Result<Vec<_>, _>>();
    let arrays = match arrays {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(error = %e, "reading a recurrent-state snapshot back for the disk tier failed");
            return false;
        }
    };
    let meta = snapshot_meta(tier, block_size, hash, arrays.len());
    tier.store.put(&meta, &format::encode_state(&arrays))
}

/// The snapshot under `hash` read back from disk, each array in its own
/// dtype and shape; `None` when it is not there or unusable. A file that
/// checks out but describes states other than `recurrent`'s is discarded
/// as a corrupt one; an MLX failure making the arrays leaves the file.
fn read_snapshot(
    tier: &mut DiskTier,
    block_size: usize,
    hash: BlockHash,
    recurrent: &RecurrentConfig,
) -> Option<Vec<Rc<Vec<Array>>>> {
    let meta = snapshot_meta(tier, block_size, hash, recurrent.layers.len());
    let payload = tier.store.get(&meta)?;
    let layers = format::decode_state(&payload, recurrent.layers.len())
        .map_err(|e| e.to_string())
        .and_then(|layers| {
            // Every state's elements, counted as the float32 bound is.
            let elements: usize = layers
                .iter()
                .flatten()
                .map(|a| a.shape.iter().product::<usize>())
                .sum();
            if elements.checked_mul(4) == Some(recurrent.bytes_per_sequence) {
                Ok(layers)
            } else {
                Err(format!(
                    "{elements} state elements, the model keeps {} bytes of float32 state",
                    recurrent.bytes_per_sequence
                ))
            }
        });
    let layers = match layers {
        Ok(layers) => layers,
        Err(why) => {
            tier.store.discard(&meta, &why);
            return None;
        }
    };
    let rebuilt = layers
        .into_iter()
        .map(|arrays| {
            arrays
                .iter()
                .map(|a| {
                    // decode_state keeps every dimension within i32.
                    let shape: Vec<i32> = a.shape.iter().map(|&d| d as i32).collect();
                    Array::from_bytes(&a.bytes, &shape, a.dtype)
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Rc::new)
        })
        .collect::<Result<Vec<_>, _>>();
    match rebuilt {
        Ok(layers) => Some(layers),
        Err(e) => {
            tracing::warn!(error = %e, "making a recurrent-state snapshot read from disk failed");
            None
        }
    }
}

/// The header of the snapshot under `hash` of a model of `layers`
/// recurrent layers.
fn snapshot_meta(tier: &DiskTier, block_size: usize, hash: BlockHash, layers: usize) -> BlockMeta {
    BlockMeta::snapshot(tier.store.key(), hash, block_size as u32, layers as u32)
}

/// The slots of `blocks`, in order, `block_size` each.
fn slots_of(blocks: &[BlockId], bs: usize) -> Vec<i32> {
    blocks
        .iter()
        .flat_map(|b| (0..bs).map(move |i| (b.index() * bs + i) as i32))
        .collect()
}

/// Each block's payload (crate::disk::format): per layer of the group,
/// its keys then its values, each part's bytes as stored in the pool
/// (`Array::to_bytes`: no conversion).
fn read_blocks(group: &Group, blocks: &[BlockId]) -> Result<Vec<Vec<u8>>, KvError> {
    let paged = group
        .paged
        .as_ref()
        .ok_or(KvError::Invariant("disk tier without paged storage".into()))?;
    let bs = group.pool.block_size();
    let slots = slots_of(blocks, bs);
    let idx = Array::from_i32(&slots, &[slots.len() as i32])?;
    let mut out: Vec<Vec<u8>> = vec![Vec::new(); blocks.len()];
    for l in 0..group.config.layers.len() {
        for part in paged.take_stored(l, &idx)? {
            let bytes = part.to_bytes()?;
            let per_block = (bytes.len() / blocks.len().max(1)).max(1);
            for (b, chunk) in bytes.chunks(per_block).enumerate() {
                out[b].extend_from_slice(chunk);
            }
        }
    }
    Ok(out)
}

/// Writes `payloads` (crate::disk::format) into `blocks` of the group's
/// pool arrays and evaluates them.
fn write_blocks(
    group: &mut Group,
    layout: &KvLayout,
    blocks: &[BlockId],
    payloads: &[&[u8]],
) -> Result<(), KvError> {
    let bs = group.pool.block_size();
    let layers = group.config.layers.len();
    let paged = group
        .paged
        .as_mut()
        .ok_or(KvError::Invariant("disk tier without paged storage".into()))?;
    let slots = slots_of(blocks, bs);
    let n = slots.len() as i32;
    let idx = Array::from_i32(&slots, &[n, 1, 1])?;
    let parts = layout.stored_parts();
    let h = layout.kv_heads;
    // Byte offset of each part inside a block's payload.
    let mut at = 0;
    for l in 0..layers {
        let mut kv: [Vec<Array>; 2] = [Vec::new(), Vec::new()];
        for half in kv.iter_mut() {
            for &(x, dtype) in &parts {
                let len = bs * h * x as usize * dtype.size_bytes();
                // Each block's bytes of this part, in block order, made
                // contiguous on the host: one upload per part, written with
                // one scatter (measured on the H200: slicing every part out
                // of one upload of all payloads, or writing runs of
                // consecutive blocks with slice updates, was slower).
                let mut bytes = Vec::with_capacity(len * payloads.len());
                for p in payloads {
                    bytes.extend_from_slice(&p[at..at + len]);
                }
                half.push(Array::from_bytes(&bytes, &[n, h as i32, x], dtype)?);
                at += len;
            }
        }
        paged.write_stored(l, &idx, &kv[0], &kv[1])?;
    }
    let arrays: Vec<&Array> = paged.arrays().collect();
    mlxcel_mlx::eval(&arrays)?;
    Ok(())
}

impl KvCache {
    /// Loads from disk the blocks a lookup of `tokens` (chunks of `chunk`)
    /// could use beyond what the pools hold, so that the lookup that
    /// follows finds them: for the groups that keep every key, the longest
    /// run of full blocks in RAM or on disk, `n`; for each group, the
    /// blocks a hit of `n` needs ([`hold_from`]). A loaded block is
    /// written into a newly allocated pool block and registered under its
    /// hash, then left unreferenced (cached, evictable). Loading stops in
    /// a group at the first block missing or unusable on disk, or when its
    /// pool has no free block. MLX failures are logged and the blocks
    /// concerned dropped: the lookup then finds less.
    ///
    /// # Errors
    /// A pool inconsistency.
    pub(super) fn load_from_disk(&mut self, tokens: &[u32], chunk: usize) -> Result<(), KvError> {
        let (Some(tier), Some((_, cfg))) = (&mut self.disk, &self.prefix) else {
            return Ok(());
        };
        let bs = self.config.block_size;
        let mut hashes = Vec::with_capacity(tokens.len() / bs);
        extend_hashes(&mut hashes, tokens, tokens.len(), bs, cfg.extra_key)?;
        let mut n = hashes.len();
        for (g, group) in self.groups.iter().enumerate() {
            if group.config.keep.is_none() {
                let run = hashes
                    .iter()
                    .take_while(|&&h| {
                        group.pool.cached_block(h).is_some() || tier.store.contains(h, g as u32)
                    })
                    .count();
                n = n.min(run);
            }
        }
        if n == 0 {
            return Ok(());
        }
        // With recurrent layers a hit ends at a block boundary strictly
        // inside the prompt whose state snapshot is kept: the longest one
        // within the run, its snapshot read back if RAM lacks it (a bad
        // file, deleted, leaves the next shorter one).
        if !self.recurrent.layers.is_empty() {
            n = n.min((tokens.len() - 1) / bs);
            loop {
                let Some(m) = (1..=n).rev().find(|&m| {
                    self.snapshots.contains(&hashes[m - 1])
                        || tier.store.contains(hashes[m - 1], format::SNAPSHOT_GROUP)
                }) else {
                    return Ok(());
                };
                let hash = hashes[m - 1];
                if self.snapshots.contains(&hash) {
                    n = m;
                    break;
                }
                if let Some(layers) = read_snapshot(tier, bs, hash, &self.recurrent) {
                    for (h, s) in self.snapshots.insert_loaded(hash, m * bs, layers) {
                        save_snapshot(tier, bs, h, &s);
                    }
                    n = m;
                    break;
                }
                n = m - 1;
            }
        }
        let cached = if n * bs >= tokens.len() {
            tokens.len() - 1
        } else {
            n * bs
        };
        let layout = self.config.layout;
        let key = tier.store.key();
        let started = std::time::Instant::now();
        let mut loaded = 0;
        let mut read_s = 0.0;
        for (g, group) in self.groups.iter_mut().enumerate() {
            let from = hold_from(cached, group.config.keep, chunk) / bs;
            // Hold the blocks already in RAM so loading can't evict them.
            let mut held: Vec<(usize, BlockId)> = Vec::new();
            let mut wants: Vec<(usize, BlockHash)> = Vec::new();
            for (i, &h) in hashes.iter().enumerate().take(n).skip(from.min(n)) {
                if let Some(id) = group.pool.cached_block(h) {
                    group.pool.touch(&[id])?;
                    held.push((i, id));
                    continue;
                }
                if wants.len() >= group.pool.free_blocks() || !tier.store.contains(h, g as u32) {
                    break;
                }
                wants.push((i, h));
            }
            // Read in parallel; the run ends at the first unusable file.
            let metas: Vec<BlockMeta> = wants
                .iter()
                .map(|&(_, h)| meta_of(key, &layout, g, group, h))
                .collect();
            let reading = std::time::Instant::now();
            let payloads = tier.store.get_many(&metas);
            read_s += reading.elapsed().as_secs_f64();
            let load: Vec<(usize, BlockHash, Vec<u8>)> = wants
                .into_iter()
                .zip(payloads)
                .map_while(|((i, h), payload)| Some((i, h, payload?)))
                .collect();
            if !load.is_empty() {
                let ids = group.pool.allocate(load.len())?;
                let evicted = group.pool.take_evicted();
                save_evicted_to(tier, &layout, g, group, evicted);
                let payloads: Vec<&[u8]> = load.iter().map(|(_, _, p)| p.as_slice()).collect();
                match write_blocks(group, &layout, &ids, &payloads) {
                    Ok(()) => {
                        for (&id, (_, h, _)) in ids.iter().zip(&load) {
                            group.pool.register(id, *h)?;
                        }
                        loaded += ids.len();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "writing KV blocks read from disk failed");
                    }
                }
                held.extend(load.iter().map(|(i, _, _)| *i).zip(ids));
            }
            // Last first: the prefix stays cached longest.
            held.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
            let ids: Vec<BlockId> = held.into_iter().map(|(_, id)| id).collect();
            group.pool.free(&ids)?;
        }
        if loaded > 0 {
            tracing::info!(
                blocks = loaded,
                seconds = started.elapsed().as_secs_f64(),
                read_seconds = read_s,
                "prompt cache blocks read from disk"
            );
        }
        Ok(())
    }
}
