//! What the timed steps say of a cost curve's prices: per class of block size, the mean of measured over
//! priced seconds, pooled over every request on the model in this process, older steps fading.
//!
//! A curve is timed once, in about a second, on a machine whose load changes. Three timings of one
//! binary on one machine priced a 4-row block at 1.42, 1.48 and 1.86 plain steps, and every request of the
//! process inherits the error: a pessimistic curve speculates too little all run long, an optimistic one
//! too much. One request's steps are too few to correct it (a class it rarely sends stays uncorrected),
//! so the requests pool what they measure.

use std::sync::Mutex;

/// Steps' worth of evidence that a class costs the curve's price, before measured steps count.
const PRIOR_STEPS: f64 = 3.0;
/// Measured steps a class remembers: past these, each new step shrinks the weight of the older ones, so
/// the correction follows the machine's load.
const MEMORY_STEPS: f64 = 256.0;

/// Measured-over-priced ratios by class (the caller's numbering), summed with their weights.
#[derive(Debug, Default)]
pub struct CostCorrection {
    by_class: Mutex<Vec<(f64, f64)>>,
}

/// A curve's identity is its timings; what later steps measured does not make two curves differ.
impl PartialEq for CostCorrection {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl CostCorrection {
    /// A step of `class` took `ratio` times its curve price (clamped to 1/4..4: a step stalled by
    /// another process must not reprice a class).
    pub fn record(&self, class: usize, ratio: f64) {
        let mut by_class = self.by_class.lock().unwrap_or_else(|e| e.into_inner());
        if by_class.len() <= class {
            by_class.resize(class + 1, (0.0, 0.0));
        }
        let (sum, weight) = &mut by_class[class];
        if *weight >= MEMORY_STEPS {
            let keep = (MEMORY_STEPS - 1.0) / *weight;
            *sum *= keep;
            *weight *= keep;
        }
        *sum += ratio.clamp(0.25, 4.0);
        *weight += 1.0;
    }

    /// How much more (or less) than the curve's price the steps of `class` took: 1 (the curve) for
    /// [`PRIOR_STEPS`] steps, then the remembered steps' mean.
    pub fn factor(&self, class: usize) -> f64 {
        let by_class = self.by_class.lock().unwrap_or_else(|e| e.into_inner());
        let (sum, weight) = by_class.get(class).copied().unwrap_or((0.0, 0.0));
        (sum + PRIOR_STEPS) / (weight + PRIOR_STEPS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_at_the_curve_and_follows_the_steps() {
        let c = CostCorrection::default();
        assert_eq!(c.factor(3), 1.0);
        for _ in 0..3 {
            c.record(3, 2.0);
        }
        // Three steps at twice the price against three of prior at the price.
        assert!((c.factor(3) - 1.5).abs() < 1e-12);
        assert_eq!(c.factor(0), 1.0);
        // A stalled step counts as four times the price at most.
        let stalled = CostCorrection::default();
        stalled.record(0, 100.0);
        assert!((stalled.factor(0) - 7.0 / 4.0).abs() < 1e-12);
    }

    #[test]
    fn old_steps_fade_when_the_load_changes() {
        let c = CostCorrection::default();
        for _ in 0..1000 {
            c.record(1, 2.0);
        }
        assert!((c.factor(1) - 2.0).abs() < 0.02, "{}", c.factor(1));
        // The machine gets faster: within a few hundred steps the factor follows it, and the sums stay
        // within the memory.
        for _ in 0..400 {
            c.record(1, 1.0);
        }
        let f = c.factor(1);
        assert!(f < 1.25 && f > 1.0, "{f}");
        let weight = c.by_class.lock().unwrap()[1].1;
        assert!(weight <= MEMORY_STEPS + 1.0, "{weight}");
    }
}
