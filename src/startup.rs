//! What both binaries do first: parse the arguments (with the `--config`
//! file), the version strings, and logging.

use crate::{config, progress};

/// Parses the process's arguments as `P`, with the settings of the
/// `--config` file of the server's flags (see [`config`]) put before the
/// command line's. `serve` names the subcommand that takes the server's
/// flags (`mlxcel serve`), or is `None` when the command itself does
/// (`mlxcel-server`). Exits with clap's usage errors (status 2), and with a
/// config file's error.
pub fn parse_args<P: clap::Parser>(serve: Option<&str>) -> P {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // Only `--version` asks MLX about the device (a GPU backend may take a
    // moment to start).
    let asks_version = argv
        .iter()
        .skip(1)
        .take_while(|a| *a != "--")
        .any(|a| a == "--version");
    let mut command = P::command().version(SHORT_VERSION);
    if asks_version {
        command = command.long_version(long_version());
    }
    command = match serve {
        None => command.args_override_self(true),
        Some(name) => command.mut_subcommand(name, |c| c.args_override_self(true)),
    };
    // The server's flags start after the binary (and the subcommand).
    let start = match serve {
        None => Some(1),
        Some(name) => (argv.get(1).is_some_and(|a| a == name)).then_some(2),
    };
    let server = match serve {
        None => Some(&command),
        Some(name) => command.find_subcommand(name),
    };
    if let (Some(start), Some(server)) = (start, server) {
        let tail = argv.split_off(start.min(argv.len()));
        match config::args_with_config(server, tail) {
            Ok(tail) => argv.extend(tail),
            Err(err) => {
                eprintln!("error: {err}");
                std::process::exit(2);
            }
        }
    }
    let matches = command.get_matches_from(argv);
    P::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// What `-V` prints after the binary's name: the version and the git
/// commit it was built from (`unknown` when built outside a git checkout
/// without `MLXCEL_GIT_COMMIT`).
pub const SHORT_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("MLXCEL_GIT_COMMIT"),
    ")"
);

/// What `--version` prints after the binary's name: the version, the git
/// commit, the version of the MLX library loaded, and the device MLX runs
/// on by default (`--device auto`) as MLX names it.
pub fn long_version() -> String {
    let gpu = mlxcel_mlx::gpu_available();
    let kind = if gpu { "gpu" } else { "cpu" };
    let device = mlxcel_mlx::device_name(gpu).unwrap_or_else(|e| format!("unnamed ({e})"));
    format!(
        "{}\ncommit: {}\nmlx: {}\ndevice: {kind}, {device}",
        env!("CARGO_PKG_VERSION"),
        env!("MLXCEL_GIT_COMMIT"),
        mlxcel_mlx::version(),
    )
}

/// Logs to stderr; `RUST_LOG` filters (default `info`). On a terminal,
/// loading weights and warming up also draw progress bars
/// ([`progress::ProgressLayer`]), whatever `RUST_LOG` says.
pub fn init_logging() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Progress events are for the bars, never log lines.
    let filter = match format!("{}=off", progress::TARGET).parse() {
        Ok(directive) => filter.add_directive(directive),
        Err(_) => filter,
    };
    let bars = progress::Bars::default();
    let logs = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(progress::BarWriter::new(bars.clone()))
        .with_filter(filter);
    let bars_layer = progress::ProgressLayer::stderr(bars).with_filter(
        tracing_subscriber::filter::Targets::new()
            .with_target(progress::TARGET, tracing::Level::DEBUG),
    );
    let _ = tracing_subscriber::registry()
        .with(logs)
        .with(bars_layer)
        .try_init();
}
