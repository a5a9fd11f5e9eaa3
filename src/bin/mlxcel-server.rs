//! `mlxcel-server -m <model-dir>`: the OpenAI-compatible HTTP server.

use clap::Parser;

/// OpenAI-compatible LLM inference server on MLX.
#[derive(Debug, Parser)]
#[command(name = "mlxcel-server", version)]
struct Cli {
    #[command(flatten)]
    serve: mlxcel::ServeArgs,
}

fn main() {
    mlxcel::init_logging();
    // Not a plain return from `main`: see `mlxcel::exit`.
    mlxcel::exit(mlxcel::serve(Cli::parse().serve))
}
