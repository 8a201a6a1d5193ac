// Tests of common/config.h (schema, YAML, --set, dump, help) and common/log.h, and of one real
// setting through the deployment schema (memory.partition).
#include "common/config.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/model_spec.h"
#include "deploy/deployment.h"
#include "deploy/placement.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

// gtest only (the test helper links no gmock): substring assertions with readable failures.
::testing::AssertionResult Contains(const char* haystack_expr, const char* needle_expr,
                                    const std::string& haystack, const std::string& needle) {
  if (haystack.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << haystack_expr << " does not contain " << needle_expr
                                       << "\n  haystack: " << haystack << "\n  needle: " << needle;
}
::testing::AssertionResult Lacks(const char* haystack_expr, const char* needle_expr,
                                 const std::string& haystack, const std::string& needle) {
  if (haystack.find(needle) == std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << haystack_expr << " contains " << needle_expr << "\n  haystack: " << haystack;
}
#define EXPECT_CONTAINS(haystack, needle) EXPECT_PRED_FORMAT2(Contains, haystack, needle)
#define EXPECT_LACKS(haystack, needle) EXPECT_PRED_FORMAT2(Lacks, haystack, needle)

// Sections interleave on purpose ("scheduler" comes back after "kv") to exercise grouping.
const ConfigSchema& TestSchema() {
  static const ConfigSchema* const schema = [] {
    auto* s = new ConfigSchema;
    s->Int("scheduler.max_batch_size", 32, "Most sequences in one step", 1, 65536)
        .Double("scheduler.prefill_ratio", 0.5, "Share of a step's tokens spent on prefill", 0.0, 1.0)
        .Bool("scheduler.chunked_prefill", true, "Split long prompts into chunks")
        .Int("kv.capacity_tokens", 0, "KV cache capacity in tokens (0 = from free memory)", 0)
        .Enum("kv.dtype", "bf16", {"fp16", "bf16", "fp8"}, "KV cache element type")
        .String("model.path", "", "Checkpoint folder")
        .String("model.name", "tiny", "Model name reported by the API")
        .Enum("scheduler.policy", "fcfs", {"fcfs", "priority"}, "Admission order")
        .Int("net.rdma.port", 1, "RDMA port number")
        .Double("net.timeout_s", 5, "Peer timeout in seconds")
        .Bool("debug", false, "Extra checks");
    return s;
  }();
  return *schema;
}

absl::StatusOr<Config> Load(std::string_view yaml, std::vector<std::string> overrides = {}) {
  return LoadConfig(TestSchema(), yaml, "deploy.yaml", overrides);
}

// Asserts `result` failed with `code` and a message holding every one of `parts`.
void ExpectError(const absl::StatusOr<Config>& result, absl::StatusCode code,
                 std::initializer_list<std::string_view> parts) {
  ASSERT_FALSE(result.ok()) << "expected an error containing " << *parts.begin();
  EXPECT_EQ(result.status().code(), code) << result.status();
  for (std::string_view part : parts) {
    EXPECT_CONTAINS(std::string(result.status().message()), std::string(part));
  }
}

void ExpectInvalid(std::string_view yaml, std::initializer_list<std::string_view> parts) {
  SCOPED_TRACE(yaml);
  ExpectError(Load(yaml), absl::StatusCode::kInvalidArgument, parts);
}

void ExpectInvalidSet(const std::string& override_text, std::initializer_list<std::string_view> parts) {
  SCOPED_TRACE(override_text);
  ExpectError(Load("", {override_text}), absl::StatusCode::kInvalidArgument, parts);
  ExpectError(Load("", {override_text}), absl::StatusCode::kInvalidArgument, {"--set " + override_text});
}

// Every knob of the test schema holds the same value in both configs.
void ExpectSameValues(const Config& a, const Config& b) {
  for (const KnobSpec& knob : TestSchema().knobs()) {
    SCOPED_TRACE(knob.path);
    switch (knob.type) {
      case KnobType::kInt:
        EXPECT_EQ(a.GetInt(knob.path), b.GetInt(knob.path));
        break;
      case KnobType::kDouble:
        EXPECT_EQ(a.GetDouble(knob.path), b.GetDouble(knob.path));
        break;
      case KnobType::kBool:
        EXPECT_EQ(a.GetBool(knob.path), b.GetBool(knob.path));
        break;
      case KnobType::kString:
      case KnobType::kEnum:
        EXPECT_EQ(a.GetString(knob.path), b.GetString(knob.path));
        break;
      case KnobType::kList:
        EXPECT_EQ(a.GetList(knob.path), b.GetList(knob.path));
        break;
    }
  }
}

// ---- values --------------------------------------------------------------------------------------

TEST(ConfigTest, DefaultsOnly) {
  absl::StatusOr<Config> config = Load("");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->GetInt("scheduler.max_batch_size"), 32);
  EXPECT_EQ(config->GetDouble("scheduler.prefill_ratio"), 0.5);
  EXPECT_TRUE(config->GetBool("scheduler.chunked_prefill"));
  EXPECT_EQ(config->GetString("kv.dtype"), "bf16");
  EXPECT_EQ(config->GetString("model.path"), "");
  EXPECT_EQ(config->GetDouble("net.timeout_s"), 5.0);
  EXPECT_FALSE(config->GetBool("debug"));
  for (const KnobSpec& knob : TestSchema().knobs()) EXPECT_EQ(config->SourceOf(knob.path), "default");
  EXPECT_TRUE(config->NonDefault().empty());
}

TEST(ConfigTest, EmptyOrCommentOnlyYamlSetsNothing) {
  for (std::string_view yaml :
       {"", "\n\n", "# only a comment\n# and another\n", "---\n", "scheduler:\n  # max_batch_size: 4\n"}) {
    SCOPED_TRACE(yaml);
    absl::StatusOr<Config> config = Load(yaml);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_TRUE(config->NonDefault().empty());
  }
}

TEST(ConfigTest, YamlOverridesDefaults) {
  absl::StatusOr<Config> config = Load(R"(
scheduler:
  max_batch_size: 8
  prefill_ratio: 0.25
  chunked_prefill: false
  policy: priority
kv:
  capacity_tokens: +4096
  dtype: fp8
model:
  path: /models/tiny llama
  name: "007"
net:
  rdma:
    port: -2
  timeout_s: 3
debug: true
)");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->GetInt("scheduler.max_batch_size"), 8);
  EXPECT_EQ(config->GetDouble("scheduler.prefill_ratio"), 0.25);
  EXPECT_FALSE(config->GetBool("scheduler.chunked_prefill"));
  EXPECT_EQ(config->GetString("scheduler.policy"), "priority");
  EXPECT_EQ(config->GetInt("kv.capacity_tokens"), 4096);
  EXPECT_EQ(config->GetString("kv.dtype"), "fp8");
  EXPECT_EQ(config->GetString("model.path"), "/models/tiny llama");
  EXPECT_EQ(config->GetString("model.name"), "007");
  EXPECT_EQ(config->GetInt("net.rdma.port"), -2);
  EXPECT_EQ(config->GetDouble("net.timeout_s"), 3.0);
  EXPECT_TRUE(config->GetBool("debug"));
  EXPECT_EQ(config->SourceOf("kv.dtype"), "deploy.yaml");
  EXPECT_EQ(config->SourceOf("net.rdma.port"), "deploy.yaml");
}

TEST(ConfigTest, DottedKeysAndEmptySections) {
  absl::StatusOr<Config> config = Load("scheduler.max_batch_size: 7\nkv:\nnet:\n  rdma.port: 3\n");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->GetInt("scheduler.max_batch_size"), 7);
  EXPECT_EQ(config->GetInt("net.rdma.port"), 3);
}

