//! Drafter-specific behaviour: the method flags parse into the library's [`Method`] and bad values are
//! refused, drafts larger than the KV cache's margin stay lossless, and merging draft sources in the hybrid
//! drafter keeps what each source finds alone. (That every method is token-identical to plain decoding in
//! every configuration and at the edges is tests/lossless.rs.)

mod common;

use common::decoding::{
    check_all, esp, greedy, hybrid, hybrid_auto, lookahead, lookahead_auto, pld, pld_auto, prompts, tau,
};
use common::TinySpec;
use probespec::decode::method::{
    Budget, EspTree, HybridSpec, LookaheadConfig, Masks, Method, MethodKind, PldConfig,
};
use probespec::flags::{MethodArg, MethodArgs};

/// Lookahead windows and prompt-lookup chains longer than the KV cache's margin over the prompt and
/// --max-new-tokens (256 rows), up to the flags' bounds: the prefill's probe rows fit the cache, and the
/// output is plain decoding's.
#[test]
fn drafts_larger_than_the_cache_margin() {
    let (_d, model) = common::load_tiny(&TinySpec::llama());
    let configs = [
        lookahead(300, 5, 7),
        lookahead(1024, 1024, 1024),
        pld(1024, 1024),
        hybrid(1024, 1),
    ];
    let ps = prompts(3, 2..30, 27);
    for max_new in [1, 3, 40] {
        check_all(&model, &ps, &configs, &greedy(max_new, vec![]));
    }
}

#[test]
fn hybrid_beats_its_parents_on_repetitive_text() {
    // Not a benchmark: a sanity check that merging sources does not lose what each source finds alone.
    let (_d, model) = common::load_tiny(&TinySpec::llama());
    let ps = prompts(9, 8..48, 25);
    let configs = [pld(3, 10), esp(30, 1, EspTree::Dynamic), hybrid(30, 1)];
    let params = greedy(48, vec![]);
    let mut taus = Vec::new();
    for m in &configs {
        let p = check_all(&model, &ps, std::slice::from_ref(m), &params);
        taus.push(tau(&p, m.kind()));
    }
    eprintln!("tau pld {:.3} esp {:.3} hybrid {:.3}", taus[0], taus[1], taus[2]);
    let best_parent = taus[0].max(taus[1]);
    assert!(
        taus[2] >= 0.95 * best_parent,
        "hybrid {:.3} vs best parent {best_parent:.3}",
        taus[2]
    );
}

