//! Unit tests of the `--bc auto` chooser (kept apart to hold `auto.rs` to its job).

use super::*;

/// A chooser whose request has already taken a long time: the loss budget never binds, only the pricing
/// decides.
fn chooser(f: impl Fn(usize, usize) -> f64) -> Chooser {
    fresh(f).with_time_spent(1e9)
}

/// A chooser at the start of a request.
fn fresh(f: impl Fn(usize, usize) -> f64) -> Chooser {
    Chooser::new(Arc::new(CostCurve::from_fn(f, 0.0)))
}

/// A step that commits `committed` (drafts then the bonus token) with no measured time: the curve's
/// price counts.
fn step(committed: &'static [u32]) -> Step<'static> {
    Step {
        accepted: &[1, 2, 3, 4, 5, 6, 7, 8][..committed.len() - 1],
        committed,
        probe_logits: &[],
        replaced: false,
        seconds: 0.0,
        remaining: 64,
    }
}

fn chain(q: f64, n: usize) -> Vec<Offer> {
    let scores: Vec<f64> = (1..=n).map(|d| q.powi(d as i32)).collect();
    prefix_offers(&scores, |m| 1 + m)
}

#[test]
fn flat_cost_takes_the_largest_block_and_steep_cost_decodes_plainly() {
    let mut flat = chooser(|_, r| 1.0 + 1e-4 * r as f64);
    assert_eq!(flat.choose(100, &chain(0.5, 10)), Choice::Offer(9));
    // Blocks of 3 rows and more cost their rows, the 2-row exploring block no more than one row:
    // nothing on offer pays, and exploring is free.
    let mut steep = chooser(|_, r| if r <= 2 { 1.0 } else { r as f64 });
    let offers = prefix_offers(&[0.9, 0.81, 0.73, 0.66], |m| 2 + m);
    let picks: Vec<Choice> = (0..EXPLORE_EVERY + 2 * EXPLORE_EVERY + 4 * EXPLORE_EVERY)
        .map(|_| steep.choose(100, &offers))
        .collect();
    // Explorations after 8, then 16, then 32 plain steps.
    let explores: Vec<usize> = (0..picks.len())
        .filter(|&i| picks[i] == Choice::Explore)
        .collect();
    assert_eq!(
        explores,
        [EXPLORE_EVERY - 1, 3 * EXPLORE_EVERY - 1, 7 * EXPLORE_EVERY - 1],
        "{picks:?}"
    );
    assert!(picks
        .iter()
        .all(|&c| matches!(c, Choice::Plain | Choice::Explore)));
    // Nothing on offer: plain, and no exploration is owed.
    assert_eq!(steep.choose(100, &[]), Choice::Plain);
}

/// `n` steps, each recorded as committing one token; the indices of the explorations among them.
fn explorations(c: &mut Chooser, offers: &[Offer], n: usize) -> Vec<usize> {
    (0..n)
        .filter(|_| {
            let explored = c.choose(100, offers) == Choice::Explore;
            c.record(&step(&[1]));
            explored
        })
        .collect()
}

#[test]
fn exploring_stays_within_its_budget() {
    // Every row costs as much as the first: an exploring block of 2 rows costs a whole plain step
    // more, and a 64-step answer cannot afford one (1% of 64 steps is 0.64 of a step).
    let never_pays = [Offer { rows: 4, tokens: 1.3 }];
    let mut c = fresh(|_, r| r as f64);
    assert_eq!(explorations(&mut c, &never_pays, 64), Vec::<usize>::new());
    // Over a long answer it explores, and never past the budget.
    let seen = explorations(&mut c, &never_pays, 2000);
    assert!(!seen.is_empty());
    let (explored, spent) = c.exploration_cost();
    assert!(explored <= EXPLORE_SHARE * spent + 1e-9, "{explored} of {spent}");
    assert!(explored > 0.5 * EXPLORE_SHARE * spent, "{explored} of {spent}");
    // What they lost is what they cost: nothing was accepted.
    assert!((c.losses_and_gains().0 - explored).abs() < 1e-9);
    // A larger exploring block is priced as such: 4 rows cost 3 steps more, so it waits 3 times as
    // long for its first exploration.
    let first = |rows: usize| {
        let mut c = fresh(|_, r| r as f64).exploring_with(rows);
        explorations(&mut c, &never_pays, 1000)[0]
    };
    let (two, four) = (first(2), first(4));
    assert!((98..=101).contains(&two), "{two}");
    assert!((298..=301).contains(&four), "{four}");
}

#[test]
fn explorations_are_charged_the_time_they_took() {
    // The curve prices the 2-row exploring block as a plain step, but each one takes two: within the
    // 1% budget, about one exploration per hundred plain steps, where the price alone would send one
    // every 64 steps.
    let never_pays = [Offer { rows: 4, tokens: 1.3 }];
    let timed = |committed: &'static [u32], seconds: f64| Step {
        seconds,
        ..step(committed)
    };
    let run = |exploring_takes: f64| {
        let mut c = fresh(|_, r| if r <= 2 { 1.0 } else { r as f64 });
        let mut explored = 0;
        for _ in 0..2000 {
            let explore = c.choose(100, &never_pays) == Choice::Explore;
            explored += explore as usize;
            c.record(&timed(&[1], if explore { exploring_takes } else { 1.0 }));
        }
        (explored, c.exploration_cost())
    };
    let (free, _) = run(1.0);
    let (dear, (charged, spent)) = run(2.0);
    assert!(free >= 30, "{free}");
    assert!((15..=21).contains(&dear), "{dear} explorations");
    assert!(charged <= EXPLORE_SHARE * spent + 1.0, "{charged} of {spent}");
}

