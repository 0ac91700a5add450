// The checkpoint format's pure parts: CRC32C, strict JSON, safetensors files, and the resharding
// arithmetic (checked element by element against torch's own chunk/narrow on real tensors).
#include "checkpoint/json.h"
#include "checkpoint/reshard.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/store.h"
#include "tests/support/error_of.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdlib>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace meshddp;
using ::testing::HasSubstr;

using meshddp::test::error_of;

namespace {

std::string temp_path(const std::string& name) {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp ? tmp : "/tmp") + "/meshddp-fmt-" + name + "-" + std::to_string(::getpid());
}

// The local tensor a rank holds: chunk tp_rank of tp_size along dim (torch's own arithmetic).
torch::Tensor local_of(const torch::Tensor& global, const TpSlice& s) {
  if (s.dim < 0 || s.tp_size == 1) return global;
  return global.chunk(s.tp_size, s.dim)[s.tp_rank].contiguous();
}

}  // namespace

TEST(Crc32c, MatchesTheStandardCheckValueAndContinues) {
  const std::string text = "123456789";
  EXPECT_EQ(crc32c(text.data(), text.size()), 0xE3069283u);  // the CRC-32C check value (RFC 3720)
  EXPECT_EQ(crc32c(text.data() + 4, 5, crc32c(text.data(), 4)), 0xE3069283u);
  std::string big(1000003, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 + 7);
  const uint32_t whole = crc32c(big.data(), big.size());
  EXPECT_EQ(crc32c(big.data() + 500001, big.size() - 500001, crc32c(big.data(), 500001)), whole);
  big[777] ^= 1;
  EXPECT_NE(crc32c(big.data(), big.size()), whole);
  EXPECT_EQ(crc_hex(0xE3069283u), "0xe3069283");
}

TEST(Json, RoundTripsIntegersDoublesStringsAndNesting) {
  const Json v = {{"int", int64_t{9007199254740993}},  // > 2^53: must stay exact
                  {"double", 0.1},
                  {"whole_double", 2.0},
                  {"text", "a \"quoted\"\n\\ string \x01"},
                  {"list", Json::array({1, nullptr, true})}};
  for (int indent : {-1, 1}) {
    const Json back = parse_json(json_text(v, indent), "test");
    EXPECT_EQ(json_text(back), json_text(v));
    EXPECT_EQ(json_int(json_at(back, "int", "t"), "int"), int64_t{9007199254740993});
    EXPECT_EQ(json_kind(json_at(back, "whole_double", "t")), "number");
    EXPECT_EQ(json_double(json_at(back, "double", "t"), "d"), 0.1);
    EXPECT_EQ(json_string(json_at(back, "text", "t"), "s"), "a \"quoted\"\n\\ string \x01");
  }
  // What a checkpoint written before nlohmann-json holds reads back the same (%.17g doubles).
  EXPECT_EQ(json_double(parse_json("[0.10000000000000001]", "s")[0], "d"), 0.1);
}

TEST(Json, ParseErrorsNameTheByteAndTheSource) {
  EXPECT_THAT(error_of([] { parse_json("{\"a\": [1, 2}", "'m.json'"); }), HasSubstr("at byte 11 of 'm.json'"));
  EXPECT_THAT(error_of([] { parse_json("{} x", "'m.json'"); }),
              HasSubstr("expected end of input at byte 3 of 'm.json'"));
  EXPECT_THAT(error_of([] { json_at(parse_json("[1]", "s"), "x", "the manifest"); }),
              HasSubstr("expected an object at the manifest"));
  EXPECT_THAT(error_of([] { json_int(parse_json("[1.5]", "s")[0], "shape[0]"); }),
              HasSubstr("expected an integer at shape[0], got number"));
}

