//! The collectives data-parallel ranks need, behind one trait so the engine loop does not care
//! whether its peers are threads of this process (`local`) or MPI processes (`mpi`). Every
//! operation is collective: all ranks of the group call it, in the same order, with compatible
//! arguments, and it returns on every rank or fails on every rank. Not a general MPI binding.

/// Which collective a call is, for counting (tests, metrics) and for mismatch errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    AllReduceSum,
    AllReduceMax,
    AllGather,
    AllToAll,
    Broadcast,
    Barrier,
}

impl CollectiveKind {
    pub const ALL: [CollectiveKind; 6] = [
        CollectiveKind::AllReduceSum,
        CollectiveKind::AllReduceMax,
        CollectiveKind::AllGather,
        CollectiveKind::AllToAll,
        CollectiveKind::Broadcast,
        CollectiveKind::Barrier,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CollectiveKind::AllReduceSum => "all_reduce_sum",
            CollectiveKind::AllReduceMax => "all_reduce_max",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
        }
    }

    /// Dense index (0..6) for counter arrays.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Why a collective (or the group as a whole) failed. Every rank of a failed collective gets an
/// error, never a hang.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DpError {
    #[error("data-parallel rank {rank} left the group, so no collective can complete; stopping this rank too")]
    PeerGone { rank: usize },
    #[error("the data-parallel group stopped because a rank hit a fatal error: {0}")]
    RankFailed(String),
    #[error("data-parallel ranks called different collectives: {0}")]
    Mismatch(String),
    #[error("data-parallel ranks disagree on their configuration: {0}")]
    ConfigMismatch(String),
    #[error("invalid data-parallel configuration: {0}")]
    Config(String),
    #[error("bad data-parallel step metadata: {0}")]
    BadMetadata(String),
    #[error("MPI: {0}")]
    Mpi(String),
}

/// A group of `size` ranks. All calls are collective (see the module docs); buffers that are
/// reduced in place must have the same length on every rank.
pub trait Communicator {
    /// This rank, in `0..size()`.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;

    /// Element-wise sum over ranks, in place. This is the one call per engine step
    /// (see `metadata::agree`).
    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), DpError>;

    /// Element-wise maximum over ranks, in place.
    fn all_reduce_max_i64(&self, buf: &mut [i64]) -> Result<(), DpError>;

    /// `out[r * local.len()..(r + 1) * local.len()]` receives rank r's `local`;
    /// `out.len() == size() * local.len()`.
    fn all_gather_f32(&self, local: &[f32], out: &mut [f32]) -> Result<(), DpError>;

    /// `send` holds `size()` equal chunks, chunk j for rank j; `recv` (same length) receives
    /// chunk i from rank i. The exchange an expert-parallel MoE layer makes (tokens to the rank
    /// owning their expert and back); every rank pads to the step's agreed token count first.
    fn all_to_all_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<(), DpError>;

    /// Rank `root`'s bytes replace `buf` on every rank (lengths may differ before the call).
    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), DpError>;

    fn barrier(&self) -> Result<(), DpError>;
}

/// Checks the shapes a rank passes before it enters a collective, so a caller's slip fails on
/// its own rank with a message instead of confusing the peers.
pub(crate) fn check_gather_shape(size: usize, local: usize, out: usize) -> Result<(), DpError> {
    if out != size * local {
        return Err(DpError::Mismatch(format!(
            "all_gather of {local} values per rank over {size} ranks needs an output of {} values, got {out}",
            size * local
        )));
    }
    Ok(())
}

pub(crate) fn check_all_to_all_shape(size: usize, send: usize, recv: usize) -> Result<(), DpError> {
    if send != recv || !send.is_multiple_of(size) {
        return Err(DpError::Mismatch(format!("all_to_all needs send and recv of equal length divisible by {size} ranks, got {send} and {recv}")));
    }
    Ok(())
}

pub(crate) fn check_root(size: usize, root: usize) -> Result<(), DpError> {
    if root >= size {
        return Err(DpError::Mismatch(format!("broadcast from rank {root} in a group of {size}")));
    }
    Ok(())
}
