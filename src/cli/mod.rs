//! The command line: the top-level parser, its subcommands and their dispatch to the front ends, and
//! how an error becomes the exit code; the terminal front ends themselves. Nothing in the library
//! imports this module: it sits above the other front ends (`serve`, `bench`) and the shared flags
//! ([`crate::flags`]).
//!
//! - `oneshot`: one-shot generation (the default command);
//! - `chat`: the interactive conversation (no prompt, a terminal on stdin);
//! - `bench`: the flags of `bench`, `cost` and `shape-gguf`, converted into the bench's options.

mod bench;
mod chat;
mod oneshot;

pub use bench::{BenchAction, BenchArgs, BenchRunArgs, CostArgs, FormatArg, ShapeGgufArgs};

use crate::flags::{MethodArgs, ModelArgs, SamplingArgs};
use clap::{Args, Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "probespec",
    version,
    about = "Faster lossless generation from a frozen LLM by embedding-space probing"
)]
#[command(args_conflicts_with_subcommands = true, allow_negative_numbers = true)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    generate: GenerateArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate a reply to a prompt (the default command).
    #[command(allow_negative_numbers = true)]
    Generate(GenerateArgs),
    /// Spec-Bench benchmark: `bench [--questions FILE]`, `bench report DIR`, `bench merge OUT DIR...`,
    /// `bench export DIR`.
    Bench(BenchArgs),
    /// Forward cost curve: one block of R rows after C cached tokens, for a model or a named shape.
    Cost(CostArgs),
    /// Write a GGUF of random weights in a published shape and llama-quantize's mix (speed tests only).
    ShapeGguf(ShapeGgufArgs),
    /// An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, /health).
    #[command(allow_negative_numbers = true)]
    Serve(crate::serve::ServeArgs),
    /// Answer a file of requests (OpenAI's batch input, or one prompt a line) into OpenAI's batch output.
    #[command(allow_negative_numbers = true)]
    RunBatch(crate::serve::RunBatchArgs),
}

/// The flags of one-shot generation and of the conversation.
#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    /// The prompt; read from stdin when "-" or when stdin is not a terminal. Absent with a terminal: an
    /// interactive conversation (/exit or Ctrl-D ends it, /reset starts over).
    pub prompt: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub method: MethodArgs,
    /// System message for the chat template.
    #[arg(long)]
    pub system: Option<String>,
    /// Feed the prompt verbatim instead of through the model's chat template.
    #[arg(long)]
    pub no_chat_template: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Print the prompt as the model will read it (after the chat template) and exit.
    #[arg(long)]
    pub print_prompt: bool,
}

/// Entry point: returns the process exit code. Errors are one line on stderr.
pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return 0;
            }
            eprintln!("{}", one_line(&e.to_string()));
            return 2;
        }
    };
    if let Err(e) = model_args(&cli).apply_threads() {
        eprintln!("error: {e:#}");
        return 2;
    }
    let result = match cli.command {
        Some(Command::Generate(args)) => oneshot::run_generate(&args),
        Some(Command::Bench(args)) => bench::run_bench(&args),
        Some(Command::Cost(args)) => bench::run_cost(&args),
        Some(Command::ShapeGguf(args)) => bench::run_shape_gguf(args),
        Some(Command::Serve(args)) => crate::serve::run(&args),
        Some(Command::RunBatch(args)) => crate::serve::run_batch::run(&args),
        None => oneshot::run_generate(&cli.generate),
    };
    match result {
        Ok(()) => 0,
        // A reader that stopped reading (`probespec ... | head`): end quietly, as Unix tools do.
        Err(e) if is_broken_pipe(&e) => 0,
        Err(e) => {
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            1
        }
    }
}

/// clap's message on one line: its first line, with the indented lines that follow it (the names of
/// missing arguments), up to the usage.
fn one_line(message: &str) -> String {
    let mut lines = message.lines();
    let mut line = lines.next().unwrap_or("invalid arguments").trim_end().to_string();
    for more in lines.take_while(|l| l.starts_with("  ")) {
        line.push(' ');
        line.push_str(more.trim());
    }
    line
}

/// The model flags of the command given (the default generation's where it takes none).
fn model_args(cli: &Cli) -> &ModelArgs {
    match &cli.command {
        Some(Command::Generate(args)) => &args.model,
        Some(Command::Bench(args)) => &args.run.model,
        Some(Command::Cost(args)) => &args.model,
        Some(Command::Serve(args)) => &args.answer.model,
        Some(Command::RunBatch(args)) => &args.answer.model,
        Some(Command::ShapeGguf(_)) | None => &cli.generate.model,
    }
}

/// Whether an error comes from writing to a closed pipe.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// No two flags of a command share a short or a long name (clap checks that only in debug builds,
    /// and the tests run in release), in the top-level command and every subcommand.
    #[test]
    fn no_two_flags_share_a_name() {
        use clap::CommandFactory;
        fn check(cmd: &clap::Command, path: &str) {
            let mut shorts = std::collections::HashSet::new();
            let mut longs = std::collections::HashSet::new();
            for arg in cmd.get_arguments() {
                if let Some(c) = arg.get_short() {
                    assert!(shorts.insert(c), "{path}: two flags are -{c}");
                }
                if let Some(l) = arg.get_long() {
                    assert!(longs.insert(l), "{path}: two flags are --{l}");
                }
            }
            for sub in cmd.get_subcommands() {
                check(sub, &format!("{path} {}", sub.get_name()));
            }
        }
        let cmd = Cli::command();
        check(&cmd, "probespec");
        assert!(
            cmd.get_subcommands().count() >= 5,
            "the subcommands were not walked"
        );
    }

    /// `--threads` parses on every command that loads a model, short and long.
    #[test]
    fn threads_is_accepted_by_every_model_command() {
        for args in [
            &["probespec", "-t", "3", "hi"][..],
            &["probespec", "generate", "--threads", "3", "hi"],
            &["probespec", "cost", "-t", "3"],
            &["probespec", "bench", "-t", "3"],
            &["probespec", "serve", "-t", "3"],
            &["probespec", "run-batch", "-t", "3", "-o", "x"],
        ] {
            let cli = Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert_eq!(model_args(&cli).threads, Some(3), "{args:?}");
        }
    }

    #[test]
    fn kv_cache_is_accepted_by_every_model_command() {
        for (args, want) in [
            (&["probespec", "--kv-cache", "f32", "hi"][..], Some(DType::F32)),
            (
                &["probespec", "generate", "--kv-cache", "bf16", "hi"],
                Some(DType::BF16),
            ),
            (&["probespec", "cost", "--kv-cache", "f32"], Some(DType::F32)),
            (&["probespec", "bench", "--kv-cache", "f32"], Some(DType::F32)),
            (&["probespec", "serve", "--kv-cache", "f32"], Some(DType::F32)),
            (&["probespec", "hi"], None),
        ] {
            let cli = Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert_eq!(model_args(&cli).options().kv_dtype, want, "{args:?}");
        }
        assert!(Cli::try_parse_from(["probespec", "--kv-cache", "f16", "hi"]).is_err());
    }
}
