//! Decoding strategies: the block and tree types (plain data, no tensors), the verifier, the generate loop,
//! sampling, statistics, `--bc auto` (the cost curve, its disk cache, the per-step block chooser), and one
//! module per drafter.
//!
//! Layering: [`kind`] (the methods' names) sits below everything; the loop ([`generate`]), its statistics
//! and the drafters use it; [`method`] (method specs -> drafters) sits on top and is the only module that
//! imports the drafters. Nothing below [`method`] imports it; its `pub use` re-exports keep the drafters'
//! configuration types reachable as `decode::method::*`.

pub mod auto;
pub mod batch;
pub mod budget;
pub mod capacity;
pub mod cost_cache;
pub mod cost_curve;
pub mod drafters;
pub mod generate;
pub mod kind;
pub mod layout;
pub mod method;
pub mod prefill;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod stats;
pub mod step;
pub mod tree;

/// Largest value a drafter's size flag takes (`--ngram`, `--draft-len`, `--lookahead-window`,
/// `--lookahead-ngram`, `--lookahead-guesses`, each `--branches` entry). Far above any useful setting: a
/// step's block is cut to the context window anyway, so larger values would only allocate.
pub const MAX_DRAFT_FLAG: usize = 1024;

/// Checks a drafter's size flag against `min..=MAX_DRAFT_FLAG`, with an error naming the flag.
pub fn check_flag(flag: &str, value: usize, min: usize) -> anyhow::Result<()> {
    if !(min..=MAX_DRAFT_FLAG).contains(&value) {
        anyhow::bail!("{flag} must be in {min}..={MAX_DRAFT_FLAG} (got {value})");
    }
    Ok(())
}
