//! `probespec shape-gguf`: random-weight GGUFs of a model shape in llama-quantize's mixes.
//!
//! A tiny shape (hidden 256, 8 or 16 layers) with a small byte-level BPE tokenizer written here as an HF
//! `tokenizer.json` is turned into GGUF files and read back: the metadata llama.cpp needs, each tensor's
//! type against the mix rule (the expected layers are worked out by hand from llama-quant.cpp's rule, not
//! by the code under test), the tokenizer against the same tokenizer.json read directly, and the model
//! loading and running in probespec. That llama.cpp loads the files too is checked by hand with its
//! tools (they are not part of the test setup).

mod common;

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::GgmlDType;
use probespec::model::load::{load_model, LoadOptions, ModelSource};
use probespec::model::shape_gguf::{write_random_gguf, QuantMix};
use probespec::model::ModelConfig;
use probespec::tokenizer::TextTokenizer;
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;

/// LLaMA 3's and Qwen 2/3's split regexes, as their tokenizer.json files spell them.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-2's byte-to-character map of byte-level BPE.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}

/// The family a test tokenizer imitates.
#[derive(Clone, Copy, PartialEq)]
enum Family {
    Llama3,
    Qwen3,
}

/// Writes a small byte-level BPE tokenizer (256 byte tokens, a few merges, added tokens) into `dir`;
/// returns its token count.
fn write_tokenizer(dir: &Path, family: Family) -> usize {
    let chars = byte_chars();
    let mut vocab: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let sp = chars[b' ' as usize];
    let pairs = [
        ("h", "e"),
        ("l", "l"),
        ("he", "ll"),
        ("hell", "o"),
        (&*format!("{sp}"), "w"),
        (&*format!("{sp}w"), "o"),
        ("r", "l"),
        ("rl", "d"),
        (&*format!("{sp}wo"), "rld"),
        (&*format!("{sp}"), "t"),
        (&*format!("{sp}t"), "he"),
    ]
    .map(|(a, b)| (a.to_string(), b.to_string()));
    for (a, b) in &pairs {
        vocab.push(format!("{a}{b}"));
    }
    let merges: Vec<serde_json::Value> = pairs
        .iter()
        .map(|(a, b)| match family {
            // Newer tokenizer.json files (Qwen 3's) write merges as pairs, older ones as "a b".
            Family::Qwen3 => json!([a, b]),
            Family::Llama3 => json!(format!("{a} {b}")),
        })
        .collect();
    let n = vocab.len();
    let added: Vec<(&str, bool)> = match family {
        Family::Llama3 => vec![
            ("<|begin_of_text|>", true),
            ("<|eot_id|>", true),
            ("<|reserved_0|>", false),
        ],
        Family::Qwen3 => vec![
            ("<|endoftext|>", true),
            ("<|im_start|>", true),
            ("<|im_end|>", true),
            ("<think>", false),
        ],
    };
    let added_json: Vec<serde_json::Value> = added
        .iter()
        .enumerate()
        .map(|(i, (content, special))| {
            json!({"id": n + i, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": special})
        })
        .collect();
    let vocab_json: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let regex = if family == Family::Llama3 {
        LLAMA3_SPLIT
    } else {
        QWEN2_SPLIT
    };
    let post = match family {
        Family::Llama3 => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [n],
                                                     "tokens": ["<|begin_of_text|>"]}}
        }),
        Family::Qwen3 => json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                                "use_regex": false}),
    };
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added_json,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": family == Family::Llama3, "vocab": vocab_json, "merges": merges}
    });
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
    let config = match family {
        Family::Llama3 => json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                 "chat_template": template}),
        Family::Qwen3 => json!({"bos_token": null, "eos_token": {"content": "<|im_end|>"},
                                "pad_token": "<|endoftext|>", "add_bos_token": false,
                                "chat_template": template}),
    };
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    n + added.len()
}

