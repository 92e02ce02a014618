//! The bounded queue between the HTTP handlers and the decoding thread, and the counters `/health`
//! reports. A job carries its own unbounded event channel back: the decoding thread never waits on a
//! client, so a slow reader only lets its own answer pile up (at most max_tokens pieces) while the queue
//! moves on.

use super::api::JobSpec;
use super::error::ApiError;
use crate::decode::stats::DecodeStats;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// One request for the decoding thread.
pub struct Job {
    pub spec: JobSpec,
    pub events: UnboundedSender<Event>,
    pub enqueued: Instant,
}

/// What the decoding thread tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// Text of committed tokens (stop strings already cut).
    Text(String),
    Done(Box<Outcome>),
    /// The generation failed; the message says why.
    Failed(String),
}

/// A finished answer.
#[derive(Debug)]
pub struct Outcome {
    pub text: String,
    pub tokens: Vec<u32>,
    /// OpenAI's finish_reason: "stop" (a stop token or string) or "length".
    pub finish_reason: &'static str,
    pub stats: DecodeStats,
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from the previous request's cache.
    pub cached_tokens: usize,
    /// Time from the request's arrival in the queue to the start of its decoding.
    pub queue_seconds: f64,
}

/// What `/health` reports.
#[derive(Debug, Default)]
pub struct Counters {
    pub waiting: AtomicUsize,
    pub decoding: AtomicBool,
    pub completed: AtomicU64,
    /// Requests whose client left before or while they decoded.
    pub cancelled: AtomicU64,
    /// Requests answered 503.
    pub rejected: AtomicU64,
    pub failed: AtomicU64,
}

impl Counters {
    pub fn snapshot(&self) -> serde_json::Value {
        serde_json::json!({
            "waiting": self.waiting.load(Ordering::SeqCst),
            "decoding": self.decoding.load(Ordering::SeqCst),
            "completed": self.completed.load(Ordering::SeqCst),
            "cancelled": self.cancelled.load(Ordering::SeqCst),
            "rejected": self.rejected.load(Ordering::SeqCst),
            "failed": self.failed.load(Ordering::SeqCst),
        })
    }
}

/// The submitting end of the queue.
pub struct Queue {
    jobs: SyncSender<Job>,
    pub counters: Arc<Counters>,
}

impl Queue {
    /// A queue with room for `capacity` waiting jobs, and the receiving end the decoding thread takes
    /// them from ([`super::worker::start`]).
    pub fn new(capacity: usize) -> (Queue, Receiver<Job>) {
        let (jobs, rx) = sync_channel::<Job>(capacity);
        let counters = Arc::new(Counters::default());
        (Queue { jobs, counters }, rx)
    }

    /// Queues `spec`; its events come on the returned receiver. A full queue is a 503.
    pub fn submit(&self, spec: JobSpec) -> Result<UnboundedReceiver<Event>, ApiError> {
        let (events, rx) = unbounded_channel();
        let job = Job {
            spec,
            events,
            enqueued: Instant::now(),
        };
        self.counters.waiting.fetch_add(1, Ordering::SeqCst);
        match self.jobs.try_send(job) {
            Ok(()) => Ok(rx),
            Err(e) => {
                self.counters.waiting.fetch_sub(1, Ordering::SeqCst);
                match e {
                    TrySendError::Full(_) => {
                        self.counters.rejected.fetch_add(1, Ordering::SeqCst);
                        Err(ApiError::busy(1))
                    }
                    TrySendError::Disconnected(_) => {
                        Err(ApiError::internal("the decoding thread has stopped"))
                    }
                }
            }
        }
    }
}
