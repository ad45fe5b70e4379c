// The parallel layout of a job (see layout.h).
#include "parallel/layout.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace ddm {

std::vector<int> ParallelLayout::pipeline_ranks() const {
  std::vector<int> out;
  for (int s = 0; s < pp; ++s) out.push_back(pipelined() ? s * replicas + replica : rank);
  return out;
}

std::vector<int> ParallelLayout::stage_ranks() const {
  std::vector<int> out;
  for (int r = 0; r < replicas; ++r) out.push_back(pipelined() ? stage * replicas + r : r);
  return out;
}

ParallelLayout derive_layout(const RunConfig& cfg, int world, int rank) {
  const ParallelConfig& p = cfg.parallel;
  const TrainConfig& tc = cfg.train;
  ParallelLayout l;
  l.world = world, l.rank = rank;
  l.pp = static_cast<int>(p.pp);
  l.mode = l.pp > 1 ? ParallelMode::kPipeline : p.mode == SyncMode::kDiloco ? ParallelMode::kDiloco : ParallelMode::kData;
  const bool pipelined = l.pipelined();
  DDM_CHECK(!pipelined || (world % l.pp == 0 && (p.dp == 0 || p.dp * l.pp == world)),
            "rank " << rank << ": parallel.pp = " << l.pp << " pipeline stages"
                    << (p.dp > 0 ? " x parallel.dp = " + std::to_string(p.dp) + " replicas" : "")
                    << " but the job has " << world << (world == 1 ? " process" : " processes")
                    << "; a pipeline runs one process per stage: launch "
                    << l.pp * std::max<int64_t>(1, p.dp) << " processes"
                    << (p.dp == 0 ? " (or a multiple of " + std::to_string(l.pp) + " for data-parallel replicas)" : ""));
  DDM_CHECK(!pipelined || !tc.checkpoint_activations,
            "train.checkpoint_activations is not supported with pipeline stages (parallel.pp = "
                << l.pp << "): a stage keeps each micro-batch's activations for its split backward; turn one of them off");
  DDM_CHECK(!tc.cuda_graphs || (world == 1 && !l.diloco()),
            "rank " << rank << ": train.cuda_graphs captures one process's whole step, but the job has " << world
                    << (world == 1 ? " process with DiLoCo" : " processes")
                    << " (their gradient all-reduce, a pipeline's sends and DiLoCo's outer step run outside what ddm "
                       "captures); turn train.cuda_graphs off, or train with one process");
  DDM_CHECK(pipelined || p.dp == 0 || p.dp == world,
            "parallel.dp = " << p.dp << " but the job has " << world
                             << " processes; set parallel.dp = 0 (every process) or launch " << p.dp << " processes");
  l.replicas = pipelined ? world / l.pp : world;  // every stage of a pipeline replica takes that replica's batch
  l.stage = pipelined ? rank / l.replicas : 0;
  l.replica = pipelined ? rank % l.replicas : rank;
  DDM_CHECK(tc.batch_size % (static_cast<int64_t>(l.replicas) * tc.grad_accum) == 0,
            "train.batch_size = " << tc.batch_size << " does not split into " << l.replicas << " rank"
                                  << (l.replicas > 1 ? "s" : "") << " x " << tc.grad_accum
                                  << " micro-batch" << (tc.grad_accum > 1 ? "es" : "")
                                  << " of equal size; the global batch must be a multiple of "
                                  << l.replicas * tc.grad_accum << " (or change train.grad_accum"
                                  << (pipelined ? ", the pipeline's micro-batches, or parallel.dp)" : " / the process count)")
                                  << (l.diloco() ? "; with parallel.mode = \"diloco\" each replica takes its share of it" : ""));
  l.local_batch = tc.batch_size / l.replicas;
  return l;
}

}  // namespace ddm