/// A tiny config of the family: hidden 256 (a whole K-quant block per row), `layers` layers, `vocab`
/// embedding rows.
fn tiny_config(family: Family, layers: usize, vocab: usize) -> ModelConfig {
    let c = match family {
        Family::Llama3 => json!({"model_type": "llama", "vocab_size": vocab, "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 2048, "tie_word_embeddings": false, "bos_token_id": 999,
            "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}}),
        Family::Qwen3 => json!({"model_type": "qwen3", "vocab_size": vocab, "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
            "max_position_embeddings": 1024, "tie_word_embeddings": true, "bos_token_id": 0}),
    };
    ModelConfig::from_hf_json(&c.to_string()).unwrap()
}

fn read_content(path: &Path) -> Content {
    let mut f = std::fs::File::open(path).unwrap();
    Content::read(&mut f).unwrap()
}

fn md_u32(ct: &Content, key: &str) -> u32 {
    ct.metadata
        .get(key)
        .unwrap_or_else(|| panic!("no {key}"))
        .to_u32()
        .unwrap()
}

fn md_str<'a>(ct: &'a Content, key: &str) -> &'a str {
    ct.metadata
        .get(key)
        .unwrap_or_else(|| panic!("no {key}"))
        .to_string()
        .unwrap()
}

fn types(ct: &Content) -> HashMap<String, GgmlDType> {
    ct.tensor_infos
        .iter()
        .map(|(n, i)| (n.clone(), i.ggml_dtype))
        .collect()
}

fn load(path: &Path) -> probespec::model::LoadedModel {
    let opts = LoadOptions {
        device: candle_core::Device::Cpu,
        dtype: candle_core::DType::F32,
        dequantize: false,
        activations: Default::default(),
    };
    load_model(&ModelSource::Gguf(path.to_path_buf()), &opts).unwrap()
}

/// Q4_K_M's Q6_K layers of attn_v and ffn_down, worked out by hand from `i < n/8 || i >= 7n/8 ||
/// (i - n/8) % 3 == 2`: n = 8 gives 0 (i < 1), 7 (i >= 7), 3 and 6 ((i - 1) % 3 == 2); n = 16 gives 0, 1,
/// 14, 15 and 4, 7, 10, 13.
const MORE_BITS_8: [usize; 4] = [0, 3, 6, 7];
const MORE_BITS_16: [usize; 8] = [0, 1, 4, 7, 10, 13, 14, 15];

