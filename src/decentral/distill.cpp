// Distillation teacher (see distill.h).
#include "decentral/distill.h"

#include <filesystem>
#include <mutex>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/error.h"
#include "core/input_check.h"
#include "core/fileio.h"
#include "core/run_dir.h"
#include "decentral/ensemble_dir.h"
#include "decentral/partition.h"
#include "diffusion/path.h"
#include "model/net.h"
#include "train/network.h"

namespace fs = std::filesystem;

namespace ddm {

struct DistillTeacher {
  LoadedEnsemble ens;
  std::unique_ptr<Ensemble> model;
  std::string manifest_sha256;
  // What the student learns from: the partition's, the experts' and the router's weights' sha256 as
  // ensemble.json records them. Not its default routing (distillation routes top-1 always), its paths
  // or the ddm version that assembled it, so re-assembling the same models keeps a student resumable.
  std::string teacher_sha256;
  double flops_per_image = 0;  // mean over the data's clusters
  uint64_t seed = 0;
  // Where the experts are: loaded on the CPU (the job is prepared before its device is known) and
  // reloaded, verified again, onto the student's device at its first step there.
  torch::Device device = torch::kCPU;
  std::mutex move;

  void to(torch::Device d) {
    std::lock_guard<std::mutex> lock(move);
    if (d == device) return;
    ens = load_ensemble(ens.dir, /*use_ema=*/true, /*allow_missing=*/false, d);
    model = make_ensemble(ens, parse_routing("top1"), seed);
    device = d;
  }
};

std::shared_ptr<DistillTeacher> load_distill_teacher(const RunConfig& cfg, Dataset& data) {
  const std::string& dir = cfg.train.teacher;
  auto t = std::make_shared<DistillTeacher>();
  t->ens = load_ensemble(dir, /*use_ema=*/true, /*allow_missing=*/false);
  t->manifest_sha256 = sha256_file((fs::path(dir) / "ensemble.json").string());
  {
    const nlohmann::json& m = t->ens.manifest;
    nlohmann::json who = {{"partition", m.at("partition").at("sha256")}, {"router", m.at("router").at("weights_sha256")}};
    for (const auto& e : m.at("experts")) who["experts"].push_back(e.at("weights_sha256"));
    t->teacher_sha256 = sha256_hex(who.dump());
  }
  const Partition p = load_ensemble_partition(t->ens);
  check_partition_matches(p, data);
  data.clusters = p.labels;

  const ModelConfig& te = t->ens.first_expert().cfg.model;
  const ModelConfig& st = cfg.model;
  DDM_CHECK(te.latent_sha256 == st.latent_sha256 && te.latent_scale == st.latent_scale &&
                te.latent_shift == st.latent_shift,
            "the ensemble " << dir << "'s experts learn "
                            << (te.latent.empty() ? "pixels" : "the latents of the autoencoder " + te.latent)
                            << ", but the student "
                            << (st.latent.empty() ? "learns pixels" : "the latents of " + st.latent)
                            << "; a student learns the space of its teachers: "
                            << (te.latent.empty() ? "remove model.latent"
                                                  : "set model.latent = \"" + te.latent + "\""));
  DDM_CHECK(te.in_channels == st.in_channels && te.image_size == st.image_size,
            "the ensemble " << dir << " works on " << te.in_channels << "x" << te.image_size << "x" << te.image_size
                            << " images but the student's data is " << st.in_channels << "x" << st.image_size << "x"
                            << st.image_size);
  DDM_CHECK(st.num_classes == 0 || st.num_classes == te.num_classes,
            "the student has " << st.num_classes << " classes but the ensemble's experts "
                               << (te.num_classes == 0 ? "are unconditional" : "have " + std::to_string(te.num_classes))
                               << "; set model.num_classes = 0 (unconditional student) or use the experts' data");
  DDM_CHECK(te.text_sha256 == st.text_sha256 && te.text_skip == st.text_skip && te.text_tokens == st.text_tokens,
            "the ensemble " << dir << "'s experts are "
                            << (te.text_encoder.empty() ? "not conditioned on text" : "conditioned on the text encoder " + te.text_encoder)
                            << ", the student " << (st.text_encoder.empty() ? "not" : "on " + st.text_encoder)
                            << " (or another text_skip / text_tokens); a student is conditioned on its teachers' text: "
                            << (te.text_encoder.empty() ? "remove model.text_encoder" : "use the experts' text keys"));
  t->seed = static_cast<uint64_t>(cfg.train.seed);
  t->model = make_ensemble(t->ens, parse_routing("top1"), t->seed);
  const auto sizes = p.sizes.to(torch::kDouble);
  for (int64_t k = 0; k < t->ens.k; ++k)
    t->flops_per_image += sizes[k].item<double>() / sizes.sum().item<double>() *
                          network_flops_per_image(t->ens.experts[k]->cfg.model);
  return t;
}

std::string describe(const DistillTeacher& t) {
  std::ostringstream s;
  s << "teacher: ensemble " << t.ens.dir << ", K = " << t.ens.k << " (";
  for (int64_t k = 0; k < t.ens.k; ++k)
    s << (k ? ", " : "") << t.ens.experts[k]->cfg.model.preset << " " << t.ens.experts[k]->cfg.diffusion.objective;
  s << "); each image's target comes from the expert of its cluster, " << t.flops_per_image / 1e6
    << " MFLOP/image per step\n";
  return s.str();
}

TeacherFn teacher_fn(std::shared_ptr<DistillTeacher> t, const RunConfig& student) {
  const NoisePath student_path = make_path(student.diffusion);
  const NoisePath teacher_path = make_path(t->ens.first_expert().cfg.diffusion);  // the ensemble's path
  const int64_t teacher_null = t->ens.first_expert().cfg.model.num_classes;
  const bool unconditional = student.model.num_classes == 0;
  return [t, student_path, teacher_path, teacher_null, unconditional](const torch::Tensor& xt, const torch::Tensor& time,
                                                                      const Cond& y, const torch::Tensor& k) {
    t->to(xt.device());  // a no-op once there
    const PathMatch m = match_path(student_path, time, teacher_path);  // the same x_t on the experts' path
    Cond y_teacher(unconditional ? torch::full_like(y.y, teacher_null) : y.y);  // [B]
    y_teacher.context = y.context;            // text: the same captions, through the same encoder
    y_teacher.context_mask = y.context_mask;
    y_teacher.pooled = y.pooled;
    // (x0_hat, eps_hat) do not depend on the path, so they serve the student's path as they are.
    return t->model->estimate_assigned(xt * m.scale.view({-1, 1, 1, 1}), m.t, y_teacher, k);
  };
}

void check_distill_record(const std::string& out_dir, bool resume, const DistillTeacher& t) {
  const fs::path record = fs::path(RunDir(out_dir) / RunDir::kDistill);
  if (resume && fs::exists(record)) {
    auto stored = nlohmann::json::parse(read_file(record.string()));
    if (!stored.contains("teacher_sha256")) {
      // A record of an earlier version holds only the whole manifest's sha256: the same file goes on
      // (and the record gains teacher_sha256); another may hold the same models, which it cannot tell.
      DDM_INPUT_CHECK(stored.at("ensemble_sha256") == t.manifest_sha256,
                      "--resume: the ensemble " << t.ens.dir << "'s ensemble.json changed since this student started, "
                      "and its distill.json, written by an earlier version, records only that file's sha256: restore "
                      "the file, or start over with --force");
      stored["teacher_sha256"] = t.teacher_sha256;
      write_file_atomic(record.string(), stored.dump(2) + "\n");
      return;
    }
    DDM_INPUT_CHECK(stored.at("teacher_sha256") == t.teacher_sha256,
                    "--resume: the ensemble " << t.ens.dir << " holds other models than when this student started "
                                              << "(its partition, an expert or the router changed; a new default "
                                              << "routing alone would not count); a student must finish on the teacher "
                                                 "it started with. Restore them, or start over with --force");
    return;
  }
  nlohmann::json experts = nlohmann::json::array();
  for (const auto& e : t.ens.experts) experts.push_back({{"checkpoint", e->checkpoint}, {"preset", e->cfg.model.preset}});
  const nlohmann::json j = {{"ensemble", t.ens.dir},
                            {"ensemble_sha256", t.manifest_sha256},
                            {"teacher_sha256", t.teacher_sha256},
                            {"k", t.ens.k},
                            {"experts", experts},
                            {"teacher_flops_per_image", t.flops_per_image}};
  write_file_atomic(record.string(), j.dump(2) + "\n");
}

}  // namespace ddm
