// Configuration: one table of knobs per program drives YAML parsing, `--set a.b=c` overrides,
// `--help` text and the dump of the effective configuration (after UCX's config tables and
// NCCL_PARAM). Precedence: defaults < YAML file < --set overrides, applied in that order.
//
// Every error names the knob's dotted path (the YAML path) and where the value came from:
//   deploy.yaml: scheduler.max_batch_size: expected an integer in [1, 65536], got "many"
//   deploy.yaml: unknown key 'scheduler.max_bach_size' (did you mean 'scheduler.max_batch_size'?)
//   --set kv.capacity_tokens=-3: expected an integer >= 0, got "-3"
// Loading is all-or-nothing: on any error no Config is returned; the first error is reported.
//
// What the loader accepts (strict on purpose; a typo must not silently fall back to a default):
//   - The YAML is one document whose top level is a mapping; an empty file or one of only comments
//     sets nothing. Sections nest ("scheduler:\n  max_batch_size: 64"); a dotted key
//     ("scheduler.max_batch_size: 64") is the same knob. "section:" with no keys is an empty section.
//   - Unknown keys, a mapping where a value is expected, a scalar or sequence where a section is
//     expected, a key given twice (also once dotted and once nested) and a null value ("key:",
//     "~", "null") are errors. Unknown keys get a "did you mean" suggestion.
//   - int: decimal digits with an optional sign (no 1.5, 0x10, 1e3, true). double: a decimal or
//     exponent number, finite (no .nan, .inf). bool: exactly true or false (no yes/no/on/off).
//     Numbers and booleans must be plain: "64" in quotes is a string and is refused for an int.
//     string: any scalar (quote it to keep "null", "~", leading/trailing spaces, ": " or " #").
//     enum: one of the choices, case-sensitive. Bounds are inclusive. list: a YAML sequence
//     (--set takes a flow sequence: --set 'memory.hosts=[{host: a, devices: [cpu]}]').
//   - --set a.b=c splits at the first '='; c is parsed as one YAML scalar with the rules above
//     (so --set model.name='a b' and --set x.y="" work; a later --set of the same path wins).
// Errors for YAML syntax carry the line and column: "deploy.yaml: YAML syntax error at line 3,
// column 5: ...". The file's own name (as passed) is the source.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem {

// kList: a YAML sequence (of scalars or mappings), kept as its flow-style YAML text ("[]" when
// empty); the code that reads it checks its elements and names their paths ("memory.hosts[1].devices").
enum class KnobType : uint8_t { kInt, kDouble, kBool, kString, kEnum, kList };

struct KnobSpec {
  std::string path;  // dotted YAML path, e.g. "scheduler.max_batch_size"
  KnobType type = KnobType::kString;
  std::string default_value;  // text read as a plain YAML scalar (kString: as is); checked on Add
  std::string help;
  std::vector<std::string> choices;  // kEnum: the allowed values
  std::optional<double> min, max;    // kInt, kDouble: inclusive bounds
};

// The set of knobs a program understands. Paths are '.'-separated names of letters, digits, '_'
// and '-'; they must be unique and none may be a prefix of another knob's path segment-wise (a
// path is either a section or a leaf). Breaking these rules, or a default that fails the knob's
// own type, bounds or choices, is a programmer error and aborts (TANDEM_CHECK).
// Not thread-safe while knobs are added; const use from many threads is fine.
class ConfigSchema {
 public:
  ConfigSchema& Int(std::string path, int64_t def, std::string help, std::optional<double> min = std::nullopt,
                    std::optional<double> max = std::nullopt);
  ConfigSchema& Double(std::string path, double def, std::string help,
                       std::optional<double> min = std::nullopt, std::optional<double> max = std::nullopt);
  ConfigSchema& Bool(std::string path, bool def, std::string help);
  ConfigSchema& String(std::string path, std::string def, std::string help);
  ConfigSchema& Enum(std::string path, std::string def, std::vector<std::string> choices, std::string help);
  // A list knob; its default is the empty list.
  ConfigSchema& List(std::string path, std::string help);

  const std::vector<KnobSpec>& knobs() const { return knobs_; }
  const KnobSpec* Find(std::string_view path) const;
  // An aligned table of every knob, one per line under a header: path, type (with bounds or
  // choices, e.g. "int in [1, 65536]", "enum [fp16, bf16]"), default, help.
  std::string HelpText() const;

 private:
  ConfigSchema& Add(KnobSpec spec);  // aborts on a programmer error (duplicate, bad default)
  std::vector<KnobSpec> knobs_;
};

// Resolved values, one per knob of the schema. Getters abort if the path is not a knob of that
// type (a programmer error); values were validated on load.
class Config {
 public:
  int64_t GetInt(std::string_view path) const;
  double GetDouble(std::string_view path) const;
  bool GetBool(std::string_view path) const;
  const std::string& GetString(std::string_view path) const;  // kString and kEnum
  // kList: the sequence as flow-style YAML text ("[]", "[{host: a, devices: [cpu]}]").
  const std::string& GetList(std::string_view path) const;
  // Where a value came from: "default", the YAML file's name, or "--set".
  const std::string& SourceOf(std::string_view path) const;
  // The effective configuration as YAML: every knob, grouped by section in schema order, with
  // "# from <source>" after each value that differs from its default. Loading the dump yields the
  // same values.
  std::string DumpYaml() const;
  // Lines "path = value (source)" for values that differ from the default (a value set explicitly
  // to its default is not listed), in schema order; for start-up logs.
  std::vector<std::string> NonDefault() const;

 private:
  friend class ConfigLoader;
  struct Value {
    KnobType type;
    int64_t i = 0;
    double d = 0;
    bool b = false;
    std::string s;
    std::string source = "default";
    bool is_default = true;
  };
  const Value& At(std::string_view path, KnobType t) const;
  const ConfigSchema* schema_ = nullptr;  // must outlive the Config
  std::map<std::string, Value, std::less<>> values_;
};

// Builds a Config from the schema's defaults, then the YAML text (if non-empty; `yaml_source`
// names it in errors, e.g. the file name), then the overrides ("a.b=c" each, values parsed as
// YAML scalars). Unknown keys, a section where a value is expected (or the reverse), wrong types
// and out-of-range values are InvalidArgument naming the path and the source.
absl::StatusOr<Config> LoadConfig(const ConfigSchema& schema, std::string_view yaml_text,
                                  std::string_view yaml_source, const std::vector<std::string>& overrides);
// Same, reading the YAML from `path` (NotFound naming the path if it cannot be read).
absl::StatusOr<Config> LoadConfigFile(const ConfigSchema& schema, const std::string& path,
                                      const std::vector<std::string>& overrides);

}  // namespace tandem
