// Direct skip routes between pipeline stages (docs/pipeline.md): an open U-Net skip goes from the
// stage that makes it straight to the stage whose units read it, never through the stages between
// (as torchgpipe's @skippable does). Found once, alike on every stage, by running the backbone's
// units on one prepared row and watching its skip slots: a unit *touches* slot i when it pops it
// (a decoder block) or puts another tensor there (a ControlNet's zero convolutions); the stage of the
// unit that last touched a slot holds it, the stage of the next unit that touches it reads it. At the
// cut after stage s, slot i is then
//   carried      in the carry to s+1, when s holds it and s+1 reads it;
//   sent to t    directly to stage t > s+1, when s holds it (a placeholder takes its place in the
//                carry, so the slots keep their positions);
//   elsewhere    a placeholder, when an earlier stage holds it (it travels directly to its reader).
// Its gradient goes back the same way. A unit that reads a skip without popping or replacing it
// would see a placeholder: no backbone here does that. The lives of the skips are model/net.h's
// skip_lives.
#pragma once
#include <cstdint>
#include <vector>

#include "diffusion/objective.h"
#include "model/net.h"

namespace ddm {

struct PipeSkipRoutes {
  static constexpr int kCarried = -1, kElsewhere = -2;
  // [stage s < S - 1][slot]: kCarried, kElsewhere, or the stage the slot is sent to directly.
  std::vector<std::vector<int>> out;
  struct Direct {
    int from = 0, slot = 0;
    std::vector<int64_t> row_shape;  // one row's shape, e.g. [c, h, w]
  };
  std::vector<std::vector<Direct>> in;  // [stage]: the slots it receives directly, by (from, slot)
  int slots = 0;                        // the most skips open at any cut
};

// The routes for stages [bounds[s], bounds[s+1]) of `net`'s units, from one prepared row.
PipeSkipRoutes pipe_skip_routes(NetImpl& net, const Prepared& sample, const std::vector<int>& bounds);

}  // namespace ddm
