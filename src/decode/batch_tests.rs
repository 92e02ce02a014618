//! A batch's answers against each request's answer alone ([`generate`]): every method, greedy and seeded
//! sampling, sequences joining between steps, cancelled, or ended by their own caller.

use super::*;
use crate::decode::generate::{generate, FinishReason};
use crate::decode::method::{Budget, EspSpec, HybridSpec, LookaheadConfig, Method, PldConfig};
use crate::decode::sampling::SamplingParams;
use crate::model::synthetic::{packed_model, random_model, shape_config};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use std::collections::HashMap;

fn methods() -> Vec<Method> {
    vec![
        Method::Ar,
        Method::Esp(EspSpec {
            budget: Budget::Fixed(10),
            ..EspSpec::default()
        }),
        Method::Pld(PldConfig {
            max_ngram: 3,
            draft_len: Some(4),
        }),
        Method::Lookahead(LookaheadConfig {
            window: Some(4),
            ngram: 3,
            guesses: 4,
            seed: 0,
        }),
        Method::Hybrid(HybridSpec {
            budget: Budget::Fixed(20),
            ..HybridSpec::default()
        }),
    ]
}

/// Prompts with repeats in them, so that the lookup drafters find drafts.
fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![5, 17, 9, 40, 17, 9, 40, 17],
        vec![3, 3, 8],
        (0..30).map(|i| (i * 7 % 23) as u32 + 10).collect(),
        vec![200, 201, 202, 200, 201],
        vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3],
    ]
}

fn params(max_new_tokens: usize, sampling: SamplingParams) -> GenerateParams {
    GenerateParams {
        max_new_tokens,
        sampling,
        stop_tokens: vec![],
        max_block_rows: None,
    }
}

fn alone(model: &Transformer, prompt: &[u32], method: &Method, p: &GenerateParams) -> Result<Vec<u32>> {
    let mut d = method.drafter(0)?;
    Ok(generate(model, prompt, d.as_mut(), p, &mut |_| Ok(()))?.tokens)
}

/// Requests `(prompt, method, params, step it joins at)` through one batch: each one's streamed tokens
/// and its generation.
fn batched(
    model: &Transformer,
    requests: &[(Vec<u32>, Method, GenerateParams, usize)],
) -> Result<HashMap<SequenceId, (Vec<u32>, Generation)>> {
    batched_chunked(model, requests, None)
}

/// [`batched`] with prompts prefilled at most `prefill_chunk` rows a step beside the decoding ones.
fn batched_chunked(
    model: &Transformer,
    requests: &[(Vec<u32>, Method, GenerateParams, usize)],
    prefill_chunk: Option<usize>,
) -> Result<HashMap<SequenceId, (Vec<u32>, Generation)>> {
    let mut batch = Batch::new(model).with_prefill_chunk(prefill_chunk);
    let mut streamed: HashMap<SequenceId, Vec<u32>> = HashMap::new();
    let mut done = HashMap::new();
    let mut ids = Vec::new();
    let mut step = 0;
    while done.len() < requests.len() {
        for (prompt, method, p, at) in requests {
            if *at == step {
                ids.push(batch.join(prompt, method.drafter(0)?, p)?);
            }
        }
        for (id, g) in batch.step(&mut |id, t| {
            streamed.entry(id).or_default().push(t);
            Ok(())
        })? {
            done.insert(id, (streamed.remove(&id).unwrap_or_default(), g?));
        }
        step += 1;
        assert!(step < 10_000, "the batch never ended");
    }
    assert_eq!(ids, (0..requests.len() as u64).collect::<Vec<_>>());
    Ok(done)
}

/// A small model of the Llama-3.2-1B kind on candle's tensors (one sequence after another in a batch).
fn small_tensors_model() -> Result<Transformer> {
    let mut c = shape_config("llama3.2-1b")?;
    (c.hidden_size, c.intermediate_size, c.num_layers, c.head_dim) = (64, 128, 2, 16);
    (c.num_heads, c.num_kv_heads) = (4, 2);
    (c.vocab_size, c.max_position_embeddings) = (300, 256);
    random_model(c, &Device::Cpu, DType::F32)
}

