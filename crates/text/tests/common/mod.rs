//! Shared by the text crate's integration tests.

use std::path::PathBuf;

/// The test model's directory (`MLXCEL_TEST_MODEL`, else the repository's
/// `models/SmolLM2-135M-Instruct`); a missing model is a failure.
pub fn model_dir() -> PathBuf {
    let dir = std::env::var_os("MLXCEL_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct")
        });
    assert!(
        dir.join("tokenizer.json").is_file(),
        "{} has no tokenizer.json: run scripts/setup.sh (or set MLXCEL_TEST_MODEL)",
        dir.display()
    );
    dir
}
