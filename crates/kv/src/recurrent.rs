//! Recurrent layer state: what a Gated DeltaNet (or Mamba2) layer keeps
//! per sequence between steps, a few arrays of fixed size whatever the
//! sequence's length (a convolution state and a recurrent state).
//!
//! K/V can be rewound by truncation; a recurrent state cannot (it folds
//! every token into the same arrays). So a sequence keeps its state as
//! *entries*, each the state of every recurrent layer after the tokens
//! before one position: a step reads the entry at its rows' first new
//! position and writes one at their end. Rolling a step back (a failed
//! forward, a pipelined step whose evaluation failed) drops the entries
//! past the sequence's new end; the entry the rewound sequence needs is
//! still there because the last [`ENTRIES_KEPT`] are kept. MLX arrays are
//! immutable and reference counted, so an entry costs no copy, only the
//! memory of the arrays it keeps alive.
//!
//! The prefix cache stays exact with *snapshots*: the state at a block
//! boundary, kept under the chained hash of the block that ends there
//! (the same hash the block's K/V is cached under). A prefix hit on a
//! model with recurrent layers may stop only at a block boundary that has
//! a snapshot, strictly inside the prompt; a snapshot that isn't there
//! makes the hit shorter, never wrong. Which snapshots are kept: see
//! [`SnapshotStore`].

use std::collections::HashMap;
use std::rc::Rc;

use mlxcel_mlx::Array;

use crate::hash::BlockHash;

/// State entries a sequence keeps (the newest by position): the current
/// one, plus two for the rollback of pipelined decode (two steps queued
/// before the first is read).
pub const ENTRIES_KEPT: usize = 3;

/// The recurrent layers of a model, for [`crate::KvCache::with_layer_states`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecurrentConfig {
    /// Model layers that keep a recurrent state, ascending.
    pub layers: Vec<usize>,
    /// Bytes of state one sequence holds in all of them (one entry).
    pub bytes_per_sequence: usize,
    /// Most prefix-cache snapshots kept (0: no prefix hit is possible on a
    /// model with recurrent layers).
    pub snapshots: usize,
}

impl RecurrentConfig {
    /// The most bytes of state the cache holds with `parallel` sequences
    /// running: [`ENTRIES_KEPT`] entries each, and every snapshot.
    pub fn bytes_total(&self, parallel: usize) -> usize {
        (ENTRIES_KEPT * parallel + self.snapshots) * self.bytes_per_sequence
    }
}

/// The state of every recurrent layer of one sequence after the tokens
/// before `at`.
#[derive(Debug, Clone)]
pub(crate) struct StateEntry {
    /// Tokens folded into the state (the position of the next token).
    pub(crate) at: usize,
    /// Per recurrent layer (in [`RecurrentConfig::layers`] order), its
    /// state arrays; `None` while the step that writes it is being built.
    pub(crate) layers: Vec<Option<Rc<Vec<Array>>>>,
    /// Written by a row of more than one real token (a prompt chunk):
    /// kept as a snapshot beside the sequence's decode snapshot.
    pub(crate) chunk: bool,
}

impl StateEntry {
    /// Whether every layer's state is written.
    pub(crate) fn complete(&self) -> bool {
        self.layers.iter().all(Option::is_some)
    }
}

/// One sequence's state entries, ascending by position.
#[derive(Debug, Clone, Default)]
pub(crate) struct SeqRecurrent {
    pub(crate) entries: Vec<StateEntry>,
    /// The hash under which this sequence's latest decode snapshot is
    /// stored (replaced by its next one).
    pub(crate) decode_snapshot: Option<BlockHash>,
    /// The hashes of its prompt-chunk snapshots, oldest first (at most
    /// [`CHUNK_SNAPSHOTS_KEPT`]).
    pub(crate) chunk_snapshots: Vec<BlockHash>,
}

/// Prompt-chunk snapshots one sequence keeps in the store: its newest
/// ones, nearest the end of its prompt (a long prompt would otherwise
/// flush every other request's snapshots).
pub const CHUNK_SNAPSHOTS_KEPT: usize = 2;

impl SeqRecurrent {
    /// The entry at `at`, if any.
    pub(crate) fn at(&self, at: usize) -> Option<&StateEntry> {
        self.entries.iter().find(|e| e.at == at)
    }

    /// The entry at `at`, created empty (for `layers` layers) if missing.
    pub(crate) fn at_mut(&mut self, at: usize, layers: usize, chunk: bool) -> &mut StateEntry {
        let i = match self.entries.iter().position(|e| e.at == at) {
            Some(i) => i,
            None => {
                let i = self.entries.partition_point(|e| e.at < at);
                self.entries.insert(
                    i,
                    StateEntry {
                        at,
                        layers: vec![None; layers],
                        chunk,
                    },
                );
                i
            }
        };
        &mut self.entries[i]
    }

