//! `mlxcel-server -m <model-dir>`: the OpenAI-compatible HTTP server.

/// OpenAI-compatible LLM inference server on MLX.
#[derive(Debug, clap::Parser)]
#[command(name = "mlxcel-server", version)]
struct Cli {
    #[command(flatten)]
    serve: mlxcel::ServeArgs,
}

fn main() {
    mlxcel::init_logging();
    // Not a plain return from `main`: see `mlxcel::exit`.
    let cli: Cli = mlxcel::parse_args(None);
    mlxcel::exit(mlxcel::serve(cli.serve))
}
