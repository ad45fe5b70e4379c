// Shared pieces of the ddm command line: validators with readable messages and the Command record
// that each group of subcommands returns to main. Defaults are shown one way: a literal default after
// the option's type (`--n INT=100`, captured for every option by ddm.cpp); where the default is
// worked out when the command runs (the run's sample.steps), the option shows none (default_str(""))
// and its text says "(default: ...)".
#pragma once

#include <CLI/CLI.hpp>

#include <cmath>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/input_check.h"  // DDM_INPUT_CHECK: usage mistakes exit 2 under every command

namespace ddm {

// "must be a positive integer, got 'x'" (CLI11's numeric ranges print the whole double range). A
// finite number in [min, max]: an integer too large for its type would be capped by CLI11 silently.
inline CLI::Validator number_in(double min, double max, const std::string& what) {
  return CLI::Validator(
      [min, max, what](std::string& value) -> std::string {
        try {
          size_t used = 0;
          const double v = std::stod(value, &used);
          if (used == value.size() && std::isfinite(v) && v >= min && v <= max) return "";
        } catch (const std::exception&) {
        }
        return "must be " + what + ", got '" + value + "'";
      },
      "");  // nothing after the type in --help: the type and the default say it (INT=100)
}
inline CLI::Validator number_at_least(double min, const std::string& what) {
  return number_in(min, 9.2e18, what);  // (below 2^63: what an int64 holds)
}
inline const CLI::Validator kPositive = number_at_least(1, "a positive integer");
inline const CLI::Validator kNonNegative = number_at_least(0, "a number >= 0");
// A --device value: auto | cpu | cuda | cuda:N (its message is check_device_spec's).
inline const CLI::Validator kDeviceSpec = CLI::Validator(
    [](std::string& value) -> std::string {
      try {
        check_device_spec(value, "--device");
      } catch (const std::exception& e) {
        return e.what();
      }
      return "";
    },
    "DEVICE");

// The texts of the command line, then those of `file` (one per line, a trailing \r dropped), each
// with what names it in errors.
inline std::vector<std::pair<std::string, std::string>> read_texts(const std::vector<std::string>& args,
                                                                   const std::string& file, const std::string& option) {
  std::vector<std::pair<std::string, std::string>> texts;
  // As a caption is read (data/captions.h): without the whitespace around it, nor a file's UTF-8 BOM.
  const auto trimmed = [](std::string t) {
    const char* ws = " \t\r\n\v\f";
    const size_t b = t.find_first_not_of(ws);
    return b == std::string::npos ? std::string() : t.substr(b, t.find_last_not_of(ws) - b + 1);
  };
  for (size_t i = 0; i < args.size(); ++i) texts.emplace_back(trimmed(args[i]), "text " + std::to_string(i + 1) + " of the command line");
  if (!file.empty()) {
    if (std::filesystem::is_directory(file)) throw InputError(option + " " + file + ": a directory; give a text file, one per line");
    std::ifstream in(file, std::ios::binary);
    if (!in) throw InputError(file + ": cannot read it (" + option + ")");
    std::string line;
    int n = 1;
    for (; std::getline(in, line); ++n) {
      if (n == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);
      texts.emplace_back(trimmed(line), file + " line " + std::to_string(n));
    }
    if (n == 1) throw InputError(option + " " + file + ": the file is empty; write one per line");
  }
  return texts;
}


// A subcommand and what runs when it was chosen (returns the exit code).
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

// The registry (apps/ddm.cpp) calls these in the order `ddm --help` lists them; each adds its
// subcommand(s) to `app` and returns what runs when one is chosen.
// `ddm train`, `train-autoencoder`, `train-classifier` (it records argv), `presets` (apps/train_cli.cpp).
Command add_train_command(CLI::App& app);
Command add_autoencoder_command(CLI::App& app);
Command add_classifier_command(CLI::App& app, int argc, char** argv);
Command add_presets_command(CLI::App& app);

// `ddm text tokenize` (apps/text_cli.cpp).
Command add_text_command(CLI::App& app);

// `ddm shards write` and `ddm encode` (apps/shards_cli.cpp).
Command add_shards_command(CLI::App& app);
Command add_encode_command(CLI::App& app);

// `ddm export` (apps/export_cli.cpp).
Command add_export_command(CLI::App& app);

// `ddm quickstart` (apps/quickstart_cli.cpp).
Command add_quickstart_command(CLI::App& app);

// `ddm sample` and `ddm eval` are declared in apps/sample_cli.h.

// Decentralized-diffusion subcommands (apps/decentral_cli.cpp): partition, ...
std::vector<Command> add_decentral_commands(CLI::App& app);

// `ddm plan` (apps/plan_cli.cpp).
Command add_plan_command(CLI::App& app);

// `ddm launch` (apps/launch_cli.cpp). It reads argv itself to find the `--` before the command.
Command add_launch_command(CLI::App& app, int argc, char** argv);

// The decentralized quickstart's training (apps/decentral_cli.cpp): writes OUT/quickstart.toml (the
// experts' config) and OUT/islands.toml, then runs those islands: a K = 4 partition, four experts
// splitting the global batch, a router, and OUT/ensemble.json. expert_steps / router_steps / threads
// of 0 keep the defaults; device is every island's train.device; concurrency islands run at once
// (run.concurrency). Returns the islands' exit code.
int run_quickstart_islands(const std::string& out, const std::string& experts_config, int64_t expert_steps,
                           int64_t router_steps, int64_t threads, const std::string& device,
                           int64_t concurrency);

// `ddm --version`'s text (apps/version_cli.cpp): ddm, its commit, LibTorch, CUDA, the GPUs seen.
std::string version_text();

}  // namespace ddm