TEST(ConfigTest, NumberForms) {
  absl::StatusOr<Config> config =
      Load("scheduler:\n  prefill_ratio: .5e-1\nnet:\n  timeout_s: 1e3\n  rdma:\n    port: 0010\n");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->GetDouble("scheduler.prefill_ratio"), 0.05);
  EXPECT_EQ(config->GetDouble("net.timeout_s"), 1000.0);
  EXPECT_EQ(config->GetInt("net.rdma.port"), 10);  // decimal, not YAML 1.1 octal
  config = Load("scheduler:\n  max_batch_size: 65536\n  prefill_ratio: 1\n");
  ASSERT_TRUE(config.ok()) << config.status();  // bounds are inclusive
  EXPECT_EQ(config->GetInt("scheduler.max_batch_size"), 65536);
  EXPECT_EQ(config->GetDouble("scheduler.prefill_ratio"), 1.0);
}

TEST(ConfigTest, SetOverridesYaml) {
  absl::StatusOr<Config> config = Load("scheduler:\n  max_batch_size: 8\nkv:\n  dtype: fp8\n",
                                       {"scheduler.max_batch_size=16", "model.name='a b'",
                                        "model.path=/x/y=z", " debug = true", "net.timeout_s=1e-3"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->GetInt("scheduler.max_batch_size"), 16);
  EXPECT_EQ(config->SourceOf("scheduler.max_batch_size"), "--set");
  EXPECT_EQ(config->GetString("kv.dtype"), "fp8");
  EXPECT_EQ(config->SourceOf("kv.dtype"), "deploy.yaml");
  EXPECT_EQ(config->GetString("model.name"), "a b");
  EXPECT_EQ(config->GetString("model.path"), "/x/y=z");  // split at the first '='
  EXPECT_TRUE(config->GetBool("debug"));
  EXPECT_EQ(config->GetDouble("net.timeout_s"), 1e-3);
}

TEST(ConfigTest, LastSetWins) {
  absl::StatusOr<Config> config = Load("", {"scheduler.max_batch_size=4", "scheduler.max_batch_size=5"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->GetInt("scheduler.max_batch_size"), 5);
}

TEST(ConfigTest, SourceOfAndNonDefault) {
  // A value equal to its default counts as default, even when set explicitly.
  absl::StatusOr<Config> config = Load(
      "scheduler:\n  max_batch_size: 8\n  prefill_ratio: 0.5\nkv:\n  dtype: fp8\n", {"model.name=big model"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->SourceOf("scheduler.max_batch_size"), "deploy.yaml");
  EXPECT_EQ(config->SourceOf("scheduler.prefill_ratio"), "deploy.yaml");
  EXPECT_EQ(config->SourceOf("model.name"), "--set");
  EXPECT_EQ(config->SourceOf("debug"), "default");
  EXPECT_EQ(config->NonDefault(),
            (std::vector<std::string>{"scheduler.max_batch_size = 8 (deploy.yaml)",
                                      "kv.dtype = fp8 (deploy.yaml)", "model.name = \"big model\" (--set)"}));
}

TEST(ConfigTest, LoadConfigFile) {
  const std::string path = ::testing::TempDir() + "/config_test_deploy.yaml";
  {
    std::ofstream file(path);
    file << "kv:\n  dtype: fp16\n";
  }
  absl::StatusOr<Config> config = LoadConfigFile(TestSchema(), path, {"scheduler.max_batch_size=2"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->GetString("kv.dtype"), "fp16");
  EXPECT_EQ(config->SourceOf("kv.dtype"), path);
  EXPECT_EQ(config->GetInt("scheduler.max_batch_size"), 2);

  {
    std::ofstream file(path);
    file << "kv:\n  dtype: fp32\n";
  }
  ExpectError(LoadConfigFile(TestSchema(), path, {}), absl::StatusCode::kInvalidArgument,
              {path, "kv.dtype", "fp32"});
  std::remove(path.c_str());
}

// ---- errors --------------------------------------------------------------------------------------

TEST(ConfigErrorTest, FileNotFound) {
  ExpectError(LoadConfigFile(TestSchema(), "/nonexistent/deploy.yaml", {}), absl::StatusCode::kNotFound,
              {"/nonexistent/deploy.yaml"});
  ExpectError(LoadConfigFile(TestSchema(), ::testing::TempDir(), {}), absl::StatusCode::kNotFound,
              {::testing::TempDir()});
}

TEST(ConfigErrorTest, UnknownKeySuggestsClosePath) {
  absl::StatusOr<Config> config = Load("scheduler:\n  max_bach_size: 4\n");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().message(),
            "deploy.yaml: unknown key 'scheduler.max_bach_size' "
            "(did you mean 'scheduler.max_batch_size'?)");
}

TEST(ConfigErrorTest, UnknownKeySuggestsSameLastSegment) {
  ExpectInvalid("kv:\n  max_batch_size: 4\n", {"deploy.yaml", "unknown key 'kv.max_batch_size'",
                                               "did you mean 'scheduler.max_batch_size'"});
}

TEST(ConfigErrorTest, UnknownKeyWithoutSuggestionListsKnownKeys) {
  ExpectInvalid("kv:\n  frobnicate: 1\n",
                {"deploy.yaml", "unknown key 'kv.frobnicate'", "capacity_tokens, dtype"});
}

TEST(ConfigErrorTest, UnknownSection) {
  ExpectInvalid("schedular:\n  max_batch_size: 4\n",
                {"deploy.yaml", "unknown key 'schedular'", "did you mean 'scheduler'"});
  ExpectInvalid("frobnicator:\n  x: 1\n", {"deploy.yaml", "unknown key 'frobnicator'"});
}

TEST(ConfigErrorTest, WrongTypeInt) {
  absl::StatusOr<Config> config = Load("scheduler:\n  max_batch_size: many\n");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().message(),
            "deploy.yaml: scheduler.max_batch_size: expected an integer in [1, 65536], got \"many\"");
  for (const char* value : {"1.5", "true", "1e3", "0x10", "\"64\"", "99999999999999999999"}) {
    ExpectInvalid(absl::StrCat("scheduler:\n  max_batch_size: ", value, "\n"),
                  {"deploy.yaml", "scheduler.max_batch_size", "expected an integer"});
  }
  ExpectInvalid("scheduler:\n  max_batch_size: \"64\"\n", {"the quoted string \"64\""});
}

TEST(ConfigErrorTest, IntOutOfRange) {
  ExpectInvalid("scheduler:\n  max_batch_size: 0\n",
                {"deploy.yaml", "scheduler.max_batch_size", "[1, 65536]", "got \"0\""});
  ExpectInvalid("scheduler:\n  max_batch_size: 65537\n", {"scheduler.max_batch_size", "65537"});
  absl::StatusOr<Config> config = Load("", {"kv.capacity_tokens=-3"});
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(config.status().message(), "--set kv.capacity_tokens=-3: expected an integer >= 0, got \"-3\"");
}

TEST(ConfigErrorTest, WrongTypeDouble) {
  for (const char* value :
       {"abc", ".nan", ".inf", "-.inf", "nan", "inf", "true", "1e999", "1.5.2", "'0.5'", "1e"}) {
    ExpectInvalid(absl::StrCat("scheduler:\n  prefill_ratio: ", value, "\n"),
                  {"deploy.yaml", "scheduler.prefill_ratio", "expected a number in [0, 1]"});
  }
  ExpectInvalid("scheduler:\n  prefill_ratio: 1.5\n", {"scheduler.prefill_ratio", "got \"1.5\""});
}

TEST(ConfigErrorTest, WrongTypeBool) {
  for (const char* value : {"yes", "no", "on", "off", "1", "True", "\"true\""}) {
    ExpectInvalid(absl::StrCat("debug: ", value, "\n"), {"deploy.yaml", "debug", "expected true or false"});
  }
}

TEST(ConfigErrorTest, WrongTypeString) {
  ExpectInvalid("model:\n  name: [a, b]\n",
                {"deploy.yaml", "model.name", "expected a string, got a sequence"});
  ExpectInvalid("model:\n  name: {a: b}\n", {"model.name", "expected a string, got a mapping"});
}

TEST(ConfigErrorTest, BadEnumListsChoices) {
  ExpectInvalid("kv:\n  dtype: fp32\n",
                {"deploy.yaml", "kv.dtype", "one of [fp16, bf16, fp8]", "got \"fp32\""});
  ExpectInvalidSet("kv.dtype=FP16", {"kv.dtype", "one of [fp16, bf16, fp8]"});
}

TEST(ConfigErrorTest, NullValue) {
  for (const char* value : {"", "~", "null"}) {
    ExpectInvalid(absl::StrCat("scheduler:\n  max_batch_size: ", value, "\n"),
                  {"deploy.yaml", "scheduler.max_batch_size", "expected a value"});
  }
  ExpectInvalid("model:\n  name:\n", {"model.name", "expected a value"});
  ExpectInvalidSet("scheduler.max_batch_size=", {"expected a value"});
}

TEST(ConfigErrorTest, SectionWhereValueExpected) {
  ExpectInvalid("scheduler:\n  max_batch_size:\n    x: 1\n",
                {"deploy.yaml", "scheduler.max_batch_size", "got a mapping"});
  ExpectInvalid("debug:\n  x: 1\n", {"deploy.yaml", "debug", "got a mapping"});
}

TEST(ConfigErrorTest, ValueWhereSectionExpected) {
  ExpectInvalid("scheduler: 5\n",
                {"deploy.yaml", "scheduler", "expected a section", "max_batch_size", "got \"5\""});
  ExpectInvalid("net:\n  rdma: [1, 2]\n", {"deploy.yaml", "net.rdma", "got a sequence"});
}

TEST(ConfigErrorTest, DuplicateKey) {
  ExpectInvalid("scheduler:\n  max_batch_size: 4\n  max_batch_size: 8\n",
                {"deploy.yaml", "duplicate key 'scheduler.max_batch_size'", "lines 2 and 3"});
  ExpectInvalid("kv:\n  dtype: fp8\nscheduler:\n  policy: fcfs\nkv:\n  capacity_tokens: 1\n",
                {"deploy.yaml", "duplicate key 'kv'", "lines 1 and 5"});
  ExpectInvalid("scheduler.max_batch_size: 4\nscheduler:\n  max_batch_size: 8\n",
                {"deploy.yaml", "duplicate key 'scheduler.max_batch_size'"});
}

TEST(ConfigErrorTest, YamlSyntaxErrorNamesLineAndColumn) {
  ExpectInvalid("scheduler:\n  max_batch_size: 4\n  policy: [fcfs\n",
                {"deploy.yaml", "YAML syntax error", "line 4"});
  ExpectInvalid("scheduler:\n  max_batch_size: 4\n bad: 2\n",
                {"deploy.yaml", "YAML syntax error at line 3, column 2"});
}

TEST(ConfigErrorTest, TopLevelMustBeAMapping) {
  ExpectInvalid("- scheduler\n- kv\n", {"deploy.yaml", "top level", "got a sequence"});
  ExpectInvalid("hello\n", {"deploy.yaml", "top level", "\"hello\""});
  ExpectInvalid("debug: true\n---\ndebug: false\n", {"deploy.yaml", "one YAML document"});
}

TEST(ConfigErrorTest, BadSetForms) {
  ExpectInvalidSet("scheduler.max_batch_size", {"expected path=value"});
  ExpectInvalidSet("=5", {"path before '=' is empty"});
  ExpectInvalidSet(" =5", {"path before '=' is empty"});
  ExpectInvalidSet("scheduler=5", {"'scheduler' is a section", "scheduler.max_batch_size"});
  ExpectInvalidSet("scheduler.max_bach_size=5",
                   {"unknown key 'scheduler.max_bach_size'", "did you mean 'scheduler.max_batch_size'"});
  ExpectInvalidSet("scheduler.policy=[fcfs", {"scheduler.policy", "not a valid YAML scalar"});
  ExpectInvalidSet("scheduler.policy=[fcfs]", {"scheduler.policy", "got a sequence"});
  ExpectInvalidSet("model.name=a: b", {"model.name", "got a mapping"});
  ExpectInvalidSet("debug=yes", {"debug", "expected true or false", "got \"yes\""});
}

TEST(ConfigErrorTest, LoadingIsAllOrNothing) {
  // A valid YAML with one bad override yields no Config at all.
  EXPECT_FALSE(Load("kv:\n  dtype: fp8\n", {"scheduler.max_batch_size=0"}).ok());
}

// ---- dump and help -----------------------------------------------------------------------------

// ---- a real schema: memory.partition of the deployment ------------------------------------------

TEST(DeployPartitionSetting, YamlSetBadValueAndDivisibility) {
  auto load = [](std::string_view yaml, std::vector<std::string> sets = {}) {
    return LoadConfig(DeploySchema(), yaml, "deploy.yaml", sets);
  };
  absl::StatusOr<Config> c = load("compute:\n  device: cpu\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->GetString("memory.partition"), "request");
  c = load("memory:\n  partition: head\n  ranks: 4\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->GetString("memory.partition"), "head");
  c = load("memory:\n  partition: head\n", {"memory.partition=request"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->GetString("memory.partition"), "request");
  EXPECT_EQ(c->SourceOf("memory.partition"), "--set");
  ExpectError(load("memory:\n  partition: tensor\n"), absl::StatusCode::kInvalidArgument,
              {"deploy.yaml", "memory.partition", "one of [request, head]", "got \"tensor\""});
  ExpectError(load("", {"memory.partition=Head"}), absl::StatusCode::kInvalidArgument,
              {"--set memory.partition=Head", "one of [request, head]"});

  // Resolved against the model: head needs a KV head per memory rank.
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");  // 8 query heads, 2 KV heads
  ASSERT_TRUE(spec.ok()) << spec.status();
  for (const auto& [ranks, partition, want] : std::vector<std::tuple<int, std::string, std::string>>{
           {1, "head", ""},
           {2, "head", ""},
           {3, "request", ""},
           {3, "head",
            "memory.partition: head needs a KV head per memory rank: num_key_value_heads (2) < memory.ranks "
            "(3)"},
           {4, "head",
            "memory.partition: head needs a KV head per memory rank: num_key_value_heads (2) < memory.ranks "
            "(4)"}}) {
    SCOPED_TRACE(testing::Message() << ranks << " ranks, " << partition);
    c = load("compute:\n  device: cpu\nmemory:\n  devices: cpu\n",
             {absl::StrCat("memory.ranks=", ranks), "memory.partition=" + partition});
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<DeployPlan> plan = ResolveDeployment(*c, *spec);
    if (want.empty()) {
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_EQ(plan->partition, *ParseAttentionPartition(partition));
      EXPECT_EQ(plan->memory_devices.size(), static_cast<size_t>(ranks));
    } else {
      ASSERT_FALSE(plan.ok());
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(plan.status().message(), want);
    }
  }
}

TEST(ConfigDumpTest, GroupsSectionsAndMarksNonDefaults) {
  absl::StatusOr<Config> config = Load("kv:\n  dtype: fp8\n", {"scheduler.policy=priority"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->DumpYaml(),
            "scheduler:\n"
            "  max_batch_size: 32\n"
            "  prefill_ratio: 0.5\n"
            "  chunked_prefill: true\n"
            "  policy: priority  # from --set\n"
            "kv:\n"
            "  capacity_tokens: 0\n"
            "  dtype: fp8  # from deploy.yaml\n"
            "model:\n"
            "  path: \"\"\n"
            "  name: tiny\n"
            "net:\n"
            "  rdma:\n"
            "    port: 1\n"
            "  timeout_s: 5.0\n"
            "debug: false\n");
}

TEST(ConfigDumpTest, RoundTrip) {
  const std::vector<std::vector<std::string>> cases = {
      {},
      {"scheduler.max_batch_size=65536", "scheduler.prefill_ratio=0.1", "kv.dtype=fp16",
       "model.path='/models/a: b # c'", "model.name=\"line\\nbreak \\\"quoted\\\" back\\\\slash\"",
       "net.rdma.port=-9223372036854775808", "net.timeout_s=1e-300", "debug=true"},
      {"model.name='null'", "model.path=''", "net.timeout_s=-0.0"},
      {"model.name=' padded '", "model.path='-5'", "net.timeout_s=123456789.125"},
      {"model.name='true'", "model.path='~'", "net.timeout_s=0.30000000000000004"},
      {"model.name=\"tab\\there\\x01\"", "model.path=ünïcödé"},
  };
  for (const std::vector<std::string>& overrides : cases) {
    SCOPED_TRACE(absl::StrJoin(overrides, " "));
    absl::StatusOr<Config> config = Load("", overrides);
    ASSERT_TRUE(config.ok()) << config.status();
    const std::string dump = config->DumpYaml();
    absl::StatusOr<Config> reloaded = LoadConfig(TestSchema(), dump, "dump.yaml", {});
    ASSERT_TRUE(reloaded.ok()) << reloaded.status() << "\n" << dump;
    ExpectSameValues(*config, *reloaded);
    EXPECT_EQ(reloaded->DumpYaml().size() > 0, true);
  }
}

TEST(ConfigHelpTest, ListsEveryKnob) {
  const std::string help = TestSchema().HelpText();
  for (const KnobSpec& knob : TestSchema().knobs()) {
    EXPECT_CONTAINS(help, knob.path);
    EXPECT_CONTAINS(help, knob.help);
  }
  EXPECT_CONTAINS(help, "int in [1, 65536]");
  EXPECT_CONTAINS(help, "int >= 0");
  EXPECT_CONTAINS(help, "double in [0, 1]");
  EXPECT_CONTAINS(help, "enum [fp16, bf16, fp8]");
  // Aligned: every row's help starts in the same column.
  const size_t column = help.find("DESCRIPTION");
  EXPECT_EQ(help.find("Most sequences in one step") - help.find("scheduler.max_batch_size"), column);
}

// ---- programmer errors abort ---------------------------------------------------------------------

TEST(ConfigDeathTest, DuplicateRegistration) {
  EXPECT_DEATH(ConfigSchema().Int("a.b", 1, "").Int("a.b", 2, ""), "registered twice");
}

TEST(ConfigDeathTest, SectionAndKnobClash) {
  EXPECT_DEATH(ConfigSchema().Int("a.b", 1, "").Int("a", 2, ""), "either a section or a knob");
  EXPECT_DEATH(ConfigSchema().Int("a", 1, "").Bool("a.b", true, ""), "either a section or a knob");
}

TEST(ConfigDeathTest, InvalidDefaults) {
  EXPECT_DEATH(ConfigSchema().Enum("a", "x", {"y", "z"}, ""), "invalid default");
  EXPECT_DEATH(ConfigSchema().Int("a", 0, "", 1, 10), "invalid default");
  EXPECT_DEATH(ConfigSchema().Double("a", 2.0, "", 0.0, 1.0), "invalid default");
  EXPECT_DEATH(ConfigSchema().Int("a..b", 0, ""), "must be");
}

// ---- list knobs and the deployment's pools (deploy/placement.h) -----------------------------------

absl::StatusOr<Config> LoadDeploy(std::string_view yaml, const std::vector<std::string>& overrides = {}) {
  return LoadConfig(DeploySchema(), yaml, "deploy.yaml", overrides);
}

TEST(ConfigTest, ListKnobsFromYamlAndSetAndDumpRoundTrip) {
  absl::StatusOr<Config> c = LoadDeploy(
      "memory:\n  hosts:\n    - host: node-b\n      devices: [cpu, cpu]\n      device_type: big-ram\n"
      "    - {host: node-c, address: eth1, devices: [cpu]}\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->GetList("memory.hosts"),
            "[{host: node-b, devices: [cpu, cpu], device_type: big-ram}, {host: node-c, address: eth1, "
            "devices: [cpu]}]");
  EXPECT_EQ(c->GetList("compute.hosts"), "[]");
  EXPECT_EQ(c->SourceOf("memory.hosts"), "deploy.yaml");
  absl::StatusOr<Config> again = LoadDeploy(c->DumpYaml());
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << c->DumpYaml();
  EXPECT_EQ(again->GetList("memory.hosts"), c->GetList("memory.hosts"));
  absl::StatusOr<Config> set = LoadDeploy("", {"compute.hosts=[{host: local, devices: [cpu]}]"});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->GetList("compute.hosts"), "[{host: local, devices: [cpu]}]");
  absl::StatusOr<Config> scalar = LoadDeploy("memory:\n  hosts: node-b\n");
  ASSERT_FALSE(scalar.ok());
  EXPECT_CONTAINS(std::string(scalar.status().message()), "memory.hosts: expected a list, got \"node-b\"");
}

TEST(PlacementTest, PoolsGiveOneRankPerDeviceAndTheShorthandOneLocalHost) {
  absl::StatusOr<Config> c = LoadDeploy(
      "compute:\n  hosts: [{host: local, address: 127.0.0.1, devices: [cpu], device_type: c1}]\n"
      "memory:\n  hosts:\n    - {host: node-b, devices: [cpu, cpu], device_type: m1, tandem: /opt/t}\n"
      "    - {host: node-c, address: eth1, devices: [cuda:1]}\n");
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<Placement> p = ResolvePlacement(*c);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->compute.host, "local");
  EXPECT_EQ(p->compute.device_type, "c1");
  ASSERT_EQ(p->memory.size(), 3u);
  EXPECT_EQ(p->memory[1].name, "memory-1");
  EXPECT_EQ(p->memory[1].host, "node-b");
  EXPECT_EQ(p->memory[1].bind, "node-b");  // the host itself when no address is given
  EXPECT_EQ(p->memory[1].tandem, "/opt/t");
  EXPECT_EQ(p->memory[2].bind, "eth1");
  EXPECT_EQ(p->memory[2].device, "cuda:1");
  EXPECT_EQ(p->memory[2].path, "memory.hosts[1].devices[0]");
  EXPECT_FALSE(p->one_host());

  absl::StatusOr<Config> shorthand = LoadDeploy("memory:\n  ranks: 2\n  devices: cpu\n  host: 127.0.0.1\n");
  ASSERT_TRUE(shorthand.ok());
  p = ResolvePlacement(*shorthand);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->memory.size(), 2u);
  EXPECT_TRUE(p->memory[0].local());
  EXPECT_EQ(p->memory[1].bind, "127.0.0.1");
  EXPECT_EQ(p->compute.bind, "127.0.0.1");
  EXPECT_TRUE(p->one_host());
}

TEST(PlacementTest, ErrorsNameTheYamlPath) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"memory:\n  hosts: [{host: a, devices: [cpu]}, {host: b, devices: [[cpu]]}]\n",
       "memory.hosts[1].devices[0]: expected a device"},
      {"memory:\n  hosts: [{host: a, gpus: [cpu]}]\n", "memory.hosts[0]: unknown key 'gpus'"},
      {"memory:\n  hosts: [{host: a}]\n", "memory.hosts[0].devices: expected a non-empty list"},
      {"memory:\n  hosts: [node-a]\n", "memory.hosts[0]: expected a mapping"},
      {"memory:\n  ranks: 2\n  hosts: [{host: a, devices: [cpu]}]\n",
       "memory.ranks: set together with memory.hosts"},
      {"compute:\n  device: cpu\n  hosts: [{host: local, devices: [cpu]}]\n",
       "compute.device: set together with compute.hosts"},
      {"compute:\n  hosts: [{host: local, devices: [cpu, cpu]}]\n", "compute.hosts: 2 devices listed"},
  };
  for (const auto& [yaml, message] : cases) {
    SCOPED_TRACE(yaml);
    absl::StatusOr<Config> c = LoadDeploy(yaml);
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<Placement> p = ResolvePlacement(*c);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_CONTAINS(std::string(p.status().message()), message);
  }
}

