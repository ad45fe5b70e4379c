// Profiling a backbone's units and reading/writing pipeline profiles; see profile.h.
#include "pipeline/profile.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/device.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"
#include "core/runtime.h"
#include "model/controlnet.h"
#include "train/latent.h"

namespace ddm {
namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// A copy of the carry whose float tensors are fresh leaves that need gradients (the unit's inputs).
NetCarry leaf_copy(const NetCarry& k, std::vector<torch::Tensor>& inputs) {
  auto leaf = [&](const torch::Tensor& x) {
    if (!x.defined()) return x;
    torch::Tensor y = x.detach().clone().requires_grad_(true);
    inputs.push_back(y);
    return y;
  };
  NetCarry out{leaf(k.h), leaf(k.emb), {}};
  for (const torch::Tensor& s : k.skips) out.skips.push_back(leaf(s));
  return out;
}

// Linear interpolation in rows of a sample field, proportional below the first and above the last.
double interpolate(const std::vector<PipeUnitSample>& s, int64_t rows, double PipeUnitSample::*field) {
  if (rows <= s.front().rows) return s.front().*field * rows / s.front().rows;
  for (size_t i = 1; i < s.size(); ++i)
    if (rows <= s[i].rows)
      return s[i - 1].*field + (s[i].*field - s[i - 1].*field) * (rows - s[i - 1].rows) / (s[i].rows - s[i - 1].rows);
  return s.back().*field * rows / s.back().rows;
}

}  // namespace

std::vector<PipeUnit> PipeProfile::units_at(int64_t rows, double speed) const {
  DDM_CHECK(rows >= 1, "micro-batch rows must be >= 1, got " << rows);
  DDM_CHECK(speed > 0, "device speed must be > 0, got " << speed);
  std::vector<PipeUnit> out;
  for (const PipeUnitProfile& u : units) {
    PipeUnit x;
    x.name = u.name;
    x.forward = interpolate(u.samples, rows, &PipeUnitSample::forward) / speed;
    x.input_grad = interpolate(u.samples, rows, &PipeUnitSample::input_grad) / speed;
    x.weight_grad = interpolate(u.samples, rows, &PipeUnitSample::weight_grad) / speed;
    const bool passed = std::all_of(u.samples.begin(), u.samples.end(), [](const PipeUnitSample& y) { return y.weight_pass >= 0; });
    x.weight_pass = passed ? interpolate(u.samples, rows, &PipeUnitSample::weight_pass) / speed : -1;
    x.activation_bytes = interpolate(u.samples, rows, &PipeUnitSample::activation_bytes);
    x.cut_bytes = interpolate(u.samples, rows, &PipeUnitSample::cut_bytes);
    x.state_bytes = 5.0 * 4.0 * static_cast<double>(u.params);
    for (const PipeSkip& k : u.skips) x.skips.push_back({k.read, k.bytes * static_cast<double>(rows)});
    out.push_back(x);
  }
  return out;
}

