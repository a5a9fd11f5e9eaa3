//! Where `-m` points: a local checkpoint directory, a GGUF file, or a Hugging Face hub
//! repository id (`org/name`) resolved through the local hub cache and
//! downloaded with `hf-hub` when missing.

use anyhow::{bail, Context};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo};
use std::path::{Path, PathBuf};

/// Files a checkpoint needs besides its weights.
const REQUIRED: &[&str] = &["config.json", "tokenizer.json"];
/// Files read when present.
const OPTIONAL: &[&str] = &[
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];
/// The weight index of a sharded checkpoint.
const INDEX: &str = "model.safetensors.index.json";
/// The weights of a single-file checkpoint.
const SINGLE: &str = "model.safetensors";

/// Resolves `-m`: an existing directory or `.gguf` file is used as is; `org/name` is looked
/// up in the hub cache (`cache_dir`, default `$HF_HOME/hub` or
/// `~/.cache/huggingface/hub`) and downloaded into it when any file is
/// missing (progress in the log). Returns the checkpoint directory.
///
/// # Errors
/// A path that is neither a directory nor a repository id, a repository
/// without `config.json`/`tokenizer.json`/weights, or a failed download.
pub fn resolve(model: &Path, cache_dir: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if model.is_dir() || mlxcel_engine::loader::is_gguf(model) {
        return Ok(model.to_path_buf());
    }
    let Some(repo_id) = repo_id(model) else {
        bail!(
            "{} is not a model directory or .gguf file (or a hub id like org/name)",
            model.display()
        );
    };
    let cache = cache_dir.map(Cache::new).unwrap_or_else(Cache::from_env);
    if let Some(dir) = cached_snapshot(&cache, &repo_id) {
        tracing::info!(repo = %repo_id, dir = %dir.display(), "model found in the hub cache");
        return Ok(dir);
    }
    download(&cache, &repo_id)
}

/// `org/name` (one slash, no path syntax) or `None`.
fn repo_id(model: &Path) -> Option<String> {
    let s = model.to_str()?;
    let mut parts = s.split('/');
    let (org, name) = (parts.next()?, parts.next()?);
    let ok = |p: &str| !p.is_empty() && p != "." && p != ".." && !p.starts_with('~');
    (parts.next().is_none() && ok(org) && ok(name)).then(|| s.to_string())
}

/// The snapshot directory when every needed file is already cached.
fn cached_snapshot(cache: &Cache, repo_id: &str) -> Option<PathBuf> {
    let repo = cache.repo(Repo::model(repo_id.to_string()));
    let config = repo.get("config.json")?;
    for f in REQUIRED {
        repo.get(f)?;
    }
    for shard in weight_files(&|f| repo.get(f))? {
        repo.get(&shard)?;
    }
    config.parent().map(Path::to_path_buf)
}

/// The weight files of a checkpoint, given a way to fetch a file.
fn weight_files(get: &dyn Fn(&str) -> Option<PathBuf>) -> Option<Vec<String>> {
    if let Some(index) = get(INDEX) {
        let text = std::fs::read_to_string(index).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        let mut shards: Vec<String> = v
            .get("weight_map")?
            .as_object()?
            .values()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect();
        shards.sort();
        shards.dedup();
        return Some(shards);
    }
    get(SINGLE).map(|_| vec![SINGLE.to_string()])
}

fn download(cache: &Cache, repo_id: &str) -> anyhow::Result<PathBuf> {
    tracing::info!(repo = %repo_id, cache = %cache.path().display(), "downloading model");
    let api = ApiBuilder::from_cache(cache.clone())
        // hf-hub draws one bar per file on a terminal (indicatif, as ours).
        .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .build()
        .context("hub client")?;
    let repo = api.model(repo_id.to_string());
    let fetch = |f: &str| -> anyhow::Result<PathBuf> {
        tracing::info!(repo = %repo_id, file = f, "downloading");
        repo.get(f)
            .with_context(|| format!("downloading {f} of {repo_id}"))
    };
    let mut dir = None;
    for f in REQUIRED {
        dir = fetch(f)?.parent().map(Path::to_path_buf);
    }
    for f in OPTIONAL {
        if let Err(e) = fetch(f) {
            tracing::debug!(file = f, error = %e, "optional file not downloaded");
        }
    }
    let shards = weight_files(&|f| fetch(f).ok())
        .with_context(|| format!("{repo_id} has neither {INDEX} nor {SINGLE}"))?;
    for shard in &shards {
        fetch(shard)?;
    }
    dir.context("download produced no directory")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hub cache laid out as `hf-hub` and `huggingface_hub` write it, with
    /// the test checkpoint's files linked into one snapshot; `skip` files
    /// are left out.
    fn fake_cache(name: &str, skip: &[&str]) -> (PathBuf, PathBuf) {
        let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct");
        assert!(model.join("config.json").exists(), "run scripts/setup.sh");
        let cache = std::env::temp_dir().join(format!("mlxcel-hub-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        let repo = cache.join("models--mlxcel-test--smollm2");
        let snapshot = repo.join("snapshots/0123456789abcdef");
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "0123456789abcdef").unwrap();
        for entry in std::fs::read_dir(&model).unwrap() {
            let path = entry.unwrap().path();
            let file = path.file_name().unwrap().to_str().unwrap().to_string();
            if path.is_file() && !skip.contains(&file.as_str()) {
                std::os::unix::fs::symlink(&path, snapshot.join(&file)).unwrap();
            }
        }
        (cache, snapshot)
    }

    #[test]
    fn a_cached_hub_snapshot_resolves_without_network() {
        let (cache, snapshot) = fake_cache("full", &[]);
        let dir = resolve(Path::new("mlxcel-test/smollm2"), Some(cache.clone())).unwrap();
        assert_eq!(dir, snapshot);
        assert!(dir.join("model.safetensors").exists());
        std::fs::remove_dir_all(cache).unwrap();
    }

    #[test]
    fn an_incomplete_snapshot_is_not_used() {
        let (cache, _) = fake_cache("partial", &["model.safetensors"]);
        let c = Cache::new(cache.clone());
        assert_eq!(
            cached_snapshot(&c, "mlxcel-test/smollm2"),
            None,
            "weights missing"
        );
        let (cache2, _) = fake_cache("notok", &["tokenizer.json"]);
        assert_eq!(
            cached_snapshot(&Cache::new(cache2.clone()), "mlxcel-test/smollm2"),
            None
        );
        std::fs::remove_dir_all(cache).unwrap();
        std::fs::remove_dir_all(cache2).unwrap();
    }

    #[test]
    fn local_directories_win_and_other_paths_fail() {
        let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct");
        assert_eq!(resolve(&model, None).unwrap(), model);
        let err = resolve(Path::new("/no/such/model/dir"), None).unwrap_err();
        assert!(err.to_string().contains("not a model directory"), "{err}");
    }

    #[test]
    fn repo_ids_and_paths() {
        assert_eq!(
            repo_id(Path::new("HuggingFaceTB/SmolLM2-135M-Instruct")).as_deref(),
            Some("HuggingFaceTB/SmolLM2-135M-Instruct")
        );
        for not_id in [
            "models",
            "./models/x",
            "/abs/dir",
            "a/b/c",
            "../x",
            "~/x",
            "a/",
        ] {
            assert_eq!(repo_id(Path::new(not_id)), None, "{not_id}");
        }
    }
}