// Note [Strict JSON]: what nlohmann's own parser takes (keeping the last of two keys, reading an
// integer past int64 as uint64 or a rounded double, 1e999 as inf) is refused, naming the source.
TEST(Json, RefusesWhatNlohmannAloneWouldAccept) {
  const std::string twice = "{\"step\": 1, \"step\": 2}";
  ASSERT_EQ(Json::parse(twice)["step"], 2) << "the library alone keeps the last";
  EXPECT_THAT(error_of([&] { parse_json(twice, "'m.json'"); }), HasSubstr("JSON: duplicate key \"step\" in 'm.json'"));
  EXPECT_NO_THROW(parse_json("[{\"a\": 1}, {\"a\": 2}]", "s")) << "the same key in two objects is fine";
  for (const char* text :
       {"[9223372036854775808]", "[18446744073709551615]", "[-9223372036854775809]", "[100000000000000000000]"}) {
    EXPECT_THAT(error_of([&] { parse_json(text, "'m.json'"); }), HasSubstr("out of range (not an int64) in 'm.json'"))
        << text;
  }
  EXPECT_EQ(json_int(parse_json("[9223372036854775807]", "s")[0], "i"), INT64_MAX);
  EXPECT_EQ(json_int(parse_json("[-9223372036854775808]", "s")[0], "i"), INT64_MIN);
  EXPECT_THAT(error_of([] { parse_json(std::string(65, '[') + std::string(65, ']'), "'m.json'"); }),
              HasSubstr("nesting deeper than 64 levels in 'm.json'"));
  EXPECT_NO_THROW(parse_json(std::string(64, '[') + std::string(64, ']'), "s"));
  EXPECT_THAT(error_of([] { parse_json("\xEF\xBB\xBF{}", "'m.json'"); }), HasSubstr("byte-order mark"));
}

// Issue 20's attack: 1e999 parsed as inf (a later, unclear error); "\u12" or "\uZZZZ" read as
// whatever strtoul made of it; a lone surrogate written out as invalid UTF-8. Each is refused at
// parse by nlohmann's own parser, naming the byte.
TEST(Json, RefusesNonFiniteNumbersAndMalformedUnicodeEscapes) {
  for (const char* text : {"[1e999]", "[-1e999]", "[1e400]"}) {
    EXPECT_THAT(error_of([&] { parse_json(text, "'m.json'"); }), HasSubstr("JSON: number overflow parsing '")) << text;
    EXPECT_THAT(error_of([&] { parse_json(text, "'m.json'"); }), HasSubstr("' at byte ")) << text;
  }
  EXPECT_EQ(json_double(parse_json("[1e-999]", "s")[0], "d"), 0.0) << "underflow to 0 is finite";
  for (const char* text : {R"(["\u12"])", R"(["\uZZZZ"])", R"(["\u-123"])", R"(["\u 123"])"}) {
    EXPECT_THAT(error_of([&] { parse_json(text, "'m.json'"); }), HasSubstr("'\\u' must be followed by 4 hex digits"))
        << text;
  }
  for (const char* text : {R"(["\ud800"])", R"(["\udc00"])", R"(["\ud800\u0041"])", R"(["\ud800x"])"}) {
    EXPECT_THAT(error_of([&] { parse_json(text, "'m.json'"); }), HasSubstr("surrogate U+")) << text;
    EXPECT_THAT(error_of([&] { parse_json(text, "'m.json'"); }), HasSubstr(" of 'm.json'")) << text;
  }
  for (const char* text : {"[\"a\x01\"]", "[\"\xff\"]", R"(["\q"])", "[01]", "[1.]"}) {
    EXPECT_THAT(error_of([&] { parse_json(text, "'m.json'"); }), HasSubstr(" of 'm.json'")) << text;
  }
  EXPECT_EQ(json_string(parse_json(R"(["\ud83d\ude00\u00e9A"])", "s")[0], "s"),
            "\xF0\x9F\x98\x80\xC3\xA9"
            "A");
}

