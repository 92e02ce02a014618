//! Segments (the recipe's step 6): every row's visible list, its cut into segments of [`SEGMENT`]
//! keys, where the segments leave their partial softmaxes, and their merge in a fixed order.

use super::layout::Shape;
use super::score::exp_nonpositive;
use super::{Visibility, LANES, SEGMENT};
use crate::kernels::pool::SharedMut;

/// Segments are units of their own where their results for step 6 take at most this many bytes (in
/// decoding steps and small blocks; a long prefill's would be tens of MB, written and read again).
pub(super) const SPLIT_BYTES: usize = 1 << 20;

/// Every row's visible list: its leading run of keys `0 .. lead[r]` (all of a causal row's keys, the
/// whole cache for a tree's row), then the keys listed at `listed[starts[r] .. starts[r + 1]]`.
pub(super) struct VisibleLists {
    pub(super) lead: Vec<usize>,
    pub(super) listed: Vec<u32>,
    pub(super) starts: Vec<usize>,
}

impl VisibleLists {
    pub(super) fn new(vis: Visibility, rows: usize, keys: usize) -> Self {
        let mut lists = VisibleLists {
            lead: Vec::with_capacity(rows),
            listed: Vec::new(),
            starts: Vec::with_capacity(rows + 1),
        };
        lists.starts.push(0);
        for r in 0..rows {
            let lead = match vis {
                Visibility::Causal { offset } => (offset + r + 1).min(keys),
                Visibility::Additive(m) => {
                    let m = &m[r * keys..(r + 1) * keys];
                    let lead = leading_visible(m);
                    // Branch-free: every key is written, and the count moves past the visible ones.
                    let v0 = lists.listed.len();
                    lists.listed.resize(v0 + keys - lead, 0);
                    let mut n = v0;
                    for (j, &bias) in m[lead..].iter().enumerate() {
                        lists.listed[n] = (lead + j) as u32;
                        n += usize::from(bias != f32::NEG_INFINITY);
                    }
                    lists.listed.truncate(n);
                    lead
                }
            };
            lists.lead.push(lead);
            lists.starts.push(lists.listed.len());
        }
        lists
    }

    /// How many keys row `r` sees.
    pub(super) fn len(&self, r: usize) -> usize {
        self.lead[r] + self.starts[r + 1] - self.starts[r]
    }

    /// How many segments row `r`'s list is cut into (the recipe's step 6).
    pub(super) fn segments(&self, r: usize) -> usize {
        segments(self.len(r))
    }
}

/// How many segments a visible list of `n` keys is cut into: `n / SEGMENT` rounded to the nearest (at
/// least one), the last segment taking the rest, so that none holds fewer than half a [`SEGMENT`].
pub(super) fn segments(n: usize) -> usize {
    ((n + SEGMENT / 2) / SEGMENT).max(1)
}

/// Where a unit leaves a segment's results for (row `ri` of its tile, query head `g` of its group):
/// slot `base + ri · per_row + g` of `o` (`hd` values a slot) and, for step 6, of `stats` (`(m_k,
/// sum_k)`, `m_k` left -inf where the row sees no key of the segment). Without `stats`, `o` is the
/// output and the results are final.
#[derive(Clone, Copy)]
pub(super) struct Slots<'s, 'a> {
    pub(super) o: &'s SharedMut<'a, f32>,
    pub(super) stats: Option<&'s SharedMut<'a, f32>>,
    pub(super) base: usize,
    pub(super) per_row: usize,
}

impl Slots<'_, '_> {
    pub(super) fn slot(&self, ri: usize, g: usize) -> usize {
        self.base + ri * self.per_row + g
    }
}

/// Per (segment, row, head) of the problem: the segment's results, as [`Slots`] lay them out.
pub(super) struct Partials<'a> {
    pub(super) o: SharedMut<'a, f32>,
    pub(super) stats: SharedMut<'a, f32>,
    /// Units finished per (key/value head, row tile): the one that makes it `segments` merges.
    pub(super) done: Vec<std::sync::atomic::AtomicUsize>,
}

/// Step 6 for the given rows and the query heads of key/value head `kvh`, once each of the `segments`
/// has left its results (segment `k`'s in `segment(k)`).
#[inline(always)]
pub(super) fn merge<'s, 'a: 's>(
    shape: &Shape,
    segments: usize,
    kvh: usize,
    rows: std::ops::Range<usize>,
    segment: impl Fn(usize) -> Slots<'s, 'a>,
    out: &SharedMut<f32>,
) {
    let (hd, heads) = (shape.hd, shape.heads);
    let group = heads / shape.kv_heads;
    for (ri, r) in rows.enumerate() {
        for g in 0..group {
            // SAFETY: every unit writing these has finished, and this (row, head)'s output is this
            // unit's alone.
            let stats = |k: usize| {
                let at = segment(k);
                let st = unsafe { at.stats.unwrap().range(2 * at.slot(ri, g), 2) };
                (st[0], st[1])
            };
            let top = (0..segments).fold(f32::NEG_INFINITY, |m, k| m.max(stats(k).0));
            let o = unsafe { out.range((r * heads + kvh * group + g) * hd, hd) };
            let mut sum = None;
            for k in 0..segments {
                let (m, sum_k) = stats(k);
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let w = exp_nonpositive(m - top);
                let at = segment(k);
                let o_k = unsafe { at.o.range(at.slot(ri, g) * hd, hd) };
                sum = Some(match sum {
                    None => {
                        for (x, &y) in o.iter_mut().zip(o_k.iter()) {
                            *x = w * y;
                        }
                        w * sum_k
                    }
                    Some(sum) => {
                        for (x, &y) in o.iter_mut().zip(o_k.iter()) {
                            *x = w.mul_add(y, *x);
                        }
                        w.mul_add(sum_k, sum)
                    }
                });
            }
            match sum {
                None => o.fill(0.0),
                Some(sum) => {
                    let inv = 1.0 / sum;
                    o.iter_mut().for_each(|x| *x *= inv);
                }
            }
        }
    }
}

/// How many entries of a mask row lead before its first hidden key (`-inf`): 16 at a time, branch-free
/// inside a chunk so that it compiles to vector compares (a tree's row sees the whole cache first).
pub(super) fn leading_visible(m: &[f32]) -> usize {
    let visible = |b: &f32| *b != f32::NEG_INFINITY;
    let whole = m
        .chunks_exact(LANES)
        .take_while(|c| c.iter().fold(true, |all, b| all & visible(b)))
        .count()
        * LANES;
    whole + m[whole..].iter().take_while(|b| visible(b)).count()
}
