//! `probespec run-batch -i IN -o OUT`: the OpenAI API over a file, as `vllm run-batch` and OpenAI's Batch
//! API take one. Each request of the input ([`batch_file`]) is read as the server reads a body (the same
//! checks, template and defaults), up to `--parallel` of them decode together as the server's batched
//! worker steps them, and each answer is written as one line of OpenAI's batch output in the input's
//! order: the server's answer object, so the one-shot CLI's tokens. A bad line gets an error line and
//! the others are still answered; the exit code says whether any failed.
//!
//! An output that already holds answers to some of the requests is resumed: those lines are kept as they
//! are and only the rest decoded (`--overwrite` starts afresh). Every line is flushed as it is written, so
//! a run that is stopped loses only the answers under way.

use super::answer::{Answer, TextSink};
use super::api::{self, Defaults};
use super::args::{parse_parallel, AnswerArgs, Parallel};
use super::batch_file::{self, Entry, InputFormat};
use super::error::ApiError;
use super::fields::Endpoint;
use super::respond::Envelope;
use crate::decode::generate::Generation;
use crate::decode::scheduler::{self, Capacity, Jobs, Next, Request};
use crate::session::Session;
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub struct RunBatchArgs {
    /// The requests: OpenAI's batch input (a JSON object a line: custom_id, method, url, body) or one
    /// prompt a line; "-" reads stdin.
    #[arg(short = 'i', long, default_value = "-")]
    pub input: String,
    /// Where the answers go, a JSON line a request in the input's order (OpenAI's batch output). An
    /// output that holds answers to some of the requests already is resumed.
    #[arg(short = 'o', long)]
    pub output: PathBuf,
    /// How the input is read.
    #[arg(long, value_enum, default_value_t = InputFormat::Auto)]
    pub format: InputFormat,
    /// Start afresh: drop the answers the output already holds.
    #[arg(long)]
    pub overwrite: bool,
    /// Requests decoded together, each step one forward pass over all of them (every answer the same as
    /// alone); auto: from 1, doubled while that gives 15% more tokens a second on
    /// this machine's forward cost curve (where batching stops paying).
    #[arg(long, default_value = "auto", value_name = "N|auto", value_parser = parse_parallel)]
    pub parallel: Parallel,
    /// System message of prompt lines (through the chat template).
    #[arg(long)]
    pub system: Option<String>,
    /// Feed prompt lines verbatim (as `/v1/completions`) instead of through the chat template.
    #[arg(long)]
    pub no_chat_template: bool,
    #[command(flatten)]
    pub answer: AnswerArgs,
}

/// A prompt line's request: a chat request of one user message (after `system`), as the one-shot CLI
/// renders a prompt, or the prompt verbatim.
fn prompt_request(text: &str, system: Option<&str>, chat: bool) -> (Endpoint, Value) {
    if !chat {
        return (Endpoint::Completion, json!({"prompt": text}));
    }
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(json!({"role": "system", "content": s}));
    }
    messages.push(json!({"role": "user", "content": text}));
    (Endpoint::Chat, json!({"messages": messages}))
}

