// The pipeline's wire (pipeline/wire.h), alone: the carry's header round trip, the mailbox between two
// stages of one rank, bfloat16 across processes (ranks as threads), and tags that never collide.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "pipeline/wire.h"
#include "test_util.h"
#include "unit/test_dist_util.h"

namespace {

using namespace ddm;
using ddm::test::error_message;
using ddm::test::has;

TEST(PipeWire, ACarryRoundTripsThroughItsHeaderAndOneFlatMessage) {
  torch::manual_seed(3);
  NetCarry k;
  k.h = torch::randn({2, 4, 3, 3});
  k.emb = torch::randn({2, 8});
  k.skips = {torch::randn({2, 4, 3, 3}), torch::Tensor(), torch::randn({2, 2, 6, 6}), torch::randn({2, 5})};
  const std::vector<bool> carried{true, true, false, true};  // slot 2 goes straight to its reader
  std::vector<torch::Tensor> tensors;
  const torch::Tensor header = carry_header(k, carried, tensors);
  ASSERT_EQ(header.numel(), kCarryHeaderSize);
  ASSERT_EQ(tensors.size(), 4u);  // h, emb, skips 0 and 3
  const torch::Tensor flat = flat_of(tensors);
  EXPECT_EQ(flat.numel(), 2 * 36 + 16 + 2 * 36 + 10);
  std::vector<bool> present;
  const auto shapes = header_shapes(header, &present);
  EXPECT_EQ(present, (std::vector<bool>{true, true, true, false, false, true}));
  const NetCarry back = carry_from(header, split_flat(flat, shapes));
  EXPECT_TRUE(torch::equal(back.h, k.h));
  EXPECT_TRUE(torch::equal(back.emb, k.emb));
  ASSERT_EQ(back.skips.size(), 4u);
  EXPECT_TRUE(torch::equal(back.skips[0], k.skips[0]));
  EXPECT_FALSE(back.skips[1].defined());  // a placeholder stays one
  EXPECT_FALSE(back.skips[2].defined());  // not carried: a placeholder here
  EXPECT_TRUE(torch::equal(back.skips[3], k.skips[3]));

  // A carry without emb, and one whose slots are all placeholders.
  NetCarry bare;
  bare.h = torch::randn({1, 3});
  bare.skips = {torch::Tensor()};
  const torch::Tensor h2 = carry_header(bare, {true}, tensors);
  const NetCarry back2 = carry_from(h2, split_flat(flat_of(tensors), header_shapes(h2)));
  EXPECT_TRUE(torch::equal(back2.h, bare.h));
  EXPECT_FALSE(back2.emb.defined());
  ASSERT_EQ(back2.skips.size(), 1u);
  EXPECT_FALSE(back2.skips[0].defined());
}

TEST(PipeWire, ACarryItsHeaderCannotHoldOrOfAnotherTypeIsAClearError) {
  std::vector<torch::Tensor> tensors;
  NetCarry many;
  many.h = torch::zeros({1, 1, 1, 1});
  for (int i = 0; i < 40; ++i) many.skips.push_back(torch::zeros({1, 1, 1, 1}));
  EXPECT_TRUE(has(error_message([&] { carry_header(many, std::vector<bool>(40, true), tensors); }),
                  "too many tensors for its header"));
  NetCarry ints;
  ints.h = torch::zeros({2}, torch::kLong);
  EXPECT_TRUE(has(error_message([&] { carry_header(ints, {}, tensors); }), "not float"));
  EXPECT_TRUE(has(error_message([&] { carry_header(ints, {true}, tensors); }), "a carry of 0 skips, 1 of them routed"));
}

TEST(PipeWire, TagsOfEveryMessageAndPieceAreDistinct) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto comm = Comm::create_for_test(store, 0, 1, test::short_timeouts());
  const PipeSchedule v = make_schedule("zb-v", 1, 3);  // 2 stages on one rank, 3 micro-batches
  const PipeWire wire(comm, v, /*skip_slots=*/2, false);
  std::set<int> seen;
  const int kinds = kSkip + 2 * 2;
  for (int cut = 0; cut < v.stages; ++cut)
    for (int m = 0; m < v.micro; ++m)
      for (int kind = 0; kind < kinds; ++kind) EXPECT_TRUE(seen.insert(wire.tag(cut, m, kind)).second);
  const int last = *seen.rbegin();
  for (size_t piece = 0; piece < 5; ++piece)
    for (int part = 0; part < 2; ++part) {
      EXPECT_GT(wire.piece_tag(piece, part), last);
      EXPECT_TRUE(seen.insert(wire.piece_tag(piece, part)).second);
    }
}

