#include "planner/devices.h"

#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "yaml-cpp/yaml.h"

namespace tandem::planner {

namespace {

constexpr double kGB = 1e9;
constexpr double kTB = 1e12;

std::string_view BaseName(std::string_view name) {
  const size_t at = name.find('@');
  return at == std::string_view::npos ? name : name.substr(0, at);
}

}  // namespace

const std::vector<DeviceSpec>& KnownDevices() {
  static const std::vector<DeviceSpec>* devices = new std::vector<DeviceSpec>{
      {"h100", 80 * kGB, 3.11 * kTB, 795 * kTB, 390 * kGB,
       "measured on the lent H100 80GB (read 3.11 TB/s, bf16 GEMM ~795 TFLOP/s); link: the H200 pair's "
       "NVLink peer copy (390 GB/s)"},
      {"h200", 141 * kGB, 4.6 * kTB, 790 * kTB, 390 * kGB,
       "measured on the lent H200 (read 4.38-4.71 TB/s, bf16 GEMM ~790 TFLOP/s, NVLink peer copy 390 GB/s)"},
      {"a100-80g", 80 * kGB, 1.935 * kTB, 312 * kTB, 25 * kGB,
       "Lamina Table 1 (80 GB, 1935 GB/s), NVIDIA datasheet (312 TFLOP/s bf16); link: a 200 Gb/s NIC"},
      {"h20", 96 * kGB, 4.0 * kTB, 148 * kTB, 25 * kGB,
       "vendor figures (96 GB, 4.0 TB/s, 148 TFLOP/s bf16); link: a 200 Gb/s NIC"},
      {"tpu-v6e", 32 * kGB, 1.64 * kTB, 918 * kTB, 25 * kGB,
       "Google Cloud TPU v6e figures (32 GB HBM, 1640 GB/s, 918 TFLOP/s bf16); link: a 200 Gb/s NIC"},
      {"rtx3090", 24 * kGB, 0.9362 * kTB, 71 * kTB, 25 * kGB,
       "Lamina Table 1 (24 GB, 936.2 GB/s), NVIDIA figures (71 TFLOP/s bf16 tensor); link: PCIe 4.0 x16"},
      {"rx7900xtx", 24 * kGB, 0.96 * kTB, 123 * kTB, 25 * kGB,
       "Lamina Table 1 (24 GB, 960 GB/s), AMD figures (123 TFLOP/s fp16); link: PCIe 4.0 x16"},
      {"arc-a770", 16 * kGB, 0.56 * kTB, 0, 25 * kGB,
       "Lamina Table 1 (16 GB, 560 GB/s); FLOP/s not given (a memory role only); link: PCIe 4.0 x16"},
  };
  return *devices;
}

absl::StatusOr<DeviceSpec> FindDevice(std::string_view name) {
  const std::string_view base = BaseName(name);
  std::vector<std::string> names;
  for (const DeviceSpec& d : KnownDevices()) {
    if (d.name == base) return d;
    names.push_back(d.name);
  }
  return absl::NotFoundError(
      absl::StrCat("unknown device \"", std::string(base), "\" (known: ", absl::StrJoin(names, ", "), ")"));
}

absl::StatusOr<PriceOffer> PriceTable::Find(std::string_view name) const {
  std::vector<std::string> names;
  for (const PriceOffer& o : offers) {
    if (o.name == name) return o;
    names.push_back(o.name);
  }
  return absl::NotFoundError(absl::StrCat(path, ": no price for \"", std::string(name),
                                          "\" (priced: ", absl::StrJoin(names, ", "), ")"));
}

absl::StatusOr<double> PriceTable::HourlyUsd(std::string_view name) const {
  absl::StatusOr<PriceOffer> o = Find(name);
  if (!o.ok()) return o.status();
  if (o->usd_per_hour > 0) return o->usd_per_hour;
  return o->usd_purchase / (amortize_years * 365.0 * 24.0);
}

absl::StatusOr<PriceTable> ParsePriceTable(std::string_view yaml, const std::string& path) {
  PriceTable t;
  t.path = path;
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ":", e.mark.line + 1, ": ", e.msg));
  }
  if (!root.IsMap()) return absl::InvalidArgumentError(absl::StrCat(path, ": expected a mapping at the top"));
  try {
    for (const auto& kv : root) {
      const std::string key = kv.first.as<std::string>();
      if (key != "date" && key != "amortize_years" && key != "offers" && key != "notes")
        return absl::InvalidArgumentError(absl::StrCat(path, ": unknown key '", key, "'"));
    }
    if (!root["date"]) return absl::InvalidArgumentError(absl::StrCat(path, ": 'date' is required"));
    t.date = root["date"].as<std::string>();
    if (root["amortize_years"]) t.amortize_years = root["amortize_years"].as<double>();
    if (!(t.amortize_years > 0))
      return absl::InvalidArgumentError(absl::StrCat(path, ": 'amortize_years' must be positive"));
    const YAML::Node offers = root["offers"];
    if (!offers || !offers.IsSequence() || offers.size() == 0)
      return absl::InvalidArgumentError(absl::StrCat(path, ": 'offers' must be a non-empty list"));
    std::set<std::string> seen;
    for (size_t i = 0; i < offers.size(); ++i) {
      const YAML::Node o = offers[i];
      std::string where = absl::StrCat(path, ": offers[", i, "]");
      if (!o.IsMap()) return absl::InvalidArgumentError(absl::StrCat(where, ": expected a mapping"));
      PriceOffer p;
      if (!o["name"]) return absl::InvalidArgumentError(absl::StrCat(where, ": 'name' is required"));
      p.name = o["name"].as<std::string>();
      where = absl::StrCat(where, " (", p.name, ")");
      for (const auto& kv : o) {
        const std::string key = kv.first.as<std::string>();
        if (key != "name" && key != "usd_per_hour" && key != "usd_purchase" && key != "source" &&
            key != "estimate")
          return absl::InvalidArgumentError(absl::StrCat(where, ": unknown key '", key, "'"));
      }
      if (!seen.insert(p.name).second)
        return absl::InvalidArgumentError(absl::StrCat(where, ": duplicate name"));
      if (o["usd_per_hour"]) p.usd_per_hour = o["usd_per_hour"].as<double>();
      if (o["usd_purchase"]) p.usd_purchase = o["usd_purchase"].as<double>();
      if ((p.usd_per_hour > 0) == (p.usd_purchase > 0) || p.usd_per_hour < 0 || p.usd_purchase < 0)
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": give exactly one positive price, usd_per_hour or usd_purchase"));
      if (!o["source"] || o["source"].as<std::string>().empty())
        return absl::InvalidArgumentError(absl::StrCat(where, ": 'source' is required"));
      p.source = o["source"].as<std::string>();
      if (o["estimate"]) p.estimate = o["estimate"].as<bool>();
      t.offers.push_back(std::move(p));
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ":", e.mark.line + 1, ": ", e.msg));
  }
  return t;
}

