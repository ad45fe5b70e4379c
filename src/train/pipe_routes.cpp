// Direct skip routes between pipeline stages (see pipe_routes.h).
#include "train/pipe_routes.h"

#include <algorithm>

#include "core/error.h"

namespace ddm {

PipeSkipRoutes pipe_skip_routes(NetImpl& net, const Prepared& sample, const std::vector<int>& bounds) {
  torch::NoGradGuard no_grad;
  const std::vector<NetUnit> units = net.units();
  const int L = static_cast<int>(units.size()), S = static_cast<int>(bounds.size()) - 1;
  DDM_CHECK(S >= 1 && bounds.front() == 0 && bounds.back() == L, "pipeline stage bounds must cover units 0.." << L - 1);
  auto stage_of = [&](int u) { return static_cast<int>(std::upper_bound(bounds.begin(), bounds.end(), u) - bounds.begin()) - 1; };
  // The skip slots after each unit: which tensor, and one row's shape.
  std::vector<std::vector<const void*>> held(static_cast<size_t>(L));
  std::vector<std::vector<std::vector<int64_t>>> shape(static_cast<size_t>(L));
  NetCarry k{sample.xt.narrow(0, 0, 1), {}, {}};
  const torch::Tensor t = sample.t.narrow(0, 0, 1);
  for (int u = 0; u < L; ++u) {
    units[static_cast<size_t>(u)].run(k, t, sample.cond);
    for (const torch::Tensor& s : k.skips) {
      held[static_cast<size_t>(u)].push_back(s.unsafeGetTensorImpl());
      shape[static_cast<size_t>(u)].push_back(s.sizes().slice(1).vec());
    }
  }
  auto open = [&](int u, int i) { return i < static_cast<int>(held[static_cast<size_t>(u)].size()); };
  // Unit v >= 1 touches slot i: pops it, or leaves another tensor there.
  auto touches = [&](int v, int i) {
    return !open(v, i) || held[static_cast<size_t>(v)][static_cast<size_t>(i)] != held[static_cast<size_t>(v) - 1][static_cast<size_t>(i)];
  };
  PipeSkipRoutes r;
  r.out.resize(static_cast<size_t>(std::max(0, S - 1)));
  r.in.resize(static_cast<size_t>(S));
  for (int s = 0; s + 1 < S; ++s) {
    const int u = bounds[static_cast<size_t>(s) + 1] - 1;  // the stage's last unit
    const int n = static_cast<int>(held[static_cast<size_t>(u)].size());
    r.slots = std::max(r.slots, n);
    for (int i = 0; i < n; ++i) {
      int made = u;  // the unit that put the slot's tensor there
      while (made > 0 && open(made - 1, i) && !touches(made, i)) --made;
      int read = u + 1;  // the next unit that touches it (none: the last stage, which never reads it)
      while (read < L && !touches(read, i)) ++read;
      const int holder = stage_of(made), reader = read < L ? stage_of(read) : S - 1;
      int& route = r.out[static_cast<size_t>(s)].emplace_back();
      if (holder < s) {
        route = PipeSkipRoutes::kElsewhere;
      } else if (reader <= s + 1) {
        route = PipeSkipRoutes::kCarried;
      } else {
        route = reader;
        r.in[static_cast<size_t>(reader)].push_back({s, i, shape[static_cast<size_t>(u)][static_cast<size_t>(i)]});
      }
    }
  }
  return r;
}

}  // namespace ddm
