#include "loadgen/workload.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace tandem::loadgen {

namespace {

absl::Status RowError(const std::string& path, int64_t line, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ":", line, ": ", what));
}

// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's days_from_civil).
int64_t DaysFromCivil(int64_t y, int64_t m, int64_t d) {
  y -= m <= 2;
  const int64_t era = (y >= 0 ? y : y - 399) / 400;
  const int64_t yoe = y - era * 400;
  const int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + doe - 719468;
}

// "2023-11-16 18:15:46.6805900" -> seconds since the epoch; false when malformed.
bool ParseAzureTime(absl::string_view s, double* out) {
  std::vector<absl::string_view> dt = absl::StrSplit(s, ' ');
  if (dt.size() != 2) return false;
  std::vector<absl::string_view> ymd = absl::StrSplit(dt[0], '-');
  std::vector<absl::string_view> hms = absl::StrSplit(dt[1], ':');
  if (ymd.size() != 3 || hms.size() != 3) return false;
  int64_t y, mo, d, h, mi;
  double sec;
  if (!absl::SimpleAtoi(ymd[0], &y) || !absl::SimpleAtoi(ymd[1], &mo) || !absl::SimpleAtoi(ymd[2], &d) ||
      !absl::SimpleAtoi(hms[0], &h) || !absl::SimpleAtoi(hms[1], &mi) || !absl::SimpleAtod(hms[2], &sec))
    return false;
  if (mo < 1 || mo > 12 || d < 1 || d > 31 || h < 0 || h > 23 || mi < 0 || mi > 59 || !(sec >= 0) ||
      sec >= 61)
    return false;
  *out =
      static_cast<double>(DaysFromCivil(y, mo, d)) * 86400.0 + static_cast<double>(h * 3600 + mi * 60) + sec;
  return true;
}

bool ParseCount(absl::string_view s, int64_t* out) {
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(s), out) && *out >= 0;
}

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Token i of a stream named by (kind, id): a pure function, so equal names give equal tokens.
int32_t TokenAt(const TokenSpace& t, uint64_t kind, uint64_t id, uint64_t i) {
  const int64_t span = std::max<int64_t>(1, t.vocab_size - t.first_token_id);
  uint64_t h =
      SplitMix(t.seed ^ SplitMix(kind * 0x100000001b3ULL ^ SplitMix(id) ^ (i * 0x9e3779b97f4a7c15ULL)));
  for (int tries = 0; tries < 16; ++tries) {
    const int32_t tok =
        static_cast<int32_t>(t.first_token_id + static_cast<int64_t>(h % static_cast<uint64_t>(span)));
    if (std::find(t.avoid.begin(), t.avoid.end(), tok) == t.avoid.end()) return tok;
    h = SplitMix(h);
  }
  return t.first_token_id;
}

enum Stream : uint64_t { kUnique = 1, kBlock = 2, kPrefix = 3, kTurn = 4 };

void Append(const TokenSpace& t, uint64_t kind, uint64_t id, int64_t n, std::vector<int32_t>* out,
            int64_t from = 0) {
  for (int64_t i = 0; i < n; ++i) out->push_back(TokenAt(t, kind, id, static_cast<uint64_t>(from + i)));
}

int64_t Scaled(int64_t n, double scale) {
  if (scale == 1.0) return n;
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(static_cast<double>(n) * scale)));
}

}  // namespace

