//! MLX's distributed layer: a group of processes (ranks) started by
//! `mlx.launch` (or MPI) and the collectives between them, carried by one
//! of MLX's backends (`ring` over TCP, `jaccl` over RDMA/Thunderbolt, `mpi`,
//! `nccl` on NVIDIA). mlxcel brings no launcher or transport of its own:
//! [`init`] reads what the launcher put in the environment (`MLX_RANK`,
//! `MLX_HOSTFILE`, ...), as MLX's Python `mx.distributed.init` does.
//!
//! Collectives are lazy graph nodes like every other op: they run (and can
//! block on a peer) when an array depending on them is evaluated. A
//! backend's failure (a peer that closed its connection) is thrown by MLX
//! and comes back as an [`Error`] from that evaluation. A peer that stops
//! answering without closing may block the evaluation for as long as the
//! backend waits; callers that must not hang put a watchdog around it (the
//! engine does, see docs/distributed.md).

use std::sync::OnceLock;

use crate::ffi::bridge;
use crate::{count, Array, Error, Result, OPS};
use cxx::UniquePtr;

/// A group of processes that communicate (MLX's `distributed::Group`).
pub struct Group(UniquePtr<bridge::DistGroup>);

// SAFETY: the handle is a shared pointer to the backend's group, which MLX
// uses from its stream threads; mlxcel builds collectives from one thread
// at a time (the engine thread), as MLX's Python bindings do.
unsafe impl Send for Group {}
// SAFETY: `&Group` only reads the rank and size or builds graph nodes.
unsafe impl Sync for Group {}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .finish()
    }
}

/// The group [`init`] returned first: the one [`all_sum`] and the other
/// collectives use when given no group.
static WORLD: OnceLock<Group> = OnceLock::new();

/// Whether this MLX build has the distributed backend `backend` (`ring`,
/// `jaccl`, `mpi`, `nccl`, or `any`).
///
/// # Errors
/// MLX's, for an unknown backend name.
pub fn is_available(backend: &str) -> Result<bool> {
    Ok(bridge::distributed_is_available(backend)?)
}

/// Joins the group of processes the launcher started, over `backend`
/// (`any` picks the first MLX finds configured). With `strict`, a backend
/// that cannot initialize is an error; without it, MLX returns a group of
/// one (collectives are then no-ops). The first group initialized becomes
/// the world group of [`world`].
///
/// # Errors
/// MLX's: an unknown or unavailable backend, a hostfile it cannot read, a
/// peer it cannot reach.
pub fn init(backend: &str, strict: bool) -> Result<&'static Group> {
    if let Some(g) = WORLD.get() {
        return Ok(g);
    }
    let raw = bridge::distributed_init(backend, strict)?;
    if raw.is_null() {
        return Err(Error("distributed init returned no group".into()));
    }
    Ok(WORLD.get_or_init(|| Group(raw)))
}

/// The group [`init`] made, if it ran.
pub fn world() -> Option<&'static Group> {
    WORLD.get()
}

impl Group {
    fn raw(&self) -> &bridge::DistGroup {
        // Non-null: checked in `init`, the only constructor.
        self.0.as_ref().expect("Group is never null")
    }

    /// This process's rank, `0..size`.
    pub fn rank(&self) -> usize {
        bridge::group_rank(self.raw()).map_or(0, |r| r.max(0) as usize)
    }

    /// Processes in the group.
    pub fn size(&self) -> usize {
        bridge::group_size(self.raw()).map_or(1, |s| s.max(1) as usize)
    }
}

fn group_or_world(group: Option<&Group>) -> Result<&Group> {
    match group {
        Some(g) => Ok(g),
        None => world()
            .ok_or_else(|| Error("no distributed group: call distributed::init first".into())),
    }
}

fn wrap(p: std::result::Result<UniquePtr<bridge::array>, cxx::Exception>) -> Result<Array> {
    count(&OPS);
    let p = p?;
    if p.is_null() {
        return Err(Error("null array".into()));
    }
    Ok(Array(p))
}

/// The element-wise sum of `x` over every rank of `group` (default: the
/// world group), the same shape as `x`, on every rank. Lazy: the exchange
/// happens when the result is evaluated.
///
/// # Errors
/// No group initialized; MLX's errors building the node.
pub fn all_sum(x: &Array, group: Option<&Group>) -> Result<Array> {
    let g = group_or_world(group)?;
    wrap(bridge::dist_all_sum(x.raw(), g.raw()))
}

/// Every rank's `x` concatenated along axis 0 in rank order:
/// `[n, ...] -> [n * size, ...]`.
///
/// # Errors
/// As [`all_sum`].
pub fn all_gather(x: &Array, group: Option<&Group>) -> Result<Array> {
    let g = group_or_world(group)?;
    wrap(bridge::dist_all_gather(x.raw(), g.raw()))
}

/// Sends `x` to rank `dst`; evaluate the returned array to send.
///
/// # Errors
/// As [`all_sum`], and a `dst` outside the group.
pub fn send(x: &Array, dst: usize, group: Option<&Group>) -> Result<Array> {
    let g = group_or_world(group)?;
    wrap(bridge::dist_send(x.raw(), dst as i32, g.raw()))
}

/// Receives an array of `like`'s shape and dtype from rank `src`.
///
/// # Errors
/// As [`send`].
pub fn recv_like(like: &Array, src: usize, group: Option<&Group>) -> Result<Array> {
    let g = group_or_world(group)?;
    wrap(bridge::dist_recv_like(like.raw(), src as i32, g.raw()))
}
