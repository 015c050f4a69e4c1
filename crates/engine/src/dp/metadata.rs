//! What ranks agree on before each lockstep step, in exactly one collective: every rank packs
//! its [`StepMetadata`] into one i64 vector (its token count in its own slot, its flags as 0/1
//! counters) and a single sum all-reduce yields the [`GlobalStep`] every rank acts on. Adding a
//! field means adding a slot here, never another collective. Also the start-up check that all
//! ranks run the same configuration.

use super::communicator::{Communicator, DpError};

/// One rank's view of the step it is about to run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepMetadata {
    /// Agreement counter: the same on every rank (checked: a rank that skipped or repeated an
    /// agreement is caught here instead of deadlocking later).
    pub step: u64,
    /// Tokens this rank's batch computes (0: it runs a dummy batch or idles).
    pub num_tokens: usize,
    /// The batch holds a prefill chunk.
    pub has_prefill: bool,
    /// The batch verifies draft tokens.
    pub has_spec: bool,
    /// The rank holds requests (running or waiting), scheduled this step or not.
    pub has_work: bool,
    /// The rank was asked to shut down (or its command channel closed).
    pub wants_shutdown: bool,
    /// The rank hit an error it cannot recover from; the whole group stops.
    pub has_error: bool,
}

/// Offsets of the summed fields after the `size` per-rank token slots.
const STEP: usize = 0;
const PREFILL: usize = 1;
const SPEC: usize = 2;
const BUSY: usize = 3;
const SHUTDOWN: usize = 4;
const ERROR: usize = 5;
/// Summed fields after the token slots.
pub const NUM_FIELDS: usize = 6;

/// The packed vector's length for a group of `size` ranks.
pub fn packed_len(size: usize) -> usize {
    size + NUM_FIELDS
}

impl StepMetadata {
    /// `[tokens of rank 0, .., tokens of rank size-1, step, prefill, spec, busy, shutdown, error]`
    /// with this rank's tokens in slot `rank`, zeros in the other slots, and each flag 0 or 1.
    pub fn pack(&self, rank: usize, size: usize) -> Result<Vec<i64>, DpError> {
        if rank >= size {
            return Err(DpError::BadMetadata(format!("rank {rank} in a group of {size}")));
        }
        let tokens = i64::try_from(self.num_tokens).map_err(|_| DpError::BadMetadata(format!("{} tokens do not fit the packed step", self.num_tokens)))?;
        // the step is summed over ranks: keep size * step representable
        let step = i64::try_from(self.step)
            .ok()
            .filter(|s| s.checked_mul(size as i64).is_some())
            .ok_or_else(|| DpError::BadMetadata(format!("step {} too large to pack for {size} ranks", self.step)))?;
        let mut v = vec![0i64; packed_len(size)];
        v[rank] = tokens;
        let f = &mut v[size..];
        f[STEP] = step;
        f[PREFILL] = self.has_prefill as i64;
        f[SPEC] = self.has_spec as i64;
        f[BUSY] = self.has_work as i64;
        f[SHUTDOWN] = self.wants_shutdown as i64;
        f[ERROR] = self.has_error as i64;
        Ok(v)
    }
}

/// What every rank learns from the agreement; identical on all ranks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GlobalStep {
    pub step: u64,
    /// Tokens each rank's batch computes, by rank.
    pub per_rank_tokens: Vec<usize>,
    /// The padded batch size: every rank's forward (real or dummy) covers this many tokens.
    pub max_tokens: usize,
    pub total_tokens: usize,
    /// How many ranks' batches hold a prefill chunk / verify drafts / hold requests / want to
    /// shut down / failed.
    pub prefill_ranks: usize,
    pub spec_ranks: usize,
    pub busy_ranks: usize,
    pub shutdown_ranks: usize,
    pub error_ranks: usize,
}

