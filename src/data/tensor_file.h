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

// Loads `path`; throws ddm::Error naming the file and tensor on a wrong dtype, rank or length, or a
// label beyond 65535. The class count is the metadata 'num_classes', else the largest label + 1; then,
// with every_class (training data), each class 0..K-1 must have an image: a gap in the labels would
// otherwise make a model with classes it never sees. Samples of a few classes pass every_class = false.
Dataset load_tensor_file(const std::string& path, bool every_class = true);

}  // namespace ddm
