//! The crate's tests link libmlx through `mlxcel-model` (the GGUF header
//! only): MLX's link arguments reach only the package that prints them.
fn main() {
    mlxcel_mlx_link::emit();
}
