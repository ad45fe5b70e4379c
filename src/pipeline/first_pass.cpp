// Self-conditioning's first pass through a pipeline (see first_pass.h).
#include "pipeline/first_pass.h"

#include "core/error.h"

namespace ddm {

PipeFirstPass::PipeFirstPass(const Objective& objective, PipeWire& wire, int stages, int64_t rows, int64_t quantum)
    : objective_(objective), wire_(wire), stages_(stages), rows_(rows), quantum_(quantum) {
  DDM_CHECK(quantum_ > 0 && rows_ % quantum_ == 0, "pipeline: a first pass of " << rows_ << " rows in quanta of " << quantum_);
}

void PipeFirstPass::begin_step(const std::vector<Batch>& micro, int64_t step) {
  micro_.assign(micro.size(), Micro{});
  for (size_t m = 0; m < micro.size(); ++m) {  // alike on every stage
    Micro& f = micro_[m];
    f.idx = objective_.self_cond_rows(micro[m].first, rows_, step);
    const auto* idx = f.idx.data_ptr<int64_t>();
    const int64_t n = f.idx.numel();
    f.bound.assign(1, 0);
    for (int64_t q = quantum_; q <= rows_; q += quantum_) {
      int64_t j = f.bound.back();
      while (j < n && idx[j] < q) ++j;
      f.bound.push_back(j);
    }
    f.stage.assign(static_cast<size_t>(stages_), StagePass{});
    f.idx = f.idx.to(wire_.device());  // (the bounds read it on the host) the rows' device
  }
}

namespace {
// Rows [from, to) of every tensor of a carry (a placeholder stays one).
NetCarry carry_rows(const NetCarry& k, int64_t from, int64_t to) {
  auto rows = [&](const torch::Tensor& t) { return t.defined() ? t.slice(0, from, to) : t; };
  NetCarry r;
  r.h = rows(k.h), r.emb = rows(k.emb);
  for (const torch::Tensor& t : k.skips) r.skips.push_back(rows(t));
  return r;
}

// The quanta's carries joined row-wise, in order (each has the same tensors).
NetCarry concat_carries(const std::vector<NetCarry>& parts) {
  auto cat = [&](auto get) {
    std::vector<torch::Tensor> ts;
    for (const NetCarry& k : parts) ts.push_back(get(k));
    return ts.front().defined() ? torch::cat(ts) : torch::Tensor();
  };
  NetCarry r;
  r.h = cat([](const NetCarry& k) { return k.h; });
  r.emb = cat([](const NetCarry& k) { return k.emb; });
  for (size_t i = 0; i < parts.front().skips.size(); ++i) r.skips.push_back(cat([&](const NetCarry& k) { return k.skips.at(i); }));
  return r;
}
}  // namespace

void PipeFirstPass::run(PipeStage& l, int m, const Prepared& p, int64_t first, int64_t rows) {
  torch::NoGradGuard no_grad;
  const int S = stages_;
  Micro& f = micro_.at(static_cast<size_t>(m));
  StagePass& sp = f.stage.at(static_cast<size_t>(l.stage()));
  DDM_CHECK(first == sp.done && first % quantum_ == 0 && rows % quantum_ == 0 && first + rows <= rows_,
            "pipeline: stage " << l.stage() << "'s first-pass piece of micro-batch " << m << " covers rows [" << first << ", "
                               << first + rows << "), expected whole quanta of " << quantum_ << " from row " << sp.done);
  const int64_t chosen = f.idx.numel();
  if (chosen > 0 && l.stage() > 0 && !sp.received) {
    sp.in = l.receive_first_pass(m);  // all b' rows
    sp.received = true;
  }
  for (int64_t q = first / quantum_; q < (first + rows) / quantum_ && chosen > 0; ++q) {
    const int64_t lo = f.bound[static_cast<size_t>(q)], hi = f.bound[static_cast<size_t>(q) + 1];
    if (lo == hi) continue;
    const torch::Tensor idx = f.idx.slice(0, lo, hi);  // [n] of this quantum's positions
    Cond c = p.cond.select(idx);
    NetCarry k;
    if (l.stage() == 0) {
      k.h = p.xt.index_select(0, idx);      // [n, C, H, W]
      c.self_cond = torch::zeros_like(k.h);  // the first pass has no estimate
    } else {
      k = carry_rows(sp.in, lo, hi);
    }
    const torch::Tensor t = p.t.index_select(0, idx);  // [n]
    for (const NetUnit& u : l.units()) u.run(k, t, c);
    sp.out.push_back(std::move(k));
  }
  sp.done += rows;
  if (sp.done == rows_ && chosen > 0) {  // every piece ran: the b' rows go on as one message
    const NetCarry k = concat_carries(sp.out);
    sp.in = NetCarry{}, sp.out.clear();  // (held no longer than needed)
    if (!l.last())
      l.send_first_pass(k, m);
    else
      l.send_first_out(k.h.contiguous(), m);  // the model's output [b', C, H, W]
    if (l.stage() == 0) {
      f.x = p.xt.index_select(0, f.idx);  // [b', C, H, W]
      f.t = p.t.index_select(0, f.idx);   // [b']
      f.out = wire_.post_recv(torch::empty_like(f.x), S - 1, wire_.tag(S - 1, m, kFirstOut));
    }
  }
}

void PipeFirstPass::estimate(int micro, Prepared& p) {
  Micro& f = micro_.at(static_cast<size_t>(micro));
  p.cond.self_cond = torch::zeros_like(p.xt);  // [B, C, H, W]
  if (f.idx.numel() == 0) return;
  const torch::Tensor out = wire_.wait(f.out, "receiving the first pass's output from stage " + std::to_string(stages_ - 1));
  torch::NoGradGuard no_grad;
  p.cond.self_cond.index_copy_(0, f.idx, objective_.self_cond_estimate(f.x, f.t, out));
}

}  // namespace ddm