std::vector<PipeUnitProfile> profile_units(NetImpl& net, const ModelConfig& cfg, const std::vector<int64_t>& rows,
                                           int repeats, torch::Device device, Precision precision) {
  DDM_CHECK(!rows.empty() && std::is_sorted(rows.begin(), rows.end()) && rows.front() >= 1,
            "profile: micro-batch sizes must be ascending and >= 1");
  DDM_CHECK(repeats >= 1, "profile: repeats must be >= 1, got " << repeats);
  const std::vector<NetUnit> units = net.units();
  std::vector<PipeUnitProfile> out(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    out[u].name = units[u].name;
    for (const torch::Tensor& p : units[u].params) out[u].params += p.requires_grad() ? p.numel() : 0;
  }
  // On a GPU every reading of the clock or of the allocator waits for the queued kernels first.
  auto now = [&] {
    synchronize(device);
    return now_ms();
  };
  auto heap = [&] {
    synchronize(device);
    return allocated_bytes_on(device);
  };
  auto here = [&](const torch::Tensor& y) { return y.defined() ? y.to(device) : y; };  // drawn on the CPU: alike everywhere
  torch::manual_seed(0);
  for (int64_t r : rows) {
    const torch::Tensor x = here(torch::randn({r, cfg.in_channels, cfg.image_size, cfg.image_size})), t = here(torch::rand({r}));
    Cond c;
    if (cfg.num_classes > 0) c.y = here(torch::randint(0, cfg.num_classes, {r}, torch::kLong));
    if (cfg.self_cond) c.self_cond = here(torch::randn(x.sizes()));
    if (!cfg.embed.empty()) c.embed = here(torch::nn::functional::normalize(torch::randn({r, cfg.embed_dim})));
    if (!cfg.controlnet.empty()) {  // at the images' size; SD's ControlNet takes a map of one channel alike
      const int64_t side = cfg.image_size * latent_downsampling(cfg), ch = cfg.arch == "sd-unet" ? 1 : control_channels(cfg);
      c.control = here(torch::rand({r, ch, side, side}) * 2 - 1);
    }
    if (!cfg.text_encoder.empty()) {  // a caption's encoding: states [r, T, D], every token attended, pooled [r, P]
      c.context = here(torch::randn({r, cfg.text_tokens, cfg.text_dim}));
      c.context_mask = here(torch::ones({r, cfg.text_tokens}, torch::kLong));
      c.pooled = here(torch::randn({r, cfg.text_pooled_dim}));
    }
    Autocast autocast(device, precision);  // (bf16: the units as a step runs them)
    c = net.precompute(x, t, c);  // a ControlNet's locked encoder features, which its units read
    if (r == rows.front())
      for (const NetSkipLife& k : skip_lives(units, NetCarry{x, {}, {}}, t, c))
        out[static_cast<size_t>(k.made)].skips.push_back({k.read, static_cast<double>(k.row_bytes)});
    // Each unit's input carry, from a no-grad pass.
    std::vector<NetCarry> in;
    {
      torch::NoGradGuard ng;
      NetCarry k{x, {}, {}};
      for (const NetUnit& unit : units) {
        in.push_back(k);
        unit.run(k, t, c);
      }
    }
    for (size_t u = 0; u < units.size(); ++u) {
      std::vector<double> f, i, w, b, f0, act;
      double cut = 0;
      for (int rep = 0; rep <= repeats; ++rep) {  // rep 0 warms up
        std::vector<torch::Tensor> inputs;
        NetCarry k = u == 0 ? in[0] : leaf_copy(in[u], inputs);  // the first unit's inputs are data
        std::set<const void*> passed;  // tensors that only pass through (open skips it does not touch)
        for (const torch::Tensor& y : k.tensors()) passed.insert(y.unsafeGetTensorImpl());
        const double heap0 = heap(), t0 = now();
        units[u].run(k, t, c);
        const double t1 = now(), heap1 = heap();
        std::vector<torch::Tensor> outs, grads;
        for (const torch::Tensor& y : k.tensors())
          if (y.requires_grad() && !passed.count(y.unsafeGetTensorImpl())) outs.push_back(y), grads.push_back(torch::randn_like(y));
        cut = static_cast<double>(k.bytes());
        double t2 = t1;
        if (!inputs.empty()) {
          torch::autograd::grad(outs, inputs, grads, /*retain_graph=*/true, false, /*allow_unused=*/true);
          t2 = now();
        }
        std::vector<torch::Tensor> params;
        for (const torch::Tensor& p : units[u].params)
          if (p.requires_grad()) params.push_back(p);
        const double tw = now();
        if (!params.empty()) torch::autograd::grad(outs, params, grads, /*retain_graph=*/true, false, /*allow_unused=*/true);
        const double tw1 = now();
        std::vector<torch::Tensor> all = inputs;
        all.insert(all.end(), params.begin(), params.end());
        const double t3 = now();
        torch::autograd::grad(outs, all, grads, /*retain_graph=*/false, false, /*allow_unused=*/true);
        const double t4 = now();
        double t6;
        {
          torch::NoGradGuard ng;
          NetCarry k0 = in[u];
          const double t5 = now();
          units[u].run(k0, t, c);
          t6 = now() - t5;
        }
        if (rep == 0) continue;
        f.push_back(t1 - t0), i.push_back(t2 - t1), w.push_back(tw1 - tw), b.push_back(t4 - t3), f0.push_back(t6);
        act.push_back(std::max(0.0, heap1 - heap0));
      }
      PipeUnitSample s;
      s.rows = r, s.forward = median(f), s.input_grad = median(i);
      s.weight_grad = std::max(0.0, median(b) - s.input_grad), s.forward_nograd = median(f0);
      s.activation_bytes = median(act), s.cut_bytes = u + 1 == units.size() ? 0 : cut, s.weight_pass = median(w);
      out[u].samples.push_back(s);
    }
  }
  return out;
}

