//! Build-script helper: where MLX is, and how to link against it.
//!
//! `mlxcel-mlx`'s build script uses [`mlx_dir`] to compile its shim; every
//! crate whose binaries or tests link `libmlx` (directly or through another
//! crate) calls [`emit`] from its own `build.rs`, because `rustc-link-arg`
//! reaches only the package that prints it.
//!
//! Search order for MLX: `MLX_DIR` (a folder with `include/mlx` and
//! `lib/libmlx.*`, e.g. the `mlx` package folder of a wheel), then the `mlx`
//! package of the nearest `.venv` above the crate (made by
//! `scripts/setup.sh`).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The MLX folder (holding `include/` and `lib/`).
///
/// # Panics
/// When MLX cannot be found (a build-script failure with instructions).
pub fn mlx_dir() -> PathBuf {
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    if let Ok(dir) = std::env::var("MLX_DIR") {
        return PathBuf::from(dir);
    }
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let python = manifest
        .ancestors()
        .map(|d| d.join(".venv/bin/python"))
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "MLX not found: run scripts/setup.sh (creates .venv with mlx) or set MLX_DIR \
                 to the mlx package folder (with include/ and lib/)"
            )
        });
    let out = Command::new(&python)
        .args([
            "-c",
            "import mlx, os; print(os.path.abspath(mlx.__path__[0]))",
        ])
        .output();
    match out {
        Ok(o) if o.status.success() => PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()),
        _ => panic!(
            "{} cannot import mlx: run scripts/setup.sh",
            python.display()
        ),
    }
}

/// The folder holding `libopenblas.so` on Linux, unless
/// `MLXCEL_NO_OPENBLAS=1`.
pub fn openblas_dir() -> Option<PathBuf> {
    println!("cargo:rerun-if-env-changed=MLXCEL_NO_OPENBLAS");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux")
        || std::env::var("MLXCEL_NO_OPENBLAS").is_ok_and(|v| v == "1")
    {
        return None;
    }
    [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ]
    .iter()
    .map(Path::new)
    .find(|d| d.join("libopenblas.so").exists())
    .map(Path::to_path_buf)
}

/// Prints the link arguments for the calling package's binaries and tests:
/// `libmlx` with a RUNPATH to its folder (so `LD_LIBRARY_PATH` can swap in
/// the CUDA build of the same MLX version), and, when found, OpenBLAS linked
/// into the executable itself: the dynamic linker then resolves
/// `cblas_sgemm` in OpenBLAS before `libmlx`'s bundled reference BLAS (the
/// executable's own `NEEDED` libraries come first in the search order).
pub fn emit() {
    let lib = mlx_dir().join("lib");
    println!("cargo:rustc-link-arg=-L{}", lib.display());
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    if let Some(dir) = openblas_dir() {
        println!("cargo:rustc-link-arg=-L{}", dir.display());
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-lopenblas");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
