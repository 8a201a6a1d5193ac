// KV tiers (memory_node/kv_tier_store.h, memory_node/kv_tiers.h): the store's host and disk tiers,
// its checks of what it reads back, and the colocated engine over a tiny KV pool, whose
// conversations must get the same tokens with tiers on and off, whatever happens to the files.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "colocated/engine.h"
#include "gtest/gtest.h"
#include "memory_node/kv_tier_store.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;

// A fresh directory under the test's temporary directory.
std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TMPDIR");
  const fs::path dir = fs::path(base != nullptr ? base : "/tmp") /
                       ("tandem_kv_tiers_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::vector<uint8_t> Bytes(int64_t n, uint8_t seed) {
  std::vector<uint8_t> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed * 31 + i * 7);
  return v;
}

std::vector<fs::path> BlockFiles(const std::string& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.path().extension() == ".kvb") files.push_back(e.path());
  return files;
}

TEST(KvTierStore, HostTierKeepsTheMostRecentlyUsedBlocks) {
  auto store = KvTierStore::Create({.host_bytes = 300}, 1, 100);
  ASSERT_TRUE(store.ok()) << store.status();
  for (uint8_t i = 1; i <= 4; ++i) (*store)->Save({.hash = i, .parent_hash = 0, .depth = 1}, Bytes(100, i));
  std::vector<uint8_t> out(100);
  KvTierBlock b;
  EXPECT_TRUE(absl::IsNotFound((*store)->Load(1, &b, out).status()));  // the least recently used went
  for (uint8_t i = 2; i <= 4; ++i) {
    absl::StatusOr<int> tier = (*store)->Load(i, &b, out);
    ASSERT_TRUE(tier.ok()) << tier.status();
    EXPECT_EQ(*tier, 1);
    EXPECT_EQ(out, Bytes(100, i));
  }
  const KvTierStats s = (*store)->stats();
  EXPECT_EQ(s.host_evictions, 1);
  EXPECT_EQ(s.host_hits, 3);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.bytes_to_host, 400);
}

TEST(KvTierStore, DiskTierWritesOnceAndReadsBack) {
  const std::string dir = TempDir("disk");
  auto store = KvTierStore::Create({.host_bytes = 0, .disk_dir = dir, .disk_bytes = 10000}, 7, 100);
  ASSERT_TRUE(store.ok()) << store.status();
  (*store)->Save({.hash = 0xabc, .parent_hash = 0x12, .depth = 3}, Bytes(100, 5));
  (*store)->Save({.hash = 0xabc, .parent_hash = 0x12, .depth = 3}, Bytes(100, 5));
  (*store)->Flush();
  EXPECT_EQ(BlockFiles(dir).size(), 1u);
  EXPECT_EQ((*store)->stats().bytes_to_disk, 164);  // once: header + payload
  std::vector<uint8_t> out(100);
  KvTierBlock b;
  absl::StatusOr<int> tier = (*store)->Load(0xabc, &b, out);
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ(*tier, 2);
  EXPECT_EQ(out, Bytes(100, 5));
  EXPECT_EQ(b.parent_hash, 0x12u);
  EXPECT_EQ(b.depth, 3);
  store->reset();
  EXPECT_TRUE(BlockFiles(dir).empty()) << "without persist the files go with the store";
}

// Each way a file can go bad: the load refuses it, says so, and the file is gone.
TEST(KvTierStore, BadFilesAreDiscardedNeverReturned) {
  struct Case {
    const char* name;
    std::function<void(const fs::path&)> damage;
  };
  const std::vector<Case> cases = {
      {"payload byte flipped",
       [](const fs::path& p) {
         std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(64 + 50);
         f.put('\x5a');
       }},
      {"truncated", [](const fs::path& p) { fs::resize_file(p, 64 + 20); }},
      {"header byte flipped",
       [](const fs::path& p) {
         std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(33);
         f.put('\x7f');
       }},
      {"removed", [](const fs::path& p) { fs::remove(p); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = TempDir("bad");
    auto store = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 10000}, 7, 100);
    ASSERT_TRUE(store.ok()) << store.status();
    (*store)->Save({.hash = 0x99, .parent_hash = 0, .depth = 1}, Bytes(100, 9));
    (*store)->Flush();
    c.damage((*store)->FilePath(0x99));
    std::vector<uint8_t> out(100);
    KvTierBlock b;
    EXPECT_TRUE(absl::IsNotFound((*store)->Load(0x99, &b, out).status()));
    EXPECT_FALSE((*store)->Contains(0x99));
    EXPECT_FALSE(fs::exists((*store)->FilePath(0x99)));
  }
}