#[test]
fn an_untied_llama_shape_in_q4_k_m_has_llama_quantizes_types_metadata_and_tokenizer() {
    let dir = common::tempdir();
    let n_tok = write_tokenizer(dir.path(), Family::Llama3);
    let config = tiny_config(Family::Llama3, 16, n_tok + 5);
    let out = dir.path().join("llama.gguf");
    write_random_gguf(&config, "tiny-llama", QuantMix::Q4KM, dir.path(), &out, 7).unwrap();
    let ct = read_content(&out);

    assert_eq!(md_str(&ct, "general.architecture"), "llama");
    assert_eq!(md_u32(&ct, "general.file_type"), 15);
    for (key, want) in [
        ("llama.block_count", 16),
        ("llama.embedding_length", 256),
        ("llama.feed_forward_length", 512),
        ("llama.attention.head_count", 4),
        ("llama.attention.head_count_kv", 2),
        ("llama.rope.dimension_count", 64),
        ("llama.context_length", 2048),
        ("llama.vocab_size", n_tok as u32 + 5),
    ] {
        assert_eq!(md_u32(&ct, key), want, "{key}");
    }
    assert_eq!(ct.metadata["llama.rope.freq_base"].to_f32().unwrap(), 500000.0);
    assert_eq!(md_str(&ct, "tokenizer.ggml.model"), "gpt2");
    assert_eq!(md_str(&ct, "tokenizer.ggml.pre"), "llama-bpe");
    assert_eq!(md_u32(&ct, "tokenizer.ggml.bos_token_id"), 267);
    assert_eq!(md_u32(&ct, "tokenizer.ggml.eos_token_id"), 268);
    assert!(ct.metadata["tokenizer.ggml.add_bos_token"].to_bool().unwrap());
    assert!(ct.metadata.contains_key("tokenizer.chat_template"));

    // 256 bytes + 11 merges are normal, two special tokens control, `<|reserved_0|>` looks special,
    // and five padding rows are unused.
    let tokens = ct.metadata["tokenizer.ggml.tokens"].to_vec().unwrap();
    let kinds: Vec<i32> = ct.metadata["tokenizer.ggml.token_type"]
        .to_vec()
        .unwrap()
        .iter()
        .map(|v| v.to_i32().unwrap())
        .collect();
    assert_eq!(tokens.len(), n_tok + 5);
    assert_eq!(kinds[..267], [1; 267]);
    assert_eq!(kinds[267..], [3, 3, 3, 5, 5, 5, 5, 5]);
    assert_eq!(
        tokens[n_tok + 2].to_string().unwrap(),
        &format!("[PAD{}]", n_tok + 2)
    );
    let merges = ct.metadata["tokenizer.ggml.merges"].to_vec().unwrap();
    assert_eq!(merges[3].to_string().unwrap(), "hell o");

    let t = types(&ct);
    assert_eq!(t["token_embd.weight"], GgmlDType::Q4K);
    assert_eq!(t["output.weight"], GgmlDType::Q6K);
    assert_eq!(t["output_norm.weight"], GgmlDType::F32);
    assert_eq!(t["rope_freqs.weight"], GgmlDType::F32);
    for i in 0..16 {
        let more = if MORE_BITS_16.contains(&i) {
            GgmlDType::Q6K
        } else {
            GgmlDType::Q4K
        };
        assert_eq!(t[&format!("blk.{i}.attn_v.weight")], more, "layer {i}");
        assert_eq!(t[&format!("blk.{i}.ffn_down.weight")], more, "layer {i}");
        for m in ["attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"] {
            assert_eq!(t[&format!("blk.{i}.{m}.weight")], GgmlDType::Q4K, "{m} {i}");
        }
        assert_eq!(t[&format!("blk.{i}.attn_norm.weight")], GgmlDType::F32);
        assert!(!t.contains_key(&format!("blk.{i}.attn_q_norm.weight")));
    }
    // LLaMA 3 scaling by 32: the fastest frequency is left alone, the slowest divided by 32.
    let mut f = std::fs::File::open(&out).unwrap();
    let factors = ct
        .tensor(&mut f, "rope_freqs.weight", &candle_core::Device::Cpu)
        .unwrap()
        .dequantize(&candle_core::Device::Cpu)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(factors.len(), 32);
    assert_eq!((factors[0], factors[31]), (1.0, 32.0));

    // probespec reads it back: the shape, and the tokenizer encoding as the tokenizer.json does.
    let loaded = load(&out);
    let c = &loaded.model.config;
    assert_eq!(
        (c.num_layers, c.hidden_size, c.head_dim, c.vocab_size),
        (16, 256, 64, n_tok + 5)
    );
    assert!(!c.tie_word_embeddings);
    let hf = TextTokenizer::from_hf_dir(dir.path()).unwrap();
    for text in [
        "hello world",
        "Hello the world!\n\n  12345 <|eot_id|> x",
        "héllo wörld 😀",
    ] {
        let ids = loaded.tokenizer.encode(text).unwrap();
        assert_eq!(ids, hf.encode(text).unwrap(), "{text:?}");
        assert_eq!(ids[0], 267, "BOS first");
        assert_eq!(loaded.tokenizer.decode(&ids).unwrap(), hf.decode(&ids).unwrap());
    }
    assert_eq!(loaded.tokenizer.encode("hello world").unwrap(), [267, 259, 264]);
}

