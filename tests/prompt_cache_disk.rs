//! The prompt cache's disk tier (`--prompt-cache-dir`, issue 25): a
//! restarted engine starts warm and answers exactly as a cold one
//! (invariant 5 across restarts); corrupt, truncated and foreign files
//! are skipped and counted, never served; one engine per directory; a
//! full disk leaves the engine in RAM only; KV groups (tiny Gemma 3).

mod common;

use std::path::{Path, PathBuf};

use common::{collect_tokens, greedy_request, model_dir, readme_tokens, settled};
use mlxcel_engine::api::{DiskCacheStats, InferenceService, Prompt, Usage};
use mlxcel_engine::fault::FaultInjection;
use mlxcel_engine::{Engine, EngineConfig};

/// A fresh directory for block files.
fn cache_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mlxcel-disk-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The block files in `dir`, by name.
fn block_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("cache dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "kvb"))
        .collect();
    files.sort();
    files
}

fn smollm(dir: &Path) -> EngineConfig {
    let mut c = EngineConfig::new(model_dir());
    c.parallel = 2;
    c.kv_cache_budget = Some(64 << 20);
    c.check_invariants = true;
    c.prompt_cache_dir = Some(dir.to_path_buf());
    c
}

fn run(e: &Engine, prompt: &[u32], cache: bool) -> (Vec<u32>, Usage) {
    let mut r = greedy_request(Prompt::Tokens(prompt.to_vec()), 16);
    r.cache_prompt = cache;
    collect_tokens(e.submit(r).expect("submit")).expect("run")
}

fn disk(e: &Engine) -> DiskCacheStats {
    settled(e).disk.expect("the disk tier is on")
}

