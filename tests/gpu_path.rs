//! A GPU device's code path, run on the CPU in f32 in every `cargo test` (`Ops::Candle`: candle's
//! matmuls, norms, RoPE, SwiGLU, attention as two products around an f32 softmax, keys cached as rows):
//! every method token-identical to plain decoding on tiny LLaMA and Qwen 3 checkpoints, under greedy
//! decoding and under sampling with the same seed, and a conversation's turns equal to one-shot calls.
//! The whole lossless, chat and sampling suites run through the same path with `PROBESPEC_OPS=candle`
//! (scripts/gpu-check.sh --device cpu); half precision on it is tests/half.rs.

mod common;

use common::decoding::{
    all_configs, assert_acceptance_exercised, check_all, esp, greedy, hybrid, lookahead, pld, prompts, run,
};
use common::TinySpec;
use probespec::decode::generate::{generate, GenerateParams};
use probespec::decode::method::{EspTree, Method};
use probespec::decode::sampling::SamplingParams;
use probespec::model::Ops;

#[test]
fn gpu_code_path_in_f32_every_method_is_lossless() {
    for (spec, seed) in [(TinySpec::llama(), 21), (TinySpec::qwen3(), 22)] {
        let (_d, m) = common::load_tiny(&spec);
        let m = m.with_ops(Ops::Candle).unwrap();
        let pooled = check_all(&m, &prompts(4, 1..48, seed), &all_configs(), &greedy(32, vec![]));
        assert_acceptance_exercised(&pooled);
    }
}

#[test]
fn gpu_code_path_in_f32_same_seed_same_tokens_under_sampling() {
    let mut spec = TinySpec::llama();
    spec.scale = 0.5;
    let (_d, m) = common::load_tiny(&spec);
    let m = m.with_ops(Ops::Candle).unwrap();
    let methods = [
        esp(30, 1, EspTree::Dynamic),
        pld(3, 10),
        lookahead(7, 5, 7),
        hybrid(30, 1),
    ];
    let mut accepted = 0;
    for (i, prompt) in prompts(3, 8..24, 26).iter().enumerate() {
        for seed in 0..4 {
            let params = GenerateParams {
                max_new_tokens: 24,
                sampling: SamplingParams {
                    temperature: 0.8,
                    top_p: 0.9,
                    top_k: 0,
                    seed: seed + 100 * i as u64,
                },
                stop_tokens: vec![],
                max_block_rows: None,
            };
            let want = run(&m, prompt, &Method::Ar, &params);
            for method in &methods {
                let got = run(&m, prompt, method, &params);
                assert_eq!(got.tokens, want.tokens, "seed {seed}, {method:?}");
                accepted += got.stats.committed_by_calls() - got.stats.model_calls;
            }
        }
    }
    assert!(
        accepted >= 10,
        "only {accepted} drafts accepted: sampling not exercised"
    );
}

#[test]
fn gpu_code_path_in_f32_conversation_turns_match_one_shot_calls() {
    use probespec::conversation::Conversation;
    use probespec::model::load::{load_model, LoadOptions, ModelSource};
    use probespec::tokenizer::Message;
    let dir = common::tempdir();
    TinySpec::qwen3().write_hf(dir.path());
    let opts = LoadOptions {
        device: common::test_device(),
        dtype: candle_core::DType::F32,
        dequantize: false,
        activations: Default::default(),
    };
    let loaded = load_model(&ModelSource::HfDir(dir.path().to_path_buf()), &opts).unwrap();
    let (model, tok) = (loaded.model.with_ops(Ops::Candle).unwrap(), &loaded.tokenizer);
    let params = greedy(12, tok.stop_tokens().to_vec());
    let mut chat = Conversation::new(&model, tok, None).unwrap();
    for user in ["w10 w11 w12", "w20 w21", "w30 w31 w32"] {
        let mut d = hybrid(10, 1).drafter(1).unwrap();
        let turn = chat.turn(user, d.as_mut(), &params, &mut |_| Ok(())).unwrap();
        let messages: Vec<Message> = chat.messages()[..chat.messages().len() - 1].to_vec();
        let prompt = tok
            .encode(&tok.apply_chat_template(&messages, true).unwrap())
            .unwrap();
        let mut d = hybrid(10, 1).drafter(1).unwrap();
        let fresh = generate(&model, &prompt, d.as_mut(), &params, &mut |_| Ok(())).unwrap();
        assert_eq!(turn.generation.tokens, fresh.tokens, "turn {user}");
    }
}
