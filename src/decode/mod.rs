//! Decoding strategies: the block and tree types (plain data, no tensors), the verifier, the generate loop,
//! sampling, statistics, and one module per drafter.

pub mod ar;
pub mod auto_bc;
pub mod esp;
pub mod generate;
pub mod hybrid;
pub mod lookahead;
pub mod method;
pub mod ngram;
pub mod pld;
pub mod sampling;
pub mod stats;
pub mod tree;