#[test]
fn a_tied_qwen3_shape_in_each_mix_has_llama_quantizes_types_and_runs() {
    let dir = common::tempdir();
    let n_tok = write_tokenizer(dir.path(), Family::Qwen3);
    let config = tiny_config(Family::Qwen3, 8, n_tok + 3);
    for mix in [QuantMix::Q4KM, QuantMix::Q4_0, QuantMix::Q8_0] {
        let out = dir.path().join(format!("qwen3.{}.gguf", mix.name()));
        write_random_gguf(&config, "tiny-qwen3", mix, dir.path(), &out, 1).unwrap();
        let ct = read_content(&out);
        assert_eq!(md_str(&ct, "general.architecture"), "qwen3");
        assert_eq!(md_u32(&ct, "qwen3.attention.key_length"), 128);
        assert_eq!(md_u32(&ct, "qwen3.attention.value_length"), 128);
        assert_eq!(md_str(&ct, "tokenizer.ggml.pre"), "qwen2");
        assert_eq!(md_u32(&ct, "tokenizer.ggml.padding_token_id"), 267);
        assert_eq!(md_u32(&ct, "tokenizer.ggml.eos_token_id"), 269);
        // No BOS in tokenizer_config.json: the config's, and never added.
        assert_eq!(md_u32(&ct, "tokenizer.ggml.bos_token_id"), 0);
        assert!(!ct.metadata["tokenizer.ggml.add_bos_token"].to_bool().unwrap());
        let kinds: Vec<i32> = ct.metadata["tokenizer.ggml.token_type"]
            .to_vec()
            .unwrap()
            .iter()
            .map(|v| v.to_i32().unwrap())
            .collect();
        assert_eq!(kinds[267..], [3, 3, 3, 4, 5, 5, 5], "<think> is user-defined");
        assert_eq!(md_u32(&ct, "general.file_type"), [15, 2, 7][mix as usize]);

        let t = types(&ct);
        assert!(!t.contains_key("output.weight"), "tied");
        assert!(!t.contains_key("rope_freqs.weight"));
        let (embed, base) = match mix {
            QuantMix::Q4KM => (GgmlDType::Q6K, GgmlDType::Q4K),
            QuantMix::Q4_0 => (GgmlDType::Q6K, GgmlDType::Q4_0),
            QuantMix::Q8_0 => (GgmlDType::Q8_0, GgmlDType::Q8_0),
        };
        assert_eq!(t["token_embd.weight"], embed, "{mix:?}");
        for i in 0..8 {
            let more = mix == QuantMix::Q4KM && MORE_BITS_8.contains(&i);
            let v = if more { GgmlDType::Q6K } else { base };
            assert_eq!(t[&format!("blk.{i}.attn_v.weight")], v, "{mix:?} layer {i}");
            assert_eq!(t[&format!("blk.{i}.ffn_down.weight")], v, "{mix:?} layer {i}");
            assert_eq!(t[&format!("blk.{i}.attn_q.weight")], base);
            assert_eq!(t[&format!("blk.{i}.attn_q_norm.weight")], GgmlDType::F32);
            assert_eq!(t[&format!("blk.{i}.attn_k_norm.weight")], GgmlDType::F32);
        }

        let loaded = load(&out);
        let c = &loaded.model.config;
        assert_eq!((c.num_layers, c.head_dim, c.vocab_size), (8, 128, n_tok + 3));
        assert!(c.tie_word_embeddings && c.qk_norm());
        let hf = TextTokenizer::from_hf_dir(dir.path()).unwrap();
        for text in [
            "hello world",
            "<|im_start|>user\nhello the world 2024<|im_end|> <think>",
        ] {
            assert_eq!(
                loaded.tokenizer.encode(text).unwrap(),
                hf.encode(text).unwrap(),
                "{text:?}"
            );
        }
        // And it runs: a block through the model gives finite logits over the whole vocabulary.
        let m = &loaded.model;
        let mut cache = m.new_cache(16).unwrap();
        let ids = loaded.tokenizer.encode("hello world").unwrap();
        let pos: Vec<u32> = (0..ids.len() as u32).collect();
        let h = m
            .forward(
                &m.embed(&ids).unwrap(),
                &pos,
                &probespec::model::BlockMask::Causal,
                &mut cache,
            )
            .unwrap();
        let logits = m.logits(&h, &[ids.len() - 1]).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(logits[0].len(), n_tok + 3);
        assert!(logits[0].iter().all(|x| x.is_finite()));
    }
}