impl GlobalStep {
    /// Reads the summed vector of a group of `size` ranks agreeing on step `step`. Fails on any
    /// value a correct sum cannot produce (negative counts, flags above `size`, another step).
    pub fn unpack(sum: &[i64], size: usize, step: u64) -> Result<Self, DpError> {
        if sum.len() != packed_len(size) {
            return Err(DpError::BadMetadata(format!("{} values for {size} ranks (expected {})", sum.len(), packed_len(size))));
        }
        let bad = |what: &str, v: i64| DpError::BadMetadata(format!("{what} = {v} is impossible for {size} ranks"));
        let mut per_rank_tokens = Vec::with_capacity(size);
        for (r, &t) in sum[..size].iter().enumerate() {
            per_rank_tokens.push(usize::try_from(t).map_err(|_| bad(&format!("tokens of rank {r}"), t))?);
        }
        let f = &sum[size..];
        let count = |i: usize, what: &str| -> Result<usize, DpError> {
            let v = f[i];
            if (0..=size as i64).contains(&v) {
                Ok(v as usize)
            } else {
                Err(bad(what, v))
            }
        };
        let expected_step = (step as i128) * size as i128;
        if f[STEP] as i128 != expected_step {
            return Err(DpError::BadMetadata(format!(
                "ranks are out of step: this rank is at agreement {step} but the sum of every rank's counter is {} (expected {expected_step}); a rank skipped or repeated an agreement",
                f[STEP]
            )));
        }
        Ok(Self {
            step,
            max_tokens: per_rank_tokens.iter().copied().max().unwrap_or(0),
            total_tokens: per_rank_tokens.iter().sum(),
            per_rank_tokens,
            prefill_ranks: count(PREFILL, "prefill ranks")?,
            spec_ranks: count(SPEC, "speculating ranks")?,
            busy_ranks: count(BUSY, "busy ranks")?,
            shutdown_ranks: count(SHUTDOWN, "ranks shutting down")?,
            error_ranks: count(ERROR, "failed ranks")?,
        })
    }

    pub fn any_prefill(&self) -> bool {
        self.prefill_ranks > 0
    }
    pub fn any_spec(&self) -> bool {
        self.spec_ranks > 0
    }
    /// No rank computes anything this step (all idle together).
    pub fn all_idle(&self) -> bool {
        self.max_tokens == 0
    }
    /// Some rank asked to shut down: every rank stops taking work and drains.
    pub fn shutdown_requested(&self) -> bool {
        self.shutdown_ranks > 0
    }
    /// Shutdown was asked for and no rank holds a request: every rank leaves the loop at this
    /// same agreement, so none is left waiting in a collective.
    pub fn can_stop(&self) -> bool {
        self.shutdown_ranks > 0 && self.busy_ranks == 0
    }
}

/// The step's one metadata collective: packs `local`, sums it over the group, unpacks.
pub fn agree<C: Communicator + ?Sized>(comm: &C, local: &StepMetadata) -> Result<GlobalStep, DpError> {
    let mut v = local.pack(comm.rank(), comm.size())?;
    comm.all_reduce_sum_i64(&mut v)?;
    GlobalStep::unpack(&v, comm.size(), local.step)
}