TEST(ConfigDeathTest, GetterOfWrongTypeOrUnknownPath) {
  absl::StatusOr<Config> config = Load("");
  ASSERT_TRUE(config.ok());
  EXPECT_DEATH(config->GetInt("kv.dtype"), "kv.dtype");
  EXPECT_DEATH(config->GetBool("no.such.knob"), "no.such.knob");
}

// ---- logging -------------------------------------------------------------------------------------

TEST(LogTest, ParseLogLevel) {
  EXPECT_EQ(ParseLogLevel("debug"), LogLevel::kDebug);
  EXPECT_EQ(ParseLogLevel("info"), LogLevel::kInfo);
  EXPECT_EQ(ParseLogLevel("warn"), LogLevel::kWarn);
  EXPECT_EQ(ParseLogLevel("WARNING"), LogLevel::kWarn);
  EXPECT_EQ(ParseLogLevel("error"), LogLevel::kError);
  EXPECT_EQ(ParseLogLevel("verbose"), std::nullopt);
  EXPECT_EQ(ParseLogLevel(""), std::nullopt);
  for (LogLevel level : {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarn, LogLevel::kError}) {
    EXPECT_EQ(ParseLogLevel(LogLevelName(level)), level);
  }
}

int evaluations = 0;
int CountEvaluation() { return ++evaluations; }

