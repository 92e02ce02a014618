//! The decoding thread: owns the KV cache, takes one job at a time from the queue and runs it through the
//! library's generate loop (the one-shot path), reusing the cache of the previous prompt and answer.
//! Committed tokens become text (streaming detokenisation, stop strings) and go to the job's handler; a
//! handler that is gone (the client left) halts the generation at its next token.

use super::queue::{Counters, Event, Job, Outcome};
use super::stop::StopMatcher;
use crate::conversation::PrefixCache;
use crate::decode::generate::{FinishReason, Halt};
use crate::session::Session;
use crate::tokenizer::StreamDecoder;
use anyhow::Result;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

/// Starts the decoding thread on the receiving end of a [`super::queue::Queue`].
pub fn start(session: Arc<Session>, jobs: Receiver<Job>, counters: Arc<Counters>) -> Result<()> {
    std::thread::Builder::new()
        .name("probespec-decode".into())
        .spawn(move || run(&session, jobs, &counters))?;
    Ok(())
}

/// Runs jobs until every submitting end is gone.
fn run(session: &Session, jobs: Receiver<Job>, counters: &Counters) {
    let mut cache = match PrefixCache::new(&session.model) {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!(
                "probespec serve: no KV cache to reuse ({e:#}); every request prefills its whole prompt"
            );
            None
        }
    };
    while let Ok(job) = jobs.recv() {
        counters.waiting.fetch_sub(1, Ordering::SeqCst);
        if job.events.is_closed() {
            counters.cancelled.fetch_add(1, Ordering::SeqCst);
            continue;
        }
        counters.decoding.store(true, Ordering::SeqCst);
        // A panic in one generation must not take the server down: the job fails, the cache is dropped.
        let result = catch_unwind(AssertUnwindSafe(|| run_job(session, cache.as_mut(), &job)));
        counters.decoding.store(false, Ordering::SeqCst);
        let failure = match result {
            Ok(Ok(Some(outcome))) => {
                counters.completed.fetch_add(1, Ordering::SeqCst);
                let _ = job.events.send(Event::Done(Box::new(outcome)));
                continue;
            }
            Ok(Ok(None)) => {
                counters.cancelled.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            Ok(Err(e)) => format!("{e:#}"),
            Err(_) => {
                if let Some(c) = cache.as_mut() {
                    c.clear();
                }
                "the generation panicked".to_string()
            }
        };
        counters.failed.fetch_add(1, Ordering::SeqCst);
        eprintln!("probespec serve: a request failed: {failure}");
        let _ = job.events.send(Event::Failed(failure));
    }
}

/// One job: its answer, or `None` when its client left.
fn run_job(session: &Session, cache: Option<&mut PrefixCache>, job: &Job) -> Result<Option<Outcome>> {
    let queue_seconds = job.enqueued.elapsed().as_secs_f64();
    let spec = &job.spec;
    let mut drafter = spec.method.drafter(spec.params.sampling.seed)?;
    let mut stream = StreamDecoder::new(&session.tokenizer);
    let mut stops = StopMatcher::new(spec.stop.clone());
    let mut text = String::new();
    let mut gone = false;
    let mut stopped = false;
    let send = |piece: String, text: &mut String| -> bool {
        if piece.is_empty() {
            return !job.events.is_closed();
        }
        text.push_str(&piece);
        job.events.send(Event::Text(piece)).is_ok()
    };
    let mut on_token = |t: u32| -> Result<()> {
        if let Some(piece) = stream.push(t)? {
            let passed = stops.push(&piece);
            stopped = passed.stopped;
            if !send(passed.text, &mut text) {
                gone = true;
            }
        } else if job.events.is_closed() {
            gone = true;
        }
        if gone || stopped {
            return Err(Halt.into());
        }
        Ok(())
    };
    let (generation, cached_tokens) = match cache {
        Some(c) => c.generate(
            &session.model,
            &spec.prompt,
            drafter.as_mut(),
            &spec.params,
            &mut on_token,
        )?,
        None => (
            crate::decode::generate::generate(
                &session.model,
                &spec.prompt,
                drafter.as_mut(),
                &spec.params,
                &mut on_token,
            )?,
            0,
        ),
    };
    if gone {
        eprintln!(
            "probespec serve: the client left after {} of at most {} tokens: generation stopped",
            generation.tokens.len(),
            spec.params.max_new_tokens
        );
        return Ok(None);
    }
    if !stopped {
        let mut tail = stream
            .finish()?
            .map(|p| stops.push(&p))
            .map_or(String::new(), |p| {
                stopped = p.stopped;
                p.text
            });
        if !stopped {
            tail.push_str(&stops.finish());
        }
        if !send(tail, &mut text) {
            return Ok(None);
        }
    }
    let finish_reason = match generation.finish_reason {
        FinishReason::StopToken | FinishReason::Halted => "stop",
        FinishReason::MaxNewTokens | FinishReason::ContextWindow => "length",
    };
    Ok(Some(Outcome {
        text,
        tokens: generation.tokens,
        finish_reason: if stopped { "stop" } else { finish_reason },
        stats: generation.stats,
        prompt_tokens: spec.prompt.len(),
        cached_tokens,
        queue_seconds,
    }))
}