#[test]
fn time_saved_pays_for_more_exploring() {
    // Blocks of r rows cost 1 + (r - 1) / 2 plain steps; the exploring block is 4 rows, 1.5 steps more.
    let curve = |_: usize, r: usize| if r == 1 { 1.0 } else { 1.0 + 0.5 * (r as f64 - 1.0) };
    let pays = [Offer { rows: 2, tokens: 1.9 }];
    let never_pays = [Offer { rows: 2, tokens: 1.2 }];
    // Both start after a prefill of 50 steps' time: 1% of it affords a first 2-row block.
    let start = || fresh(curve).exploring_with(4).with_time_spent(50.0);
    let mut lucky = start();
    // Ten 2-row steps that commit 2 tokens each save half a step each: 5 steps gained.
    for _ in 0..10 {
        assert_eq!(lucky.choose(100, &pays), Choice::Offer(0));
        lucky.record(&step(&[5, 6]));
    }
    assert_eq!(lucky.losses_and_gains(), (0.0, 5.0));
    // A quarter of that pays for the first exploration as soon as 8 plain steps have passed; without
    // the gains, 1% of the 68 steps' time pays for none.
    let mut unlucky = start();
    for _ in 0..10 {
        unlucky.choose(100, &[]);
        unlucky.record(&step(&[5]));
    }
    assert_eq!(explorations(&mut lucky, &never_pays, 8), [7]);
    assert_eq!(explorations(&mut unlucky, &never_pays, 8), Vec::<usize>::new());
    // What only speculation would use is not paid for when nothing beats plain decoding.
    assert!(lucky.would_speculate(100, &pays));
    assert!(!lucky.would_speculate(100, &never_pays));
}