TEST(LogTest, LinesCarryTagSubsystemAndMessage) {
  unsetenv("TANDEM_LOG_LEVEL");
  InitLogging("compute:0", LogLevel::kInfo);
  InitLogging("compute:0", LogLevel::kInfo);  // idempotent
  ::testing::internal::CaptureStderr();
  TANDEM_LOG_INFO("scheduler", "admitted ", 3, " requests");
  TANDEM_LOG_DEBUG("scheduler", "hidden ", CountEvaluation());
  TANDEM_LOG_ERROR("kv", "out of slots");
  const std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_CONTAINS(out, "[compute:0] scheduler: admitted 3 requests");
  EXPECT_CONTAINS(out, "[compute:0] kv: out of slots");
  EXPECT_LACKS(out, "hidden");
  EXPECT_EQ(evaluations, 0) << "arguments of a filtered-out line must not be evaluated";
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 2) << out;
}

TEST(LogTest, LevelFiltering) {
  unsetenv("TANDEM_LOG_LEVEL");
  InitLogging("memory:1", LogLevel::kWarn);
  EXPECT_FALSE(LogEnabled(LogLevel::kInfo));
  EXPECT_TRUE(LogEnabled(LogLevel::kWarn));
  ::testing::internal::CaptureStderr();
  LogLine(LogLevel::kInfo, "transport", "not shown");
  LogLine(LogLevel::kWarn, "transport", "shown");
  const std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_CONTAINS(out, "[memory:1] transport: shown");
  EXPECT_LACKS(out, "not shown");
}

