// loadgen/: trace parsers against malformed rows, prompts from prefix-block hashes, arrivals,
// metrics on a timeline with known answers, and the in-process replay on the colocated engine
// (multi-turn history, prefix hits, Ctrl-C).
#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>

#include "colocated/engine.h"
#include "compute_node/weights.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "loadgen/arrivals.h"
#include "loadgen/metrics.h"
#include "loadgen/report.h"
#include "loadgen/runner.h"
#include "loadgen/workload.h"
#include "nlohmann/json.hpp"

namespace tandem::loadgen {
namespace {

std::string SourceDir() {
  const char* s = std::getenv("TANDEM_SOURCE_DIR");
  return s == nullptr ? std::string(".") : std::string(s);
}

constexpr char kAzureHeader[] = "TIMESTAMP,ContextTokens,GeneratedTokens\n";

TEST(TraceTest, ParsesAzureRowsWithTimes) {
  const std::string text = std::string(kAzureHeader) +
                           "2023-11-16 18:15:46.5000000,374,44\n"
                           "2023-11-16 18:15:50.0000000,396,109\r\n"
                           "\n"
                           "2023-11-17 00:00:01.2500000,10,0\n";
  TraceFormat f;
  absl::StatusOr<std::vector<TraceRow>> rows = ParseTrace(text, "a.csv", 0, 0, &f);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(f, TraceFormat::kAzure);
  ASSERT_EQ(rows->size(), 3u);
  EXPECT_DOUBLE_EQ((*rows)[0].time_s, 0);
  EXPECT_NEAR((*rows)[1].time_s, 3.5, 1e-6);
  // Across midnight: 18:15:46.5 -> 00:00:01.25 next day.
  EXPECT_NEAR((*rows)[2].time_s, 5 * 3600 + 44 * 60 + 14.75, 1e-6);
  EXPECT_EQ((*rows)[1].input_tokens, 396);
  EXPECT_EQ((*rows)[1].output_tokens, 109);
  EXPECT_EQ((*rows)[2].line, 5);
  // skip and limit count data rows; times restart from the first row read.
  rows = ParseTrace(text, "a.csv", 1, 1, &f);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].input_tokens, 396);
  EXPECT_DOUBLE_EQ((*rows)[0].time_s, 0);
}

TEST(TraceTest, MalformedRowsNameFileAndLine) {
  struct Case {
    std::string text, needle;
  };
  const std::string h = kAzureHeader;
  const std::string ok = "2023-11-16 18:15:46.6805900,374,44\n";
  for (const Case& c : std::vector<Case>{
           {h + ok + "2023-11-16 18:15:47.0,12\n", "t.csv:3: expected 3 fields, got 2"},
           {h + ok + "yesterday,1,2\n", "t.csv:3: TIMESTAMP"},
           {h + ok + "2023-13-16 18:15:47.0,1,2\n", "t.csv:3: TIMESTAMP"},
           {h + ok + "2023-11-16 18:15:47.0,x,2\n",
            "t.csv:3: ContextTokens: expected a non-negative integer, got \"x\""},
           {h + ok + "2023-11-16 18:15:47.0,5,-2\n", "t.csv:3: GeneratedTokens"},
           {h + ok + "2023-11-16 18:15:47.0,0,2\n", "t.csv:3: the prompt has no tokens"},
           {h + ok + "2023-11-16 18:15:40.0,5,2\n", "t.csv:3: timestamps go backwards"},
           {"time,in,out\n", "t.csv:1: not a known trace"},
           {"", "t.csv: empty trace"},
           {"{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n{\"timestamp\": 1,\n",
            "t.csv:2: not a JSON object"},
           {"{\"timestamp\": 0, \"output_length\": 1}\n", "t.csv:1: missing key 'input_length'"},
           {"{\"timestamp\": 0, \"input_length\": -5, \"output_length\": 1}\n", "t.csv:1: input_length"},
           {"{\"timestamp\": \"0\", \"input_length\": 5, \"output_length\": 1}\n", "t.csv:1: timestamp"},
           {"{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1, \"a\"]}\n",
            "t.csv:1: hash_ids"},
           {"{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": 3}\n",
            "t.csv:1: hash_ids"},
           {"{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n[1, 2]\n",
            "t.csv:2: not a JSON object"},
       }) {
    absl::StatusOr<std::vector<TraceRow>> rows = ParseTrace(c.text, "t.csv", 0, 0);
    ASSERT_FALSE(rows.ok()) << c.text;
    EXPECT_EQ(rows.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(rows.status().message().find(c.needle), std::string_view::npos)
        << rows.status() << "\nwanted: " << c.needle;
  }
  EXPECT_EQ(ReadTrace("/nonexistent/trace.csv", 0, 0).status().code(), absl::StatusCode::kNotFound);
}

