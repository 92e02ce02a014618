//! The one-shot generation front end (the default command): a prompt from the argument or stdin, the reply
//! streamed to stdout (or one JSON object with `--json`), a stats line on stderr. With no prompt and a
//! terminal on stdin it hands over to the interactive conversation (`chat`).

use super::GenerateArgs;
use crate::decode::generate::GenerateParams;
use crate::session::Session;
use crate::tokenizer::StreamDecoder;
use anyhow::Result;
use std::io::Write;

/// The prompt text: the argument, or stdin when absent or "-".
fn read_prompt(arg: Option<&str>) -> Result<String> {
    match arg {
        Some(p) if p != "-" => Ok(p.to_string()),
        _ => crate::session::read_text("-"),
    }
}

/// `probespec [generate]`: one reply to one prompt, or the conversation when there is no prompt.
pub(super) fn run_generate(a: &GenerateArgs) -> Result<()> {
    use std::io::IsTerminal;
    if a.prompt.is_none() && std::io::stdin().is_terminal() {
        return super::chat::run_chat(a);
    }
    let sampling = a.sampling.params()?;
    let method = a.method.method()?;
    method.validate()?;
    let text = read_prompt(a.prompt.as_deref())?;
    crate::session::check_prompt_text(&text)?;
    let session = Session::load(&a.model.options())?;
    if a.print_prompt {
        let text = session.render_prompt(&text, a.system.as_deref(), !a.no_chat_template)?;
        crate::bench::write_stdout(&text)?;
        return Ok(());
    }
    let prompt = session.encode_prompt(&text, a.system.as_deref(), !a.no_chat_template)?;
    let params = GenerateParams {
        max_new_tokens: a.sampling.max_new_tokens,
        sampling,
        stop_tokens: session.stop_tokens(),
        max_block_rows: None,
    };
    let mut stream = StreamDecoder::new(&session.tokenizer);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let json = a.json;
    let result = session.generate(&prompt, &method, &params, &mut |t| {
        if !json {
            if let Some(s) = stream.push(t)? {
                out.write_all(s.as_bytes())?;
                out.flush()?;
            }
        }
        Ok(())
    });
    let g = match result {
        Ok(g) => g,
        Err(e) => {
            if !json {
                let _ = writeln!(out);
            }
            return Err(e);
        }
    };
    if json {
        let v = serde_json::json!({
            "text": session.tokenizer.decode(&g.tokens)?,
            "token_ids": g.tokens,
            "prompt_token_ids": prompt,
            "finish_reason": g.finish_reason,
            "stats": g.stats,
        });
        writeln!(out, "{v}")?;
    } else {
        if let Some(s) = stream.finish()? {
            out.write_all(s.as_bytes())?;
        }
        writeln!(out)?;
        out.flush()?;
        eprintln!("{}", g.stats.summary_line(prompt.len()));
    }
    // The process ends next: freeing the model (its tokenizer alone is hundreds of thousands of
    // allocations) would only delay the exit.
    std::mem::forget(session);
    Ok(())
}
