//! A request's answer as its tokens come: streaming detokenisation and stop strings, the text passed on
//! to the request's handler (the server) or kept until the answer is whole (a batch file), and the
//! [`Outcome`] of the finished generation.

use super::api::JobSpec;
use super::queue::{Event, Outcome};
use super::stop::StopMatcher;
use crate::decode::generate::{FinishReason, Generation, Halt};
use crate::session::Session;
use crate::tokenizer::StreamDecoder;
use anyhow::Result;
use tokio::sync::mpsc::UnboundedSender;

/// Where an answer's text goes as it comes.
pub enum TextSink {
    /// A request's handler, which streams it or collects it; gone when its client left.
    Handler(UnboundedSender<Event>),
    /// Nowhere until the answer is whole (`run-batch`).
    Whole,
}

/// A request's answer as its tokens come: streaming detokenisation, stop strings, the text sent so far.
pub struct Answer<'a> {
    sink: TextSink,
    prompt_tokens: usize,
    max_new_tokens: usize,
    stream: StreamDecoder<'a>,
    stops: StopMatcher,
    text: String,
    /// The client left.
    gone: bool,
    /// A stop string was seen.
    stopped: bool,
}

impl<'a> Answer<'a> {
    pub fn new(session: &'a Session, spec: &JobSpec, sink: TextSink) -> Self {
        Answer {
            sink,
            prompt_tokens: spec.prompt.len(),
            max_new_tokens: spec.params.max_new_tokens,
            stream: StreamDecoder::new(&session.tokenizer),
            stops: StopMatcher::new(spec.stop.clone()),
            text: String::new(),
            gone: false,
            stopped: false,
        }
    }

    /// Sends `piece` to the client; false when it is gone.
    fn send(&mut self, piece: String) -> bool {
        self.text.push_str(&piece);
        match &self.sink {
            TextSink::Handler(events) if piece.is_empty() => !events.is_closed(),
            TextSink::Handler(events) => events.send(Event::Text(piece)).is_ok(),
            TextSink::Whole => true,
        }
    }

    /// Whether the client is gone.
    fn client_gone(&self) -> bool {
        matches!(&self.sink, TextSink::Handler(events) if events.is_closed())
    }

    /// A committed token: its text goes to the client, unless a stop string ends it there; [`Halt`]
    /// when the answer is complete or its client gone.
    pub fn push(&mut self, t: u32) -> Result<()> {
        if let Some(piece) = self.stream.push(t)? {
            let passed = self.stops.push(&piece);
            self.stopped = passed.stopped;
            if !self.send(passed.text) {
                self.gone = true;
            }
        } else if self.client_gone() {
            self.gone = true;
        }
        if self.gone || self.stopped {
            return Err(Halt.into());
        }
        Ok(())
    }

    /// The outcome of the finished `generation`, the text held back sent; `None` when the client left.
    /// Its prompt tokens that the generation did not prefill came from a cache.
    pub fn finish(mut self, generation: Generation, queue_seconds: f64) -> Result<Option<Outcome>> {
        if self.gone {
            eprintln!(
                "probespec serve: the client left after {} of at most {} tokens: generation stopped",
                generation.tokens.len(),
                self.max_new_tokens
            );
            return Ok(None);
        }
        if !self.stopped {
            let mut tail = match self.stream.finish()? {
                Some(p) => {
                    let p = self.stops.push(&p);
                    self.stopped = p.stopped;
                    p.text
                }
                None => String::new(),
            };
            if !self.stopped {
                tail.push_str(&self.stops.finish());
            }
            if !self.send(tail) {
                return Ok(None);
            }
        }
        let finish_reason = match generation.finish_reason {
            FinishReason::StopToken | FinishReason::Halted => "stop",
            FinishReason::MaxNewTokens | FinishReason::ContextWindow => "length",
        };
        let cached_tokens = self.prompt_tokens.saturating_sub(generation.stats.prefill_tokens);
        Ok(Some(Outcome {
            text: self.text,
            tokens: generation.tokens,
            finish_reason: if self.stopped { "stop" } else { finish_reason },
            stats: generation.stats,
            prompt_tokens: self.prompt_tokens,
            cached_tokens,
            queue_seconds,
        }))
    }
}