void write_profile(const PipeProfile& p, const std::string& path) {
  nlohmann::json j;
  j["format"] = "ddm pipeline profile 1";
  j["model"] = p.model, j["workload"] = p.workload, j["machine"] = p.machine, j["threads"] = p.threads;
  j["optimizer_ms_per_mparam"] = p.optimizer_ms_per_mparam, j["self_cond"] = p.self_cond;
  j["x_bytes_per_row"] = p.x_bytes_per_row;
  j["units"] = nlohmann::json::array();
  for (const PipeUnitProfile& u : p.units) {
    nlohmann::json s = nlohmann::json::array();
    for (const PipeUnitSample& x : u.samples)
      s.push_back({{"rows", x.rows}, {"forward_ms", x.forward}, {"input_grad_ms", x.input_grad},
                   {"weight_grad_ms", x.weight_grad}, {"forward_nograd_ms", x.forward_nograd},
                   {"activation_bytes", x.activation_bytes}, {"cut_bytes", x.cut_bytes}, {"weight_pass_ms", x.weight_pass}});
    nlohmann::json k = nlohmann::json::array();
    for (const PipeSkip& x : u.skips) k.push_back({{"read_by", x.read}, {"bytes_per_row", x.bytes}});
    j["units"].push_back({{"name", u.name}, {"params", u.params}, {"samples", s}, {"skips", k}});
  }
  j["tasks"] = nlohmann::json::array();
  for (const PipeTaskProfile& t : p.tasks) {
    nlohmann::json c = nlohmann::json::array();
    for (const auto& [rows, ms] : t.cost) c.push_back({{"rows", rows}, {"ms", ms}});
    j["tasks"].push_back({{"name", t.name}, {"uses_weights", t.uses_weights},
                          {"output_bytes_per_row", t.output_bytes_per_row}, {"cost", c}});
  }
  write_file_atomic(path, j.dump(1) + "\n");
}

