// The restricted pickle reader (src/archive/pickle_reader.h): what torch.save writes reads into
// the tree its caller interprets, and the hostile pickles of docs/security.md, at full size, end
// in a named FormatError (or a small tree) within 2 s and a few MiB. Each of them took the old
// reader minutes, gigabytes or its stack.
#include <chrono>

#include <gtest/gtest.h>

#include "archive/pickle_reader.h"
#include "support/hostile_archives.h"
#include "support/resident_memory.h"
#include "support/unity_namespace.h"

namespace ddp::archive {
namespace {
namespace DDP_UNITY_ID {

using namespace std::string_literals;
using Kind = PickleNode::Kind;

const std::string kTail = "ccollections\nOrderedDict\n)R.";

bool torch_global(std::string_view name) {
  return name == "collections.OrderedDict" || name.starts_with("torch._utils._rebuild_") ||
         name == "torch.FloatStorage";
}

PickleTree read(const std::string& pickle) {
  auto tree = read_pickle(pickle, {.allow_global = torch_global});
  tree.check_shape({});
  return tree;
}

struct Outcome {
  std::optional<FormatError> error;
  double seconds = 0;
  double added_mib = 0;
};

Outcome run(const std::string& pickle) {
  Outcome o;
  const auto start = std::chrono::steady_clock::now();
  o.added_mib = test::peak_added_mib([&] {
    try {
      read(pickle);
    } catch (const FormatError& e) {
      o.error = e;
    }
  });
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return o;
}

TEST(PickleReader, ReadsAStateDictAsTorchSaveWritesIt) {
  namespace p = test::pickle;
  const std::string pickle =
      p::state_dict({{"weight", p::tensor("FloatStorage", "0", 6, 0, {2, 3}, {3, 1})},
                     {"bias", p::tensor("FloatStorage", "1", 2, 0, {2}, {1})}});
  const auto tree = read(pickle);
  const PickleNode& root = tree.node(tree.root());
  ASSERT_EQ(root.kind, Kind::kDict);
  ASSERT_EQ(root.items.size(), 4u);
  EXPECT_EQ(tree.text(tree.node(root.items[0])), "weight");
  const PickleNode& call = tree.node(root.items[1]);
  ASSERT_EQ(call.kind, Kind::kCall);
  EXPECT_EQ(tree.text(tree.node(call.items[0])), "torch._utils._rebuild_tensor_v2");
  const PickleNode& args = tree.node(call.items[1]);
  ASSERT_EQ(args.kind, Kind::kTuple);
  ASSERT_EQ(args.items.size(), 6u);
  EXPECT_EQ(tree.node(args.items[0]).kind, Kind::kPersistentId);
  EXPECT_EQ(tree.node(args.items[5]).kind, Kind::kDict);  // OrderedDict(): a dict
}

TEST(PickleReader, ValuesUsedTwiceAreOneNode) {
  // DUP, and a memoized list fetched back: the same node, as Python shares the same object; an
  // APPEND through one is seen through the other.
  const auto tree = read("\x80\x02]q\x01h\x01K\x07\x61\x86."s);
  const PickleNode& pair = tree.node(tree.root());
  ASSERT_EQ(pair.items.size(), 2u);
  EXPECT_EQ(pair.items[0], pair.items[1]);
  EXPECT_EQ(tree.node(pair.items[0]).items.size(), 1u);
}

// Case by case, the pickles a probe built against the old reader, at their full size.
TEST(PickleReader, HostilePicklesEndFastInANamedErrorOrASmallTree) {
  struct Case {
    const char* name;
    std::string pickle;
    const char* error;  // nullptr: reads
  };
  std::string binget = "\x80\x02("s + std::string(1000, 'N') + "tq\x01(";
  for (int i = 0; i < 200000; ++i)
    binget += "h\x01";
  const std::vector<Case> cases{
      // 300 KB nesting 150,000 lists: overflowed the stack.
      {"nested lists",
       "\x80\x02" + std::string(150000, '(') + "N" + std::string(150000, 'l') + "0" + kTail,
       "nests values deeper than 256 levels"},
      // 84 bytes: each DUP and TUPLE2 deep-copied the tree, 9.6 GB.
      {"DUP bomb",
       "\x80\x02N" +
           [] {
             std::string s;
             for (int i = 0; i < 26; ++i)
               s += "2\x86";
             return s;
           }() +
           "0" + kTail,
       "unfold to more than"},
      // 37 bytes: a memo index of 2^25 made a dense memo of 2.5 GB.
      {"memo index 2^25", "\x80\x02Nr\x00\x00\x00\x02\x30"s + kTail, nullptr},
      // 600 KB: one memoized 1,000-item tuple fetched 200,000 times, 9.6 GB.
      {"BINGET of a tuple", binget + "t0" + kTail, "unfold to more than"},
      // 100 KB of TUPLE1: copied through an initializer_list each time, minutes.
      {"TUPLE1 chain", "\x80\x02N" + std::string(100000, '\x85') + "0" + kTail,
       "nests values deeper than 256 levels"},
      // A list that holds itself: a tree that never ends for whoever walks it.
      {"list holds itself", "\x80\x02]q\x01h\x01\x61."s, "contains itself"},
  };
  for (const auto& c : cases) {
    const Outcome o = run(c.pickle);
    if (c.error == nullptr) {
      EXPECT_FALSE(o.error) << c.name << ": " << o.error->what();
    } else {
      ASSERT_TRUE(o.error) << c.name << " was read";
      EXPECT_NE(std::string(o.error->what()).find(c.error), std::string::npos)
          << c.name << ": " << o.error->what();
    }
    EXPECT_LT(o.seconds, 2.0) << c.name;
    EXPECT_LT(o.added_mib, 64.0 * test::kSanitizerMemoryFactor) << c.name;
  }
}

TEST(PickleReader, GlobalsOutsideTheAllowlistAndObjectOpcodesAreUnsafe) {
  for (const auto& [pickle, global] :
       {std::pair{"\x80\x02\x63posix\nsystem\nX\x04\x00\x00\x00true\x85R."s, "posix.system"s},
        std::pair{"\x80\x04\x8c\x02os\x8c\x06system\x93."s, "os.system"s},
        std::pair{"\x80\x02\x63torch.nn.modules.linear\nLinear\n."s,
                  "torch.nn.modules.linear.Linear"s}}) {
    try {
      read(pickle);
      ADD_FAILURE() << global << " was read";
    } catch (const FormatError& e) {
      EXPECT_EQ(e.kind(), FormatError::Kind::kUnsafe);
      EXPECT_EQ(e.global_name(), global);
    }
  }
  try {
    read("\x80\x02\x63\x63ollections\nOrderedDict\n)\x81."s);
    ADD_FAILURE() << "NEWOBJ was read";
  } catch (const FormatError& e) {
    EXPECT_EQ(e.kind(), FormatError::Kind::kUnsafe);
    EXPECT_NE(std::string(e.what()).find("opcode 0x81"), std::string::npos) << e.what();
  }
}

// Every prefix of a valid pickle, and every single-byte change to it, ends in a FormatError or
// a tree that passes check_shape: never a crash or an out-of-range node.
TEST(PickleReader, TruncatedAndDamagedPicklesAreRefusedByName) {
  namespace p = test::pickle;
  const std::string pickle =
      p::state_dict({{"w", p::tensor("FloatStorage", "0", 4, 0, {2, 2}, {2, 1})}});
  for (std::size_t n = 0; n < pickle.size(); ++n) {
    EXPECT_THROW(read(pickle.substr(0, n)), FormatError) << n;
  }
  for (std::size_t i = 0; i < pickle.size(); ++i) {
    for (const unsigned char bits : {0x01, 0x80, 0xff}) {
      std::string bad = pickle;
      bad[i] = static_cast<char>(bad[i] ^ bits);
      try {
        const auto tree = read(bad);
        for (std::size_t id = 0; id < tree.size(); ++id)
          for (const NodeId item : tree.node(static_cast<NodeId>(id)).items)
            ASSERT_LT(item, tree.size());
      } catch (const FormatError&) {
      }
    }
  }
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::archive
