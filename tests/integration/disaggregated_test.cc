// The disaggregated runtime as it is deployed: memory ranks are real `tandem memory` processes
// (started with ProcessGroup, each in a fresh temporary directory for its log and ready file),
// compute rank 0 with the controller runs in this process and reaches them over UCX on loopback.
//
// What must hold:
//   * the same requests on the same arrival schedule give the same tokens, finish reasons and
//     log-probabilities (within 1e-4) as the colocated engine, with 1, 2 or 3 memory ranks;
//   * the head partition (memory.partition: head; every rank holds a slice of every request's KV
//     heads) gives the same as the colocated engine and as the request partition, with 1, 2 and 4
//     memory ranks, on a mixed batch with prefix sharing on; a model whose KV heads do not divide
//     among the ranks is refused with both numbers;
//   * pipeline.q_first (q, then k,v; attention over the context merged with the new rows') gives
//     the colocated engine's tokens in every pipeline mode and both partitions (GPU ranks:
//     tests/gpu/multi_gpu_deploy_test.cc);
//   * a full KV cache makes requests wait, never drops one; a request that can never fit is
//     refused at Submit and the deployment keeps working;
//   * the transformers reference data is met through a deployment as it is by the engine;
//   * a memory rank that dies, or an address where nothing listens, fails with a status that
//     says so within the configured timeouts instead of hanging.
//
// Needs TANDEM_BINARY (the tandem executable) and TANDEM_SOURCE_DIR, both set by ctest.
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "colocated/engine.h"
#include "common/host_memory.h"
#include "compute_node/compute_rank.h"
#include "compute_node/pipeline_report.h"
#include "compute_node/weights.h"
#include "deploy/process_group.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "param_names.h"
#include "unit/truncated_conversations.h"

namespace tandem {
namespace {

constexpr double kSameLogprobTol = 1e-4;  // deployment vs colocated engine (usually bit-identical)
// vs transformers on the CPU backend, as tests/reference/hf_reference_test.cc.
constexpr double kHfGapFloor = 1e-3, kHfLogprobTol = 1e-3;

std::string SourceDir() {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");
  return src ? src : ".";
}
std::string ModelDir(const std::string& model) { return SourceDir() + "/tests/data/reference/" + model; }

std::unique_ptr<WeightSource> OpenReference(const std::string& model) {
  absl::StatusOr<std::unique_ptr<WeightSource>> source = OpenModel(ModelDir(model));
  EXPECT_TRUE(source.ok()) << source.status();
  return source.ok() ? std::move(*source) : nullptr;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// A request and the step after which it is submitted (0: before the first step).
struct Arrival {
  int64_t after_step = 0;
  GenerationRequest request;
};

GenerationRequest MakeRequest(std::mt19937& rng, int64_t vocab, int64_t prompt_len, int64_t max_tokens,
                              bool sampled, uint64_t seed) {
  GenerationRequest r;
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
  for (int64_t i = 0; i < prompt_len; ++i) r.prompt.push_back(id(rng));
  r.max_tokens = max_tokens;
  if (sampled) r.sampling = {.temperature = 0.8f, .top_k = 40, .top_p = 0.9f, .seed = seed};
  return r;
}

// Submits each arrival after its step and steps until every request finished; the same schedule
// for the colocated engine and a compute rank (both have Submit and Step). `after_step` is called
// after every step. Results in arrival order (ids are assigned in submission order).
template <typename Runner, typename Observer>
std::vector<GenerationResult> RunSchedule(Runner& runner, const std::vector<Arrival>& arrivals,
                                          Observer after_step) {
  std::vector<GenerationResult> results(arrivals.size());
  size_t submitted = 0, finished_count = 0;
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  for (int64_t step = 0; finished_count < arrivals.size(); ++step) {
    if (step > 10000) {
      ADD_FAILURE() << "schedule did not finish in 10000 steps";
      return {};
    }
    while (submitted < arrivals.size() && arrivals[submitted].after_step <= step) {
      absl::StatusOr<int64_t> id = runner.Submit(arrivals[submitted].request);
      if (!id.ok()) {
        ADD_FAILURE() << "request " << submitted << ": " << id.status();
        return {};
      }
      EXPECT_EQ(*id, static_cast<int64_t>(submitted));
      ++submitted;
    }
    finished.clear();
    const absl::Status st = runner.Step(&finished);
    if (!st.ok()) {
      ADD_FAILURE() << "step " << step << ": " << st;
      return {};
    }
    for (auto& [id, result] : finished) {
      results[static_cast<size_t>(id)] = std::move(result);
      ++finished_count;
    }
    after_step();
  }
  return results;
}

// Returns the largest |logprob difference| seen.
double ExpectSameResults(const std::vector<GenerationResult>& got,
                         const std::vector<GenerationResult>& want) {
  double max_diff = 0;
  EXPECT_EQ(got.size(), want.size());
  if (got.size() != want.size()) return max_diff;
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "request " << i);
    EXPECT_EQ(got[i].token_ids, want[i].token_ids);
    EXPECT_EQ(got[i].finish_reason, want[i].finish_reason);
    EXPECT_EQ(got[i].prompt_tokens, want[i].prompt_tokens);
    EXPECT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
    for (size_t t = 0; t < std::min(got[i].logprobs.size(), want[i].logprobs.size()); ++t) {
      EXPECT_NEAR(got[i].logprobs[t], want[i].logprobs[t], kSameLogprobTol) << "position " << t;
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i].logprobs[t] - want[i].logprobs[t])));
    }
  }
  return max_diff;
}

// Memory ranks as processes and compute rank 0 in this process. TearDown says bye and expects
// every memory rank to exit 0 within a bound (pidfds, so a missed bye fails instead of hanging),
// then stops whatever is left.
class DisaggregatedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "tandem-disaggregated-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr) << "mkdtemp " << tmpl;
    dir_ = tmpl;
    std::ofstream(dir_ + "/deploy.yaml") << "launch:\n  startup_timeout_s: 60\n  step_timeout_s: 20\n";
  }

  void TearDown() override {
    if (rank_) {
      (void)rank_->Shutdown();
      rank_.reset();
    }
    if (expect_clean_exit_) ExpectRanksExit();
    const std::vector<std::string> killed = group_.StopAll(absl::Seconds(5));
    if (expect_clean_exit_) {
      EXPECT_TRUE(killed.empty()) << absl::StrJoin(killed, ", ") << " needed SIGKILL";
    }
    for (int fd : pidfds_) close(fd);
    if (HasFailure()) {
      for (const std::string& name : names_) {
        std::printf("--- %s log (in %s):\n%s\n", name.c_str(), dir_.c_str(),
                    group_.LogTail(name, 40).c_str());
      }
    } else if (!dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }

  // Expects every memory rank not yet waited for to exit 0 within 20 s (of the bye it was sent).
  void ExpectRanksExit() {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    for (size_t m = exited_; m < names_.size(); ++m) {
      pollfd p{.fd = pidfds_[m], .events = POLLIN, .revents = 0};
      const int ms =
          static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now())));
      if (poll(&p, 1, ms) != 1) {
        ADD_FAILURE() << names_[m] << " did not exit within 20 s of the bye; log:\n"
                      << group_.LogTail(names_[m]);
        continue;
      }
      EXPECT_TRUE(group_.WaitExit(names_[m]).ok()) << names_[m] << " did not exit cleanly";
    }
    exited_ = names_.size();
  }

  // Starts `n` memory ranks and waits until each listens; their addresses go to addresses_. A test
  // may start a second deployment after StopDeployment(): its processes get new names.
  // `kv_shares[m]`, when given, is memory rank m's --kv-share (its KV sized from that share of
  // kv.memory_fraction, with kv_capacity 0).
  void StartMemoryRanks(int n, const std::vector<int>& kv_shares = {}) {
    const char* binary = std::getenv("TANDEM_BINARY");
    ASSERT_NE(binary, nullptr) << "TANDEM_BINARY must name the tandem executable (ctest sets it)";
    const size_t first = names_.size();
    addresses_.clear();
    for (int m = 0; m < n; ++m) {
      const std::string name = absl::StrCat("memory-", first + static_cast<size_t>(m));
      const std::string ready = absl::StrCat(dir_, "/", name, ".ready");
      ASSERT_TRUE(
          group_
              .Start(name,
                     {binary, "memory", "--config", dir_ + "/deploy.yaml", "--rank", std::to_string(m),
                      "--listen", "127.0.0.1:0", "--device", "cpu", "--ready-file", ready, "--kv-share",
                      std::to_string(kv_shares.empty() ? 1 : kv_shares[static_cast<size_t>(m)])},
                     absl::StrCat(dir_, "/", name, ".log"))
              .ok());
      const int fd = static_cast<int>(syscall(SYS_pidfd_open, group_.pid(name), 0));
      ASSERT_GE(fd, 0) << "pidfd_open: " << std::strerror(errno);
      names_.push_back(name);
      pidfds_.push_back(fd);
    }
    for (size_t i = first; i < names_.size(); ++i) {
      const std::string& name = names_[i];
      absl::StatusOr<std::string> address =
          group_.WaitReady(name, absl::StrCat(dir_, "/", name, ".ready"), absl::Seconds(60));
      ASSERT_TRUE(address.ok()) << address.status();
      while (!address->empty() && (address->back() == '\n' || address->back() == '\r')) address->pop_back();
      ASSERT_FALSE(address->empty()) << name << " wrote an empty ready file";
      addresses_.push_back(*address);
    }
  }

  // The prefix registry with blocks of `block` tokens and kv.prefix_sharing `sharing`.
  static void UsePrefixCache(ComputeRankOptions* o, int64_t block, const std::string& sharing) {
    absl::StatusOr<PrefixOptions> prefix = ResolvePrefixOptions(true, block, sharing);
    ASSERT_TRUE(prefix.ok()) << prefix.status();
    o->scheduler.prefix_block_tokens = prefix->block_tokens;
    o->scheduler.prefix_sharing = prefix->sharing;
  }

  static ComputeRankOptions Options(int64_t max_batch_size, int64_t max_tokens_per_step,
                                    int64_t kv_capacity) {
    ComputeRankOptions o;
    o.device = -1;
    o.scheduler.max_batch_size = max_batch_size;
    o.scheduler.max_tokens_per_step = max_tokens_per_step;
    o.kv_capacity_tokens = kv_capacity;
    o.startup_timeout = absl::Seconds(60);
    o.step_timeout = absl::Seconds(20);
    return o;
  }

  // StartMemoryRanks(n), then compute rank 0 connected to them.
  void StartDeployment(const WeightSource& source, int n, ComputeRankOptions options,
                       const std::vector<int>& kv_shares = {}) {
    ASSERT_NO_FATAL_FAILURE(StartMemoryRanks(n, kv_shares));
    options.memory_addresses = addresses_;
    absl::StatusOr<std::unique_ptr<ComputeRank>> rank = ComputeRank::Create(source, options);
    ASSERT_TRUE(rank.ok()) << rank.status();
    rank_ = std::move(*rank);
    // Under the head partition every rank holds every request: one placement group.
    ASSERT_EQ(rank_->controller().num_memory_ranks(), options.partition == AttentionPartition::kHead ? 1 : n);
  }

  // Starts compute ranks 1..ranks-1 (after the memory ranks) for compute rank 0's options `o`.
  void StartReplicas(const std::string& model, int ranks, const ComputeRankOptions& o,
                     std::vector<std::string>* replica_addresses) {
    const char* binary = std::getenv("TANDEM_BINARY");
    ASSERT_NE(binary, nullptr);
    const std::string config = dir_ + "/replicas.yaml";
    std::ofstream(config) << "model:\n  path: " << ModelDir(model) << "\ncompute:\n  ranks: " << ranks
                          << "\n  device: cpu\nmemory:\n  ranks: " << addresses_.size()
                          << "\n  partition: " << AttentionPartitionName(o.partition)
                          << "\npipeline:\n  mode: " << (o.slice_layers > 0 ? "rotational" : "fixed")
                          << "\n  slice_layers: " << std::max(1, o.slice_layers)
                          << "\n  batches: " << o.micro_batches
                          << "\n  q_first: " << (o.q_first ? "true" : "false")
                          << "\nscheduler:\n  max_batch_size: " << o.scheduler.max_batch_size
                          << "\n  max_tokens_per_step: " << o.scheduler.max_tokens_per_step
                          << "\nlaunch:\n  startup_timeout_s: 60\n  step_timeout_s: "
                          << absl::ToInt64Seconds(o.step_timeout) << "\n";
    for (int r = 1; r < ranks; ++r) {
      const std::string name = absl::StrCat("compute-", r), ready = absl::StrCat(dir_, "/", name, ".ready");
      ASSERT_TRUE(group_
                      .Start(name,
                             {binary, "compute", "--replica", std::to_string(r), "--config", config,
                              "--memory", absl::StrJoin(addresses_, ","), "--listen", "127.0.0.1:0",
                              "--device", "cpu", "--ready-file", ready},
                             absl::StrCat(dir_, "/", name, ".log"))
                      .ok());
      absl::StatusOr<std::string> address = group_.WaitReady(name, ready, absl::Seconds(60));
      ASSERT_TRUE(address.ok()) << address.status();
      replica_addresses->emplace_back(absl::StripAsciiWhitespace(*address));
    }
  }

  // Says bye to the deployment's memory ranks and expects them to exit cleanly.
  void StopDeployment() {
    if (!rank_) return;
    (void)rank_->Shutdown();
    rank_.reset();
    ExpectRanksExit();
  }

  std::unique_ptr<ColocatedEngine> Engine(const WeightSource& source, int64_t max_batch_size,
                                          int64_t max_tokens_per_step, bool prefix_cache = true) {
    EngineOptions o;
    o.device = "cpu";
    o.max_batch_size = max_batch_size;
    o.max_tokens_per_step = max_tokens_per_step;
    o.kv_capacity_tokens = 8192;
    o.prefix_cache = prefix_cache;
    absl::StatusOr<std::unique_ptr<ColocatedEngine>> engine = ColocatedEngine::Create(source, o);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(*engine) : nullptr;
  }

  std::string dir_;
  ProcessGroup group_;
  std::vector<std::string> names_, addresses_;
  std::vector<int> pidfds_;
  size_t exited_ = 0;  // names_[0, exited_) were stopped and waited for
  std::unique_ptr<ComputeRank> rank_;
  bool expect_clean_exit_ = true;
};