PipeProfile read_profile(const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    DDM_FAIL(path << " is not a JSON pipeline profile: " << e.what() << "; write one with `ddm plan --config C --save-profile "
                  << path << "`");
  }
  PipeProfile p;
  std::string where = "";
  // Integers are checked before conversion (core/json.h; found by fuzz_pipe_profile).
  auto whole = [&](const nlohmann::json& v, int64_t lo = std::numeric_limits<int64_t>::min(),
                   int64_t hi = std::numeric_limits<int64_t>::max()) {
    return json_int(v, path + ": key \"" + where + "\"", lo, hi);
  };
  const int64_t int_min = std::numeric_limits<int>::min(), int_max = std::numeric_limits<int>::max();
  try {
    DDM_CHECK(j.value("format", "") == "ddm pipeline profile 1",
              path << ": not a ddm pipeline profile (\"format\" should be \"ddm pipeline profile 1\")");
    where = "model", p.model = j.at("model").get<std::string>();
    where = "workload", p.workload = j.at("workload").get<std::string>();
    where = "machine", p.machine = j.at("machine").get<std::string>();
    where = "threads", p.threads = static_cast<int>(whole(j.at("threads"), int_min, int_max));
    where = "optimizer_ms_per_mparam", p.optimizer_ms_per_mparam = j.at("optimizer_ms_per_mparam").get<double>();
    where = "self_cond", p.self_cond = j.at("self_cond").get<bool>();
    where = "x_bytes_per_row", p.x_bytes_per_row = j.at("x_bytes_per_row").get<double>();
    where = "units";
    for (const auto& u : j.at("units")) {
      PipeUnitProfile x;
      x.name = u.at("name").get<std::string>(), x.params = whole(u.at("params"));
      where = "units." + x.name;
      for (const auto& s : u.at("samples"))
        x.samples.push_back({whole(s.at("rows")), s.at("forward_ms").get<double>(), s.at("input_grad_ms").get<double>(),
                             s.at("weight_grad_ms").get<double>(), s.at("forward_nograd_ms").get<double>(),
                             s.at("activation_bytes").get<double>(), s.at("cut_bytes").get<double>(),
                             s.value("weight_pass_ms", -1.0)});  // older profiles have none
      if (u.contains("skips"))  // older profiles have none: every open skip is planned as carried
        for (const auto& k : u.at("skips")) x.skips.push_back({static_cast<int>(whole(k.at("read_by"), int_min, int_max)), k.at("bytes_per_row").get<double>()});
      DDM_CHECK(!x.samples.empty(), path << ": unit '" << x.name << "' has no samples");
      for (size_t i = 0; i < x.samples.size(); ++i)
        DDM_CHECK(x.samples[i].rows >= 1 && (i == 0 || x.samples[i].rows > x.samples[i - 1].rows),
                  path << ": unit '" << x.name << "': sample rows must be >= 1 and ascending");
      p.units.push_back(x);
      where = "units";
    }
    where = "tasks";
    for (const auto& t : j.at("tasks")) {
      PipeTaskProfile x;
      x.name = t.at("name").get<std::string>(), x.uses_weights = t.at("uses_weights").get<bool>();
      where = "tasks." + x.name;
      x.output_bytes_per_row = t.at("output_bytes_per_row").get<double>();
      for (const auto& c : t.at("cost")) x.cost.push_back({whole(c.at("rows")), c.at("ms").get<double>()});
      DDM_CHECK(!x.cost.empty(), path << ": task '" << x.name << "' has no (rows, ms) points");
      p.tasks.push_back(x);
      where = "tasks";
    }
  } catch (const nlohmann::json::exception& e) {
    DDM_FAIL(path << ": key \"" << where << "\" is missing or of the wrong type (" << e.what() << ")");
  }
  DDM_CHECK(!p.units.empty(), path << ": the profile has no units");
  auto sane = [](double v) { return std::isfinite(v) && v >= 0; };
  DDM_CHECK(p.threads >= 1 && sane(p.optimizer_ms_per_mparam) && sane(p.x_bytes_per_row),
            path << ": threads must be >= 1, optimizer_ms_per_mparam and x_bytes_per_row finite and >= 0");
  for (size_t l = 0; l < p.units.size(); ++l) {
    const PipeUnitProfile& u = p.units[l];
    DDM_CHECK(u.params >= 0, path << ": unit '" << u.name << "' has a negative parameter count");
    for (const PipeSkip& k : u.skips)
      DDM_CHECK(k.read > static_cast<int>(l) && k.read <= static_cast<int>(p.units.size()) && sane(k.bytes),
                path << ": unit '" << u.name << "': a skip's read_by must be a later unit's index (or the unit count, "
                     << p.units.size() << ": none reads it) and bytes_per_row finite and >= 0");
    for (const PipeUnitSample& x : u.samples)
      DDM_CHECK(sane(x.forward) && sane(x.input_grad) && sane(x.weight_grad) && sane(x.forward_nograd) &&
                    sane(x.activation_bytes) && sane(x.cut_bytes) && std::isfinite(x.weight_pass),
                path << ": unit '" << u.name << "' at " << x.rows << " rows has a negative or non-finite time or size");
  }
  for (const PipeTaskProfile& t : p.tasks) {
    DDM_CHECK(sane(t.output_bytes_per_row), path << ": task '" << t.name << "': output_bytes_per_row must be finite and >= 0");
    for (size_t i = 0; i < t.cost.size(); ++i)
      DDM_CHECK(t.cost[i].first >= 1 && (i == 0 || t.cost[i].first > t.cost[i - 1].first) && sane(t.cost[i].second),
                path << ": task '" << t.name << "': cost points need rows >= 1, ascending, and finite ms >= 0");
  }
  return p;
}

std::string machine_name(torch::Device device) { return device.is_cuda() ? gpu_name(device) : cpu_model_name(); }

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown CPU";
}

}  // namespace ddm