/// Blocks the drafter's model expects to pay are trusted to it for a few failures in a row, then sent
/// only within 1% of the time so far plus what speculation gained: drafts that keep failing stop
/// whatever the model says, and the loss stays about 1% of the time (and a few blocks).
#[test]
fn failing_drafts_stop_within_the_loss_budget() {
    // 2 rows cost 1.03 plain steps; the model promises 0.3 drafted tokens a block (a rate of 1.26x), as
    // a lookahead window's rows do: a small promise, which the calibration corrects slowly.
    let extra = 0.03;
    let curve = move |_: usize, r: usize| 1.0 + extra * (r as f64 - 1.0);
    let offer = [Offer { rows: 2, tokens: 1.3 }];
    // A fresh request sends its first blocks (nothing is lost yet) ...
    let mut c = fresh(curve);
    for i in 0..TRUSTED_FAILURES {
        assert_eq!(c.choose(100, &offer), Choice::Offer(0), "block {i}");
        c.record(&step(&[5]));
    }
    let (lost, gained) = c.losses_and_gains();
    assert!(
        (lost - extra * TRUSTED_FAILURES as f64).abs() < 1e-9 && gained == 0.0,
        "{lost} {gained}"
    );
    // ... and after that many failed, none until 1% of the time covers the loss and one more (27 steps'
    // time, about 19 steps on).
    for i in 0..15 {
        assert_ne!(c.choose(100, &offer), Choice::Offer(0), "step {i}");
        c.record(&step(&[5]));
    }
    // Every block commits nothing: the loss stays within 1% of the time and the trusted blocks.
    let trusted = extra * TRUSTED_FAILURES as f64;
    let mut c = fresh(curve).with_time_spent(100.0);
    let mut sent = 0;
    for _ in 0..1000 {
        let choice = c.choose(100, &offer);
        sent += usize::from(choice == Choice::Offer(0));
        c.record(&step(&[5]));
        let (lost, _) = c.losses_and_gains();
        assert!(lost <= EXPLORE_SHARE * c.exploration_cost().1 + trusted + 1e-9);
    }
    let (lost, gained) = c.losses_and_gains();
    let (_, spent) = c.exploration_cost();
    assert_eq!(gained, 0.0);
    assert!(
        lost <= EXPLORE_SHARE * spent + trusted + 1e-9,
        "lost {lost} of {spent}"
    );
    // The budget grows with the time: a few blocks more over the 1000 steps, never a run of them.
    assert!((TRUSTED_FAILURES..=30).contains(&sent), "{sent} blocks sent");
    // Drafts that pay keep being sent from the first one.
    let mut c = fresh(curve);
    for _ in 0..100 {
        assert_eq!(c.choose(100, &offer), Choice::Offer(0));
        c.record(&step(&[5, 6]));
    }
    assert!(c.losses_and_gains().1 > 70.0);
    // A block that commits a draft ends a run of failures: the next ones are trusted again.
    let mut c = fresh(curve);
    for _ in 0..3 {
        for _ in 0..TRUSTED_FAILURES - 1 {
            assert_eq!(c.choose(100, &offer), Choice::Offer(0));
            c.record(&step(&[5]));
        }
        assert_eq!(c.choose(100, &offer), Choice::Offer(0));
        c.record(&step(&[5, 6]));
    }
}

/// The prefill's seconds (a step no choice priced) count as time spent, so after a long prompt a run of
/// failed blocks does not stop the next.
#[test]
fn the_prefill_counts_as_time_spent() {
    let curve = |_: usize, r: usize| 1.0 + 0.03 * (r as f64 - 1.0);
    let offer = [Offer { rows: 2, tokens: 1.3 }];
    let after_prefill = |seconds: f64| {
        let mut c = fresh(curve);
        c.record(&Step {
            seconds,
            ..step(&[5])
        });
        assert_eq!(c.exploration_cost().1, seconds);
        for _ in 0..TRUSTED_FAILURES {
            assert_eq!(c.choose(100, &offer), Choice::Offer(0));
            c.record(&step(&[5]));
        }
        c.choose(100, &offer)
    };
    assert_eq!(after_prefill(100.0), Choice::Offer(0));
    assert_eq!(after_prefill(1.0), Choice::Plain);
}

#[test]
fn offers_that_overpromise_are_discounted() {
    // Each row adds 10%: a chain the drafter believes in (q = 0.9) pays ...
    let mut c = chooser(|_, r| 1.0 + 0.1 * (r as f64 - 1.0));
    assert!(matches!(c.choose(64, &chain(0.9, 8)), Choice::Offer(_)));
    // ... until the verifier keeps rejecting it: the calibration falls and plain decoding wins.
    let rejected = Step {
        accepted: &[],
        committed: &[7],
        probe_logits: &[],
        replaced: false,
        seconds: 0.0,
        remaining: 64,
    };
    for _ in 0..20 {
        if let Choice::Offer(_) = c.choose(64, &chain(0.9, 8)) {
            c.record(&rejected);
        }
    }
    assert!(c.calibration() < 0.2, "{}", c.calibration());
    assert_ne!(c.choose(64, &chain(0.9, 8)), Choice::Offer(7));
    // A step that was not verified as drafted teaches nothing.
    let before = c.calibration();
    c.record(&Step {
        replaced: true,
        ..rejected
    });
    assert_eq!(c.calibration(), before);
}