// ---------------------------------------------------------------------------------------------
// 1. A mixed batch with staggered arrivals equals the colocated engine.

class MixedBatch : public DisaggregatedTest,
                   public ::testing::WithParamInterface<std::tuple<std::string, int>> {};

TEST_P(MixedBatch, EqualsColocated) {
  const auto& [model, n] = GetParam();
  std::unique_ptr<WeightSource> source = OpenReference(model);
  ASSERT_NE(source, nullptr);
  constexpr int64_t kBatch = 8, kStepTokens = 24;  // prompts are prefilled in chunks beside decodes

  // Prompt lengths 1..60, some requests done after 1-3 tokens, half sampled; arrivals staggered.
  struct Shape {
    int64_t prompt, max_tokens, after_step;
  };
  const Shape shapes[] = {{1, 16, 0}, {60, 2, 0}, {7, 20, 0},  {33, 1, 2},
                          {3, 14, 2}, {45, 3, 5}, {12, 18, 8}, {20, 12, 11}};
  std::mt19937 rng(1234);
  std::vector<Arrival> arrivals;
  for (size_t i = 0; i < std::size(shapes); ++i) {
    arrivals.push_back({shapes[i].after_step, MakeRequest(rng, source->spec().vocab_size, shapes[i].prompt,
                                                          shapes[i].max_tokens, i % 2 == 1, 100 + i)});
  }

  std::unique_ptr<ColocatedEngine> engine = Engine(*source, kBatch, kStepTokens);
  ASSERT_NE(engine, nullptr);
  const std::vector<GenerationResult> want = RunSchedule(*engine, arrivals, [] {});
  ASSERT_FALSE(HasFailure());

  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, n, Options(kBatch, kStepTokens, 4096)));
  int most_ranks_in_use = 0;
  const std::vector<GenerationResult> got = RunSchedule(*rank_, arrivals, [&] {
    int in_use = 0;
    for (int m = 0; m < n; ++m) in_use += rank_->controller().kv_reserved(m) > 0 ? 1 : 0;
    most_ranks_in_use = std::max(most_ranks_in_use, in_use);
  });
  ASSERT_FALSE(HasFailure());
  int64_t generated = 0, ended_early = 0;
  for (const GenerationResult& r : got) {
    generated += static_cast<int64_t>(r.token_ids.size());
    ended_early += r.token_ids.size() <= 3 ? 1 : 0;
  }
  std::printf(
      "%s, %d memory rank(s): %lld tokens in %lld steps, %lld requests ended within 3 tokens, "
      "max |logprob difference| %.3g\n",
      model.c_str(), n, static_cast<long long>(generated), static_cast<long long>(rank_->stats().steps),
      static_cast<long long>(ended_early), ExpectSameResults(got, want));
  EXPECT_EQ(most_ranks_in_use, n) << "requests were not spread over every memory rank";
  EXPECT_EQ(rank_->stats().steps, engine->stats().steps);

  // The pipeline report: every step counted, every rank's attention timed, the phases inside the
  // steps' wall time.
  absl::StatusOr<PipelineTotals> totals = rank_->Pipeline();
  ASSERT_TRUE(totals.ok()) << totals.status();
  const PipelineReport report = MakePipelineReport(*totals);
  std::printf("  pipeline: %s\n", report.ToString().c_str());
  EXPECT_EQ(report.steps, rank_->stats().steps);
  ASSERT_EQ(report.rank_attention_ms.size(), static_cast<size_t>(n));
  for (int m = 0; m < n; ++m) EXPECT_GT(report.rank_attention_ms[m], 0.0) << "memory rank " << m;
  EXPECT_GT(report.compute_ms, 0.0);
  EXPECT_GT(report.attention_phase_ms, 0.0);
  EXPECT_LE(report.compute_ms + report.attention_phase_ms, report.step_ms * 1.0001);
  EXPECT_GT(report.efficiency, 0.0);
  EXPECT_LE(report.efficiency, 1.0);
}

INSTANTIATE_TEST_SUITE_P(ModelsAndRanks, MixedBatch,
                         ::testing::Combine(::testing::Values("llama3-gqa-tied", "llama2-mha", "mqa-headdim"),
                                            ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           std::string s = absl::StrCat(std::get<0>(info.param), "_", std::get<1>(info.param),
                                                        "_memory_ranks");
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

// ---------------------------------------------------------------------------------------------
// 1b. Shared prefixes: the memory ranks reuse registered blocks (prefix cache) and read a group's
// shared blocks once (cascade), and the tokens still equal the colocated engine without either.

class SharedPrefixDeployed : public DisaggregatedTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(SharedPrefixDeployed, EqualsColocatedWithoutSharing) {
  std::unique_ptr<WeightSource> source = OpenReference("llama3-gqa-tied");
  ASSERT_NE(source, nullptr);
  constexpr int64_t kBatch = 6, kStepTokens = 32, kBlock = 8;
  std::mt19937 rng(99);
  const int64_t vocab = source->spec().vocab_size;
  // A 16-token system prompt for all, one of two 16-token examples for most, then own tails;
  // arrivals staggered so that later requests find the earlier ones' blocks registered.
  const GenerationRequest system = MakeRequest(rng, vocab, 16, 1, false, 0);
  const GenerationRequest shots[2] = {MakeRequest(rng, vocab, 16, 1, false, 0),
                                      MakeRequest(rng, vocab, 16, 1, false, 0)};
  std::vector<Arrival> arrivals;
  for (int i = 0; i < 14; ++i) {
    GenerationRequest r = MakeRequest(rng, vocab, 1 + (i * 7) % 19, 3 + i % 6, i % 3 == 1, 500 + i);
    std::vector<int32_t> prompt = system.prompt;
    if (i % 5 != 4) prompt.insert(prompt.end(), shots[i % 2].prompt.begin(), shots[i % 2].prompt.end());
    prompt.insert(prompt.end(), r.prompt.begin(), r.prompt.end());
    r.prompt = prompt;
    arrivals.push_back({i < 4 ? 0 : 3 + i, r});
  }
  std::unique_ptr<ColocatedEngine> engine = Engine(*source, kBatch, kStepTokens, /*prefix_cache=*/false);
  ASSERT_NE(engine, nullptr);
  const std::vector<GenerationResult> want = RunSchedule(*engine, arrivals, [] {});
  ASSERT_FALSE(HasFailure());

  ComputeRankOptions o = Options(kBatch, kStepTokens, 4096);
  ASSERT_NO_FATAL_FAILURE(UsePrefixCache(&o, kBlock, GetParam()));
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 2, o));
  const std::vector<GenerationResult> got = RunSchedule(*rank_, arrivals, [] {});
  ASSERT_FALSE(HasFailure());
  int64_t cached = 0;
  for (const GenerationResult& r : got) cached += r.cached_tokens;
  const ControllerStats& stats = rank_->controller().stats();
  std::printf(
      "prefix_sharing %s: %lld prompt tokens reused, %lld rows in prefix groups, max |logprob "
      "difference| %.3g\n",
      GetParam().c_str(), static_cast<long long>(cached), static_cast<long long>(stats.grouped_rows),
      ExpectSameResults(got, want));
  EXPECT_GT(cached, 0);
  EXPECT_EQ(stats.cached_tokens, cached);
  if (GetParam() == "on") {
    EXPECT_GT(stats.grouped_rows, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Sharing, SharedPrefixDeployed, ::testing::Values("on", "off", "auto"));

// ---------------------------------------------------------------------------------------------
// 2. KV full: requests wait for KV and none is dropped.

TEST_F(DisaggregatedTest, FullKvMakesRequestsWaitAndDropsNone) {
  std::unique_ptr<WeightSource> source = OpenReference("llama3-gqa-tied");
  ASSERT_NE(source, nullptr);
  constexpr int64_t kBatch = 8, kStepTokens = 24, kKv = 96;  // per rank: two of these at most
  const int64_t shapes[][2] = {{30, 16}, {25, 20}, {40, 12}, {35, 18}, {20, 20}, {28, 14}, {38, 16}};
  std::mt19937 rng(99);
  std::vector<Arrival> arrivals;
  for (size_t i = 0; i < std::size(shapes); ++i) {
    arrivals.push_back(
        {0, MakeRequest(rng, source->spec().vocab_size, shapes[i][0], shapes[i][1], i % 2 == 0, 7 + i)});
  }

  // The reference: each request alone.
  std::unique_ptr<ColocatedEngine> engine = Engine(*source, kBatch, kStepTokens);
  ASSERT_NE(engine, nullptr);
  std::vector<GenerationResult> want;
  for (const Arrival& a : arrivals) {
    absl::StatusOr<std::vector<GenerationResult>> r = engine->GenerateAll({a.request});
    ASSERT_TRUE(r.ok()) << r.status();
    want.push_back((*r)[0]);
  }

  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 2, Options(kBatch, kStepTokens, kKv)));
  bool waited_while_running = false;
  int64_t most_running = 0;
  const std::vector<GenerationResult> got = RunSchedule(*rank_, arrivals, [&] {
    const Controller& c = rank_->controller();
    if (c.num_waiting() > 0 && c.num_running() > 0) waited_while_running = true;
    most_running = std::max(most_running, c.num_running());
    for (int m = 0; m < 2; ++m) EXPECT_LE(c.kv_reserved(m), kKv);
  });
  ASSERT_FALSE(HasFailure());
  std::printf("max running %lld, max |logprob difference| %.3g\n", static_cast<long long>(most_running),
              ExpectSameResults(got, want));
  EXPECT_TRUE(waited_while_running);
  EXPECT_LE(most_running, 4);
  EXPECT_GE(most_running, 2);
}

// ---------------------------------------------------------------------------------------------
// 3. A request that fits on no memory rank is refused; the deployment keeps working.

TEST_F(DisaggregatedTest, RequestThatFitsNowhereIsRefused) {
  std::unique_ptr<WeightSource> source = OpenReference("mqa-headdim");
  ASSERT_NE(source, nullptr);
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 2, Options(8, 24, 96)));
  std::mt19937 rng(5);
  const absl::StatusOr<int64_t> refused =
      rank_->Submit(MakeRequest(rng, source->spec().vocab_size, 50, 60, false, 0));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("110"), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("96"), std::string::npos) << refused.status();
  EXPECT_TRUE(rank_->controller().Idle());

  const GenerationRequest ok = MakeRequest(rng, source->spec().vocab_size, 10, 8, true, 3);
  std::unique_ptr<ColocatedEngine> engine = Engine(*source, 8, 24);
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<std::vector<GenerationResult>> want = engine->GenerateAll({ok});
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<std::vector<GenerationResult>> got = rank_->GenerateAll({ok});
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameResults(*got, *want);
  EXPECT_FALSE((*got)[0].token_ids.empty());
}

// ---------------------------------------------------------------------------------------------
// 3b. Cancel through the Engine interface: the request ends at once with its tokens so far, and
// the memory rank frees its KV (told by a release message). The KV holds one request at a time,
// so the waiting request can only run, and match the colocated engine, once the memory rank has
// freed the cancelled one's slots.