TEST(KvTierStore, ForeignFilesAreRefusedAndPersistedOnesReindexed) {
  const std::string dir = TempDir("persist");
  {
    auto store = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 10000, .persist = true}, 7, 100);
    ASSERT_TRUE(store.ok()) << store.status();
    (*store)->Save({.hash = 0x1, .parent_hash = 0, .depth = 1}, Bytes(100, 1));
    (*store)->Save({.hash = 0x2, .parent_hash = 0x1, .depth = 2}, Bytes(100, 2));
    (*store)->Flush();
  }
  std::ofstream(fs::path(dir) / "00000000000000ff.kvb.tmp") << "a write that never finished";
  {
    // Another model (fingerprint): its files are discarded when it opens the directory.
    auto other = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 10000, .persist = true}, 8, 100);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_TRUE((*other)->PersistedBlocks().empty());
    EXPECT_EQ((*other)->stats().discarded, 2);
    EXPECT_TRUE(BlockFiles(dir).empty());
  }
  auto store = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 10000, .persist = true}, 7, 100);
  ASSERT_TRUE(store.ok()) << store.status();
  (*store)->Save({.hash = 0x3, .parent_hash = 0, .depth = 1}, Bytes(100, 3));
  (*store)->Flush();
  store->reset();
  auto again = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 10000, .persist = true}, 7, 100);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ((*again)->PersistedBlocks().size(), 1u);
  std::vector<uint8_t> out(100);
  KvTierBlock b;
  ASSERT_TRUE((*again)->Load(0x3, &b, out).ok());
  EXPECT_EQ(out, Bytes(100, 3));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "00000000000000ff.kvb.tmp"));
}

TEST(KvTierStore, DiskBudgetEvictsLeastRecentlyUsedFiles) {
  const std::string dir = TempDir("budget");
  auto store = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 2 * 164}, 7, 100);
  ASSERT_TRUE(store.ok()) << store.status();
  for (uint8_t i = 1; i <= 3; ++i) {
    (*store)->Save({.hash = i, .parent_hash = 0, .depth = 1}, Bytes(100, i));
    (*store)->Flush();
  }
  EXPECT_EQ(BlockFiles(dir).size(), 2u);
  EXPECT_FALSE((*store)->Contains(1));
  EXPECT_EQ((*store)->stats().disk_evictions, 1);
}

TEST(KvTierStore, SettingsAreCheckedAgainstTheMachine) {
  EXPECT_NE(CheckKvTierOptions({.host_bytes = int64_t{1} << 50}).message().find("kv.tiers.host_bytes"),
            std::string_view::npos);
  EXPECT_NE(CheckKvTierOptions({.disk_bytes = 10}).message().find("kv.tiers.disk_dir"),
            std::string_view::npos);
  const std::string dir = TempDir("check");
  EXPECT_NE(CheckKvTierOptions({.disk_dir = dir, .disk_bytes = int64_t{1} << 50})
                .message()
                .find("kv.tiers.disk_bytes"),
            std::string_view::npos);
  EXPECT_TRUE(CheckKvTierOptions({.host_bytes = 1 << 20, .disk_dir = dir, .disk_bytes = 1 << 20}).ok());
}

// --- The colocated engine over a pool that holds about one conversation ---

constexpr int64_t kBlock = 8;

struct Tiers {
  int64_t host_bytes = 0;
  int64_t disk_bytes = 0;
  std::string dir;
};

std::unique_ptr<ColocatedEngine> MakeEngine(const WeightSource& w, bool cache, const Tiers& t) {
  EngineOptions o;
  o.device = "cpu";
  o.max_batch_size = 2;
  o.max_tokens_per_step = 64;
  o.kv_capacity_tokens = 160;
  o.prefix_cache = cache;
  o.prefix_block_tokens = kBlock;
  o.tiers_host_bytes = t.host_bytes;
  o.tiers_disk_bytes = t.disk_bytes;
  o.tiers_disk_dir = t.dir;
  absl::StatusOr<std::unique_ptr<ColocatedEngine>> e = ColocatedEngine::Create(w, o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

// Three conversations of four turns, interleaved: each turn's prompt is the conversation's history
// (prompts and answers) plus a new message; all greedy. Between turns, `between` may damage the
// tiers. Returns every answer in order.
std::vector<std::vector<int32_t>> Converse(ColocatedEngine& e, int64_t vocab,
                                           const std::function<void(int turn)>& between = nullptr) {
  std::vector<std::vector<int32_t>> history(3), answers;
  uint32_t x = 777;
  for (int turn = 0; turn < 4; ++turn) {
    if (between) between(turn);
    for (size_t c = 0; c < history.size(); ++c) {
      for (int i = 0; i < 13; ++i) {
        x = x * 1664525u + 1013904223u;
        history[c].push_back(static_cast<int32_t>(2 + (x >> 8) % static_cast<uint32_t>(vocab - 2)));
      }
      GenerationRequest r;
      r.prompt = history[c];
      r.max_tokens = 9;
      r.ignore_eos = true;
      absl::StatusOr<std::vector<GenerationResult>> out = e.GenerateAll({r});
      EXPECT_TRUE(out.ok()) << out.status();
      if (!out.ok()) return answers;
      const std::vector<int32_t>& tokens = (*out)[0].token_ids;
      history[c].insert(history[c].end(), tokens.begin(), tokens.end());
      answers.push_back(tokens);
    }
  }
  return answers;
}

class KvTiersEngine : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
    ASSERT_TRUE(spec.ok());
    weights_ = RandomWeights(*spec, 42);
    auto plain = MakeEngine(*weights_, /*cache=*/false, {});
    expected_ = Converse(*plain, vocab());
    block_bytes_ = kBlock * spec->kv_bytes_per_token(sizeof(float));
  }
  int64_t vocab() const { return weights_->spec().vocab_size; }
  std::unique_ptr<WeightSource> weights_;
  std::vector<std::vector<int32_t>> expected_;
  int64_t block_bytes_ = 0;
};

