//! `probespec serve`: an OpenAI-compatible HTTP server over one loaded model. Every answer is the one-shot
//! CLI's answer for the same messages and settings (the same template, generate loop and sampler), sped up
//! by the method of the server's flags or of the request's `probespec` field.
//!
//! The model is loaded once; one decoding thread owns the KV cache and takes requests in order from a
//! bounded queue (full: 503). Requests are not batched together: concurrency gives queueing, not more
//! throughput. A request whose prompt starts with the previous prompt and answer (a multi-turn client)
//! prefills only the new part.
//!
//! Modules: [`args`] (flags), [`api`] (request bodies -> jobs), [`queue`] (the queue, events, counters),
//! [`worker`] (the decoding thread), [`stop`] (stop strings), [`respond`] (answers and streamed chunks),
//! [`reasoning`] (a chat answer's thinking apart from its reply),
//! [`routes`] (HTTP routes, API key), [`error`] (OpenAI-shaped errors).

pub mod api;
pub mod args;
pub mod error;
pub mod queue;
pub mod reasoning;
pub mod respond;
pub mod routes;
pub mod stop;
pub mod worker;

pub use args::ServeArgs;

use crate::model::load::{default_model_path, ModelSource};
use crate::session::Session;
use anyhow::{Context, Result};
use std::sync::Arc;

/// Loads the model, binds, and serves until Ctrl-C.
pub fn run(a: &ServeArgs) -> Result<()> {
    let sampling = a.sampling()?;
    let method = a.method.method()?;
    method.validate()?;
    let api_key = a.api_key()?;
    let session = Arc::new(Session::load(&a.model.options())?);
    let (queue, jobs) = queue::Queue::new(a.queue);
    worker::start(session.clone(), jobs, queue.counters.clone())?;
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
            defaults: api::Defaults {
                method: a.method.clone(),
                sampling,
                max_new_tokens: a.sampling.max_new_tokens,
            },
            model_id: model_id(a.model.model.as_deref()),
            api_key,
            started: respond::unix_now(),
            max_body: a.max_body,
            reasoning: a.reasoning_format == args::ReasoningFormat::Deepseek,
        };
        eprintln!(
            "probespec serve: {} | {} | {} | listening on http://{addr}",
            session.description,
            method.kind(),
            if state.api_key.is_some() {
                "API key required"
            } else {
                "no API key"
            },
        );
        let app = routes::router(Arc::new(state));
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .context("the server failed")
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
