// SplitBackward: the input-gradient pass now, the weight-gradient pass later, from one graph
// (see split_backward.h for the method).
#include "pipeline/split_backward.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "core/error.h"

namespace ddm {

namespace ag = torch::autograd;

struct SplitBackward::Part {
  std::shared_ptr<ag::Node> node;    // a frontier node; null: the part of the roots that reach no input
  ag::edge_list roots;               // where W starts
  std::vector<torch::Tensor> grads;  // ... with these gradients (a frontier's: kept during I)
  ag::edge_list outputs;             // the parameters' accumulators it reaches
  bool fired = false;                // the frontier's hook ran during I
};

namespace {

// Keeps the gradients a frontier node receives during I, passing them on unchanged.
struct Keep : ag::FunctionPreHook {
  std::vector<torch::Tensor>* into;
  bool* fired;
  Keep(std::vector<torch::Tensor>* i, bool* f) : into(i), fired(f) {}
  ag::variable_list operator()(const ag::variable_list& grads) override {
    *into = grads, *fired = true;
    return grads;
  }
};

constexpr int kToInput = 1, kToParam = 2;

// For every node reachable from `from`: which of an input (kToInput) and a parameter (kToParam) it
// leads to. Iterative (graphs are thousands of nodes deep).
void mark_reach(const std::vector<ag::Node*>& from, const std::unordered_set<ag::Node*>& input_acc,
                const std::unordered_set<ag::Node*>& param_acc, std::unordered_map<ag::Node*, int>& reach) {
  std::vector<std::pair<ag::Node*, size_t>> stack;
  for (ag::Node* r : from) {
    if (!r || reach.count(r)) continue;
    reach[r] = 0, stack.push_back({r, 0});
    while (!stack.empty()) {
      auto& [n, i] = stack.back();
      if (i < n->next_edges().size()) {
        ag::Node* c = n->next_edges()[i++].function.get();
        if (c && !reach.count(c)) reach[c] = 0, stack.push_back({c, 0});
        continue;
      }
      int r2 = (input_acc.count(n) ? kToInput : 0) | (param_acc.count(n) ? kToParam : 0);
      for (const ag::Edge& e : n->next_edges())
        if (e.function) r2 |= reach.at(e.function.get());
      reach[n] = r2;
      stack.pop_back();
    }
  }
}

}  // namespace

std::vector<torch::Tensor> SplitBackward::input_grads(const std::vector<torch::Tensor>& roots,
                                                      const std::vector<torch::Tensor>& grads,
                                                      const std::vector<torch::Tensor>& inputs,
                                                      const std::vector<torch::Tensor>& params) {
  DDM_CHECK(!pending_, "SplitBackward: input_grads twice before weight_grads");
  DDM_CHECK(grads.empty() || grads.size() == roots.size(), "SplitBackward: " << grads.size() << " gradients for " << roots.size() << " roots");
  roots_ = roots, grads_ = grads, params_ = params, parts_.clear(), split_ = false, pending_ = true;
  if (roots.empty()) return std::vector<torch::Tensor>(inputs.size());

  // The accumulators (leaves' gradient nodes) of the inputs and of the parameters.
  ag::edge_list held;  // keeps them alive while their addresses are compared
  std::unordered_set<ag::Node*> input_acc, param_acc;
  for (const torch::Tensor& x : inputs)
    if (x.requires_grad()) held.push_back(ag::impl::gradient_edge(x)), input_acc.insert(held.back().function.get());
  for (const torch::Tensor& p : params)
    if (p.requires_grad()) held.push_back(ag::impl::gradient_edge(p)), param_acc.insert(held.back().function.get());
  ag::edge_list root_edges;
  std::vector<ag::Node*> from;
  for (const torch::Tensor& r : roots) root_edges.push_back(ag::impl::gradient_edge(r)), from.push_back(root_edges.back().function.get());
  std::unordered_map<ag::Node*, int> reach;
  mark_reach(from, input_acc, param_acc, reach);
  auto reach_of = [&](ag::Node* n) { return n ? reach.at(n) : 0; };

  // The parameters' accumulators reachable from `start` (nodes off the I set, leading to one).
  auto params_from = [&](const std::vector<ag::Edge>& start, ag::edge_list& out, std::unordered_set<ag::Node*>& seen) {
    std::vector<ag::Edge> stack(start.begin(), start.end());
    while (!stack.empty()) {
      ag::Edge e = stack.back();
      stack.pop_back();
      if (!e.function || !(reach_of(e.function.get()) & kToParam) || !seen.insert(e.function.get()).second) continue;
      if (param_acc.count(e.function.get())) out.push_back(ag::Edge(e.function, 0));
      for (const ag::Edge& c : e.function->next_edges()) stack.push_back(c);
    }
  };
  // The roots that reach no input: one part, started from them with their own gradients.
  {
    auto part = std::make_shared<Part>();
    std::unordered_set<ag::Node*> seen;
    std::vector<ag::Edge> start;
    for (size_t i = 0; i < roots.size(); ++i) {
      ag::Node* n = root_edges[i].function.get();
      if (!n || (reach_of(n) & kToInput) || !(reach_of(n) & kToParam)) continue;
      part->roots.push_back(root_edges[i]);
      part->grads.push_back(grads.empty() ? torch::ones_like(roots[i]) : grads[i]);
      start.push_back(root_edges[i]);
    }
    params_from(start, part->outputs, seen);
    part->fired = true;
    if (!part->roots.empty()) parts_.push_back(part);
  }
  // The frontier: I nodes with an edge off the set toward a parameter, in the engine's order
  // (latest-made first): a fixed order, so a parameter read in two places sums its two
  // contributions alike in every run.
  std::vector<ag::Node*> on_i;
  for (const auto& [n, r] : reach)
    if (r & kToInput) on_i.push_back(n);
  std::sort(on_i.begin(), on_i.end(), [](ag::Node* a, ag::Node* b) { return a->sequence_nr() > b->sequence_nr(); });
  for (ag::Node* n : on_i) {
    std::vector<ag::Edge> off;
    for (const ag::Edge& e : n->next_edges())
      if (e.function && !(reach_of(e.function.get()) & kToInput) && (reach_of(e.function.get()) & kToParam)) off.push_back(e);
    if (off.empty()) continue;
    auto part = std::make_shared<Part>();
    std::unordered_set<ag::Node*> seen;
    params_from(off, part->outputs, seen);
    part->node = n->shared_from_this();
    parts_.push_back(part);
  }
  // I, with the frontier's hooks on for its duration.
  std::vector<std::pair<ag::Node*, ag::FunctionPreHook*>> hooks;
  std::vector<torch::Tensor> out;
  for (const auto& p : parts_)
    if (p->node) {
      auto h = std::make_unique<Keep>(&p->grads, &p->fired);
      hooks.push_back({p->node.get(), h.get()});
      p->node->add_pre_hook(std::move(h));
    }
  auto unhook = [&] {
    for (const auto& nh : hooks) {  // (no structured binding: clang's C++17 cannot capture one in a lambda)
      ag::FunctionPreHook* h = nh.second;
      auto& v = nh.first->pre_hooks();
      v.erase(std::remove_if(v.begin(), v.end(), [h](const std::unique_ptr<ag::FunctionPreHook>& x) { return x.get() == h; }), v.end());
    }
  };
  try {
    bool any_input = false;
    for (const torch::Tensor& x : inputs) any_input = any_input || x.requires_grad();
    out = any_input ? ag::grad(roots, inputs, grads, /*retain_graph=*/true, /*create_graph=*/false, /*allow_unused=*/true)
                    : std::vector<torch::Tensor>(inputs.size());
  } catch (...) {
    unhook();
    throw;
  }
  unhook();
  split_ = std::all_of(parts_.begin(), parts_.end(), [](const std::shared_ptr<Part>& p) { return p->fired; });
  if (!split_) {
    parts_.clear();
    return out;
  }
  for (const auto& p : parts_)
    if (p->node) {
      // Start from the node's inputs that received a gradient...
      std::vector<torch::Tensor> g = std::move(p->grads);
      p->grads.clear();
      for (size_t i = 0; i < g.size(); ++i)
        if (g[i].defined()) p->roots.push_back(ag::Edge(p->node, static_cast<uint32_t>(i))), p->grads.push_back(g[i]);
      // ... and cut its edges into the input's chain, which I has run: W from here reaches only
      // the parameters' side (its derivative skips an output whose edge is invalid), and the
      // engine's walk of the graph before it runs stays as small. The graph is not used again.
      // (Assigned directly: set_next_edge refuses a node that already has a parent.)
      for (ag::Edge& e : p->node->next_edges())
        if (e.function && (reach_of(e.function.get()) & kToInput)) e = ag::Edge();
    }
  return out;
}

void SplitBackward::weight_grads() {
  DDM_CHECK(pending_, "SplitBackward: weight_grads without input_grads");
  pending_ = false;
  if (!split_) {
    if (!params_.empty() && !roots_.empty())
      ag::backward(roots_, grads_, /*retain_graph=*/false, /*create_graph=*/false, params_);
  } else {
    for (const auto& p : parts_)
      if (!p->roots.empty() && !p->outputs.empty())
        ag::Engine::get_default_engine().execute(p->roots, p->grads, /*keep_graph=*/true, /*create_graph=*/false,
                                                 /*accumulate_grad=*/true, p->outputs);
  }
  parts_.clear(), roots_.clear(), grads_.clear(), params_.clear();
}

}  // namespace ddm
