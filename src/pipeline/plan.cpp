// The planner's search; the model of each candidate is described in plan.h.
#include "pipeline/plan.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "pipeline/prepare.h"

namespace ddm {
namespace {

std::vector<int> divisors(int64_t n, int64_t most) {
  std::vector<int> d;
  for (int64_t k = 1; k <= std::min(n, most); ++k)
    if (n % k == 0) d.push_back(static_cast<int>(k));
  return d;
}

// The link as the activations see it: their bytes scaled by the wire's format.
PipeLink activation_link(const PipeMachine& m) {
  PipeLink l = m.link;
  l.bandwidth /= m.activation_bytes;
  return l;
}

// The tasks of one candidate (see plan.h).
std::vector<PipeTask> tasks_of(const PipeProfile& p, const PipeMachine& m, const PipePartition& part, int64_t rows) {
  std::vector<PipeTask> out;
  for (const PipeTaskProfile& t : p.tasks) {
    PipeTask k;
    k.name = t.name, k.rows = rows, k.consumer = 0, k.cross_iteration = !t.uses_weights;
    k.quantum = prepare_quantum(rows);  // the pieces a run can place (pipeline/prepare.h)
    for (const auto& [r, ms] : t.cost) k.cost.push_back({r, ms / m.speed});
    k.send = m.link.time(t.output_bytes_per_row * static_cast<double>(rows));
    out.push_back(k);
  }
  if (!p.self_cond) return out;
  const int S = static_cast<int>(part.first.size()) - 1;
  for (int s = 0; s < S; ++s) {
    // In partial batches like the prepare tasks (the runtime's pieces are whole quanta of a few
    // rows; its rows go on to the next stage once all of them ran), after the previous stage's
    // pass; stage 0's after this iteration's rows of the prepare phase.
    PipeTask k;
    k.name = "self-cond pass, stage " + std::to_string(s);
    k.rows = rows, k.consumer = 0, k.ranks = {part.rank_of(s)}, k.cross_iteration = false;
    k.after = static_cast<int>(out.size()) - 1;
    k.quantum = prepare_quantum(rows);
    for (const PipeUnitSample& x : p.units.front().samples) {
      double ms = 0;
      for (int l = part.first[s]; l < part.first[s + 1]; ++l)
        for (const PipeUnitSample& y : p.units[l].samples)
          if (y.rows == x.rows) ms += y.forward_nograd;
      k.cost.push_back({x.rows, ms / m.speed});
    }
    const int64_t last = part.first[s + 1] - 1;
    const double bytes = s + 1 < S ? p.units_at(rows)[last].cut_bytes : p.x_bytes_per_row * static_cast<double>(rows);
    k.send = s + 1 < S && part.rank_of(s) == part.rank_of(s + 1) ? 0 : activation_link(m).time(bytes);
    out.push_back(k);
  }
  return out;
}

}  // namespace

std::string PipePlan::cuts_text() const {
  std::string t;
  for (size_t s = 0; s + 1 < partition.first.size(); ++s) {
    const int a = partition.first[s], b = partition.first[s + 1] - 1;
    t += (s ? " | " : "") + units[a].name + (b > a ? ".." + units[b].name : "");
    if (!partition.stage_rank.empty()) t += " (r" + std::to_string(partition.rank_of(static_cast<int>(s))) + ")";
  }
  return t;
}

std::vector<PipePlan> plan_pipeline(const PipeProfile& p, const PipeMachine& m, const PipePlanOptions& o) {
  const int L = static_cast<int>(p.units.size());
  DDM_CHECK(m.devices >= 1, "devices must be >= 1, got " << m.devices);
  DDM_CHECK(o.batch >= 1, "the global batch must be >= 1, got " << o.batch);
  DDM_CHECK(m.link.bandwidth > 0 && m.link.latency >= 0, "the link needs a bandwidth > 0 and a latency >= 0");
  DDM_CHECK(m.activation_bytes > 0 && m.activation_bytes <= 1, "activation_bytes must be in (0, 1], got " << m.activation_bytes);
  const PipeLink act = activation_link(m);
  std::vector<int> stages = o.stages;
  if (stages.empty())
    for (int s : divisors(m.devices, L)) stages.push_back(s);
  for (int s : stages) {
    DDM_CHECK(s >= 1 && m.devices % s == 0, "a pipeline of " << s << " stages does not divide " << m.devices
                                                             << " devices into equal replicas: use a divisor of " << m.devices);
    DDM_CHECK(s <= L, "a pipeline of " << s << " stages needs at least " << s << " units, but the model has " << L);
  }
  // --schedule may name the one-stage plans too (data-parallel, dp-sharded: the table's names); a
  // list of those alone plans no pipeline.
  const auto one_stage = [](const std::string& n) { return n == "data-parallel" || n == "dp-sharded"; };
  std::vector<std::string> schedules, dp_names;
  for (const std::string& n : o.schedules.empty() ? schedule_names() : o.schedules)
    (one_stage(n) ? dp_names : schedules).push_back(n);
  if (dp_names.empty()) dp_names = {"data-parallel", "dp-sharded"};
  std::vector<PipePlan> plans;
  std::string last_error;
  for (int S : stages) {
    const int replicas = m.devices / S;
    DDM_CHECK(o.batch % replicas == 0, "the global batch " << o.batch << " does not split over " << replicas
                                                           << " data-parallel replicas of a " << S << "-stage pipeline");
    const int64_t replica_batch = o.batch / replicas;
    std::vector<int> micro = o.micro;
    if (micro.empty()) micro = divisors(replica_batch, 64);
    for (int M : micro) {
      DDM_CHECK(M >= 1 && replica_batch % M == 0, "the micro-batch count " << M << " does not divide a replica's batch of "
                                                                           << replica_batch << " (global batch " << o.batch
                                                                           << " over " << replicas << " replicas)");
      const int64_t rows = replica_batch / M;
      const std::vector<PipeUnit> units = p.units_at(rows, m.speed);
      // Data parallelism, and with its optimizer state sharded (parallel.shard_optimizer): each replica
      // holds the weights and gradients whole, the moments and the EMA of 1/replicas (2 + 3/d of the
      // 5 float32 copies in state_bytes).
      std::vector<PipeUnit> sharded_units = units;
      for (PipeUnit& u : sharded_units) u.state_bytes *= (2 + 3.0 / replicas) / 5;
      const std::vector<std::string> names =
          S > 1 ? schedules : replicas > 1 ? dp_names : std::vector<std::string>{"single"};
      for (const std::string& name : names) {
        PipePlan plan;
        plan.stages = S, plan.replicas = replicas, plan.micro = M, plan.rows = rows, plan.units = units;
        const bool sharded = name == "dp-sharded";
        const bool v = is_v_schedule(name);
        if (v && 2 * S > L) {
          last_error = "a V-shaped pipeline over " + std::to_string(S) + " ranks needs " + std::to_string(2 * S) +
                       " units; the model has " + std::to_string(L);
          continue;
        }
        plan.actions = make_schedule(S == 1 ? "gpipe" : name, S, M);
        plan.schedule = name;
        const int stage_count = plan.actions.stages;
        try {
          if (static_cast<int>(o.first.size()) == stage_count + 1) {
            DDM_CHECK(o.first.front() == 0 && o.first.back() == L && std::is_sorted(o.first.begin(), o.first.end()),
                      "a fixed split must start at unit 0, end at " << L << " and increase");
            plan.partition.first = o.first;
            plan.partition.stage_rank = plan.actions.stage_rank;
          } else if (v) {
            plan.partition = partition_units_v(units, S, peak_in_flight(plan.actions), m.memory, act);
          } else {
            plan.partition = partition_units(sharded ? sharded_units : units, S, peak_in_flight(plan.actions), m.memory, act);
          }
        } catch (const Error& e) {
          last_error = e.what();
          continue;
        }
        plan.costs = costs_of_partition(units, plan.partition, act);
        for (int r = 0; r < S; ++r) {
          double params = 0, backward = 0;
          for (int s = 0; s < stage_count; ++s) {
            if (plan.actions.rank_of(s) != r) continue;
            for (int l = plan.partition.first[s]; l < plan.partition.first[s + 1]; ++l) params += units[l].state_bytes / 20;
            backward += plan.costs.stage[s].input_grad + plan.costs.stage[s].weight_grad;
          }
          const double d = replicas;
          double t = params / (sharded ? d : 1.0) / 1e6 * p.optimizer_ms_per_mparam / m.speed;
          if (replicas > 1) {
            const double ring = 2 * (d - 1) / d * 4 * params / m.link.bandwidth + 2 * (d - 1) * m.link.latency;
            t += std::max(0.0, ring - backward);
          }
          // Sharded: after the update every replica's range of the weights goes to the others (an
          // all-gather's bytes), with nothing left to overlap it.
          if (sharded) t += (d - 1) / d * 4 * params / m.link.bandwidth + (d - 1) * m.link.latency;
          plan.costs.optimizer.push_back(t);
          plan.sync = std::max(plan.sync, t);
        }
        plan.costs.tasks = tasks_of(p, m, plan.partition, rows);
        plan.serial = simulate(with_serial_tasks(plan.actions, plan.costs), plan.costs);
        plan.filled = fill_bubbles(plan.actions, plan.costs);
        plans.push_back(std::move(plan));
      }
    }
  }
  DDM_CHECK(!plans.empty(), "no pipeline plan fits: " << last_error);
  std::stable_sort(plans.begin(), plans.end(), [](const PipePlan& a, const PipePlan& b) {
    return a.filled_iteration() < b.filled_iteration();
  });
  return plans;
}

}  // namespace ddm
