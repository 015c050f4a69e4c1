//! Acceptance counters, kept raw (as vLLM does) and exported to Prometheus; ratios are computed
//! when read and never divide by zero.

/// Raw counters since start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecMetrics {
    /// Verification steps that carried at least one draft token.
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    /// `accepted_per_pos[i]`: drafts whose token at position i was accepted.
    pub accepted_per_pos: Vec<u64>,
    /// Forced draft tokens (structured outputs' jump-forward: the grammar allowed only that
    /// token there) verified, and how many were accepted. Counted apart from the proposer's
    /// drafts above, so the proposer's acceptance rate is its own.
    pub num_forced_tokens: u64,
    pub num_forced_accepted_tokens: u64,
}

impl SpecMetrics {
    pub fn new(k: usize) -> Self {
        Self { accepted_per_pos: vec![0; k], ..Default::default() }
    }

    /// Records one verified draft of `proposed` tokens of which the first `accepted` were kept.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.num_drafts += 1;
        self.num_draft_tokens += proposed as u64;
        self.num_accepted_tokens += accepted as u64;
        if self.accepted_per_pos.len() < proposed {
            self.accepted_per_pos.resize(proposed, 0);
        }
        for p in &mut self.accepted_per_pos[..accepted] {
            *p += 1;
        }
        metrics::counter!("specula:spec_decode_num_drafts").increment(1);
        metrics::counter!("specula:spec_decode_num_draft_tokens").increment(proposed as u64);
        metrics::counter!("specula:spec_decode_num_accepted_tokens").increment(accepted as u64);
        for pos in 0..accepted {
            metrics::counter!("specula:spec_decode_num_accepted_tokens_per_pos", "position" => pos.to_string()).increment(1);
        }
    }

    /// Records `forced` forced draft tokens verified, `accepted` of them kept (see
    /// [`record_forced`]).
    pub fn record_forced(&mut self, forced: usize, accepted: usize) {
        self.num_forced_tokens += forced as u64;
        self.num_forced_accepted_tokens += accepted as u64;
        record_forced(forced, accepted);
    }

    /// Accepted / proposed draft tokens.
    pub fn acceptance_rate(&self) -> Option<f64> {
        (self.num_draft_tokens > 0).then(|| self.num_accepted_tokens as f64 / self.num_draft_tokens as f64)
    }

    /// Tokens emitted per verification step: 1 + accepted / drafts.
    pub fn mean_acceptance_length(&self) -> Option<f64> {
        (self.num_drafts > 0).then(|| 1.0 + self.num_accepted_tokens as f64 / self.num_drafts as f64)
    }
}

/// Publishes forced draft tokens (jump-forward) verified and accepted: `specula:spec_forced_tokens_total`
/// and `specula:spec_forced_accepted_tokens_total`, also without a speculative method.
pub fn record_forced(forced: usize, accepted: usize) {
    if forced > 0 {
        metrics::counter!("specula:spec_forced_tokens_total").increment(forced as u64);
        metrics::counter!("specula:spec_forced_accepted_tokens_total").increment(accepted as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_accept_pattern_updates_every_counter() {
        let mut m = SpecMetrics::new(3);
        assert_eq!(m.acceptance_rate(), None);
        assert_eq!(m.mean_acceptance_length(), None);
        m.record(3, 3);
        m.record(3, 1);
        m.record(2, 0);
        m.record(0, 0); // no draft: not a verification
        assert_eq!(m.num_drafts, 3);
        assert_eq!(m.num_draft_tokens, 8);
        assert_eq!(m.num_accepted_tokens, 4);
        assert_eq!(m.accepted_per_pos, vec![2, 1, 1]);
        assert_eq!(m.acceptance_rate(), Some(0.5));
        assert!((m.mean_acceptance_length().unwrap() - (1.0 + 4.0 / 3.0)).abs() < 1e-12);
        // forced drafts (jump-forward) are counted apart: the proposer's rate does not move
        m.record_forced(5, 5);
        m.record_forced(2, 1);
        assert_eq!((m.num_forced_tokens, m.num_forced_accepted_tokens), (7, 6));
        assert_eq!((m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens), (3, 8, 4));
        assert_eq!(m.acceptance_rate(), Some(0.5));
    }
}
