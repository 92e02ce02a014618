//! The OpenAI API over one loaded model: `probespec serve`, an HTTP server, and `probespec run-batch`, the
//! same requests read from a file ([`run_batch`]). Every answer is the one-shot CLI's answer for the same
//! messages and settings (the same template, generate loop and sampler), sped up by the method of the
//! flags or of the request's `probespec` field.
//!
//! The model is loaded once; one decoding thread takes requests from a bounded queue (full: 503). With
//! `--parallel 1` it owns one KV cache and answers one request at a time, and a request whose prompt
//! starts with the previous prompt and answer (a multi-turn client) prefills only the new part; with
//! `--parallel N` up to N requests decode together, one forward pass a step, and a request reuses the
//! cache of an earlier answer it starts with (the last N are kept).
//!
//! One client cannot hold the server: connections are bounded and time out (`listen`), a body has a size
//! and a time limit, a prompt that cannot fit the context is refused before it is tokenised, tokenising
//! runs off the threads that answer other requests, and a request's block and answer are capped.
//!
//! Modules: [`args`] (flags), [`listen`] (the accept loop, connection limits), [`routes`] (HTTP routes,
//! API key, bodies), [`fields`] (which request fields are read, ignored or refused), [`api`] (request
//! bodies -> jobs), [`queue`] (the queue, events, counters), [`worker`] (the decoding thread), [`answer`]
//! (a request's text from its tokens), [`stop`] (stop strings), [`respond`] (answers and streamed
//! chunks), [`reasoning`] (a chat answer's thinking apart from its reply), [`error`] (OpenAI-shaped
//! errors), [`batch_file`] and [`run_batch`] (`run-batch`'s files and loop).

pub mod answer;
pub mod api;
pub mod args;
pub mod batch_file;
pub mod error;
pub mod fields;
pub mod listen;
pub mod queue;
pub mod reasoning;
pub mod respond;
pub mod routes;
pub mod run_batch;
pub mod stop;
pub mod worker;

pub use args::ServeArgs;
pub use run_batch::RunBatchArgs;

use crate::model::load::{default_model_path, ModelSource};
use crate::session::Session;
use anyhow::{Context, Result};
use std::sync::Arc;
use std::time::Duration;

/// Loads the model, binds, and serves until Ctrl-C.
pub fn run(a: &ServeArgs) -> Result<()> {
    let mut defaults = a.defaults()?;
    let method = a.answer.method.method()?;
    let api_key = a.api_key()?;
    let session = Arc::new(Session::load(&a.answer.model.options())?);
    let capacity = a.answer.capacity(a.parallel, &session.model);
    defaults.kv_rows = capacity.kv_rows;
    let (queue, jobs) = queue::Queue::new(a.queue);
    worker::start(session.clone(), jobs, queue.counters.clone(), capacity)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", a.host, a.port))?;
        let addr = listener.local_addr()?;
        let state = routes::AppState {
            queue,
            session: session.clone(),
            defaults,
            model_id: model_id(a.answer.model.model.as_deref()),
            api_key,
            started: respond::unix_now(),
            max_body: a.max_body,
            body_timeout: Duration::from_secs(a.body_timeout),
            reasoning: a.answer.thinking_apart(),
        };
        let batching = match (capacity.sequences, capacity.prefill_chunk) {
            (1, _) => String::new(),
            (n, Some(rows)) => format!(" | {n} decoded together, prompts in {rows} rows a step"),
            (n, None) => format!(" | {n} decoded together"),
        };
        eprintln!(
            "probespec serve: {} | {} | {}{batching} | listening on http://{addr}",
            session.description,
            method.kind(),
            if state.api_key.is_some() {
                "API key required"
            } else {
                "no API key"
            },
        );
        let app = routes::router(Arc::new(state));
        let limits = listen::Limits {
            max_connections: a.max_connections,
            header_timeout: Duration::from_secs(a.header_timeout),
        };
        listen::serve(listener, app, limits, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
        Ok(())
    })
}

/// The model's name in answers: the checkpoint's file or folder name, or the hub id.
fn model_id(spec: Option<&str>) -> String {
    let path = match spec {
        None => default_model_path(),
        Some(s) => match ModelSource::resolve(Some(s)) {
            Ok(ModelSource::HfDir(p)) | Ok(ModelSource::Gguf(p)) => p,
            _ => return s.to_string(),
        },
    };
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}