TEST(TraceTest, CommittedExcerptsParse) {
  TraceFormat f;
  absl::StatusOr<std::vector<TraceRow>> a =
      ReadTrace(SourceDir() + "/tests/data/traces/azure_conv_head40.csv", 0, 0, &f);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->size(), 40u);
  EXPECT_EQ(f, TraceFormat::kAzure);
  EXPECT_EQ((*a)[0].input_tokens, 374);
  absl::StatusOr<std::vector<TraceRow>> m =
      ReadTrace(SourceDir() + "/tests/data/traces/mooncake_conv_head40.jsonl", 0, 0, &f);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(f, TraceFormat::kMooncake);
  ASSERT_EQ(m->size(), 40u);
  EXPECT_EQ((*m)[0].hash_ids.size(), 14u);
  EXPECT_DOUBLE_EQ((*m)[10].time_s, 3.0);
}

TEST(WorkloadTest, HashBlocksBecomeIdenticalTokens) {
  std::vector<TraceRow> rows(3);
  rows[0] = {0, 10, 2, {7, 8, 9}, 1};  // blocks 7, 8 (4 tokens each) and 2 tokens of 9
  rows[1] = {0, 12, 2, {7, 8, 5}, 2};  // shares 7 and 8
  rows[2] = {0, 6, 2, {1, 8}, 3};      // 8 again (its first 2 tokens)
  TokenSpace t;
  t.vocab_size = 100;
  t.avoid = {50};
  absl::StatusOr<Workload> w = MakeTraceWorkload("m", TraceFormat::kMooncake, rows, t, {}, 1.0, 4);
  ASSERT_TRUE(w.ok());
  const auto& r = w->requests;
  ASSERT_EQ(r[0].prompt.size(), 10u);
  ASSERT_EQ(r[1].prompt.size(), 12u);
  EXPECT_TRUE(std::equal(r[0].prompt.begin(), r[0].prompt.begin() + 8, r[1].prompt.begin()));
  EXPECT_NE(std::vector<int32_t>(r[0].prompt.begin() + 8, r[0].prompt.end()),
            std::vector<int32_t>(r[1].prompt.begin() + 8, r[1].prompt.begin() + 10));
  // Block 8 is the same tokens in every request that lists it (a partial last block: its start).
  EXPECT_TRUE(std::equal(r[0].prompt.begin() + 4, r[0].prompt.begin() + 6, r[2].prompt.begin() + 4));
  EXPECT_NE(std::vector<int32_t>(r[0].prompt.begin(), r[0].prompt.begin() + 4),
            std::vector<int32_t>(r[2].prompt.begin(), r[2].prompt.begin() + 4));
  for (const BenchRequest& q : r)
    for (int32_t id : q.prompt) {
      EXPECT_GE(id, 3);
      EXPECT_LT(id, 100);
      EXPECT_NE(id, 50);
    }
  // Another seed, other tokens; the same seed, the same tokens.
  TokenSpace t2 = t;
  t2.seed = 1;
  EXPECT_NE(MakeTraceWorkload("m", TraceFormat::kMooncake, rows, t2, {}, 1.0, 4)->requests[0].prompt,
            r[0].prompt);
  EXPECT_EQ(MakeTraceWorkload("m", TraceFormat::kMooncake, rows, t, {}, 1.0, 4)->requests[0].prompt,
            r[0].prompt);
}

