//! `mlxcel-server -m <model-dir>`: the OpenAI-compatible HTTP server.

fn main() {
    mlxcel::init_logging();
    let cli: mlxcel::ServerCli = mlxcel::parse_args(None);
    // Not a plain return from `main`: see `mlxcel::exit`.
    mlxcel::exit(mlxcel::serve(cli.serve))
}
