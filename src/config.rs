//! `--config FILE`: server flags from a TOML file.
//!
//! Every key is the long name of a flag of `mlxcel-server` (`mlxcel
//! serve`), spelled as on the command line, with dashes
//! (`kv-cache-budget = "4GiB"`, `port = 8080`, `no-prompt-cache = true`).
//! A value is a string, an integer, a float or a boolean, and is read as the
//! flag's value would be (`--port 8080`); a boolean turns a switch such as
//! `--no-prompt-cache` on (`true`) or leaves it off (`false`).
//!
//! Precedence, highest first: the command line, the flag's environment
//! variable (`MLXCEL_MODEL`, `MLXCEL_HOST`, `MLXCEL_PORT`,
//! `MLXCEL_API_KEY`), the file, the built-in default. An unknown key, a key
//! spelled with underscores, a table or an array, and a value the flag
//! refuses are errors that name the file, the line and the key.
//!
//! [`args_with_config`] does the merge on the raw arguments: the file's
//! settings become flags put in front of the command line's, and the
//! command is parsed with `args_override_self`, so a flag given again on the
//! command line wins and clap parses, checks and documents every flag in
//! one place.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

/// The flag that names the file.
pub const CONFIG_FLAG: &str = "config";

/// Why a configuration file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read the config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML (the message names the line).
    #[error("{path}: {message}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The TOML parser's message.
        message: String,
    },
    /// A key that is not a flag of the server.
    #[error("{path}:{line}: unknown key `{key}`: not a flag of {command}{hint}")]
    UnknownKey {
        /// The file.
        path: PathBuf,
        /// 1-based line of the key.
        line: usize,
        /// The key as written.
        key: String,
        /// The command whose flags were expected.
        command: String,
        /// A suggestion (the dashed spelling of an underscored key), or "".
        hint: String,
    },
    /// A known key whose value the flag does not accept.
    #[error("{path}:{line}: `{key}`: {message}")]
    Value {
        /// The file.
        path: PathBuf,
        /// 1-based line of the value.
        line: usize,
        /// The key.
        key: String,
        /// What is wrong with the value.
        message: String,
    },
}

/// `args` (the arguments after the binary's name, or after a subcommand's
/// name) with the settings of the `--config` file they name put in front,
/// as flags of `command` (see the module documentation). Without
/// `--config` (or `MLXCEL_CONFIG`), `args` is returned as it is. Parse the
/// result with `command.args_override_self(true)`.
pub fn args_with_config(
    command: &clap::Command,
    args: Vec<OsString>,
) -> Result<Vec<OsString>, ConfigError> {
    let from_env = || {
        command
            .get_arguments()
            .find(|a| a.get_long() == Some(CONFIG_FLAG))
            .and_then(|a| a.get_env())
            .and_then(std::env::var_os)
            .filter(|v| !v.is_empty())
    };
    let Some(path) = config_path(&args).or_else(from_env) else {
        return Ok(args);
    };
    let path = PathBuf::from(path);
    let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
        path: path.clone(),
        source,
    })?;
    let env_is_set = |name: &OsStr| std::env::var_os(name).is_some_and(|v| !v.is_empty());
    let mut merged = config_args(command, &path, &text, env_is_set)?;
    merged.extend(args);
    Ok(merged)
}

/// The value of `--config FILE` / `--config=FILE` in `args`, if any (the
/// last one, as clap would take it). Scanning stops at `--`.
fn config_path(args: &[OsString]) -> Option<OsString> {
    let flag = format!("--{CONFIG_FLAG}");
    let with_value = format!("--{CONFIG_FLAG}=");
    let mut found = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let Some(text) = arg.to_str() else { continue };
        if text == "--" {
            break;
        }
        if text == flag {
            found = args.next().cloned();
        } else if let Some(value) = text.strip_prefix(&with_value) {
            found = Some(OsString::from(value));
        }
    }
    found
}