/// Runs the file's requests; an error when any failed (after every other is answered and written).
pub fn run(a: &RunBatchArgs) -> Result<()> {
    let mut defaults = a.answer.defaults()?;
    if a.parallel == Parallel::Count(0) {
        bail!("--parallel must be at least 1");
    }
    let text = crate::session::read_text(&a.input)?;
    let entries = batch_file::read_requests(&text, a.format, |p| {
        prompt_request(p, a.system.as_deref(), !a.no_chat_template)
    });
    if entries.is_empty() {
        bail!("{} holds no requests", crate::session::source_name(&a.input));
    }
    let kept = match std::fs::read_to_string(&a.output) {
        Ok(old) if !a.overwrite => {
            let known: HashSet<&str> = entries.iter().filter_map(custom_id).collect();
            batch_file::kept_answers(&old, &known).with_context(|| {
                format!(
                    "{} holds another input's answers: pass --overwrite to start afresh, or another -o",
                    a.output.display()
                )
            })?
        }
        Ok(_) => HashMap::new(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => HashMap::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", a.output.display())),
    };
    // Only a request's answer is kept (a line that is no request, or repeats a custom_id, is read again).
    let mut lines: Vec<Option<String>> = entries
        .iter()
        .map(|e| e.as_ref().ok().and_then(|r| kept.get(&r.custom_id).cloned()))
        .collect();
    let todo: Vec<usize> = (0..entries.len()).filter(|&i| lines[i].is_none()).collect();
    if !kept.is_empty() {
        eprintln!(
            "resuming {}: {} answers kept, {} requests to go",
            a.output.display(),
            kept.len(),
            todo.len()
        );
    }
    let session = Session::load(&a.answer.model.options())?;
    let capacity = a.answer.capacity(a.parallel, &session.model);
    defaults.kv_rows = capacity.kv_rows;
    // The kept answers first (in input order), then each new one as it is written.
    rewrite(&a.output, lines.iter().flatten())?;
    let mut out = std::fs::OpenOptions::new()
        .append(true)
        .open(&a.output)
        .with_context(|| format!("cannot write {}", a.output.display()))?;
    let bar = ProgressBar::with_draw_target(Some(todo.len() as u64), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} requests, ETA {eta} | {msg}")
            .expect("valid progress template")
            .progress_chars("=> "),
    );
    let started = Instant::now();
    let mut written = 0;
    let mut write_line = |i: usize, line: String| -> Result<()> {
        lines[i] = Some(line);
        // Write the answers that are next in input order.
        while let Some(line) = todo.get(written).and_then(|&j| lines[j].as_ref()) {
            writeln!(out, "{line}").and_then(|()| out.flush())?;
            written += 1;
            bar.inc(1);
        }
        Ok(())
    };
    let mut runner = Runner {
        session: &session,
        defaults: &defaults,
        model_id: super::model_id(a.answer.model.model.as_deref()),
        thinking_apart: a.answer.thinking_apart(),
        entries: &entries,
        todo: todo.iter(),
        done: &mut write_line,
        unwritten: None,
        failed: 0,
        tokens: 0,
    };
    runner.answer_all(capacity)?;
    let (failed, tokens) = (runner.failed, runner.tokens);
    bar.finish_and_clear();
    drop(out);
    if !kept.is_empty() {
        rewrite(&a.output, lines.iter().flatten())?;
    }
    let seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "run-batch: {} requests answered, {} failed, {} kept from before; {} tokens in {seconds:.1} s ({:.1} tok/s) -> {}",
        todo.len() - failed,
        failed,
        kept.len(),
        tokens,
        tokens as f64 / seconds.max(1e-9),
        a.output.display()
    );
    if failed > 0 {
        bail!(
            "{} of {} requests failed: their lines in {} say why",
            failed,
            entries.len(),
            a.output.display()
        );
    }
    Ok(())
}

/// The output line id of request `index` (from 0).
fn line_id(index: usize) -> String {
    format!("batch_req_{}", index + 1)
}

fn custom_id(e: &Entry) -> Option<&str> {
    match e {
        Ok(r) => Some(&r.custom_id),
        Err(e) => e.custom_id.as_deref(),
    }
}

/// Writes `lines` to `path` whole: into a file beside it, then renamed over it.
fn rewrite<'a>(path: &Path, lines: impl Iterator<Item = &'a String>) -> Result<()> {
    let mut name = path.file_name().context("the output names no file")?.to_owned();
    name.push(".partial");
    let partial = path.with_file_name(name);
    let write = || -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&partial)?);
        for line in lines {
            writeln!(f, "{line}")?;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&partial, path)
    };
    write().with_context(|| format!("cannot write {}", path.display()))
}

