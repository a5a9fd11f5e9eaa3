// Implementation of include/distributed.h over MLX's distributed API.
#include "mlxcel-mlx/include/distributed.h"

#include <string>

namespace mx = mlx::core;
namespace dist = mlx::core::distributed;

namespace mlxcel {

bool distributed_is_available(rust::Str backend) {
  return dist::is_available(std::string(backend));
}

std::unique_ptr<DistGroup> distributed_init(rust::Str backend, bool strict) {
  return std::make_unique<DistGroup>(DistGroup{dist::init(strict, std::string(backend))});
}

int32_t group_rank(const DistGroup& g) { return g.group.rank(); }
int32_t group_size(const DistGroup& g) { return g.group.size(); }

ArrayPtr dist_all_sum(const array& x, const DistGroup& g) {
  return std::make_unique<array>(dist::all_sum(x, g.group));
}
ArrayPtr dist_all_gather(const array& x, const DistGroup& g) {
  return std::make_unique<array>(dist::all_gather(x, g.group));
}
ArrayPtr dist_send(const array& x, int32_t dst, const DistGroup& g) {
  return std::make_unique<array>(dist::send(x, dst, g.group));
}
ArrayPtr dist_recv_like(const array& like, int32_t src, const DistGroup& g) {
  return std::make_unique<array>(dist::recv_like(like, src, g.group));
}

}  // namespace mlxcel
