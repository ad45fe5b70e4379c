// `ddm shards write`: any dataset ddm loads whole (Fashion-MNIST, an image folder, a safetensors
// file; config data.*) written as WebDataset tar shards for data.source = "shards" (docs/data.md).
#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli_util.h"
#include "core/config.h"
#include "core/progress.h"  // format_bytes
#include "data/dataset.h"
#include "data/shard_write.h"

namespace ddm {

Command add_shards_command(CLI::App& app) {
  struct Args {
    std::string config, out, prefix = "train";
    std::vector<std::string> overrides;
    int64_t shard_size = 10000;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("shards", "Tar shards (WebDataset layout) for streaming large datasets.");
  cmd->require_subcommand(1);
  auto* write = cmd->add_subcommand(
      "write",
      "Write the data a config names (data.source fashion-mnist, folder or safetensors, with data.split and "
      "data.limit) as tar shards OUT/PREFIX-000000.tar, ...: each sample a lossless PNG (grey or RGB, as the data "
      "is) and its label as .cls. Each shard is written atomically; the same data gives the same bytes. Train on "
      "them with --set data.source=shards --set data.root='<the pattern it prints>' --set data.resolution=N.");
  write->add_option("--config", a->config, "a config whose data.* names the data (default: Fashion-MNIST train)");
  write->add_option("--set", a->overrides, "override a config key, e.g. --set data.split=test (repeatable)");
  write->add_option("--out", a->out, "the folder to write the shards into (created if missing)")->required();
  write->add_option("--shard-size", a->shard_size, "samples per shard (default 10000)")->check(kPositive);
  write->add_option("--prefix", a->prefix, "shard file names start with this (default train)");
  return Command{cmd, [a] {
                   const RunConfig cfg = a->config.empty() ? parse_config("", "--set", a->overrides)
                                                           : load_config(a->config, a->overrides);
                   const Dataset data = load_dataset(cfg.data);
                   std::cout << "writing " << data.description << " as shards of " << a->shard_size << " into "
                             << a->out << std::endl;
                   const int64_t n = data.images.size(0), shards = (n + a->shard_size - 1) / a->shard_size;
                   const ShardsWritten w = write_shards(data, a->out, a->shard_size, a->prefix, [&](int64_t done) {
                     const int64_t k = (done + a->shard_size - 1) / a->shard_size;
                     if (k == shards || k % std::max<int64_t>(1, shards / 10) == 0)
                       std::cout << "  " << k << "/" << shards << " shards, " << done << " samples" << std::endl;
                   });
                   std::cout << "wrote " << w.samples << " samples in " << w.shards << " shard"
                             << (w.shards > 1 ? "s" : "") << " (" << format_bytes(w.bytes) << ")\n"
                             << "train on them with: --set data.source=shards --set \"data.root=" << w.pattern
                             << "\" --set data.resolution=" << data.images.size(2) << std::endl;
                   return 0;
                 }};
}

}  // namespace ddm