absl::StatusOr<std::vector<TraceRow>> ParseTrace(const std::string& text, const std::string& path,
                                                 int64_t skip, int64_t limit, TraceFormat* format) {
  std::vector<TraceRow> rows;
  std::istringstream in(text);
  std::string line;
  int64_t lineno = 0;
  bool have_format = false;
  TraceFormat fmt = TraceFormat::kAzure;
  int64_t data_rows = 0;
  double t0 = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    if (!have_format) {
      have_format = true;
      if (absl::StartsWith(absl::StripLeadingAsciiWhitespace(line), "{")) {
        fmt = TraceFormat::kMooncake;
      } else if (absl::StripAsciiWhitespace(line) == "TIMESTAMP,ContextTokens,GeneratedTokens") {
        fmt = TraceFormat::kAzure;
        continue;
      } else {
        return RowError(
            path, lineno,
            "not a known trace: expected the CSV header \"TIMESTAMP,ContextTokens,GeneratedTokens\" "
            "(Azure 2023) or JSON lines (Mooncake)");
      }
    }
    const int64_t index = data_rows++;
    if (index < skip) continue;
    if (limit > 0 && index >= skip + limit) break;
    TraceRow r;
    r.line = lineno;
    double t = 0;
    if (fmt == TraceFormat::kAzure) {
      std::vector<absl::string_view> f = absl::StrSplit(line, ',');
      if (f.size() != 3) return RowError(path, lineno, absl::StrCat("expected 3 fields, got ", f.size()));
      if (!ParseAzureTime(f[0], &t))
        return RowError(
            path, lineno,
            absl::StrCat("TIMESTAMP: expected \"YYYY-MM-DD HH:MM:SS.fff\", got \"", std::string(f[0]), "\""));
      if (!ParseCount(f[1], &r.input_tokens))
        return RowError(
            path, lineno,
            absl::StrCat("ContextTokens: expected a non-negative integer, got \"", std::string(f[1]), "\""));
      if (!ParseCount(f[2], &r.output_tokens))
        return RowError(path, lineno,
                        absl::StrCat("GeneratedTokens: expected a non-negative integer, got \"",
                                     std::string(f[2]), "\""));
    } else {
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded() || !j.is_object()) return RowError(path, lineno, "not a JSON object");
      auto count = [&](const char* key, int64_t* out) -> absl::Status {
        if (!j.contains(key)) return RowError(path, lineno, absl::StrCat("missing key '", key, "'"));
        const nlohmann::json& v = j[key];
        if (!v.is_number_integer() || v.get<int64_t>() < 0)
          return RowError(path, lineno,
                          absl::StrCat(key, ": expected a non-negative integer, got ", v.dump()));
        *out = v.get<int64_t>();
        return absl::OkStatus();
      };
      int64_t ms = 0;
      if (j.contains("timestamp") && j["timestamp"].is_number() && !j["timestamp"].is_number_integer()) {
        if (!(j["timestamp"].get<double>() >= 0))
          return RowError(path, lineno, "timestamp: expected a non-negative number");
        t = j["timestamp"].get<double>() / 1e3;
      } else {
        if (absl::Status s = count("timestamp", &ms); !s.ok()) return s;
        t = static_cast<double>(ms) / 1e3;
      }
      if (absl::Status s = count("input_length", &r.input_tokens); !s.ok()) return s;
      if (absl::Status s = count("output_length", &r.output_tokens); !s.ok()) return s;
      if (j.contains("hash_ids")) {
        const nlohmann::json& h = j["hash_ids"];
        if (!h.is_array()) return RowError(path, lineno, "hash_ids: expected a list of integers");
        for (const nlohmann::json& id : h) {
          if (!id.is_number_integer() || id.get<int64_t>() < 0)
            return RowError(path, lineno,
                            absl::StrCat("hash_ids: expected non-negative integers, got ", id.dump()));
          r.hash_ids.push_back(id.get<int64_t>());
        }
      }
    }
    if (r.input_tokens < 1) return RowError(path, lineno, "the prompt has no tokens");
    if (rows.empty()) t0 = t;
    if (t < t0) return RowError(path, lineno, "timestamps go backwards (rows must be in arrival order)");
    r.time_s = t - t0;
    rows.push_back(std::move(r));
  }
  if (!have_format) return absl::InvalidArgumentError(absl::StrCat(path, ": empty trace"));
  if (rows.empty())
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": no rows in the range asked for (", data_rows, " rows)"));
  if (format != nullptr) *format = fmt;
  return rows;
}

absl::StatusOr<std::vector<TraceRow>> ReadTrace(const std::string& path, int64_t skip, int64_t limit,
                                                TraceFormat* format) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read the trace"));
  std::stringstream text;
  text << in.rdbuf();
  return ParseTrace(text.str(), path, skip, limit, format);
}

void ApplyCaps(const Caps& caps, Workload* w) {
  int64_t cut_in = 0, cut_out = 0, cut_ctx = 0;
  for (BenchRequest& r : w->requests) {
    if (caps.max_input > 0 && static_cast<int64_t>(r.prompt.size()) > caps.max_input) {
      r.prompt.resize(static_cast<size_t>(caps.max_input));
      ++cut_in;
    }
    if (caps.max_output > 0 && r.max_tokens > caps.max_output) {
      r.max_tokens = caps.max_output;
      ++cut_out;
    }
    if (caps.max_context > 0 && r.turn == 0 &&
        static_cast<int64_t>(r.prompt.size()) + r.max_tokens > caps.max_context) {
      r.max_tokens = std::min(r.max_tokens, caps.max_context - 1);
      r.prompt.resize(static_cast<size_t>(std::max<int64_t>(1, caps.max_context - r.max_tokens)));
      ++cut_ctx;
    }
  }
  const size_t n = w->requests.size();
  if (cut_in > 0)
    w->notes.push_back(
        absl::StrCat(cut_in, " of ", n, " prompts cut to --max-input ", caps.max_input, " tokens"));
  if (cut_out > 0)
    w->notes.push_back(
        absl::StrCat(cut_out, " of ", n, " outputs capped at --max-output ", caps.max_output, " tokens"));
  if (cut_ctx > 0)
    w->notes.push_back(absl::StrCat(cut_ctx, " of ", n, " prompts truncated to fit the model's context (",
                                    caps.max_context, " tokens with the output)"));
}

