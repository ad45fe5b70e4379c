// Checked integers from JSON (core/json.h): the type and the range are checked before converting, so a
// float such as 3e81 or an integer out of range is a clear error naming what it is, never undefined
// behaviour; and a timeline file with one is refused naming the file and the key.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"
#include "pipeline/timeline.h"
#include "test_util.h"

namespace {

using namespace ddm;
using ddm::test::error_message;

TEST(JsonInt, ChecksTypeAndRangeBeforeConverting) {
  using nlohmann::json;
  EXPECT_EQ(json_int(json(5), "k", 0, 10), 5);
  EXPECT_EQ(json_int(json(-7), "k"), -7);
  EXPECT_EQ(json_int(json(std::numeric_limits<int64_t>::max()), "k"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(json_int32(json(2147483647), "k"), 2147483647);
  EXPECT_EQ(error_message([] { json_int(json(3e81), "profile.json: key \"rows\""); }),
            "profile.json: key \"rows\": 3e+81 is not an integer in [-9223372036854775808, 9223372036854775807]");
  EXPECT_EQ(error_message([] { json_int(json(2.0), "k", 0, 10); }), "k: 2.0 is not an integer in [0, 10]");
  EXPECT_EQ(error_message([] { json_int(json("12"), "k", 0, 10); }), "k: \"12\" is not an integer in [0, 10]");
  EXPECT_EQ(error_message([] { json_int(json(-1), "k", 0, 10); }), "k: -1 is not an integer in [0, 10]");
  // A non-negative value below a positive lower bound (parsed as unsigned; found by fuzz_diffusers_configs).
  EXPECT_EQ(error_message([] { json_int(nlohmann::json::parse("0"), "k", 1, 10); }), "k: 0 is not an integer in [1, 10]");
  EXPECT_EQ(error_message([] { json_int(nlohmann::json::parse("3"), "k", -10, -1); }), "k: 3 is not an integer in [-10, -1]");
  EXPECT_EQ(error_message([] { json_int(json(std::numeric_limits<uint64_t>::max()), "k"); }),
            "k: 18446744073709551615 is not an integer in [-9223372036854775808, 9223372036854775807]");
  EXPECT_EQ(error_message([] { json_int32(json(int64_t{1} << 40), "k", 0); }),
            "k: 1099511627776 is not an integer in [0, 2147483647]");
}

TEST(JsonInt, ATimelineWithAFloatForACountIsRefusedNamingTheFileAndKey) {
  ddm::test::TempDir dir;
  const std::string path = dir.path + "/timeline.json";
  write_file_atomic(path, R"({"format": "ddm pipeline timeline 1", "stages": 3e81, "schedule": "1f1b"})");
  const std::string msg = error_message([&] { read_pipe_timeline(path); });
  EXPECT_NE(msg.find(path + " is not a pipeline timeline ddm wrote: key \"stages\": 3e+81 is not an integer"),
            std::string::npos)
      << msg;
  write_file_atomic(path, R"({"format": "something else"})");
  const std::string other = error_message([&] { read_pipe_timeline(path); });
  EXPECT_NE(other.find(path + " is not a pipeline timeline ddm wrote: unknown format"), std::string::npos) << other;
}

}  // namespace
