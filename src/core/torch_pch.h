// Precompiled header: the heavy LibTorch headers every translation unit of ddm uses.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>
