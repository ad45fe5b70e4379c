// `ddm export --diffusers OUT --ckpt RUN`: a trained model written in another library's format, for
// the tools users sample and serve with (src/train/export_diffusers.h: a Stable Diffusion pipeline).
#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>
#include <string>

#include "cli_util.h"
#include "train/export_diffusers.h"
#include "train/loaded_model.h"

namespace ddm {

Command add_export_command(CLI::App& app) {
  struct Args {
    std::string ckpt, diffusers;
    bool no_ema = false;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand(
      "export", "Write a trained model in diffusers' format.\nAn sd-unet run becomes a Stable Diffusion pipeline "
                "directory that StableDiffusionPipeline.from_pretrained opens (a ControlNet run: one that "
                "StableDiffusionControlNetPipeline opens): the run's UNet (or ControlNet and its locked UNet), its "
                "VAE, text encoder and tokenizer, and its scheduler (the scheduler_config.json it was trained with, "
                "or an EulerDiscreteScheduler of its schedule). Written under a temporary name and renamed when "
                "complete (docs/stable-diffusion.md).");
  cmd->add_option("--ckpt", a->ckpt, "run directory (latest checkpoint) or checkpoint directory")->required();
  cmd->add_option("--diffusers", a->diffusers, "the pipeline directory to write (must not exist)")->required();
  cmd->add_flag("--no-ema", a->no_ema, "export the raw weights instead of the EMA");
  cmd->footer("\nExamples:\n"
              "  ddm export --ckpt runs/sd --diffusers runs/sd-diffusers       # the EMA weights of the last checkpoint\n"
              "  ddm export --ckpt runs/sd/ckpt/step-00005000 --diffusers sd-5k --no-ema\n"
              "  python3 -c \"from diffusers import StableDiffusionPipeline as P; P.from_pretrained('runs/sd-diffusers')\"");
  return Command{cmd, [a] {
                   const LoadedModel m = load_model(a->ckpt, !a->no_ema);
                   std::cout << export_diffusers(m, a->diffusers) << std::endl;
                   return 0;
                 }};
}

}  // namespace ddm
