//! Choosing how many tokens to draft per sequence and step, so speculation never makes serving
//! slower: none when the batch is large (verification then costs real compute), fewer when a
//! sequence's recent acceptance is low, with an occasional probe so a sequence can recover.

/// Per-sequence acceptance history (exponential moving average of the per-step accept rate).
#[derive(Clone, Debug)]
pub struct AcceptanceTracker {
    ema: f64,
    steps_since_probe: u32,
}

impl Default for AcceptanceTracker {
    fn default() -> Self {
        Self { ema: 0.7, steps_since_probe: 0 }
    }
}

impl AcceptanceTracker {
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed > 0 {
            let rate = accepted as f64 / proposed as f64;
            self.ema = 0.7 * self.ema + 0.3 * rate;
        }
    }

    pub fn ema(&self) -> f64 {
        self.ema
    }

    /// Draft length for the next step given the configured k.
    pub fn next_k(&mut self, k: usize) -> usize {
        if self.ema >= 0.5 {
            return k;
        }
        if self.ema >= 0.25 {
            return k.min(2);
        }
        self.steps_since_probe += 1;
        if self.steps_since_probe >= 8 {
            self.steps_since_probe = 0;
            return 1;
        }
        0
    }
}

/// No speculation in a step where more than `max_batch` sequences decode.
pub fn batch_allows_speculation(decoding: usize, max_batch: usize) -> bool {
    decoding <= max_batch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn low_acceptance_shrinks_then_pauses_drafting_with_probes() {
        let mut t = AcceptanceTracker::default();
        assert_eq!(t.next_k(4), 4);
        for _ in 0..3 {
            t.record(4, 1);
        }
        assert!(t.ema() < 0.5 && t.ema() >= 0.25, "{}", t.ema());
        assert_eq!(t.next_k(4), 2);
        for _ in 0..10 {
            t.record(2, 0);
        }
        let ks: Vec<usize> = (0..8).map(|_| t.next_k(4)).collect();
        assert_eq!(ks, vec![0, 0, 0, 0, 0, 0, 0, 1]);
        for _ in 0..10 {
            t.record(1, 1);
        }
        assert_eq!(t.next_k(4), 4);
    }

    #[test]
    fn large_batches_do_not_speculate() {
        assert!(batch_allows_speculation(4, 4));
        assert!(!batch_allows_speculation(5, 4));
    }
}