TEST(WorkloadTest, CapsAndScaleAreAppliedAndStated) {
  std::vector<TraceRow> rows = {{0, 100, 50, {}, 2}, {1, 40, 10, {}, 3}, {2, 30, 700, {}, 4}};
  TokenSpace t;
  Caps caps{.max_input = 64, .max_output = 200, .max_context = 128};
  absl::StatusOr<Workload> w = MakeTraceWorkload("a", TraceFormat::kAzure, rows, t, caps);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->requests[0].prompt.size(), 64u);
  EXPECT_EQ(w->requests[0].max_tokens, 50);
  EXPECT_EQ(w->requests[1].prompt.size(), 40u);
  EXPECT_EQ(w->requests[2].max_tokens, 127);  // 700 -> 200 (cap) -> 127 (context 128 less one prompt token)
  EXPECT_EQ(w->requests[2].prompt.size(), 1u);
  ASSERT_EQ(w->notes.size(), 3u);
  EXPECT_NE(w->notes[0].find("1 of 3 prompts cut to --max-input 64"), std::string::npos) << w->notes[0];
  EXPECT_NE(w->notes[1].find("1 of 3 outputs capped at --max-output 200"), std::string::npos);
  EXPECT_NE(w->notes[2].find("truncated to fit the model's context"), std::string::npos);
  absl::StatusOr<Workload> s = MakeTraceWorkload("a", TraceFormat::kAzure, rows, t, {}, 0.1);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->requests[0].prompt.size(), 10u);
  EXPECT_EQ(s->requests[1].max_tokens, 1);
  EXPECT_NE(s->notes[0].find("lengths scaled by 0.1"), std::string::npos);
}

TEST(ArrivalTest, Processes) {
  Workload w = MakeFixedWorkload(2001, 4, 2, TokenSpace{});
  absl::StatusOr<std::vector<double>> t = ArrivalTimes(w, {ArrivalKind::kPoisson, 10, 1, 1, 3}, false);
  ASSERT_TRUE(t.ok());
  EXPECT_DOUBLE_EQ((*t)[0], 0);
  EXPECT_NEAR(t->back() / 2000, 0.1, 0.01);  // mean gap 1/rate
  // Burstiness 0.25: the same mean rate, gaps with 4x the variance (CV^2 = 1/shape).
  auto cv2 = [&](double shape) {
    std::vector<double> x = *ArrivalTimes(w, {ArrivalKind::kPoisson, 10, 1, shape, 3}, false);
    double m = 0, v = 0;
    for (size_t i = 1; i < x.size(); ++i) m += x[i] - x[i - 1];
    m /= 2000;
    for (size_t i = 1; i < x.size(); ++i) v += (x[i] - x[i - 1] - m) * (x[i] - x[i - 1] - m);
    return v / 2000 / (m * m);
  };
  EXPECT_NEAR(cv2(1), 1, 0.15);
  EXPECT_NEAR(cv2(0.25), 4, 0.8);
  EXPECT_FALSE(ArrivalTimes(w, {ArrivalKind::kPoisson, 0, 1, 1, 0}, false).ok());
  EXPECT_FALSE(ArrivalTimes(w, {ArrivalKind::kTrace, 0, 1, 1, 0}, false).ok());
  // Trace times: scaled, or rescaled to a mean rate.
  Workload tw = MakeFixedWorkload(5, 4, 2, TokenSpace{});
  for (size_t i = 0; i < 5; ++i) tw.requests[i].trace_time_s = 2.0 * static_cast<double>(i);
  EXPECT_DOUBLE_EQ((*ArrivalTimes(tw, {ArrivalKind::kTrace, 0, 0.5, 1, 0}, true))[4], 4.0);
  EXPECT_DOUBLE_EQ((*ArrivalTimes(tw, {ArrivalKind::kTrace, 2, 1, 1, 0}, true))[4], 2.0);  // 4 gaps at 2/s
  // Sessions: only first turns get a time.
  Workload mt = MakeMultiTurnWorkload(2, 3, 0, 4, 2, 0.5, TokenSpace{});
  std::vector<double> at = *ArrivalTimes(mt, {ArrivalKind::kAllAtOnce, 0, 1, 1, 0}, false);
  EXPECT_EQ(at[0], 0);
  EXPECT_EQ(at[1], kLater);
  EXPECT_EQ(at[3], 0);
}