#[test]
fn the_same_seed_writes_the_same_file_and_another_seed_does_not() {
    let dir = common::tempdir();
    let n_tok = write_tokenizer(dir.path(), Family::Qwen3);
    let config = tiny_config(Family::Qwen3, 2, n_tok);
    let write = |name: &str, seed: u64| {
        let out = dir.path().join(name);
        write_random_gguf(&config, "tiny", QuantMix::Q8_0, dir.path(), &out, seed).unwrap();
        std::fs::read(out).unwrap()
    };
    let (a, b, c) = (write("a.gguf", 3), write("b.gguf", 3), write("c.gguf", 4));
    assert_eq!(a, b);
    assert_eq!(a.len(), c.len());
    assert_ne!(a, c);
}

#[test]
fn bad_requests_fail_with_one_line() {
    let dir = common::tempdir();
    let out = dir.path().join("x.gguf");
    let out = out.to_str().unwrap();
    let d = dir.path().to_str().unwrap();
    let run = |args: &[&str]| common::binary::probespec(&[&["shape-gguf"], args].concat());
    run(&["--shape", "gpt-9", "--tokenizer", d, "--out", out]).errors_with("unknown model shape 'gpt-9'");
    run(&[
        "--shape",
        "qwen3-0.6b",
        "--format",
        "q3_k",
        "--tokenizer",
        d,
        "--out",
        out,
    ])
    .errors_with("unknown format 'q3_k'");
    run(&["--shape", "qwen3-0.6b", "--tokenizer", d, "--out", out]).errors_with("tokenizer.json");
    // A tokenizer larger than the shape's vocabulary is refused, not truncated.
    write_tokenizer(dir.path(), Family::Qwen3);
    let big = tiny_config(Family::Qwen3, 1, 100);
    let e = write_random_gguf(
        &big,
        "t",
        QuantMix::Q8_0,
        dir.path(),
        dir.path().join("y.gguf").as_path(),
        0,
    )
    .unwrap_err();
    assert!(
        format!("{e:#}").contains("beyond the model's vocabulary of 100"),
        "{e:#}"
    );
    assert!(!Path::new(out).exists());
}

/// The real tokenizers of the published shapes (fetched by scripts/real-shapes.sh, not part of the
/// test setup): each GGUF's tokenizer encodes as its tokenizer.json does.
#[test]
#[ignore = "needs scripts/real-shapes.sh qwen3-0.6b,llama3.2-1b q8_0 first"]
fn the_real_shapes_tokenize_as_their_tokenizer_json() {
    let base = std::env::var("PROBESPEC_SHAPES_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/probespec/shapes")
        });
    for (file, family) in [
        ("qwen3-0.6b.q8_0.gguf", "qwen3"),
        ("llama3.2-1b.q8_0.gguf", "llama3_1"),
    ] {
        let path = base.join(file);
        assert!(
            path.is_file(),
            "{} missing: run scripts/real-shapes.sh qwen3-0.6b,llama3.2-1b q8_0",
            path.display()
        );
        let mut f = std::fs::File::open(&path).unwrap();
        let gguf = TextTokenizer::from_gguf(&Content::read(&mut f).unwrap().metadata).unwrap();
        let hf = TextTokenizer::from_hf_dir(&base.join("tokenizers").join(family)).unwrap();
        for text in [
            "Hello, world! The year 2024 was 365 days long.",
            "<|im_start|>user\nWhat's 12345 + 678?<|im_end|>\n<think>\n</think>",
            "  indented\n\n\tcode() { return x->y; }  ",
            "Grüße, 世界! Ελληνικά 😀👍",
        ] {
            assert_eq!(
                gguf.encode(text).unwrap(),
                hf.encode(text).unwrap(),
                "{file}: {text:?}"
            );
        }
    }
}
