// make_engine (parallel/engine.h): the engine of the layout's mode.
#include "parallel/engine.h"

namespace ddm {

std::unique_ptr<Engine> make_engine(const EngineParts& parts) {
  switch (parts.layout.mode) {
    case ParallelMode::kDiloco:
      return make_diloco_engine(parts);
    case ParallelMode::kPipeline:
      return make_pipeline_engine(parts);
    case ParallelMode::kData:
      break;
  }
  return make_data_parallel_engine(parts);
}

}  // namespace ddm
