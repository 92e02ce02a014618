//! Continuous batching: jobs join a [`Batch`] between its steps as they come, up to a number decoded
//! together, and leave when they end. The caller says where jobs come from and what their tokens become
//! ([`Jobs`]); [`run`] steps them. The server's batched worker and `run-batch` are two such callers, and
//! [`generate_all`] is the plain one: token ids in, each generation's tokens streamed and returned.
//!
//! A step that fails or panics fails every job in it and the batch starts afresh; a job whose prefill
//! fails or panics fails alone. Every job's tokens are those it would get alone
//! ([`generate`](super::generate::generate)), whatever else is in the batch.
//!
//! # Example
//!
//! ```
//! use probespec::decode::generate::{generate, GenerateParams};
//! use probespec::decode::method::Method;
//! use probespec::decode::scheduler::{generate_all, Request};
//! # use candle_core::{DType, Device};
//! # use probespec::model::{synthetic::random_model, ModelConfig};
//! # fn main() -> anyhow::Result<()> {
//! # let config = ModelConfig::from_hf_json(
//! #     r#"{"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
//! #         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
//! #         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
//! #         "tie_word_embeddings": false, "eos_token_id": 2}"#,
//! # )?;
//! # let model = random_model(config, &Device::Cpu, DType::F32)?;
//! let params = GenerateParams {
//!     max_new_tokens: 16,
//!     sampling: Default::default(),
//!     stop_tokens: vec![],
//!     max_block_rows: None,
//! };
//! let prompts = [vec![5, 17, 9, 40], vec![3, 3, 8], vec![7, 7, 7, 7, 7]];
//! let requests = prompts
//!     .iter()
//!     .map(|p| {
//!         let drafter = Method::Pld(Default::default()).drafter(0)?;
//!         Ok(Request { prompt: p.clone(), drafter, params: params.clone() })
//!     })
//!     .collect::<anyhow::Result<Vec<_>>>()?;
//! // Two decoded together; the third joins when one of them ends.
//! let mut streamed = vec![Vec::new(); prompts.len()];
//! let generations = generate_all(&model, requests, 2, &mut |i, token| {
//!     streamed[i].push(token);
//!     Ok(())
//! })?;
//! for ((p, g), s) in prompts.iter().zip(generations).zip(&streamed) {
//!     let mut drafter = Method::Pld(Default::default()).drafter(0)?;
//!     let alone = generate(&model, p, drafter.as_mut(), &params, &mut |_| Ok(()))?;
//!     assert_eq!(g?.tokens, alone.tokens);
//!     assert_eq!(s, &alone.tokens);
//! }
//! # Ok(())
//! # }
//! ```

use super::batch::{Batch, Retired, SequenceId};
pub use super::capacity::Capacity;
use super::prefill::{cache_rows, common_prefix};
use super::step::{Drafter, GenerateParams, Generation, Halt};
use crate::model::Transformer;
use anyhow::{anyhow, Result};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What a job decodes.
pub struct Request {
    pub prompt: Vec<u32>,
    pub drafter: Box<dyn Drafter>,
    pub params: GenerateParams,
}

/// What [`Jobs::next`] has.
pub enum Next<J> {
    /// A job and what it decodes.
    Job(J, Request),
    /// None waiting now.
    Empty,
    /// None ever again: [`run`] returns when the batch is done.
    Closed,
}

/// The caller's side of the scheduler: where jobs come from and what their tokens become.
pub trait Jobs {
    type Job;

    /// The next job. `wait` is true when nothing decodes, so that the call may block until one comes
    /// (returning [`Next::Empty`] then asks again).
    fn next(&mut self, wait: bool) -> Next<Self::Job>;

    /// A token `job` committed; an error ends its generation there ([`Halt`]: normally, as a stop
    /// token would).
    fn token(&mut self, job: &mut Self::Job, token: u32) -> Result<()>;

    /// How `job` ended: its generation, or why it failed. An error stops [`run`] at once.
    fn end(&mut self, job: Self::Job, generation: Result<Generation>) -> Result<()>;
}

