//! The names of the decoding methods ([`MethodKind`]), as the CLI, the statistics and the benchmark
//! records write them. Plain data with no dependencies inside the crate: the decoding loop, the statistics
//! and every drafter name their method with it, below the factory that builds drafters from method specs
//! ([`super::method`], which re-exports it).

use serde::{Deserialize, Serialize};
use std::fmt;

/// The methods, by the names the CLI, the statistics and the benchmark records use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MethodKind {
    /// Plain greedy / sampled decoding, the reference.
    Ar,
    /// Embedding-Space Probing: mask tokens on every tree node.
    Esp,
    /// Prompt Lookup Decoding.
    Pld,
    /// Lookahead decoding (one Jacobi level and an n-gram pool).
    Lookahead,
    /// ESP, prompt lookup and n-gram continuations in one tree.
    Hybrid,
}

impl MethodKind {
    pub fn name(self) -> &'static str {
        match self {
            MethodKind::Ar => "ar",
            MethodKind::Esp => "esp",
            MethodKind::Pld => "pld",
            MethodKind::Lookahead => "lookahead",
            MethodKind::Hybrid => "hybrid",
        }
    }
}

impl fmt::Display for MethodKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