TEST_F(DisaggregatedTest, CancelFreesTheRequestsKvOnItsMemoryRank) {
  std::unique_ptr<WeightSource> source = OpenReference("mqa-headdim");
  ASSERT_NE(source, nullptr);
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 1, Options(4, 32, 128)));
  tandem::Engine& engine = *rank_;
  std::mt19937 rng(11);
  const int64_t vocab = source->spec().vocab_size;
  const GenerationRequest first = MakeRequest(rng, vocab, 60, 60, false, 0);
  const GenerationRequest second = MakeRequest(rng, vocab, 50, 70, true, 5);
  const GenerationRequest third = MakeRequest(rng, vocab, 5, 4, false, 0);
  absl::StatusOr<int64_t> a = engine.Submit(first), b = engine.Submit(second), c = engine.Submit(third);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  for (int step = 0; step < 4; ++step) ASSERT_TRUE(engine.Step(&finished).ok());
  ASSERT_TRUE(finished.empty());

  // The waiting one first (it holds no KV), then the running one.
  absl::StatusOr<GenerationResult> cancelled_waiting = engine.Cancel(*c);
  ASSERT_TRUE(cancelled_waiting.ok()) << cancelled_waiting.status();
  EXPECT_EQ(cancelled_waiting->finish_reason, "cancelled");
  EXPECT_TRUE(cancelled_waiting->token_ids.empty());
  absl::StatusOr<GenerationResult> cancelled = engine.Cancel(*a);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->finish_reason, "cancelled");
  EXPECT_GE(cancelled->token_ids.size(), 1u);  // prefilled in two steps, then decoding
  EXPECT_LT(cancelled->token_ids.size(), 60u);
  EXPECT_EQ(engine.Cancel(*a).status().code(), absl::StatusCode::kNotFound);

  while (!engine.Idle()) ASSERT_TRUE(engine.Step(&finished).ok());
  ASSERT_EQ(finished.size(), 1u);
  EXPECT_EQ(finished[0].first, *b);

  std::unique_ptr<ColocatedEngine> colocated = Engine(*source, 4, 32);
  ASSERT_NE(colocated, nullptr);
  absl::StatusOr<std::vector<GenerationResult>> want = colocated->GenerateAll({first, second});
  ASSERT_TRUE(want.ok()) << want.status();
  ExpectSameResults({finished[0].second}, {(*want)[1]});
  // The cancelled request's tokens are the start of what it would have generated.
  ASSERT_LE(cancelled->token_ids.size(), (*want)[0].token_ids.size());
  EXPECT_TRUE(
      std::equal(cancelled->token_ids.begin(), cancelled->token_ids.end(), (*want)[0].token_ids.begin()));
}

// ---------------------------------------------------------------------------------------------
// 3c. Head partition: every memory rank holds a slice of the KV heads of every request. A mixed
// batch (1- to 70-token prompts, shared system prompt and examples, 1 to 16 tokens out, greedy
// and sampled, staggered arrivals) with the prefix cache and prefix sharing on equals the
// colocated engine (without the prefix cache) and the request partition on the same ranks.

// A GQA model with 4 KV heads, so that 4 memory ranks get one KV head (and two query heads) each:
// the tiny-gqa preset's shape with 8 query heads and 4 KV heads of 16, random weights. Untied: with
// the preset's tied embeddings, random weights make each token predict itself with probability ~1,
// whatever attention returns, and the comparison would check nothing.
std::unique_ptr<WeightSource> OpenHeadModel(const std::string& model) {
  if (model != "gqa-8x4") return OpenReference(model);
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  EXPECT_TRUE(spec.ok()) << spec.status();
  if (!spec.ok()) return nullptr;
  spec->name = model;
  spec->num_kv_heads = 4;
  spec->tie_word_embeddings = false;
  EXPECT_TRUE(spec->Validate().ok()) << spec->Validate();
  return RandomWeights(*spec, /*seed=*/7);
}

class HeadPartition : public DisaggregatedTest,
                      public ::testing::WithParamInterface<std::tuple<std::string, int>> {};

TEST_P(HeadPartition, EqualsColocatedAndRequestPartition) {
  const auto& [model, n] = GetParam();
  std::unique_ptr<WeightSource> source = OpenHeadModel(model);
  ASSERT_NE(source, nullptr);
  ASSERT_GE(source->spec().num_kv_heads, n);
  constexpr int64_t kBatch = 6, kStepTokens = 32, kBlock = 8;
  std::mt19937 rng(4321);
  const int64_t vocab = source->spec().vocab_size;
  const GenerationRequest system = MakeRequest(rng, vocab, 16, 1, false, 0);
  const GenerationRequest shot = MakeRequest(rng, vocab, 8, 1, false, 0);
  struct Shape {
    int64_t tail, max_tokens, after_step;
    bool shared;
  };
  const Shape shapes[] = {{1, 16, 0, false}, {70, 3, 0, false}, {5, 12, 0, true},  {20, 1, 1, true},
                          {9, 14, 3, true},  {1, 8, 4, true},   {45, 6, 6, false}, {12, 10, 9, true},
                          {3, 16, 12, true}, {30, 4, 14, true}};
  std::vector<Arrival> arrivals;
  for (size_t i = 0; i < std::size(shapes); ++i) {
    GenerationRequest r = MakeRequest(rng, vocab, shapes[i].tail, shapes[i].max_tokens, i % 3 == 1, 900 + i);
    if (shapes[i].shared) {
      std::vector<int32_t> prompt = system.prompt;
      if (i % 2 == 0) prompt.insert(prompt.end(), shot.prompt.begin(), shot.prompt.end());
      prompt.insert(prompt.end(), r.prompt.begin(), r.prompt.end());
      r.prompt = prompt;
    }
    arrivals.push_back({shapes[i].after_step, r});
  }

  std::unique_ptr<ColocatedEngine> engine = Engine(*source, kBatch, kStepTokens, /*prefix_cache=*/false);
  ASSERT_NE(engine, nullptr);
  const std::vector<GenerationResult> want = RunSchedule(*engine, arrivals, [] {});
  ASSERT_FALSE(HasFailure());

  ComputeRankOptions o = Options(kBatch, kStepTokens, 1024);
  ASSERT_NO_FATAL_FAILURE(UsePrefixCache(&o, kBlock, "on"));

  o.partition = AttentionPartition::kRequest;
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, n, o));
  const std::vector<GenerationResult> by_request = RunSchedule(*rank_, arrivals, [] {});
  ASSERT_FALSE(HasFailure());
  StopDeployment();

  o.partition = AttentionPartition::kHead;
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, n, o));
  int64_t most_reserved = 0;
  const std::vector<GenerationResult> got = RunSchedule(*rank_, arrivals, [&] {
    const std::vector<KvUsage> usage = rank_->kv_usage();
    ASSERT_EQ(usage.size(), static_cast<size_t>(n));
    for (const KvUsage& u : usage) {
      EXPECT_EQ(u.capacity, 1024);  // every rank was given 1024 tokens of its heads
      EXPECT_EQ(u.reserved, usage[0].reserved);
    }
    most_reserved = std::max(most_reserved, usage[0].reserved);
  });
  ASSERT_FALSE(HasFailure());
  for (int m = 0; m < n; ++m) {
    // [m·Hkv/n, (m+1)·Hkv/n), rounded down: 4 KV heads over 3 ranks are 1, 1 and 2.
    const int64_t kv_heads = source->spec().num_kv_heads;
    const std::string& name = rank_->memory_ranks()[static_cast<size_t>(m)];
    EXPECT_NE(name.find(absl::StrCat("memory rank ", m, ": cpu")), std::string::npos) << name;
    EXPECT_NE(name.find(absl::StrCat("1024 KV tokens of KV heads [", m * kv_heads / n, ", ",
                                     (m + 1) * kv_heads / n, ")")),
              std::string::npos)
        << name;
  }
  int64_t cached = 0, generated = 0;
  for (const GenerationResult& r : got) {
    cached += r.cached_tokens;
    generated += static_cast<int64_t>(r.token_ids.size());
  }
  const ControllerStats& stats = rank_->controller().stats();
  const double vs_colocated = ExpectSameResults(got, want);
  const double vs_request = ExpectSameResults(got, by_request);
  std::printf(
      "%s, %d memory rank(s), head partition: %lld tokens generated, %lld prompt tokens reused, %lld rows in "
      "prefix groups, max |logprob difference| %.3g vs colocated, %.3g vs request partition\n",
      model.c_str(), n, static_cast<long long>(generated), static_cast<long long>(cached),
      static_cast<long long>(stats.grouped_rows), vs_colocated, vs_request);
  EXPECT_GT(cached, 0) << "the prefix cache was not used";
  EXPECT_GT(stats.grouped_rows, 0) << "no prefix group was formed";
  EXPECT_GT(most_reserved, 0);
}

INSTANTIATE_TEST_SUITE_P(ModelsAndRanks, HeadPartition,
                         ::testing::Values(std::tuple<std::string, int>{"llama2-mha", 1},
                                           std::tuple<std::string, int>{"llama3-gqa-tied", 1},
                                           std::tuple<std::string, int>{"gqa-8x4", 1},
                                           std::tuple<std::string, int>{"llama2-mha", 2},
                                           std::tuple<std::string, int>{"llama2-mha", 4},
                                           std::tuple<std::string, int>{"llama3-gqa-tied", 2},
                                           std::tuple<std::string, int>{"gqa-8x4", 2},
                                           std::tuple<std::string, int>{"gqa-8x4", 3},
                                           std::tuple<std::string, int>{"gqa-8x4", 4},
                                           std::tuple<std::string, int>{"llama2-mha", 3}),
                         [](const auto& info) {
                           return absl::StrCat(testing_names::Identifier(std::get<0>(info.param)), "_",
                                               std::get<1>(info.param), "_memory_ranks");
                         });

// ---------------------------------------------------------------------------------------------
// Pipelining (pipeline.mode pingpong): each step split into micro-batches that compute rank 0 runs
// interleaved with the memory ranks' attention gives the colocated engine's tokens, whatever the
// partition, the number of memory ranks and of micro-batches, with prefix sharing on.

// With compute replicas (pipeline.mode fixed, compute.ranks > 1): `tandem compute --replica r`
// processes that load the same checkpoint, connect to the memory ranks and run the micro-batches
// j with j % compute.ranks == r.
class PingPong : public DisaggregatedTest,
                 public ::testing::WithParamInterface<
                     std::tuple<std::string, int, AttentionPartition, int, int, int, bool>> {};

TEST_P(PingPong, EqualsColocated) {
  const auto& [model, n, partition, batches, compute_ranks, slice_layers, q_first] = GetParam();
  std::unique_ptr<WeightSource> source = OpenHeadModel(model);
  ASSERT_NE(source, nullptr);
  constexpr int64_t kBatch = 8, kStepTokens = 40, kBlock = 8;
  std::mt19937 rng(2468 + batches);
  const int64_t vocab = source->spec().vocab_size;
  const GenerationRequest system = MakeRequest(rng, vocab, 16, 1, false, 0);
  std::vector<Arrival> arrivals;
  for (int i = 0; i < 16; ++i) {
    GenerationRequest r = MakeRequest(rng, vocab, 1 + (i * 11) % 37, 2 + (i * 5) % 13, i % 3 == 2, 700 + i);
    if (i % 2 == 0) {
      std::vector<int32_t> prompt = system.prompt;
      prompt.insert(prompt.end(), r.prompt.begin(), r.prompt.end());
      r.prompt = prompt;
    }
    arrivals.push_back({i < 6 ? 0 : i, r});
  }
  std::unique_ptr<ColocatedEngine> engine = Engine(*source, kBatch, kStepTokens, /*prefix_cache=*/false);
  ASSERT_NE(engine, nullptr);
  const std::vector<GenerationResult> want = RunSchedule(*engine, arrivals, [] {});
  ASSERT_FALSE(HasFailure());

  ComputeRankOptions o = Options(kBatch, kStepTokens, 2048);
  ASSERT_NO_FATAL_FAILURE(UsePrefixCache(&o, kBlock, "on"));
  o.partition = partition;
  o.micro_batches = batches;
  o.slice_layers = slice_layers;
  o.q_first = q_first;
  if (compute_ranks > 1) {
    ASSERT_NO_FATAL_FAILURE(StartMemoryRanks(n));
    ASSERT_NO_FATAL_FAILURE(StartReplicas(model, compute_ranks, o, &o.replica_addresses));
    o.memory_addresses = addresses_;
    absl::StatusOr<std::unique_ptr<ComputeRank>> rank = ComputeRank::Create(*source, o);
    ASSERT_TRUE(rank.ok()) << rank.status();
    rank_ = std::move(*rank);
  } else {
    ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, n, o));
  }
  const std::vector<GenerationResult> got = RunSchedule(*rank_, arrivals, [] {});
  ASSERT_FALSE(HasFailure());
  int64_t cached = 0, generated = 0;
  for (const GenerationResult& r : got) {
    cached += r.cached_tokens;
    generated += static_cast<int64_t>(r.token_ids.size());
  }
  const ControllerStats& stats = rank_->controller().stats();
  std::printf(
      "%s, %d compute rank(s)%s, %d memory rank(s), %s partition, %d micro-batches%s: %lld tokens in %lld "
      "steps, "
      "%lld prompt tokens reused, %lld rows in prefix groups, max |logprob difference| %.3g\n",
      model.c_str(), compute_ranks,
      slice_layers > 0 ? absl::StrCat(" rotating every ", slice_layers, " layer(s)").c_str() : "", n,
      std::string(AttentionPartitionName(partition)).c_str(), batches, q_first ? ", q first" : "",
      static_cast<long long>(generated), static_cast<long long>(stats.steps), static_cast<long long>(cached),
      static_cast<long long>(stats.grouped_rows), ExpectSameResults(got, want));
  EXPECT_GT(cached, 0) << "the prefix cache was not used";
  absl::StatusOr<PipelineTotals> totals = rank_->Pipeline();
  ASSERT_TRUE(totals.ok()) << totals.status();
  const PipelineReport report = MakePipelineReport(*totals);
  std::printf("  pipeline: %s\n", report.ToString().c_str());
  EXPECT_EQ(report.steps, stats.steps);
  for (int m = 0; m < n; ++m) EXPECT_GT(report.rank_attention_ms[static_cast<size_t>(m)], 0.0);
  EXPECT_LE(report.compute_ms + report.attention_phase_ms, report.step_ms * 1.0001);
}

