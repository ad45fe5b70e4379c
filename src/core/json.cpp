// Checked integers from JSON (see json.h).
#include "core/json.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"

namespace ddm {

int64_t json_int(const nlohmann::json& v, const std::string& what, int64_t lo, int64_t hi) {
  // A non-negative integer in the file parses as unsigned: compared with both bounds as unsigned.
  DDM_CHECK(v.is_number_integer() &&
                (v.is_number_unsigned()
                     ? hi >= 0 && v.get<uint64_t>() <= static_cast<uint64_t>(hi) &&
                           (lo <= 0 || v.get<uint64_t>() >= static_cast<uint64_t>(lo))
                     : v.get<int64_t>() >= lo && v.get<int64_t>() <= hi),
            what << ": " << v.dump() << " is not an integer in [" << lo << ", " << hi << "]");
  return v.get<int64_t>();
}

nlohmann::json read_json_file(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": not valid JSON (" + e.what() + ")");
  }
}

int json_int32(const nlohmann::json& v, const std::string& what, int lo, int hi) {
  return static_cast<int>(json_int(v, what, lo, hi));
}

}  // namespace ddm