/// Start-up check that every rank runs the same configuration, so a mismatch fails on every
/// rank with a clear message instead of deadlocking at the first step. `local` is this rank's
/// configuration as `key=value` lines, or why it could not be built (the rank still takes part,
/// so its peers learn of the failure instead of waiting for it). One broadcast of rank 0's
/// description, one max all-reduce of a per-rank status vector.
pub fn check_same_config<C: Communicator + ?Sized>(comm: &C, local: Result<&str, &str>) -> Result<(), DpError> {
    const SAME: i64 = 0;
    const DIFFERS: i64 = 1;
    const FAILED: i64 = 2;
    let (rank, size) = (comm.rank(), comm.size());
    let mut reference = match (rank, local) {
        (0, Ok(desc)) => desc.as_bytes().to_vec(),
        _ => Vec::new(),
    };
    comm.broadcast_bytes(0, &mut reference)?;
    let reference = String::from_utf8_lossy(&reference).into_owned();
    let (status, detail) = match local {
        Err(e) => (FAILED, e.to_string()),
        Ok(_) if rank == 0 => (SAME, String::new()),
        Ok(_) if reference.is_empty() => (SAME, String::new()), // rank 0 failed; it reports below
        Ok(desc) => {
            let diff = describe_differences(&reference, desc);
            if diff.is_empty() {
                (SAME, String::new())
            } else {
                (DIFFERS, diff)
            }
        }
    };
    let mut statuses = vec![SAME; size];
    statuses[rank] = status;
    comm.all_reduce_max_i64(&mut statuses)?;
    let failed: Vec<usize> = (0..size).filter(|&r| statuses[r] == FAILED).collect();
    let differ: Vec<usize> = (0..size).filter(|&r| statuses[r] == DIFFERS).collect();
    if failed.is_empty() && differ.is_empty() {
        return Ok(());
    }
    let mut msg = String::new();
    if !failed.is_empty() {
        msg.push_str(&format!("rank(s) {failed:?} could not start"));
    }
    if !differ.is_empty() {
        if !msg.is_empty() {
            msg.push_str("; ");
        }
        msg.push_str(&format!("rank(s) {differ:?} run a different configuration than rank 0 (every rank needs the same flags and model)"));
    }
    if !detail.is_empty() {
        msg.push_str(&format!("; this rank ({rank}): {detail}"));
    }
    Err(if failed.is_empty() { DpError::ConfigMismatch(msg) } else { DpError::Config(msg) })
}