// (model, memory ranks, partition, micro-batches, compute ranks, slice_layers: 0 fixed, else
// rotational, pipeline.q_first)
using PingPongCase = std::tuple<std::string, int, AttentionPartition, int, int, int, bool>;
INSTANTIATE_TEST_SUITE_P(
    ModelsRanksPartitionsBatches, PingPong,
    ::testing::Values(PingPongCase{"llama3-gqa-tied", 1, AttentionPartition::kRequest, 2, 1, 0, false},
                      PingPongCase{"llama2-mha", 2, AttentionPartition::kRequest, 3, 1, 0, false},
                      PingPongCase{"mqa-headdim", 3, AttentionPartition::kRequest, 2, 1, 0, false},
                      PingPongCase{"llama3-gqa-tied", 2, AttentionPartition::kHead, 2, 1, 0, false},
                      PingPongCase{"gqa-8x4", 4, AttentionPartition::kHead, 4, 1, 0, false},
                      // Compute replicas (pipeline.mode fixed).
                      PingPongCase{"llama3-gqa-tied", 1, AttentionPartition::kRequest, 2, 2, 0, false},
                      PingPongCase{"llama2-mha", 2, AttentionPartition::kRequest, 3, 2, 0, false},
                      PingPongCase{"mqa-headdim", 2, AttentionPartition::kRequest, 3, 3, 0, false},
                      PingPongCase{"llama2-mha", 2, AttentionPartition::kHead, 4, 3, 0, false},
                      // Rotational: n micro-batches on n - 1 compute ranks (the paper's layout),
                      // slices of one layer and of more, both partitions, 1-4 memory ranks.
                      PingPongCase{"llama3-gqa-tied", 1, AttentionPartition::kRequest, 3, 2, 1, false},
                      PingPongCase{"llama2-mha", 2, AttentionPartition::kRequest, 4, 3, 1, false},
                      PingPongCase{"mqa-headdim", 3, AttentionPartition::kRequest, 2, 2, 2, false},
                      PingPongCase{"llama2-mha", 4, AttentionPartition::kHead, 4, 3, 1, false},
                      PingPongCase{"llama3-gqa-tied", 2, AttentionPartition::kHead, 3, 2, 3, false},
                      // q-first (q, then k,v; attention over the context merged with the new rows'
                      // by log-sum-exp): without micro-batches, pingpong, fixed and rotational, both
                      // partitions, 1-3 memory ranks.
                      PingPongCase{"llama3-gqa-tied", 1, AttentionPartition::kRequest, 1, 1, 0, true},
                      PingPongCase{"llama2-mha", 2, AttentionPartition::kRequest, 2, 1, 0, true},
                      PingPongCase{"gqa-8x4", 2, AttentionPartition::kHead, 2, 1, 0, true},
                      PingPongCase{"mqa-headdim", 3, AttentionPartition::kRequest, 3, 2, 0, true},
                      PingPongCase{"llama2-mha", 2, AttentionPartition::kHead, 3, 2, 1, true},
                      PingPongCase{"llama3-gqa-tied", 3, AttentionPartition::kRequest, 3, 2, 2, true}),
    [](const auto& info) {
      const int slice = std::get<5>(info.param);
      return absl::StrCat(testing_names::Identifier(std::get<0>(info.param)), "_", std::get<4>(info.param),
                          "_compute_", std::get<1>(info.param), "_memory_",
                          AttentionPartitionName(std::get<2>(info.param)), "_", std::get<3>(info.param),
                          "_batches", slice > 0 ? absl::StrCat("_rotating_", slice) : "",
                          std::get<6>(info.param) ? "_q_first" : "");
    });

// Head partition with fewer KV heads than memory ranks: refused by Create, with both numbers,
// before anything connects (nothing listens at these addresses).
TEST_F(DisaggregatedTest, HeadPartitionRefusesFewerKvHeadsThanRanks) {
  std::unique_ptr<WeightSource> source = OpenReference("llama3-gqa-tied");  // 2 KV heads
  ASSERT_NE(source, nullptr);
  ComputeRankOptions o = Options(8, 24, 1024);
  o.partition = AttentionPartition::kHead;
  o.memory_addresses = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
  absl::StatusOr<std::unique_ptr<ComputeRank>> rank = ComputeRank::Create(*source, o);
  ASSERT_FALSE(rank.ok());
  EXPECT_EQ(rank.status().code(), absl::StatusCode::kInvalidArgument) << rank.status();
  EXPECT_EQ(
      rank.status().message(),
      "memory.partition: head needs a KV head per memory rank: num_key_value_heads (2) < memory.ranks (3)");
  o.memory_addresses.resize(4);
  o.memory_addresses[3] = "127.0.0.1:4";
  rank = ComputeRank::Create(*source, o);
  ASSERT_FALSE(rank.ok());
  EXPECT_EQ(
      rank.status().message(),
      "memory.partition: head needs a KV head per memory rank: num_key_value_heads (2) < memory.ranks (4)");
}

// ---------------------------------------------------------------------------------------------
// 4. The transformers reference through a deployment of two memory ranks.

struct HfCase {
  std::vector<int32_t> prompt, tokens;
  std::vector<double> logprobs, gaps;
};

std::vector<HfCase> LoadHfCases(const std::string& model) {
  std::ifstream in(ModelDir(model) + "/reference.json");
  EXPECT_TRUE(in.good()) << "missing " << ModelDir(model) << "/reference.json";
  if (!in.good()) return {};
  const nlohmann::json j = nlohmann::json::parse(in);
  std::vector<HfCase> cases;
  for (const auto& c : j.at("cases")) {
    cases.push_back(
        {c.at("prompt_ids").get<std::vector<int32_t>>(), c.at("token_ids").get<std::vector<int32_t>>(),
         c.at("logprobs").get<std::vector<double>>(), c.at("top2_gaps").get<std::vector<double>>()});
  }
  return cases;
}

class HfReferenceDeployed : public DisaggregatedTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(HfReferenceDeployed, GreedyTokensAndLogprobsMatchTransformers) {
  const std::string model = GetParam();
  std::unique_ptr<WeightSource> source = OpenReference(model);
  ASSERT_NE(source, nullptr);
  const std::vector<HfCase> cases = LoadHfCases(model);
  ASSERT_FALSE(cases.empty());
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 2, Options(8, 16, 2048)));
  std::vector<GenerationRequest> requests;
  for (const HfCase& c : cases) {
    GenerationRequest r;
    r.prompt = c.prompt;
    r.max_tokens = static_cast<int64_t>(c.tokens.size());
    r.ignore_eos = true;  // the reference does not stop at EOS
    requests.push_back(r);
  }
  absl::StatusOr<std::vector<GenerationResult>> results = rank_->GenerateAll(requests);
  ASSERT_TRUE(results.ok()) << results.status();
  int compared = 0, total = 0;
  double max_err = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const HfCase& c = cases[i];
    const GenerationResult& r = (*results)[i];
    ASSERT_EQ(r.token_ids.size(), c.tokens.size());
    total += static_cast<int>(c.tokens.size());
    for (size_t t = 0; t < c.tokens.size(); ++t) {
      if (c.gaps[t] < kHfGapFloor) break;  // near-tie: the continuation may legitimately differ
      ASSERT_EQ(r.token_ids[t], c.tokens[t]) << "prompt " << i << " position " << t;
      ASSERT_FALSE(std::isnan(r.logprobs[t]));
      EXPECT_NEAR(r.logprobs[t], c.logprobs[t], kHfLogprobTol) << "prompt " << i << " position " << t;
      max_err = std::max(max_err, std::fabs(r.logprobs[t] - c.logprobs[t]));
      ++compared;
    }
  }
  std::printf("%s, 2 memory ranks: %d of %d positions compared, max |logprob error| %.3g\n", model.c_str(),
              compared, total, max_err);
  EXPECT_GE(compared, total * 3 / 4);
}

INSTANTIATE_TEST_SUITE_P(Models, HfReferenceDeployed,
                         ::testing::Values("llama3-gqa-tied", "llama2-mha", "mqa-headdim"),
                         [](const auto& info) {
                           std::string s = info.param;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

// ---------------------------------------------------------------------------------------------
// 5. A memory rank killed mid-run fails the next steps, naming it, instead of hanging.

// With recovery (launch.recover_memory_ranks, the default): a memory rank killed mid-decode costs
// its requests a recomputation on the survivor, and every request gets the colocated engine's
// tokens, greedy and seeded sampling alike.
TEST_F(DisaggregatedTest, MemoryRankKilledMidRunIsRecovered) {
  std::unique_ptr<WeightSource> source = OpenReference("mqa-headdim");
  ASSERT_NE(source, nullptr);
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 2, Options(8, 24, 1024)));
  expect_clean_exit_ = false;  // memory-1 is gone
  std::mt19937 rng(11);
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r = MakeRequest(rng, source->spec().vocab_size, 8, 60, i % 2 == 1, 100 + i);
    r.ignore_eos = true;
    requests.push_back(r);
  }
  std::unique_ptr<ColocatedEngine> engine = Engine(*source, 8, 24);
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<std::vector<GenerationResult>> want = engine->GenerateAll(requests);
  ASSERT_TRUE(want.ok()) << want.status();
  for (const GenerationRequest& r : requests) ASSERT_TRUE(rank_->Submit(r).ok());
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  for (int step = 0; step < 6; ++step) ASSERT_TRUE(rank_->Step(&finished).ok()) << "step " << step;
  ASSERT_GT(rank_->controller().kv_reserved(1), 0);
  ASSERT_EQ(kill(group_.pid("memory-1"), SIGKILL), 0);
  const auto t0 = std::chrono::steady_clock::now();
  while (!rank_->Idle() && Seconds(t0) < 60) ASSERT_TRUE(rank_->Step(&finished).ok());
  ASSERT_TRUE(rank_->Idle());
  EXPECT_EQ(rank_->stats().memory_ranks_lost, 1);
  EXPECT_GT(rank_->stats().requests_recovered, 0);
  EXPECT_TRUE(rank_->controller().rank_lost(1));
  std::vector<GenerationResult> got(requests.size());
  for (auto& [id, result] : finished) got[static_cast<size_t>(id)] = std::move(result);
  ExpectSameResults(got, *want);
}

