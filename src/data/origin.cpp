// Where a dataset's images come from (see origin.h).
#include "data/origin.h"

#include <filesystem>
#include <map>
#include <regex>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"
#include "data/latent_shards.h"
#include "data/shard_write.h"
#include "data/shards.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

constexpr const char* kUnknownShards = "shards";

// The record of shard `path` (DIR/PREFIX.shards.json for DIR/PREFIX-NNNNNN.tar) if it lists the
// shard with its current size; else null. `records` keeps the records read.
const nlohmann::json& record_of(const std::string& path, std::map<std::string, nlohmann::json>& records) {
  static const nlohmann::json none;
  static const std::regex numbered(R"((.*)-[0-9]+\.tar)");
  const fs::path p(path);
  std::smatch m;
  const std::string name = p.filename().string();
  if (!std::regex_match(name, m, numbered)) return none;
  const std::string record = (p.parent_path() / (m[1].str() + ".shards.json")).string();
  auto it = records.find(record);
  if (it == records.end()) {
    nlohmann::json j;
    if (fs::is_regular_file(record)) j = nlohmann::json::parse(read_file(record), nullptr, /*allow_exceptions=*/false);
    it = records.emplace(record, j.is_object() && j.value("format", "") == "ddm shards" ? j : nlohmann::json()).first;
  }
  const nlohmann::json& j = it->second;
  if (j.is_null() || !j.contains("shards") || !j["shards"].is_array()) return none;
  try {  // a record with fields of the wrong types says nothing
    for (const auto& s : j["shards"])
      if (s.is_object() && s.value("name", "") == name &&
          s.value("bytes", int64_t(-1)) == static_cast<int64_t>(fs::file_size(p)))
        return j;
  } catch (const nlohmann::json::exception&) {
  }
  return none;
}

// The origin the record of `path` gives, or "".
std::string recorded_origin(const std::string& path, std::map<std::string, nlohmann::json>& records) {
  const nlohmann::json& j = record_of(path, records);
  if (j.is_null()) return "";
  try {
    return j.value("origin", "");
  } catch (const nlohmann::json::exception&) {
    return "";
  }
}

}  // namespace

std::string data_origin(const DataConfig& cfg) {
  if (cfg.source == "latents") {
    const std::string origin = read_latent_shards_info(cfg.root).origin;
    return origin.empty() ? "latents" : origin;
  }
  if (cfg.source != "shards") return cfg.source;
  std::map<std::string, nlohmann::json> records;
  std::string origin;
  for (const std::string& shard : expand_shards(cfg.root, "data.root")) {
    const std::string o = recorded_origin(shard, records);
    if (o.empty() || (!origin.empty() && o != origin)) return kUnknownShards;
    origin = o;
  }
  return origin.empty() ? kUnknownShards : origin;
}

std::vector<std::string> recorded_class_names(const std::vector<std::string>& shards) {
  std::map<std::string, nlohmann::json> records;
  std::vector<std::string> names;
  for (size_t i = 0; i < shards.size(); ++i) {
    const nlohmann::json& j = record_of(shards[i], records);
    std::vector<std::string> these;
    try {
      if (!j.is_null() && j.contains("class_names")) these = j["class_names"].get<std::vector<std::string>>();
    } catch (const nlohmann::json::exception&) {
    }
    if (these.empty() || (i > 0 && these != names)) return {};
    names = std::move(these);
  }
  return names;
}

void write_shards_record(const std::string& dir, const std::string& prefix, const ShardsWritten& w,
                         const std::string& origin, const std::string& description,
                         const std::vector<std::string>& class_names) {
  nlohmann::json shards = nlohmann::json::array();
  for (int64_t s = 0; s < w.shards; ++s) {
    const std::string name = prefix + "-" + zero_padded(s, 6) + ".tar";
    shards.push_back({{"name", name}, {"bytes", static_cast<int64_t>(fs::file_size(fs::path(dir) / name))}});
  }
  nlohmann::json j = {{"format", "ddm shards"}, {"version", 1},          {"origin", origin},
                            {"data", description},    {"samples", w.samples}, {"shards", shards}};
  if (!class_names.empty()) j["class_names"] = class_names;
  write_file_atomic((fs::path(dir) / (prefix + ".shards.json")).string(), j.dump(2) + "\n");
}

}  // namespace ddm
