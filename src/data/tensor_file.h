// Loading a Dataset from a safetensors file with an `images` tensor (uint8, rank 4) and an optional
// `labels` tensor (integer, 1-D, one per image).
//
// Layout rule for `images`: the file's "__metadata__" key "layout" ("NCHW" or "NHWC") decides when
// present. Otherwise the tensor is NHWC when its last dimension is 1, 3 or 4 and its second
// dimension is not; everything else is NCHW. The channel count must then be 1..4. Examples:
// [N,28,28,1] and [N,32,32,3] are NHWC; [N,1,28,28], [N,3,32,32] and [N,3,4,3] are NCHW.
//
// Classes: num_classes = max(label) + 1, or the metadata key "num_classes" when given (it must
// exceed every label). Class names are "class 0", "class 1", ...
#pragma once
#include <string>

#include "data/dataset.h"

namespace ddm {

// Whether an images tensor of these sizes is read as NHWC under the rule above (no metadata).
bool images_look_nhwc(const std::vector<int64_t>& sizes);

// Loads `path`; throws ddm::Error naming the file and tensor on a wrong dtype, rank or length.
Dataset load_tensor_file(const std::string& path);

}  // namespace ddm