TEST(LogTest, EnvironmentOverridesLevel) {
  setenv("TANDEM_LOG_LEVEL", "error", 1);
  InitLogging("generate", LogLevel::kDebug);
  EXPECT_FALSE(LogEnabled(LogLevel::kWarn));
  EXPECT_TRUE(LogEnabled(LogLevel::kError));

  setenv("TANDEM_LOG_LEVEL", "loud", 1);
  ::testing::internal::CaptureStderr();
  InitLogging("generate", LogLevel::kInfo);
  const std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(LogEnabled(LogLevel::kInfo));
  EXPECT_CONTAINS(out, "TANDEM_LOG_LEVEL='loud'");
  unsetenv("TANDEM_LOG_LEVEL");
  InitLogging("generate", LogLevel::kWarn);
}

// ---- recovery settings, resolved per transport ----------------------------------------------------

// Compute rank 0 recovers lost ranks on ucx and on p2p's device path (with or without compute
// replicas), and the launcher restarts a lost memory rank wherever it does, with rejoin probes on;
// nccl and verbs stop the deployment instead.
TEST(DeployRecoverySettings, PerTransportAndComputeRanks) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  ASSERT_TRUE(spec.ok()) << spec.status();
  struct Case {
    std::string transport;
    int compute_ranks;
    std::string probe;  // launch.rejoin_probe_s
    bool recover;
    int restarts;
    bool replicas;     // recover_compute_replicas with more than one compute rank
    std::string mode;  // pipeline.mode with more than one compute rank
  };
  // nccl: a memory rank's loss and rejoin (restarts), and a replica's loss under fixed, not under
  // rotational (its ring made anew needs a communicator between ranks that had none).
  for (const Case& k : std::vector<Case>{{"ucx", 1, "1", true, 3, true, "fixed"},
                                         {"ucx", 2, "1", true, 3, true, "fixed"},
                                         {"ucx", 3, "1", true, 3, true, "rotational"},
                                         {"p2p", 1, "1", true, 3, true, "fixed"},
                                         {"p2p", 2, "1", true, 3, true, "fixed"},
                                         {"p2p", 3, "0", true, 0, true, "fixed"},
                                         {"p2p", 3, "1", true, 3, true, "rotational"},
                                         {"nccl", 1, "1", true, 3, false, "fixed"},
                                         {"nccl", 2, "1", true, 3, true, "fixed"},
                                         {"nccl", 2, "0", true, 0, true, "fixed"},
                                         {"nccl", 3, "1", true, 3, false, "rotational"},
                                         {"verbs", 1, "1", false, 0, false, "fixed"},
                                         {"verbs", 2, "1", false, 0, false, "fixed"}}) {
    SCOPED_TRACE(testing::Message() << k.transport << ", " << k.compute_ranks << " compute rank(s), "
                                    << k.mode << ", probe " << k.probe);
    const bool gpu = k.transport != "ucx";
    absl::StatusOr<Config> c = LoadConfig(
        DeploySchema(),
        gpu ? "compute:\n  device: cuda:0\nmemory:\n  devices: cuda:1\n" : "compute:\n  device: cpu\n",
        "deploy.yaml",
        {"transport.kind=" + k.transport, absl::StrCat("compute.ranks=", k.compute_ranks),
         k.compute_ranks > 1 ? "pipeline.mode=" + k.mode : "pipeline.mode=pingpong",
         absl::StrCat("pipeline.batches=", std::max(2, k.compute_ranks)), "launch.rejoin_probe_s=" + k.probe,
         // A GPU of its own per replica (nccl needs it): cuda:2, cuda:3.
         gpu && k.compute_ranks > 1
             ? std::string("compute.replica_devices=cuda:2") + (k.compute_ranks > 2 ? ",cuda:3" : "")
             : std::string("compute.replica_devices=auto")});
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<DeployPlan> plan = ResolveDeployment(*c, *spec);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->recover_memory_ranks, k.recover);
    EXPECT_EQ(plan->recover_compute_replicas, k.replicas && k.compute_ranks > 1);
    EXPECT_EQ(plan->restart_memory_ranks, k.restarts);
    // Rejoins (compute rank 0's probes) wherever restarts could apply, whatever their number.
    EXPECT_EQ(plan->memory_rank_rejoins, k.recover && k.probe != "0");
  }
}

