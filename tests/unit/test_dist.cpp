// src/dist: environment detection for every launcher (and every malformed variable), Slurm
// hostlists, the Comm collectives and their error messages (ranks as threads on a shared HashStore,
// plus real processes over TCP on 127.0.0.1), and GradSync's buckets, hooks and averaged gradients.
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "dist/env.h"
#include "test_util.h"

using namespace ddm;
using ddm::test::error_message;

namespace {

using Vars = std::map<std::string, std::string>;

DistEnv detect(const Vars& vars) {
  return detect_dist_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string detect_error(const Vars& vars) { return error_message([&] { detect(vars); }); }

Vars torchrun_vars() {
  return {{"RANK", "3"},         {"WORLD_SIZE", "4"},    {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "1"},  {"MASTER_ADDR", "10.0.0.1"},
          {"MASTER_PORT", "29400"},  {"TORCHELASTIC_RESTART_COUNT", "2"}, {"TORCHELASTIC_MAX_RESTARTS", "3"},
          {"TORCHELASTIC_RUN_ID", "job7"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
}

}  // namespace

TEST(DistEnv, NoVariablesIsOneProcess) {
  const auto e = detect({});
  EXPECT_EQ(e.launcher, "none");
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_FALSE(e.distributed());
}

TEST(DistEnv, Torchrun) {
  const auto e = detect(torchrun_vars());
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 29400);
  EXPECT_TRUE(e.agent_store);
  EXPECT_EQ(e.store_prefix, "/worker/attempt_2");
  EXPECT_EQ(e.restart_count, 2);
  EXPECT_EQ(e.max_restarts, 3);
  EXPECT_EQ(e.run_id, "job7");
  EXPECT_TRUE(e.distributed());
  EXPECT_NE(e.describe().find("rank 3/4"), std::string::npos) << e.describe();
}

TEST(DistEnv, DdmLauncherAndBareEnv) {
  auto v = torchrun_vars();
  v["DDM_LAUNCHER"] = "ddm";
  v["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  auto e = detect(v);
  EXPECT_EQ(e.launcher, "ddm");
  EXPECT_FALSE(e.agent_store);
  e = detect({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(e.launcher, "env");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.store_prefix, "");
  // One process needs no master.
  e = detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_FALSE(e.distributed());
}

TEST(DistEnv, MalformedTorchrunVariablesAreNamed) {
  struct Case {
    std::string var, value, expect;
  };
  const std::vector<Case> cases = {
      {"RANK", "x", "RANK='x' is not an integer"},
      {"RANK", "1.5", "RANK='1.5' is not an integer"},
      {"RANK", "-1", "RANK=-1 is out of range"},
      {"RANK", "4", "RANK=4 is not below WORLD_SIZE=4"},
      {"WORLD_SIZE", "0", "WORLD_SIZE=0 is out of range"},
      {"WORLD_SIZE", "four", "WORLD_SIZE='four' is not an integer"},
      {"LOCAL_RANK", "2", "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"},
      {"LOCAL_WORLD_SIZE", "9", "LOCAL_WORLD_SIZE=9 is out of range"},
      {"GROUP_RANK", "a", "GROUP_RANK='a' is not an integer"},
      {"MASTER_PORT", "70000", "MASTER_PORT=70000 is out of range"},
      {"MASTER_PORT", "0", "MASTER_PORT=0 is out of range"},
      {"MASTER_PORT", "29500x", "MASTER_PORT='29500x' is not an integer"},
      {"TORCHELASTIC_RESTART_COUNT", "?", "TORCHELASTIC_RESTART_COUNT='?' is not an integer"},
      {"TORCHELASTIC_MAX_RESTARTS", "-2", "TORCHELASTIC_MAX_RESTARTS=-2 is out of range"},
      {"TORCHELASTIC_USE_AGENT_STORE", "yes", "TORCHELASTIC_USE_AGENT_STORE='yes' is not a boolean"},
      {"DDM_LAUNCHER", "other", "DDM_LAUNCHER='other' is not known"},
      {"MASTER_ADDR", "", "MASTER_ADDR is not set but WORLD_SIZE=4"},
      {"MASTER_PORT", "", "MASTER_PORT is not set but WORLD_SIZE=4"},
      {"WORLD_SIZE", "", "RANK=3 is set but WORLD_SIZE is not"},
      {"RANK", "", "RANK is not set but WORLD_SIZE is"},
  };
  for (const auto& c : cases) {
    auto v = torchrun_vars();
    v[c.var] = c.value;
    const auto msg = detect_error(v);
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.var << "=" << c.value << " gave: " << msg;
  }
}

TEST(DistEnv, Slurm) {
  Vars v = {{"SLURM_PROCID", "5"},         {"SLURM_NTASKS", "8"},     {"SLURM_LOCALID", "1"},
            {"SLURM_NODEID", "2"},         {"SLURM_TASKS_PER_NODE", "2(x3),2"},
            {"SLURM_JOB_NODELIST", "gpu[007-010],cpu1"}, {"SLURM_JOB_ID", "123456"}};
  auto e = detect(v);
  EXPECT_EQ(e.launcher, "slurm");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.node_rank, 2);
  EXPECT_EQ(e.master_addr, "gpu007");
  EXPECT_EQ(e.master_port, 20000 + 123456 % 20000);
  EXPECT_EQ(e.run_id, "123456");
  EXPECT_FALSE(e.agent_store);
  v["MASTER_ADDR"] = "head";
  v["MASTER_PORT"] = "4000";
  v["SLURM_NTASKS_PER_NODE"] = "4";
  e = detect(v);
  EXPECT_EQ(e.master_addr, "head");
  EXPECT_EQ(e.master_port, 4000);
  EXPECT_EQ(e.local_world_size, 4);

  const std::vector<std::pair<Vars, std::string>> bad = {
      {{{"SLURM_PROCID", "0"}}, "SLURM_NTASKS is not"},
      {{{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "a"}}, "SLURM_PROCID=2 is not below"},
      {{{"SLURM_PROCID", "z"}, {"SLURM_NTASKS", "2"}}, "SLURM_PROCID='z' is not an integer"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}, "SLURM_JOB_NODELIST is set"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "a[1-"}}, "SLURM_JOB_NODELIST='a[1-'"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "a"}, {"SLURM_JOB_ID", "j"}},
       "SLURM_JOB_ID='j' is not an integer"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "a"}, {"MASTER_PORT", "-5"}},
       "MASTER_PORT=-5 is out of range"},
  };
  for (const auto& [vars, expect] : bad) {
    const auto msg = detect_error(vars);
    EXPECT_NE(msg.find(expect), std::string::npos) << expect << " gave: " << msg;
  }
}