#[test]
fn a_restart_starts_warm_from_disk_and_answers_like_a_cold_run() {
    let dir = cache_dir("restart");
    let first = Engine::start(smollm(&dir)).expect("engine");
    let ids = readme_tokens(&first);
    let (long, short) = (ids[..200].to_vec(), ids[..97].to_vec());
    let (cold_long, _) = run(&first, &long, false);
    let (cold_short, _) = run(&first, &short, false);
    assert_eq!(run(&first, &long, true).0, cold_long);
    assert_eq!(run(&first, &short, true).0, cold_short);
    drop(first); // A clean stop saves every cached block.
    let saved = block_files(&dir);
    assert!(saved.len() >= 6, "{} block files", saved.len());

    // Another model's file in the same directory is left alone.
    let foreign = dir.join(format!("0123456789abcdef-{}-g0.kvb", "f".repeat(32)));
    std::fs::copy(&saved[0], &foreign).expect("copy");

    let second = Engine::start(smollm(&dir)).expect("restart");
    let (warm, usage) = run(&second, &long, true);
    assert_eq!(usage.cached_tokens, 192, "six blocks from disk");
    assert_eq!(warm, cold_long, "warm from disk == cold");
    let d = disk(&second);
    assert!(d.hits >= 6, "{d:?}");
    assert_eq!((d.foreign, d.skipped), (1, 0), "{d:?}");
    assert!(foreign.exists());

    // One engine per directory: a second one is refused, naming the holder.
    let err = Engine::start(smollm(&dir)).err().expect("refused");
    assert!(err.to_string().contains("in use"), "{err}");

    // A reset that keeps the disk: the next run reads it again.
    let reset = second.reset_prefix_cache(true).expect("reset");
    assert_eq!(reset.disk_blocks_freed, 0);
    let (again, usage) = run(&second, &short, true);
    assert_eq!((again, usage.cached_tokens), (cold_short, 96));
    assert!(disk(&second).hits > d.hits);
    drop(second);

    // Flip a byte of every block file, or cut it short: all are skipped,
    // counted, and the answer is the cold one.
    for (i, f) in block_files(&dir).iter().enumerate() {
        if *f == foreign {
            continue;
        }
        let mut bytes = std::fs::read(f).expect("read");
        if i % 2 == 0 {
            let at = bytes.len() - 7;
            bytes[at] ^= 0x40;
        } else {
            bytes.truncate(bytes.len() - 100);
        }
        std::fs::write(f, bytes).expect("write");
    }
    let third = Engine::start(smollm(&dir)).expect("restart");
    let (answer, usage) = run(&third, &long, true);
    assert_eq!(usage.cached_tokens, 0, "nothing corrupt is served");
    assert_eq!(answer, cold_long);
    let d = disk(&third);
    // The lookup reads its blocks' files together: every one is skipped.
    assert!(d.skipped >= 6 && d.hits == 0, "{d:?}");
    // Its clean stop saves the blocks it computed; a full reset then
    // deletes this model's files, not the foreign one.
    drop(third);
    let fourth = Engine::start(smollm(&dir)).expect("restart");
    let reset = fourth.reset_prefix_cache(false).expect("reset");
    assert!(reset.disk_blocks_freed >= 6, "{reset:?}");
    assert_eq!(disk(&fourth).blocks, 0);
    drop(fourth);
    assert!(foreign.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The tiny checkpoint `name` of scripts/make_tiny_models.py, its golden
/// prompt and mlx_lm's greedy tokens for it.
fn tiny_model(name: &str) -> (PathBuf, Vec<u32>, Vec<u32>) {
    let model = common::tiny_model_dir(name, "disk");
    let golden = common::parity::read_golden(&model, "make_tiny_models.py");
    let prompt = common::parity::ids(&golden, "prompt");
    let want = common::parity::ids(&golden, "greedy");
    (model, prompt, want)
}

/// An engine on a tiny checkpoint with the disk tier in `dir`: 8-token
/// blocks, 16-token prefill chunks.
fn tiny_config(model: &Path, dir: &Path) -> EngineConfig {
    let mut c = common::tiny_engine_config(model, 2);
    c.prompt_cache_dir = Some(dir.to_path_buf());
    c
}

/// KV groups: tiny Gemma 3's window group and full group both come back
/// from disk, and the answer is mlx_lm's.
#[test]
fn kv_groups_come_back_from_disk_with_the_cold_answer() {
    let (model, prompt, want) = tiny_model("gemma3");
    let dir = cache_dir("groups");
    let config = || tiny_config(&model, &dir);
    let go = |e: &Engine| {
        let mut r = greedy_request(Prompt::Tokens(prompt.clone()), want.len());
        r.ignore_eos = true;
        collect_tokens(e.submit(r).expect("submit")).expect("run")
    };
    let e = Engine::start(config()).expect("engine");
    assert_eq!(go(&e).0, want, "cold = mlx_lm");
    drop(e);
    let e = Engine::start(config()).expect("restart");
    let (warm, usage) = go(&e);
    assert_eq!(usage.cached_tokens, prompt.len() - 1, "a whole-prompt hit");
    assert_eq!(warm, want, "warm from disk = cold");
    assert!(disk(&e).hits >= 2);
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&model);
}

/// Blocks evicted from RAM (a prefix cache of two unused blocks) are
/// saved before their blocks are reused, and come back from disk with the
/// cold answer.
#[test]
fn evicted_blocks_come_back_from_disk() {
    let dir = cache_dir("evicted");
    let mut c = smollm(&dir);
    c.prefix_cache_capacity = Some(2);
    let e = Engine::start(c).expect("engine");
    let ids = readme_tokens(&e);
    let prompt = ids[..160].to_vec();
    let (cold, _) = run(&e, &prompt, false);
    assert_eq!(run(&e, &prompt, true).0, cold);
    let d = disk(&e);
    assert!(d.writes >= 3, "evicted blocks were saved: {d:?}");
    let (warm, usage) = run(&e, &prompt, true);
    assert_eq!(
        usage.cached_tokens, 159,
        "a whole-prompt hit from RAM and disk"
    );
    assert_eq!(warm, cold);
    assert!(disk(&e).hits >= 3);
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A disk that fills up (an injected ENOSPC on every write) turns writes
/// off once; the engine goes on from RAM with the same answers.
#[test]
fn a_full_disk_leaves_the_engine_in_ram() {
    let dir = cache_dir("full");
    let mut c = smollm(&dir);
    // Two unused cached blocks at most: finished prompts evict at once.
    c.prefix_cache_capacity = Some(2);
    c.fault = FaultInjection {
        disk_write_errno: Some(28),
        ..FaultInjection::default()
    };
    let e = Engine::start(c).expect("engine");
    let ids = readme_tokens(&e);
    let prompt = ids[..160].to_vec();
    let (cold, _) = run(&e, &prompt, false);
    assert_eq!(run(&e, &prompt, true).0, cold);
    assert_eq!(run(&e, &prompt, true).0, cold);
    let d = disk(&e);
    assert_eq!(
        (d.write_errors, d.writes, d.writable),
        (1, 0, false),
        "{d:?}"
    );
    drop(e);
    assert!(block_files(&dir).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The recurrent-state snapshot files in `dir`.
fn snapshot_files(dir: &Path) -> Vec<PathBuf> {
    block_files(dir)
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with("-state.kvb"))
        .collect()
}

/// Recurrent-state snapshots (tiny Qwen3.5: Gated DeltaNet layers beside
/// full attention, 8-token blocks, 16-token prefill chunks). A clean stop
/// saves them with the blocks; a restarted engine resumes from disk at
/// the decode-time snapshot inside a first reply (48 tokens) and at the
/// chunk snapshot inside the prompt (32 of 40); snapshots evicted from
/// RAM are saved and come back; a corrupt snapshot file is skipped, never
/// served, and the hit falls back to the next boundary with a snapshot.
/// Every answer is the cold one (mlx_lm's for the golden prompt).
#[test]
fn recurrent_state_snapshots_come_back_from_disk_with_the_cold_answer() {
    let (model, prompt, want) = tiny_model("qwen3_5");
    let dir = cache_dir("recurrent");
    let config = || tiny_config(&model, &dir);
    let go = |e: &Engine, prompt: &[u32], n: usize, cache: bool| {
        let mut r = greedy_request(Prompt::Tokens(prompt.to_vec()), n);
        r.ignore_eos = true;
        r.cache_prompt = cache;
        collect_tokens(e.submit(r).expect("submit")).expect("run")
    };

    // Turn 1 caches (chunk snapshots at 32 and 40, the decode one at 48);
    // turn 2 is turn 1, its reply and five more tokens.
    let e = Engine::start(config()).expect("engine");
    let (first, _) = go(&e, &prompt, want.len(), true);
    assert_eq!(first, want, "cold = mlx_lm");
    let mut turn2 = prompt.clone();
    turn2.extend(&first);
    turn2.extend(&prompt[..5]);
    let (cold2, _) = go(&e, &turn2, 8, false);
    drop(e);
    let snapshots = snapshot_files(&dir);
    assert_eq!(snapshots.len(), 3, "snapshots at 32, 40, 48");

    // A corrupt snapshot file is skipped and deleted, never served: in a
    // copy of the directory per file, one of them corrupted, turn 2
    // resumes at 48, or, when the file corrupted is the one at 48, falls
    // back to 40; the answer is the cold one either way.
    let mut resumed = Vec::new();
    for (i, bad) in snapshots.iter().enumerate() {
        let copy = cache_dir(&format!("recurrent-copy{i}"));
        std::fs::create_dir_all(&copy).expect("copy dir");
        for f in block_files(&dir) {
            let to = copy.join(f.file_name().expect("name"));
            std::fs::copy(&f, &to).expect("copy");
            if f == *bad {
                let mut bytes = std::fs::read(&to).expect("read");
                let at = bytes.len() - 3;
                bytes[at] ^= 0x10;
                std::fs::write(&to, bytes).expect("write");
            }
        }
        let e = Engine::start(tiny_config(&model, &copy)).expect("engine on the copy");
        let (answer, usage) = go(&e, &turn2, 8, true);
        assert_eq!(answer, cold2, "copy {i}: warm from disk = cold");
        let d = disk(&e);
        resumed.push((usage.cached_tokens, d.skipped, d.snapshot_hits));
        drop(e);
        let _ = std::fs::remove_dir_all(&copy);
    }
    resumed.sort();
    assert_eq!(
        resumed,
        vec![(40, 1, 1), (48, 0, 1), (48, 0, 1)],
        "(cached tokens, skipped, snapshot hits) per corrupted file"
    );

    let e = Engine::start(config()).expect("restart");
    assert_eq!(disk(&e).snapshots, 3);
    let (warm2, usage) = go(&e, &turn2, 8, true);
    assert_eq!(
        usage.cached_tokens, 48,
        "resumed from disk inside the reply"
    );
    assert_eq!(warm2, cold2, "warm from disk = cold");
    let (warm, usage) = go(&e, &prompt, want.len(), true);
    assert_eq!(
        usage.cached_tokens, 32,
        "resumed from disk inside the prompt"
    );
    assert_eq!(warm, want, "warm from disk = mlx_lm");
    let d = disk(&e);
    assert_eq!((d.snapshot_hits, d.skipped), (2, 0), "{d:?}");
    assert!(d.hits >= 6, "{d:?}");

    // Two more conversations overflow the RAM store (2 x 2 + 2
    // snapshots): the evicted ones go to disk, and the first prompt
    // resumes from its snapshot there.
    for k in 1..=2u32 {
        let other: Vec<u32> = prompt.iter().map(|t| (t + 7 * k) % 256).collect();
        let (cold, _) = go(&e, &other, want.len(), false);
        assert_eq!(go(&e, &other, want.len(), true).0, cold);
    }
    let r = e.stats().recurrent.expect("recurrent stats");
    assert!(r.snapshots_evicted >= 5, "{r:?}");
    assert!(disk(&e).snapshots > 3, "evicted snapshots were saved");
    let (again, usage) = go(&e, &prompt, want.len(), true);
    assert_eq!((again, usage.cached_tokens), (want.clone(), 32));
    assert_eq!(disk(&e).snapshot_hits, 3);
    drop(e);

    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&model);
}