/// The flags of `command` that the TOML `text` (read from `path`) sets,
/// leaving out those whose environment variable is set (`env_is_set`):
/// the environment wins over the file.
pub fn config_args(
    command: &clap::Command,
    path: &Path,
    text: &str,
    env_is_set: impl Fn(&OsStr) -> bool,
) -> Result<Vec<OsString>, ConfigError> {
    type Entries = std::collections::BTreeMap<toml::Spanned<String>, toml::Spanned<toml::Value>>;
    let entries: Entries = toml::from_str(text).map_err(|e| ConfigError::Syntax {
        path: path.to_owned(),
        message: e.to_string().trim_end().to_owned(),
    })?;
    // In the file's order, so the first bad line is the one reported.
    let mut entries: Vec<_> = entries.into_iter().collect();
    entries.sort_by_key(|(key, _)| key.span().start);
    let line_of = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
    let mut out = Vec::new();
    for (key, value) in &entries {
        let name = key.get_ref().as_str();
        let line = line_of(key.span().start);
        let unknown = |hint: String| ConfigError::UnknownKey {
            path: path.to_owned(),
            line,
            key: name.to_owned(),
            command: command.get_name().to_owned(),
            hint,
        };
        let arg = command
            .get_arguments()
            .filter(|a| a.get_long() != Some(CONFIG_FLAG))
            .find(|a| a.get_long() == Some(name));
        let Some(arg) = arg else {
            let dashed = name.replace('_', "-");
            let known = dashed != name
                && command
                    .get_arguments()
                    .any(|a| a.get_long() == Some(dashed.as_str()));
            return Err(if name == CONFIG_FLAG {
                unknown(" (a config file cannot name another)".to_owned())
            } else if known {
                unknown(format!(" (keys are spelled like the flags: `{dashed}`)"))
            } else {
                unknown(String::new())
            });
        };
        if arg.get_env().is_some_and(&env_is_set) {
            continue;
        }
        let bad_value = |message: String| ConfigError::Value {
            path: path.to_owned(),
            line: line_of(value.span().start),
            key: name.to_owned(),
            message,
        };
        let switch = matches!(arg.get_action(), clap::ArgAction::SetTrue);
        let flag = OsString::from(format!("--{name}"));
        let text = match (value.get_ref(), switch) {
            (toml::Value::Boolean(true), true) => {
                out.push(flag);
                continue;
            }
            (toml::Value::Boolean(false), true) => continue,
            (_, true) => return Err(bad_value("expected true or false".to_owned())),
            (toml::Value::String(s), false) => s.clone(),
            (toml::Value::Integer(n), false) => n.to_string(),
            (toml::Value::Float(x), false) => x.to_string(),
            (toml::Value::Boolean(_), false) => {
                return Err(bad_value(
                    "expected a value as on the command line, not true or false".to_owned(),
                ))
            }
            (_, false) => {
                return Err(bad_value(
                    "expected a string, a number or a boolean".to_owned(),
                ))
            }
        };
        check_value(command, arg, &text).map_err(bad_value)?;
        out.push(flag);
        out.push(OsString::from(text));
    }
    Ok(out)
}