/// `key: rank 0 has A, this rank has B` for each differing `key=value` line.
fn describe_differences(reference: &str, mine: &str) -> String {
    let parse = |s: &str| -> std::collections::BTreeMap<String, String> {
        s.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.trim().to_string(), v.trim().to_string())).collect()
    };
    let (a, b) = (parse(reference), parse(mine));
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let none = "(unset)".to_string();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| format!("{k}: rank 0 has {}, this rank has {}", a.get(k).unwrap_or(&none), b.get(k).unwrap_or(&none)))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dp::local::LocalGroup;

    fn sum(vs: &[Vec<i64>]) -> Vec<i64> {
        let mut out = vec![0; vs[0].len()];
        for v in vs {
            for (o, x) in out.iter_mut().zip(v) {
                *o += x;
            }
        }
        out
    }

    #[test]
    fn pack_puts_tokens_in_the_rank_slot_and_flags_after_the_slots() {
        let m = StepMetadata { step: 7, num_tokens: 33, has_prefill: true, has_spec: false, has_work: true, wants_shutdown: false, has_error: true };
        assert_eq!(m.pack(1, 3).unwrap(), vec![0, 33, 0, 7, 1, 0, 1, 0, 1]);
        assert_eq!(packed_len(3), 9);
    }

    #[test]
    fn summed_packs_unpack_to_the_global_step() {
        let ranks = [
            StepMetadata { step: 4, num_tokens: 10, has_prefill: true, has_work: true, ..Default::default() },
            StepMetadata { step: 4, num_tokens: 0, has_work: false, ..Default::default() },
            StepMetadata { step: 4, num_tokens: 3, has_spec: true, has_work: true, wants_shutdown: true, ..Default::default() },
        ];
        let packed: Vec<Vec<i64>> = ranks.iter().enumerate().map(|(r, m)| m.pack(r, 3).unwrap()).collect();
        let g = GlobalStep::unpack(&sum(&packed), 3, 4).unwrap();
        assert_eq!(g.per_rank_tokens, vec![10, 0, 3]);
        assert_eq!((g.max_tokens, g.total_tokens), (10, 13));
        assert_eq!((g.prefill_ranks, g.spec_ranks, g.busy_ranks, g.shutdown_ranks, g.error_ranks), (1, 1, 2, 1, 0));
        assert!(g.any_prefill() && g.any_spec() && g.shutdown_requested());
        assert!(!g.all_idle() && !g.can_stop());
    }

    #[test]
    fn all_idle_ranks_agree_on_an_empty_step_and_stop_only_when_asked() {
        let idle = StepMetadata { step: 0, ..Default::default() };
        let packed: Vec<Vec<i64>> = (0..4).map(|r| idle.pack(r, 4).unwrap()).collect();
        let g = GlobalStep::unpack(&sum(&packed), 4, 0).unwrap();
        assert!(g.all_idle() && !g.can_stop());
        assert_eq!(g.per_rank_tokens, vec![0; 4]);
        let mut packed = packed;
        packed[3] = StepMetadata { wants_shutdown: true, ..idle }.pack(3, 4).unwrap();
        assert!(GlobalStep::unpack(&sum(&packed), 4, 0).unwrap().can_stop());
    }

    #[test]
    fn edges_one_rank_and_large_counts() {
        let m = StepMetadata { step: u32::MAX as u64, num_tokens: 1 << 40, has_work: true, ..Default::default() };
        let g = GlobalStep::unpack(&m.pack(0, 1).unwrap(), 1, u32::MAX as u64).unwrap();
        assert_eq!((g.max_tokens, g.busy_ranks), (1 << 40, 1));
        assert!(matches!(StepMetadata { step: u64::MAX, ..Default::default() }.pack(0, 2), Err(DpError::BadMetadata(_))));
        assert!(matches!(StepMetadata { step: (i64::MAX / 2) as u64 + 1, ..Default::default() }.pack(0, 2), Err(DpError::BadMetadata(_))));
        assert!(matches!(StepMetadata::default().pack(2, 2), Err(DpError::BadMetadata(_))));
    }

    #[test]
    fn impossible_sums_are_refused() {
        // a flag counted by more ranks than exist
        assert!(GlobalStep::unpack(&[0, 0, 0, 3, 0, 0, 0, 0], 2, 0).is_err());
        // negative tokens
        assert!(GlobalStep::unpack(&[-1, 0, 0, 0, 0, 0, 0, 0], 2, 0).is_err());
        // wrong length
        assert!(GlobalStep::unpack(&[0; 7], 2, 0).is_err());
    }

    #[test]
    fn a_rank_at_another_step_is_caught() {
        let a = StepMetadata { step: 5, ..Default::default() }.pack(0, 2).unwrap();
        let b = StepMetadata { step: 6, ..Default::default() }.pack(1, 2).unwrap();
        let e = GlobalStep::unpack(&sum(&[a, b]), 2, 5).unwrap_err();
        assert!(e.to_string().contains("out of step"), "{e}");
    }

    fn run_config_check(descs: Vec<Result<&'static str, &'static str>>) -> Vec<Result<(), DpError>> {
        let joins: Vec<_> = LocalGroup::new(descs.len()).into_iter().zip(descs).map(|(c, d)| std::thread::spawn(move || check_same_config(&c, d))).collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    }

    #[test]
    fn same_configuration_passes_on_every_rank() {
        let out = run_config_check(vec![Ok("a=1\nb=2"); 3]);
        assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
    }

    #[test]
    fn a_differing_flag_fails_every_rank_and_the_odd_rank_names_it() {
        let out = run_config_check(vec![Ok("a=1\nb=2"), Ok("a=1\nb=2"), Ok("a=1\nb=3")]);
        for r in &out {
            let e = r.as_ref().unwrap_err().to_string();
            assert!(e.contains("rank(s) [2] run a different configuration"), "{e}");
        }
        let e = out[2].as_ref().unwrap_err().to_string();
        assert!(e.contains("b: rank 0 has 2, this rank has 3"), "{e}");
    }

    #[test]
    fn a_rank_that_cannot_start_fails_every_rank() {
        let out = run_config_check(vec![Err("MPI backend without mpirun"), Ok("a=1"), Ok("a=1")]);
        for r in &out {
            assert!(matches!(r, Err(DpError::Config(m)) if m.contains("rank(s) [0] could not start")), "{r:?}");
        }
        assert!(out[0].as_ref().unwrap_err().to_string().contains("MPI backend without mpirun"));
    }
}