/// The method flags, parsed by clap as the binary parses them, give the library's [`Method`]; bad values
/// (zero, too small, beyond the flags' bounds) are refused by the method's validation.
#[test]
fn method_flags_parse_and_bad_values_fail() {
    use clap::Parser;
    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        m: MethodArgs,
    }
    let t = T::parse_from([
        "t",
        "--method",
        "lookahead",
        "--lookahead-window",
        "4",
        "--lookahead-ngram",
        "3",
        "--lookahead-guesses",
        "1",
    ]);
    assert_eq!(
        (
            t.m.method,
            t.m.lookahead_window,
            t.m.lookahead_ngram,
            t.m.lookahead_guesses
        ),
        (MethodArg::Lookahead, Some(4), 3, 1)
    );
    assert_eq!(t.m.method().unwrap(), lookahead(4, 3, 1));
    // The flags' defaults, and the library's: the same.
    let d = T::parse_from(["t"]).m;
    assert_eq!(
        (
            d.ngram,
            d.draft_len,
            d.lookahead_window,
            d.lookahead_ngram,
            d.lookahead_guesses
        ),
        (3, None, None, 5, 7)
    );
    assert_eq!(d.method().unwrap(), Method::default());
    assert_eq!(
        T::parse_from(["t", "--method", "pld"]).m.method().unwrap(),
        Method::Pld(PldConfig::default())
    );
    assert_eq!(
        T::parse_from(["t", "--method", "lookahead"]).m.method().unwrap(),
        Method::Lookahead(LookaheadConfig::default())
    );
    let t = T::parse_from(["t", "--method", "pld", "--ngram", "2", "--draft-len", "5"]);
    assert_eq!(
        (t.m.method, t.m.ngram, t.m.draft_len),
        (MethodArg::Pld, 2, Some(5))
    );
    assert_eq!(t.m.method().unwrap(), pld(2, 5));
    // Left out, the chain length and the window are chosen per step under --bc auto (the default) and
    // take their classic values under a fixed --bc.
    assert_eq!(
        T::parse_from(["t", "--method", "pld"]).m.method().unwrap(),
        pld_auto(3)
    );
    assert_eq!(
        T::parse_from(["t", "--method", "pld", "--bc", "30"])
            .m
            .method()
            .unwrap(),
        pld(3, 10)
    );
    assert_eq!(
        T::parse_from(["t", "--method", "lookahead"]).m.method().unwrap(),
        lookahead_auto(5, 7)
    );
    assert_eq!(
        T::parse_from(["t", "--method", "lookahead", "--bc", "30"])
            .m
            .method()
            .unwrap(),
        lookahead(7, 5, 7)
    );
    assert_eq!(
        T::parse_from(["t", "--method", "hybrid"]).m.method().unwrap(),
        hybrid_auto(1)
    );
    let t = T::parse_from(["t", "--method", "hybrid", "--bc", "60", "--masks", "2"]);
    assert_eq!(
        (t.m.method, t.m.bc, t.m.masks),
        (MethodArg::Hybrid, Budget::Fixed(60), 2)
    );
    assert_eq!(t.m.method().unwrap(), hybrid(60, 2));
    assert_eq!(t.m.method().unwrap().kind(), MethodKind::Hybrid);
    // Hybrid has one mode now: the flag that chose between two is gone.
    assert!(T::try_parse_from(["t", "--method", "hybrid", "--hybrid-mode", "simple"]).is_err());
    let t = T::parse_from([
        "t",
        "--method",
        "esp",
        "--bc",
        "60",
        "--masks",
        "2",
        "--branches",
        "15,4",
    ]);
    assert_eq!(
        t.m.method().unwrap(),
        esp(60, 2, EspTree::Static(Some(vec![15, 4])))
    );
    assert_eq!(
        T::parse_from(["t", "--method", "esp", "--tree", "static", "--bc", "30"])
            .m
            .method()
            .unwrap(),
        esp(30, 1, EspTree::Static(None))
    );
    for bad in [
        pld(0, 10),
        pld(3, 0),
        lookahead(0, 5, 7),
        lookahead(7, 1, 7),
        lookahead(7, 5, 0),
        hybrid(3, 1),
        hybrid(30, 4),
        // Sizes beyond any use (they would only allocate): bounded.
        pld(1025, 10),
        pld(3, 1 << 40),
        lookahead(1 << 40, 5, 7),
        lookahead(7, 1025, 7),
        lookahead(7, 5, 1 << 40),
        hybrid(1025, 1),
        Method::Hybrid(HybridSpec {
            masks: Masks::default(),
            budget: Budget::Fixed(30),
            lookup: PldConfig {
                max_ngram: 3,
                draft_len: Some(1025),
            },
        }),
    ] {
        assert!(bad.validate().is_err(), "{bad:?} should be rejected");
        assert!(bad.drafter(0).is_err(), "{bad:?} should be rejected");
    }
}