/// The file's requests as the scheduler takes them: what answering them shares.
struct Runner<'s, 'r> {
    session: &'s Session,
    defaults: &'s Defaults,
    model_id: String,
    thinking_apart: bool,
    entries: &'r [Entry],
    /// The entries still to answer.
    todo: std::slice::Iter<'r, usize>,
    /// Gets each request's output line (by entry), in the order they end.
    done: &'r mut dyn FnMut(usize, String) -> Result<()>,
    /// Why a line could not be written from [`Jobs::next`], which cannot fail.
    unwritten: Option<anyhow::Error>,
    failed: usize,
    tokens: usize,
}

/// A request decoding in the batch.
struct Active<'s> {
    index: usize,
    answer: Answer<'s>,
    envelope: Envelope,
}

impl<'s> Jobs for Runner<'s, '_> {
    type Job = Active<'s>;

    /// The next request the server would take; a request it would refuse gets its error line here.
    fn next(&mut self, _wait: bool) -> Next<Active<'s>> {
        while let Some(&i) = self.todo.next() {
            match self.start(i) {
                Ok((active, request)) => return Next::Job(active, request),
                Err(error) => {
                    let line = self.failure(i, error);
                    if let Err(e) = (self.done)(i, line) {
                        self.unwritten = Some(e);
                        return Next::Closed;
                    }
                }
            }
        }
        Next::Closed
    }

    fn token(&mut self, a: &mut Active<'s>, token: u32) -> Result<()> {
        a.answer.push(token)
    }

    fn end(&mut self, a: Active<'s>, generation: Result<Generation>) -> Result<()> {
        let line = match generation.and_then(|g| a.answer.finish(g, 0.0)) {
            Ok(Some(o)) => {
                self.tokens += o.tokens.len();
                let id = custom_id(&self.entries[a.index]).unwrap_or_default();
                batch_file::answer_line(id, &line_id(a.index), a.envelope.complete(&o)).to_string()
            }
            Ok(None) => self.failure(a.index, ApiError::internal("the answer was lost")),
            Err(e) => self.failure(a.index, ApiError::internal(format!("{e:#}"))),
        };
        (self.done)(a.index, line)
    }
}

impl<'s> Runner<'s, '_> {
    /// Answers every request to do, as many together as `capacity` holds.
    fn answer_all(&mut self, capacity: Capacity) -> Result<()> {
        scheduler::run(&self.session.model, capacity, self)?;
        match self.unwritten.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Reads entry `i` as the server reads a body: its answer as it will come, and what it decodes.
    fn start(&self, i: usize) -> Result<(Active<'s>, Request), ApiError> {
        let request = self.entries[i]
            .as_ref()
            .map_err(|e| ApiError::invalid(e.message.clone()))?;
        let parsed = api::endpoint_job(
            request.body.clone(),
            request.endpoint,
            self.session,
            self.defaults,
        )?;
        let spec = parsed.spec;
        let drafter = spec
            .method
            .drafter(spec.params.sampling.seed)
            .map_err(|e| ApiError::internal(format!("{e:#}")))?;
        let mut envelope = Envelope::new(request.endpoint, &self.model_id);
        if self.thinking_apart && request.endpoint == Endpoint::Chat {
            envelope.thinking = Some(parsed.prompt_opens_thinking);
        }
        let answer = Answer::new(self.session, &spec, TextSink::Whole);
        let active = Active {
            index: i,
            answer,
            envelope,
        };
        let request = Request {
            prompt: spec.prompt,
            drafter,
            params: spec.params,
        };
        Ok((active, request))
    }

    /// The output line of request `index`, failed with `error`.
    fn failure(&mut self, index: usize, error: ApiError) -> String {
        self.failed += 1;
        let entry = &self.entries[index];
        let status = entry.is_ok().then_some(error.status.as_u16());
        let message = match entry {
            Ok(r) => format!("custom_id '{}': {}", r.custom_id, error.message),
            Err(e) => e.message.clone(),
        };
        eprintln!("run-batch: {message}");
        batch_file::error_line(
            custom_id(entry),
            &line_id(index),
            status,
            error.body()["error"].clone(),
        )
        .to_string()
    }
}
