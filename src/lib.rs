//! probespec: training-free multi-token prediction for frozen LLaMA 3 / Qwen 3 checkpoints.
//!
//! Mask tokens (vectors made from the mean of the prompt's embeddings) are appended to the input; their
//! logits propose future tokens, which form a token tree verified in one tree-attention forward pass.
//! Output is token-identical to greedy decoding. Module map: docs/ARCHITECTURE.md.

// The one-line notes on the modules below are comments, not doc comments: each module's own `//!` text is
// its documentation, and a module with both has the links of its own text resolved in this file's scope.

// The Spec-Bench runner, records, reports and export; the forward cost curve.
pub mod bench;
// Multi-turn conversations that reuse the KV cache of earlier turns.
pub mod chat;
// Command-line flags converted into library types, and the terminal front ends (used by the binary).
pub mod cli;
// The one decoding loop, token trees and their masks, the drafters, and method specs.
pub mod decode;
// CPU compute kernels whose results do not depend on the block size (row-invariant matmul, attention).
pub mod kernels;
// Checkpoints in (HF folders, GGUF, hub ids); the transformer forward: positions + mask + KV cache in, logits out.
pub mod model;
// `probespec serve`: an OpenAI-compatible HTTP server over one loaded model (a front end, as `cli`).
pub mod serve;
// A loaded model ready to answer: device, dtype, model, tokenizer, prompt encoding.
pub mod session;
// Text to token ids and back, chat templates, streaming detokenisation.
pub mod tokenizer;
