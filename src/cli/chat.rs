//! The interactive conversation front end: one line per user message read with a line editor, the reply
//! streamed, a stats line per turn; `/reset` starts over, `/exit` or Ctrl-D ends it. Turns reuse the KV
//! cache of earlier ones ([`crate::conversation::Conversation`]).

use super::GenerateArgs;
use crate::decode::generate::GenerateParams;
use crate::decode::method::Method;
use crate::session::Session;
use crate::tokenizer::StreamDecoder;
use anyhow::{bail, Context, Result};
use std::io::Write;

/// The interactive conversation: one line per user message, the reply streamed, a stats line per turn.
pub(super) fn run_chat(a: &GenerateArgs) -> Result<()> {
    use rustyline::error::ReadlineError;
    let sampling = a.sampling.params()?;
    let method = a.method.method()?;
    method.validate()?;
    if a.no_chat_template {
        bail!("--no-chat-template needs a prompt: the interactive conversation uses the chat template");
    }
    let loaded = Session::load(&a.model.options())?;
    let params = GenerateParams {
        max_new_tokens: a.sampling.max_new_tokens,
        sampling,
        stop_tokens: loaded.stop_tokens(),
        max_block_rows: None,
    };
    let mut chat =
        crate::conversation::Conversation::new(&loaded.model, &loaded.tokenizer, a.system.clone())?;
    let mut editor = rustyline::DefaultEditor::new().context("cannot open the terminal for input")?;
    eprintln!(
        "{} | {} | /exit or Ctrl-D to quit, /reset to start over",
        loaded.description,
        method_label(&method)
    );
    let stdout = std::io::stdout();
    loop {
        let line = match editor.readline(">>> ") {
            Ok(l) => l,
            Err(ReadlineError::Eof) => break,
            // Ctrl-C on an empty prompt: a new prompt, as shells do.
            Err(ReadlineError::Interrupted) => continue,
            Err(e) => return Err(e).context("cannot read from the terminal"),
        };
        let text = line.trim();
        match text {
            "" => continue,
            "/exit" | "/quit" | "/bye" => break,
            "/reset" | "/clear" => {
                chat.reset();
                eprintln!("(new conversation)");
                continue;
            }
            "/help" | "/?" => {
                eprintln!("/exit, /quit or Ctrl-D: quit | /reset: forget the conversation | anything else: a message");
                continue;
            }
            t if t.starts_with('/') => {
                eprintln!("unknown command {t} (/help lists them)");
                continue;
            }
            _ => {}
        }
        let _ = editor.add_history_entry(text);
        let mut drafter = method.drafter(a.sampling.seed)?;
        let mut stream = StreamDecoder::new(&loaded.tokenizer);
        let mut out = stdout.lock();
        let turn = chat.turn(text, drafter.as_mut(), &params, &mut |t| {
            if let Some(s) = stream.push(t)? {
                out.write_all(s.as_bytes())?;
                out.flush()?;
            }
            Ok(())
        });
        match turn {
            Ok(turn) => {
                if let Some(s) = stream.finish()? {
                    out.write_all(s.as_bytes())?;
                }
                writeln!(out)?;
                out.flush()?;
                let s = &turn.generation.stats;
                eprintln!(
                    "[{}] {} tok | {:.1} tok/s | tau {:.2} | {} | prefill {} tok ({} from cache) {:.2}s",
                    s.method,
                    s.new_tokens,
                    s.tokens_per_second,
                    s.tau,
                    crate::decode::stats::blocks_line(&s.block_histogram),
                    s.prefill_tokens,
                    turn.reused_tokens,
                    s.prefill_seconds
                );
            }
            Err(e) => {
                let _ = writeln!(out);
                // A turn that cannot run (the context is full, ...) ends the turn, not the conversation.
                eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            }
        }
    }
    Ok(())
}

/// "esp, bc auto" and the like, for the conversation's banner.
fn method_label(m: &Method) -> String {
    match m.budget() {
        Some(b) => format!("{}, bc {b}", m.kind()),
        None => m.kind().to_string(),
    }
}
