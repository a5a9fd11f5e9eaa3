//! `mlxcel`: command-line front end (`generate`, `serve`).

use anyhow::Context;
use clap::{Parser, Subcommand};
use mlxcel_engine::api::{
    ChatMessage, GenerationEvent, GenerationRequest, InferenceService, Prompt, SamplingParams,
};
use mlxcel_engine::Engine;
use std::io::Write;

#[derive(Debug, Parser)]
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
}

#[derive(Debug, clap::Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: mlxcel::ModelArgs,
    /// The prompt (a user message unless --no-chat-template).
    #[arg(short = 'p', long)]
    prompt: String,
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
}

fn main() -> anyhow::Result<()> {
    mlxcel::init_logging();
    match Cli::parse().command {
        Command::Generate(args) => generate(args),
        Command::Serve(args) => mlxcel::serve(args),
    }
}

fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    // One prompt: a batch of one.
    let mut config = args.model.engine_config(None)?;
    config.parallel = 1;
    let engine = Engine::start(config)?;
    let prompt = if args.no_chat_template {
        Prompt::Text(args.prompt.clone())
    } else {
        Prompt::Chat(vec![ChatMessage::text("user", args.prompt.clone())])
    };
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
        ..SamplingParams::default()
    };
    let mut request = GenerationRequest::new(prompt, sampling, args.max_tokens as usize);
    request.ignore_eos = args.ignore_eos;
    let mut stream = engine.submit(request).context("submitting the prompt")?;
    let mut out = std::io::stdout().lock();
    let mut ids = Vec::new();
    while let Some(event) = stream.blocking_recv() {
        match event {
            GenerationEvent::Delta { token, text, .. } => {
                ids.push(token);
                write!(out, "{text}")?;
                out.flush()?;
            }
            GenerationEvent::Finished { usage, timings, .. } => {
                writeln!(out)?;
                if args.print_token_ids {
                    writeln!(out, "{}", serde_json::to_string(&ids)?)?;
                }
                let decode_tokens = usage.completion_tokens.saturating_sub(1);
                eprintln!("==========");
                eprintln!(
                    "Prompt: {} tokens, {:.3} tokens-per-sec",
                    usage.prompt_tokens,
                    usage.prompt_tokens as f64 / timings.prefill_s.max(1e-9)
                );
                eprintln!(
                    "Generation: {} tokens, {:.3} tokens-per-sec",
                    usage.completion_tokens,
                    decode_tokens as f64 / timings.decode_s.max(1e-9)
                );
                return Ok(());
            }
            GenerationEvent::Failed { message } => anyhow::bail!("generation failed: {message}"),
            // No tools are offered, so none are parsed.
            GenerationEvent::ToolCall { .. } => {}
        }
    }
    anyhow::bail!("the engine stopped before the request finished")
}
