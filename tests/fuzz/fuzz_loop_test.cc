// The fuzzed entry points (fuzz_entries.h) over a fixed number of seeded mutations of valid
// inputs, with any compiler, so CI exercises them without clang; plus every committed corpus and
// regression input (tests/fuzz/). A crash or a broken property aborts the test. scripts/fuzz.sh
// runs the same entry points under libFuzzer for as long as asked.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz_entries.h"
#include "gtest/gtest.h"

namespace tandem::fuzz {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;
using Entry = std::function<void(const uint8_t*, size_t)>;

uint64_t Next(uint64_t* s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Bytes that parsers treat specially, so that mutations reach deeper than random bytes would.
const std::vector<std::string> kTokens = {"{",
                                          "}",
                                          "[",
                                          "]",
                                          "\"",
                                          ":",
                                          ",",
                                          "\n",
                                          "-",
                                          "0",
                                          "9e99",
                                          "null",
                                          "true",
                                          "\\u0000",
                                          "\\ud800",
                                          ".",
                                          "=",
                                          "#",
                                          "  ",
                                          "*a",
                                          "&a",
                                          "!!",
                                          "\xff\xff\xff\xff",
                                          std::string(1, '\0')};

// One to four of: flip a bit, set a byte, insert or delete a run, insert a token, duplicate a
// chunk, splice another seed, truncate.
Bytes Mutate(Bytes in, const std::vector<Bytes>& seeds, uint64_t* rng) {
  const int n = 1 + static_cast<int>(Next(rng) % 4);
  for (int k = 0; k < n; ++k) {
    const size_t size = in.size();
    const size_t at = size == 0 ? 0 : Next(rng) % (size + 1);
    switch (Next(rng) % 8) {
      case 0:
        if (size > 0) in[at % size] ^= static_cast<uint8_t>(1u << (Next(rng) % 8));
        break;
      case 1:
        if (size > 0) in[at % size] = static_cast<uint8_t>(Next(rng));
        break;
      case 2: {
        const size_t len = 1 + Next(rng) % 16;
        for (size_t i = 0; i < len; ++i) in.insert(in.begin() + at, static_cast<uint8_t>(Next(rng)));
        break;
      }
      case 3:
        if (at < size) in.erase(in.begin() + at, in.begin() + std::min(size, at + 1 + Next(rng) % 16));
        break;
      case 4: {
        const std::string& t = kTokens[Next(rng) % kTokens.size()];
        in.insert(in.begin() + at, t.begin(), t.end());
        break;
      }
      case 5:
        if (size > 0) {
          const size_t from = Next(rng) % size, len = std::min<size_t>(size - from, 1 + Next(rng) % 64);
          Bytes chunk(in.begin() + from, in.begin() + from + len);
          const int times = 1 + static_cast<int>(Next(rng) % 8);
          for (int i = 0; i < times; ++i) in.insert(in.begin() + at, chunk.begin(), chunk.end());
        }
        break;
      case 6: {
        const Bytes& other = seeds[Next(rng) % seeds.size()];
        if (!other.empty()) {
          const size_t from = Next(rng) % other.size();
          in.insert(in.begin() + at, other.begin() + from, other.end());
        }
        break;
      }
      default:
        in.resize(at);
        break;
    }
  }
  if (in.size() > (1u << 16)) in.resize(1u << 16);
  return in;
}

std::vector<Bytes> FilesUnder(const fs::path& dir) {
  std::vector<Bytes> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream f(e.path(), std::ios::binary);
    out.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  return out;
}

fs::path FuzzDir() {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");
  return fs::path(src != nullptr ? src : ".") / "tests" / "fuzz";
}

// `mutations` per entry point keeps each test at a few seconds with gcc -O2 on one core (the config
// loader, through yaml-cpp and a dump and reload per input, is the slowest).
void FuzzEntry(const std::string& name, const Entry& entry, std::vector<Bytes> seeds, uint64_t seed,
               int mutations) {
  // The committed corpus and every regression input first, as they are.
  const std::vector<Bytes> corpus = FilesUnder(FuzzDir() / "corpus" / name);
  const std::vector<Bytes> regressions = FilesUnder(FuzzDir() / "regressions" / name);
  EXPECT_FALSE(corpus.empty()) << "no corpus under " << (FuzzDir() / "corpus" / name);
  for (const Bytes& b : regressions) entry(b.data(), b.size());
  for (const Bytes& b : corpus) {
    entry(b.data(), b.size());
    seeds.push_back(b);
  }
  for (const Bytes& b : seeds) entry(b.data(), b.size());
  uint64_t rng = seed;
  for (int i = 0; i < mutations; ++i) {
    const Bytes in = Mutate(seeds[Next(&rng) % seeds.size()], seeds, &rng);
    const auto start = std::chrono::steady_clock::now();
    entry(in.data(), in.size());
    // One input that takes this long is a hang waiting to happen: keep it for a regression.
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(1)) {
      const fs::path kept = fs::temp_directory_path() / ("tandem-fuzz-slow-" + name);
      std::ofstream(kept, std::ios::binary)
          .write(reinterpret_cast<const char*>(in.data()), static_cast<std::streamsize>(in.size()));
      ADD_FAILURE() << name << ": mutation " << i << " took over 1 s (" << in.size() << " bytes, kept in "
                    << kept << ")";
      return;
    }
  }
}

std::vector<Bytes> AsBytes(const std::vector<std::string>& v) {
  std::vector<Bytes> out;
  for (const std::string& s : v) out.emplace_back(s.begin(), s.end());
  return out;
}

TEST(FuzzLoop, WireDecoders) { FuzzEntry("wire", FuzzWireFrame, WireSeeds(), 1, 50000); }
TEST(FuzzLoop, PromptsFileParser) {
  FuzzEntry("prompts", FuzzPromptsJsonl, AsBytes(PromptsSeeds()), 2, 50000);
}
TEST(FuzzLoop, ConfigLoader) { FuzzEntry("config", FuzzConfigYaml, AsBytes(ConfigSeeds()), 3, 20000); }

// The committed corpus holds the seeds (scripts/fuzz.sh starts from it): regenerate it with
// TANDEM_WRITE_FUZZ_CORPUS=1 when the seeds change.
TEST(FuzzLoop, CommittedCorpusHoldsTheSeeds) {
  const auto write = [](const fs::path& dir, const std::vector<Bytes>& seeds) {
    fs::create_directories(dir);
    for (size_t i = 0; i < seeds.size(); ++i) {
      std::ofstream f(dir / ("seed-" + std::to_string(i)), std::ios::binary);
      f.write(reinterpret_cast<const char*>(seeds[i].data()), static_cast<std::streamsize>(seeds[i].size()));
    }
  };
  const std::vector<std::pair<std::string, std::vector<Bytes>>> all = {
      {"wire", WireSeeds()}, {"prompts", AsBytes(PromptsSeeds())}, {"config", AsBytes(ConfigSeeds())}};
  for (const auto& [name, seeds] : all) {
    if (std::getenv("TANDEM_WRITE_FUZZ_CORPUS") != nullptr) write(FuzzDir() / "corpus" / name, seeds);
    const std::vector<Bytes> corpus = FilesUnder(FuzzDir() / "corpus" / name);
    for (const Bytes& s : seeds) {
      EXPECT_NE(std::find(corpus.begin(), corpus.end(), s), corpus.end())
          << name << ": a seed is missing from the corpus (TANDEM_WRITE_FUZZ_CORPUS=1 writes it)";
    }
  }
}

}  // namespace
}  // namespace tandem::fuzz