// After a loss, requests whose context fits no surviving rank end with an error (Unavailable,
// naming the surviving capacity) instead of waiting at the head of the queue forever, and the
// request behind them that fits runs to the end with the colocated engine's tokens. The ranks'
// capacities differ: each sizes its KV from its share of host memory, rank 1 a quarter of rank 0's.
TEST_F(DisaggregatedTest, RequestsThatFitNoSurvivingRankFailInsteadOfWaiting) {
  std::unique_ptr<WeightSource> source = OpenReference("mqa-headdim");
  ASSERT_NE(source, nullptr);
  ComputeRankOptions options = Options(2, 24, 0);
  const int64_t per_token = source->spec().kv_bytes_per_token(sizeof(float));
  options.kv_memory_fraction =
      240.0 * static_cast<double>(per_token) / static_cast<double>(AvailableHostBytes());
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 2, options, {1, 4}));
  expect_clean_exit_ = false;  // memory-0 is gone
  const int64_t big = rank_->controller().kv_capacity(0), small = rank_->controller().kv_capacity(1);
  std::printf("KV capacities: memory rank 0 %lld, memory rank 1 %lld tokens\n", static_cast<long long>(big),
              static_cast<long long>(small));
  // Two requests that only rank 0 can hold, one at a time (the second waits at the head of the
  // queue for the first's KV), and one that fits either rank, waiting behind them.
  const int64_t only_big = big / 2 + 10;
  ASSERT_GT(small, 40);
  ASSERT_GT(only_big, small);
  std::mt19937 rng(5);
  std::vector<GenerationRequest> requests;
  for (int64_t need : {only_big, only_big, int64_t{40}}) {
    GenerationRequest r = MakeRequest(rng, source->spec().vocab_size, 8, need - 8, false, 0);
    r.ignore_eos = true;
    requests.push_back(r);
  }
  std::unique_ptr<ColocatedEngine> engine = Engine(*source, 2, 24);
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<std::vector<GenerationResult>> want = engine->GenerateAll({requests[2]});
  ASSERT_TRUE(want.ok()) << want.status();
  for (const GenerationRequest& r : requests) ASSERT_TRUE(rank_->Submit(r).ok());
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  for (int step = 0; step < 4; ++step) ASSERT_TRUE(rank_->Step(&finished).ok()) << "step " << step;
  ASSERT_EQ(rank_->controller().num_running(), 1);
  ASSERT_EQ(rank_->controller().num_waiting(), 2);  // held back by the second
  ASSERT_EQ(kill(group_.pid("memory-0"), SIGKILL), 0);
  const auto t0 = std::chrono::steady_clock::now();
  while (!rank_->Idle() && Seconds(t0) < 60) ASSERT_TRUE(rank_->Step(&finished).ok());
  ASSERT_TRUE(rank_->Idle()) << "requests still wait " << Seconds(t0) << " s after the loss";
  ASSERT_EQ(finished.size(), 3u);
  std::vector<GenerationResult> got(requests.size());
  for (auto& [id, result] : finished) got[static_cast<size_t>(id)] = std::move(result);
  for (int i : {0, 1}) {
    EXPECT_EQ(got[i].finish_reason, "error") << "request " << i;
    EXPECT_EQ(got[i].error.code(), absl::StatusCode::kUnavailable) << got[i].error;
    EXPECT_NE(
        got[i].error.message().find(absl::StrCat("largest surviving memory rank holds ", small, " tokens")),
        std::string::npos)
        << got[i].error;
  }
  EXPECT_GT(got[0].token_ids.size(), 0u);  // it had run on memory rank 0
  EXPECT_TRUE(got[2].error.ok()) << got[2].error;
  ExpectSameResults({got[2]}, *want);
  // A new request of that size is refused at once, naming the loss.
  const absl::Status refused = rank_->Check(requests[0]);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("memory rank(s) 0 lost"), std::string::npos) << refused;
}

// Heartbeats while idle (ComputeRank::Heartbeat, as the server's engine loop calls it): a memory
// rank stopped between requests is named by its own unanswered heartbeat, never its healthy
// neighbour; with recovery the next request runs on the survivor with the colocated tokens,
// without it Heartbeat fails naming the rank.
TEST_F(DisaggregatedTest, HeartbeatsNameAMemoryRankStoppedWhileIdle) {
  std::unique_ptr<WeightSource> source = OpenReference("mqa-headdim");
  ASSERT_NE(source, nullptr);
  std::mt19937 rng(3);
  GenerationRequest request = MakeRequest(rng, source->spec().vocab_size, 8, 12, true, 42);
  std::unique_ptr<ColocatedEngine> engine = Engine(*source, 4, 24);
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<std::vector<GenerationResult>> want = engine->GenerateAll({request});
  ASSERT_TRUE(want.ok()) << want.status();
  for (const bool recover : {true, false}) {
    SCOPED_TRACE(recover ? "recovery on" : "recovery off");
    ComputeRankOptions options = Options(4, 24, 1024);
    options.step_timeout = absl::Seconds(1);
    options.heartbeat = absl::Milliseconds(100);
    options.recover_memory_ranks = recover;
    ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 2, options));
    expect_clean_exit_ = false;  // memory-1 is stopped
    EXPECT_EQ(rank_->heartbeat_interval(), absl::Milliseconds(100));
    // Healthy ranks answer: a few rounds lose nothing.
    for (int i = 0; i < 10; ++i) {
      ASSERT_TRUE(rank_->Heartbeat().ok());
      absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_EQ(rank_->stats().memory_ranks_lost, 0);
    const pid_t victim = group_.pid(names_[names_.size() - 1]);
    ASSERT_EQ(kill(victim, SIGSTOP), 0);
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status beat;
    while (beat.ok() && !rank_->controller().rank_lost(1) && Seconds(t0) < 10) {
      beat = rank_->Heartbeat();
      absl::SleepFor(absl::Milliseconds(100));
    }
    const double seconds = Seconds(t0);
    std::printf("%s: memory rank 1 stopped, found after %.2f s: %s\n", recover ? "recovery" : "no recovery",
                seconds, beat.ToString().c_str());
    EXPECT_LT(seconds, 5.0) << "the step timeout is 1 s";
    EXPECT_FALSE(rank_->controller().rank_lost(0));
    if (recover) {
      ASSERT_TRUE(beat.ok()) << beat;
      ASSERT_TRUE(rank_->controller().rank_lost(1));
      absl::StatusOr<std::vector<GenerationResult>> got = rank_->GenerateAll({request});
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectSameResults(*got, *want);
      EXPECT_TRUE(rank_->Heartbeat().ok());
    } else {
      ASSERT_FALSE(beat.ok());
      const std::string message(beat.message());
      EXPECT_NE(message.find("memory rank 1 (" + addresses_[1] + "): no answer to a heartbeat"),
                std::string::npos)
          << beat;
      EXPECT_EQ(message.find("memory rank 0"), std::string::npos) << beat;
    }
    kill(victim, SIGKILL);
    rank_.reset();
    (void)group_.StopAll(absl::Seconds(5));
  }
}

// Under the head partition every rank holds a slice of every request: a memory rank killed or
// stopped mid-run is given up, the survivors split the KV heads again (slices that may differ by
// one head: 4 KV heads over 3 survivors are 1, 1 and 2) and every request in flight is recomputed,
// ending with the colocated engine's tokens; their capacities and names say the new slices. Also
// with two micro-batches in flight (pipeline.mode pingpong) and q first (pipeline.q_first), and with
// compute replicas (pipeline.mode fixed): the step in flight is dropped on every rank (a step
// discard) and the replicas take the new slices (a head split) and go on sampling micro-batches;
// with a second rank killed at once, found in the same step or during the split (then given up
// with a step discard of no step, so that the replicas let it go too).
struct HeadLossCase {
  std::string model;
  int ranks;
  int victim;
  bool stop;              // SIGSTOP instead of SIGKILL (found by the step deadline)
  bool pipelined;         // two micro-batches, q first
  int compute_ranks = 1;  // > 1: compute.ranks - 1 replicas, one micro-batch per compute rank
  int victim2 = -1;       // >= 0: killed right after the victim (found in the same step or the split)
};

class HeadPartitionLoss : public DisaggregatedTest, public ::testing::WithParamInterface<HeadLossCase> {};

TEST_P(HeadPartitionLoss, SurvivorsSplitTheHeadsAndEveryRequestIsRecomputed) {
  const HeadLossCase& c = GetParam();
  std::unique_ptr<WeightSource> source = OpenHeadModel(c.model);
  ASSERT_NE(source, nullptr);
  const int64_t kv_heads = source->spec().num_kv_heads;
  ComputeRankOptions o = Options(8, 24, 1024);
  o.partition = AttentionPartition::kHead;
  if (c.stop) o.step_timeout = absl::Seconds(2);
  if (c.pipelined) o.micro_batches = 2, o.q_first = true;
  if (c.compute_ranks > 1) {
    o.micro_batches = c.compute_ranks;
    std::ofstream(dir_ + "/deploy.yaml")
        << "launch:\n  startup_timeout_s: 60\n  step_timeout_s: " << absl::ToInt64Seconds(o.step_timeout)
        << "\n";
    ASSERT_NO_FATAL_FAILURE(StartMemoryRanks(c.ranks));
    ASSERT_NO_FATAL_FAILURE(StartReplicas(c.model, c.compute_ranks, o, &o.replica_addresses));
    o.memory_addresses = addresses_;
    absl::StatusOr<std::unique_ptr<ComputeRank>> rank = ComputeRank::Create(*source, o);
    ASSERT_TRUE(rank.ok()) << rank.status();
    rank_ = std::move(*rank);
  } else {
    ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, c.ranks, o));
  }
  expect_clean_exit_ = false;  // the victim is gone (or stopped)
  std::mt19937 rng(23);
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r = MakeRequest(rng, source->spec().vocab_size, 6 + 3 * i, 40, i % 2 == 1, 300 + i);
    r.ignore_eos = true;
    requests.push_back(r);
  }
  std::unique_ptr<ColocatedEngine> engine = Engine(*source, 8, 24);
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<std::vector<GenerationResult>> want = engine->GenerateAll(requests);
  ASSERT_TRUE(want.ok()) << want.status();
  for (const GenerationRequest& r : requests) ASSERT_TRUE(rank_->Submit(r).ok());
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  for (int step = 0; step < 6; ++step) ASSERT_TRUE(rank_->Step(&finished).ok()) << "step " << step;
  ASSERT_GT(rank_->controller().num_running(), 0);
  const int64_t sampled_before = rank_->stats().replica_micro_batches;
  const std::string victim = absl::StrCat("memory-", c.victim);
  ASSERT_EQ(kill(group_.pid(victim), c.stop ? SIGSTOP : SIGKILL), 0);
  if (c.victim2 >= 0) {
    ASSERT_EQ(kill(group_.pid(absl::StrCat("memory-", c.victim2)), SIGKILL), 0);
  }
  const int lost = c.victim2 >= 0 ? 2 : 1;
  const auto t0 = std::chrono::steady_clock::now();
  int64_t sampled_at_loss = -1;  // the replicas' micro-batches once the heads were split again
  while (!rank_->Idle() && Seconds(t0) < 60) {
    ASSERT_TRUE(rank_->Step(&finished).ok());
    if (sampled_at_loss < 0 && rank_->stats().memory_ranks_lost > 0)
      sampled_at_loss = rank_->stats().replica_micro_batches;
  }
  ASSERT_TRUE(rank_->Idle());
  std::printf("%s, %d memory ranks%s%s, memory rank %d%s %s: every request done %.2f s after it\n",
              c.model.c_str(), c.ranks, c.pipelined ? " (pingpong, q first)" : "",
              c.compute_ranks > 1 ? absl::StrCat(", ", c.compute_ranks, " compute ranks").c_str() : "",
              c.victim, c.victim2 >= 0 ? absl::StrCat(" and ", c.victim2).c_str() : "",
              c.stop ? "stopped" : "killed", Seconds(t0));
  if (c.stop) kill(group_.pid(victim), SIGKILL);
  EXPECT_EQ(rank_->stats().memory_ranks_lost, lost);
  if (c.compute_ranks > 1) {
    // Every replica kept, and sampling micro-batches over the new slices.
    const EngineStats es = rank_->stats();
    EXPECT_EQ(es.compute_ranks_live, c.compute_ranks);
    EXPECT_EQ(es.compute_ranks_lost, 0);
    EXPECT_GT(sampled_before, 0);
    ASSERT_GE(sampled_at_loss, 0);
    EXPECT_GT(es.replica_micro_batches, sampled_at_loss) << "no replica ran a micro-batch after the split";
    for (int r = 1; r < c.compute_ranks; ++r) {
      const std::string log = group_.LogTail(absl::StrCat("compute-", r), 200);
      EXPECT_NE(log.find(absl::StrCat("the KV heads over ", c.ranks - lost, " memory rank(s)")),
                std::string::npos)
          << "compute-" << r << "'s log does not say it took the head split:\n"
          << log;
    }
  }
  EXPECT_GE(rank_->stats().requests_recovered, static_cast<int64_t>(requests.size()) - 1);
  // The survivors' new slices tile the heads in rank order; the lost rank holds nothing.
  const std::vector<KvUsage> usage = rank_->kv_usage();
  ASSERT_EQ(usage.size(), static_cast<size_t>(c.ranks));
  int64_t next = 0, slice = 0;
  const int64_t survivors = c.ranks - lost;
  for (int m = 0; m < c.ranks; ++m) {
    const std::string& name = rank_->memory_ranks()[static_cast<size_t>(m)];
    if (m == c.victim || m == c.victim2) {
      EXPECT_EQ(usage[static_cast<size_t>(m)].capacity, 0);
      continue;
    }
    const int64_t end = (slice + 1) * kv_heads / survivors;
    EXPECT_NE(name.find(absl::StrCat("1024 KV tokens of KV heads [", next, ", ", end, ")")),
              std::string::npos)
        << name;
    EXPECT_EQ(usage[static_cast<size_t>(m)].capacity, 1024);
    next = end, ++slice;
  }
  EXPECT_EQ(next, kv_heads);
  std::vector<GenerationResult> got(requests.size());
  for (auto& [id, result] : finished) got[static_cast<size_t>(id)] = std::move(result);
  ExpectSameResults(got, *want);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, HeadPartitionLoss,
    ::testing::Values(HeadLossCase{"gqa-8x4", 4, 1, false, false},
                      HeadLossCase{"llama2-mha", 2, 0, false, false},
                      HeadLossCase{"gqa-8x4", 4, 3, true, false}, HeadLossCase{"gqa-8x4", 4, 2, false, true},
                      HeadLossCase{"llama2-mha", 3, 1, false, false, 2},
                      HeadLossCase{"llama2-mha", 4, 3, true, false, 3},
                      HeadLossCase{"llama2-mha", 4, 1, false, false, 2, 3}),
    [](const auto& info) {
      return absl::StrCat(
          testing_names::Identifier(info.param.model), "_", info.param.ranks, "_ranks_",
          info.param.stop ? "stop" : "kill", "_rank_", info.param.victim,
          info.param.pipelined ? "_pingpong_q_first" : "",
          info.param.victim2 >= 0 ? absl::StrCat("_and_", info.param.victim2) : "",
          info.param.compute_ranks > 1 ? absl::StrCat("_", info.param.compute_ranks, "_compute_ranks") : "");
    });

