//! How often 8-bit activations (`--activations q8`, the default for GGUF block weights on the CPU) and f32
//! activations (`--activations f32`, the dequantised model's own numbers) agree on the greedy token.
//!
//! For the first turns of Spec-Bench questions (chat template), the f32 model's greedy answer is generated;
//! then both models read prompt + answer in one forward pass and their argmax is compared at every answer
//! position (teacher forcing: each position sees the same prefix in both). Also reported: how many answers
//! the q8 model reproduces token for token, and where the first difference falls.
//!
//! `cargo bench --bench numerics` (env: PROBESPEC_NUMERICS_PER_GROUP, default 4; PROBESPEC_NUMERICS_TOKENS,
//! default 64). Needs the default model (`make model`).

use probespec::bench::questions::{bundled_questions, group_of};
use probespec::decode::generate::GenerateParams;
use probespec::decode::method::Method;
use probespec::decode::sampling::argmax;
use probespec::model::load::Activations;
use probespec::model::BlockMask;
use probespec::session::{ModelOptions, Session};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Greedy token after every position of `ids` from `from` on (teacher forcing).
fn argmax_after(s: &Session, ids: &[u32], from: usize) -> Vec<u32> {
    let m = &s.model;
    let mut cache = m.new_cache(ids.len()).unwrap();
    let pos: Vec<u32> = (0..ids.len() as u32).collect();
    let h = m
        .forward(&m.embed(ids).unwrap(), &pos, &BlockMask::Causal, &mut cache)
        .unwrap();
    let rows: Vec<usize> = (from..ids.len()).collect();
    let logits = m.logits(&h, &rows).unwrap().to_vec2::<f32>().unwrap();
    logits.iter().map(|l| argmax(l)).collect()
}

fn main() {
    // `cargo bench` passes flags such as --bench; this target has none of its own.
    let per_group = env("PROBESPEC_NUMERICS_PER_GROUP", 4);
    let tokens = env("PROBESPEC_NUMERICS_TOKENS", 64);
    let load = |activations| {
        Session::load(&ModelOptions {
            activations,
            ..ModelOptions::default()
        })
        .unwrap_or_else(|e| panic!("{e:#} (fetch the default model with `make model`)"))
    };
    let (f32s, q8s) = (load(Activations::F32), load(Activations::Q8));
    let (questions, _) = bundled_questions();
    let mut taken: std::collections::HashMap<String, usize> = Default::default();
    let (mut positions, mut agree, mut same, mut answers) = (0usize, 0usize, 0usize, 0usize);
    let mut first_diffs = Vec::new();
    for q in &questions {
        let n = taken.entry(group_of(&q.category)).or_default();
        if *n >= per_group {
            continue;
        }
        *n += 1;
        let prompt = f32s.encode_prompt(&q.turns[0], None, true).unwrap();
        let params = GenerateParams {
            max_new_tokens: tokens,
            sampling: Default::default(),
            stop_tokens: f32s.stop_tokens(),
            max_block_rows: None,
        };
        let a = f32s
            .generate(&prompt, &Method::Ar, &params, &mut |_| Ok(()))
            .unwrap()
            .tokens;
        let b = q8s
            .generate(&prompt, &Method::Ar, &params, &mut |_| Ok(()))
            .unwrap()
            .tokens;
        let mut ids = prompt.clone();
        ids.extend_from_slice(&a[..a.len().saturating_sub(1)]);
        let (x, y) = (
            argmax_after(&f32s, &ids, prompt.len() - 1),
            argmax_after(&q8s, &ids, prompt.len() - 1),
        );
        assert_eq!(x, a, "teacher forcing reproduces the f32 answer");
        positions += x.len();
        agree += x.iter().zip(&y).filter(|(p, q)| p == q).count();
        answers += 1;
        match a.iter().zip(&b).position(|(p, q)| p != q) {
            None if a.len() == b.len() => same += 1,
            None => first_diffs.push(a.len().min(b.len())),
            Some(i) => first_diffs.push(i),
        }
    }
    first_diffs.sort_unstable();
    let median = first_diffs.get(first_diffs.len() / 2).copied();
    println!(
        "q8 vs f32 activations, {answers} Spec-Bench first turns ({per_group} per group), up to {tokens} tokens:"
    );
    println!(
        "  greedy token agrees at {agree} of {positions} answer positions ({:.2}%)",
        100.0 * agree as f64 / positions as f64
    );
    println!(
        "  answers identical: {same} of {answers}; median first difference of the others at token {}",
        median.map_or("-".to_string(), |m| m.to_string())
    );
}