// A timeline with answers worked out by hand.
TEST(MetricsTest, KnownTimeline) {
  std::vector<RequestTiming> t(4);
  // r0: arrives 0, tokens at 1, 2, 4 -> TTFT 1, TPOT 1.5, ITL {1, 2}, E2E 4.
  t[0] = {.index = 0,
          .arrival = 0,
          .sent = 0,
          .token_times = {1, 2, 4},
          .end = 4,
          .prompt_tokens = 10,
          .output_tokens = 3,
          .cached_tokens = 5,
          .finish_reason = "length"};
  // r1: arrives 1, tokens at 3, 4 -> TTFT 2, TPOT 1, ITL {1}, E2E 3.
  t[1] = {.index = 1,
          .arrival = 1,
          .sent = 1,
          .token_times = {3, 4},
          .end = 4,
          .prompt_tokens = 20,
          .output_tokens = 2,
          .finish_reason = "length"};
  // r2: one token at 5 (arrived 2) -> TTFT 3, no TPOT, E2E 3; the run ends at 5.
  t[2] = {.index = 2,
          .arrival = 2,
          .sent = 2,
          .token_times = {5},
          .end = 5,
          .prompt_tokens = 10,
          .output_tokens = 1,
          .finish_reason = "length"};
  // r3: failed: counted apart, in no latency.
  t[3] = {.index = 3, .arrival = 2, .sent = 2, .end = 2, .finish_reason = "error", .error = "refused"};
  RunMetrics m = ComputeMetrics(t, {});
  EXPECT_EQ(m.completed, 3);
  EXPECT_EQ(m.failed, 1);
  EXPECT_DOUBLE_EQ(m.duration_s, 5);
  EXPECT_DOUBLE_EQ(m.request_throughput, 3.0 / 5);
  EXPECT_DOUBLE_EQ(m.input_throughput, 40.0 / 5);
  EXPECT_DOUBLE_EQ(m.output_throughput, 6.0 / 5);
  EXPECT_DOUBLE_EQ(m.ttft.mean, 2);
  EXPECT_DOUBLE_EQ(m.ttft.median, 2);
  EXPECT_DOUBLE_EQ(m.ttft.p90, 2.8);  // 2 + 0.8 * (3 - 2)
  EXPECT_DOUBLE_EQ(m.ttft.p99, 2.98);
  EXPECT_DOUBLE_EQ(m.tpot.mean, 1.25);
  EXPECT_EQ(m.tpot.count, 2);
  EXPECT_EQ(m.itl.count, 3);
  EXPECT_DOUBLE_EQ(m.itl.mean, 4.0 / 3);
  EXPECT_DOUBLE_EQ(m.itl.median, 1);
  EXPECT_DOUBLE_EQ(m.e2e.mean, 10.0 / 3);
  EXPECT_DOUBLE_EQ(m.e2e.max, 4);
  EXPECT_DOUBLE_EQ(m.prefix_hit_rate, 5.0 / 40);
  EXPECT_EQ(m.good, 3);
  // SLOs: TTFT <= 2 keeps r0 and r1; TPOT <= 1.2 then keeps r1 (r2 has no TPOT: 0 meets it).
  absl::StatusOr<Slo> slo = ParseSlo("ttft=2, tpot=1200ms");
  ASSERT_TRUE(slo.ok());
  m = ComputeMetrics(t, *slo);
  EXPECT_EQ(m.good, 1);
  EXPECT_DOUBLE_EQ(m.goodput, 1.0 / 5);
  slo = ParseSlo("e2e=3s");
  ASSERT_TRUE(slo.ok());
  EXPECT_EQ(ComputeMetrics(t, *slo).good, 2);
  for (const char* bad : {"ttft", "ttft=0", "ttft=-1", "ttft=abc", "latency=3"}) {
    absl::StatusOr<Slo> s = ParseSlo(bad);
    EXPECT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.status().message().find("--slo"), std::string_view::npos);
  }
}

class ReplayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<WeightSource>> w = OpenModel("tiny-gqa", 0);
    ASSERT_TRUE(w.ok());
    source_ = *std::move(w);
    EngineOptions o;
    o.device = "cpu";
    o.kv_capacity_tokens = 8192;
    o.prefix_block_tokens = 16;
    absl::StatusOr<std::unique_ptr<ColocatedEngine>> e = ColocatedEngine::Create(*source_, o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = *std::move(e);
    tokens_.vocab_size = source_->spec().vocab_size;
    tokens_.avoid = source_->spec().eos_token_ids;
  }
  std::unique_ptr<WeightSource> source_;
  std::unique_ptr<ColocatedEngine> engine_;
  TokenSpace tokens_;
};

TEST_F(ReplayTest, SharedPrefixHitsAndTimelines) {
  Workload w = MakeSharedPrefixWorkload(6, 48, 8, 5, tokens_);
  RunOptions o;
  o.arrivals = *ArrivalTimes(w, {ArrivalKind::kAllAtOnce}, false);
  absl::StatusOr<RunResult> r = RunOnEngine(*engine_, w, o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->timings.size(), 6u);
  for (const RequestTiming& t : r->timings) {
    EXPECT_TRUE(t.completed()) << t.error;
    EXPECT_EQ(t.token_times.size(), 5u);
    EXPECT_EQ(t.output_tokens, 5);
    EXPECT_EQ(t.prompt_tokens, 56);
    EXPECT_TRUE(std::is_sorted(t.token_times.begin(), t.token_times.end()));
    EXPECT_GE(t.token_times.front(), t.arrival);
    EXPECT_DOUBLE_EQ(t.end, t.token_times.back());
  }
  const RunMetrics m = ComputeMetrics(r->timings, {});
  // The 48 shared tokens are 3 blocks of 16: the first request prefills them, later ones reuse them.
  EXPECT_GT(m.cached_tokens, 0);
  EXPECT_LE(m.cached_tokens, 5 * 48);
  EXPECT_FALSE(r->kv.empty());
  double peak = 0;
  for (const KvSample& k : r->kv) peak = std::max(peak, k.used);
  EXPECT_GT(peak, 0);
  EXPECT_GT(r->steps, 0);
}

TEST_F(ReplayTest, MultiTurnSessionsCarryTheirHistory) {
  Workload w = MakeMultiTurnWorkload(2, 3, 16, 8, 4, 0.01, tokens_);
  RunOptions o;
  o.arrivals = *ArrivalTimes(w, {ArrivalKind::kAllAtOnce}, false);
  absl::StatusOr<RunResult> r = RunOnEngine(*engine_, w, o);
  ASSERT_TRUE(r.ok()) << r.status();
  for (size_t s = 0; s < 2; ++s) {
    const RequestTiming& t0 = r->timings[s * 3];
    const RequestTiming& t1 = r->timings[s * 3 + 1];
    const RequestTiming& t2 = r->timings[s * 3 + 2];
    ASSERT_TRUE(t0.completed() && t1.completed() && t2.completed());
    // Turn k+1's prompt is turn k's prompt + its 4 tokens + 8 new ones.
    EXPECT_EQ(t0.prompt_tokens, 24);
    EXPECT_EQ(t1.prompt_tokens, 24 + 4 + 8);
    EXPECT_EQ(t2.prompt_tokens, 36 + 4 + 8);
    // Sent after the previous turn ended plus the think time; its history's blocks hit.
    EXPECT_GE(t1.arrival, t0.end + 0.01 - 1e-9);
    EXPECT_GE(t2.arrival, t1.end + 0.01 - 1e-9);
    EXPECT_GE(t1.cached_tokens, 16);
    EXPECT_GE(t2.cached_tokens, 32);
  }
  // A context limit ends sessions early, counted.
  o.max_context = 40;
  r = RunOnEngine(*engine_, MakeMultiTurnWorkload(2, 3, 16, 8, 4, 0, tokens_), o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->skipped_turns, 2);  // turn 2 of each (48 + 4 > 40); turn 1 (36 + 4) fits
  EXPECT_EQ(r->timings[2].finish_reason, "skipped");
}

