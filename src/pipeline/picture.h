// Pipeline timelines as a PNG: one panel per timeline (e.g. a schedule without and with bubble
// filling, or planned and measured), one row per rank on one shared time axis. Forward blue,
// backward (or input-gradient) orange, weight-gradient light orange, each with its micro-batch
// number when there is room; non-trainable work run serially at the iteration's start dark red,
// non-trainable work filled into bubbles green; the optimizer step (and exposed gradient sync) grey;
// white is idle. Under V-shaped placement a rank's second stage has a dark lower edge.
#pragma once
#include <string>
#include <vector>

#include "pipeline/simulate.h"

namespace ddm {

struct PipePanel {
  std::string title;
  PipeTimeline timeline;
  std::vector<double> optimizer;  // per rank, drawn after the makespan (may be empty)
};

// Throws ddm::Error unless path ends in .png.
void save_pipe_picture(const std::string& path, const std::string& title, const std::vector<PipePanel>& panels);

}  // namespace ddm
