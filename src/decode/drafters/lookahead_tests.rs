//! Unit tests of the lookahead drafter (kept apart to hold `lookahead.rs` to its job).

use super::*;

fn lookahead(w: usize, n: usize, g: usize) -> Lookahead {
    let mut la = Lookahead::new(LookaheadConfig {
        window: Some(w),
        ngram: n,
        guesses: g,
        seed: 1,
    })
    .unwrap();
    la.fill = vec![100];
    la
}

#[test]
fn config_checks_and_block_complexity() {
    assert_eq!(LookaheadConfig::default().block_complexity(), 45);
    let spec_bench = LookaheadConfig {
        window: Some(7),
        ..LookaheadConfig::default()
    };
    assert_eq!(spec_bench.block_complexity(), 36);
    assert_eq!(
        (1..=17).map(window_bucket).collect::<Vec<_>>(),
        [0, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4]
    );
    for (w, n, g) in [(0, 5, 7), (7, 1, 7), (7, 5, 0)] {
        assert!(Lookahead::new(LookaheadConfig {
            window: Some(w),
            ngram: n,
            guesses: g,
            seed: 0
        })
        .is_err());
    }
}

#[test]
fn window_slides_with_absolute_positions() {
    let mut la = lookahead(4, 3, 2);
    la.guesses = Level {
        start: 12,
        tokens: vec![1, 2, 3, 4],
    };
    // Root at 12: positions 13..=16 -> guesses 2, 3, 4, then a fill token.
    assert_eq!(
        la.window_for(12, 4),
        Level {
            start: 13,
            tokens: vec![2, 3, 4, 100]
        }
    );
    // Root at 10: position 11 has no guess.
    assert_eq!(
        la.window_for(10, 3),
        Level {
            start: 11,
            tokens: vec![100, 1, 2]
        }
    );
}

#[test]
fn ngrams_follow_the_diagonal() {
    // N = 3: gram = (guess two levels back at q-2, current guess at q-1, output at q).
    let mut la = lookahead(3, 3, 4);
    la.levels.push_back(Level {
        start: 10,
        tokens: vec![1, 2, 3],
    });
    la.levels.push_back(Level {
        start: 11,
        tokens: vec![4, 5, 6],
    });
    la.collect_ngrams(&Level {
        start: 12,
        tokens: vec![7, 8, 9],
    });
    // q = 12: current guess at 11 = 4, previous level at 10 = 1 -> [1, 4, 7].
    // q = 13: [2, 5, 8]; q = 14: [3, 6, 9].
    assert_eq!(la.pool.get(1).collect::<Vec<_>>(), vec![&[4u32, 7][..]]);
    assert_eq!(la.pool.get(2).collect::<Vec<_>>(), vec![&[5u32, 8][..]]);
    assert_eq!(la.pool.get(3).collect::<Vec<_>>(), vec![&[6u32, 9][..]]);
    // A slid window: current level starts at 13, the older one at 10; q = 14 needs 13 (ok) and 12 (ok).
    let mut la = lookahead(3, 3, 4);
    la.levels.push_back(Level {
        start: 10,
        tokens: vec![1, 2, 3],
    });
    la.levels.push_back(Level {
        start: 13,
        tokens: vec![4, 5, 6],
    });
    la.collect_ngrams(&Level {
        start: 14,
        tokens: vec![7, 8, 9],
    });
    // q=14: level0 at 12 = 3, current at 13 = 4 -> [3, 4, 7]; q=15: level0 at 13 missing; q=16 too.
    assert_eq!(la.pool.len(), 1);
    assert_eq!(la.pool.get(3).collect::<Vec<_>>(), vec![&[4u32, 7][..]]);
    // Too few levels yet: nothing.
    let mut la = lookahead(3, 3, 4);
    la.levels.push_back(Level {
        start: 11,
        tokens: vec![4, 5, 6],
    });
    la.collect_ngrams(&Level {
        start: 12,
        tokens: vec![7, 8, 9],
    });
    assert!(la.pool.is_empty());
    // N = 2: the current level alone.
    let mut la = lookahead(3, 2, 4);
    la.levels.push_back(Level {
        start: 11,
        tokens: vec![4, 5, 6],
    });
    la.collect_ngrams(&Level {
        start: 12,
        tokens: vec![7, 8, 9],
    });
    assert_eq!(la.pool.len(), 3);
    assert_eq!(la.pool.get(5).collect::<Vec<_>>(), vec![&[8u32][..]]);
}

#[test]
fn draft_merges_pool_candidates_and_appends_the_window() {
    let mut la = lookahead(3, 3, 2);
    la.pool.insert(&[5, 6, 7]);
    la.pool.insert(&[5, 6, 8]);
    la.pool.insert(&[9, 1, 1]);
    let history = [1, 2, 5];
    let d = la.draft(5, &history, 100);
    // Most recent first: [6, 8] then [6, 7], sharing the node 6.
    assert_eq!(d.tree.tokens(), &[5, 6, 8, 7]);
    assert_eq!(d.tree.parents(), &[0, 0, 1, 1]);
    assert_eq!(
        d.probes,
        vec![
            Probe { owner: 0, offset: 1 },
            Probe { owner: 0, offset: 2 },
            Probe { owner: 0, offset: 3 }
        ]
    );
    assert_eq!(la.fed.start, 3);
    // Tight room: 4 rows = root + window of 3, no candidates.
    let d = la.draft(5, &history, 4);
    assert_eq!((d.tree.len(), d.probes.len()), (1, 3));
    // 2 rows: root + 1 window probe.
    let d = la.draft(5, &history, 2);
    assert_eq!((d.tree.len(), d.probes.len()), (1, 1));
    assert_eq!(la.probe_owner(7), 0);
}
