//! The decoding thread. With `--parallel 1` it owns one KV cache, takes one job at a time from the queue
//! and runs it through the library's generate loop (the one-shot path), reusing the cache of the previous
//! prompt and answer. With `--parallel N` it hands the queue to the library's [`scheduler`], which steps
//! up to N jobs as one batch: jobs join between steps and leave when done, each with its own cache, and
//! every answer is still the one-shot path's.
//! Committed tokens become text ([`super::answer`]) and go to the job's handler; a handler that is gone
//! (the client left) halts its generation at its next token.

use super::answer::{Answer, TextSink};
use super::queue::{Counters, Event, Job, Outcome};
use crate::conversation::PrefixCache;
use crate::decode::generate::Generation;
use crate::decode::scheduler::{self, Capacity, Jobs, Next, Request};
use crate::session::Session;
use anyhow::Result;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;

/// Starts the decoding thread on the receiving end of a [`super::queue::Queue`]: one job at a time when
/// `capacity` holds one sequence, else as many as it holds decoded together.
pub fn start(
    session: Arc<Session>,
    jobs: Receiver<Job>,
    counters: Arc<Counters>,
    capacity: Capacity,
) -> Result<()> {
    std::thread::Builder::new()
        .name("probespec-decode".into())
        .spawn(move || match capacity.sequences {
            0 | 1 => run(&session, jobs, &counters),
            _ => run_batched(&session, jobs, &counters, capacity),
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
struct Active<'s> {
    events: UnboundedSender<Event>,
    answer: Answer<'s>,
    queue_seconds: f64,
}

/// The queue's jobs as the scheduler takes them.
struct Queued<'s> {
    session: &'s Session,
    jobs: Receiver<Job>,
    counters: &'s Counters,
}

impl<'s> Jobs for Queued<'s> {
    type Job = Active<'s>;

    /// The next job whose client is still there (waiting for one when nothing decodes).
    fn next(&mut self, wait: bool) -> Next<Active<'s>> {
        let counters = self.counters;
        counters.decoding.store(!wait, Ordering::SeqCst);
        loop {
            let job = match if wait {
                self.jobs.recv().map_err(|_| TryRecvError::Disconnected)
            } else {
                self.jobs.try_recv()
            } {
                Ok(job) => job,
                Err(TryRecvError::Empty) => return Next::Empty,
                Err(TryRecvError::Disconnected) => return Next::Closed,
            };
            counters.waiting.fetch_sub(1, Ordering::SeqCst);
            if job.events.is_closed() {
                counters.cancelled.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            let queue_seconds = job.enqueued.elapsed().as_secs_f64();
            let spec = job.spec;
            let drafter = match spec.method.drafter(spec.params.sampling.seed) {
                Ok(d) => d,
                Err(e) => {
                    report(counters, &job.events, Err(format!("{e:#}")));
                    continue;
                }
            };
            counters.decoding.store(true, Ordering::SeqCst);
            let answer = Answer::new(self.session, &spec, TextSink::Handler(job.events.clone()));
            let active = Active {
                events: job.events,
                answer,
                queue_seconds,
            };
            let request = Request {
                prompt: spec.prompt,
                drafter,
                params: spec.params,
            };
            return Next::Job(active, request);
        }
    }

    fn token(&mut self, a: &mut Active<'s>, token: u32) -> Result<()> {
        a.answer.push(token)
    }

    fn end(&mut self, a: Active<'s>, generation: Result<Generation>) -> Result<()> {
        let result = generation
            .and_then(|g| a.answer.finish(g, a.queue_seconds))
            .map_err(|e| format!("{e:#}"));
        report(self.counters, &a.events, result);
        Ok(())
    }
}

/// Runs the jobs `capacity` holds together until every submitting end is gone: waiting jobs join between
/// steps, and each step decodes one block of every job (and the next chunk of a joining prompt) in one
/// forward pass.
fn run_batched(session: &Session, jobs: Receiver<Job>, counters: &Counters, capacity: Capacity) {
    let mut queued = Queued {
        session,
        jobs,
        counters,
    };
    // `end` never fails here.
    let _ = scheduler::run(&session.model, capacity, &mut queued);
    counters.decoding.store(false, Ordering::SeqCst);
}

/// One job through the one-sequence loop, reusing the previous request's cache: its answer, or `None`
/// when its client left.
fn run_job(session: &Session, cache: Option<&mut PrefixCache>, job: &Job) -> Result<Option<Outcome>> {
    let queue_seconds = job.enqueued.elapsed().as_secs_f64();
    let spec = &job.spec;
    let mut drafter = spec.method.drafter(spec.params.sampling.seed)?;
    let mut answer = Answer::new(session, spec, TextSink::Handler(job.events.clone()));
    let mut on_token = |t: u32| answer.push(t);
    let (model, prompt, params) = (&session.model, &spec.prompt, &spec.params);
    let generation = match cache {
        Some(c) => c.generate(model, prompt, drafter.as_mut(), params, &mut on_token)?,
        None => crate::decode::generate::generate(model, prompt, drafter.as_mut(), params, &mut on_token)?,
    };
    answer.finish(generation, queue_seconds)
}