/// Every method beside every other, joining at different steps, on the flat layers (one forward pass for
/// all) and on candle's tensors (one after another): each answer is its answer alone.
#[test]
fn every_answer_in_a_batch_is_its_answer_alone() -> Result<()> {
    let flat = packed_model("qwen3-0.6b", GgmlDType::Q4K)?;
    assert!(flat.flat_layers());
    let tensors = small_tensors_model()?;
    for model in [&flat, &tensors] {
        for sampling in [
            SamplingParams::default(),
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                top_k: 40,
                seed: 7,
            },
        ] {
            let requests: Vec<_> = prompts()
                .into_iter()
                .zip(methods())
                .enumerate()
                .map(|(i, (prompt, method))| {
                    (prompt, method, params(12 + 5 * i, sampling), [0, 0, 2, 5, 6][i])
                })
                .collect();
            let done = batched(model, &requests)?;
            for (i, (prompt, method, p, _)) in requests.iter().enumerate() {
                let (streamed, g) = &done[&(i as u64)];
                let want = alone(model, prompt, method, p)?;
                assert_eq!(g.tokens, want, "{} (request {i}, {sampling:?})", method.kind());
                assert_eq!(streamed, &want, "{} streamed", method.kind());
                assert_eq!(g.finish_reason, FinishReason::MaxNewTokens);
            }
        }
    }
    Ok(())
}

/// The same request beside different neighbours, or none, gives the same tokens.
#[test]
fn neighbours_do_not_change_an_answer() -> Result<()> {
    let model = packed_model("llama3.2-1b", GgmlDType::Q8_0)?;
    let hybrid = methods().pop().expect("the hybrid");
    let p = params(24, SamplingParams::default());
    let me = (prompts()[0].clone(), hybrid.clone(), p.clone(), 0);
    let answer = |neighbours: Vec<(Vec<u32>, Method, GenerateParams, usize)>| -> Result<Vec<u32>> {
        let mut requests = vec![me.clone()];
        requests.extend(neighbours);
        Ok(batched(&model, &requests)?
            .remove(&0)
            .expect("the first request")
            .1
            .tokens)
    };
    let lone = answer(vec![])?;
    assert_eq!(lone, alone(&model, &me.0, &hybrid, &p)?);
    let others: Vec<_> = prompts()[1..]
        .iter()
        .zip(methods())
        .map(|(q, m)| (q.clone(), m, params(30, SamplingParams::default()), 1))
        .collect();
    assert_eq!(answer(others.clone())?, lone);
    assert_eq!(answer(others.into_iter().rev().take(2).collect())?, lone);
    Ok(())
}

/// A cancelled sequence ends with the tokens it had, a prefix of its answer alone; one whose caller
/// fails ends with that error; the others go on unchanged.
#[test]
fn cancelled_and_failed_sequences_leave_the_others_alone() -> Result<()> {
    let model = packed_model("qwen3-0.6b", GgmlDType::Q4K)?;
    let p = params(20, SamplingParams::default());
    let (prompts, methods) = (prompts(), methods());
    let mut batch = Batch::new(&model);
    for (q, m) in prompts.iter().zip(&methods).take(3) {
        batch.join(q, m.drafter(0)?, &p)?;
    }
    let mut streamed: HashMap<SequenceId, Vec<u32>> = HashMap::new();
    let mut ended = HashMap::new();
    for _ in 0..3 {
        for (id, g) in batch.step(&mut |id, t| {
            streamed.entry(id).or_default().push(t);
            Ok(())
        })? {
            ended.insert(id, g);
        }
    }
    let cancelled = batch.cancel(0).expect("sequence 0 is in the batch");
    assert_eq!(cancelled.finish_reason, FinishReason::Halted);
    assert!(batch.cancel(0).is_none());
    let want0 = alone(&model, &prompts[0], &methods[0], &p)?;
    assert!(!cancelled.tokens.is_empty() && want0.starts_with(&cancelled.tokens));
    while !batch.is_empty() {
        for (id, g) in batch.step(&mut |id, t| {
            if id == 1 && streamed.get(&1).map_or(0, Vec::len) >= 5 {
                anyhow::bail!("the client went away");
            }
            streamed.entry(id).or_default().push(t);
            Ok(())
        })? {
            ended.insert(id, g);
        }
    }
    let failed = ended.remove(&1).expect("sequence 1 ended");
    assert!(format!("{:#}", failed.err().expect("an error")).contains("went away"));
    let g2 = ended.remove(&2).expect("sequence 2 ended")?;
    assert_eq!(g2.tokens, alone(&model, &prompts[2], &methods[2], &p)?);
    Ok(())
}