/// The KV cache rows `request` reserves on `model`.
pub fn request_rows(model: &Transformer, request: &Request) -> usize {
    cache_rows(
        model.config.max_position_embeddings,
        request.prompt.len(),
        request.params.max_new_tokens,
    )
}

/// Steps the jobs `jobs` hands out, up to `capacity` together, until it is closed and every job has
/// ended; an error only from [`Jobs::end`]. A job whose cache would overflow `capacity.kv_rows` waits
/// (and the jobs after it) until others end; one that could never fit fails.
pub fn run<J: Jobs>(model: &Transformer, capacity: Capacity, jobs: &mut J) -> Result<()> {
    // Retired caches are reused only where a prompt after a cached prefix gives the bits of a whole one.
    let reuse = model.row_invariant();
    let new_batch = || {
        let batch = Batch::new(model).with_prefill_chunk(capacity.prefill_chunk);
        if reuse {
            batch.keeping_caches()
        } else {
            batch
        }
    };
    let mut batch = new_batch();
    // The caches of generations that ended, oldest first: a later prompt that starts with one's tokens
    // (a conversation's next turn) prefills only the rest.
    let mut pool: Vec<Retired> = Vec::new();
    // Each active job and the cache rows it reserved.
    let mut active: HashMap<SequenceId, (J::Job, usize)> = HashMap::new();
    let mut waiting: Option<(J::Job, Request)> = None;
    let mut open = true;
    loop {
        while batch.len() < capacity.sequences.max(1) {
            let (job, request) = match waiting.take() {
                Some(w) => w,
                None if !open => break,
                None => match jobs.next(batch.is_empty()) {
                    Next::Job(job, request) => (job, request),
                    Next::Empty if batch.is_empty() => continue,
                    Next::Empty => break,
                    Next::Closed => {
                        open = false;
                        break;
                    }
                },
            };
            let mut rows = request_rows(model, &request);
            if let Some(budget) = capacity.kv_rows {
                if rows > budget {
                    let why = anyhow!("it needs {rows} KV cache rows, more than the {budget} all may hold");
                    jobs.end(job, Err(why))?;
                    continue;
                }
                let reserved: usize = active.values().map(|(_, r)| r).sum();
                // Retired caches give way to the jobs.
                while reserved + pooled_rows(&pool) + rows > budget && !pool.is_empty() {
                    pool.remove(0);
                }
                if reserved + rows > budget {
                    waiting = Some((job, request));
                    break;
                }
            }
            let cache = match longest_prefix(&pool, &request.prompt) {
                Some((i, shared)) => {
                    let mut retired = pool.remove(i);
                    retired.cache.truncate(shared);
                    rows = rows.max(retired.cache.capacity());
                    retired.cache
                }
                None => match model.new_cache(0) {
                    Ok(cache) => cache,
                    Err(e) => {
                        jobs.end(job, Err(e))?;
                        continue;
                    }
                },
            };
            let joined = catch_unwind(AssertUnwindSafe(|| {
                batch.join_reusing(&request.prompt, request.drafter, &request.params, cache)
            }));
            match joined {
                Ok(Ok(id)) => {
                    active.insert(id, (job, rows));
                }
                Ok(Err(e)) => jobs.end(job, Err(e))?,
                Err(_) => jobs.end(job, Err(anyhow!("the prefill panicked")))?,
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        let step = catch_unwind(AssertUnwindSafe(|| {
            batch.step(&mut |id, t| match active.get_mut(&id) {
                Some((job, _)) => jobs.token(job, t),
                None => Err(Halt.into()),
            })
        }));
        match step {
            Ok(Ok(ended)) => {
                pool.extend(batch.take_retired());
                let most = capacity.sequences.max(1);
                if pool.len() > most {
                    pool.drain(..pool.len() - most);
                }
                for (id, generation) in ended {
                    if let Some((job, _)) = active.remove(&id) {
                        jobs.end(job, generation)?;
                    }
                }
            }
            failed => {
                let why = match failed {
                    Ok(Err(e)) => format!("{e:#}"),
                    _ => "the generation panicked".to_string(),
                };
                batch = new_batch();
                pool.clear();
                for (_, (job, _)) in active.drain() {
                    jobs.end(job, Err(anyhow!("{why}")))?;
                }
            }
        }
    }
}

/// KV cache rows the retired caches hold.
fn pooled_rows(pool: &[Retired]) -> usize {
    pool.iter().map(|r| r.cache.capacity()).sum()
}

/// The retired cache that shares the most tokens with `prompt` (the latest of equals), and how many.
fn longest_prefix(pool: &[Retired], prompt: &[u32]) -> Option<(usize, usize)> {
    pool.iter()
        .enumerate()
        .map(|(i, r)| (i, common_prefix(&r.tokens, prompt)))
        .filter(|&(_, shared)| shared > 0)
        .max_by_key(|&(i, shared)| (shared, i))
}

/// Decodes `requests`, up to `parallel` together, handing each committed token to `on_token(index,
/// token)` as it comes (an error ends that request's generation, [`Halt`] normally); each request's
/// generation or why it failed, in the requests' order.
pub fn generate_all(
    model: &Transformer,
    requests: Vec<Request>,
    parallel: usize,
    on_token: &mut dyn FnMut(usize, u32) -> Result<()>,
) -> Result<Vec<Result<Generation>>> {
    struct Listed<'a> {
        requests: std::iter::Enumerate<std::vec::IntoIter<Request>>,
        on_token: &'a mut dyn FnMut(usize, u32) -> Result<()>,
        ended: Vec<Option<Result<Generation>>>,
    }
    impl Jobs for Listed<'_> {
        type Job = usize;
        fn next(&mut self, _wait: bool) -> Next<usize> {
            match self.requests.next() {
                Some((i, r)) => Next::Job(i, r),
                None => Next::Closed,
            }
        }
        fn token(&mut self, &mut i: &mut usize, token: u32) -> Result<()> {
            (self.on_token)(i, token)
        }
        fn end(&mut self, i: usize, generation: Result<Generation>) -> Result<()> {
            self.ended[i] = Some(generation);
            Ok(())
        }
    }
    let n = requests.len();
    let mut listed = Listed {
        requests: requests.into_iter().enumerate(),
        on_token,
        ended: (0..n).map(|_| None).collect(),
    };
    run(model, Capacity::sequences(parallel), &mut listed)?;
    Ok(listed
        .ended
        .into_iter()
        .map(|g| g.unwrap_or_else(|| Err(anyhow!("the request never ended"))))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::generate::generate;
    use crate::decode::method::{EspSpec, Method, PldConfig};
    use crate::model::synthetic::random_model;
    use crate::model::ModelConfig;
    use candle_core::{DType, Device};
    use std::collections::HashSet;

    fn tiny_model() -> Result<Transformer> {
        let config = ModelConfig::from_hf_json(
            r#"{"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
                "tie_word_embeddings": false, "eos_token_id": 2}"#,
        )?;
        random_model(config, &Device::Cpu, DType::F32)
    }

    fn params(max_new_tokens: usize) -> GenerateParams {
        GenerateParams {
            max_new_tokens,
            sampling: Default::default(),
            stop_tokens: vec![],
            max_block_rows: None,
        }
    }

    /// Jobs that arrive one by one while others decode, some failing before they join.
    struct Arrivals {
        waiting: Vec<(usize, Result<Request>)>,
        tokens: HashMap<usize, Vec<u32>>,
        ended: HashMap<usize, Result<Vec<u32>, String>>,
        /// Jobs that have had a token and not ended, and the most there were at once.
        live: HashSet<usize>,
        most_live: usize,
    }

    impl Arrivals {
        /// `waiting` arrives from its end.
        fn new(waiting: Vec<(usize, Result<Request>)>) -> Self {
            Arrivals {
                waiting,
                tokens: HashMap::new(),
                ended: HashMap::new(),
                live: HashSet::new(),
                most_live: 0,
            }
        }
    }

    impl Jobs for Arrivals {
        type Job = usize;
        fn next(&mut self, _wait: bool) -> Next<usize> {
            match self.waiting.pop() {
                Some((i, Ok(r))) => Next::Job(i, r),
                Some((i, Err(e))) => {
                    self.ended.insert(i, Err(format!("{e:#}")));
                    Next::Empty
                }
                None => Next::Closed,
            }
        }
        fn token(&mut self, &mut i: &mut usize, token: u32) -> Result<()> {
            self.tokens.entry(i).or_default().push(token);
            self.live.insert(i);
            self.most_live = self.most_live.max(self.live.len());
            Ok(())
        }
        fn end(&mut self, i: usize, generation: Result<Generation>) -> Result<()> {
            self.live.remove(&i);
            self.ended
                .insert(i, generation.map(|g| g.tokens).map_err(|e| format!("{e:#}")));
            Ok(())
        }
    }

    #[test]
    fn jobs_joining_as_they_come_get_their_answers_alone() -> Result<()> {
        let model = tiny_model()?;
        let prompts: Vec<Vec<u32>> = (0..7)
            .map(|i| (0..5 + i).map(|j| (j * 3 + i) as u32 % 50 + 4).collect())
            .collect();
        let methods = [
            Method::Ar,
            Method::Pld(PldConfig::default()),
            Method::Esp(EspSpec::default()),
        ];
        let lens = |i: usize| 3 + 5 * i;
        let mut waiting: Vec<(usize, Result<Request>)> = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let request = Ok(Request {
                prompt: p.clone(),
                drafter: methods[i % 3].drafter(0)?,
                params: params(lens(i)),
            });
            waiting.push((i, request));
        }
        waiting.push((99, Err(anyhow!("no such model"))));
        waiting.reverse();
        let mut arrivals = Arrivals::new(waiting);
        run(&model, Capacity::sequences(3), &mut arrivals)?;
        assert_eq!(arrivals.most_live, 3, "never more than --parallel, and that many");
        for (i, p) in prompts.iter().enumerate() {
            let mut d = methods[i % 3].drafter(0)?;
            let alone = generate(&model, p, d.as_mut(), &params(lens(i)), &mut |_| Ok(()))?.tokens;
            assert_eq!(arrivals.ended[&i].as_ref().unwrap(), &alone, "request {i}");
            assert_eq!(arrivals.tokens[&i], alone, "request {i} streamed");
        }
        assert_eq!(arrivals.ended[&99], Err("no such model".to_string()));
        assert_eq!(arrivals.ended.len(), prompts.len() + 1);
        Ok(())
    }

    /// Four requests of 272 cache rows each on a model of context 256 (prompt 6, answer 10, a block's
    /// 256 rows), and one of 512 rows.
    fn budget_run(kv_rows: usize) -> Result<Arrivals> {
        let model = tiny_model()?;
        assert_eq!(cache_rows(256, 6, 10), 272);
        let mut waiting: Vec<(usize, Result<Request>)> = Vec::new();
        for i in 0..5 {
            let request = Request {
                prompt: (0..6).map(|j| (i * 5 + j) as u32 + 4).collect(),
                drafter: Method::Pld(PldConfig::default()).drafter(0)?,
                params: params(if i == 2 { 300 } else { 10 }),
            };
            waiting.push((i, Ok(request)));
        }
        waiting.reverse();
        let mut arrivals = Arrivals::new(waiting);
        let capacity = Capacity {
            sequences: 4,
            kv_rows: Some(kv_rows),
            prefill_chunk: Some(2),
        };
        run(&model, capacity, &mut arrivals)?;
        for i in [0, 1, 3, 4] {
            let mut d = Method::Pld(PldConfig::default()).drafter(0)?;
            let prompt: Vec<u32> = (0..6).map(|j| (i * 5 + j) as u32 + 4).collect();
            let alone = generate(&model, &prompt, d.as_mut(), &params(10), &mut |_| Ok(()))?.tokens;
            assert_eq!(arrivals.ended[&i].as_ref().unwrap(), &alone, "request {i}");
        }
        Ok(arrivals)
    }

    #[test]
    fn jobs_wait_for_room_in_the_kv_budget() -> Result<()> {
        // Room for two of the small ones, or the large one alone.
        let two = budget_run(2 * 272 + 10)?;
        assert_eq!(two.most_live, 2);
        assert!(two.ended[&2].is_ok(), "{:?}", two.ended[&2]);
        // Room for one small one: the large one can never fit.
        let one = budget_run(300)?;
        assert_eq!(one.most_live, 1);
        let refused = one.ended[&2].as_ref().unwrap_err();
        assert!(
            refused.contains("512 KV cache rows, more than the 300"),
            "{refused}"
        );
        Ok(())
    }

    /// A job whose prompt starts with an ended job's prompt and answer (a conversation's next turn)
    /// prefills only the rest, into that job's cache, and gets the answer a whole prefill gives; one
    /// that shares nothing prefills all of its prompt.
    #[test]
    fn a_next_turn_reuses_the_cache_of_the_turn_before() -> Result<()> {
        let model = tiny_model()?;
        assert!(model.row_invariant());
        let first: Vec<u32> = (4..14).collect();
        let alone = |prompt: &[u32], n: usize| -> Result<Generation> {
            generate(
                &model,
                prompt,
                Method::Ar.drafter(0)?.as_mut(),
                &params(n),
                &mut |_| Ok(()),
            )
        };
        let answer = alone(&first, 8)?.tokens;
        let mut second = first.clone();
        second.extend(&answer);
        second.extend([50, 51, 52]);
        let other: Vec<u32> = (60..75).collect();
        let requests = [(&first, 8), (&second, 12), (&other, 6)]
            .iter()
            .map(|&(p, n)| {
                Ok(Request {
                    prompt: p.clone(),
                    drafter: Method::Pld(PldConfig::default()).drafter(0)?,
                    params: params(n),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let ended = generate_all(&model, requests, 1, &mut |_, _| Ok(()))?;
        let [g1, g2, g3] = <[_; 3]>::try_from(ended).ok().expect("three generations");
        let (g1, g2, g3) = (g1?, g2?, g3?);
        assert_eq!(g1.tokens, answer);
        assert_eq!(g2.tokens, alone(&second, 12)?.tokens);
        assert_eq!(g3.tokens, alone(&other, 6)?.tokens);
        // The first turn's cache holds its prompt and its answer, the last token's keys only where a
        // draft brought it (a bonus token is never fed): only the 3 new tokens, or those and the last
        // answer token, are prefilled.
        let new = second.len() - first.len() - answer.len();
        assert!(
            (new..=new + 1).contains(&g2.stats.prefill_tokens),
            "{} prefilled",
            g2.stats.prefill_tokens
        );
        assert_eq!(g3.stats.prefill_tokens, other.len());
        Ok(())
    }

    #[test]
    fn an_error_from_end_stops_the_run_and_a_halt_ends_only_its_job() -> Result<()> {
        let model = tiny_model()?;
        let requests = |n: usize| -> Result<Vec<Request>> {
            (0..n)
                .map(|i| {
                    Ok(Request {
                        prompt: vec![4 + i as u32, 9, 11],
                        drafter: Method::Ar.drafter(0)?,
                        params: params(12),
                    })
                })
                .collect()
        };
        // Request 1 halts after 3 tokens; the others run to their length.
        let mut seen = [0usize; 3];
        let ends = generate_all(&model, requests(3)?, 3, &mut |i, _| {
            seen[i] += 1;
            if i == 1 && seen[i] == 3 {
                return Err(Halt.into());
            }
            Ok(())
        })?;
        let lens: Vec<usize> = ends.into_iter().map(|g| g.unwrap().tokens.len()).collect();
        assert_eq!(lens, [12, 3, 12]);

        struct Failing(std::vec::IntoIter<Request>, usize);
        impl Jobs for Failing {
            type Job = ();
            fn next(&mut self, _: bool) -> Next<()> {
                self.0.next().map_or(Next::Closed, |r| Next::Job((), r))
            }
            fn token(&mut self, _: &mut (), _: u32) -> Result<()> {
                Ok(())
            }
            fn end(&mut self, _: (), _: Result<Generation>) -> Result<()> {
                self.1 += 1;
                Err(anyhow!("disk full"))
            }
        }
        let mut failing = Failing(requests(4)?.into_iter(), 0);
        let e = run(&model, Capacity::sequences(2), &mut failing).unwrap_err();
        assert_eq!(e.to_string(), "disk full");
        assert_eq!(failing.1, 1, "no job ends after the error");
        Ok(())
    }
}