// A name or value that is not UTF-8 cannot be JSON text: the save refuses it by name; a status
// message between ranks is written lossy (U+FFFD), so it still arrives.
TEST(Json, TextThatIsNotUtf8IsRefusedOnWriteOrReplacedWhenLossy) {
  const Json bad = {{"key", "a\xff"}};
  EXPECT_THAT(error_of([&] { json_text(bad); }), HasSubstr("must be UTF-8 text"));
  EXPECT_EQ(json_text(bad, -1, /*lossy=*/true), "{\"key\":\"a\xEF\xBF\xBD\"}");
}

TEST(Safetensors, WritesAFileWhoseHeaderAndBytesReadBack) {
  const std::string path = temp_path("st");
  const auto a = torch::arange(12, torch::kFloat).view({3, 4});
  const auto b = torch::tensor({1.5, -2.25}, torch::kBFloat16);
  const WrittenFile w = write_safetensors_file(path, {{"a", a}, {"b", b}}, {{"save_id", "abc"}});
  EXPECT_EQ(w.bytes, file_bytes(path));
  EXPECT_EQ(w.crc, checksum_file(path).crc);
  const SafetensorsHeader h = read_safetensors_header(path, w.bytes);
  EXPECT_EQ(h.data_start % 8, 0) << "data 8-aligned, as safetensors writes it";
  EXPECT_EQ(h.metadata.at("save_id"), "abc");
  EXPECT_EQ(h.tensors.at("a").dtype, "F32");
  EXPECT_EQ(h.tensors.at("a").shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(h.tensors.at("b").dtype, "BF16");
  torch::Tensor back = torch::empty({3, 4});
  read_file_range(path, h.data_start + h.tensors.at("a").begin, 48, back.data_ptr());
  EXPECT_TRUE(torch::equal(back, a));
  ASSERT_EQ(::truncate(path.c_str(), w.bytes - 1), 0);
  EXPECT_THAT(error_of([&] { read_safetensors_header(path, w.bytes - 1); }), HasSubstr("truncated"));
  std::remove(path.c_str());
}

// `ulimit -f` once killed a saving worker with SIGXFSZ and no message. In a forked child with a
// 4 KiB RLIMIT_FSIZE, the write fails with an error naming the file, and the previous SIGXFSZ
// handler is back afterwards.
TEST(Safetensors, AFileSizeLimitFailsTheWriteNamingTheFileInsteadOfKillingTheProcess) {
  const std::string path = temp_path("fsize");
  const auto big = torch::zeros({10000});  // 40 KB: made before the fork
  struct sigaction before{};
  ASSERT_EQ(::sigaction(SIGXFSZ, nullptr, &before), 0);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    const struct rlimit limit{4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    std::string message = error_of([&] { write_safetensors_file(path, {{"big", big}}, {}); });
    struct sigaction after{};
    ::sigaction(SIGXFSZ, nullptr, &after);
    message += after.sa_handler == before.sa_handler ? " [handler restored]" : " [handler not restored]";
    (void)!::write(fds[1], message.data(), message.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string message;
  char buf[4096];
  for (ssize_t r; (r = ::read(fds[0], buf, sizeof(buf))) > 0;) message.append(buf, static_cast<size_t>(r));
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal " << WTERMSIG(status) << " (SIGXFSZ is " << SIGXFSZ
                                 << ")";
  EXPECT_THAT(message,
              HasSubstr("checkpoint: writing '" + path + "' failed: File too large (over the file-size limit"));
  EXPECT_THAT(message, HasSubstr("[handler restored]"));
  std::remove(path.c_str());
}

TEST(Reshard, GlobalRunsOfAColumnShardAreOneRunPerRow) {
  // [4, 6] sharded on dim 1 over 3 ranks: rank 1 holds columns 2..3 of every row.
  const auto runs = global_runs({4, 6}, {1, 3, 1}, 1, 7);  // local elements 1..6 of the [4, 2] shard
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[0].global_begin, 3);  // row 0, column 3
  EXPECT_EQ(runs[0].numel, 1);
  EXPECT_EQ(runs[1].global_begin, 8);  // row 1, columns 2..3
  EXPECT_EQ(runs[1].numel, 2);
  EXPECT_EQ(runs[3].global_begin, 20);  // row 3, column 2
  EXPECT_EQ(runs[3].local_begin, 6);
  EXPECT_EQ(global_runs({8, 4}, {0, 2, 1}, 0, 16).size(), 1u) << "a row shard is one run";
  EXPECT_THAT(error_of([] { global_runs({5, 4}, {0, 2, 0}, 0, 1); }),
              HasSubstr("does not split into 2 equal TP chunks"));
}

// Every (saved DP x TP) -> (loaded DP x TP) pair, on shapes sharded on each dim: the planned copies
// rebuild exactly torch's chunk of the global tensor, element for element.
TEST(Reshard, PlannedCopiesRebuildEveryLocalShardAcrossDpAndTpSizes) {
  const std::vector<std::vector<int64_t>> shapes = {{8, 12}, {4, 8, 12}, {16}};
  for (const auto& shape : shapes) {
    const auto global = torch::arange(numel_of(shape), torch::kFloat).view(shape);
    for (int64_t dim = -1; dim < static_cast<int64_t>(shape.size()); ++dim) {
      for (auto [save_dp, save_tp] : {std::pair{2, 2}, std::pair{4, 1}, std::pair{1, 4}, std::pair{3, 2}}) {
        // Saved pieces: each TP rank's local tensor, split evenly over DP (only TP rank 0 when unsharded).
        std::vector<Piece> saved;
        std::vector<torch::Tensor> data;
        const int64_t tp_used = dim < 0 ? 1 : save_tp;
        for (int64_t t = 0; t < tp_used; ++t) {
          const TpSlice slice = dim < 0 ? TpSlice{} : TpSlice{dim, save_tp, t};
          const auto local = local_of(global, slice).reshape({-1});
          for (int64_t d = 0; d < save_dp; ++d) {
            auto [b, e] = even_split(local.numel(), d, save_dp);
            saved.push_back({slice, b, e});
            data.push_back(local.narrow(0, b, e - b));
          }
        }
        for (auto [load_dp, load_tp] :
             {std::pair{1, 1}, std::pair{2, 2}, std::pair{1, 4}, std::pair{4, 1}, std::pair{2, 4}}) {
          for (int64_t t = 0; t < (dim < 0 ? 1 : load_tp); ++t) {
            const TpSlice slice = dim < 0 ? TpSlice{} : TpSlice{dim, load_tp, t};
            const auto expected = local_of(global, slice).reshape({-1});
            for (int64_t d = 0; d < load_dp; ++d) {
              auto [b, e] = even_split(expected.numel(), d, load_dp);
              const auto copies = plan_copies(shape, saved, {slice, b, e});
              ASSERT_EQ(covered_numel(copies), e - b);
              auto got = torch::full({e - b}, -1.0);
              for (const PieceCopy& c : copies) {
                got.narrow(0, c.dest_offset, c.numel).copy_(data[c.source].narrow(0, c.source_offset, c.numel));
              }
              ASSERT_TRUE(torch::equal(got, expected.narrow(0, b, e - b)))
                  << "shape dim " << dim << " saved " << save_dp << "x" << save_tp << " loaded " << load_dp << "x"
                  << load_tp << " tp rank " << t << " dp rank " << d;
            }
          }
        }
      }
    }
  }
}

TEST(Reshard, MissingPiecesLeaveElementsUncovered) {
  const std::vector<Piece> saved = {{{}, 0, 5}};  // elements 5..9 of a [10] tensor were never saved
  EXPECT_EQ(covered_numel(plan_copies({10}, saved, {{}, 0, 10})), 5);
}

TEST(Reshard, EvenSplitCoversEveryElementOnce) {
  int64_t next = 0;
  for (int64_t p = 0; p < 4; ++p) {
    auto [b, e] = even_split(10, p, 4);
    EXPECT_EQ(b, next);
    EXPECT_GE(e - b, 2);
    next = e;
  }
  EXPECT_EQ(next, 10);
}