/// Whether `arg` of `command` accepts `value`: clap's own parser for that
/// flag alone, so the file gets the command line's checks and messages.
fn check_value(command: &clap::Command, arg: &clap::Arg, value: &str) -> Result<(), String> {
    let probe = clap::Command::new(command.get_name().to_owned())
        .no_binary_name(true)
        .disable_help_flag(true)
        .disable_version_flag(true)
        .arg(arg.clone().required(false).env(None::<&str>));
    let long = format!("--{}", arg.get_long().unwrap_or_default());
    match probe.try_get_matches_from([long.as_str(), value]) {
        Ok(_) => Ok(()),
        Err(e) => {
            // clap's rendering: "error: invalid value 'x' for '--f <F>': ...".
            let rendered = e.render().to_string();
            let first = rendered.lines().next().unwrap_or_default();
            Err(first.trim_start_matches("error: ").to_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ServerCli;
    use clap::{CommandFactory, FromArgMatches};

    fn command() -> clap::Command {
        ServerCli::command().args_override_self(true)
    }

    /// Parses `cli` (the arguments after the binary) with `toml` as the
    /// config file; `env` names the environment variables that are set.
    fn parse(toml: &str, cli: &[&str], env: &[&str]) -> Result<crate::ServeArgs, String> {
        let command = command();
        let env_is_set = |name: &OsStr| env.iter().any(|e| OsStr::new(e) == name);
        let mut args = config_args(&command, Path::new("server.toml"), toml, env_is_set)
            .map_err(|e| e.to_string())?;
        args.extend(cli.iter().map(OsString::from));
        let argv = std::iter::once(OsString::from("mlxcel-server")).chain(args);
        let matches = command
            .try_get_matches_from(argv)
            .map_err(|e| e.to_string())?;
        ServerCli::from_arg_matches(&matches)
            .map(|c| c.serve)
            .map_err(|e| e.to_string())
    }

    const FILE: &str = r#"
# the model and where to listen
model = "/srv/models/smollm2"
host = "0.0.0.0"
port = 9000
parallel = 8
kv-cache-budget = "2GiB"
no-prompt-cache = true
cudnn-attention = false
shutdown-timeout = 2.5
warmup = "off"
"#;

    #[test]
    fn the_file_sets_flags() {
        let args = parse(FILE, &[], &[]).unwrap();
        assert_eq!(args.model.model, PathBuf::from("/srv/models/smollm2"));
        assert_eq!(args.host, "0.0.0.0");
        assert_eq!(args.port, 9000);
        assert_eq!(args.model.parallel, 8);
        assert_eq!(
            args.model.kv_cache_budget,
            crate::AutoOr::Value(2 * 1024 * 1024 * 1024)
        );
        assert!(args.model.no_prompt_cache);
        assert!(!args.model.cudnn_attention);
        assert_eq!(
            args.shutdown_timeout,
            std::time::Duration::from_millis(2500)
        );
        assert_eq!(args.model.warmup, crate::SwitchArg::Off);
        // Flags the file leaves out keep their defaults.
        assert_eq!(args.default_max_tokens, 512);
        assert_eq!(args.model.kv_block_size, 32);
    }

    #[test]
    fn dequant_matmul_rows_takes_auto_or_a_number() {
        let args = parse(FILE, &[], &[]).unwrap();
        assert_eq!(args.model.dequant_matmul_rows, crate::AutoOr::Auto);
        let args = parse(FILE, &["--dequant-matmul-rows", "0"], &[]).unwrap();
        assert_eq!(args.model.dequant_matmul_rows, crate::AutoOr::Value(0));
        let args = parse(FILE, &["--dequant-matmul-rows=96"], &[]).unwrap();
        assert_eq!(args.model.dequant_matmul_rows, crate::AutoOr::Value(96));
        assert!(parse(FILE, &["--dequant-matmul-rows", "some"], &[]).is_err());
    }

    #[test]
    fn the_command_line_wins_over_the_file() {
        let args = parse(
            FILE,
            &["--port", "7000", "--parallel=2", "-m", "/tmp/other"],
            &[],
        )
        .unwrap();
        assert_eq!(args.port, 7000);
        assert_eq!(args.model.parallel, 2);
        assert_eq!(args.model.model, PathBuf::from("/tmp/other"));
        // The rest still comes from the file.
        assert_eq!(args.host, "0.0.0.0");
        assert!(args.model.no_prompt_cache);
    }

    #[test]
    fn an_environment_variable_wins_over_the_file() {
        let command = command();
        let env_is_set = |name: &OsStr| name == "MLXCEL_PORT";
        let args = config_args(&command, Path::new("server.toml"), FILE, env_is_set).unwrap();
        let args: Vec<_> = args.iter().map(|a| a.to_string_lossy()).collect();
        assert!(!args.contains(&"--port".into()), "{args:?}");
        assert!(args.contains(&"--host".into()), "{args:?}");
    }

    #[test]
    fn a_switch_set_false_stays_off_and_the_command_line_can_turn_it_on() {
        let file = "model = \"m\"\nno-prompt-cache = false\n";
        assert!(!parse(file, &[], &[]).unwrap().model.no_prompt_cache);
        assert!(
            parse(file, &["--no-prompt-cache"], &[])
                .unwrap()
                .model
                .no_prompt_cache
        );
    }

    #[test]
    fn quantize_takes_bits_from_the_file_and_refuses_a_directory() {
        let file = "model = \"/srv/m.gguf\"\nquantize = \"8\"\n";
        let args = parse(file, &[], &[]).unwrap();
        assert_eq!(args.model.quantize, crate::QuantizeArg::Q8);
        let args = parse(file, &["--quantize", "none"], &[]).unwrap();
        assert_eq!(args.model.quantize, crate::QuantizeArg::None);
        // A checkpoint directory is already in MLX's format.
        let dir = std::env::temp_dir();
        let args = parse(file, &["--quantize", "4", "-m", dir.to_str().unwrap()], &[]).unwrap();
        let err = args.model.engine_config(None).unwrap_err().to_string();
        assert!(err.contains("--quantize 4 applies to GGUF files"), "{err}");
    }

    #[test]
    fn an_unknown_key_is_an_error_naming_it_and_its_line() {
        let file = "model = \"m\"\nport = 1\n\n  kv-cache-bugdet = \"1G\"\n";
        let err = parse(file, &[], &[]).unwrap_err();
        assert_eq!(
            err,
            "server.toml:4: unknown key `kv-cache-bugdet`: not a flag of mlxcel-server"
        );
    }

    #[test]
    fn an_underscored_key_is_an_error_that_suggests_the_flag_spelling() {
        let err = parse("default_max_tokens = 5\n", &[], &[]).unwrap_err();
        assert_eq!(
            err,
            "server.toml:1: unknown key `default_max_tokens`: not a flag of mlxcel-server \
             (keys are spelled like the flags: `default-max-tokens`)"
        );
    }

    #[test]
    fn config_help_and_tables_are_not_settings() {
        let err = parse("config = \"other.toml\"\n", &[], &[]).unwrap_err();
        assert!(
            err.starts_with("server.toml:1: unknown key `config`"),
            "{err}"
        );
        let err = parse("help = true\n", &[], &[]).unwrap_err();
        assert!(
            err.starts_with("server.toml:1: unknown key `help`"),
            "{err}"
        );
        let err = parse("model = \"m\"\n[server]\nport = 1\n", &[], &[]).unwrap_err();
        assert!(
            err.starts_with("server.toml:2: unknown key `server`"),
            "{err}"
        );
    }

    #[test]
    fn a_bad_value_is_an_error_naming_the_key_and_its_line() {
        let err = parse("model = \"m\"\nparallel = 0\n", &[], &[]).unwrap_err();
        assert!(
            err.starts_with("server.toml:2: `parallel`: invalid value '0'"),
            "{err}"
        );
        let err = parse("warmup = \"sometimes\"\n", &[], &[]).unwrap_err();
        assert!(
            err.starts_with("server.toml:1: `warmup`: invalid value 'sometimes'"),
            "{err}"
        );
        let err = parse("\nno-prompt-cache = \"yes\"\n", &[], &[]).unwrap_err();
        assert_eq!(
            err,
            "server.toml:2: `no-prompt-cache`: expected true or false"
        );
        let err = parse("port = true\n", &[], &[]).unwrap_err();
        assert!(
            err.starts_with("server.toml:1: `port`: expected a value"),
            "{err}"
        );
        let err = parse("allowed-origins = [\"*\"]\n", &[], &[]).unwrap_err();
        assert!(
            err.starts_with("server.toml:1: `allowed-origins`: expected a string"),
            "{err}"
        );
    }

    #[test]
    fn a_syntax_error_names_the_line() {
        let err = parse("model = \"m\"\nport = \n", &[], &[]).unwrap_err();
        assert!(
            err.starts_with("server.toml: TOML parse error at line 2"),
            "{err}"
        );
    }

    #[test]
    fn config_path_is_found_in_both_spellings() {
        let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(config_path(&args(&["--port", "1"])), None);
        assert_eq!(
            config_path(&args(&["--config", "a.toml", "--port", "1"])),
            Some("a.toml".into())
        );
        assert_eq!(
            config_path(&args(&["--config=b.toml"])),
            Some("b.toml".into())
        );
        assert_eq!(config_path(&args(&["--", "--config=c.toml"])), None);
    }

    /// The shipped example, with every commented-out setting turned on,
    /// sets every server flag, and each value is accepted.
    #[test]
    fn the_example_config_covers_every_flag_and_parses() {
        let example = include_str!("../docs/server.example.toml");
        // As shipped (the model left for the operator to set).
        parse(example, &["-m", "m"], &[]).unwrap();
        let example_all: String = example
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(setting) if setting.contains(" = ") => setting,
                _ => l,
            })
            .map(|l| format!("{l}\n"))
            .collect();
        let all = parse(&example_all, &[], &[]).unwrap();
        assert_eq!(all.port, 8080);
        assert!(all.model.max_kv_size.is_some());
        let keys: toml::Table = toml::from_str(&example_all).unwrap();
        for arg in command().get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if ["help", "version", CONFIG_FLAG].contains(&long) {
                continue;
            }
            assert!(
                keys.contains_key(long),
                "docs/server.example.toml lacks `{long}`"
            );
        }
    }
}
