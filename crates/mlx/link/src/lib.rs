//! For the build script of every crate that links binaries or tests against
//! `mlxcel-mlx`: cargo passes `mlxcel-mlx`'s link metadata only to its direct
//! dependents (as `DEP_MLX_*`), and `rustc-link-arg` only to the package that
//! prints it, so each such crate calls [`emit`] from its `build.rs`.

/// Prints the RUNPATH to `libmlx` and, when `mlxcel-mlx` found OpenBLAS, links
/// it into the executable ahead of `libmlx`'s bundled reference BLAS (the
/// dynamic linker resolves `cblas_sgemm` in the executable's own `NEEDED`
/// libraries before those of `libmlx`).
pub fn emit() {
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    if let Ok(dir) = std::env::var("DEP_MLX_OPENBLAS_DIR") {
        println!("cargo:rustc-link-arg=-L{dir}");
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-lopenblas");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIB_DIR");
    println!("cargo:rerun-if-env-changed=DEP_MLX_OPENBLAS_DIR");
}
