// ParallelLayout (src/parallel/layout.h): who does what in a job, from the config, world size and rank,
// and a clear error, naming the keys and what to launch, for every job that does not fit.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/config.h"
#include "parallel/layout.h"
#include "test_util.h"

using namespace ddm;
using ddm::test::error_message;

namespace {
RunConfig job(int64_t pp, int64_t dp, int64_t batch, int64_t micro, SyncMode mode = SyncMode::kDp) {
  RunConfig c;
  c.parallel.pp = pp;
  c.parallel.dp = dp;
  c.parallel.mode = mode;
  c.train.batch_size = batch;
  c.train.grad_accum = micro;
  return c;
}
}  // namespace

TEST(ParallelLayout, OneProcessIsTrivialDataParallelism) {
  const ParallelLayout l = derive_layout(job(1, 0, 32, 1), 1, 0);
  EXPECT_EQ(l.mode, ParallelMode::kData);
  EXPECT_EQ(l.replicas, 1);
  EXPECT_EQ(l.local_batch, 32);
  EXPECT_EQ(l.shard_offset(), 0);
}

TEST(ParallelLayout, DataParallelRanksTakeConsecutiveShares) {
  for (int rank = 0; rank < 4; ++rank) {
    const ParallelLayout l = derive_layout(job(1, 0, 64, 2), 4, rank);
    EXPECT_EQ(l.replicas, 4);
    EXPECT_EQ(l.replica, rank);
    EXPECT_EQ(l.local_batch, 16);
    EXPECT_EQ(l.shard_offset(), 16 * rank);
    EXPECT_EQ(l.stage_ranks(), (std::vector<int>{0, 1, 2, 3}));
  }
  EXPECT_EQ(derive_layout(job(1, 0, 64, 1, SyncMode::kDiloco), 2, 1).mode, ParallelMode::kDiloco);
}

// Three replicas of a two-stage pipeline: rank = stage x 3 + replica.
TEST(ParallelLayout, PipelineReplicasInterleaveByStage) {
  for (int rank = 0; rank < 6; ++rank) {
    const ParallelLayout l = derive_layout(job(2, 3, 48, 4), 6, rank);
    EXPECT_TRUE(l.pipelined());
    EXPECT_EQ(l.replicas, 3);
    EXPECT_EQ(l.stage, rank / 3);
    EXPECT_EQ(l.replica, rank % 3);
    EXPECT_EQ(l.local_batch, 16);
    EXPECT_EQ(l.shard_offset(), 16 * (rank % 3));
    EXPECT_EQ(l.pipeline_ranks(), (std::vector<int>{rank % 3, 3 + rank % 3}));
    EXPECT_EQ(l.stage_ranks(), (std::vector<int>{3 * (rank / 3), 3 * (rank / 3) + 1, 3 * (rank / 3) + 2}));
  }
  EXPECT_EQ(derive_layout(job(2, 0, 48, 4), 4, 3).replicas, 2);  // parallel.dp = 0: every process
}

TEST(ParallelLayout, JobsThatDoNotFitAreClearErrors) {
  EXPECT_EQ(error_message([] { derive_layout(job(2, 0, 32, 4), 3, 1); }),
            "rank 1: parallel.pp = 2 pipeline stages but the job has 3 processes; a pipeline runs one process per "
            "stage: launch 2 processes (or a multiple of 2 for data-parallel replicas)");
  EXPECT_EQ(error_message([] { derive_layout(job(2, 0, 32, 4), 1, 0); }),
            "rank 0: parallel.pp = 2 pipeline stages but the job has 1 process; a pipeline runs one process per "
            "stage: launch 2 processes (or a multiple of 2 for data-parallel replicas)");
  EXPECT_EQ(error_message([] { derive_layout(job(2, 2, 32, 4), 2, 0); }),
            "rank 0: parallel.pp = 2 pipeline stages x parallel.dp = 2 replicas but the job has 2 processes; a pipeline "
            "runs one process per stage: launch 4 processes");
  EXPECT_EQ(error_message([] { derive_layout(job(1, 3, 32, 1), 2, 0); }),
            "parallel.dp = 3 but the job has 2 processes; set parallel.dp = 0 (every process) or launch 3 processes");
  EXPECT_EQ(error_message([] { derive_layout(job(1, 0, 30, 4), 2, 0); }),
            "train.batch_size = 30 does not split into 2 ranks x 4 micro-batches of equal size; the global batch must "
            "be a multiple of 8 (or change train.grad_accum / the process count)");
  EXPECT_NE(error_message([] { derive_layout(job(1, 0, 30, 1, SyncMode::kDiloco), 4, 0); })
                .find("with parallel.mode = \"diloco\" each replica takes its share of it"),
            std::string::npos);
  EXPECT_NE(error_message([] { derive_layout(job(2, 0, 30, 4), 2, 0); }).find("the pipeline's micro-batches, or parallel.dp)"),
            std::string::npos);
}
