// `ddm launch`: start N local workers (ddm subcommands, or any program with --no-ddm) with
// torchrun's environment, and supervise them (src/launch/launcher.h).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli_util.h"
#include "core/error.h"
#include "core/suggest.h"
#include "launch/launcher.h"

namespace ddm {

namespace {

const char* kLaunchHelp =
    "Start --nproc worker processes of a ddm command, as torchrun does.\n"
    "Start --nproc workers on this machine, each running `ddm COMMAND...` (this ddm binary), with the "
    "environment torchrun gives its workers: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0, "
    "GROUP_WORLD_SIZE=1, ROLE_NAME=default, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, "
    "TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID, TORCHELASTIC_USE_AGENT_STORE=True, and DDM_LAUNCHER=ddm. "
    "Like torchrun's agent, the launcher hosts the rendezvous TCPStore at MASTER_ADDR:MASTER_PORT for the whole "
    "launch; workers connect to it as clients under the prefix /worker/attempt_<TORCHELASTIC_RESTART_COUNT>. "
    "Each worker's stdout and stderr are shown line by line, prefixed `[rank N] ` (a ddm worker's "
    "`error: rank N: ...` is shown as `[rank N] error: ...`).";

const char* kLaunchFooter =
    "Faults: when a worker exits non-zero or is killed by a signal, the launcher names the rank and the cause, "
    "stops the other workers (SIGTERM, then SIGKILL after --grace seconds) and, while --max-restarts allows, "
    "starts all of them again with TORCHELASTIC_RESTART_COUNT one higher. `ddm train` resumes from its last "
    "checkpoint in --out when that count is above 0, so a restart repeats at most the steps since the last "
    "checkpoint. Ranks are not tied to processes across restarts. A ddm worker that exits with status 2 stopped on "
    "bad input (its command line or config refused before it ran, or a damaged sample of its data): it is not "
    "restarted, since it would fail the same way.\n"
    "Signals: SIGINT, SIGTERM and SIGHUP are forwarded to every worker; the launcher waits --grace seconds, kills "
    "what is left and exits with 128 + the signal (130 for Ctrl-C). A second signal kills at once. A ddm worker "
    "sent SIGTERM or SIGINT itself stops the job (the ranks agree on the step, rank 0 writes a checkpoint): "
    "not restarted, and the launcher exits with its status.\n"
    "Exit status: 0 when every worker exited 0; 1 when the restarts ran out, --timeout expired, or the launch "
    "could not start; 2 when its own flags or a ddm worker's input were refused (a worker's exit status 2, not "
    "restarted); 128 + signal when "
    "the launcher, or a ddm worker, was sent that signal. Worker processes never outlive the launcher, "
    "even one killed with SIGKILL (they get SIGTERM; a worker that starts children of its own must pass it on).\n"
    "Examples:\n"
    "  ddm launch --nproc 2 -- train --config configs/quickstart.toml --out runs/dp2\n"
    "  ddm launch --nproc 4 --max-restarts 3 -- train --config c.toml --out runs/x --resume\n"
    "  ddm launch --nproc 2 --no-ddm -- sh -c 'echo rank $RANK of $WORLD_SIZE'";

// The arguments after the first `--` that follows the `launch` word, or nullopt when there is none.
std::optional<std::vector<std::string>> after_separator(int argc, char** argv) {
  int i = 1;
  while (i < argc && std::strcmp(argv[i], "launch") != 0) ++i;
  for (++i; i < argc; ++i)
    if (std::strcmp(argv[i], "--") == 0) return std::vector<std::string>(argv + i + 1, argv + argc);
  return std::nullopt;
}

}  // namespace

Command add_launch_command(CLI::App& app, int argc, char** argv) {
  auto c = std::make_shared<LaunchConfig>();
  auto positional = std::make_shared<std::vector<std::string>>();
  auto* cmd = app.add_subcommand("launch", kLaunchHelp);
  cmd->add_option("--nproc", c->nproc, "number of workers (ranks 0..N-1)")->required()->default_str("");
  cmd->add_option("--max-restarts", c->max_restarts,
                  "how many restarts (of all workers, or of one with --restart failed) the launch may use");
  cmd->add_option("--restart", c->restart,
                  "all (torchrun's semantics): a failed worker stops the others and all restart from the "
                  "last checkpoint; failed: a failed worker other than rank 0 restarts alone (DDM_REJOIN=1) while "
                  "the others go on, which DiLoCo replicas take back at their next synchronization");
  cmd->add_option("--timeout", c->timeout_s,
                  "seconds an attempt may run before its workers are stopped and the launch fails (0: no limit)");
  cmd->add_option("--grace", c->grace_s, "seconds stopped workers get to exit before SIGKILL");
  cmd->add_option("--master-port", c->master_port,
                  "port of the launcher's TCPStore (MASTER_PORT); 0: the kernel picks a free port as the "
                  "store binds it, so no other process can take it in between");
  cmd->add_option("--run-id", c->run_id, "TORCHELASTIC_RUN_ID (none unless given, as torchrun)");
  cmd->add_flag("--no-ddm", c->no_ddm,
                "the command is a program and its arguments, not a ddm subcommand (as torchrun's --no_python)");
  cmd->add_option("command", *positional, "after `--`: the ddm subcommand and its flags (or, with --no-ddm, a "
                                          "program and its arguments)");
  cmd->footer(kLaunchFooter);
  // c and positional outlive parsing (CLI11 writes into them); app outlives the run (apps/ddm.cpp).
  auto run = [c, positional, argc, argv, &app]() -> int {
    const auto command = after_separator(argc, argv);
    DDM_INPUT_CHECK(command.has_value(), "ddm launch: put the command after `--`, e.g. `ddm launch --nproc 2 -- train "
                                   "--config c.toml --out runs/x` (or `--no-ddm -- PROGRAM ARGS`)");
    // A ddm subcommand that does not exist is said once, not by each of the --nproc workers.
    if (!c->no_ddm && !command->empty()) {
      const std::string& sub = command->front();
      std::vector<std::string> names;
      for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; })) names.push_back(s->get_name());
      const bool known = std::find(names.begin(), names.end(), sub) != names.end();
      const bool ddm_again = sub == "ddm" || (sub.size() > 4 && sub.compare(sub.size() - 4, 4, "/ddm") == 0);
      DDM_INPUT_CHECK(known || ddm_again || sub.rfind("-", 0) == 0,  // (`-- ddm train`: the launcher says what to do)
                      "ddm launch: `" << sub << "` is not a ddm command" << did_you_mean(sub, names)
                                      << " (`ddm --help` lists them); to run a program of your own, give --no-ddm");
    }
    c->command = *command;
    return run_launch(*c);
  };
  return Command{cmd, run};
}

}  // namespace ddm
