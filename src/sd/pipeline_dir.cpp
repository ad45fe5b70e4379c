// A diffusers pipeline directory's components (see pipeline_dir.h).
#include "sd/pipeline_dir.h"

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"

namespace fs = std::filesystem;

namespace ddm::sd {

bool is_pipeline_dir(const std::string& dir) { return fs::is_regular_file(fs::path(dir) / "model_index.json"); }

std::string pipeline_component(const std::string& dir, const std::string& name, const std::vector<std::string>& classes) {
  const std::string index = (fs::path(dir) / "model_index.json").string();
  const nlohmann::json j = read_json_file(index);
  DDM_CHECK(j.is_object(), index << ": not a JSON object (a diffusers pipeline's model_index.json)");
  // The pipeline's class, which diffusers' from_pretrained needs; each component's class is checked below.
  DDM_CHECK(j.contains("_class_name") && j["_class_name"].is_string(),
            index << ": no \"_class_name\" naming the pipeline's class, so not a diffusers pipeline's model_index.json "
                  << "(save_pretrained writes it); restore the file, or name the component's own folder");
  DDM_CHECK(j.contains(name), index << ": the pipeline has no \"" << name << "\" component (it lists "
                                    << [&] {
                                         std::string keys;
                                         for (const auto& [k, v] : j.items())
                                           if (!k.empty() && k[0] != '_' && v.is_array()) keys += (keys.empty() ? "" : ", ") + k;
                                         return keys;
                                       }()
                                    << "); name the component's own folder instead"
                                    << (name == "controlnet" ? ", or model.controlnet = \"from-unet\" for a new one "
                                                               "made from the UNet"
                                                             : ""));
  const nlohmann::json& entry = j[name];
  DDM_CHECK(entry.is_array() && entry.size() == 2, index << ": \"" << name << "\" is " << entry.dump()
                                                         << ", not [library, class]");
  DDM_CHECK(!entry[1].is_null(), index << ": the pipeline was saved without a " << name << " (\"" << name
                                       << "\": [null, null]); name one's folder instead");
  DDM_CHECK(entry[1].is_string(), index << ": \"" << name << "\" has class " << entry[1].dump() << ", not a name");
  const std::string cls = entry[1].get<std::string>();
  if (!classes.empty()) {
    std::string want;
    for (const std::string& c : classes) want += (want.empty() ? "" : " or ") + c;
    DDM_CHECK(std::find(classes.begin(), classes.end(), cls) != classes.end(),
              index << ": the pipeline's " << name << " is a " << cls << ", and ddm reads " << want << " there");
  }
  const fs::path folder = fs::path(dir) / name;
  DDM_CHECK(fs::is_directory(folder), index << " lists the " << name << " (" << cls << "), but " << folder.string()
                                            << " is missing: the directory is incomplete (copy it whole)");
  return folder.string();
}

}  // namespace ddm::sd
