//! `mlxcel-server -m <model-dir>`: the OpenAI-compatible HTTP server.

fn main() {
    // A child the engine started to compile one GPU kernel
    // (`mlxcel_engine::kernels`): it does that and nothing else.
    if let Some(status) = mlxcel_engine::kernels::child_main() {
        std::process::exit(status);
    }
    mlxcel::init_logging();
    let cli: mlxcel::ServerCli = mlxcel::parse_args(None);
    // Not a plain return from `main`: see `mlxcel::exit`.
    mlxcel::exit(mlxcel::serve(cli.serve))
}