// Without recovery the loss fails the step, naming the rank, within the step timeout.
TEST_F(DisaggregatedTest, MemoryRankKilledMidRunFailsTheStepWithoutRecovery) {
  std::unique_ptr<WeightSource> source = OpenReference("mqa-headdim");
  ASSERT_NE(source, nullptr);
  ComputeRankOptions options = Options(8, 24, 1024);
  options.recover_memory_ranks = false;
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 2, options));
  expect_clean_exit_ = false;  // the survivor may be stuck in a step; TearDown stops it
  std::mt19937 rng(11);
  for (int i = 0; i < 4; ++i) {
    GenerationRequest r = MakeRequest(rng, source->spec().vocab_size, 8, 200, false, 0);
    r.ignore_eos = true;
    ASSERT_TRUE(rank_->Submit(r).ok());
  }
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  for (int step = 0; step < 4; ++step) ASSERT_TRUE(rank_->Step(&finished).ok()) << "step " << step;
  ASSERT_GT(rank_->controller().kv_reserved(0), 0);
  ASSERT_GT(rank_->controller().kv_reserved(1), 0);
  ASSERT_TRUE(finished.empty());

  ASSERT_EQ(kill(group_.pid("memory-1"), SIGKILL), 0);
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status st;
  int steps = 0;
  while (st.ok() && Seconds(t0) < 60 && steps < 1000) {
    st = rank_->Step(&finished);
    ++steps;
  }
  const double seconds = Seconds(t0);
  std::printf("failed after %d step(s), %.2f s: %s\n", steps, seconds, st.ToString().c_str());
  ASSERT_FALSE(st.ok()) << "steps kept succeeding after memory rank 1 was killed";
  EXPECT_LT(seconds, 25.0) << "took longer than the step timeout (20 s) to notice";
  const std::string message(st.message());
  EXPECT_NE(message.find("memory rank 1"), std::string::npos) << st;
  EXPECT_NE(message.find(addresses_[1]), std::string::npos) << st;
  // It stays failed; nothing hangs.
  const auto t1 = std::chrono::steady_clock::now();
  EXPECT_FALSE(rank_->Step(&finished).ok());
  EXPECT_LT(Seconds(t1), 25.0);
}

// A compute replica killed mid-run: with recovery off the step fails within the step timeout,
// naming it; with recovery (the default) the step runs again on the surviving compute ranks, and
// every request ends with the colocated engine's tokens.
class ReplicaFailure : public PingPong {};

// Compute rank 0 with `compute_ranks` - 1 replicas (rotational with `slice_layers` > 0, else
// fixed) and `memory_ranks` memory ranks runs 6 requests for 4 steps; then `victim` is killed (or
// stopped: `sig` SIGSTOP, found silent after a step deadline of `step_timeout_s`) while 6 more
// requests arrive, one every other step, and every request must end with the colocated engine's
// tokens. The replicas that were not lost are kept, in both modes (under rotational the ring closes
// over a lost replica: its neighbours are connected to each other): each still runs, says in its
// log that it was kept, and the replicas still sample micro-batches after the loss.
struct KillCase {
  int compute_ranks = 3, memory_ranks = 2, slice_layers = 0;
  std::string victim;
  int sig = SIGKILL;
  int step_timeout_s = 20;
  std::vector<std::pair<std::string, std::string>> logs;  // (rank, what its log must say)
};

class RankLossWithReplicas : public ReplicaFailure {
 protected:
  void Run(const KillCase& c) {
    std::unique_ptr<WeightSource> source = OpenReference("mqa-headdim");
    ASSERT_NE(source, nullptr);
    ComputeRankOptions o = Options(8, 24, 1024);
    o.micro_batches = c.compute_ranks;
    o.slice_layers = c.slice_layers;
    o.step_timeout = absl::Seconds(c.step_timeout_s);
    std::ofstream(dir_ + "/deploy.yaml")
        << "launch:\n  startup_timeout_s: 60\n  step_timeout_s: " << c.step_timeout_s << "\n";
    ASSERT_NO_FATAL_FAILURE(StartMemoryRanks(c.memory_ranks));
    ASSERT_NO_FATAL_FAILURE(StartReplicas("mqa-headdim", c.compute_ranks, o, &o.replica_addresses));
    o.memory_addresses = addresses_;
    std::mt19937 rng(12);
    std::vector<GenerationRequest> requests;
    for (int i = 0; i < 12; ++i) {
      requests.push_back(MakeRequest(rng, source->spec().vocab_size, 8, 30, i % 2 == 1, 50 + i));
      requests.back().ignore_eos = true;
    }
    std::unique_ptr<ColocatedEngine> engine = Engine(*source, 8, 24);
    ASSERT_NE(engine, nullptr);
    absl::StatusOr<std::vector<GenerationResult>> want = engine->GenerateAll(requests);
    ASSERT_TRUE(want.ok()) << want.status();
    absl::StatusOr<std::unique_ptr<ComputeRank>> rank = ComputeRank::Create(*source, o);
    ASSERT_TRUE(rank.ok()) << rank.status();
    rank_ = std::move(*rank);
    expect_clean_exit_ = false;  // the killed rank
    EXPECT_EQ(rank_->stats().compute_ranks_live, c.compute_ranks);
    std::vector<int64_t> ids;
    auto submit = [&](size_t i) {
      absl::StatusOr<int64_t> id = rank_->Submit(requests[i]);
      ASSERT_TRUE(id.ok()) << id.status();
      ids.push_back(*id);
    };
    for (size_t i = 0; i < 6; ++i) ASSERT_NO_FATAL_FAILURE(submit(i));
    std::vector<std::pair<int64_t, GenerationResult>> finished;
    for (int step = 0; step < 4; ++step) ASSERT_TRUE(rank_->Step(&finished).ok()) << "step " << step;
    const bool replica = c.victim.starts_with("compute-");
    if (!replica) {
      ASSERT_GT(rank_->controller().kv_reserved(1), 0);  // requests to recover
    }
    const int64_t sampled_before = rank_->stats().replica_micro_batches;
    EXPECT_GT(sampled_before, 0);
    group_.Tolerate(c.victim);
    const pid_t victim = group_.pid(c.victim);
    ASSERT_EQ(kill(victim, c.sig), 0);
    const auto t0 = std::chrono::steady_clock::now();
    size_t next = 6;
    int64_t sampled_at_loss = -1;  // the replicas' micro-batches when the loss was recovered
    double recovered_s = -1;       // when the step that lost the rank came back, rerun
    for (int step = 0; (!rank_->Idle() || next < requests.size()) && Seconds(t0) < 60; ++step) {
      if (step % 2 == 0 && next < requests.size()) {
        ASSERT_NO_FATAL_FAILURE(submit(next++));
      }
      const absl::Status st = rank_->Step(&finished);
      ASSERT_TRUE(st.ok()) << st;
      const EngineStats es = rank_->stats();
      if (sampled_at_loss < 0 && es.steps_rerun > 0) {
        sampled_at_loss = es.replica_micro_batches;
        recovered_s = Seconds(t0);
      }
    }
    if (c.sig == SIGSTOP) kill(victim, SIGKILL);  // stopped: nothing more to learn from it
    ASSERT_TRUE(rank_->Idle());
    ASSERT_EQ(next, requests.size());
    const EngineStats es = rank_->stats();
    if (!replica) {
      EXPECT_GT(es.requests_recovered, 0);
    }
    EXPECT_EQ(es.compute_ranks_lost, replica ? 1 : 0);
    EXPECT_EQ(es.memory_ranks_lost, replica ? 0 : 1);
    EXPECT_GE(es.steps_rerun, 1);
    std::vector<GenerationResult> got(ids.size());
    for (auto& [id, result] : finished) {
      got[static_cast<size_t>(std::find(ids.begin(), ids.end(), id) - ids.begin())] = std::move(result);
    }
    const int others = c.compute_ranks - 1 - (replica ? 1 : 0);
    std::printf(
        "%s %s (%d compute ranks, %s, %d memory ranks): step rerun %.2f s after the signal, %.2f s to the "
        "end, %lld step(s) rerun, %d replica(s) kept, replica micro-batches %lld before, %lld at the loss, "
        "%lld at the end, max |logprob difference| %.3g\n",
        c.victim.c_str(), c.sig == SIGSTOP ? "stopped" : "killed", c.compute_ranks,
        c.slice_layers > 0 ? "rotational" : "fixed", c.memory_ranks, recovered_s, Seconds(t0),
        static_cast<long long>(es.steps_rerun), others, static_cast<long long>(sampled_before),
        static_cast<long long>(sampled_at_loss), static_cast<long long>(es.replica_micro_batches),
        ExpectSameResults(got, *want));
    // The others go on: compute rank 0 counts them live and kept, they still sample micro-batches
    // after the loss, and their processes still run.
    EXPECT_EQ(es.compute_ranks_live, 1 + others);
    EXPECT_GE(es.compute_replicas_kept, others);
    if (others > 0) {
      ASSERT_GE(sampled_at_loss, 0);
      EXPECT_GT(es.replica_micro_batches, sampled_at_loss) << "no replica ran a micro-batch after the loss";
    }
    for (int r = 1; r < c.compute_ranks; ++r) {
      const std::string name = absl::StrCat("compute-", r);
      if (name == c.victim) continue;
      EXPECT_FALSE(group_.WaitExit(name, absl::Milliseconds(200)).ok()) << name << " exited after the loss";
      EXPECT_EQ(kill(group_.pid(name), 0), 0) << name;
      if (replica) {
        EXPECT_NE(group_.LogTail(name, 200).find("kept by compute rank 0"), std::string::npos)
            << name << "'s log does not say it was kept";
      }
    }
    for (const auto& [name, text] : c.logs) {
      EXPECT_NE(group_.LogTail(name, 200).find(text), std::string::npos)
          << name << "'s log does not say " << text;
    }
  }
};

TEST_F(RankLossWithReplicas, KilledReplicaStepIsRerunWithTheSameTokens) {
  Run({.compute_ranks = 2, .memory_ranks = 2, .slice_layers = 0, .victim = "compute-1"});
}

// pipeline.mode fixed, 3 compute ranks: either replica killed; the other goes on as the pipeline's
// compute rank 1 of 2 and takes over micro-batches.
TEST_F(RankLossWithReplicas, KilledReplicaAmongSeveralFixedKeepsTheOther) {
  Run({.compute_ranks = 3, .memory_ranks = 2, .slice_layers = 0, .victim = "compute-2"});
}

TEST_F(RankLossWithReplicas, KilledFirstReplicaAmongSeveralFixedKeepsTheOther) {
  Run({.compute_ranks = 3, .memory_ranks = 2, .slice_layers = 0, .victim = "compute-1"});
}

