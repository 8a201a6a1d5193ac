// Workloads for `tandem bench`: the requests to replay, with token ids, output lengths and (before
// an arrival process is applied, loadgen/arrivals.h) the trace's own arrival offsets.
//
// Contract:
//   * Traces (ReadTrace): Azure LLM inference 2023 CSV (`TIMESTAMP,ContextTokens,
//     GeneratedTokens`, timestamps "YYYY-MM-DD HH:MM:SS.fffffff") and Mooncake JSON lines
//     (`timestamp` in ms, `input_length`, `output_length`, `hash_ids`). Every malformed row is
//     an InvalidArgument naming the file and its 1-based line ("trace.csv:17: ContextTokens:
//     expected a non-negative integer, got \"x\""). Only lengths and times are in a trace.
//   * Prompts (MakeTraceWorkload): token ids are made, never read. Mooncake `hash_ids` name
//     prefix blocks of `block_tokens` tokens; block h is the same token sequence in every request
//     that lists h (a pure function of h and the seed), so two requests sharing their first k ids
//     share k blocks of prompt and the engine's prefix cache really hits. Azure rows (no ids)
//     get tokens unique to the request. Ids lie in [first_token_id, vocab) and avoid the model's
//     EOS ids.
//   * Caps: prompts longer than `max_input` keep their first max_input tokens, outputs are
//     capped at `max_output`, and then any prompt + output beyond the model's context
//     (`max_context`) loses prompt tokens from its end; each cap is counted in `notes`, which the
//     bench prints and writes with its results.
//   * Synthetic workloads: fixed lengths; a shared system prompt of P tokens + a unique S-token
//     suffix; multi-turn sessions (turn k+1 is sent `think_s` after turn k finishes, and its
//     prompt is turn k's prompt + turn k's generated tokens + `new_tokens` new ones, so it
//     extends the previous context exactly, as a chat does).
//
// Thread safety: values only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::loadgen {

// One row of a trace.
struct TraceRow {
  double time_s = 0;  // arrival offset from the trace's first row
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  std::vector<int64_t> hash_ids;  // Mooncake prefix blocks (empty for Azure)
  int64_t line = 0;               // 1-based line in the file
};

enum class TraceFormat { kAzure, kMooncake };

// Reads rows [skip, skip + limit) of a trace (limit 0: all). The format comes from the content:
// a CSV header "TIMESTAMP,ContextTokens,GeneratedTokens", or JSON objects. NotFound for a file
// that cannot be read; InvalidArgument naming file:line for a malformed row.
absl::StatusOr<std::vector<TraceRow>> ReadTrace(const std::string& path, int64_t skip, int64_t limit,
                                                TraceFormat* format = nullptr);
// The same from text (`path` only names it in errors).
absl::StatusOr<std::vector<TraceRow>> ParseTrace(const std::string& text, const std::string& path,
                                                 int64_t skip, int64_t limit, TraceFormat* format = nullptr);

// One request to send.
struct BenchRequest {
  double trace_time_s = 0;      // arrival offset from the workload (traces); 0 for synthetic
  std::vector<int32_t> prompt;  // full prompt; for a later turn of a session, only its new tokens
  int64_t max_tokens = 1;
  int64_t session = -1;  // >= 0: a turn of a multi-turn session
  int64_t turn = 0;      // 0 for the first turn
  double think_s = 0;    // later turns: delay after the previous turn ends
};

struct Workload {
  std::string name;  // "azure_llm_conv_2023.csv", "synthetic fixed", ...
  std::vector<BenchRequest> requests;
  std::vector<std::string> notes;    // caps and truncations applied, one line each
  int64_t shared_prefix_tokens = 0;  // synthetic shared-prefix: P
};

struct TokenSpace {
  int64_t vocab_size = 32000;
  int32_t first_token_id = 3;  // ids below are left out (BOS, EOS, UNK in Llama vocabularies)
  std::vector<int32_t> avoid;  // e.g. the model's EOS ids
  uint64_t seed = 0;
};

struct Caps {
  int64_t max_input = 0;    // 0: none
  int64_t max_output = 0;   // 0: none
  int64_t max_context = 0;  // the model's max_position; 0: none
};

// Turns trace rows into requests. `length_scale` multiplies every length (and the Mooncake block
// size, default 512 tokens) before the caps, for running a trace's shape on a small model;
// lengths round up to at least 1.
absl::StatusOr<Workload> MakeTraceWorkload(const std::string& name, TraceFormat format,
                                           const std::vector<TraceRow>& rows, const TokenSpace& tokens,
                                           const Caps& caps, double length_scale = 1.0,
                                           int64_t block_tokens = 512);

// n requests of `input` prompt tokens (unique per request) and `output` tokens.
Workload MakeFixedWorkload(int64_t n, int64_t input, int64_t output, const TokenSpace& tokens);
// n requests: the same `prefix` tokens, then `suffix` tokens unique to each, and `output` tokens.
Workload MakeSharedPrefixWorkload(int64_t n, int64_t prefix, int64_t suffix, int64_t output,
                                  const TokenSpace& tokens);
// `sessions` conversations of `turns` turns: `input` new tokens per turn (the first turn also
// gets the `prefix` tokens every session shares), `output` tokens each, `think_s` between turns.
Workload MakeMultiTurnWorkload(int64_t sessions, int64_t turns, int64_t prefix, int64_t input, int64_t output,
                               double think_s, const TokenSpace& tokens);

// Applies `caps` to a workload built elsewhere (the synthetic makers do not cap), adding notes.
void ApplyCaps(const Caps& caps, Workload* w);

}  // namespace tandem::loadgen