    /// Drops the entries past `end` and all but the newest
    /// [`ENTRIES_KEPT`].
    pub(crate) fn prune(&mut self, end: usize) {
        self.entries.retain(|e| e.at <= end);
        let extra = self.entries.len().saturating_sub(ENTRIES_KEPT);
        self.entries.drain(..extra);
    }
}

/// The owner of a snapshot read back from disk: no sequence.
const NO_OWNER: u64 = u64::MAX;

/// A snapshot: the state of every recurrent layer at a block boundary.
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    pub(crate) at: usize,
    pub(crate) layers: Vec<Rc<Vec<Array>>>,
    /// The sequence that took it (only it replaces it).
    owner: u64,
    /// Logical time of its last insertion or use (LRU).
    used: u64,
}

/// The prefix cache's recurrent-state snapshots, keyed by the chained
/// hash of the block ending at the snapshot's position, least recently
/// used evicted beyond `capacity`.
///
/// What is kept: a prompt chunk that ends at a block boundary leaves one
/// (chunks end at multiples of the prefill chunk size, and a prompt's last
/// chunk ends at its last block boundary: a repeated or extended prompt
/// resumes there), each sequence keeping its newest
/// [`CHUNK_SNAPSHOTS_KEPT`]; and each sequence keeps its latest decode-time
/// block boundary (each new one replaces the sequence's previous one), so
/// the next turn of a conversation resumes inside the previous reply.
#[derive(Debug, Default)]
pub(crate) struct SnapshotStore {
    map: HashMap<BlockHash, Snapshot>,
    capacity: usize,
    clock: u64,
    /// Snapshots taken (by sequences; not those read back from disk),
    /// and evicted for room.
    pub(crate) taken: u64,
    pub(crate) evicted: u64,
}

impl SnapshotStore {
    pub(crate) fn new(capacity: usize) -> Self {
        SnapshotStore {
            capacity,
            ..Default::default()
        }
    }

    /// Whether a snapshot is kept under `hash`.
    pub(crate) fn contains(&self, hash: &BlockHash) -> bool {
        self.map.contains_key(hash)
    }

    /// Snapshots kept.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The snapshot under `hash`, marked used.
    pub(crate) fn take(&mut self, hash: &BlockHash) -> Option<Snapshot> {
        self.clock += 1;
        let clock = self.clock;
        self.map.get_mut(hash).map(|s| {
            s.used = clock;
            s.clone()
        })
    }

    /// Keeps `entry` (complete) of sequence `owner` under `hash`, evicting
    /// the least recently used beyond capacity; returns the evicted ones
    /// (for the disk tier).
    pub(crate) fn insert(
        &mut self,
        hash: BlockHash,
        entry: &StateEntry,
        owner: u64,
    ) -> Vec<(BlockHash, Snapshot)> {
        let Some(layers) = entry.layers.iter().cloned().collect::<Option<Vec<_>>>() else {
            return Vec::new();
        };
        self.insert_layers(hash, entry.at, layers, owner)
    }

    /// Keeps a snapshot read back from disk (no sequence owns it), as
    /// [`SnapshotStore::insert`].
    pub(crate) fn insert_loaded(
        &mut self,
        hash: BlockHash,
        at: usize,
        layers: Vec<Rc<Vec<Array>>>,
    ) -> Vec<(BlockHash, Snapshot)> {
        self.insert_layers(hash, at, layers, NO_OWNER)
    }

    /// Every snapshot kept, by hash.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&BlockHash, &Snapshot)> {
        self.map.iter()
    }

    fn insert_layers(
        &mut self,
        hash: BlockHash,
        at: usize,
        layers: Vec<Rc<Vec<Array>>>,
        owner: u64,
    ) -> Vec<(BlockHash, Snapshot)> {
        let mut evicted = Vec::new();
        if self.capacity == 0 {
            return evicted;
        }
        self.clock += 1;
        let fresh = self
            .map
            .insert(
                hash,
                Snapshot {
                    at,
                    layers,
                    owner,
                    used: self.clock,
                },
            )
            .is_none();
        if fresh && owner != NO_OWNER {
            self.taken += 1;
        }
        while self.map.len() > self.capacity {
            let Some(oldest) = self.map.iter().min_by_key(|(_, s)| s.used).map(|(h, _)| *h) else {
                break;
            };
            if let Some(s) = self.map.remove(&oldest) {
                evicted.push((oldest, s));
            }
            self.evicted += 1;
        }
        evicted
    }

    /// Drops the snapshot under `hash` if sequence `owner` took it.
    pub(crate) fn remove_owned(&mut self, hash: &BlockHash, owner: u64) {
        if self.map.get(hash).is_some_and(|s| s.owner == owner) {
            self.map.remove(hash);
        }
    }

    /// Drops every snapshot; returns how many.
    pub(crate) fn clear(&mut self) -> usize {
        let n = self.map.len();
        self.map.clear();
        n
    }
}