absl::StatusOr<Workload> MakeTraceWorkload(const std::string& name, TraceFormat format,
                                           const std::vector<TraceRow>& rows, const TokenSpace& tokens,
                                           const Caps& caps, double length_scale, int64_t block_tokens) {
  if (!(length_scale > 0)) return absl::InvalidArgumentError("--length-scale must be positive");
  Workload w;
  w.name = name;
  const int64_t block = Scaled(block_tokens, length_scale);
  int64_t with_ids = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const TraceRow& row = rows[i];
    BenchRequest r;
    r.trace_time_s = row.time_s;
    r.max_tokens = std::max<int64_t>(1, Scaled(row.output_tokens, length_scale));
    const int64_t input = Scaled(row.input_tokens, length_scale);
    r.prompt.reserve(static_cast<size_t>(input));
    if (format == TraceFormat::kMooncake && !row.hash_ids.empty()) {
      ++with_ids;
      for (int64_t h : row.hash_ids) {
        const int64_t n = std::min<int64_t>(block, input - static_cast<int64_t>(r.prompt.size()));
        if (n <= 0) break;
        Append(tokens, kBlock, static_cast<uint64_t>(h), n, &r.prompt);
      }
    }
    // Whatever the blocks do not cover is the request's own.
    Append(tokens, kUnique, i, input - static_cast<int64_t>(r.prompt.size()), &r.prompt);
    w.requests.push_back(std::move(r));
  }
  if (length_scale != 1.0) {
    w.notes.push_back(absl::StrCat("lengths scaled by ", length_scale,
                                   format == TraceFormat::kMooncake
                                       ? absl::StrCat(" (prefix blocks of ", block, " tokens)")
                                       : std::string()));
  }
  if (with_ids > 0)
    w.notes.push_back(absl::StrCat(with_ids, " prompts built from hash_ids blocks of ", block, " tokens"));
  ApplyCaps(caps, &w);
  return w;
}

Workload MakeFixedWorkload(int64_t n, int64_t input, int64_t output, const TokenSpace& tokens) {
  Workload w;
  w.name = absl::StrCat("synthetic fixed (", input, " in, ", output, " out)");
  for (int64_t i = 0; i < n; ++i) {
    BenchRequest r;
    Append(tokens, kUnique, static_cast<uint64_t>(i), input, &r.prompt);
    r.max_tokens = output;
    w.requests.push_back(std::move(r));
  }
  return w;
}

Workload MakeSharedPrefixWorkload(int64_t n, int64_t prefix, int64_t suffix, int64_t output,
                                  const TokenSpace& tokens) {
  Workload w;
  w.name =
      absl::StrCat("synthetic shared prefix (", prefix, " shared + ", suffix, " own in, ", output, " out)");
  w.shared_prefix_tokens = prefix;
  for (int64_t i = 0; i < n; ++i) {
    BenchRequest r;
    Append(tokens, kPrefix, 0, prefix, &r.prompt);
    Append(tokens, kUnique, static_cast<uint64_t>(i), suffix, &r.prompt);
    r.max_tokens = output;
    w.requests.push_back(std::move(r));
  }
  return w;
}

Workload MakeMultiTurnWorkload(int64_t sessions, int64_t turns, int64_t prefix, int64_t input, int64_t output,
                               double think_s, const TokenSpace& tokens) {
  Workload w;
  w.name = absl::StrCat("synthetic multi-turn (", sessions, " sessions x ", turns, " turns, ", prefix,
                        " shared + ", input, " new in per turn, ", output, " out)");
  w.shared_prefix_tokens = prefix;
  for (int64_t s = 0; s < sessions; ++s) {
    for (int64_t t = 0; t < turns; ++t) {
      BenchRequest r;
      r.session = s;
      r.turn = t;
      r.think_s = t == 0 ? 0 : think_s;
      if (t == 0) Append(tokens, kPrefix, 0, prefix, &r.prompt);
      Append(tokens, kTurn, static_cast<uint64_t>(s * 1000003 + t), input, &r.prompt);
      r.max_tokens = output;
      w.requests.push_back(std::move(r));
    }
  }
  return w;
}

}  // namespace tandem::loadgen
