// Direct skip routes between pipeline stages (see routes.h).
#include "pipeline/routes.h"

#include <algorithm>

#include "core/error.h"

namespace ddm {

PipeSkipRoutes pipe_skip_routes(NetImpl& net, const Prepared& sample, const std::vector<int>& bounds) {
  const std::vector<NetUnit> units = net.units();
  const int L = static_cast<int>(units.size()), S = static_cast<int>(bounds.size()) - 1;
  DDM_CHECK(S >= 1 && bounds.front() == 0 && bounds.back() == L, "pipeline stage bounds must cover units 0.." << L - 1);
  auto stage_of = [&](int u) { return static_cast<int>(std::upper_bound(bounds.begin(), bounds.end(), u) - bounds.begin()) - 1; };
  const std::vector<NetSkipLife> lives =
      skip_lives(units, NetCarry{sample.xt.narrow(0, 0, 1), {}, {}}, sample.t.narrow(0, 0, 1), sample.cond);
  PipeSkipRoutes r;
  r.out.resize(static_cast<size_t>(std::max(0, S - 1)));
  r.in.resize(static_cast<size_t>(S));
  for (int s = 0; s + 1 < S; ++s) {
    const int u = bounds[static_cast<size_t>(s) + 1] - 1;  // the stage's last unit
    std::vector<const NetSkipLife*> open;                   // the skips live after it, by slot
    for (const NetSkipLife& x : lives)
      if (x.made <= u && u < x.read) {
        if (static_cast<int>(open.size()) <= x.slot) open.resize(static_cast<size_t>(x.slot) + 1, nullptr);
        open[static_cast<size_t>(x.slot)] = &x;
      }
    r.slots = std::max(r.slots, static_cast<int>(open.size()));
    for (int i = 0; i < static_cast<int>(open.size()); ++i) {
      const NetSkipLife* x = open[static_cast<size_t>(i)];
      DDM_CHECK(x, "pipeline: skip slot " << i << " after unit " << u << " has no life (a slot below an open one is empty)");
      // The last stage holds a skip no unit reads.
      const int holder = stage_of(x->made), reader = x->read < L ? stage_of(x->read) : S - 1;
      int& route = r.out[static_cast<size_t>(s)].emplace_back();
      if (holder < s) {
        route = PipeSkipRoutes::kElsewhere;
      } else if (reader <= s + 1) {
        route = PipeSkipRoutes::kCarried;
      } else {
        route = reader;
        r.in[static_cast<size_t>(reader)].push_back({s, i, x->row_shape});
      }
    }
  }
  return r;
}

}  // namespace ddm