// pipeline.mode rotational: the ring closes over the lost replica. With 3 compute ranks one of
// its neighbours is compute rank 0, which hands residual streams to (compute-1 lost) or takes them
// from (compute-2 lost) the other replica over the connection it has; with 4, compute-2's loss
// makes compute rank 1 connect to compute rank 3 (a replica ring message after the discard).
TEST_F(RankLossWithReplicas, KilledReplicaAmongSeveralRotationalKeepsTheOther) {
  Run({.compute_ranks = 3, .memory_ranks = 2, .slice_layers = 1, .victim = "compute-1"});
}

TEST_F(RankLossWithReplicas, KilledLastReplicaRotationalKeepsTheOther) {
  Run({.compute_ranks = 3, .memory_ranks = 2, .slice_layers = 1, .victim = "compute-2"});
}

TEST_F(RankLossWithReplicas, StoppedReplicaRotationalKeepsTheOther) {
  Run({.compute_ranks = 3,
       .memory_ranks = 2,
       .slice_layers = 1,
       .victim = "compute-1",
       .sig = SIGSTOP,
       .step_timeout_s = 2});
}

TEST_F(RankLossWithReplicas, KilledMiddleReplicaOfFourRotationalReconnectsTheRing) {
  Run({.compute_ranks = 4,
       .memory_ranks = 1,
       .slice_layers = 1,
       .victim = "compute-2",
       .logs = {{"compute-1", "ring: from compute rank 0 to compute rank 3 ("},
                {"compute-3", "ring: from compute rank 1 to compute rank 0"}}});
}

TEST_F(RankLossWithReplicas, StoppedMiddleReplicaOfFourRotationalReconnectsTheRing) {
  Run({.compute_ranks = 4,
       .memory_ranks = 1,
       .slice_layers = 1,
       .victim = "compute-2",
       .sig = SIGSTOP,
       .step_timeout_s = 2,
       .logs = {{"compute-1", "ring: from compute rank 0 to compute rank 3 ("},
                {"compute-3", "ring: from compute rank 1 to compute rank 0"}}});
}

// A memory rank lost while replicas run: compute rank 0 gives it up, the step is discarded and
// runs again on the same compute ranks without it (the discard names it), and its requests are
// recomputed on the survivor.
TEST_F(RankLossWithReplicas, KilledMemoryRankWithAReplicaIsRecovered) {
  Run({.compute_ranks = 2, .memory_ranks = 2, .slice_layers = 0, .victim = "memory-1"});
}

TEST_F(RankLossWithReplicas, KilledMemoryRankWithTwoReplicasKeepsThem) {
  Run({.compute_ranks = 3, .memory_ranks = 2, .slice_layers = 0, .victim = "memory-1"});
}

TEST_F(RankLossWithReplicas, KilledMemoryRankWithRotationalReplicasKeepsThem) {
  Run({.compute_ranks = 3, .memory_ranks = 2, .slice_layers = 1, .victim = "memory-1"});
}

// A memory rank stopped (SIGSTOP) while a replica runs, where compute rank 0 never waits on it
// itself: request A (long) is placed on memory rank 0, B (short) on memory rank 1, so each step's
// micro-batch 0 (compute rank 0's, the heavier part) has rows on rank 0 only and micro-batch 1 (the
// replica's) on rank 1 only. Compute rank 0's wait for the replica's result passes its deadline;
// every replica answers a heartbeat, and so does memory rank 0, from its wait: memory rank 1, which
// does not, is given up (never rank 0), the step runs again without it, and both requests end with
// the colocated engine's tokens. Without that recovery the step fails naming memory rank 1.
// The memory ranks and the replica run with a 2 s step timeout.
class SilentMemoryRankWithReplica : public ReplicaFailure {
 protected:
  void Run(bool recover) {
    std::unique_ptr<WeightSource> source = OpenReference("mqa-headdim");
    ASSERT_NE(source, nullptr);
    std::mt19937 rng(21);
    std::vector<GenerationRequest> requests = {MakeRequest(rng, source->spec().vocab_size, 16, 24, false, 0),
                                               MakeRequest(rng, source->spec().vocab_size, 3, 24, true, 77)};
    for (GenerationRequest& r : requests) r.ignore_eos = true;
    std::unique_ptr<ColocatedEngine> engine = Engine(*source, 8, 24);
    ASSERT_NE(engine, nullptr);
    absl::StatusOr<std::vector<GenerationResult>> want = engine->GenerateAll(requests);
    ASSERT_TRUE(want.ok()) << want.status();
    constexpr int kStepTimeoutS = 2;
    std::ofstream(dir_ + "/deploy.yaml")
        << "launch:\n  startup_timeout_s: 60\n  step_timeout_s: " << kStepTimeoutS << "\n";
    ComputeRankOptions o = Options(8, 24, 1024);
    o.micro_batches = 2;
    o.step_timeout = absl::Seconds(kStepTimeoutS);
    o.recover_memory_ranks = recover;
    ASSERT_NO_FATAL_FAILURE(StartMemoryRanks(2));
    ASSERT_NO_FATAL_FAILURE(StartReplicas("mqa-headdim", 2, o, &o.replica_addresses));
    o.memory_addresses = addresses_;
    absl::StatusOr<std::unique_ptr<ComputeRank>> rank = ComputeRank::Create(*source, o);
    ASSERT_TRUE(rank.ok()) << rank.status();
    rank_ = std::move(*rank);
    expect_clean_exit_ = false;  // the stopped rank
    std::vector<int64_t> ids;
    for (const GenerationRequest& r : requests) {
      absl::StatusOr<int64_t> id = rank_->Submit(r);
      ASSERT_TRUE(id.ok()) << id.status();
      ids.push_back(*id);
    }
    std::vector<std::pair<int64_t, GenerationResult>> finished;
    for (int step = 0; step < 3; ++step) ASSERT_TRUE(rank_->Step(&finished).ok()) << "step " << step;
    // A on memory rank 0, B on memory rank 1: the replica's micro-batch is the only one there.
    ASSERT_GT(rank_->controller().kv_reserved(0), rank_->controller().kv_reserved(1));
    ASSERT_GT(rank_->controller().kv_reserved(1), 0);
    ASSERT_GT(rank_->stats().replica_micro_batches, 0);
    const pid_t victim = group_.pid(names_[names_.size() - 1]);
    ASSERT_EQ(kill(victim, SIGSTOP), 0);
    const auto t0 = std::chrono::steady_clock::now();
    const absl::Status st = rank_->Step(&finished);
    const double found = Seconds(t0);
    std::printf("%s: memory rank 1 stopped, step back after %.2f s: %s\n",
                recover ? "recovery" : "no recovery", found, st.ToString().c_str());
    // The step's deadline (2 s) and a quarter of it for the heartbeats; the rest is slack.
    EXPECT_LT(found, 4.0 * kStepTimeoutS + 5);
    EXPECT_FALSE(rank_->controller().rank_lost(0));
    if (recover) {
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(rank_->controller().rank_lost(1));
      for (int step = 0; !rank_->Idle() && Seconds(t0) < 60; ++step) {
        const absl::Status more = rank_->Step(&finished);
        ASSERT_TRUE(more.ok()) << more;
      }
      ASSERT_TRUE(rank_->Idle());
      const EngineStats es = rank_->stats();
      EXPECT_EQ(es.memory_ranks_lost, 1);
      EXPECT_EQ(es.compute_ranks_lost, 0);
      EXPECT_GE(es.steps_rerun, 1);
      EXPECT_GE(es.requests_recovered, 1);
      EXPECT_EQ(es.compute_ranks_live, 2);
      std::vector<GenerationResult> got(ids.size());
      for (auto& [id, result] : finished) {
        got[static_cast<size_t>(std::find(ids.begin(), ids.end(), id) - ids.begin())] = std::move(result);
      }
      ExpectSameResults(got, *want);
    } else {
      ASSERT_FALSE(st.ok());
      const std::string message(st.message());
      EXPECT_NE(message.find("memory rank 1 (" + addresses_[1] + "): no answer to a heartbeat"),
                std::string::npos)
          << st;
      EXPECT_EQ(message.find("memory rank 0"), std::string::npos) << st;
    }
    kill(victim, SIGKILL);
  }
};

TEST_F(SilentMemoryRankWithReplica, FoundByItsHeartbeatAndRecovered) { Run(true); }

TEST_F(SilentMemoryRankWithReplica, NamedWithoutRecovery) { Run(false); }

TEST_F(ReplicaFailure, KilledReplicaFailsTheStepNamingIt) {
  std::unique_ptr<WeightSource> source = OpenReference("mqa-headdim");
  ASSERT_NE(source, nullptr);
  ComputeRankOptions o = Options(8, 24, 1024);
  o.micro_batches = 2;
  o.recover_compute_replicas = false;
  ASSERT_NO_FATAL_FAILURE(StartMemoryRanks(1));
  ASSERT_NO_FATAL_FAILURE(StartReplicas("mqa-headdim", 2, o, &o.replica_addresses));
  o.memory_addresses = addresses_;
  absl::StatusOr<std::unique_ptr<ComputeRank>> rank = ComputeRank::Create(*source, o);
  ASSERT_TRUE(rank.ok()) << rank.status();
  rank_ = std::move(*rank);
  expect_clean_exit_ = false;  // the memory rank may be stuck waiting for the replica's rows
  std::mt19937 rng(12);
  for (int i = 0; i < 4; ++i) {
    GenerationRequest r = MakeRequest(rng, source->spec().vocab_size, 8, 200, false, 0);
    r.ignore_eos = true;
    ASSERT_TRUE(rank_->Submit(r).ok());
  }
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  for (int step = 0; step < 4; ++step) ASSERT_TRUE(rank_->Step(&finished).ok()) << "step " << step;
  ASSERT_EQ(kill(group_.pid("compute-1"), SIGKILL), 0);
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status st;
  int steps = 0;
  while (st.ok() && Seconds(t0) < 60 && steps < 1000) {
    st = rank_->Step(&finished);
    ++steps;
  }
  std::printf("failed after %d step(s), %.2f s: %s\n", steps, Seconds(t0), st.ToString().c_str());
  ASSERT_FALSE(st.ok()) << "steps kept succeeding after compute rank 1 was killed";
  EXPECT_LT(Seconds(t0), 25.0) << "took longer than the step timeout (20 s) to notice";
  EXPECT_NE(std::string(st.message()).find("compute rank 1"), std::string::npos) << st;
}

// ---------------------------------------------------------------------------------------------
// 6. A memory-rank address where nothing listens fails Create within the startup timeout.

TEST_F(DisaggregatedTest, NothingListeningFailsCreateWithinTheStartupTimeout) {
  std::unique_ptr<WeightSource> source = OpenReference("mqa-headdim");
  ASSERT_NE(source, nullptr);
  ComputeRankOptions o = Options(8, 24, 1024);
  o.memory_addresses = {"127.0.0.1:1"};
  o.startup_timeout = absl::Seconds(5);
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<ComputeRank>> rank = ComputeRank::Create(*source, o);
  const double seconds = Seconds(t0);
  std::printf("Create failed after %.2f s: %s\n", seconds, rank.status().ToString().c_str());
  ASSERT_FALSE(rank.ok());
  EXPECT_LT(seconds, 15.0);
  EXPECT_NE(rank.status().message().find("127.0.0.1:1"), std::string::npos) << rank.status();
}

// ---------------------------------------------------------------------------------------------
// KV tiers on the memory ranks (kv.tiers.*): conversations whose turns outgrow the ranks' pools
// get the colocated engine's tokens, with evicted blocks restored from the host tier, and with the
// disk tier's files damaged mid-run (restores fail, the tokens are recomputed).

// Four conversations, each turn the history plus 11 new tokens, 6 answered (greedy, EOS ignored),
// one request at a time. Turns continue where the last call stopped; Reset starts them over.
struct TierConversations {
  int64_t vocab = 0;
  std::vector<std::vector<int32_t>> history = std::vector<std::vector<int32_t>>(4);
  std::mt19937 rng{5};
  void Reset() {
    history.assign(4, {});
    rng.seed(5);
  }
  // Turns [from, to) on `e`; before each turn, `between(turn)` may damage the tiers. Every answer.
  std::vector<std::vector<int32_t>> Turns(tandem::Engine& e, int from, int to,
                                          const std::function<void(int)>& between = nullptr) {
    std::vector<std::vector<int32_t>> answers;
    for (int turn = from; turn < to; ++turn) {
      if (between) between(turn);
      for (auto& h : history) {
        for (int i = 0; i < 11; ++i)
          h.push_back(static_cast<int32_t>(2 + rng() % static_cast<uint32_t>(vocab - 2)));
        GenerationRequest r;
        r.prompt = h;
        r.max_tokens = 6;
        r.ignore_eos = true;
        absl::StatusOr<std::vector<GenerationResult>> out = e.GenerateAll({r});
        EXPECT_TRUE(out.ok()) << out.status();
        if (!out.ok()) return answers;
        h.insert(h.end(), (*out)[0].token_ids.begin(), (*out)[0].token_ids.end());
        answers.push_back((*out)[0].token_ids);
      }
    }
    return answers;
  }
};