/// A curve that prices 4 rows as cheap as one (a noisy timing) makes an offer look worth it that is
/// not: the steps' measured seconds (a 4-row block takes 2.5 plain steps here) turn the choice back to
/// plain decoding after a few blocks; where the steps take what the curve says, the offer is kept.
/// Every block commits what it promised, so the acceptance calibration stays at 1 and only the cost
/// decides.
#[test]
fn measured_step_times_correct_a_curve_that_prices_blocks_too_cheap() {
    let offer = [Offer { rows: 4, tokens: 2.0 }];
    let step = |committed: &'static [u32], seconds: f64| Step {
        accepted: &[1][..committed.len() - 1],
        committed,
        probe_logits: &[],
        replaced: false,
        seconds,
        remaining: 64,
    };
    let mut c = chooser(|_, _| 1.0);
    let mut blocks = 0;
    for _ in 0..60 {
        match c.choose(64, &offer) {
            Choice::Offer(_) => {
                blocks += 1;
                c.record(&step(&[5, 6], 2.5));
            }
            _ => c.record(&step(&[5], 1.0)),
        }
    }
    assert!(
        (3..=8).contains(&blocks),
        "{blocks} blocks sent at a measured loss"
    );
    assert!(c.cost_factor(4) > 1.8, "{}", c.cost_factor(4));
    assert!((c.cost_factor(1) - 1.0).abs() < 1e-9);
    let mut c = chooser(|_, _| 1.0);
    for _ in 0..60 {
        assert_eq!(c.choose(64, &offer), Choice::Offer(0));
        c.record(&step(&[5, 6], 1.0));
    }
}

#[test]
fn each_block_size_is_calibrated_on_its_own() {
    assert_eq!(
        [2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 1000].map(size_class),
        [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    );
    let mut c = chooser(|_, r| 1.0 + 0.1 * (r as f64 - 1.0));
    let step = |committed: &'static [u32]| Step {
        accepted: &[],
        committed,
        probe_logits: &[],
        replaced: false,
        seconds: 0.0,
        remaining: 64,
    };
    // Large blocks promise 4 drafted tokens and commit 1; small ones promise 1 and commit 1.
    let large = [Offer { rows: 8, tokens: 5.0 }];
    let small = [Offer { rows: 2, tokens: 2.0 }];
    for _ in 0..30 {
        assert_eq!(c.choose(64, &large), Choice::Offer(0));
        c.record(&step(&[1, 2]));
        assert_eq!(c.choose(64, &small), Choice::Offer(0));
        c.record(&step(&[1, 2]));
    }
    // Overall (4 + 60) / (4 + 150); each class (accepted + 4 at that ratio) / (promised + 4):
    // 30 of 120 and 30 of 30.
    let overall = 64.0 / 154.0;
    assert!((c.calibration() - overall).abs() < 1e-9);
    let want = |acc: f64, prom: f64| (acc + 4.0 * overall) / (prom + 4.0);
    assert!((c.calibration_at(8) - want(30.0, 120.0)).abs() < 1e-9);
    assert!((c.calibration_at(2) - want(30.0, 30.0)).abs() < 1e-9);
    assert!(c.calibration_at(8) < 0.3 && c.calibration_at(2) > 0.9);
    // An untried class starts from the overall ratio.
    assert!((c.calibration_at(20) - overall).abs() < 1e-9);
    // So the small block now wins against the large one.
    assert_eq!(c.choose(64, &[large[0], small[0]]), Choice::Offer(1));
}

#[test]
fn acceptance_and_cache_length_move_the_choice() {
    // Each row adds 10% at a short cache, 40% at a long one (a model whose attention dominates).
    let mut c = chooser(|ctx, r| 1.0 + (r as f64 - 1.0) * if ctx < 512 { 0.1 } else { 0.4 });
    // A good chain pays in full at a short cache; a poor one only for a token or two.
    assert_eq!(c.choose(64, &chain(0.95, 8)), Choice::Offer(7));
    let poor = c.choose(64, &chain(0.3, 8));
    assert!(matches!(poor, Choice::Offer(0) | Choice::Offer(1)), "{poor:?}");
    // At a long cache the same poor chain no longer pays.
    assert_eq!(c.choose(1024, &chain(0.3, 8)), Choice::Plain);
}

#[test]
fn best_nodes_form_trees_and_tried_nodes_are_counted() {
    // root -> 1 (0.9) -> 3 (0.5); root -> 2 (0.5) -> 4 (0.45)
    let mut t = TokenTree::new(0);
    let a = t.push(0, 10);
    let b = t.push(0, 20);
    t.push(a, 30);
    t.push(b, 40);
    let score = [1.0, 0.9, 0.5, 0.5, 0.45];
    let order = best_first(&t, &score);
    assert_eq!(order, vec![1, 2, 3, 4]);
    let (sub, from) = subtree(&t, &[1, 3]);
    assert_eq!(sub.tokens(), &[0, 10, 30]);
    assert_eq!(from, vec![0, 1, 3]);
    // Accepted 1: nodes 1, 2 (children of the root) and 3 (child of 1) were tried, 4 was not.
    assert_eq!(tried_nodes(&t, &[1]), vec![(1, true), (2, false), (3, false)]);
}

