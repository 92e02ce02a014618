//! The drafters: what each method proposes per step (a candidate tree and probe rows) and what it learns
//! from the verified step. Verification, KV compaction and statistics live in the shared loop
//! (`decode::generate`), not here.

// Plain decoding: the root alone.
pub mod ar;
// ESP's tree builders from the masks' candidate distributions.
pub mod candidates;
// Embedding-Space Probing: the mask tokens and their tree.
pub mod esp;
// ESP, prompt lookup and n-gram continuations in one scored tree.
pub mod hybrid;
// Lookahead decoding: a Jacobi window and an n-gram pool.
pub mod lookahead;
// N-gram matching and pools shared by the training-free drafters.
pub mod ngram;
// Prompt Lookup Decoding.
pub mod pld;

/// A small deterministic generator for the drafters' brute-force tests: a 64-bit LCG's high bits.
#[cfg(test)]
fn test_rng(mut seed: u64) -> impl FnMut() -> u32 {
    move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    }
}
