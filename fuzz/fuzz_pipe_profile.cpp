// Fuzz target: a pipeline profile (`ddm plan --profile FILE`) -> read_profile, then the planner on
// it for 2 devices, as `ddm plan` would use it.
#include "fuzz_util.h"
#include "pipeline/plan.h"
#include "pipeline/profile.h"

namespace {
std::string g_path;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  g_path = ddm::fuzz::scratch_dir() + "/profile.json";
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ddm::fuzz::write_bytes(g_path, data, size);
  ddm::fuzz::expect_errors([&] {
    const ddm::PipeProfile p = ddm::read_profile(g_path);
    ddm::PipeMachine m;
    m.devices = 2;
    ddm::PipePlanOptions o;
    o.batch = 8, o.micro = {2};
    if (p.units.size() < 2) o.stages = {1};
    ddm::plan_pipeline(p, m, o);
  });
  return 0;
}
