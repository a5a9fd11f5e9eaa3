//! `mlxcel`: command-line front end (`generate`, `serve`).

use anyhow::Context;
use clap::Subcommand;
use mlxcel_engine::api::{
    ChatMessage, GenerationEvent, GenerationRequest, InferenceService, Prompt, SamplingParams,
};
use mlxcel_engine::Engine;
use mlxcel_model::profile::{self, ProfileMode};
use std::io::Write;

#[derive(Debug, clap::Parser)]
#[command(name = "mlxcel", version, about = "LLM inference on MLX")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate a completion for one prompt and print speed.
    Generate(GenerateArgs),
    /// Run the OpenAI-compatible server (same as `mlxcel-server`).
    Serve(mlxcel::ServeArgs),
    /// Write the man pages and shell completions of `mlxcel` and
    /// `mlxcel-server` under DIR (for packaging; see
    /// `mlxcel::package_files`).
    #[command(hide = true)]
    PackageFiles {
        /// Where to write `man/man1/`, `bash/`, `zsh/` and `fish/`.
        dir: std::path::PathBuf,
    },
}

#[derive(Debug, clap::Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: mlxcel::ModelArgs,
    /// The prompt (a user message unless --no-chat-template).
    #[arg(short = 'p', long, required_unless_present = "prompts_file")]
    prompt: Option<String>,
    /// A JSON file holding a list of prompts instead of `--prompt`: each a
    /// string (a user message, or raw text with --no-chat-template) or a
    /// list of token ids (used as is). They run at once (`--parallel`
    /// becomes their count) unless --sequential; with --print-token-ids
    /// each prompt's ids are printed as one JSON line.
    #[arg(long, value_name = "FILE")]
    prompts_file: Option<std::path::PathBuf>,
    /// Run the prompts of --prompts-file one after the other.
    #[arg(long)]
    sequential: bool,
    /// Most tokens to generate.
    #[arg(short = 'n', long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    max_tokens: u32,
    /// Send the prompt as raw text instead of a chat message.
    #[arg(long)]
    no_chat_template: bool,
    /// Sampling temperature (0 = greedy).
    #[arg(long = "temp", default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Random seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Generate exactly --max-tokens tokens, past end-of-sequence (benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// Print the generated token ids as JSON after the text.
    #[arg(long)]
    print_token_ids: bool,
    /// Generate this many times in one process (the prompt cache is reset
    /// between runs), printing each run's speed: the first run pays MLX's
    /// one-time costs (kernel compilation, graph plans), later ones don't.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// Send the prompt this many times at once (a batch of N rows;
    /// `--parallel` becomes N) and report the aggregate decode speed.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
    /// Print where each step's time went after the runs (see
    /// docs/performance.md): `steps` adds no device syncs, `layers` syncs at
    /// every layer region.
    #[arg(long, value_enum, default_value_t = ProfileArg::Off)]
    profile: ProfileArg,
}

/// `--profile`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ProfileArg {
    Off,
    Steps,
    Layers,
}

fn main() -> anyhow::Result<()> {
    // A child the engine started to compile one GPU kernel
    // (`mlxcel_engine::kernels`): it does that and nothing else.
    if let Some(status) = mlxcel_engine::kernels::child_main() {
        std::process::exit(status);
    }
    mlxcel::init_logging();
    let cli: Cli = mlxcel::parse_args(Some("serve"));
    match cli.command {
        Command::Generate(args) => generate(args),
        // Not a plain return from `main`: see `mlxcel::exit`.
        Command::Serve(args) => mlxcel::exit(mlxcel::serve(args)),
        Command::PackageFiles { dir } => {
            use clap::CommandFactory;
            let commands = [Cli::command(), mlxcel::ServerCli::command()];
            for path in mlxcel::package_files::write(&dir, &commands)? {
                println!("{}", path.display());
            }
            Ok(())
        }
    }
}

fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let prompts = prompts(&args)?;
    let mut config = args.model.engine_config(None)?;
    config.parallel = if args.sequential { 1 } else { prompts.len() };
    let engine = Engine::start(config)?;
    let mode = match args.profile {
        ProfileArg::Off => ProfileMode::Off,
        ProfileArg::Steps => ProfileMode::Steps,
        ProfileArg::Layers => ProfileMode::Layers,
    };
    for run in 0..args.runs {
        // Each run prefills from scratch (from RAM; a disk tier's files are
        // kept) and is profiled on its own.
        engine
            .reset_prefix_cache(true)
            .context("resetting the prompt cache")?;
        profile::set_mode(mode);
        let report = generate_once(&engine, &args, &prompts, run == 0)?;
        // A round trip through the engine thread: its last step has ended.
        engine
            .reset_prefix_cache(true)
            .context("resetting the prompt cache")?;
        eprintln!("==========");
        if args.runs > 1 {
            eprintln!("Run {} of {}", run + 1, args.runs);
        }
        eprintln!(
            "Prompt: {} tokens, {:.3} tokens-per-sec",
            report.prompt_tokens,
            report.prompt_tokens as f64 / report.prefill_s.max(1e-9)
        );
        eprintln!(
            "Generation: {} tokens, {:.3} tokens-per-sec",
            report.completion_tokens,
            report.decode_tokens as f64 / report.decode_s.max(1e-9)
        );
        if mode != ProfileMode::Off {
            eprintln!("Profile of this run:\n{}", profile::report());
        }
    }
    Ok(())
}

