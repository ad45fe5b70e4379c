// The prepare phase in pieces (see prepare.h).
#include "pipeline/prepare.h"

#include <algorithm>
#include <map>

#include "core/device.h"
#include "core/error.h"

namespace ddm {
namespace {

const char* const kFrozen = "frozen.";

// Concatenates the rows of each piece's tensor `key`.
torch::Tensor cat_rows(const std::vector<std::pair<int64_t, TensorMap>>& pieces, const std::string& key) {
  std::vector<torch::Tensor> parts;
  for (const auto& piece : pieces) parts.push_back(piece.second.at(key));
  return parts.size() == 1 ? parts[0] : torch::cat(parts);
}

}  // namespace

int64_t prepare_quantum(int64_t rows) {
  DDM_CHECK(rows >= 1, "a micro-batch needs at least one row, got " << rows);
  for (int64_t q = 1; q < rows; ++q)
    if (rows % q == 0 && rows / q <= 8) return q;
  return 1;  // a prime above 8 (one quantum would be the whole micro-batch): one row at a time
}

Prepared prepare_rows(const Objective& objective, NetImpl& net, const Batch& micro, int64_t first, int64_t n,
                      int64_t quantum, int64_t step, Precision precision) {
  DDM_CHECK(quantum >= 1 && n % quantum == 0,
            "prepare_rows: " << n << " rows are not a whole number of quanta of " << quantum);
  std::vector<std::pair<int64_t, TensorMap>> parts;
  const PrepNeeds all{true, true, true};
  for (int64_t at = first; at < first + n; at += quantum) {
    Prepared p = objective.prepare(micro.rows(at, quantum), step);
    Autocast autocast(micro.x.device(), precision);
    p.cond = net.precompute(p.xt, p.t, p.cond);
    if (n == quantum) return p;
    parts.emplace_back(at - first, prepared_tensors(p, all));
  }
  return prepared_from(std::move(parts), n, "prepare_rows");
}

TensorMap prepared_tensors(const Prepared& p, const PrepNeeds& needs) {
  DDM_CHECK(p.cond.residuals.empty(), "a prepared micro-batch carries no ControlNet residuals");
  TensorMap out;
  auto put = [&](const char* key, const torch::Tensor& t, bool wanted) {
    if (wanted && t.defined()) out[key] = t;
  };
  put("xt", p.xt, needs.xt);
  put("t", p.t, true);
  put("target", p.target, needs.target);
  put("posterior_eps", p.posterior_eps, needs.target);
  put("y", p.cond.y, true);
  put("control", p.cond.control, true);
  put("embed", p.cond.embed, true);
  put("embed_null", p.cond.embed_null, true);
  put("self_cond", p.cond.self_cond, true);
  put("context", p.cond.context, true);  // text: every stage's cross-attention and its pooled embedding read them
  put("context_mask", p.cond.context_mask, true);
  put("pooled", p.cond.pooled, true);
  if (needs.frozen)
    for (size_t i = 0; i < p.cond.frozen.size(); ++i) out[kFrozen + std::to_string(i)] = p.cond.frozen[i];
  return out;
}

Prepared prepared_from(std::vector<std::pair<int64_t, TensorMap>> pieces, int64_t rows, const std::string& what) {
  DDM_CHECK(!pieces.empty(), what << ": no prepared rows");
  std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  int64_t next = 0;
  for (const auto& [first, tensors] : pieces) {
    DDM_CHECK(!tensors.empty() && tensors.count("t"), what << ": a prepared piece without t");
    const int64_t n = tensors.at("t").size(0);
    DDM_CHECK(first == next, what << ": prepared rows " << (first < next ? "overlap" : "are missing") << " at row "
                                  << std::min(first, next) << " of " << rows);
    DDM_CHECK(tensors.size() == pieces.front().second.size(), what << ": prepared pieces hold different tensors");
    for (const auto& [key, t] : tensors)
      DDM_CHECK(pieces.front().second.count(key) && t.dim() >= 1 && t.size(0) == n,
                what << ": prepared piece tensor '" << key << "' does not match the others or has not " << n << " rows");
    next += n;
  }
  DDM_CHECK(next == rows, what << ": prepared rows cover " << next << " of " << rows);
  Prepared p;
  std::map<int, torch::Tensor> frozen;
  for (const auto& entry : pieces.front().second) {
    const std::string& key = entry.first;
    torch::Tensor t = cat_rows(pieces, key);
    if (key == "xt") p.xt = t;
    else if (key == "t") p.t = t;
    else if (key == "target") p.target = t;
    else if (key == "posterior_eps") p.posterior_eps = t;
    else if (key == "y") p.cond.y = t;
    else if (key == "control") p.cond.control = t;
    else if (key == "embed") p.cond.embed = t;
    else if (key == "embed_null") p.cond.embed_null = t;
    else if (key == "self_cond") p.cond.self_cond = t;
    else if (key == "context") p.cond.context = t;
    else if (key == "context_mask") p.cond.context_mask = t;
    else if (key == "pooled") p.cond.pooled = t;
    else if (key.rfind(kFrozen, 0) == 0) frozen[std::stoi(key.substr(std::string(kFrozen).size()))] = t;
    else DDM_FAIL(what << ": unknown prepared tensor '" << key << "'");
  }
  for (const auto& [i, t] : frozen) {
    DDM_CHECK(i == static_cast<int>(p.cond.frozen.size()), what << ": prepared tensor frozen." << p.cond.frozen.size() << " is missing");
    p.cond.frozen.push_back(t);
  }
  return p;
}

std::vector<PrepPiece> prep_pieces(const PipeSchedule& filled, int64_t rows) {
  std::vector<PrepPiece> out;
  std::vector<int64_t> ahead(static_cast<size_t>(filled.micro), 0);
  for (int r = 0; r < static_cast<int>(filled.ranks.size()); ++r)
    for (int i = 0; i < static_cast<int>(filled.ranks[r].size()); ++i) {
      const PipeAction& a = filled.ranks[r][i];
      if (a.op != PipeOp::kTask || a.task > 0) continue;  // (tasks 1 + s: self-conditioning's first passes)
      DDM_CHECK(a.task == 0 && a.micro >= 0 && a.micro < filled.micro && a.rows >= 1,
                "fill plan: rank " << r << " holds a task piece " << action_text(a) << " that prepares no micro-batch");
      PrepPiece p;
      p.rank = r, p.position = i, p.micro = a.micro, p.rows = a.rows, p.ahead = !a.serial;
      if (p.ahead) {
        p.first = ahead[a.micro];
        ahead[a.micro] += a.rows;
      }
      out.push_back(p);
    }
  std::vector<int64_t> next = ahead;  // the serial pieces follow every ahead piece of their micro-batch
  for (PrepPiece& p : out)
    if (!p.ahead) {
      p.first = next[p.micro];
      next[p.micro] += p.rows;
    }
  for (int m = 0; m < filled.micro; ++m)
    DDM_CHECK(next[m] == rows, "fill plan: the pieces of micro-batch " << m << " cover " << next[m] << " of its " << rows << " rows");
  return out;
}

}  // namespace ddm
