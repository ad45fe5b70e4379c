// One stage of a pipeline: forward, backward and their messages (see stage.h).
#include "pipeline/stage.h"

#include <algorithm>

#include <torch/autograd.h>

#include "core/error.h"

namespace ddm {

PipeStage::PipeStage(int stage, int stages, std::vector<NetUnit> units, std::vector<torch::Tensor> params,
                     PipeWire& wire, const PipeSkipRoutes& routes, int64_t rows)
    : stage_(stage),
      stages_(stages),
      units_(std::move(units)),
      params_(std::move(params)),
      wire_(wire),
      routes_(routes),
      rows_(rows),
      direct_bytes_(static_cast<size_t>(stages), 0) {
  DDM_CHECK(static_cast<int>(routes_.in.size()) == stages_, "pipeline: skip routes for " << routes_.in.size() << " stages, not " << stages_);
}

void PipeStage::begin_step(int micro_count, int window) {
  micro_.assign(static_cast<size_t>(micro_count), Micro{});
  first_bytes_ = 0;
  posted_.assign(static_cast<size_t>(micro_count), std::nullopt);
  taken_.assign(static_cast<size_t>(micro_count), false);
  next_post_ = 0;
  carry_shapes_.clear();
  if (stage_ == 0 || !carry_header_.defined() || wire_.here(stage_ - 1)) return;
  carry_shapes_ = header_shapes(carry_header_);
  // A window of micro-batches ahead: enough to keep the transfers ahead of the forwards, and at most
  // `window` carry buffers held at once.
  for (int m = 0; m < std::min(micro_count, window); ++m) post_next_carry();
}

void PipeStage::post_next_carry() {
  // A micro-batch whose carry was already received unposted (no schedule here does that) is skipped.
  while (next_post_ < static_cast<int>(posted_.size()) && taken_[static_cast<size_t>(next_post_)]) ++next_post_;
  if (carry_shapes_.empty() || next_post_ >= static_cast<int>(posted_.size())) return;
  const int m = next_post_++, prev = stage_ - 1;
  PostedCarry& c = posted_[static_cast<size_t>(m)].emplace();
  c.header = wire_.post_recv(torch::zeros({kCarryHeaderSize}, torch::kLong), prev, wire_.tag(prev, m, kCarryHeader));
  c.values = wire_.post_recv(torch::empty({numel_of(carry_shapes_)}, wire_.floats()), prev, wire_.tag(prev, m, kCarryValues));
  for (const PipeSkipRoutes::Direct& d : routes_.in[static_cast<size_t>(stage_)])
    c.direct.push_back(wire_.post_recv(torch::empty(direct_shape(d), wire_.floats()), d.from, wire_.tag(d.from, m, kSkip + 2 * d.slot)));
}

std::vector<int64_t> PipeStage::direct_shape(const PipeSkipRoutes::Direct& d) const {
  std::vector<int64_t> shape{rows_};
  shape.insert(shape.end(), d.row_shape.begin(), d.row_shape.end());
  return shape;
}

std::optional<PipeStage::PostedCarry>* PipeStage::posted_for(int micro) {
  const bool has = micro < static_cast<int>(posted_.size()) && posted_[static_cast<size_t>(micro)];
  return has ? &posted_[static_cast<size_t>(micro)] : nullptr;
}

void PipeStage::send_carry(const NetCarry& carry, int micro, bool first_pass, Micro* m) {
  // Under bf16 autocast a unit's output may be bfloat16: the carry travels as float32 (exact), and
  // the conversion is part of the graph, so the received gradient flows back through it.
  NetCarry k = carry;
  auto widen = [](torch::Tensor& t) {
    if (t.defined() && t.scalar_type() != torch::kFloat) t = t.to(torch::kFloat);
  };
  widen(k.h), widen(k.emb);
  for (torch::Tensor& t : k.skips) widen(t);
  // The skips routed straight to the stages that read them go there; the carry lists them as
  // placeholders (as it does a slot an earlier stage holds).
  const int s = stage_;
  const std::vector<int>* route = first_pass || routes_.out.empty() ? nullptr : &routes_.out[static_cast<size_t>(s)];
  DDM_CHECK(!route || route->size() == k.skips.size(),
            "pipeline: stage " << s << " sends " << k.skips.size() << " skips, its routes know " << route->size());
  std::vector<bool> carried(k.skips.size(), true);
  for (size_t i = 0; i < k.skips.size(); ++i) {
    const int r = route ? (*route)[i] : PipeSkipRoutes::kCarried;
    if (r == PipeSkipRoutes::kCarried) continue;
    carried[i] = false;
    if (r >= 0) {  // straight to the stage that reads it
      const torch::Tensor x = k.skips[i].contiguous();
      if (!wire_.here(r)) direct_bytes_[static_cast<size_t>(r)] = wire_.bytes(x);
      wire_.send(x, r, wire_.tag(s, micro, kSkip + 2 * static_cast<int>(i)));
      if (m) m->direct_roots.push_back({x, r, static_cast<int>(i)});
    }
  }
  std::vector<torch::Tensor> tensors;
  const torch::Tensor header = carry_header(k, carried, tensors);
  wire_.send(header, s + 1, wire_.tag(s, micro, first_pass ? kFirstHeader : kCarryHeader));
  torch::Tensor values = flat_of(tensors);
  if (!first_pass) carry_bytes_ = !wire_.here(s + 1) ? wire_.bytes(values) : 0;
  else if (!wire_.here(s + 1)) first_bytes_ += wire_.bytes(values);
  wire_.send(values, s + 1, wire_.tag(s, micro, first_pass ? kFirstValues : kCarryValues));
  if (m) m->roots = tensors;
}

NetCarry PipeStage::recv_carry(int micro, std::vector<torch::Tensor>& inputs, bool first_pass) {
  const int prev = stage_ - 1;
  const std::string what = "receiving from stage " + std::to_string(prev);
  std::optional<PostedCarry>* posted = first_pass ? nullptr : posted_for(micro);
  Recv hr = posted ? (*posted)->header
                   : wire_.post_recv(torch::zeros({kCarryHeaderSize}, torch::kLong), prev, wire_.tag(prev, micro, first_pass ? kFirstHeader : kCarryHeader));
  const torch::Tensor header = wire_.wait(hr, what);
  DDM_CHECK(!posted || torch::equal(header, carry_header_),
            "pipeline: stage " << stage_ << " received a carry for micro-batch " << micro
                               << " whose layout differs from the earlier micro-batches'");
  if (!first_pass && !carry_header_.defined()) carry_header_ = header.clone();
  if (!first_pass && micro < static_cast<int>(taken_.size())) taken_[static_cast<size_t>(micro)] = true;
  const std::vector<std::vector<int64_t>> shapes = header_shapes(header);
  Recv vr = posted ? (*posted)->values
                   : wire_.post_recv(torch::empty({numel_of(shapes)}, wire_.floats()), prev, wire_.tag(prev, micro, first_pass ? kFirstValues : kCarryValues));
  const torch::Tensor values = wire_.wait(vr, what);
  inputs.clear();
  for (torch::Tensor& t : split_flat(values, shapes)) inputs.push_back(first_pass ? t : t.requires_grad_(true));
  return carry_from(header, inputs);
}

void PipeStage::send_first_pass(const NetCarry& k, int micro) { send_carry(k, micro, /*first_pass=*/true, nullptr); }

NetCarry PipeStage::receive_first_pass(int micro) {
  std::vector<torch::Tensor> inputs;
  return recv_carry(micro, inputs, /*first_pass=*/true);
}

void PipeStage::send_first_out(const torch::Tensor& out, int micro) {
  const torch::Tensor x = out.to(torch::kFloat);  // (bfloat16 under autocast)
  if (!wire_.here(0)) first_bytes_ += wire_.bytes(x);
  wire_.send(x, 0, wire_.tag(stages_ - 1, micro, kFirstOut));
}

torch::Tensor PipeStage::forward(int micro, const Prepared& p) {
  Micro& m = micro_[static_cast<size_t>(micro)];
  const int s = stage_;
  NetCarry k;
  if (s == 0) {
    k.h = p.xt;
  } else {
    k = recv_carry(micro, m.inputs, /*first_pass=*/false);
    std::optional<PostedCarry>* posted = posted_for(micro);
    // The skips an earlier stage sends here directly, into their places.
    const auto& direct = routes_.in[static_cast<size_t>(s)];
    for (size_t j = 0; j < direct.size(); ++j) {
      const PipeSkipRoutes::Direct& d = direct[j];
      DDM_CHECK(d.slot < static_cast<int>(k.skips.size()) && !k.skips[static_cast<size_t>(d.slot)].defined(),
                "pipeline: stage " << s << " expected skip " << d.slot << " from stage " << d.from << " in place of a placeholder");
      Recv r = posted ? (*posted)->direct[j]
                      : wire_.post_recv(torch::empty(direct_shape(d), wire_.floats()), d.from, wire_.tag(d.from, micro, kSkip + 2 * d.slot));
      torch::Tensor x = wire_.wait(r, "receiving a skip from stage " + std::to_string(d.from));
      k.skips[static_cast<size_t>(d.slot)] = x.requires_grad_(true);
      m.direct_inputs.push_back(x);
    }
    if (posted) {
      posted->reset();    // its tensors live on as this micro-batch's inputs
      post_next_carry();  // the window moves on
    }
  }
  for (const NetUnit& u : units_) u.run(k, p.t, p.cond);
  if (last()) return k.h;
  send_carry(k, micro, /*first_pass=*/false, &m);
  // The gradients' receives, now: they arrive while this stage runs other micro-batches.
  std::vector<std::vector<int64_t>> shapes;
  for (const torch::Tensor& r : m.roots) shapes.push_back(r.sizes().vec());
  m.grad_recvs.push_back(wire_.post_recv(torch::empty({numel_of(shapes)}, wire_.floats()), s + 1, wire_.tag(s, micro, kGradient)));
  for (const DirectRoot& d : m.direct_roots)
    m.grad_recvs.push_back(wire_.post_recv(torch::empty(d.tensor.sizes(), wire_.floats()), d.to, wire_.tag(s, micro, kSkipGrad + 2 * d.slot)));
  return {};
}

void PipeStage::set_loss(int micro, torch::Tensor loss) {
  DDM_CHECK(last(), "pipeline: stage " << stage_ << " is not the last, it has no loss");
  micro_[static_cast<size_t>(micro)].roots = {std::move(loss)};
}

void PipeStage::backward(int micro, PipeOp op) {
  Micro& m = micro_[static_cast<size_t>(micro)];
  const int s = stage_;
  if (!last() && !m.received) {
    DDM_CHECK(m.grad_recvs.size() == 1 + m.direct_roots.size(), "pipeline: backward of micro-batch " << micro << " before its forward");
    std::vector<std::vector<int64_t>> shapes;
    for (const torch::Tensor& r : m.roots) shapes.push_back(r.sizes().vec());
    m.grads = split_flat(wire_.wait(m.grad_recvs[0], "receiving a gradient from stage " + std::to_string(s + 1)), shapes);
    for (size_t j = 0; j < m.direct_roots.size(); ++j)  // the gradients of the skips sent straight to their readers
      m.grads.push_back(wire_.wait(m.grad_recvs[1 + j], "receiving a skip's gradient from stage " + std::to_string(m.direct_roots[j].to)));
    m.grad_recvs.clear();
    m.received = true;
  }
  // Only what carries a gradient back: a carried tensor may depend on no trainable parameter at all
  // (a ControlNet's locked features), and its received gradient then has nowhere to go.
  std::vector<torch::Tensor> all_roots = m.roots, roots, grads;
  for (const DirectRoot& d : m.direct_roots) all_roots.push_back(d.tensor);
  for (size_t i = 0; i < all_roots.size(); ++i)
    if (all_roots[i].requires_grad()) {
      roots.push_back(all_roots[i]);
      if (!m.grads.empty()) grads.push_back(m.grads[i]);
    }
  std::vector<torch::Tensor> inputs = m.inputs;
  inputs.insert(inputs.end(), m.direct_inputs.begin(), m.direct_inputs.end());
  // The inputs' gradients: the carry's to the previous stage in one message, each directly received
  // skip's to the stage that sent it.
  auto send_input_grads = [&](std::vector<torch::Tensor> g) {
    for (size_t i = 0; i < g.size(); ++i)
      if (!g[i].defined()) g[i] = torch::zeros_like(inputs[i]);  // an input no unit here read
    const size_t n = m.inputs.size();
    wire_.send(flat_of(std::vector<torch::Tensor>(g.begin(), g.begin() + static_cast<std::ptrdiff_t>(n))), s - 1,
               wire_.tag(s - 1, micro, kGradient));
    const auto& in = routes_.in[static_cast<size_t>(s)];
    for (size_t j = 0; j < m.direct_inputs.size(); ++j)
      wire_.send(g[n + j].contiguous(), in[j].from, wire_.tag(in[j].from, micro, kSkipGrad + 2 * in[j].slot));
  };
  // (A stage's graph starts at its inputs, leaves of their own: another stage here is out of its reach.)
  if (op == PipeOp::kBackward) {
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    if (s > 0) {
      std::vector<torch::Tensor> g;
      for (const torch::Tensor& in : inputs) g.push_back(in.grad());
      send_input_grads(g);
    }
  } else if (op == PipeOp::kInputGrad) {  // no parameter's gradient: W computes those later from what I keeps
    std::vector<torch::Tensor> g = m.split.input_grads(roots, grads, inputs, params_);
    if (s > 0) send_input_grads(std::move(g));
    return;
  } else {
    m.split.weight_grads();
  }
  m = Micro{};  // the activations go
}

}  // namespace ddm
