// LinePrefixer (src/launch/output.h): how `ddm launch` turns a worker's bytes into "[rank N] " lines:
// whole lines, partial lines held until their end, "\r" progress redraws, "\r\n", long lines, flush,
// and a rank's error line naming the rank once.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "launch/output.h"
#include "launch/process.h"

using ddm::LinePrefixer;
using std::chrono::milliseconds;

namespace {
const LinePrefixer::Clock::time_point t0 = LinePrefixer::Clock::time_point{} + std::chrono::hours(1);
}

TEST(LinePrefixer, PrefixesWholeLinesAndHoldsPartialOnes) {
  LinePrefixer p("[rank 1] ");
  EXPECT_EQ(p.feed("hello\nwor", t0), "[rank 1] hello\n");
  EXPECT_EQ(p.feed("ld\n\n", t0), "[rank 1] world\n[rank 1] \n");  // a blank line stays
  EXPECT_EQ(p.feed("no end", t0), "");
  EXPECT_EQ(p.flush(), "[rank 1] no end\n");
  EXPECT_EQ(p.flush(), "");
}

TEST(LinePrefixer, CrLfIsOneLineEnd) {
  LinePrefixer p("> ", milliseconds(1000));
  EXPECT_EQ(p.feed("a\r\nb\r", t0), "> a\n");  // the first redraw shows at once (see below)
  EXPECT_EQ(p.feed("\n", t0 + milliseconds(10)), "> b\n");
}

TEST(LinePrefixer, ProgressRedrawsAreThrottledAndTheFinalStateIsKept) {
  LinePrefixer p("> ", milliseconds(1000));
  // The first redraw shows at once; the next ones within a second are dropped; the line's final
  // text comes with its "\n". (One feed per statement: the order of calls in `a + b` is unspecified.)
  EXPECT_EQ(p.feed("\rstep 1/3", t0), "");
  EXPECT_EQ(p.feed("\r", t0), "> step 1/3\n");
  EXPECT_EQ(p.feed("step 2/3\r", t0 + milliseconds(100)), "");
  EXPECT_EQ(p.feed("step 3/3\n", t0 + milliseconds(200)), "> step 3/3\n");
  // After the interval a redraw shows again, and one already shown is not repeated by its "\n".
  EXPECT_EQ(p.feed("step 4\r", t0 + milliseconds(1300)), "> step 4\n");
  EXPECT_EQ(p.feed("\n", t0 + milliseconds(1400)), "");
  // A redraw not shown yet is shown at the end of the line, or at flush.
  EXPECT_EQ(p.feed("x 1\r", t0 + milliseconds(1500)), "");
  EXPECT_EQ(p.feed("\n", t0 + milliseconds(1600)), "> x 1\n");
  EXPECT_EQ(p.feed("y 1\r", t0 + milliseconds(1700)), "");
  EXPECT_EQ(p.flush(), "> y 1\n");
}

TEST(LinePrefixer, SplitsLinesLongerThanTheLimit) {
  LinePrefixer p("> ", milliseconds(1000), 4);
  EXPECT_EQ(p.feed("abcdefghij", t0), "> abcd\n> efgh\n");
  EXPECT_EQ(p.flush(), "> ij\n");
}

// ddm prints a rank's failure as "error: rank N: ..." under any launcher (apps/ddm.cpp, and many
// messages start with "rank N: " themselves); under `ddm launch` the prefix already names the rank.
TEST(LinePrefixer, ARanksErrorLineNamesTheRankOnce) {
  LinePrefixer p = LinePrefixer::for_rank(1);
  EXPECT_EQ(p.feed("error: rank 1: train.batch_size = 15 does not split\n", t0),
            "[rank 1] error: train.batch_size = 15 does not split\n");
  EXPECT_EQ(p.feed("error (LibTorch): rank 1: CUDA out of memory\n", t0),
            "[rank 1] error (LibTorch): CUDA out of memory\n");
  // Only the worker's own rank, right after "error: ", at the start of a line.
  EXPECT_EQ(p.feed("error: rank 0: lost the connection to rank 1\n", t0),
            "[rank 1] error: rank 0: lost the connection to rank 1\n");
  EXPECT_EQ(p.feed("error: rank 12: x\n", t0), "[rank 1] error: rank 12: x\n");
  // A status line that names its own rank (DiLoCo's) names it once too; another rank is kept.
  EXPECT_EQ(p.feed("rank 1: rejoined at step 40\n", t0), "[rank 1] rejoined at step 40\n");
  EXPECT_EQ(p.feed("rank 2: rejoined at step 40\n", t0), "[rank 1] rank 2: rejoined at step 40\n");
  EXPECT_EQ(p.feed("rank 10: x\n", t0), "[rank 1] rank 10: x\n");
  EXPECT_EQ(p.feed("note: error: rank 1: x\n", t0), "[rank 1] note: error: rank 1: x\n");
  EXPECT_EQ(p.feed("error: rank 1 (pid 7) exited\n", t0), "[rank 1] error: rank 1 (pid 7) exited\n");
  // A line that arrives in pieces, and one the pipe's close ends.
  EXPECT_EQ(p.feed("error: ra", t0), "");
  EXPECT_EQ(p.feed("nk 1: split\nerror: rank 1: last", t0), "[rank 1] error: split\n");
  EXPECT_EQ(p.flush(), "[rank 1] error: last\n");
  // The rest of a line split at max_line does not start a line.
  LinePrefixer q = LinePrefixer::for_rank(1, milliseconds(1000), 20);
  EXPECT_EQ(q.feed("error: rank 1: abcdeerror: rank 1: x\n", t0), "[rank 1] error: abcde\n[rank 1] error: rank 1: x\n");
  EXPECT_EQ(q.feed("error: rank 1: y\n", t0), "[rank 1] error: y\n");
  // A prefixer that is not a rank's keeps every line whole.
  LinePrefixer plain("[rank 1] ");
  EXPECT_EQ(plain.feed("error: rank 1: x\n", t0), "[rank 1] error: rank 1: x\n");
}

TEST(LaunchProcess, DescribesExitsAndSignals) {
  ddm::ExitStatus s;
  s.code = 3;
  EXPECT_EQ(ddm::describe(s), "exited with status 3");
  s.signal = 9;
  EXPECT_EQ(ddm::describe(s), "was killed by signal 9 (SIGKILL)");
  EXPECT_EQ(ddm::signal_name(15), "SIGTERM");
}
