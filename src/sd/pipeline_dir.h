// A diffusers pipeline directory, as DiffusionPipeline.save_pretrained writes it: model_index.json
// (each component's name -> [library, class], or [null, null] for one saved without it) and one
// folder per component. The keys that take a pipeline directory (model.unet, model.latent,
// diffusion.scheduler) find their component here, its recorded class checked.
#pragma once
#include <string>
#include <vector>

namespace ddm::sd {

// Whether DIR holds a model_index.json.
bool is_pipeline_dir(const std::string& dir);

// DIR/NAME, the folder of the pipeline's component NAME, after checking that model_index.json lists it,
// with one of `classes` (any class when empty), and that its folder exists. Throws ddm::Error naming
// model_index.json, the component and what it holds instead: a malformed index, a component it does
// not list or lists as null, another class, a missing folder.
std::string pipeline_component(const std::string& dir, const std::string& name, const std::vector<std::string>& classes);

}  // namespace ddm::sd