// transport.checksums: auto is on except on nccl (its sender's kernel costs over 2% of a decode
// step), true and false as set (YAML's unquoted booleans); anything else is refused naming the path.
TEST(DeployChecksumsSetting, AutoIsOffOnNcclOnly) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  ASSERT_TRUE(spec.ok()) << spec.status();
  for (const std::string transport : {"ucx", "p2p", "nccl"}) {
    for (const std::string setting : {"", "auto", "true", "false"}) {
      SCOPED_TRACE(transport + ", transport.checksums " + (setting.empty() ? "(default)" : setting));
      const bool gpu = transport != "ucx";
      std::string yaml =
          gpu ? "compute:\n  device: cuda:0\nmemory:\n  devices: cuda:1\n" : "compute:\n  device: cpu\n";
      absl::StrAppend(&yaml, "transport:\n  kind: ", transport, "\n");
      if (!setting.empty()) absl::StrAppend(&yaml, "  checksums: ", setting, "\n");
      absl::StatusOr<Config> c = LoadConfig(DeploySchema(), yaml, "deploy.yaml", {});
      ASSERT_TRUE(c.ok()) << c.status();
      const bool want = setting == "true" || ((setting.empty() || setting == "auto") && transport != "nccl");
      EXPECT_EQ(ChecksumsOn(*c, transport::ParseTransportKind(transport).value()), want);
      absl::StatusOr<DeployPlan> plan = ResolveDeployment(*c, *spec);
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_EQ(plan->checksums, want);
    }
  }
  const absl::StatusOr<Config> bad =
      LoadConfig(DeploySchema(), "transport:\n  checksums: yes\n", "deploy.yaml", {});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("transport.checksums"), std::string::npos)
      << bad.status();
  EXPECT_NE(std::string(bad.status().message()).find("auto"), std::string::npos) << bad.status();
}

}  // namespace
}  // namespace tandem
