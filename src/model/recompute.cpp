// Activation checkpointing unit by unit (see recompute.h): one custom autograd Function per unit.
#include "model/recompute.h"

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>

#include "core/device.h"
#include "core/error.h"

namespace ddm {
namespace {

// A carry's tensors as slots: h, emb, then the skips (undefined where the carry has none).
std::vector<torch::Tensor> slots_of(const NetCarry& k) {
  std::vector<torch::Tensor> s{k.h, k.emb};
  s.insert(s.end(), k.skips.begin(), k.skips.end());
  return s;
}

NetCarry carry_of(const std::vector<torch::Tensor>& s) {
  NetCarry k{s[0], s[1], {}};
  k.skips.assign(s.begin() + 2, s.end());
  return k;
}

// Every tensor of a conditioning (none needs a gradient: check_cond).
std::vector<torch::Tensor> cond_tensors(const Cond& c) {
  std::vector<torch::Tensor> ts{c.y, c.control, c.self_cond, c.embed, c.embed_null, c.context, c.context_mask, c.pooled};
  ts.insert(ts.end(), c.residuals.begin(), c.residuals.end());
  ts.insert(ts.end(), c.frozen.begin(), c.frozen.end());
  return ts;
}

// Where each slot of a unit's output carry comes from.
struct OutSlot {
  // kNew: made by the unit, the Function's output `index`; kInput: the Function's input `index`,
  // passed on; kCond: a tensor of the conditioning the unit put in the carry (a ControlNet's zero
  // unit hands on the precomputed time embedding), constant. Only kNew slots are the node's outputs:
  // an output that the node did not make would have its history overwritten by the node.
  enum Kind { kUndefined, kNew, kInput, kCond } kind = kUndefined;
  size_t index = 0;
};

// What one unit's node keeps for its backward besides the saved inputs.
struct UnitState : torch::CustomClassHolder {
  NetUnit unit;
  torch::Tensor t;
  Cond c;
  torch::Device device = torch::kCPU;
  Precision precision = Precision::kFp32;  // the autocast the forward ran under
  std::vector<size_t> in_slots;            // the slot of each carry input (the defined slots)
  size_t slot_count = 0;                   // slots in the input carry
  size_t carry_inputs = 0;                 // the Function's inputs: carry_inputs carry tensors, then the parameters
  std::vector<OutSlot> out;                // the output carry's slots
  std::vector<torch::Tensor> cond_out;     // the kCond slots' tensors
};

const auto kUnitStateClass = torch::class_<UnitState>("ddm", "RecomputeUnitState");

// The unit's input carry from the Function's carry inputs.
NetCarry input_carry(const UnitState& s, const std::vector<torch::Tensor>& in) {
  std::vector<torch::Tensor> slots(s.slot_count);
  for (size_t i = 0; i < s.in_slots.size(); ++i) slots[s.in_slots[i]] = in[i];
  return carry_of(slots);
}

struct RecomputeUnit : torch::autograd::Function<RecomputeUnit> {
  // inputs: the defined carry slots (s->in_slots), then the unit's trainable parameters. Returns the
  // output carry's tensors that the unit made (s->out says where each slot comes from).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const c10::intrusive_ptr<UnitState>& s, at::TensorList inputs) {
    std::vector<torch::Tensor> carry(inputs.begin(), inputs.begin() + static_cast<std::ptrdiff_t>(s->carry_inputs));
    NetCarry k = input_carry(*s, carry);
    s->unit.run(k, s->t, s->c);  // no grad: Function::apply runs forward so
    const std::vector<torch::Tensor> slots = slots_of(k);
    const std::vector<torch::Tensor> conds = cond_tensors(s->c);
    auto among = [](const torch::Tensor& x, const std::vector<torch::Tensor>& ts) {
      size_t i = 0;
      while (i < ts.size() && !(ts[i].defined() && x.is_same(ts[i]))) ++i;
      return i;
    };
    torch::autograd::variable_list made;
    s->out.assign(slots.size(), {});
    for (size_t j = 0; j < slots.size(); ++j) {
      if (!slots[j].defined()) continue;
      if (const size_t i = among(slots[j], carry); i < carry.size()) {
        s->out[j] = {OutSlot::kInput, i};
      } else if (among(slots[j], conds) < conds.size()) {
        s->out[j] = {OutSlot::kCond, s->cond_out.size()};
        s->cond_out.push_back(slots[j]);
      } else {
        s->out[j] = {OutSlot::kNew, made.size()};
        made.push_back(slots[j]);
      }
    }
    ctx->save_for_backward(carry);  // the unit's inputs: all that stays alive of it until backward
    ctx->saved_data["state"] = s;
    return made;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->saved_data["state"].toCustomClass<UnitState>();
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    std::vector<torch::Tensor> carry(saved.size());
    std::vector<torch::Tensor> wrt;   // what gradients are taken of: carry inputs needing one, parameters
    std::vector<int64_t> wrt_input;   // the Function input each of them is
    for (size_t i = 0; i < saved.size(); ++i) {
      carry[i] = saved[i].detach();
      if (saved[i].requires_grad()) {
        carry[i].requires_grad_(true);
        wrt.push_back(carry[i]);
        wrt_input.push_back(static_cast<int64_t>(i));
      }
    }
    for (size_t p = 0; p < s->unit.params.size(); ++p) {
      if (!s->unit.params[p].requires_grad()) continue;
      wrt.push_back(s->unit.params[p]);
    }
    // The unit again, this time recording its graph.
    NetCarry k = input_carry(*s, carry);
    {
      torch::AutoGradMode grad_mode(true);
      Autocast autocast(s->device, s->precision);
      s->unit.run(k, s->t, s->c);
    }
    const std::vector<torch::Tensor> slots = slots_of(k);
    DDM_CHECK(slots.size() == s->out.size(),
              "activation checkpointing: unit '" << s->unit.name << "' gave another carry when recomputed");
    std::vector<torch::Tensor> outs, outs_grad;
    for (size_t j = 0; j < slots.size(); ++j) {
      if (s->out[j].kind != OutSlot::kNew) continue;
      const torch::Tensor& g = grads[s->out[j].index];
      if (g.defined() && slots[j].requires_grad()) {
        outs.push_back(slots[j]);
        outs_grad.push_back(g);
      }
    }
    torch::autograd::variable_list got(wrt.size());
    if (!outs.empty())
      got = torch::autograd::grad(outs, wrt, outs_grad, /*retain_graph=*/false, /*create_graph=*/false,
                                  /*allow_unused=*/true);
    // One gradient per forward argument: none for the state, then the carry inputs, then the parameters.
    torch::autograd::variable_list result(1 + s->carry_inputs + s->unit.params.size());
    size_t w = 0;
    for (; w < wrt_input.size(); ++w) result[1 + static_cast<size_t>(wrt_input[w])] = got[w];
    for (size_t p = 0, q = 0; p < s->unit.params.size(); ++p)
      if (s->unit.params[p].requires_grad()) result[1 + s->carry_inputs + p] = got[w + q++];
    return result;
  }
};

bool any_requires_grad(const std::vector<torch::Tensor>& ts) {
  for (const auto& x : ts)
    if (x.defined() && x.requires_grad()) return true;
  return false;
}

// Runs one unit on k, as a RecomputeUnit node when anything in it needs a gradient.
void run_unit(const NetUnit& unit, NetCarry& k, const torch::Tensor& t, const Cond& c, torch::Device device,
              Precision precision) {
  const std::vector<torch::Tensor> slots = slots_of(k);
  if (!any_requires_grad(slots) && !any_requires_grad(unit.params)) {
    unit.run(k, t, c);  // nothing to differentiate (a ControlNet's locked part before its first trained input)
    return;
  }
  auto s = c10::make_intrusive<UnitState>();
  s->unit = unit;
  s->t = t;
  s->c = c;
  s->device = device;
  s->precision = precision;
  s->slot_count = slots.size();
  std::vector<torch::Tensor> inputs;
  for (size_t j = 0; j < slots.size(); ++j) {
    if (!slots[j].defined()) continue;
    s->in_slots.push_back(j);
    inputs.push_back(slots[j]);
  }
  s->carry_inputs = inputs.size();
  inputs.insert(inputs.end(), unit.params.begin(), unit.params.end());
  const torch::autograd::variable_list made = RecomputeUnit::apply(s, at::TensorList(inputs));
  std::vector<torch::Tensor> out(s->out.size());
  for (size_t j = 0; j < out.size(); ++j) {
    if (s->out[j].kind == OutSlot::kNew) out[j] = made[s->out[j].index];
    if (s->out[j].kind == OutSlot::kInput) out[j] = inputs[s->out[j].index];
    if (s->out[j].kind == OutSlot::kCond) out[j] = s->cond_out[s->out[j].index];
  }
  k = carry_of(out);
}

void check_cond(const Cond& c) {
  DDM_CHECK(!any_requires_grad(cond_tensors(c)), "train.checkpoint_activations: the conditioning needs a gradient (a trained "
                                    "encoder's output), which does not flow through a checkpointed unit; turn it off");
}

}  // namespace

torch::Tensor forward_recomputed(NetImpl& net, const torch::Tensor& x, const torch::Tensor& t, const Cond& c) {
  if (!torch::GradMode::is_enabled()) return net.forward(x, t, c);
  check_cond(c);
  const c10::DeviceType type = x.device().type();
  const bool on = at::autocast::is_autocast_enabled(type);
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(type);
  const Precision precision = !on ? Precision::kFp32 : dtype == at::kHalf ? Precision::kFp16 : Precision::kBf16;
  NetCarry k{x, {}, {}};  // [B, C, H, W]
  for (const NetUnit& u : net.units()) run_unit(u, k, t, c, x.device(), precision);
  return k.h;  // [B, C, H, W]
}

RecomputedNetImpl::RecomputedNetImpl(std::shared_ptr<NetImpl> inner) : inner_(std::move(inner)) {
  DDM_CHECK(inner_, "RecomputedNet: no network");
  register_module("inner", inner_);  // its parameters, device and train()/eval() are the inner network's
}

torch::Tensor RecomputedNetImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) {
  return forward_recomputed(*inner_, x, t, c);
}

}  // namespace ddm