TEST_F(ReplayTest, RefusedRequestsAndStop) {
  Workload w = MakeFixedWorkload(3, 8, 4, tokens_);
  w.requests[1].prompt.assign(2000, 5);  // beyond the model's 1024 positions
  RunOptions o;
  o.arrivals = *ArrivalTimes(w, {ArrivalKind::kAllAtOnce}, false);
  absl::StatusOr<RunResult> r = RunOnEngine(*engine_, w, o);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->timings[0].completed());
  EXPECT_FALSE(r->timings[1].error.empty());
  EXPECT_EQ(r->timings[1].finish_reason, "error");
  EXPECT_TRUE(r->timings[2].completed());
  EXPECT_EQ(ComputeMetrics(r->timings, {}).failed, 1);
  // Stop after the second step: what ran is kept, the rest is unfinished, the engine is idle.
  Workload slow = MakeFixedWorkload(4, 8, 50, tokens_);
  int polls = 0;
  o.arrivals = *ArrivalTimes(slow, {ArrivalKind::kAllAtOnce}, false);
  o.stop_requested = [&] { return ++polls > 3; };
  r = RunOnEngine(*engine_, slow, o);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->interrupted);
  const RunMetrics m = ComputeMetrics(r->timings, {});
  EXPECT_EQ(m.completed, 0);
  EXPECT_EQ(m.unfinished, 4);
  EXPECT_FALSE(r->timings[0].token_times.empty());
  EXPECT_EQ(r->timings[0].finish_reason, "cancelled");
  EXPECT_TRUE(engine_->Idle());
}

TEST_F(ReplayTest, ReportJsonHoldsEveryRequest) {
  Workload w = MakeFixedWorkload(4, 8, 3, tokens_);
  RunOptions o;
  o.arrivals = *ArrivalTimes(w, {ArrivalKind::kAllAtOnce}, false);
  BenchReport report;
  report.workload_name = w.name;
  report.cost = {true, "1 x h100", 3.6, "p.yaml", "2026-11-25", false, false};
  RunReport run;
  run.label = "all at once";
  run.result = *RunOnEngine(*engine_, w, o);
  run.metrics = ComputeMetrics(run.result.timings, {});
  report.runs.push_back(run);
  const nlohmann::json j = nlohmann::json::parse(ReportJson(report));
  EXPECT_EQ(j["schema"], "tandem-bench/1");
  ASSERT_EQ(j["runs"].size(), 1u);
  ASSERT_EQ(j["runs"][0]["requests"].size(), 4u);
  EXPECT_EQ(j["runs"][0]["requests"][2]["token_times"].size(), 3u);
  const double tps = j["runs"][0]["metrics"]["output_throughput"];
  EXPECT_DOUBLE_EQ(j["runs"][0]["cost"]["usd_per_million_output_tokens"].get<double>(),
                   3.6 / 3600 / tps * 1e6);
  EXPECT_EQ(j["runs"][0]["cost"]["price_table_date"], "2026-11-25");
  const std::string table = ReportTable(report);
  EXPECT_NE(table.find("$ / M output tokens"), std::string::npos);
  EXPECT_NE(table.find("2026-11-25"), std::string::npos);
}