/// Prompts prefilled a few rows a step beside decoding sequences (long prompts joining late, chunks of
/// 1, 3 and 16 rows, greedy and seeded sampling): every answer is its answer alone, on the flat layers
/// and on candle's tensors.
#[test]
fn prompts_prefilled_in_chunks_give_the_answers_alone() -> Result<()> {
    let flat = packed_model("qwen3-0.6b", GgmlDType::Q4K)?;
    let tensors = small_tensors_model()?;
    let long: Vec<Vec<u32>> = [41usize, 23]
        .iter()
        .map(|&n| (0..n).map(|i| (i * 11 % 37) as u32 + 20).collect())
        .collect();
    for model in [&flat, &tensors] {
        assert!(model.row_invariant());
        for (chunk, sampling) in [
            (1, SamplingParams::default()),
            (
                3,
                SamplingParams {
                    temperature: 0.8,
                    top_p: 0.9,
                    top_k: 40,
                    seed: 7,
                },
            ),
            (16, SamplingParams::default()),
        ] {
            let requests: Vec<_> = prompts()
                .into_iter()
                .chain(long.clone())
                .zip(methods().into_iter().cycle())
                .enumerate()
                .map(|(i, (prompt, method))| {
                    (
                        prompt,
                        method,
                        params(10 + 3 * i, sampling),
                        [0, 1, 2, 2, 3, 4, 6][i],
                    )
                })
                .collect();
            let done = batched_chunked(model, &requests, Some(chunk))?;
            for (i, (prompt, method, p, _)) in requests.iter().enumerate() {
                let (streamed, g) = &done[&(i as u64)];
                let want = alone(model, prompt, method, p)?;
                assert_eq!(g.tokens, want, "{} (request {i}, chunk {chunk})", method.kind());
                assert_eq!(streamed, &want, "{} streamed", method.kind());
                assert_eq!(g.stats.prefill_tokens, prompt.len(), "request {i}");
            }
        }
    }
    Ok(())
}

/// A prompt going in a row a step beside a decoding sequence: nothing comes from it until its prefill
/// ends; cancelled part-way it ends with no tokens, and the other's answer is unchanged.
#[test]
fn a_prompt_cancelled_while_it_goes_in_ends_with_no_tokens() -> Result<()> {
    let model = packed_model("qwen3-0.6b", GgmlDType::Q8_0)?;
    let p = params(20, SamplingParams::default());
    let mut batch = Batch::new(&model).with_prefill_chunk(Some(1));
    let first = prompts()[1].clone();
    batch.join(&first, Method::Ar.drafter(0)?, &p)?;
    let mut streamed: HashMap<SequenceId, Vec<u32>> = HashMap::new();
    let mut step = |batch: &mut Batch| -> Result<()> {
        let ended = batch.step(&mut |id, t| {
            streamed.entry(id).or_default().push(t);
            Ok(())
        })?;
        assert!(ended.is_empty());
        Ok(())
    };
    step(&mut batch)?;
    let long: Vec<u32> = (0..30).map(|i| i * 3 + 7).collect();
    batch.join(&long, Method::Ar.drafter(0)?, &p)?;
    for _ in 0..5 {
        step(&mut batch)?;
    }
    assert!(!streamed.contains_key(&1), "a token before the prompt went in");
    let cancelled = batch.cancel(1).expect("sequence 1 is in the batch");
    assert_eq!(cancelled.finish_reason, FinishReason::Halted);
    assert!(cancelled.tokens.is_empty());
    assert_eq!(cancelled.stats.prefill_tokens, 5, "a row a step");
    while !batch.is_empty() {
        for (id, g) in batch.step(&mut |id, t| {
            streamed.entry(id).or_default().push(t);
            Ok(())
        })? {
            assert_eq!(id, 0);
            assert_eq!(g?.tokens, alone(&model, &first, &Method::Ar, &p)?);
        }
    }
    Ok(())
}
