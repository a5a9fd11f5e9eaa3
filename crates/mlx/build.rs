//! Finds MLX (headers + `libmlx`) and builds the cxx shim against it.
//!
//! Search order: `MLX_DIR` (a folder holding `include/mlx` and `lib/libmlx.*`,
//! e.g. the `mlx` package folder of a wheel), then the project's Python
//! environment (`<repo>/.venv`, created by `scripts/setup.sh`). The binary
//! gets a RUNPATH to that `lib` folder, so `LD_LIBRARY_PATH` can swap in
//! another build of the same MLX version (e.g. the CUDA wheel's).
//!
//! On Linux the wheel's bundled BLAS is reference netlib; when OpenBLAS is
//! installed (`libopenblas.so`), it is linked ahead of `libmlx` so its
//! `cblas_sgemm` wins symbol resolution. `MLXCEL_NO_OPENBLAS=1` turns that off.

use std::path::{Path, PathBuf};
use std::process::Command;

fn find_mlx_dir(manifest: &Path) -> PathBuf {
    if let Ok(dir) = std::env::var("MLX_DIR") {
        return PathBuf::from(dir);
    }
    let repo = manifest.join("../..");
    let python = repo.join(".venv/bin/python");
    let out = Command::new(&python)
        .args([
            "-c",
            "import mlx, os; print(os.path.dirname(os.path.abspath(mlx.__path__[0] + '/x')))",
        ])
        .output();
    match out {
        Ok(o) if o.status.success() => PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()),
        _ => panic!(
            "MLX not found: set MLX_DIR to the mlx package folder (with include/ and lib/), \
             or run scripts/setup.sh to create {}",
            python.display()
        ),
    }
}

fn find_openblas() -> Option<PathBuf> {
    if std::env::var("MLXCEL_NO_OPENBLAS").is_ok_and(|v| v == "1") {
        return None;
    }
    let candidates = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|d| d.join("libopenblas.so").exists())
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let mlx_dir = find_mlx_dir(&manifest);
    let include = mlx_dir.join("include");
    let lib = mlx_dir.join("lib");
    assert!(
        include.join("mlx/mlx.h").exists(),
        "{} has no mlx/mlx.h",
        include.display()
    );

    cxx_build::bridge("src/ffi.rs")
        .file("src/shim.cc")
        .include(&include)
        .include(&manifest)
        .std("c++20")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .opt_level(2)
        .compile("mlxcel_mlx_shim");

    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "linux" {
        if let Some(blas) = find_openblas() {
            // Linked by each executable (see mlxcel-mlx-link), ahead of libmlx.
            println!("cargo:openblas_dir={}", blas.display());
            println!("cargo:rustc-link-arg=-L{}", blas.display());
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg=-lopenblas");
            println!("cargo:rustc-link-arg=-Wl,--as-needed");
        }
    }
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // Dependents read these as DEP_MLX_LIB_DIR / DEP_MLX_INCLUDE to set their own RUNPATH.
    println!("cargo:lib_dir={}", lib.display());
    println!("cargo:include={}", include.display());
    println!("cargo:rerun-if-changed=src/ffi.rs");
    println!("cargo:rerun-if-changed=src/shim.cc");
    println!("cargo:rerun-if-changed=include/shim.h");
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    println!("cargo:rerun-if-env-changed=MLXCEL_NO_OPENBLAS");
}