absl::StatusOr<PriceTable> LoadPriceTable(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read the price table"));
  std::stringstream text;
  text << in.rdbuf();
  return ParsePriceTable(text.str(), path);
}

absl::StatusOr<DevicesCost> PriceDevices(const PriceTable& table, const std::string& compute,
                                         int compute_count, const std::string& memory, int memory_count) {
  if (compute_count < 1) return absl::InvalidArgumentError("--compute-count must be at least 1");
  if (memory_count < 0) return absl::InvalidArgumentError("--memory-count must not be negative");
  if (memory_count > 0 && memory.empty())
    return absl::InvalidArgumentError("--memory-count > 0 needs --memory-device");
  DevicesCost c;
  c.table_date = table.date;
  c.table_path = table.path;
  auto add = [&](const std::string& name, int count) -> absl::Status {
    absl::StatusOr<PriceOffer> o = table.Find(name);
    if (!o.ok()) return o.status();
    absl::StatusOr<double> h = table.HourlyUsd(name);
    if (!h.ok()) return h.status();
    c.usd_per_hour += *h * count;
    std::string note;
    if (o->usd_purchase > 0) {
      c.any_amortized = true;
      note = absl::StrFormat(", $%.0f over %g y", o->usd_purchase, table.amortize_years);
    }
    if (o->estimate) {
      c.any_estimate = true;
      note += ", estimate";
    }
    if (!c.description.empty()) c.description += " + ";
    c.description += absl::StrFormat("%d x %s ($%.3f/h%s)", count, name, *h, note);
    return absl::OkStatus();
  };
  if (absl::Status s = add(compute, compute_count); !s.ok()) return s;
  if (memory_count > 0) {
    if (absl::Status s = add(memory, memory_count); !s.ok()) return s;
  }
  return c;
}

double UsdPerMillionTokens(double usd_per_hour, double tokens_per_s) {
  if (!(tokens_per_s > 0)) return 0;
  return usd_per_hour / 3600.0 / tokens_per_s * 1e6;
}

}  // namespace tandem::planner
