//! Decoding statistics: model calls, tokens committed per call (tau), a histogram of it, the block sizes
//! sent (what `--bc auto` chose: a histogram of rows per step and the share of plain one-row steps), and
//! where the time went (forward pass, drafting, verification, bookkeeping).

use super::kind::MethodKind;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct DecodeStats {
    pub method: MethodKind,
    pub new_tokens: usize,
    /// Decoding forward passes after prefill.
    pub model_calls: usize,
    /// Tokens committed by those calls / model_calls (1.0 for plain decoding).
    pub tau: f64,
    /// The prompt's forward pass and first token, from after the drafter's setup.
    pub prefill_seconds: f64,
    /// Prompt tokens the prefill computed (fewer than the prompt when a conversation's cache held the rest).
    pub prefill_tokens: usize,
    /// Seconds this generation's setup spent timing the forward cost curve for `--bc auto` (0 when the
    /// curve came from the disk cache or an earlier generation): paid once per machine and model, on
    /// top of the prefill and decode times.
    pub cost_curve_timed_seconds: f64,
    pub decode_seconds: f64,
    pub tokens_per_second: f64,
    /// `committed_histogram[n]` = steps that committed n tokens.
    pub committed_histogram: Vec<usize>,
    /// Tokens committed by each decoding call, in order (Spec-Bench's `accept_lengths`).
    pub accept_lengths: Vec<usize>,
    /// Tree nodes and block rows (nodes + probes) summed over steps, for mean block sizes.
    pub tree_nodes: usize,
    pub block_rows: usize,
    /// `block_histogram[r]` = steps whose block had r rows (probes included).
    pub block_histogram: Vec<usize>,
    /// Share of the steps that decoded plainly (a block of one row).
    pub plain_share: f64,
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
            cost_curve_timed_seconds: 0.0,
            decode_seconds: 0.0,
            tokens_per_second: 0.0,
            committed_histogram: Vec::new(),
            accept_lengths: Vec::new(),
            tree_nodes: 0,
            block_rows: 0,
            block_histogram: Vec::new(),
            plain_share: 0.0,
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
        if self.block_histogram.len() <= rows {
            self.block_histogram.resize(rows + 1, 0);
        }
        self.block_histogram[rows] += 1;
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
        self.plain_share = plain_share(&self.block_histogram).unwrap_or(0.0);
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
        let timed = if self.cost_curve_timed_seconds > 0.0 {
            format!(
                " | cost curve timed in {:.2}s (once per machine and model)",
                self.cost_curve_timed_seconds
            )
        } else {
            String::new()
        };
        format!(
            "[{}] prompt {} tok, {} new tok | prefill {:.2}s | decode {:.2} tok/s | {} model calls, tau {:.3} | {} | overhead {:.1}%{}",
            self.method,
            prompt_tokens,
            self.new_tokens,
            self.prefill_seconds,
            self.tokens_per_second,
            self.model_calls,
            self.tau,
            blocks_line(&self.block_histogram),
            100.0 * self.overhead_fraction(),
            timed
        )
    }
}

/// Share of the steps of a block histogram that had one row; `None` without steps.
pub fn plain_share(histogram: &[usize]) -> Option<f64> {
    let steps: usize = histogram.iter().sum();
    (steps > 0).then(|| histogram.get(1).copied().unwrap_or(0) as f64 / steps as f64)
}

/// "plain 62%, rows 2-4 13%, 5-8 25%": the share of plain steps, then of the other steps by block size
/// in powers of two; "no steps" without any.
pub fn blocks_line(histogram: &[usize]) -> String {
    let steps: usize = histogram.iter().sum();
    let Some(plain) = plain_share(histogram) else {
        return "no steps".into();
    };
    let pct = |n: usize| 100.0 * n as f64 / steps as f64;
    let mut parts = vec![format!("plain {:.0}%", 100.0 * plain)];
    let (mut lo, mut hi) = (2usize, 4usize);
    while lo < histogram.len() {
        let n: usize = histogram[lo..(hi + 1).min(histogram.len())].iter().sum();
        if n > 0 {
            let label = if parts.len() == 1 { "rows " } else { "" };
            parts.push(format!("{label}{lo}-{hi} {:.0}%", pct(n)));
        }
        (lo, hi) = (hi + 1, 2 * hi);
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_are_counted_and_summarised() {
        let mut s = DecodeStats::new(MethodKind::Esp);
        for rows in [1, 1, 1, 1, 1, 2, 6, 6, 30, 1] {
            s.record_step(1, rows, rows);
        }
        s.finish();
        assert_eq!(s.block_histogram[1], 6);
        assert_eq!(s.block_histogram[6], 2);
        assert_eq!(s.plain_share, 0.6);
        assert_eq!(
            blocks_line(&s.block_histogram),
            "plain 60%, rows 2-4 10%, 5-8 20%, 17-32 10%"
        );
        assert!(s.summary_line(5).contains("plain 60%"), "{}", s.summary_line(5));
        assert!(!s.summary_line(5).contains("cost curve"));
        s.cost_curve_timed_seconds = 0.8;
        assert!(
            s.summary_line(5)
                .ends_with("| cost curve timed in 0.80s (once per machine and model)"),
            "{}",
            s.summary_line(5)
        );
        assert_eq!(blocks_line(&[]), "no steps");
        assert_eq!(plain_share(&[0, 0, 3]), Some(0.0));
    }
}
