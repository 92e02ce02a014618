//! Decoding statistics: model calls, tokens committed per call (tau), a histogram of it, and where the
//! time went (forward pass, drafting, verification, bookkeeping).

use super::method::MethodKind;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct DecodeStats {
    pub method: MethodKind,
    pub new_tokens: usize,
    /// Decoding forward passes after prefill.
    pub model_calls: usize,
    /// Tokens committed by those calls / model_calls (1.0 for plain decoding).
    pub tau: f64,
    pub prefill_seconds: f64,
    /// Prompt tokens the prefill computed (fewer than the prompt when a conversation's cache held the rest).
    pub prefill_tokens: usize,
    pub decode_seconds: f64,
    pub tokens_per_second: f64,
    /// committed_histogram[n] = steps that committed n tokens.
    pub committed_histogram: Vec<usize>,
    /// Tokens committed by each decoding call, in order (Spec-Bench's `accept_lengths`).
    pub accept_lengths: Vec<usize>,
    /// Tree nodes and block rows (nodes + probes) summed over steps, for mean block sizes.
    pub tree_nodes: usize,
    pub block_rows: usize,
    pub forward_seconds: f64,
    pub draft_seconds: f64,
    pub verify_seconds: f64,
    pub bookkeeping_seconds: f64,
    #[serde(skip)]
    last_step: Option<usize>,
}

impl DecodeStats {
    pub fn new(method: MethodKind) -> Self {
        DecodeStats {
            method,
            new_tokens: 0,
            model_calls: 0,
            tau: 0.0,
            prefill_seconds: 0.0,
            prefill_tokens: 0,
            decode_seconds: 0.0,
            tokens_per_second: 0.0,
            committed_histogram: Vec::new(),
            accept_lengths: Vec::new(),
            tree_nodes: 0,
            block_rows: 0,
            forward_seconds: 0.0,
            draft_seconds: 0.0,
            verify_seconds: 0.0,
            bookkeeping_seconds: 0.0,
            last_step: None,
        }
    }

    pub fn record_step(&mut self, committed: usize, nodes: usize, rows: usize) {
        self.model_calls += 1;
        self.tree_nodes += nodes;
        self.block_rows += rows;
        self.bump(committed, 1);
        self.accept_lengths.push(committed);
        self.last_step = Some(committed);
    }

    /// The last step committed fewer tokens than it accepted (a stop token or the length limit fell inside).
    pub fn truncate_last_step(&mut self, emitted: usize) {
        if let Some(c) = self.last_step.take() {
            if emitted < c {
                self.committed_histogram[c] -= 1;
                self.bump(emitted, 1);
                if let Some(last) = self.accept_lengths.last_mut() {
                    *last = emitted;
                }
            }
        }
    }

    fn bump(&mut self, n: usize, by: usize) {
        if self.committed_histogram.len() <= n {
            self.committed_histogram.resize(n + 1, 0);
        }
        self.committed_histogram[n] += by;
    }

    pub fn committed_by_calls(&self) -> usize {
        self.committed_histogram
            .iter()
            .enumerate()
            .map(|(n, c)| n * c)
            .sum()
    }

    /// Fills the derived fields once decoding is over.
    pub fn finish(&mut self) {
        self.tau = if self.model_calls == 0 {
            1.0
        } else {
            self.committed_by_calls() as f64 / self.model_calls as f64
        };
        self.tokens_per_second = if self.decode_seconds > 0.0 {
            self.committed_by_calls() as f64 / self.decode_seconds
        } else {
            0.0
        };
    }

    /// Share of the decode time spent outside the forward pass.
    pub fn overhead_fraction(&self) -> f64 {
        let outside = self.draft_seconds + self.verify_seconds + self.bookkeeping_seconds;
        let total = outside + self.forward_seconds;
        if total > 0.0 {
            outside / total
        } else {
            0.0
        }
    }

    /// The one-line summary printed on stderr.
    pub fn summary_line(&self, prompt_tokens: usize) -> String {
        format!(
            "[{}] prompt {} tok, {} new tok | prefill {:.2}s | decode {:.2} tok/s | {} model calls, tau {:.3} | overhead {:.1}%",
            self.method,
            prompt_tokens,
            self.new_tokens,
            self.prefill_seconds,
            self.tokens_per_second,
            self.model_calls,
            self.tau,
            100.0 * self.overhead_fraction()
        )
    }
}
