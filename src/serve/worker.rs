//! The decoding thread. With `--parallel 1` it owns one KV cache, takes one job at a time from the queue
//! and runs it through the library's generate loop (the one-shot path), reusing the cache of the previous
//! prompt and answer. With `--parallel N` it steps up to N jobs as one [`Batch`]: jobs join between steps
//! and leave when done, each with its own cache, and every answer is still the one-shot path's.
//! Committed tokens become text ([`super::answer`]) and go to the job's handler; a handler that is gone
//! (the client left) halts its generation at its next token.

use super::answer::{Answer, TextSink};
use super::queue::{Counters, Event, Job, Outcome};
use crate::conversation::PrefixCache;
use crate::decode::batch::{Batch, SequenceId};
use crate::decode::generate::Halt;
use crate::session::Session;
use anyhow::Result;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;

/// Starts the decoding thread on the receiving end of a [`super::queue::Queue`]: one job at a time when
/// `parallel` is 1, else up to `parallel` decoded together.
pub fn start(
    session: Arc<Session>,
    jobs: Receiver<Job>,
    counters: Arc<Counters>,
    parallel: usize,
) -> Result<()> {
    std::thread::Builder::new()
        .name("probespec-decode".into())
        .spawn(move || match parallel {
            0 | 1 => run(&session, jobs, &counters),
            n => run_batched(&session, jobs, &counters, n),
        })?;
    Ok(())
}

/// Runs jobs one at a time until every submitting end is gone.
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
        let result = match result {
            Ok(r) => r.map_err(|e| format!("{e:#}")),
            Err(_) => {
                if let Some(c) = cache.as_mut() {
                    c.clear();
                }
                Err("the generation panicked".to_string())
            }
        };
        report(counters, &job.events, result);
    }
}

/// Tells a job's handler how it ended, and counts it.
fn report(counters: &Counters, events: &UnboundedSender<Event>, result: Result<Option<Outcome>, String>) {
    match result {
        Ok(Some(outcome)) => {
            counters.completed.fetch_add(1, Ordering::SeqCst);
            let _ = events.send(Event::Done(Box::new(outcome)));
        }
        Ok(None) => {
            counters.cancelled.fetch_add(1, Ordering::SeqCst);
        }
        Err(failure) => {
            counters.failed.fetch_add(1, Ordering::SeqCst);
            eprintln!("probespec serve: a request failed: {failure}");
            let _ = events.send(Event::Failed(failure));
        }
    }
}

/// A job decoding in the batch.
struct Active<'a> {
    events: UnboundedSender<Event>,
    answer: Answer<'a>,
    queue_seconds: f64,
}

/// Runs up to `parallel` jobs together until every submitting end is gone: waiting jobs join between
/// steps (each prefilled alone), and each step decodes one block of every job in one forward pass.
fn run_batched(session: &Session, jobs: Receiver<Job>, counters: &Counters, parallel: usize) {
    let mut batch = Batch::new(&session.model);
    let mut active: HashMap<SequenceId, Active> = HashMap::new();
    let mut open = true;
    loop {
        while open && batch.len() < parallel {
            // Nothing decodes: wait for a job; else take only those already waiting.
            let job = if batch.is_empty() {
                jobs.recv().map_err(|_| TryRecvError::Disconnected)
            } else {
                jobs.try_recv()
            };
            let job = match job {
                Ok(job) => job,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            };
            counters.waiting.fetch_sub(1, Ordering::SeqCst);
            if job.events.is_closed() {
                counters.cancelled.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            let queue_seconds = job.enqueued.elapsed().as_secs_f64();
            let spec = &job.spec;
            let joined = catch_unwind(AssertUnwindSafe(|| {
                let drafter = spec.method.drafter(spec.params.sampling.seed)?;
                batch.join(&spec.prompt, drafter, &spec.params)
            }));
            match joined {
                Ok(Ok(id)) => {
                    let answer = Answer::new(session, spec, TextSink::Handler(job.events.clone()));
                    active.insert(
                        id,
                        Active {
                            events: job.events,
                            answer,
                            queue_seconds,
                        },
                    );
                }
                Ok(Err(e)) => report(counters, &job.events, Err(format!("{e:#}"))),
                Err(_) => report(counters, &job.events, Err("the prefill panicked".to_string())),
            }
        }
        if batch.is_empty() {
            if !open {
                return;
            }
            continue;
        }
        counters.decoding.store(true, Ordering::SeqCst);
        let step = catch_unwind(AssertUnwindSafe(|| {
            batch.step(&mut |id, t| match active.get_mut(&id) {
                Some(a) => a.answer.push(t),
                None => Err(Halt.into()),
            })
        }));
        match step {
            Ok(Ok(ended)) => {
                for (id, generation) in ended {
                    let Some(a) = active.remove(&id) else { continue };
                    let result = generation
                        .and_then(|g| a.answer.finish(g, 0, a.queue_seconds))
                        .map_err(|e| format!("{e:#}"));
                    report(counters, &a.events, result);
                }
            }
            // A step that fails or panics fails every job in it: the batch starts afresh.
            failed => {
                let why = match failed {
                    Ok(Err(e)) => format!("{e:#}"),
                    _ => "the generation panicked".to_string(),
                };
                for (_, a) in active.drain() {
                    report(counters, &a.events, Err(why.clone()));
                }
                batch = Batch::new(&session.model);
            }
        }
        counters.decoding.store(!batch.is_empty(), Ordering::SeqCst);
    }
}

/// One job through the one-sequence loop, reusing the previous request's cache: its answer, or `None`
/// when its client left.
fn run_job(session: &Session, cache: Option<&mut PrefixCache>, job: &Job) -> Result<Option<Outcome>> {
    let queue_seconds = job.enqueued.elapsed().as_secs_f64();
    let spec = &job.spec;
    let mut drafter = spec.method.drafter(spec.params.sampling.seed)?;
    let mut answer = Answer::new(session, spec, TextSink::Handler(job.events.clone()));
    let mut on_token = |t: u32| answer.push(t);
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
    answer.finish(generation, cached_tokens, queue_seconds)
}
