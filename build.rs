//! Links MLX (see `mlxcel-mlx-link`) and records the git commit that
//! `--version` prints.

use std::path::Path;
use std::process::Command;

fn main() {
    mlxcel_mlx_link::emit();
    let commit = git_commit().unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=MLXCEL_GIT_COMMIT={commit}");
}

/// `MLXCEL_GIT_COMMIT` when set (a build from a source tarball can pass
/// it), else the short hash of the checkout's `HEAD`; `None` outside a git
/// checkout or without git. Asks cargo to run this again when `HEAD`
/// moves.
fn git_commit() -> Option<String> {
    println!("cargo:rerun-if-env-changed=MLXCEL_GIT_COMMIT");
    if let Some(commit) = std::env::var("MLXCEL_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
    {
        return Some(commit.trim().to_owned());
    }
    // HEAD names the branch; the branch's ref (loose or packed) moves on a
    // commit. Only files that exist are watched: a missing one would make
    // cargo run this script on every build.
    let git_dir = git(&["rev-parse", "--git-dir"])?;
    let common_dir = git(&["rev-parse", "--git-common-dir"]).unwrap_or_else(|| git_dir.clone());
    let mut watched = vec![Path::new(&git_dir).join("HEAD")];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(Path::new(&common_dir).join(branch));
    }
    watched.push(Path::new(&common_dir).join("packed-refs"));
    for file in watched.iter().filter(|f| f.exists()) {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    git(&["rev-parse", "--short=12", "HEAD"])
}

/// The trimmed output of `git args` in this package's directory, or
/// `None` when git is missing or fails.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_owned())
}
