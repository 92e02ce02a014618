//! A decoding method as plain data: which drafter, with which parameters. The one place where a method's
//! parameters are checked and its drafter is built; the CLI's flags and the benchmark's configurations
//! convert into a [`Method`].

use super::budget::node_budget;
use super::drafters::ar::Autoregressive;
use super::drafters::esp::{Esp, EspConfig, TreeShape};
pub use super::drafters::esp::{MaskInit, Masks};
use super::drafters::hybrid::{Hybrid, HybridConfig};
use super::drafters::lookahead::Lookahead;
pub use super::drafters::lookahead::LookaheadConfig;
pub use super::drafters::pld::PldConfig;
use super::drafters::pld::{Pld, DEFAULT_DRAFT_LEN};
use super::generate::Drafter;
pub use super::kind::MethodKind;
use anyhow::{anyhow, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Block complexity: rows per forward pass, masks included, `(k + 1)(1 + nodes)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Budget {
    /// Chosen per step from the measured forward cost and the observed acceptance.
    #[default]
    Auto,
    Fixed(usize),
}

impl std::str::FromStr for Budget {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Budget::Auto),
            _ => match s.parse::<usize>() {
                Ok(n) if n > 0 => Ok(Budget::Fixed(n)),
                _ => Err(format!(
                    "'{s}' is not a block complexity (a positive number or 'auto')"
                )),
            },
        }
    }
}

/// In records: a number, or "auto" (older records wrote `--bc auto` as 0).
impl Serialize for Budget {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Budget::Auto => s.serialize_str("auto"),
            Budget::Fixed(n) => s.serialize_u64(*n as u64),
        }
    }
}

impl<'de> Deserialize<'de> for Budget {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(0) => Ok(Budget::Auto),
            Raw::Number(n) => Ok(Budget::Fixed(n as usize)),
            Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Budget::Auto => f.write_str("auto"),
            Budget::Fixed(n) => write!(f, "{n}"),
        }
    }
}

/// ESP's tree.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum EspTree {
    /// The paper's Algorithm 1: best-first by cumulative probability.
    #[default]
    Dynamic,
    /// K_i candidates at depth i, only the best of each depth expanded; `None`: the paper's proportions
    /// for the budget.
    Static(Option<Vec<usize>>),
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct EspSpec {
    pub masks: Masks,
    pub budget: Budget,
    pub tree: EspTree,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct HybridSpec {
    pub masks: Masks,
    pub budget: Budget,
    /// The prompt-lookup source's n-gram length and chain length.
    pub lookup: PldConfig,
}

/// A decoding method and its parameters.
///
/// Plain data: [`Method::validate`] checks the parameters and [`Method::drafter`] builds the drafter that
/// [`generate`](super::generate::generate) runs. Every method gives the tokens of plain decoding.
///
/// # Example
///
/// ```
/// use probespec::decode::generate::{generate, GenerateParams};
/// use probespec::decode::method::{Budget, EspSpec, HybridSpec, Masks, Method, MethodKind, PldConfig};
/// # use candle_core::{DType, Device};
/// # use probespec::model::{synthetic::random_model, ModelConfig};
/// # fn main() -> anyhow::Result<()> {
/// // A tiny LLaMA-shaped model with random weights, built in memory (no checkpoint needed).
/// let config = ModelConfig::from_hf_json(
///     r#"{"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
///         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
///         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
///         "tie_word_embeddings": false, "eos_token_id": 2}"#,
/// )?;
/// let model = random_model(config, &Device::Cpu, DType::F32)?;
///
/// let esp = Method::Esp(EspSpec {
///     masks: Masks { count: 2, ..Masks::default() },
///     budget: Budget::Fixed(30),
///     ..EspSpec::default()
/// });
/// assert_eq!(esp.kind(), MethodKind::Esp);
/// assert_eq!(esp.budget(), Some(Budget::Fixed(30)));
/// esp.validate()?;
/// // A bad parameter is an error naming its flag, before anything runs.
/// let too_many = Method::Esp(EspSpec {
///     masks: Masks { count: 4, ..Masks::default() },
///     ..EspSpec::default()
/// });
/// assert!(too_many.validate().unwrap_err().to_string().contains("--masks"));
///
/// let params = GenerateParams {
///     max_new_tokens: 16,
///     sampling: Default::default(),
///     stop_tokens: vec![],
///     max_block_rows: None,
/// };
/// let prompt = [7, 3, 11, 3, 11, 7, 3];
/// let run = |method: &Method| -> anyhow::Result<Vec<u32>> {
///     let mut drafter = method.drafter(0)?;
///     Ok(generate(&model, &prompt, drafter.as_mut(), &params, &mut |_| Ok(()))?.tokens)
/// };
/// let reference = run(&Method::Ar)?;
/// let hybrid = Method::Hybrid(HybridSpec { budget: Budget::Fixed(20), ..HybridSpec::default() });
/// let pld = Method::Pld(PldConfig { max_ngram: 3, draft_len: Some(4) });
/// for method in [esp, hybrid, pld] {
///     assert_eq!(run(&method)?, reference, "{} is lossless", method.kind());
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum Method {
    Ar,
    Esp(EspSpec),
    Pld(PldConfig),
    /// The seed of the config is replaced by the generation's.
    Lookahead(LookaheadConfig),
    Hybrid(HybridSpec),
}

impl Default for Method {
    /// What `probespec` runs without flags: the hybrid (ESP's masks and prompt lookup in one tree),
    /// `--bc auto`.
    fn default() -> Self {
        Method::Hybrid(HybridSpec::default())
    }
}

/// ESP's static tree has no per-step policy: with `--bc auto` it takes the paper's middle setting.
const BC_WITHOUT_AUTO_POLICY: usize = 30;

impl Method {
    pub fn kind(&self) -> MethodKind {
        match self {
            Method::Ar => MethodKind::Ar,
            Method::Esp(_) => MethodKind::Esp,
            Method::Pld(_) => MethodKind::Pld,
            Method::Lookahead(_) => MethodKind::Lookahead,
            Method::Hybrid(_) => MethodKind::Hybrid,
        }
    }

    /// The block complexity, for methods that have one.
    pub fn budget(&self) -> Option<Budget> {
        match self {
            Method::Esp(e) => Some(e.budget),
            Method::Hybrid(h) => Some(h.budget),
            _ => None,
        }
    }

    /// Masks per node, for methods that have them.
    pub fn masks(&self) -> Option<usize> {
        match self {
            Method::Esp(e) => Some(e.masks.count),
            Method::Hybrid(h) => Some(h.masks.count),
            _ => None,
        }
    }

    /// Checks every parameter, without building anything that costs.
    pub fn validate(&self) -> Result<()> {
        self.drafter(0).map(drop)
    }

    /// The drafter of this method; `seed` feeds the drafters that draw random numbers.
    pub fn drafter(&self, seed: u64) -> Result<Box<dyn Drafter>> {
        Ok(match self {
            Method::Ar => Box::new(Autoregressive),
            Method::Esp(e) => {
                // The masks are checked first: a wrong k would make the budget's error misleading.
                e.masks.validate()?;
                let k = e.masks.count;
                let tree = match (&e.tree, e.budget) {
                    (EspTree::Static(Some(b)), _) => TreeShape::Static { branches: b.clone() },
                    (EspTree::Dynamic, Budget::Auto) => TreeShape::Auto,
                    (EspTree::Dynamic, Budget::Fixed(bc)) => TreeShape::Dynamic {
                        budget: nodes(bc, k)?,
                    },
                    (EspTree::Static(None), b) => TreeShape::Static {
                        branches: default_branches(nodes(fixed_or_default(b), k)?, k),
                    },
                };
                Box::new(Esp::new(EspConfig {
                    masks: e.masks,
                    tree,
                    seed,
                })?)
            }
            Method::Pld(c) => Box::new(Pld::new(*c)?),
            Method::Lookahead(c) => Box::new(Lookahead::new(LookaheadConfig { seed, ..*c })?),
            Method::Hybrid(h) => {
                // The masks are checked first: a wrong k would make the budget's error misleading.
                h.masks.validate()?;
                h.lookup.validate()?;
                let nodes = match h.budget {
                    Budget::Auto => None,
                    Budget::Fixed(bc) => Some(nodes(bc, h.masks.count)?),
                };
                let mut c = HybridConfig::new(h.masks.count, nodes);
                c.masks = h.masks;
                c.max_ngram = h.lookup.max_ngram;
                c.draft_len = h.lookup.draft_len.unwrap_or(DEFAULT_DRAFT_LEN);
                c.seed = seed;
                Box::new(Hybrid::new(c)?)
            }
        })
    }
}

fn fixed_or_default(b: Budget) -> usize {
    match b {
        Budget::Fixed(n) => n,
        Budget::Auto => BC_WITHOUT_AUTO_POLICY,
    }
}

fn nodes(bc: usize, k: usize) -> Result<usize> {
    node_budget(bc, k).map_err(|e| anyhow!(e))
}

/// A static shape for a node budget: the paper's proportions (BC 30, k=2: [7, 2]; BC 60, k=2: [15, 4]).
pub fn default_branches(budget: usize, k: usize) -> Vec<usize> {
    if k == 1 || budget < k {
        return vec![budget.max(1)];
    }
    let deeper = ((budget as f32 / 5.0).round() as usize).max(1);
    let mut b = vec![budget.saturating_sub(deeper * (k - 1)).max(1)];
    b.extend(std::iter::repeat_n(deeper, k - 1));
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_and_print() {
        assert_eq!("auto".parse::<Budget>(), Ok(Budget::Auto));
        assert_eq!("30".parse::<Budget>(), Ok(Budget::Fixed(30)));
        assert!("0".parse::<Budget>().is_err());
        assert!("x".parse::<Budget>().is_err());
        assert_eq!(Budget::Fixed(60).to_string(), "60");
        for (json, b) in [("30", Budget::Fixed(30)), ("\"auto\"", Budget::Auto)] {
            assert_eq!(serde_json::to_string(&b).unwrap(), json);
            assert_eq!(serde_json::from_str::<Budget>(json).unwrap(), b);
        }
        // Records written before the budget was a type held `--bc auto` as 0.
        assert_eq!(serde_json::from_str::<Budget>("0").unwrap(), Budget::Auto);
    }

    #[test]
    fn the_papers_static_shapes() {
        assert_eq!(default_branches(9, 2), vec![7, 2]);
        assert_eq!(default_branches(19, 2), vec![15, 4]);
        assert_eq!(default_branches(14, 1), vec![14]);
    }

    #[test]
    fn parameters_are_checked_once_for_every_method() {
        let masks = |count, lambda| Masks {
            count,
            lambda,
            ..Masks::default()
        };
        let esp = |m| {
            Method::Esp(EspSpec {
                masks: m,
                budget: Budget::Fixed(30),
                ..EspSpec::default()
            })
        };
        let hybrid = |m| {
            Method::Hybrid(HybridSpec {
                masks: m,
                budget: Budget::Fixed(30),
                ..HybridSpec::default()
            })
        };
        for make in [esp, hybrid] {
            assert!(make(masks(1, 0.1)).validate().is_ok());
            let e = make(masks(4, 0.1)).validate().unwrap_err().to_string();
            assert!(e.contains("--masks"), "{e}");
            let e = make(masks(1, 1.5)).validate().unwrap_err().to_string();
            assert!(e.contains("--mask-lambda"), "{e}");
        }
        // BC 4 cannot hold a root and a node with 2 masks each.
        let small = Method::Esp(EspSpec {
            masks: masks(2, 0.1),
            budget: Budget::Fixed(4),
            ..EspSpec::default()
        });
        assert!(small.validate().is_err());
        assert_eq!(Method::default().kind(), MethodKind::Hybrid);
        assert_eq!(
            serde_json::to_string(&MethodKind::Lookahead).unwrap(),
            "\"lookahead\""
        );
    }
}
