//! Shared command-line plumbing of the `mlxcel` and `mlxcel-server` binaries:
//! the model flags, the config file, logging, and the HTTP serve loop.
//!
//! - args.rs: the flags ([`ModelArgs`], [`ServeArgs`]), their value enums
//!   and parsers, and the engine configuration the model flags describe.
//! - startup.rs: argument parsing with the config file ([`parse_args`]),
//!   the version strings, logging.
//! - serve.rs: the serve loop ([`serve()`], [`exit`]): ready line, signals,
//!   the process's exit.

mod args;
pub mod config;
pub mod model_source;
pub mod package_files;
pub mod progress;
mod serve;
mod startup;

pub use args::{
    ApiKeyArg, AttentionPathArg, AutoOr, BackendArg, DeviceArg, DistributedBackendArg, DtypeArg,
    ModelArgs, QuantizeArg, ReasoningParserArg, ServeArgs, ServerCli, SwitchArg, WeightsArg,
};
pub use serve::{exit, serve};
pub use startup::{init_logging, long_version, parse_args, SHORT_VERSION};
