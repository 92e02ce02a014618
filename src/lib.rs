//! probespec: training-free multi-token prediction for frozen LLaMA 3 / Qwen 3 checkpoints.
//!
//! Mask tokens (vectors made from the mean of the prompt's embeddings) are appended to the input; their
//! logits propose future tokens, which form a token tree verified in one tree-attention forward pass.
//! Output is token-identical to greedy decoding.

pub mod bench;
pub mod chat;
pub mod cli;
pub mod decode;
pub mod kernels;
pub mod model;
pub mod tokenizer;
