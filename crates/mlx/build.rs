//! Builds the cxx shim against MLX's headers and links `libmlx` (found by
//! `mlxcel-mlx-link`, which every crate linking binaries against MLX also
//! calls for its RUNPATH and BLAS).

fn main() {
    let mlx = mlxcel_mlx_link::mlx_dir();
    let include = mlx.join("include");
    assert!(
        include.join("mlx/mlx.h").exists(),
        "{} has no mlx/mlx.h",
        include.display()
    );
    cxx_build::bridge("src/ffi.rs")
        .file("src/shim.cc")
        .file("src/paged_attention.cc")
        .file("src/gated_delta.cc")
        .file("src/ssm.cc")
        .file("src/gemv_forward.cc")
        .file("src/skinny_gemm.cc")
        .file("src/distributed.cc")
        .include(&include)
        .std("c++20")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .opt_level(3)
        .flag_if_supported("-funroll-loops")
        .compile("mlxcel_mlx_shim");
    println!(
        "cargo:rustc-link-search=native={}",
        mlx.join("lib").display()
    );
    println!("cargo:rustc-link-lib=dylib=mlx");
    mlxcel_mlx_link::emit();
    println!("cargo:rerun-if-changed=src/ffi.rs");
    println!("cargo:rerun-if-changed=src/shim.cc");
    println!("cargo:rerun-if-changed=src/paged_attention.cc");
    println!("cargo:rerun-if-changed=src/gated_delta.cc");
    println!("cargo:rerun-if-changed=src/ssm.cc");
    println!("cargo:rerun-if-changed=src/gemv_forward.cc");
    println!("cargo:rerun-if-changed=src/skinny_gemm.cc");
    println!("cargo:rerun-if-changed=src/skinny_gemm.h");
    println!("cargo:rerun-if-changed=include/shim.h");
    println!("cargo:rerun-if-changed=src/distributed.cc");
    println!("cargo:rerun-if-changed=include/distributed.h");
}
