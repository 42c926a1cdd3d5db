#include "ddprun/line_assembler.h"

#include <gtest/gtest.h>
#include "support/unity_namespace.h"

namespace ddp::ddprun {
namespace {
namespace DDP_UNITY_ID {

TEST(LineAssembler, PrefixesEveryCompleteLine) {
  LineAssembler lines("[3] ");
  std::string out;
  lines.feed("one\ntwo\n", out);
  EXPECT_EQ(out, "[3] one\n[3] two\n");
  EXPECT_FALSE(lines.has_partial_line());
}

TEST(LineAssembler, HoldsPartialLinesUntilTheirNewline) {
  LineAssembler lines("[0] ");
  std::string out;
  lines.feed("hel", out);
  EXPECT_EQ(out, "");
  lines.feed("lo\nwor", out);
  EXPECT_EQ(out, "[0] hello\n");
  lines.feed("ld\n", out);
  EXPECT_EQ(out, "[0] hello\n[0] world\n");
}

TEST(LineAssembler, KeepsEmptyLines) {
  LineAssembler lines("[1] ");
  std::string out;
  lines.feed("\n\nx\n", out);
  EXPECT_EQ(out, "[1] \n[1] \n[1] x\n");
}

TEST(LineAssembler, FinishEmitsTheUnterminatedTailOnce) {
  LineAssembler lines("[2] ");
  std::string out;
  lines.feed("a\nno newline", out);
  lines.finish(out);
  lines.finish(out);
  EXPECT_EQ(out, "[2] a\n[2] no newline\n");
}

TEST(LineAssembler, FinishWithNothingPendingEmitsNothing) {
  LineAssembler lines("[2] ");
  std::string out;
  lines.feed("a\n", out);
  lines.finish(out);
  EXPECT_EQ(out, "[2] a\n");
}

TEST(LineAssembler, CutsLinesLongerThanTheLimit) {
  LineAssembler lines("> ", 4);
  std::string out;
  lines.feed("abcdefghij\n", out);
  EXPECT_EQ(out, "> abcd\n> efgh\n> ij\n");
}

TEST(LineAssembler, ALineOfExactlyTheLimitIsNotCut) {
  LineAssembler lines("> ", 4);
  std::string out;
  lines.feed("abc", out);
  lines.feed("d", out);
  lines.feed("\n", out);
  EXPECT_EQ(out, "> abcd\n");
}

TEST(LineAssembler, ByteAtATimeGivesTheSameLines) {
  const std::string text = "first line\nsecond\n\nthird without end";
  LineAssembler whole("[5] ");
  LineAssembler bytes("[5] ");
  std::string expected, got;
  whole.feed(text, expected);
  whole.finish(expected);
  for (char c : text)
    bytes.feed(std::string_view(&c, 1), got);
  bytes.finish(got);
  EXPECT_EQ(got, expected);
}

TEST(LineAssembler, VerbatimModeGivesBackExactlyTheBytesFedIn) {
  // --no-prefix: lines stay whole, but a cut or an unterminated tail gets no newline added.
  const std::string text = "{\"a\": 1}\nabcdefghij\n\nno end";
  LineAssembler lines("", 4, LineAssembler::Ending::kVerbatim);
  std::string out;
  for (char c : text)
    lines.feed(std::string_view(&c, 1), out);
  lines.finish(out);
  EXPECT_EQ(out, text);
  EXPECT_FALSE(lines.has_partial_line());
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::ddprun
