//! Ranks as MPI processes (`mpirun -np N specula ...`): the `Communicator` over MPI_COMM_WORLD,
//! through the `mpi` crate on the system's Open MPI. One rank per process; the communicator's
//! calls come from one thread (the rank loop), while a server's `bridge` thread talks over its
//! own duplicate of the world (`init_threaded` asks for MPI_THREAD_MULTIPLE). MPI's default
//! error handler aborts the whole job on a failed collective, and mpirun ends the job when a
//! process exits early, so a broken rank never leaves its peers waiting. Built only with the
//! `mpi` feature.

use super::communicator::{check_all_to_all_shape, check_gather_shape, check_root, Communicator, DpError};
use mpi::collective::SystemOperation;
pub use mpi::environment::Threading;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives, Root};

/// Environment variables a launcher (Open MPI's mpirun, or a PMI/PMIx one) sets in each process.
const LAUNCHER_VARS: [&str; 4] = ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"];

/// Whether this process was started by an MPI launcher.
pub fn launched_by_mpirun() -> bool {
    LAUNCHER_VARS.iter().any(|v| std::env::var_os(v).is_some())
}

/// This process's rank in MPI_COMM_WORLD. From `init` it owns the MPI environment (dropping it
/// finalizes MPI, so drop it only after the group agreed to stop); from `init_threaded` the
/// returned `MpiEnv` owns it instead.
pub struct MpiComm {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    _universe: Option<Universe>,
}

/// The MPI environment of a process whose MPI is used by several threads (`init_threaded`).
/// Dropping it finalizes MPI: drop it last, after every thread that uses MPI has ended.
pub struct MpiEnv {
    _universe: Universe,
}

/// MPI thread-support levels in increasing order (the `mpi` crate's enum has no order).
fn threading_level(t: Threading) -> u8 {
    match t {
        Threading::Single => 0,
        Threading::Funneled => 1,
        Threading::Serialized => 2,
        Threading::Multiple => 3,
    }
}

impl MpiComm {
    /// Initializes MPI (once per process) and joins MPI_COMM_WORLD. Refuses, with the command to
    /// use, when the process was not started by mpirun (MPI would silently make it a group of one).
    pub fn init() -> Result<Self, DpError> {
        let (universe, _) = Self::initialize(Threading::Funneled)?;
        Ok(Self::over_world(Some(universe)))
    }

    /// Initializes MPI for a process where several threads make MPI calls at once (the engine
    /// rank's collectives and `bridge`'s messages), asking for `needed` and failing clearly when
    /// the MPI library provides less. The communicator goes to the rank loop; the environment
    /// stays with the caller, to be dropped after every MPI thread has ended.
    pub fn init_threaded(needed: Threading) -> Result<(MpiEnv, Self), DpError> {
        let (universe, provided) = Self::initialize(needed)?;
        if threading_level(provided) < threading_level(needed) {
            return Err(DpError::Mpi(format!(
                "this MPI library provides thread support {provided:?} but serving over MPI needs {needed:?} (a bridge thread passes requests while the rank computes); use an MPI built with MPI_THREAD_MULTIPLE (Debian's Open MPI is)"
            )));
        }
        Ok((MpiEnv { _universe: universe }, Self::over_world(None)))
    }

    fn initialize(threading: Threading) -> Result<(Universe, Threading), DpError> {
        if !launched_by_mpirun() {
            return Err(DpError::Config(
                "--data-parallel-backend mpi needs the processes started by MPI: run `mpirun -np N specula serve ... --data-parallel-backend mpi` (or use the default in-process backend)".into(),
            ));
        }
        mpi::initialize_with_threading(threading).ok_or_else(|| DpError::Mpi("MPI was already initialized in this process".into()))
    }

    fn over_world(universe: Option<Universe>) -> Self {
        let world = SimpleCommunicator::world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Self { world, rank, size, _universe: universe }
    }

    /// Fails on every rank when mpirun started a different number of processes than asked for.
    pub fn expect_size(&self, data_parallel_size: usize) -> Result<(), DpError> {
        if self.size != data_parallel_size {
            return Err(DpError::Config(format!(
                "mpirun started {} processes but --data-parallel-size is {data_parallel_size}; pass the same N to both (mpirun -np N ... --data-parallel-size N)",
                self.size
            )));
        }
        Ok(())
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), DpError> {
        let send = buf.to_vec();
        self.world.all_reduce_into(&send[..], buf, SystemOperation::sum());
        Ok(())
    }

    fn all_reduce_max_i64(&self, buf: &mut [i64]) -> Result<(), DpError> {
        let send = buf.to_vec();
        self.world.all_reduce_into(&send[..], buf, SystemOperation::max());
        Ok(())
    }

    fn all_gather_f32(&self, local: &[f32], out: &mut [f32]) -> Result<(), DpError> {
        check_gather_shape(self.size, local.len(), out.len())?;
        self.world.all_gather_into(local, out);
        Ok(())
    }

    fn all_to_all_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<(), DpError> {
        check_all_to_all_shape(self.size, send.len(), recv.len())?;
        self.world.all_to_all_into(send, recv);
        Ok(())
    }

    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), DpError> {
        check_root(self.size, root)?;
        let root_process = self.world.process_at_rank(root as i32);
        let mut len = [buf.len() as u64];
        root_process.broadcast_into(&mut len[..]);
        buf.resize(len[0] as usize, 0);
        // every rank skips alike (same len): Open MPI rejects an empty Rust slice's dangling pointer
        if !buf.is_empty() {
            root_process.broadcast_into(&mut buf[..]);
        }
        Ok(())
    }

    fn barrier(&self) -> Result<(), DpError> {
        self.world.barrier();
        Ok(())
    }
}
