// `ddm shards write`: any dataset ddm loads whole (Fashion-MNIST, an image folder, a safetensors
// file; config data.*) written as WebDataset tar shards for data.source = "shards" (docs/data.md);
// or shards (--from, or a config whose data.source is shards) re-sharded, samples copied unchanged.
// `ddm encode`: latent shards, a frozen autoencoder's posterior of every sample (train/encode_shards.h).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli_util.h"
#include "core/config.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/progress.h"  // format_bytes
#include "data/dataset.h"
#include "data/origin.h"
#include "data/shard_write.h"
#include "data/shards.h"
#include "run/trainer.h"  // set_threads
#include "train/encode_shards.h"

namespace ddm {
namespace {

// A write that failed part-way (a source shard damaged further on, a full disk): the shards it wrote
// are removed (the one it was writing, NAME.tar.partial, went with its writer), and --out if it made
// it, so that nothing of it is read as data; the error, of its own type, says so.
[[noreturn]] void throw_without_partial_write(const std::exception& e, const std::vector<std::string>& written, bool made,
                                              const std::string& out) {
  std::error_code ec;
  for (const std::string& f : written) std::filesystem::remove(f, ec);
  if (made && std::filesystem::is_empty(out, ec)) std::filesystem::remove(out, ec);
  std::string what = e.what();
  if (!written.empty())
    what += " (the " + std::to_string(written.size()) + " shard" + (written.size() > 1 ? "s" : "") +
            " this write made before it " + (written.size() > 1 ? "are" : "is") + " removed: nothing of it is left)";
  if (dynamic_cast<const InputError*>(&e)) throw InputError(what);
  throw Error(what);
}

}  // namespace

Command add_shards_command(CLI::App& app) {
  struct Args {
    std::string config, out, prefix = "train", from;
    std::vector<std::string> overrides;
    int64_t shard_size = 10000;
    bool force = false;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("shards", "Write tar shards (WebDataset layout) to stream large datasets from.");
  cmd->require_subcommand(1);
  auto* write = cmd->add_subcommand(
      "write",
      "Write the data a config names (data.source fashion-mnist, folder or safetensors, with data.split and "
      "data.limit) as tar shards OUT/PREFIX-000000.tar, ...: each sample a lossless PNG (grey or RGB, as the data "
      "is), its label as .cls and its caption as .txt. Each shard is written atomically; the same data gives the same bytes. Train on "
      "them with --set data.source=shards --set data.root='<the pattern it prints>' --set data.resolution=N. "
      "Shards (--from, or a config with data.source = shards) are re-sharded: their samples copied in order, "
      "keys and bytes unchanged, into shards of --shard-size.");
  write->add_option("--config", a->config, "a config whose data.* names the data (default: Fashion-MNIST train)");
  write->add_option("--set", a->overrides, "override a config key, e.g. --set data.split=test (repeatable)");
  write->add_option("--out", a->out, "the folder to write the shards into (created if missing)")->required();
  write->add_option("--shard-size", a->shard_size, "samples per shard")->check(kPositive);
  write->add_option("--prefix", a->prefix, "shard file names start with this");
  write->add_option("--from", a->from, "re-shard these shards (a brace pattern, a glob or a list file)");
  write->add_flag("--force", a->force,
                  "replace the shards of this --prefix that --out holds already (without it they are refused: a "
                  "folder or a glob would read the old ones beside the new)");
  write->footer("\nExamples:\n"
                "  ddm shards write --out data/fmnist                       # Fashion-MNIST's training images\n"
                "  ddm shards write --config configs/folder-example.toml --set data.root=path/to/photos --out data/mine\n"
                "  ddm shards write --from 'big-{000000..000099}.tar' --out data/resharded\n");
  return Command{cmd, [a] {
                   const auto report = [&](int64_t shards) {
                     return [&, shards](int64_t done) {
                       const int64_t k = (done + a->shard_size - 1) / a->shard_size;
                       if (shards <= 0 || k == shards || k % std::max<int64_t>(1, shards / 10) == 0)
                         std::cout << "  " << k << (shards > 0 ? "/" + std::to_string(shards) : std::string())
                                   << (shards > 1 || (shards <= 0 && k != 1) ? " shards, " : " shard, ") << done
                                   << (done == 1 ? " sample" : " samples") << std::endl;
                     };
                   };
                   const auto done = [&](const ShardsWritten& w, const std::string& resolution) {
                     std::cout << "wrote " << w.samples << " samples in " << w.shards << " shard"
                               << (w.shards > 1 ? "s" : "") << " (" << format_bytes(w.bytes) << ")\n"
                               << "train on them with: --set data.source=shards --set \"data.root=" << w.pattern
                               << "\" --set data.resolution=" << resolution
                               << (resolution == "SIDE" ? "  (the side images are cropped to, e.g. 64)" : "") << std::endl;
                   };
                   std::string from = a->from;
                   // What the command line asks for is checked before anything is written (exit 2).
                   DDM_INPUT_CHECK(!a->prefix.empty() && a->prefix.find('/') == std::string::npos &&
                                       a->prefix.find('{') == std::string::npos,
                                   "--prefix '" << a->prefix << "' must be a plain file name start (no '/', no braces)");
                   if (from.empty()) {
                     const RunConfig cfg = as_input_error([&] {
                       return a->config.empty() ? parse_config("", "--set", a->overrides) : load_config(a->config, a->overrides);
                     });
                     if (cfg.data.source == "shards") from = cfg.data.root;
                   } else {
                     DDM_INPUT_CHECK(a->config.empty() && a->overrides.empty(), "--from re-shards shards as they are; "
                                                                          "it takes no --config or --set");
                   }
                   // Shards of this prefix that --out holds already: a folder or a glob would read them beside
                   // the new ones, and a shorter write leaves some. Refused, or with --force removed (never an
                   // input of the re-sharding), before anything is written.
                   const std::vector<std::string> inputs =
                       from.empty() ? std::vector<std::string>{}
                                    : as_input_error([&] { return expand_shards(from, a->from.empty() ? "data.root" : "--from"); });
                   // Exactly the names this command writes, PREFIX-NNNNNN.tar (not another dataset's
                   // PREFIX-val-000000.tar), in --out now.
                   const auto ours = [&] {
                     std::vector<std::string> found;
                     if (std::error_code ec; std::filesystem::is_directory(a->out, ec))
                       for (const auto& e : std::filesystem::directory_iterator(a->out)) {
                         const std::string name = e.path().filename().string(), head = a->prefix + "-";
                         if (name.size() == head.size() + 10 && name.rfind(head, 0) == 0 &&
                             name.compare(name.size() - 4, 4, ".tar") == 0 &&
                             std::all_of(name.begin() + static_cast<std::ptrdiff_t>(head.size()), name.end() - 4,
                                         [](char c) { return c >= '0' && c <= '9'; }))
                           found.push_back(e.path().string());
                       }
                     return found;
                   };
                   std::vector<std::string> old = ours();
                   std::sort(old.begin(), old.end());
                   if (!old.empty()) {
                     // A write that was stopped leaves the shard it was writing as NAME.tar.partial.
                     bool stopped = false;
                     for (const auto& e : std::filesystem::directory_iterator(a->out)) {
                       const std::string name = e.path().filename().string();
                       stopped = stopped || (name.rfind(a->prefix + "-", 0) == 0 && name.size() > 8 &&
                                             name.compare(name.size() - 8, 8, ".partial") == 0);
                     }
                     DDM_INPUT_CHECK(a->force, "--out " << a->out << " holds " << old.size() << " shard"
                                                        << (old.size() > 1 ? "s" : "") << " named " << a->prefix
                                                        << "-NNNNNN.tar already (" << old.front()
                                                        << (old.size() > 1 ? ", ..." : "") << ")"
                                                        << (stopped ? ", of a write that was stopped before it finished "
                                                                      "(a .partial shard is beside them)"
                                                                    : "")
                                                        << ", which a folder or a glob would read beside the new "
                                                           "ones: pass --force to replace them, or use another --out "
                                                           "or --prefix");
                     for (const std::string& o : old)
                       for (const std::string& in : inputs)
                         DDM_INPUT_CHECK(!std::filesystem::equivalent(o, in),
                                         "--force would delete " << o << ", an input shard of the re-sharding; "
                                                                 "write into another --out or with another --prefix");
                   }
                   const auto remove_old = [&] {  // once the data is known to be readable
                     if (old.empty()) return;
                     for (const std::string& o : old) std::filesystem::remove(o);
                     std::filesystem::remove(std::filesystem::path(a->out) / (a->prefix + ".shards.json"));
                     std::cout << "removed " << old.size() << " earlier shard" << (old.size() > 1 ? "s" : "")
                               << " of " << a->out << " (--force)" << std::endl;
                   };
                   if (!from.empty()) {
                     const auto& shards = inputs;
                     std::cout << "re-sharding " << shards.size() << " shard" << (shards.size() > 1 ? "s" : "")
                               << " (" << from << ") into shards of " << a->shard_size << " in " << a->out << std::endl;
                     DataConfig source;
                     source.source = "shards", source.root = from;
                     // Each input opens as a tar, reads its first sample (if any) and ends as a tar before
                     // --force removes anything (a shard damaged further on is met while re-sharding).
                     for (const std::string& in : shards)
                       as_input_error([&] {
                         TarShardReader r(in);
                         ShardSample first;
                         r.next(first);
                       });
                     check_whole_tars(shards);
                     const bool made = !std::filesystem::exists(a->out);
                     as_input_error([&] { create_output_dir(a->out, "--out"); });
                     remove_old();
                     ShardsWritten w;
                     try {
                       w = reshard(shards, a->out, a->shard_size, a->prefix, report(0));
                     } catch (const std::exception& e) {
                       throw_without_partial_write(e, ours(), made, a->out);
                     }
                     write_shards_record(a->out, a->prefix, w, data_origin(source), "re-sharded from " + from,
                                         recorded_class_names(shards));
                     done(w, "SIDE");  // shards hold images of any size
                     return 0;
                   }
                   const RunConfig cfg = as_input_error([&] {
                     return a->config.empty() ? parse_config("", "--set", a->overrides) : load_config(a->config, a->overrides);
                   });
                   const Dataset data = as_input_error([&] { return load_dataset(cfg.data); });
                   std::cout << "writing " << data.description << " as shards of " << a->shard_size << " into "
                             << a->out << std::endl;
                   const int64_t n = data.images.size(0), shards = (n + a->shard_size - 1) / a->shard_size;
                   const bool made = !std::filesystem::exists(a->out);
                   as_input_error([&] { create_output_dir(a->out, "--out"); });
                   remove_old();
                   ShardsWritten w;
                   try {
                     w = write_shards(data, a->out, a->shard_size, a->prefix, report(shards));
                   } catch (const std::exception& e) {
                     throw_without_partial_write(e, ours(), made, a->out);
                   }
                   write_shards_record(a->out, a->prefix, w, data_origin(cfg.data), data.description,
                                       data.num_classes > 0 ? data.class_names : std::vector<std::string>{});
                   done(w, std::to_string(data.images.size(2)));
                   return 0;
                 }};
}

Command add_encode_command(CLI::App& app) {
  struct Args {
    std::string config, ae, out, device = "cpu";
    std::vector<std::string> overrides;
    int64_t shard_size = 10000, threads = 0;
    bool text = false;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand(
      "encode",
      "Encode a dataset once: latents (and caption encodings) as tar shards.\n"
      "Encode every image of the data a config names (any source: Fashion-MNIST, a folder, a safetensors file, tar "
      "shards) once with a frozen autoencoder (`ddm train-autoencoder`) and write its posteriors (mean and log-variance, "
      "float32, as KEY.safetensors, with KEY.cls) as tar shards OUT/latents-000000.tar, ... with OUT/encode.json naming "
      "the autoencoder and the data. Shards keep the source shards' sizes (so samples keep their positions), or hold "
      "--shard-size samples. Images are centre-cropped and never flipped. OUT is written whole or not at all. A latent "
      "model (model.latent = the same autoencoder) trains on them with data.source = \"latents\", data.root = OUT. "
      "Captions are kept (KEY.txt); with --text, each caption's encoding by the config's model.text_encoder is "
      "written too, and a text model trained on the shards does not run the encoder (docs/text.md). For a pixel "
      "text model, --text without --ae keeps the images as they are (OUT/images-000000.tar, ...) beside each "
      "caption's encoding.");
  cmd->add_option("--ae", a->ae,
                  "the autoencoder: a `ddm train-autoencoder` run directory (required, except with --text for a pixel "
                  "model)");
  cmd->add_option("--out", a->out, "the directory to write (must not exist)")->required();
  cmd->add_option("--config", a->config, "a config whose data.* names the data (default: Fashion-MNIST train)");
  cmd->add_option("--set", a->overrides, "override a config key, e.g. --set data.split=test (repeatable)");
  cmd->add_option("--shard-size", a->shard_size, "samples per shard for data held in memory")
      ->check(kPositive);
  cmd->add_option("--device", a->device, "where the encoder runs: cpu, cuda, cuda:N or auto")
      ->check(kDeviceSpec);
  cmd->add_option("--threads", a->threads, "intra-op and decode threads (0 = all cores)")->check(kNonNegative);
  cmd->add_flag("--text", a->text,
                "also cache each caption's text encoding by the config's model.text_encoder (with its text_skip and "
                "text_tokens): float32 states per token, so about T x D x 4 bytes a sample");
  cmd->footer("\nExamples:\n"
              "  ddm encode --ae runs/ae --config configs/own-64.toml --out latents       # then data.source = \"latents\"\n"
              "  ddm encode --config text.toml --text --out encoded    # images kept, captions' encodings cached\n");
  return Command{cmd, [a, cmd] {
                   const RunConfig cfg = as_input_error([&] {
                     return a->config.empty() ? parse_config("", "--set", a->overrides) : load_config(a->config, a->overrides);
                   });
                   if (cmd->count("--shard-size") > 0 && cfg.data.source == "shards")
                     std::cerr << "note: --shard-size is for data held in memory: the latent shards keep the sizes of "
                                  "the source shards, so that each sample keeps its position (which partitions and "
                                  "hold-outs name); for other sizes, re-shard the source first (ddm shards write "
                                  "--from ... --shard-size N)"
                               << std::endl;
                   EncodeShardsOptions o;
                   o.out = dir_without_slash(a->out);  // OUT.partial is renamed to OUT when complete
                   o.shard_size = a->shard_size;
                   o.device = resolve_device(a->device, 0, "--device");
                   o.threads = set_threads(a->threads);
                   o.text = a->text;
                   o.text_model = cfg.model;
                   const auto t0 = std::chrono::steady_clock::now();
                   const LatentShardsInfo info = encode_latent_shards(cfg.data, a->ae, o);
                   const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                   std::cout << "wrote the " << (info.holds_images() ? "images" : "latents")
                             << (info.text.encoder.empty() ? "" : " and text encodings") << " of "
                             << info.samples << " samples in " << info.shards << " shard"
                             << (info.shards > 1 ? "s" : "") << " (" << format_bytes(info.bytes) << ") in "
                             << static_cast<int64_t>(s + 0.5) << " s\n"
                             << "their record: " << a->out << "/" << kLatentShardsInfo << "\n"
                             << "train " << (info.holds_images() ? "a pixel" : "a latent")
                             << " model on them: ddm train --config CONFIG --set data.source=latents "
                             << "--set data.root=" << a->out
                             << (info.holds_images() ? "" : " --set model.latent=" + a->ae)
                             << (info.text.encoder.empty() ? "" : " --set model.text_encoder=" + info.text.encoder)
                             << " --out RUN" << std::endl;
                   return 0;
                 }};
}

}  // namespace ddm
