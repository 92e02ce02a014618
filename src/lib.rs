//! probespec: training-free multi-token prediction for frozen LLaMA 3 / Qwen 3 checkpoints.
//!
//! Mask tokens (vectors made from the mean of the prompt's embeddings) are appended to the input; their
//! logits propose future tokens, which form a token tree verified in one tree-attention forward pass.
//! Output is token-identical to greedy decoding. Module map: docs/ARCHITECTURE.md.

// The one-line notes on the modules below are comments, not doc comments: each module's own `//!` text is
// its documentation, and a module with both has the links of its own text resolved in this file's scope.

// In data-flow order: each module names only the ones above it (scripts/module-graph.py checks it).

// CPU compute kernels whose results do not depend on the block size (row-invariant matmul, attention).
pub mod kernels;
// Text to token ids and back, chat templates, streaming detokenisation.
pub mod tokenizer;
// Machine and build facts (CPU, commit, date) and stable fingerprints, for records and cache keys.
pub mod facts;
// Checkpoints in (HF folders, GGUF, hub ids); the transformer forward: positions + mask + KV cache in, logits out.
pub mod model;
// The one decoding loop, token trees and their masks, the drafters, and method specs.
pub mod decode;
// A loaded model ready to answer: device, dtype, model, tokenizer, prompt encoding.
pub mod session;
// Multi-turn conversations that reuse the KV cache of earlier turns.
pub mod conversation;

// The front ends: the flags they share, then `bench` (Spec-Bench, the cost curve) and `serve` (the
// OpenAI-compatible server), and `cli`, the command line that dispatches to them.
pub mod bench;
pub mod cli;
pub mod flags;
pub mod serve;