class TieredDeployment : public DisaggregatedTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(TieredDeployment, ConversationsEqualColocated) {
  const bool disk = GetParam() == "disk_damaged";
  std::unique_ptr<WeightSource> source = OpenReference("llama3-gqa-tied");
  ASSERT_NE(source, nullptr);
  const std::string tier_dir = dir_ + "/tiers";
  std::ofstream(dir_ + "/deploy.yaml")
      << "launch:\n  startup_timeout_s: 60\n  step_timeout_s: 20\nkv:\n  tiers:\n"
      << (disk ? "    disk_bytes: 16777216\n    disk_dir: " + tier_dir + "\n" : "    host_bytes: 16777216\n");
  TierConversations c{.vocab = source->spec().vocab_size};
  std::unique_ptr<ColocatedEngine> engine = Engine(*source, 4, 32, /*prefix_cache=*/false);
  ASSERT_NE(engine, nullptr);
  const auto want = c.Turns(*engine, 0, 3);
  c.Reset();

  ComputeRankOptions o = Options(4, 32, 64);  // a rank's pool holds about one conversation
  UsePrefixCache(&o, 8, "off");
  o.scheduler.tier_blocks = 1024;
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 2, o));
  const auto got = c.Turns(*rank_, 0, 3, [&](int turn) {
    if (!disk || turn < 2) return;
    for (const auto& f : std::filesystem::recursive_directory_iterator(tier_dir)) {
      if (f.path().extension() == ".kvb") std::filesystem::resize_file(f.path(), 70);
    }
  });
  EXPECT_EQ(got, want);
  const EngineStats s = rank_->stats();
  EXPECT_GT(s.demoted_tokens, 0);
  if (disk) {
    EXPECT_GT(s.restore_failed_tokens, 0);
  } else {
    EXPECT_GT(s.restored_tokens, 0);
    EXPECT_EQ(s.restore_failed_tokens, 0);
  }
  // The controller's tier counters (the per-tier ones stay on the memory ranks).
  const KvTierCounters& t = s.tiers;
  const int64_t block_bytes = 8 * source->spec().kv_bytes_per_token(sizeof(float));
  EXPECT_TRUE(t.enabled);
  EXPECT_FALSE(t.per_tier);
  EXPECT_EQ(t.demoted_blocks * 8, s.demoted_tokens);
  EXPECT_EQ(t.restored_blocks * 8, s.restored_tokens);
  EXPECT_EQ(t.restore_failed_blocks * 8, s.restore_failed_tokens);
  EXPECT_EQ(t.pool_bytes_out, t.demoted_blocks * block_bytes);
  EXPECT_EQ(t.pool_bytes_in, t.restored_blocks * block_bytes);
  EXPECT_EQ(t.host_hits + t.disk_hits, 0);
}

INSTANTIATE_TEST_SUITE_P(Tiers, TieredDeployment, ::testing::Values("host", "disk_damaged"));

// kv.store_pre_rope on a memory rank: the restores' segments (wire version 10) and the hello's
// rotary embedding reach it, and it assembles blocks of truncated histories from turned rows of
// registered ones (from its pool and its host tier). With one layer a token's KV depends on its id
// and position alone, so the truncated turns' answers equal a colocated engine's without any cache.
TEST_F(DisaggregatedTest, PreRopeReuseOnAMemoryRankIsExactWithOneLayer) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  ASSERT_TRUE(spec.ok());
  spec->num_layers = 1;
  spec->tie_word_embeddings = false;  // see OpenHeadModel
  const std::unique_ptr<WeightSource> source = RandomWeights(*spec, 7);
  std::ofstream(dir_ + "/deploy.yaml")
      << "launch:\n  startup_timeout_s: 60\n  step_timeout_s: 20\nkv:\n  tiers:\n    host_bytes: 16777216\n";
  std::unique_ptr<ColocatedEngine> engine = Engine(*source, 1, 64, /*prefix_cache=*/false);
  ASSERT_NE(engine, nullptr);
  const testing_tiers::TruncatedRun want =
      testing_tiers::TruncatedConversations(*engine, spec->vocab_size, 8);

  ComputeRankOptions o = Options(1, 64, 160);  // the pool holds about one conversation
  UsePrefixCache(&o, 8, "off");
  o.scheduler.tier_blocks = 1024;
  o.scheduler.shifted_reuse = true;
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 1, o));
  const testing_tiers::TruncatedRun got = testing_tiers::TruncatedConversations(*rank_, spec->vocab_size, 8);
  testing_tiers::ExpectExactReuse(got, want, rank_->stats().tiers);
}

// kv.tiers.eviction on a memory rank: compute rank 0 sends the rank the demoted blocks that waiting
// turns will reuse (the plan's next-use records), and its host tier of 16 blocks keeps them. Each
// round submits three conversations' next turns behind a one-off prompt, one request running at a
// time, over a pool too small for all of them: with next_use every block the controller plans to
// restore is still there; with lru the tier has dropped some, and those turns compute them again.
// The tokens are the colocated engine's either way.
class NextUseDeployment : public DisaggregatedTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(NextUseDeployment, TiersKeepWhatWaitingTurnsNeed) {
  const bool next_use = GetParam() == "next_use";
  std::unique_ptr<WeightSource> source = OpenReference("llama3-gqa-tied");
  ASSERT_NE(source, nullptr);
  constexpr int64_t kBlock = 8;
  const int64_t block_bytes = kBlock * source->spec().kv_bytes_per_token(sizeof(float));
  std::ofstream(dir_ + "/deploy.yaml")
      << "launch:\n  startup_timeout_s: 60\n  step_timeout_s: 20\nkv:\n  tiers:\n"
      << "    host_bytes: " << 16 * block_bytes << "\n    eviction: " << GetParam() << "\n";
  const int64_t vocab = source->spec().vocab_size;
  auto rounds = [&](tandem::Engine& e) {
    std::vector<std::vector<int32_t>> history(3), answers;
    std::mt19937 rng(9);
    auto next = [&] { return static_cast<int32_t>(2 + rng() % static_cast<uint32_t>(vocab - 2)); };
    for (int turn = 0; turn < 4; ++turn) {
      std::vector<GenerationRequest> round(1);
      for (int i = 0; i < 96; ++i) round[0].prompt.push_back(next());
      for (auto& h : history) {
        for (int i = 0; i < 13; ++i) h.push_back(next());
        round.push_back({.prompt = h});
      }
      for (GenerationRequest& r : round) r.max_tokens = 9, r.ignore_eos = true;
      absl::StatusOr<std::vector<GenerationResult>> out = e.GenerateAll(round);
      EXPECT_TRUE(out.ok()) << out.status();
      if (!out.ok()) return answers;
      for (size_t k = 0; k < round.size(); ++k) {
        const std::vector<int32_t>& tokens = (*out)[k].token_ids;
        if (k > 0) history[k - 1].insert(history[k - 1].end(), tokens.begin(), tokens.end());
        answers.push_back(tokens);
      }
    }
    return answers;
  };
  std::unique_ptr<ColocatedEngine> engine = Engine(*source, 1, 64, /*prefix_cache=*/false);
  ASSERT_NE(engine, nullptr);
  const auto want = rounds(*engine);

  ComputeRankOptions o = Options(1, 64, 160);
  UsePrefixCache(&o, kBlock, "off");
  o.scheduler.tier_blocks = 16;  // as ResolveControllerOptions sizes it for the tier
  o.scheduler.prefetch_lookahead = 0;
  o.scheduler.tier_next_use = next_use;
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 1, o));
  EXPECT_EQ(rounds(*rank_), want);
  const EngineStats s = rank_->stats();
  std::printf("%s: %lld tokens demoted, %lld restored, %lld restores failed\n", GetParam().c_str(),
              static_cast<long long>(s.demoted_tokens), static_cast<long long>(s.restored_tokens),
              static_cast<long long>(s.restore_failed_tokens));
  EXPECT_GT(s.demoted_tokens, 0);
  if (next_use) {
    EXPECT_GT(s.restored_tokens, 0);
    EXPECT_EQ(s.restore_failed_tokens, 0) << "the rank's tier dropped a block a waiting turn needed";
  } else {
    EXPECT_GT(s.restore_failed_tokens, 0)
        << "lru never dropped a block a waiting turn needed: the test shows nothing";
  }
}

INSTANTIATE_TEST_SUITE_P(Eviction, NextUseDeployment, ::testing::Values("next_use", "lru"));

// kv.tiers.persist on a deployment: four conversations over two memory ranks whose pools hold about
// one conversation each, their evicted blocks written to rank-<m>/ with their tokens (the plan's
// evictions carry them). The deployment stops after two turns; a new one over the same directory
// gets each rank's persisted blocks report at start, registers them, and the third turn restores
// them from disk with the colocated engine's tokens. "damaged": rank 0's files are truncated while
// the deployment is down; that rank discards them at start with a warning (none is offered), the
// conversations compute those tokens again, and the tokens are the same.
class PersistedDeployment : public DisaggregatedTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(PersistedDeployment, RestartRestoresTheConversationsFromDisk) {
  const bool damaged = GetParam() == "damaged";
  std::unique_ptr<WeightSource> source = OpenReference("llama3-gqa-tied");
  ASSERT_NE(source, nullptr);
  const std::string tier_dir = dir_ + "/tiers";
  std::ofstream(dir_ + "/deploy.yaml")
      << "launch:\n  startup_timeout_s: 60\n  step_timeout_s: 20\nkv:\n  tiers:\n"
      << "    disk_bytes: 16777216\n    disk_dir: " << tier_dir << "\n    persist: true\n";
  TierConversations c{.vocab = source->spec().vocab_size};
  std::unique_ptr<ColocatedEngine> engine = Engine(*source, 4, 32, /*prefix_cache=*/false);
  ASSERT_NE(engine, nullptr);
  const auto want = c.Turns(*engine, 0, 3);
  c.Reset();

  ComputeRankOptions o = Options(4, 32, 64);
  UsePrefixCache(&o, 8, "off");
  o.scheduler.tier_blocks = 1024;
  o.scheduler.eviction_tokens = true;  // as ResolveControllerOptions sets it for kv.tiers.persist
  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 2, o));
  EXPECT_EQ(rank_->controller().stats().tier_blocks_added, 0) << "nothing on disk yet";
  auto got = c.Turns(*rank_, 0, 2);
  EXPECT_GT(rank_->stats().demoted_tokens, 0);
  StopDeployment();

  size_t files[2] = {0, 0};
  for (int m = 0; m < 2; ++m) {
    for (const auto& f : std::filesystem::directory_iterator(absl::StrCat(tier_dir, "/rank-", m))) {
      if (f.path().extension() != ".kvb") continue;
      ++files[m];
      if (damaged && m == 0) std::filesystem::resize_file(f.path(), 70);
    }
  }
  ASSERT_GT(files[0] + files[1], 0u);

  ASSERT_NO_FATAL_FAILURE(StartDeployment(*source, 2, o));
  const int64_t added = rank_->controller().stats().tier_blocks_added;
  // A file whose parent stayed in the pool when the deployment stopped (its rank has no tokens for
  // it, so it was not written) is not registered.
  EXPECT_LE(added, static_cast<int64_t>(damaged ? files[1] : files[0] + files[1]));
  const auto later = c.Turns(*rank_, 2, 3);
  got.insert(got.end(), later.begin(), later.end());
  EXPECT_EQ(got, want);
  const EngineStats s = rank_->stats();
  std::printf("%s: %zu + %zu block files, %lld registered again, %lld tokens restored\n", GetParam().c_str(),
              files[0], files[1], static_cast<long long>(added), static_cast<long long>(s.restored_tokens));
  EXPECT_EQ(s.restore_failed_tokens, 0);
  if (!damaged) {
    EXPECT_GT(added, 0);
    EXPECT_GT(s.restored_tokens, 0);
  } else if (files[0] > 0) {
    EXPECT_NE(
        group_.LogTail(names_[2], 100000).find("discarded " + std::to_string(files[0]) + " block files"),
        std::string::npos)
        << "rank 0 names the files it refused";
  }
}

INSTANTIATE_TEST_SUITE_P(Tiers, PersistedDeployment, ::testing::Values("intact", "damaged"));

}  // namespace
}  // namespace tandem
