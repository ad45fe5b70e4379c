// Distillation of a decentralized ensemble into one dense model (docs/decentralized.md,
// "Distillation"). The student trains on every image of the ensemble's data through the ordinary
// trainer; only its target changes: at the student's x_t, the teacher is the expert of that image's
// own cluster (no router), and the student regresses that expert's prediction, converted to the
// student's path and parameterization. Labels, label dropout and the time distribution are the
// student's, so the student also learns each expert's unconditional branch for guidance.
#pragma once
#include <memory>
#include <string>

#include "core/config.h"
#include "data/dataset.h"
#include "diffusion/objective.h"

namespace ddm {

struct DistillTeacher;

// Loads the ensemble named by cfg.train.teacher (EMA weights, every expert required), checks that
// its partition belongs to `data` and that the experts' image shape and classes fit the student
// (cfg.model must be resolved against the data), and attaches each image's cluster to `data`.
std::shared_ptr<DistillTeacher> load_distill_teacher(const RunConfig& cfg, Dataset& data);

// A line for the run header: the ensemble, K, the experts, the teacher's FLOPs per image.
std::string describe(const DistillTeacher& t);

// The teacher as the training step's TeacherFn (keeps `t` alive).
TeacherFn teacher_fn(std::shared_ptr<DistillTeacher> t, const RunConfig& student);

// OUT/distill.json records the ensemble manifest's sha256; a resumed run must see the same ensemble.
void check_distill_record(const std::string& out_dir, bool resume, const DistillTeacher& t);

}  // namespace ddm