#[test]
fn rates_count_from_their_prior() {
    let mut r = Rate::default();
    assert_eq!(r.get(), 0.5);
    r.record(true);
    r.record(true);
    assert_eq!(r.get(), 0.75);
    r.record(false);
    assert_eq!(r.proposed, 5.0);
    // 2 of 3 seen; prior 0.9 instead of 0.5: (2 + 1.8) / 5.
    assert!((r.toward(0.9) - 0.76).abs() < 1e-12);
    // Depth 1 always accepted (9 of 10 with the prior), depth 2 untried: it inherits depth 1's rate;
    // depth 3 seen rejected twice: shrunk towards depth 2's.
    let seen = |d| match d {
        1 => Some(Rate {
            accepted: 9.0,
            proposed: 10.0,
        }),
        3 => Some(Rate {
            accepted: 1.0,
            proposed: 4.0,
        }),
        _ => None,
    };
    let r = chain_rates(4, seen);
    assert_eq!(r[0], 0.9);
    assert_eq!(r[1], 0.9);
    assert!((r[2] - 0.45).abs() < 1e-12);
    assert_eq!(r[3], r[2]);
}

#[test]
fn a_block_is_never_priced_below_a_plain_step() {
    // The curve prices 2 rows at 1.05 plain steps, and the 2-row steps are timed at 0.9 of that (plain
    // steps at the curve's price): corrected alone, they would cost 0.95 of a plain step.
    let mut c = fresh(|_, r| if r == 1 { 1.0 } else { 1.05 }).with_time_spent(100.0);
    let timed = |committed: &'static [u32], seconds: f64| Step {
        seconds,
        ..step(committed)
    };
    for _ in 0..30 {
        assert_eq!(c.choose(64, &[Offer { rows: 2, tokens: 1.5 }]), Choice::Offer(0));
        c.record(&timed(&[5], 0.9 * 1.05));
    }
    assert!(c.cost_factor(2) < 0.95, "{}", c.cost_factor(2));
    // Thirty blocks that committed nothing gained nothing.
    assert_eq!(c.losses_and_gains().1, 0.0);
}

#[test]
fn an_offer_must_beat_plain_decoding_by_the_margin() {
    let mut c = chooser(|_, _| 1.0);
    let edge = |share: f64| {
        [Offer {
            rows: 2,
            tokens: 1.0 + share,
        }]
    };
    assert_eq!(c.choose(64, &edge(0.5 * OFFER_MARGIN)), Choice::Plain);
    assert!(!c.would_speculate(64, &edge(0.5 * OFFER_MARGIN)));
    assert_eq!(c.choose(64, &edge(1.5 * OFFER_MARGIN)), Choice::Offer(0));
    assert!(c.would_speculate(64, &edge(1.5 * OFFER_MARGIN)));
}

/// Beside 7 other sequences a block is priced by what it costs the whole step: an offer that pays alone
/// (2 tokens in 4 rows, each row 10% of a plain step) does not pay where each extra row slows 8
/// sequences, and one that commits 7 tokens in 4 rows still does; alone again, the first pays again.
#[test]
fn beside_other_sequences_a_block_pays_only_by_the_whole_steps_tokens() {
    // A step of r rows costs 1 + 0.1 (r - 1).
    let linear = |_: usize, r: usize| 1.0 + 0.1 * (r as f64 - 1.0);
    let pays_alone = [Offer { rows: 4, tokens: 2.0 }];
    let pays_anyway = [Offer { rows: 4, tokens: 7.0 }];
    let mut alone = chooser(linear);
    assert_eq!(alone.choose(100, &pays_alone), Choice::Offer(0));
    let mut batched = chooser(linear);
    batched.beside(Beside {
        rows: 7,
        sequences: 7,
    });
    // 7 + 2 tokens in a step of 11 rows (2.0) against 8 in one of 8 (1.7): 4.5 against 4.7 a second.
    // Priced alone the block would win (2 / 1.3 against 1 / 1).
    assert_eq!(batched.choose(100, &pays_alone), Choice::Plain);
    // 7 + 7 tokens in 2.0 against 8 in 1.7.
    assert_eq!(batched.choose(100, &pays_anyway), Choice::Offer(0));
    batched.beside(Beside::default());
    assert_eq!(batched.choose(100, &pays_alone), Choice::Offer(0));
}
