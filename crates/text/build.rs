fn main() {
    mlxcel_mlx_link::emit();
}