TEST(DistEnv, OpenMpi) {
  Vars v = {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
            {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"SLURM_PROCID", "0"}};  // mpirun inside an allocation
  auto e = detect(v);
  EXPECT_EQ(e.launcher, "mpi");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
  v["OMPI_COMM_WORLD_LOCAL_SIZE"] = "1";
  v["OMPI_COMM_WORLD_LOCAL_RANK"] = "0";
  EXPECT_NE(detect_error(v).find("MASTER_ADDR is not set and mpirun placed"), std::string::npos) << detect_error(v);
  v["MASTER_ADDR"] = "n0";
  v["MASTER_PORT"] = "3000";
  e = detect(v);
  EXPECT_EQ(e.master_addr, "n0");
  EXPECT_EQ(e.master_port, 3000);
  EXPECT_EQ(e.node_rank, 1);
  v["OMPI_COMM_WORLD_SIZE"] = "x";
  EXPECT_NE(detect_error(v).find("OMPI_COMM_WORLD_SIZE='x' is not an integer"), std::string::npos);
  v["OMPI_COMM_WORLD_SIZE"] = "1";
  EXPECT_NE(detect_error(v).find("OMPI_COMM_WORLD_RANK=1 is not below OMPI_COMM_WORLD_SIZE=1"), std::string::npos)
      << detect_error(v);
}

TEST(DistEnv, SlurmHostlists) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_slurm_hostlist("a[01-03]"), (V{"a01", "a02", "a03"}));
  EXPECT_EQ(expand_slurm_hostlist("b7,c[2-3]"), (V{"b7", "c2", "c3"}));
  EXPECT_EQ(expand_slurm_hostlist("x[008-010]"), (V{"x008", "x009", "x010"}));
  EXPECT_EQ(expand_slurm_hostlist("node[01-02,07],gpu7"), (V{"node01", "node02", "node07", "gpu7"}));
  EXPECT_EQ(expand_slurm_hostlist("r[1-2]n[1-2]-ib"), (V{"r1n1-ib", "r1n2-ib", "r2n1-ib", "r2n2-ib"}));
  EXPECT_EQ(first_slurm_host("a[01-03]"), "a01");
  EXPECT_EQ(first_slurm_host("b7,c[2-3]"), "b7");
  EXPECT_EQ(first_slurm_host("x[008-010]"), "x008");
  EXPECT_EQ(first_slurm_host("n[0-99999999]"), "n0");  // stops at the first name
  for (const char* bad : {"", "a[1-", "a]", "a[3-1]", "a[]", "a[x]", "a,,b", "a[1-2"}) {
    const auto msg = error_message([&] { expand_slurm_hostlist(bad, "SLURM_JOB_NODELIST"); });
    EXPECT_NE(msg.find("SLURM_JOB_NODELIST='" + std::string(bad) + "' is not a Slurm hostlist"), std::string::npos)
        << bad << ": " << msg;
  }
}
