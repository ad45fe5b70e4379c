// The source tree's floors (docs/contributing.md, "The source layout"): a file under src/ includes headers of its own folder
// and of the folders on floors below it, never of one above. Checked on every #include "folder/..."
// of every file, so a new include that runs back up fails here, naming the file and line. And the
// unit tests mirror those folders (tests/unit/<folder>/).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "test_util.h"

namespace fs = std::filesystem;

TEST(Layout, NoFileIncludesAFolderAboveItsOwn) {
  // Folders on one floor do not include each other except where the order below allows it.
  const std::map<std::string, int> floor = {
      {"core", 0},     {"comm", 1},     {"launch", 1},  {"cuda", 1},  {"data", 2},     {"model", 3},   {"diffusion", 4},
      {"text", 4},     {"sd", 5},
      {"eval", 5},     {"train", 6},    {"pipeline", 7}, {"parallel", 8}, {"run", 9},   {"decentral", 10}};
  const fs::path src = fs::path(ddm::test::source_dir()) / "src";
  int files = 0;
  for (const auto& entry : fs::recursive_directory_iterator(src)) {
    if (!entry.is_regular_file()) continue;
    const std::string folder = fs::relative(entry.path(), src).begin()->string();
    ASSERT_TRUE(floor.count(folder)) << "src/" << folder << " has no floor: add it to docs/contributing.md's layout and here";
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

TEST(Layout, TheUnitTestsMirrorTheSourceFolders) {
  // tests/unit/<folder>/ holds the tests of src/<folder>/; only the whole tree's and the build's own
  // checks sit in tests/unit/ itself.
  const fs::path root(ddm::test::source_dir());
  const fs::path src = root / "src", unit = root / "tests" / "unit";
  int folders = 0;
  for (const auto& entry : fs::directory_iterator(src)) {
    if (!entry.is_directory()) continue;
    const std::string folder = entry.path().filename().string();
    int tests = 0;
    if (fs::is_directory(unit / folder))
      for (const auto& t : fs::directory_iterator(unit / folder))
        tests += t.path().filename().string().rfind("test_", 0) == 0 && t.path().extension() == ".cpp";
    EXPECT_GT(tests, 0) << "src/" << folder << " has no tests in tests/unit/" << folder << "/";
    ++folders;
  }
  EXPECT_GE(folders, 12);
  for (const auto& entry : fs::directory_iterator(unit)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory()) {
      EXPECT_TRUE(fs::is_directory(src / name)) << "tests/unit/" << name << "/ mirrors no folder of src/";
    } else if (entry.path().extension() == ".cpp") {
      EXPECT_TRUE(name == "test_layout.cpp" || name == "test_torch_build.cpp")
          << "tests/unit/" << name << " belongs in the folder of the source it tests";
    }
  }
}

namespace {

// Whether `file` includes a LibTorch header, directly or through the project's own headers (src/,
// tests/).
bool reaches_torch(const fs::path& file, const fs::path& root, std::set<std::string>& seen, std::string& via) {
  if (!seen.insert(file.string()).second) return false;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("#include <torch/", 0) == 0 || line.rfind("#include <ATen/", 0) == 0 ||
        line.rfind("#include <c10/", 0) == 0) {
      via = file.string() + ": " + line;
      return true;
    }
    if (line.rfind("#include \"", 0) != 0) continue;
    const std::string name = line.substr(10, line.find('"', 10) - 10);
    for (const char* dir : {"src", "tests"})
      if (fs::exists(root / dir / name) && reaches_torch(root / dir / name, root, seen, via)) return true;
  }
  return false;
}

}  // namespace

TEST(Layout, TorchFreeSourcesIncludeNoTorch) {
  // CMakeLists.txt's DDM_TORCH_FREE_SOURCES compile without the precompiled LibTorch header.
  const fs::path root(ddm::test::source_dir());
  std::ifstream cmake(root / "CMakeLists.txt");
  const std::string text((std::istreambuf_iterator<char>(cmake)), std::istreambuf_iterator<char>());
  const size_t begin = text.find("set(DDM_TORCH_FREE_SOURCES"), end = text.find(')', begin);
  ASSERT_NE(begin, std::string::npos);
  std::istringstream list(text.substr(begin + 26, end - begin - 26));
  int files = 0;
  for (std::string f; list >> f; ++files) {
    ASSERT_TRUE(fs::exists(root / f)) << "DDM_TORCH_FREE_SOURCES names " << f << ", which does not exist";
    std::set<std::string> seen;
    std::string via;
    EXPECT_FALSE(reaches_torch(root / f, root, seen, via))
        << f << " is listed in DDM_TORCH_FREE_SOURCES but includes LibTorch (" << via
        << "): take it off the list";
  }
  EXPECT_GT(files, 10);
}
