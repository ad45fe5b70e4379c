// ddm command-line interface: parses flags with CLI11 and calls the library. This file holds only
// main and the registry of subcommands; each group lives in its own file:
//   train, train-autoencoder, train-classifier, presets   apps/train_cli.cpp
//   sample, eval                                          apps/sample_cli.cpp
//   quickstart                                            apps/quickstart_cli.cpp
//   partition, train-router, ensemble, islands, distill   apps/decentral_cli.cpp
//   launch                                                apps/launch_cli.cpp
//   plan                                                  apps/plan_cli.cpp
//   shards write, encode                                  apps/shards_cli.cpp
//   text tokenize                                         apps/text_cli.cpp
//   export                                                apps/export_cli.cpp
//   --version                                             apps/version_cli.cpp
// Exit status: 0; 1 for an error; 2 (kExitBadInput, core/error.h) when the command line or the
// config was refused before anything ran (running it again unchanged fails the same way); 128 + the
// signal for a run stopped by SIGINT / SIGTERM.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <csignal>
#include <exception>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli_util.h"
#include "comm/env.h"
#include "core/cuda_load.h"
#include "core/error.h"
#include "core/runtime.h"
#include "core/suggest.h"
#include "core/version.h"
#include "model/fused_gpu.h"
#include "model/ops.h"
#include "sample_cli.h"

namespace {

// `ddm --help` lists each subcommand by the first line of its description (its summary; `ddm NAME
// --help` shows the whole), grouped as git groups its commands.
class SummaryFormatter : public CLI::Formatter {
 public:
  std::string make_subcommand(const CLI::App* sub) const override {
    std::stringstream out;
    const std::string d = sub->get_description();
    CLI::detail::format_help(out, sub->get_display_name(true), d.substr(0, d.find('\n')), column_width_);
    return out.str();
  }
};

// The group each subcommand is listed under, in the order of `ddm --help`.
const std::vector<std::pair<std::string, std::vector<std::string>>>& command_groups() {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> g = {
      {"Start here", {"quickstart", "train", "sample", "eval"}},
      {"Decentralized training",
       {"partition", "train-router", "ensemble", "islands", "distill"}},
      {"Models and data", {"train-autoencoder", "train-classifier", "encode", "shards", "text", "export", "presets"}},
      {"Several processes", {"launch", "plan"}}};
  return g;
}

int run(int argc, char** argv) {
  using namespace ddm;
  CLI::App app{"ddm trains diffusion models: one model, data- or pipeline-parallel on many processes,\n"
               "or as decentralized experts on independent compute islands with a router.\n"
               "`ddm NAME --help` explains a command; docs/ the rest."};
  app.formatter(std::make_shared<SummaryFormatter>());
  app.option_defaults()->always_capture_default();  // every option's default, shown one way: --n INT=100
  app.set_version_flag("--version", [] { return version_text(); }, "print ddm's version and commit, LibTorch's, CUDA's, the GPUs seen, and exit");
  app.require_subcommand(1);
  // In the order `ddm --help` lists them (CLI11 lists each group where its first command was added).
  std::vector<Command> commands{add_quickstart_command(app), add_train_command(app), add_sample_command(app),
                                add_eval_command(app)};
  for (Command& c : add_decentral_commands(app)) commands.push_back(std::move(c));
  commands.push_back(add_autoencoder_command(app));
  commands.push_back(add_classifier_command(app, argc, argv));
  commands.push_back(add_encode_command(app));
  commands.push_back(add_shards_command(app));
  commands.push_back(add_text_command(app));
  commands.push_back(add_export_command(app));
  commands.push_back(add_presets_command(app));
  commands.push_back(add_launch_command(app, argc, argv));
  commands.push_back(add_plan_command(app));
  for (const auto& [group, names] : command_groups())
    for (const std::string& name : names) app.get_subcommand(name)->group(group);
  // A mistyped subcommand: named, with the nearest one, before CLI11's "arguments were not expected".
  if (argc > 1 && argv[1][0] != '-') {
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) names.push_back(sub->get_name());
    if (std::find(names.begin(), names.end(), argv[1]) == names.end())
      throw InputError(std::string("'") + argv[1] + "' is not a ddm command" + did_you_mean(argv[1], names) +
                       "; `ddm --help` lists them");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {  // --help and --version exit 0; a command line it cannot parse, 2
    const int code = app.exit(e);
    return code == 0 ? 0 : kExitBadInput;
  }
  // The kernels' switches in the environment (model/fused_gpu.h, model/ops.h), read deep inside a
  // forward: a bad value is refused here, before a command writes anything.
  as_input_error([] {
    fused_group_norm_enabled();  // DDM_FUSED_CUDA and DDM_FUSED_GROUPNORM
    return channels_last_requested();
  });
  for (const Command& c : commands)
    if (*c.app) return c.run();
  return 0;
}

// "error: " or, in a process of a distributed job, "error: rank R: " (unless the message names it).
// Under `ddm launch`, whose "[rank R] " prefix names the rank already, the launcher shows the line
// as "[rank R] error: ..." (src/launch/output.h); torchrun, srun and mpirun show it as it is.
std::string error_prefix(const std::string& message) {
  try {
    const ddm::DistEnv env = ddm::detect_dist_env();
    const std::string rank = "rank " + std::to_string(env.rank) + ":";
    if (env.distributed() && message.rfind(rank, 0) != 0) return "error: " + rank + " ";
  } catch (const std::exception&) {
  }
  return "error: ";
}

}  // namespace

int main(int argc, char** argv) {
  // A write to a peer that died (a Gloo or store socket whose other end a killed rank closed) must
  // fail as an error the collective reports, not kill this process with SIGPIPE: that would turn
  // one dead DiLoCo replica into two (seen under load). Python programs get this by default.
  std::signal(SIGPIPE, SIG_IGN);
  ddm::load_cuda();  // before anything asks LibTorch about CUDA (core/cuda_load.h)
  ddm::configure_allocator();
  try {
    return run(argc, argv);
  } catch (const ddm::InputError& e) {  // the config or the job's input: running it again fails alike
    std::cerr << error_prefix(e.what()) << e.what() << std::endl;
    return ddm::kExitBadInput;
  } catch (const ddm::Error& e) {
    std::cerr << error_prefix(e.what()) << e.what() << std::endl;
    return 1;
  } catch (const c10::Error& e) {
    const std::string prefix = error_prefix("");
    std::cerr << "error (LibTorch): " << prefix.substr(7) << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << error_prefix(e.what()) << e.what() << std::endl;
    return 1;
  }
}
