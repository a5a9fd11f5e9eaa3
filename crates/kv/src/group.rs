//! KV groups: the layers of a model that share one attention window keep
//! their own block pool, block tables and prefix-cache entries, as vLLM's
//! hybrid KV cache manager keeps one "KV cache group" per attention kind
//! (`vllm/v1/core/kv_cache_coordinator.py`, `single_type_kv_cache_manager.py`).
//!
//! A full-attention group keeps every key of a sequence (or the last
//! `--max-kv-size`); a sliding-window group of window `w` keeps at most
//! `w - 1` keys between steps (the next token is the window's last; `w`
//! while a pipelined step is queued, `KvCache::trim_keeping`), so it frees
//! the blocks that fell out of its window. A model whose layers all
//! attend the same way has one group and behaves as a cache without
//! groups.

/// One KV group: the layers that share a window, and what each sequence
/// keeps in them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroupConfig {
    /// The model layers whose K/V this group stores, ascending.
    pub layers: Vec<usize>,
    /// The layers' attention window, in keys (a query sees at most this
    /// many, itself included); `None`: full attention.
    pub window: Option<usize>,
    /// Keys a sequence keeps between steps ([`KvGroupConfig::keep_for`]);
    /// `None`: every key.
    pub keep: Option<usize>,
    /// Blocks in the group's pool.
    pub num_blocks: usize,
}

impl KvGroupConfig {
    /// Keys a layer of `window` keeps between steps under `--max-kv-size
    /// max_kv_size`: `min(window - 1, max_kv_size)` (at least 1), or
    /// `max_kv_size` for full attention.
    pub fn keep_for(window: Option<usize>, max_kv_size: Option<usize>) -> Option<usize> {
        let from_window = window.map(|w| w.saturating_sub(1).max(1));
        match (from_window, max_kv_size) {
            (Some(w), Some(m)) => Some(w.min(m.max(1))),
            (Some(w), None) => Some(w),
            (None, m) => m.map(|m| m.max(1)),
        }
    }

    /// The groups of a model whose layer `l` attends within
    /// `layer_windows[l]` keys (`None`: full attention): one group per
    /// distinct window, the full-attention group first, then windows from
    /// the smallest. Every group has `num_blocks = 0`; the caller sizes
    /// them. No layers: one empty full group.
    pub fn from_layer_windows(
        layer_windows: &[Option<usize>],
        max_kv_size: Option<usize>,
    ) -> Vec<KvGroupConfig> {
        let mut windows: Vec<Option<usize>> = layer_windows.to_vec();
        // `None` sorts before every `Some`: the full group comes first.
        windows.sort_unstable();
        windows.dedup();
        if windows.is_empty() {
            windows.push(None);
        }
        windows
            .into_iter()
            .map(|window| KvGroupConfig {
                layers: (0..layer_windows.len())
                    .filter(|&l| layer_windows[l] == window)
                    .collect(),
                window,
                keep: Self::keep_for(window, max_kv_size),
                num_blocks: 0,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_grouped_by_window_full_group_first() {
        // Gemma 3's pattern: five local layers of 512 keys per global one.
        let windows: Vec<Option<usize>> = (0..12)
            .map(|l| if l % 6 == 5 { None } else { Some(512) })
            .collect();
        let groups = KvGroupConfig::from_layer_windows(&windows, None);
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].layers, vec![5, 11]);
        assert_eq!((groups[0].window, groups[0].keep), (None, None));
        assert_eq!(groups[1].layers, vec![0, 1, 2, 3, 4, 6, 7, 8, 9, 10]);
        assert_eq!((groups[1].window, groups[1].keep), (Some(512), Some(511)));
        // --max-kv-size applies to every group.
        let capped = KvGroupConfig::from_layer_windows(&windows, Some(100));
        assert_eq!((capped[0].keep, capped[1].keep), (Some(100), Some(100)));
        let wide = KvGroupConfig::from_layer_windows(&windows, Some(4096));
        assert_eq!((wide[0].keep, wide[1].keep), (Some(4096), Some(511)));
    }

    #[test]
    fn one_kind_of_layer_is_one_group() {
        let full = KvGroupConfig::from_layer_windows(&[None; 4], None);
        assert_eq!(full.len(), 1);
        assert_eq!(full[0].layers, vec![0, 1, 2, 3]);
        let windowed = KvGroupConfig::from_layer_windows(&[Some(8); 3], None);
        assert_eq!(windowed.len(), 1);
        assert_eq!((windowed[0].window, windowed[0].keep), (Some(8), Some(7)));
        assert_eq!(KvGroupConfig::from_layer_windows(&[], None).len(), 1);
    }
}

/// The state one model layer keeps per sequence between steps: what the KV
/// cache must store for it. Attention layers keep K/V (grouped by window
/// into [`KvGroupConfig`]s); recurrent layers (Gated DeltaNet, Mamba2) keep
/// a fixed-size state per sequence, whatever its length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerState {
    /// K/V of every key within `window` (`None`: full attention).
    Attention {
        /// The attention window, in keys (a query sees at most this many,
        /// itself included).
        window: Option<usize>,
    },
    /// A recurrent state of fixed size per sequence: one array per entry
    /// of `shapes` (e.g. a convolution state `[kernel - 1, channels]` and
    /// a recurrent state `[heads, key_dim, value_dim]`), float32 or the
    /// compute dtype.
    Recurrent {
        /// The state arrays' shapes, per sequence.
        shapes: Vec<Vec<usize>>,
    },
    /// An attention layer with no K/V of its own: it reads the K/V that
    /// the earlier attention layer `source` (same `window`) writes, and
    /// writes none (Gemma 4's KV sharing). The cache maps it to its
    /// source's storage ([`crate::KvCache::with_shared_layers`]), so every
    /// storage serves it unchanged.
    SharedAttention {
        /// The model layer whose K/V it reads.
        source: usize,
        /// The attention window, in keys (its source's).
        window: Option<usize>,
    },
}

impl LayerState {
    /// The attention window of an attention layer (`None` for full
    /// attention and for recurrent layers).
    pub fn window(&self) -> Option<usize> {
        match self {
            LayerState::Attention { window } | LayerState::SharedAttention { window, .. } => {
                *window
            }
            LayerState::Recurrent { .. } => None,
        }
    }

    /// The `(layer, source)` pairs of the layers of `states` that read
    /// another layer's K/V ([`LayerState::SharedAttention`]), ascending.
    pub fn shared_layers(states: &[LayerState]) -> Vec<(usize, usize)> {
        states
            .iter()
            .enumerate()
            .filter_map(|(l, s)| match s {
                LayerState::SharedAttention { source, .. } => Some((l, *source)),
                _ => None,
            })
            .collect()
    }
}