// The HTTP target against a server that is not tandem: events carry text but no token_ids (one
// token each), the usage chunk gives the counts and cached tokens, /metrics has vLLM's KV gauge;
// an HTTP error is recorded on its request, not returned.
TEST(HttpTargetTest, ForeignServerEvents) {
  httplib::Server server;
  server.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(R"({"data": [{"id": "other-model"}]})", "application/json");
  });
  server.Get("/metrics", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model=\"m\"} 0.25\n",
                    "text/plain");
  });
  server.Post("/v1/completions", [](const httplib::Request& req, httplib::Response& res) {
    const nlohmann::json body = nlohmann::json::parse(req.body);
    if (body["model"] != "other-model" || !body["stream"].get<bool>() || !body["prompt"].is_array()) {
      res.status = 400;
      res.set_content(R"({"error": {"message": "bad request"}})", "application/json");
      return;
    }
    const int64_t n = body["max_tokens"];
    if (n == 3) {  // the test's "overloaded" request
      res.status = 429;
      res.set_content(R"({"error": {"message": "too many requests"}})", "application/json");
      return;
    }
    const int64_t prompt = static_cast<int64_t>(body["prompt"].size());
    res.set_chunked_content_provider("text/event-stream", [n, prompt](size_t, httplib::DataSink& sink) {
      for (int64_t i = 0; i < n; ++i) {
        const std::string e =
            "data: " +
            nlohmann::json({{"choices", {{{"index", 0}, {"text", "x"}, {"finish_reason", nullptr}}}}})
                .dump() +
            "\n\n";
        sink.write(e.data(), e.size());
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      const std::string usage = "data: " +
                                nlohmann::json({{"choices", nlohmann::json::array()},
                                                {"usage",
                                                 {{"prompt_tokens", prompt},
                                                  {"completion_tokens", n},
                                                  {"prompt_tokens_details", {{"cached_tokens", 4}}}}}})
                                    .dump() +
                                "\n\ndata: [DONE]\n\n";
      sink.write(usage.data(), usage.size());
      sink.done();
      return true;
    });
  });
  const int port = server.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread th([&] { server.listen_after_bind(); });
  Workload w = MakeFixedWorkload(4, 10, 6, TokenSpace{});
  w.requests[2].max_tokens = 3;
  RunOptions o;
  o.arrivals = {0, 0.05, 0.1, 0.15};
  absl::StatusOr<RunResult> r = RunOnHttp({"http://127.0.0.1:" + std::to_string(port)}, w, o);
  server.stop();
  th.join();
  ASSERT_TRUE(r.ok()) << r.status();
  for (size_t i : {0u, 1u, 3u}) {
    const RequestTiming& t = r->timings[i];
    EXPECT_TRUE(t.completed()) << t.error;
    EXPECT_EQ(t.token_times.size(), 6u);
    EXPECT_EQ(t.output_tokens, 6);
    EXPECT_EQ(t.prompt_tokens, 10);
    EXPECT_EQ(t.cached_tokens, 4);
    EXPECT_GE(t.token_times.front(), t.arrival);
    EXPECT_GT(t.token_times.back() - t.token_times.front(), 0.015);  // 5 gaps of 5 ms
  }
  EXPECT_NE(r->timings[2].error.find("HTTP 429"), std::string::npos) << r->timings[2].error;
  const RunMetrics m = ComputeMetrics(r->timings, {});
  EXPECT_EQ(m.completed, 3);
  EXPECT_EQ(m.failed, 1);
  EXPECT_NEAR(m.prefix_hit_rate, 0.4, 1e-12);
  ASSERT_FALSE(r->kv.empty());  // scraped from /metrics at the start
  EXPECT_DOUBLE_EQ(r->kv.front().used, 0.25);
  EXPECT_EQ(r->target, "http://127.0.0.1:" + std::to_string(port) + "/v1");
  // An endpoint nobody listens on is Unavailable, naming it.
  absl::StatusOr<RunResult> none = RunOnHttp({"http://127.0.0.1:1/v1"}, w, o);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(none.status().message().find("127.0.0.1:1"), std::string_view::npos);
  EXPECT_EQ(RunOnHttp({"127.0.0.1:8000"}, w, o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::loadgen