TEST_F(KvTiersEngine, HostTierRestoresEvictedTurnsWithTheSameTokens) {
  auto cache_only = MakeEngine(*weights_, true, {});
  EXPECT_EQ(Converse(*cache_only, vocab()), expected_);
  const int64_t cached_without_tiers = cache_only->stats().cached_tokens;
  auto e = MakeEngine(*weights_, true, {.host_bytes = 64 * block_bytes_});
  EXPECT_EQ(Converse(*e, vocab()), expected_);
  const EngineStats s = e->stats();
  EXPECT_GT(s.demoted_tokens, 0);
  EXPECT_GT(s.restored_tokens, 0);
  EXPECT_EQ(s.restore_failed_tokens, 0);
  EXPECT_GT(s.cached_tokens, cached_without_tiers) << "restored blocks are not prefilled again";
  EXPECT_GT(e->tiers()->stats().host_hits, 0);
}

TEST_F(KvTiersEngine, DiskTierRestoresEvictedTurnsWithTheSameTokens) {
  const std::string dir = TempDir("engine_disk");
  auto e = MakeEngine(*weights_, true, {.disk_bytes = 64 * (block_bytes_ + 64), .dir = dir});
  EXPECT_EQ(Converse(*e, vocab(), [&](int) { e->tiers()->store().Flush(); }), expected_);
  EXPECT_GT(e->stats().restored_tokens, 0);
  EXPECT_GT(e->tiers()->stats().disk_hits, 0);
  EXPECT_EQ(e->tiers()->stats().host_hits, 0);
}

// Fault cases: each ends in recomputation (a failed restore) and the same tokens.
TEST_F(KvTiersEngine, DamagedFilesAreRecomputedNeverUsed) {
  struct Case {
    const char* name;
    std::function<void(const std::string& dir)> damage;
  };
  const std::vector<Case> cases = {
      {"corrupt",
       [](const std::string& dir) {
         for (const fs::path& p : BlockFiles(dir)) {
           std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
           f.seekp(100);
           f.put('\x42');
           f.seekp(101);
           f.put('\x13');
         }
       }},
      {"truncated",
       [](const std::string& dir) {
         for (const fs::path& p : BlockFiles(dir)) fs::resize_file(p, fs::file_size(p) / 2);
       }},
      {"directory removed", [](const std::string& dir) { fs::remove_all(dir); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = TempDir("engine_fault");
    auto e = MakeEngine(*weights_, true, {.disk_bytes = 64 * (block_bytes_ + 64), .dir = dir});
    const auto answers = Converse(*e, vocab(), [&](int turn) {
      e->tiers()->store().Flush();
      if (turn >= 2) c.damage(dir + "/");
    });
    EXPECT_EQ(answers, expected_);
    EXPECT_GT(e->stats().restore_failed_tokens, 0);
    EXPECT_GT(e->tiers()->stats().discarded + e->tiers()->stats().write_errors, 0);
  }
}

TEST_F(KvTiersEngine, FullDiskTierKeepsNothingAndChangesNoToken) {
  const std::string dir = TempDir("engine_full");
  // Smaller than one block file: every write is refused as "tier full".
  auto e = MakeEngine(*weights_, true, {.disk_bytes = block_bytes_ / 2, .dir = dir});
  EXPECT_EQ(Converse(*e, vocab(), [&](int) { e->tiers()->store().Flush(); }), expected_);
  EXPECT_GT(e->tiers()->stats().write_errors, 0);
  EXPECT_EQ(e->stats().restored_tokens, 0);
  EXPECT_TRUE(BlockFiles(dir).empty());
}

TEST_F(KvTiersEngine, TiersNeedThePrefixCache) {
  EngineOptions o;
  o.device = "cpu";
  o.kv_capacity_tokens = 160;
  o.prefix_cache = false;
  o.tiers_host_bytes = 1 << 20;
  absl::StatusOr<std::unique_ptr<ColocatedEngine>> e = ColocatedEngine::Create(*weights_, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("kv.tiers"), std::string_view::npos) << e.status();
}

}  // namespace
}  // namespace tandem
