//! Data parallelism: N engine ranks behind one front end (docs/architecture.md "Data parallel", invariant 6).
//!
//! - `communicator`: the collectives ranks use, with in-process (`local`) and, behind the `mpi`
//!   feature, MPI (`mpi`) implementations; `counting` wraps one to count calls in tests.
//! - `metadata`: the one packed all-reduce per lockstep step, and the start-up configuration check.
//! - `router`: the front end routing requests over ranks (least outstanding tokens, prefix
//!   affinity, aborts to the owner); `EngineHandle::routed` wraps it.
//! - `lockstep`: the per-rank loop that steps with its peers (dummy batches, agreed shutdown);
//!   `group`: starting replica or lockstep groups in this process; `rank`: what both share.
//! - `bridge` (feature `mpi`): serving over MPI processes: rank 0's router reaches the other
//!   ranks through MPI messages (requests, aborts, shutdown down; events and metrics up).
//! - `expert`: expert parallelism for MoE models in lockstep mode: the model's `ExpertExchange`
//!   over a communicator, padded to `GlobalStep::max_tokens` each step.
//!
//! Not here: the MoE math itself (specula_model::moe).

#[cfg(feature = "mpi")]
pub mod bridge;
pub mod communicator;
pub mod counting;
pub mod expert;
pub mod group;
pub mod local;
pub mod lockstep;
pub mod metadata;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "mpi")]
pub mod mpi_expert;
mod rank;
pub mod router;

pub use communicator::{CollectiveKind, Communicator, DpError};
pub use counting::{CollectiveCounts, CountingComm};
pub use group::{build_rank, spawn_lockstep, spawn_replica_rank, spawn_replicas, BuiltRank, DpGroup, DpMode, RankSetup};
pub use local::{LocalComm, LocalGroup};
pub use lockstep::{LockstepRank, IDLE_POLL};
pub use metadata::{agree, check_same_config, GlobalStep, StepMetadata};
pub use rank::{RankMetrics, RankSnapshot, RankStats};
pub use router::ReplicaRouter;
