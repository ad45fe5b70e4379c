// The source tree's floors (README, "Layout"): a file under src/ includes headers of its own folder
// and of the folders on floors below it, never of one above. Checked on every #include "folder/..."
// of every file, so a new include that runs back up fails here, naming the file and line.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "test_util.h"

namespace fs = std::filesystem;

TEST(Layout, NoFileIncludesAFolderAboveItsOwn) {
  // Folders on one floor do not include each other except where the order below allows it.
  const std::map<std::string, int> floor = {
      {"core", 0},     {"comm", 1},     {"launch", 1},  {"data", 2},     {"model", 3},   {"diffusion", 4},
      {"eval", 5},     {"train", 6},    {"pipeline", 7}, {"parallel", 8}, {"run", 9},   {"decentral", 10}};
  const fs::path src = fs::path(ddm::test::source_dir()) / "src";
  int files = 0;
  for (const auto& entry : fs::recursive_directory_iterator(src)) {
    if (!entry.is_regular_file()) continue;
    const std::string folder = fs::relative(entry.path(), src).begin()->string();
    ASSERT_TRUE(floor.count(folder)) << "src/" << folder << " has no floor: add it to README's Layout and here";
    std::ifstream in(entry.path());
    std::string line;
    int number = 0;
    while (std::getline(in, line)) {
      ++number;
      if (line.rfind("#include \"", 0) != 0) continue;
      const size_t slash = line.find('/');
      if (slash == std::string::npos) continue;
      const std::string target = line.substr(10, slash - 10);
      ASSERT_TRUE(floor.count(target)) << entry.path() << ":" << number << " includes an unknown folder: " << line;
      EXPECT_TRUE(target == folder || floor.at(target) < floor.at(folder))
          << entry.path() << ":" << number << ": src/" << folder << " includes " << line.substr(9)
          << ", a folder on its own floor or above";
    }
    ++files;
  }
  EXPECT_GT(files, 100);
}
