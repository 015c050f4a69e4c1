//! The MoE expert exchange between MPI processes (`--enable-expert-parallel` with the MPI
//! backend): a `Communicator` over MPI_COMM_WORLD for `expert::CommExchange`. The model calls
//! it from its compute thread while the rank loop (which owns the step agreement's `MpiComm`)
//! waits for the forward pass, so the two never call MPI at the same time; MPI must still allow
//! calls from more than one thread (MPI_THREAD_SERIALIZED or better: `MpiComm::init_threaded`).
//! The world handle is taken per call (a constant, no state), so this type is plain data and
//! Send + Sync without any unsafe code. A rank that aborts its exchanges aborts the MPI job:
//! mpirun then ends every process instead of leaving one waiting.

use super::communicator::{check_all_to_all_shape, check_gather_shape, check_root, Communicator, DpError};
use super::expert::{Abortable, CommExchange};
use mpi::collective::SystemOperation;
use mpi::environment::Threading;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives, Root};
use specula_model::LlamaModel;
use std::sync::Arc;

/// This process's place in MPI_COMM_WORLD, for the expert exchange.
#[derive(Debug)]
pub struct MpiExpertComm {
    rank: usize,
    size: usize,
}

impl MpiExpertComm {
    /// Needs MPI initialized (by `MpiComm`) with thread support of at least SERIALIZED.
    pub fn new() -> Result<Self, DpError> {
        if !mpi::environment::is_initialized() || mpi::environment::is_finalized() {
            return Err(DpError::Mpi("expert parallel over MPI needs MPI initialized first (MpiComm::init_threaded)".into()));
        }
        let level = mpi::environment::threading_support();
        if matches!(level, Threading::Single | Threading::Funneled) {
            return Err(DpError::Mpi(format!(
                "expert parallel over MPI exchanges tokens from the compute thread, which needs MPI thread support SERIALIZED or better; this process has {level:?} (initialize with MpiComm::init_threaded)"
            )));
        }
        let world = SimpleCommunicator::world();
        Ok(Self { rank: world.rank() as usize, size: world.size() as usize })
    }
}

impl Communicator for MpiExpertComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), DpError> {
        let send = buf.to_vec();
        SimpleCommunicator::world().all_reduce_into(&send[..], buf, SystemOperation::sum());
        Ok(())
    }
    fn all_reduce_max_i64(&self, buf: &mut [i64]) -> Result<(), DpError> {
        let send = buf.to_vec();
        SimpleCommunicator::world().all_reduce_into(&send[..], buf, SystemOperation::max());
        Ok(())
    }
    fn all_gather_f32(&self, local: &[f32], out: &mut [f32]) -> Result<(), DpError> {
        check_gather_shape(self.size, local.len(), out.len())?;
        SimpleCommunicator::world().all_gather_into(local, out);
        Ok(())
    }
    fn all_to_all_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<(), DpError> {
        check_all_to_all_shape(self.size, send.len(), recv.len())?;
        SimpleCommunicator::world().all_to_all_into(send, recv);
        Ok(())
    }
    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), DpError> {
        check_root(self.size, root)?;
        let world = SimpleCommunicator::world();
        let root_process = world.process_at_rank(root as i32);
        let mut len = [buf.len() as u64];
        root_process.broadcast_into(&mut len[..]);
        buf.resize(len[0] as usize, 0);
        root_process.broadcast_into(&mut buf[..]);
        Ok(())
    }
    fn barrier(&self) -> Result<(), DpError> {
        SimpleCommunicator::world().barrier();
        Ok(())
    }
}

impl Abortable for MpiExpertComm {
    fn abort_group(&self) {
        tracing::error!(rank = self.rank, "aborting the MPI job: this rank cannot finish its expert exchanges");
        SimpleCommunicator::world().abort(1)
    }
}

/// Spreads `model`'s experts over the MPI ranks (this process keeps its 1/N). Fails on every
/// rank alike, before any collective, for a dense model or an N that does not divide the
/// experts; pass the error to `check_same_config` so all ranks stop together.
pub fn enable_mpi_expert_parallel(model: &mut LlamaModel) -> Result<(), DpError> {
    let comm = MpiExpertComm::new()?;
    model.enable_expert_parallel(Arc::new(CommExchange::new(comm))).map_err(|e| DpError::Config(e.to_string()))
}
