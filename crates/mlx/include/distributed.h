// The cxx shim over MLX's distributed layer (mlx/distributed/*.h): group
// initialization for a named backend and the collectives tensor
// parallelism needs. Every function may throw; cxx turns the exception
// into an `Err` on the Rust side.
#pragma once

#include <cstdint>
#include <memory>

#include "mlx/distributed/distributed.h"
#include "mlx/distributed/ops.h"
#include "mlxcel-mlx/include/shim.h"
#include "rust/cxx.h"

namespace mlxcel {

// A handle on a distributed::Group (itself a shared pointer to the
// backend's group).
struct DistGroup {
  mlx::core::distributed::Group group;
};

bool distributed_is_available(rust::Str backend);
std::unique_ptr<DistGroup> distributed_init(rust::Str backend, bool strict);
int32_t group_rank(const DistGroup& g);
int32_t group_size(const DistGroup& g);
ArrayPtr dist_all_sum(const array& x, const DistGroup& g);
ArrayPtr dist_all_gather(const array& x, const DistGroup& g);
ArrayPtr dist_send(const array& x, int32_t dst, const DistGroup& g);
ArrayPtr dist_recv_like(const array& like, int32_t src, const DistGroup& g);

}  // namespace mlxcel