/// What one run measured, summed over the batch's requests.
struct RunReport {
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Tokens after each request's first.
    decode_tokens: usize,
    /// Prefill time, seconds: one request's prefill steps; for several at
    /// once, until the last got its first token (they share steps).
    prefill_s: f64,
    /// Longest decode of the batch, seconds.
    decode_s: f64,
}

/// The prompts to run: `--prompts-file`'s, or `--prompt` `--batch` times.
fn prompts(args: &GenerateArgs) -> anyhow::Result<Vec<Prompt>> {
    let text = |t: String| {
        if args.no_chat_template {
            Prompt::Text(t)
        } else {
            Prompt::Chat(vec![ChatMessage::text("user", t)])
        }
    };
    if let Some(path) = &args.prompts_file {
        let raw =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let items: Vec<serde_json::Value> =
            serde_json::from_str(&raw).context("--prompts-file: a JSON list")?;
        let prompts = items
            .into_iter()
            .map(|v| match v {
                serde_json::Value::String(t) => Ok(text(t)),
                ids => serde_json::from_value::<Vec<u32>>(ids)
                    .map(Prompt::Tokens)
                    .context("--prompts-file: each prompt is a string or a list of token ids"),
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        anyhow::ensure!(!prompts.is_empty(), "--prompts-file holds no prompt");
        return Ok(prompts);
    }
    let prompt = args.prompt.clone().context("--prompt or --prompts-file")?;
    Ok(vec![text(prompt); args.batch as usize])
}

/// Runs `prompts` (all at once, or one after the other with
/// --sequential) and waits for every answer; prints prompt 0's text when
/// `print`, and every prompt's token ids with --print-token-ids.
fn generate_once(
    engine: &Engine,
    args: &GenerateArgs,
    prompts: &[Prompt],
    print: bool,
) -> anyhow::Result<RunReport> {
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
        ..SamplingParams::default()
    };
    let submit = |prompt: &Prompt| {
        let mut request =
            GenerationRequest::new(prompt.clone(), sampling, args.max_tokens as usize);
        request.ignore_eos = args.ignore_eos;
        engine.submit(request).context("submitting the prompt")
    };
    let mut streams = Vec::new();
    if !args.sequential {
        for prompt in prompts {
            streams.push(Some(submit(prompt)?));
        }
    } else {
        streams.resize_with(prompts.len(), || None);
    }
    let mut report = RunReport {
        prompt_tokens: 0,
        completion_tokens: 0,
        decode_tokens: 0,
        prefill_s: 0.0,
        decode_s: 0.0,
    };
    let mut out = std::io::stdout().lock();
    for (i, stream) in streams.into_iter().enumerate() {
        let mut stream = match stream {
            Some(s) => s,
            None => submit(&prompts[i])?,
        };
        let print_text = print && i == 0 && args.prompts_file.is_none();
        let mut ids = Vec::new();
        // Reasoning (`--reasoning-parser`) prints inside `<think>` tags, as
        // the model wrote it.
        let mut thinking = false;
        loop {
            match stream.blocking_recv() {
                Some(GenerationEvent::Delta {
                    token,
                    text,
                    reasoning,
                    ..
                }) => {
                    ids.push(token);
                    if print_text {
                        if !reasoning.is_empty() {
                            if !thinking {
                                writeln!(out, "<think>")?;
                                thinking = true;
                            }
                            write!(out, "{reasoning}")?;
                        }
                        if !text.is_empty() && thinking {
                            write!(out, "\n</think>\n\n")?;
                            thinking = false;
                        }
                        write!(out, "{text}")?;
                        out.flush()?;
                    }
                }
                Some(GenerationEvent::Finished { usage, timings, .. }) => {
                    if print_text {
                        if thinking {
                            write!(out, "\n</think>")?;
                        }
                        writeln!(out)?;
                    }
                    if print && args.print_token_ids {
                        if args.prompts_file.is_some() {
                            let line = serde_json::json!({"prompt": i, "ids": ids});
                            writeln!(out, "{line}")?;
                        } else if i == 0 {
                            writeln!(out, "{}", serde_json::to_string(&ids)?)?;
                        }
                    }
                    report.prompt_tokens += usage.prompt_tokens;
                    report.completion_tokens += usage.completion_tokens;
                    report.decode_tokens += usage.completion_tokens.saturating_sub(1);
                    let prefill = if prompts.len() > 1 && !args.sequential {
                        timings.time_to_first_token_s
                    } else {
                        timings.prefill_s
                    };
                    report.prefill_s = if args.sequential {
                        report.prefill_s + prefill
                    } else {
                        report.prefill_s.max(prefill)
                    };
                    report.decode_s = if args.sequential {
                        report.decode_s + timings.decode_s
                    } else {
                        report.decode_s.max(timings.decode_s)
                    };
                    break;
                }
                Some(GenerationEvent::Failed { message, .. }) => {
                    anyhow::bail!("generation failed: {message}")
                }
                // No tools are offered nor prompt logprobs asked for.
                Some(
                    GenerationEvent::PromptLogprobs { .. }
                    | GenerationEvent::ToolCallStart { .. }
                    | GenerationEvent::ToolCallArguments { .. }
                    | GenerationEvent::Embedding { .. },
                ) => {}
                None => anyhow::bail!("the engine stopped before the request finished"),
            }
        }
    }
    Ok(report)
}
