// Atomic, checksummed checkpoint directories (see checkpoint.h).
#include "train/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "core/error.h"
#include "core/fileio.h"
#include "core/run_dir.h"
#include "core/safetensors.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {
constexpr const char* kFormat = "ddm-checkpoint-1";
// What to do with a damaged checkpoint, after "delete DIR".
constexpr const char* kDamagedTail =
    " to resume from the previous checkpoint (`ddm sample` and `ddm export` take an earlier one as it is: --ckpt "
    "RUN/ckpt/step-N)";

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

bool is_step_dir(const fs::path& p) {
  const std::string n = p.filename().string();
  return n.size() == 13 && n.rfind("step-", 0) == 0 &&
         std::all_of(n.begin() + 5, n.end(), [](char c) { return c >= '0' && c <= '9'; });
}
}  // namespace

void bad_state_field(const std::string& path, const std::string& pointer, const nlohmann::json* found,
                     const char* expected) {
  std::string field = pointer.substr(1);  // "/data_cursor/epoch" -> "data_cursor.epoch"
  std::replace(field.begin(), field.end(), '/', '.');
  const std::string ckpt_dir = fs::path(path).parent_path().string();
  const std::string what = !found ? "missing" : found->is_null() ? "null" : std::string("a ") + found->type_name();
  DDM_FAIL(path << ": field '" << field << "' is " << what
                << ", expected " << expected << "; the checkpoint is damaged: delete " << ckpt_dir
                << kDamagedTail);
}

std::vector<std::string> list_checkpoints(const std::string& run_dir) {
  std::vector<std::string> out;
  const fs::path dir = fs::path(run_dir) / RunDir::kCheckpoints;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_directory() && is_step_dir(e.path())) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<std::string> latest_checkpoint(const std::string& run_dir) {
  auto all = list_checkpoints(run_dir);
  if (all.empty()) return std::nullopt;
  return all.back();
}

void Checkpoint::fetch_all() {
  if (!fetch) return;
  TensorMap* parts[] = {&model, &ema, &optim};
  for (int part = 0; part < 3; ++part)
    for (auto& [name, t] : *parts[part])
      if (t.is_meta()) t = fetch(part, name);
  fetch = nullptr;
}

std::string write_checkpoint(const std::string& run_dir, const Checkpoint& ckpt, int64_t keep) {
  const fs::path ckdir = fs::path(run_dir) / RunDir::kCheckpoints;
  fs::create_directories(ckdir);
  const fs::path final_dir = ckdir / step_name(ckpt.step);
  const fs::path tmp_dir = ckdir / (".tmp-" + step_name(ckpt.step));
  std::error_code ec;
  fs::remove_all(tmp_dir, ec);
  try {
    fs::create_directories(tmp_dir);
    nlohmann::json state = ckpt.state;
    state["format"] = kFormat;
    state["step"] = ckpt.step;
    state["config"] = ckpt.config_toml;
    const std::pair<const char*, const TensorMap*> parts[] = {
        {RunDir::kModel, &ckpt.model}, {RunDir::kEma, &ckpt.ema}, {RunDir::kOptim, &ckpt.optim}};
    for (int part = 0; part < 3; ++part) {
      const auto& [name, tensors] = parts[part];
      SafetensorsFile f;
      f.tensors = *tensors;
      if (ckpt.fetch) f.fetch = [&ckpt, part](const std::string& key) { return ckpt.fetch(part, key); };
      f.metadata["format"] = kFormat;
      f.metadata["step"] = std::to_string(ckpt.step);
      state["sha256"][name] = save_safetensors((tmp_dir / name).string(), f);  // streamed: no copy in memory
    }
    write_file_atomic((tmp_dir / RunDir::kState).string(), state.dump(2) + "\n");
    fsync_dir(tmp_dir.string());
  } catch (const std::exception& e) {
    // A full disk, say: what was written of it goes (it would hold the space), the earlier ones stay.
    fs::remove_all(tmp_dir, ec);
    const auto kept = latest_checkpoint(run_dir);
    DDM_FAIL(e.what() << "; the checkpoint of step " << ckpt.step << " is not written (its partial files are removed)"
                      << (kept ? "; the earlier ones are intact: --resume goes on from the last, " + *kept
                               : std::string("; the run has no earlier one")));
  }
  fs::remove_all(final_dir, ec);  // a re-written step (after a resume) replaces the old one
  fs::rename(tmp_dir, final_dir);
  fsync_dir(ckdir.string());

  // The newest `keep`, and every one another run or directory pins (pin_checkpoint).
  auto all = list_checkpoints(run_dir);
  for (size_t i = 0; i + keep < all.size(); ++i)
    if (!fs::exists(fs::path(all[i]) / kPinned, ec)) fs::remove_all(all[i], ec);
  return final_dir.string();
}

void pin_checkpoint(const std::string& ckpt_dir, const std::string& by) {
  const fs::path dir(ckpt_dir);
  std::error_code ec;
  if (!fs::is_regular_file(dir / RunDir::kState, ec)) return;  // not a ddm checkpoint (a diffusers folder, ...)
  const std::string who = absolute_dir(by);  // one line per run, however it was named
  try {
    std::string lines;
    for (const std::string& line : checkpoint_pins(ckpt_dir)) {
      if (line == who) return;
      lines += line + "\n";
    }
    write_file_atomic((dir / kPinned).string(), lines + who + "\n");
  } catch (const std::exception&) {
    // A checkpoint this process may not write to: its run cannot remove it either.
  }
}

