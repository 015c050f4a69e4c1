//! One random stream per sequence, so a seeded request samples the same tokens whatever else shares
//! its batch (invariant 3 of docs/architecture.md). ChaCha12 seeded from the request's seed (or from the OS
//! source when it has none); the completion index picks an independent ChaCha stream, so the `n`
//! completions of one seeded request differ. Not for anything needing cryptographic secrecy.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha12Rng;

/// A sequence's random stream. Draw exactly one [`SeqRng::uniform`] per sampled token (the
/// sampler does) and the stream's position depends only on the sequence's own history.
#[derive(Clone)]
pub struct SeqRng {
    inner: ChaCha12Rng,
}

impl SeqRng {
    /// The stream for completion `index` of a request: seeded from `seed`, or from the process's
    /// random source when the request gave none.
    pub fn new(seed: Option<u64>, index: u64) -> Self {
        let seed = seed.unwrap_or_else(rand::random);
        let mut inner = ChaCha12Rng::seed_from_u64(seed);
        inner.set_stream(index);
        Self { inner }
    }

    /// A uniform draw in [0, 1) built from the top 53 bits of one `u64`, written out here so the
    /// value does not depend on `rand`'s float conversion.
    pub fn uniform(&mut self) -> f64 {
        (self.inner.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

impl std::fmt::Debug for SeqRng {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqRng").field("stream", &self.inner.get_stream()).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draws(rng: &mut SeqRng, n: usize) -> Vec<f64> {
        (0..n).map(|_| rng.uniform()).collect()
    }

    #[test]
    fn same_seed_and_index_give_the_same_draws() {
        let a = draws(&mut SeqRng::new(Some(42), 0), 8);
        let b = draws(&mut SeqRng::new(Some(42), 0), 8);
        assert_eq!(a, b);
    }

    #[test]
    fn seeded_draws_are_pinned() {
        // Regression pin: a change here means seeded requests no longer reproduce old outputs.
        let mut rng = SeqRng::new(Some(42), 0);
        assert_eq!(draws(&mut rng, 2), PINNED_SEED_42);
    }

    #[test]
    fn other_seeds_and_indexes_give_other_draws() {
        let base = draws(&mut SeqRng::new(Some(42), 0), 4);
        assert_ne!(base, draws(&mut SeqRng::new(Some(43), 0), 4));
        assert_ne!(base, draws(&mut SeqRng::new(Some(42), 1), 4));
    }

    #[test]
    fn unseeded_streams_differ() {
        assert_ne!(draws(&mut SeqRng::new(None, 0), 4), draws(&mut SeqRng::new(None, 0), 4));
    }

    #[test]
    fn draws_lie_in_the_unit_interval() {
        let mut rng = SeqRng::new(Some(7), 3);
        assert!(draws(&mut rng, 10_000).iter().all(|&u| (0.0..1.0).contains(&u)));
    }

    const PINNED_SEED_42: [f64; 2] = [0.5265574090027738, 0.5427252099031439];
}
