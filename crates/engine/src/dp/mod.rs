//! Data parallelism: N engine ranks behind one front end (DESIGN.md "Data parallel", invariant 6).
//!
//! - `communicator`: the collectives ranks use, with in-process (`local`) and, behind the `mpi`
//!   feature, MPI (`mpi`) implementations; `counting` wraps one to count calls in tests.
//! - `metadata`: the one packed all-reduce per lockstep step, and the start-up configuration check.
//! - `router`: the front end routing requests over ranks (least outstanding tokens, prefix
//!   affinity, aborts to the owner); `EngineHandle::routed` wraps it.
//! - `lockstep`: the per-rank loop that steps with its peers (dummy batches, agreed shutdown);
//!   `group`: starting replica or lockstep groups in this process; `rank`: what both share.
//!
//! Not here: the model's own parallelism (tensor/expert parallel layers); an MoE layer would
//! call `Communicator::all_to_all_f32` on buffers padded to `GlobalStep::max_tokens`.

pub mod communicator;
pub mod counting;
pub mod group;
pub mod local;
pub mod lockstep;
pub mod metadata;
#[cfg(feature = "mpi")]
pub mod mpi;
mod rank;
pub mod router;

pub use communicator::{CollectiveKind, Communicator, DpError};
pub use counting::{CollectiveCounts, CountingComm};
pub use local::{LocalComm, LocalGroup};
pub use metadata::{agree, check_same_config, GlobalStep, StepMetadata};
pub use group::{spawn_lockstep, spawn_replicas, DpGroup, DpMode, RankSetup};
pub use lockstep::{LockstepRank, IDLE_POLL};
pub use rank::RankStats;
pub use router::ReplicaRouter;
