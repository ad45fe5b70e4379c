// Checked integers from the JSON files ddm reads back (profiles, timelines, run records, manifests):
// nlohmann's get<int64_t>() of a float such as 3e81, or get<int>() of an integer out of int's range,
// is undefined behaviour, and of a string a message that names neither the file nor the key. These
// check first.
#pragma once
#include <cstdint>
#include <limits>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace ddm {

// v as an integer in [lo, hi]; otherwise a ddm::Error "<what>: <v> is not an integer in [lo, hi]".
int64_t json_int(const nlohmann::json& v, const std::string& what, int64_t lo = std::numeric_limits<int64_t>::min(),
                 int64_t hi = std::numeric_limits<int64_t>::max());
// A JSON file parsed; a ddm::Error "<path>: not valid JSON (...)" if it is not, or cannot be read.
nlohmann::json read_json_file(const std::string& path);
// The same in [lo, hi] within int's range.
int json_int32(const nlohmann::json& v, const std::string& what, int lo = std::numeric_limits<int>::min(),
               int hi = std::numeric_limits<int>::max());

}  // namespace ddm