/// `--bc auto` for every method: with a flat cost curve (rows nearly free, as on a GPU) every method sends
/// blocks of more than one row on most steps; with a steep one (every row costs as much as a whole
/// one-row step) it decodes plainly but for its exploring steps. Either way the output is plain
/// decoding's. The curves are injected: nothing is timed.
#[test]
fn auto_builds_trees_when_the_curve_is_flat_and_decodes_plainly_when_it_is_steep() {
    use probespec::decode::cost_cache::inject;
    use probespec::decode::cost_curve::CostCurve;
    use probespec::decode::stats::blocks_line;
    // A tiny model and a prompt whose greedy answer repeats itself (one token, over and over): prompt
    // lookup and the n-gram pool find a draft on nearly every step.
    let (_d, model) = common::load_tiny(&TinySpec {
        seed: 2,
        ..TinySpec::llama()
    });
    let prompt: Vec<u32> = [18u32, 42, 99, 7, 150, 63]
        .iter()
        .copied()
        .cycle()
        .take(30)
        .collect();
    let params = greedy(64, vec![]);
    let want = common::decoding::run(&model, &prompt, &Method::Ar, &params);
    let fixed = common::decoding::run(&model, &prompt, &pld(3, 10), &params);
    assert!(
        fixed.stats.plain_share <= 0.2,
        "the answer is no longer repetitive (pld finds no draft on {:.0}% of the steps): pick another prompt",
        100.0 * fixed.stats.plain_share
    );
    let methods = [
        common::decoding::esp_auto(1),
        pld_auto(3),
        lookahead_auto(5, 7),
        hybrid_auto(1),
    ];
    let flat = CostCurve::from_fn(|_, rows| 1e-2 * (1.0 + 1e-3 * rows as f64), 1e-5);
    let steep = CostCurve::from_fn(|_, rows| 1e-2 * rows as f64, 1e-3);
    for (curve, is_flat) in [(flat, true), (steep, false)] {
        inject(&model, curve);
        for m in &methods {
            let g = common::decoding::run(&model, &prompt, m, &params);
            assert_eq!(g.tokens, want.tokens, "{m:?}");
            let s = &g.stats;
            eprintln!(
                "{} {}: tau {:.2}, {}",
                if is_flat { "flat" } else { "steep" },
                s.method,
                s.tau,
                blocks_line(&s.block_histogram)
            );
            let steps: usize = s.block_histogram.iter().sum();
            assert_eq!(steps, s.model_calls);
            if is_flat {
                // ESP's masks on random weights are right on about 2% of the steps, which is the margin an
                // offer must beat plain decoding by: its trees hover at the margin, and some steps are plain.
                let most_plain = if s.method == MethodKind::Esp { 0.35 } else { 0.2 };
                assert!(
                    s.plain_share <= most_plain,
                    "{}: a flat curve must build blocks: {}",
                    s.method,
                    blocks_line(&s.block_histogram)
                );
                assert!(s.tau > 1.0, "{}: tau {}", s.method, s.tau);
            } else {
                assert!(
                    s.plain_share >= 0.8,
                    "{}: a steep curve must decode plainly: {}",
                    s.method,
                    blocks_line(&s.block_histogram)
                );
                // The steps that are not plain are the explorations: small blocks ...
                let big: usize = s.block_histogram.iter().skip(4).sum();
                assert_eq!(big, 0, "{}: {}", s.method, blocks_line(&s.block_histogram));
                // ... and what they cost beyond plain steps, priced by the curve (every row a plain
                // step), stays under 2% of a 64-token answer: not one extra row.
                let extra_rows: usize = s
                    .block_histogram
                    .iter()
                    .enumerate()
                    .map(|(rows, n)| rows.saturating_sub(1) * n)
                    .sum();
                assert!(
                    (extra_rows as f64) < 0.02 * steps as f64,
                    "{}: {extra_rows} rows beyond plain steps over {steps} steps: {}",
                    s.method,
                    blocks_line(&s.block_histogram)
                );
            }
            // ESP's prefill carries its mask rows, lookahead's its window, only where they would pay.
            use probespec::decode::method::MethodKind;
            let probes = m.drafter(0).unwrap().begin(&model, &prompt).unwrap();
            match m.kind() {
                MethodKind::Esp => assert_eq!(probes, usize::from(is_flat), "{m:?}"),
                MethodKind::Lookahead => assert_eq!(probes > 0, is_flat, "{m:?}: {probes}"),
                _ => {}
            }
        }
    }
}