TEST(PipeWire, StagesOfOneRankPassMessagesThroughTheMailbox) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto comm = Comm::create_for_test(store, 0, 1, test::short_timeouts());
  PipeWire wire(comm, make_schedule("1f1b-v", 1, 2), 0, /*bf16=*/true);
  ASSERT_TRUE(wire.here(0) && wire.here(1));
  const torch::Tensor t = torch::randn({3, 4});
  wire.send(t, 1, wire.tag(0, 0, kCarryValues));
  auto r = wire.post_recv(torch::empty({3, 4}), 0, wire.tag(0, 0, kCarryValues));
  EXPECT_TRUE(torch::equal(wire.wait(r, "the carry"), t));  // as it is: no bfloat16 within a process
  auto missing = wire.post_recv(torch::empty({3, 4}), 0, wire.tag(0, 1, kCarryValues));
  EXPECT_TRUE(has(error_message([&] { wire.wait(missing, "the next carry"); }),
                  "has not sent yet (the next carry)"));
  wire.send(t, 1, wire.tag(0, 1, kGradient));
  EXPECT_TRUE(has(error_message([&] { wire.send(t, 1, wire.tag(0, 1, kGradient)); }), "sent twice within rank 0"));
  wire.begin_step();  // a new step: the mailbox is empty again
  wire.send(t, 1, wire.tag(0, 1, kGradient));
  auto wrong = wire.post_recv(torch::empty({2, 2}), 0, wire.tag(0, 1, kGradient));
  EXPECT_TRUE(has(error_message([&] { wire.wait(wrong, "a gradient"); }), "expected [2, 2]"));
}

TEST(PipeWire, ABfloat16WireHalvesTheBytesOfFloatsAcrossProcesses) {
  torch::manual_seed(5);
  const torch::Tensor values = torch::randn({64});
  const torch::Tensor ids = torch::arange(8, torch::kLong);
  std::vector<torch::Tensor> got(2);
  std::vector<int64_t> bytes(2);
  const auto errors = test::run_ranks(2, test::short_timeouts(), [&](Comm& comm) {
    std::shared_ptr<Comm> c(&comm, [](Comm*) {});  // the runner owns it
    PipeWire wire(c, make_schedule("gpipe", 2, 1), 0, /*bf16=*/true);
    if (comm.rank() == 0) {
      bytes[0] = wire.bytes(values);
      bytes[1] = wire.bytes(ids);
      wire.send(values, 1, wire.tag(0, 0, kCarryValues));
      wire.send(ids, 1, wire.tag(0, 0, kCarryHeader));
      wire.wait_sends();
    } else {
      auto a = wire.post_recv(torch::empty({64}), 0, wire.tag(0, 0, kCarryValues));
      auto b = wire.post_recv(torch::empty({8}, torch::kLong), 0, wire.tag(0, 0, kCarryHeader));
      got[0] = wire.wait(a, "values").clone();
      got[1] = wire.wait(b, "ids").clone();
    }
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  EXPECT_EQ(bytes[0], 64 * 2);  // float32 as bfloat16
  EXPECT_EQ(bytes[1], 8 * 8);   // integers travel as they are
  EXPECT_EQ(got[0].scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(got[0], values.to(torch::kBFloat16).to(torch::kFloat)));  // rounded to nearest, widened exactly
  EXPECT_TRUE(torch::equal(got[1], ids));
}

}  // namespace
