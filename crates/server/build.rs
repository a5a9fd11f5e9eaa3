//! The HTTP layer never calls MLX, but its test binaries link the engine
//! (for the API types) and so `libmlx`: give them its RUNPATH.
fn main() {
    mlxcel_mlx_link::emit();
}