void unpin_checkpoint(const std::string& ckpt_dir, const std::string& by) {
  const fs::path pins = fs::path(ckpt_dir) / kPinned;
  std::error_code ec;
  if (!fs::exists(pins, ec)) return;
  const std::string who = absolute_dir(by);
  std::string kept;
  for (const std::string& line : checkpoint_pins(ckpt_dir))
    if (line != who) kept += line + "\n";
  try {
    if (kept.empty()) fs::remove(pins);
    else write_file_atomic(pins.string(), kept);
  } catch (const std::exception&) {
    // As pin_checkpoint: a checkpoint this process may not write to.
  }
}

std::vector<std::string> checkpoint_pins(const std::string& ckpt_dir) {
  std::vector<std::string> out;
  const fs::path pins = fs::path(ckpt_dir) / kPinned;
  std::error_code ec;
  if (!fs::exists(pins, ec)) return out;
  std::istringstream lines(read_file(pins.string()));
  for (std::string line; std::getline(lines, line);)
    if (!line.empty()) out.push_back(line);
  return out;
}

Checkpoint read_checkpoint(const std::string& ckpt_dir, bool weights_only) {
  const fs::path dir(ckpt_dir);
  const std::string state_path = (dir / RunDir::kState).string();
  DDM_CHECK(fs::is_regular_file(state_path),
            "'" << ckpt_dir << "' is not a ddm checkpoint: " << state_path << " is missing"
                << (is_step_dir(fs::path(ckpt_dir + "/").parent_path())  // (a trailing '/' or none)
                        ? std::string("; the checkpoint is damaged: delete ") + ckpt_dir + kDamagedTail
                        : std::string()));
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(read_file(state_path));
  } catch (const nlohmann::json::exception& e) {
    DDM_FAIL(state_path << " is not valid JSON (" << e.what() << "); the checkpoint is damaged: "
                        << "delete " << ckpt_dir << kDamagedTail);
  }
  Checkpoint ck;
  ck.state_path = state_path;
  DDM_CHECK(state.is_object(), state_path << " is JSON but not an object (it is " << state.type_name()
                                          << "); the checkpoint is damaged: delete " << ckpt_dir
                                          << kDamagedTail);
  const std::string format = Checkpoint::state_field<std::string>(state, "/format", state_path);
  DDM_CHECK(format == kFormat, state_path << ": unknown checkpoint format '" << format << "' (expected " << kFormat << ")");
  ck.step = Checkpoint::state_field<int64_t>(state, "/step", state_path);
  DDM_CHECK(ck.step >= 0, state_path << ": field 'step' is " << ck.step << ", expected a step >= 0; the checkpoint is "
                                     << "damaged: delete " << ckpt_dir << kDamagedTail);
  ck.config_toml = Checkpoint::state_field<std::string>(state, "/config", state_path);
  for (const char* name : {RunDir::kModel, RunDir::kEma, RunDir::kOptim}) {
    if (weights_only && std::string(name) == RunDir::kOptim) continue;
    const std::string path = (dir / name).string();
    const std::string want = Checkpoint::state_field<std::string>(state, std::string("/sha256/") + name, state_path);
    DDM_CHECK(fs::is_regular_file(path), path << " is missing; the checkpoint is damaged: delete " << ckpt_dir
                                                << kDamagedTail);
    std::string got;
    SafetensorsFile f;
    try {
      f = load_safetensors(path, got);  // straight into the tensors, hashed on the way
    } catch (const Error& e) {
      DDM_FAIL(e.what() << "; the checkpoint is damaged: delete " << ckpt_dir << kDamagedTail);
    }
    DDM_CHECK(got == want, path << ": checksum mismatch (sha256 " << got << ", state.json says " << want
                                << "); the checkpoint is damaged: delete " << ckpt_dir
                                << kDamagedTail);
    TensorMap& dst = std::string(name) == RunDir::kModel ? ck.model
                     : std::string(name) == RunDir::kEma ? ck.ema
                                                               : ck.optim;
    dst = std::move(f.tensors);
  }
  state.erase("config");
  ck.state = std::move(state);
  return ck;
}

std::string resolve_checkpoint(const std::string& path) {
  DDM_CHECK(fs::exists(path), "checkpoint path '" << path << "' does not exist");
  if (fs::is_regular_file(fs::path(path) / RunDir::kState)) return path;
  // A checkpoint's directory without its state.json: read_checkpoint says it is damaged.
  if (fs::is_directory(path) && is_step_dir(fs::path(path + "/").parent_path())) return path;
  const fs::path p = fs::path(path).lexically_normal();
  const fs::path parent = (p.has_filename() ? p : p.parent_path()).parent_path();
  // A file of a checkpoint (RUN/ckpt/step-N/model.safetensors): that checkpoint.
  if (fs::is_regular_file(p) && fs::is_regular_file(p.parent_path() / RunDir::kState)) return p.parent_path().string();
  // The run's checkpoint folder (RUN/ckpt): its latest, as for RUN.
  if (fs::is_directory(p) && (p.has_filename() ? p.filename() : p.parent_path().filename()) == RunDir::kCheckpoints)
    if (auto latest = latest_checkpoint(parent.empty() ? "." : parent.string())) return *latest;
  auto latest = latest_checkpoint(path);
  DDM_CHECK(latest || !fs::is_regular_file(fs::path(path) / "ensemble.json"),
            "'" << path << "' is a decentralized ensemble (ensemble.json), not one model's run: give it as "
                << "--ensemble " << path);
  DDM_CHECK(latest, "'" << path << "' holds no checkpoint (expected " << path
                        << "/ckpt/step-XXXXXXXX/ or a checkpoint directory); train first with ddm train");
  return *latest;
}

}  // namespace ddm
