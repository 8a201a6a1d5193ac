#include "compute_node/weights.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <new>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/host_memory.h"
#include "common/status.h"
#include "compute_node/gguf.h"
#include "compute_node/safetensors.h"
#include "nlohmann/json.hpp"

namespace tandem {
namespace {

using Json = nlohmann::json;

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string JoinPath(const std::string& dir, std::string_view name) {
  return (std::filesystem::path(dir) / name).string();
}

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("open(", path, ")"));
  std::string text;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status s = ErrnoToStatus(errno, absl::StrCat("read(", path, ")"));
      ::close(fd);
      return s;
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return text;
}

// ---- checkpoints --------------------------------------------------------------------------------

struct Located {
  const SafetensorsFile* file;
  const SafetensorsTensor* tensor;
};

class CheckpointSource : public WeightSource {
 public:
  CheckpointSource(ModelSpec spec, std::string dir, std::vector<std::unique_ptr<SafetensorsFile>> files,
                   std::map<std::string, Located> tensors)
      : spec_(std::move(spec)),
        dir_(std::move(dir)),
        files_(std::move(files)),
        tensors_(std::move(tensors)) {}

  const ModelSpec& spec() const override { return spec_; }

  absl::Status ReadF32(const std::string& name, float* out) const override {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) {
      return absl::NotFoundError(absl::StrCat(dir_, ": no tensor '", name, "' in this model"));
    }
    const SafetensorsTensor& t = *it->second.tensor;
    ConvertToF32(*t.dtype, t.data, NumElements(t.shape), out);
    return absl::OkStatus();
  }

  std::string Describe() const override {
    return absl::StrCat(dir_, " (", files_.size(), files_.size() == 1 ? " file, " : " files, ",
                        std::string(DTypeName(spec_.weight_dtype)), ")");
  }

 private:
  ModelSpec spec_;
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Located> tensors_;
};

bool IsPlainFileName(std::string_view name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find_first_of(std::string_view("/\\\0", 3)) == std::string_view::npos;
}

// The weight_map of model.safetensors.index.json: tensor name -> shard file name.
absl::StatusOr<std::map<std::string, std::string>> ReadIndex(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  Json index;
  try {
    index = Json::parse(text);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON: ", e.what()));
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected an object with a \"weight_map\" object"));
  }
  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, shard] : index["weight_map"].items()) {
    if (!shard.is_string() || !IsPlainFileName(shard.get<std::string>())) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": weight_map: tensor '", tensor, "': shard ",
                       shard.dump(-1, ' ', false, Json::error_handler_t::replace),
                       " is not a plain file name in the checkpoint directory"));
    }
    weight_map[tensor] = shard.get<std::string>();
  }
  return weight_map;
}

// The safetensors files of `dir`, and the index's weight_map if there is one.
absl::Status FindShards(const std::string& dir, std::vector<std::string>* shards,
                        std::optional<std::map<std::string, std::string>>* weight_map) {
  const std::string index_path = JoinPath(dir, "model.safetensors.index.json");
  if (IsRegularFile(index_path)) {
    ASSIGN_OR_RETURN(*weight_map, ReadIndex(index_path));
    std::map<std::string, std::string> first_tensor;  // shard -> a tensor listed in it
    for (const auto& [tensor, shard] : **weight_map) first_tensor.emplace(shard, tensor);
    for (const auto& [shard, tensor] : first_tensor) {
      const std::string path = JoinPath(dir, shard);
      if (!IsRegularFile(path)) {
        return absl::NotFoundError(absl::StrCat(index_path, ": shard '", shard, "' (listed for '", tensor,
                                                "') is not a file in ", dir));
      }
      shards->push_back(path);
    }
    return absl::OkStatus();
  }
  if (const std::string single = JoinPath(dir, "model.safetensors"); IsRegularFile(single)) {
    shards->push_back(single);
    return absl::OkStatus();
  }
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(dir, ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (it->path().extension() == ".safetensors" && IsRegularFile(it->path().string())) {
      shards->push_back(it->path().string());
    }
  }
  if (ec) return absl::NotFoundError(absl::StrCat(dir, ": cannot list directory: ", ec.message()));
  if (shards->empty()) {
    return absl::NotFoundError(
        absl::StrCat(dir, ": no model.safetensors.index.json, model.safetensors or *.safetensors file"));
  }
  std::sort(shards->begin(), shards->end());
  return absl::OkStatus();
}

std::string FileName(const SafetensorsFile& file) {
  return std::filesystem::path(file.path()).filename().string();
}

// ---- random weights -----------------------------------------------------------------------------

uint64_t Fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct RandomTensor {
  std::vector<int64_t> shape;
  float center, half_width;  // values ~ center + U(-half_width, half_width)
};

class RandomSource : public WeightSource {
 public:
  RandomSource(const ModelSpec& spec, uint64_t seed) : spec_(spec), seed_(seed) {
    const std::string embed = HfNames::Embed();
    for (ExpectedTensor& t : ExpectedTensors(spec)) {
      RandomTensor r{std::move(t.shape), 0.0f, 1.0f};
      if (r.shape.size() == 1) {  // RMSNorm weight
        r.center = 1.0f;
        r.half_width = 0.1f;
      } else if (t.name != embed) {  // linear (out, in)
        r.half_width = static_cast<float>(1.0 / std::sqrt(static_cast<double>(r.shape[1])));
      }
      tensors_.emplace(std::move(t.name), std::move(r));
    }
  }

  const ModelSpec& spec() const override { return spec_; }

  absl::Status ReadF32(const std::string& name, float* out) const override {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) {
      return absl::NotFoundError(absl::StrCat(Describe(), ": no tensor '", name, "' in this model"));
    }
    const RandomTensor& t = it->second;
    const uint64_t stream = SplitMix64(seed_ ^ SplitMix64(Fnv1a64(name)));
    const int64_t n = NumElements(t.shape);
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t bits = SplitMix64(stream + static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull);
      // 24 random bits -> u in [-1, 1), exact in float.
      const float u = static_cast<float>(static_cast<int32_t>(bits >> 40) - (1 << 23)) *
                      (1.0f / static_cast<float>(1 << 23));
      out[i] = Bf16ToFloat(FloatToBf16(t.center + t.half_width * u));
    }
    return absl::OkStatus();
  }

  std::string Describe() const override {
    return absl::StrCat("preset ", spec_.name, " (random weights, seed ", seed_, ")");
  }

 private:
  ModelSpec spec_;
  uint64_t seed_;
  std::map<std::string, RandomTensor> tensors_;
};

// ---- fp32 host copy ------------------------------------------------------------------------------

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct FillJob {
  std::string name;
  float* dst;
};

}  // namespace

std::string HfNames::Layer(int64_t layer, std::string_view leaf) {
  return absl::StrCat("model.layers.", layer, ".", std::string(leaf));
}

std::vector<ExpectedTensor> ExpectedTensors(const ModelSpec& spec) {
  const int64_t h = spec.hidden_size, inter = spec.intermediate_size;
  std::vector<ExpectedTensor> out;
  out.push_back({HfNames::Embed(), {spec.vocab_size, h}});
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    out.push_back({HfNames::Layer(l, "input_layernorm.weight"), {h}});
    out.push_back({HfNames::Layer(l, "self_attn.q_proj.weight"), {spec.q_dim(), h}});
    out.push_back({HfNames::Layer(l, "self_attn.k_proj.weight"), {spec.kv_dim(), h}});
    out.push_back({HfNames::Layer(l, "self_attn.v_proj.weight"), {spec.kv_dim(), h}});
    out.push_back({HfNames::Layer(l, "self_attn.o_proj.weight"), {h, spec.q_dim()}});
    out.push_back({HfNames::Layer(l, "post_attention_layernorm.weight"), {h}});
    out.push_back({HfNames::Layer(l, "mlp.gate_proj.weight"), {inter, h}});
    out.push_back({HfNames::Layer(l, "mlp.up_proj.weight"), {inter, h}});
    out.push_back({HfNames::Layer(l, "mlp.down_proj.weight"), {h, inter}});
  }
  out.push_back({HfNames::FinalNorm(), {h}});
  if (!spec.tie_word_embeddings) out.push_back({HfNames::LmHead(), {spec.vocab_size, h}});
  return out;
}

absl::StatusOr<std::unique_ptr<WeightSource>> OpenCheckpoint(const std::string& dir) {
  const std::string config_path = JoinPath(dir, "config.json");
  ASSIGN_OR_RETURN(std::string config_text, ReadFile(config_path));
  ASSIGN_OR_RETURN(ModelSpec spec, ParseHfConfig(config_text, config_path));
  spec.name = dir;

  std::vector<std::string> paths;
  std::optional<std::map<std::string, std::string>> weight_map;
  RETURN_IF_ERROR(FindShards(dir, &paths, &weight_map));
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  for (const std::string& path : paths) {
    ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
    files.push_back(std::move(file));
  }

  // Every tensor of every file, found once, where the index says.
  std::map<std::string, Located> all;
  for (const auto& file : files) {
    for (const auto& [name, tensor] : file->tensors()) {
      auto [it, inserted] = all.emplace(name, Located{file.get(), &tensor});
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor '", name, "' appears in both ",
                                                       FileName(*it->second.file), " and ", FileName(*file)));
      }
      if (weight_map.has_value()) {
        auto listed = weight_map->find(name);
        if (listed == weight_map->end() || listed->second != FileName(*file)) {
          return absl::InvalidArgumentError(absl::StrCat(
              file->path(), ": tensor '", name, "' is listed in model.safetensors.index.json ",
              listed == weight_map->end() ? std::string("nowhere") : absl::StrCat("under ", listed->second)));
        }
      }
    }
  }
  if (weight_map.has_value()) {
    for (const auto& [name, shard] : *weight_map) {
      if (!all.contains(name)) {
        return absl::NotFoundError(absl::StrCat(JoinPath(dir, shard), ": tensor '", name,
                                                "' listed by model.safetensors.index.json is "
                                                "missing"));
      }
    }
  }

  std::vector<std::string> file_names;
  for (const auto& file : files) file_names.push_back(FileName(*file));
  auto check = [&](const std::string& name, const std::vector<int64_t>& shape,
                   const Located& at) -> absl::Status {
    const SafetensorsTensor& t = *at.tensor;
    if (t.shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat(at.file->path(), ": tensor '", name, "': shape ",
                                                     ShapeString(t.shape), ", expected ",
                                                     ShapeString(shape)));
    }
    if (!t.dtype.has_value()) {
      return absl::UnimplementedError(absl::StrCat(at.file->path(), ": tensor '", name, "': dtype ",
                                                   t.dtype_name, " is not supported (BF16, F16, F32 are)"));
    }
    return absl::OkStatus();
  };
  std::map<std::string, Located> used;
  std::optional<DType> common_dtype;
  bool mixed = false;
  for (const ExpectedTensor& e : ExpectedTensors(spec)) {
    auto it = all.find(e.name);
    if (it == all.end()) {
      return absl::NotFoundError(absl::StrCat(dir, ": tensor '", e.name, "' is missing (looked in ",
                                              absl::StrJoin(file_names, ", "), ")"));
    }
    RETURN_IF_ERROR(check(e.name, e.shape, it->second));
    if (common_dtype.has_value() && *common_dtype != *it->second.tensor->dtype) mixed = true;
    common_dtype = it->second.tensor->dtype;
    used.insert(all.extract(it));
  }
  for (const auto& [name, at] : all) {
    if (absl::EndsWith(name, "rotary_emb.inv_freq")) continue;
    if (name == HfNames::LmHead() && spec.tie_word_embeddings) {
      RETURN_IF_ERROR(check(name, {spec.vocab_size, spec.hidden_size}, at));
      continue;
    }
    return absl::InvalidArgumentError(absl::StrCat(at.file->path(), ": unexpected tensor '", name,
                                                   "' (not part of a ", spec.model_type,
                                                   " model with this config.json)"));
  }
  if (common_dtype.has_value() && !mixed) spec.weight_dtype = *common_dtype;
  return std::unique_ptr<WeightSource>(
      new CheckpointSource(std::move(spec), dir, std::move(files), std::move(used)));
}

std::unique_ptr<WeightSource> RandomWeights(const ModelSpec& spec, uint64_t seed) {
  return std::make_unique<RandomSource>(spec, seed);
}

absl::StatusOr<std::unique_ptr<WeightSource>> OpenModel(const std::string& dir_or_preset, uint64_t seed) {
  if (absl::StatusOr<ModelSpec> preset = PresetSpec(dir_or_preset); preset.ok()) {
    return RandomWeights(*preset, seed);
  }
  std::error_code ec;
  if (std::filesystem::is_directory(dir_or_preset, ec)) return OpenCheckpoint(dir_or_preset);
  if (absl::EndsWith(dir_or_preset, ".gguf") && std::filesystem::exists(dir_or_preset, ec)) {
    ASSIGN_OR_RETURN(std::unique_ptr<GgufWeightSource> gguf, OpenGguf(dir_or_preset));
    return std::unique_ptr<WeightSource>(std::move(gguf));
  }
  return absl::NotFoundError(absl::StrCat("'", dir_or_preset, "' is neither a preset (",
                                          absl::StrJoin(PresetNames(), ", "),
                                          ") nor a checkpoint directory nor a .gguf file"));
}

absl::StatusOr<ModelWeightsF32> LoadWeightsF32(const WeightSource& source) {
  const ModelSpec& spec = source.spec();
  RETURN_IF_ERROR(spec.Validate());
  const int64_t need = spec.num_parameters() * static_cast<int64_t>(sizeof(float));
  std::string avail_from;
  const int64_t avail = AvailableHostBytes(&avail_from);
  if (need > avail) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%s: fp32 weights need %.1f GiB of host memory, but only %.1f GiB is available (%s); "
                        "use the cuda backend or a smaller preset",
                        source.Describe(), need / kGiB, avail / kGiB, avail_from));
  }

  ModelWeightsF32 w;
  std::vector<FillJob> jobs;
  try {
    const int64_t h = spec.hidden_size, inter = spec.intermediate_size;
    const int64_t q = spec.q_dim() * h, kv = spec.kv_dim() * h;
    w.spec = spec;
    w.embed.resize(spec.vocab_size * h);
    jobs.push_back({HfNames::Embed(), w.embed.data()});
    w.layers.resize(spec.num_layers);
    for (int64_t l = 0; l < spec.num_layers; ++l) {
      LayerWeightsF32& L = w.layers[l];
      L.input_norm.resize(h);
      L.wqkv.resize(q + 2 * kv);
      L.wo.resize(q);
      L.post_norm.resize(h);
      L.w_gate_up.resize(2 * inter * h);
      L.w_down.resize(inter * h);
      jobs.push_back({HfNames::Layer(l, "input_layernorm.weight"), L.input_norm.data()});
      jobs.push_back({HfNames::Layer(l, "self_attn.q_proj.weight"), L.wqkv.data()});
      jobs.push_back({HfNames::Layer(l, "self_attn.k_proj.weight"), L.wqkv.data() + q});
      jobs.push_back({HfNames::Layer(l, "self_attn.v_proj.weight"), L.wqkv.data() + q + kv});
      jobs.push_back({HfNames::Layer(l, "self_attn.o_proj.weight"), L.wo.data()});
      jobs.push_back({HfNames::Layer(l, "post_attention_layernorm.weight"), L.post_norm.data()});
      jobs.push_back({HfNames::Layer(l, "mlp.gate_proj.weight"), L.w_gate_up.data()});
      jobs.push_back({HfNames::Layer(l, "mlp.up_proj.weight"), L.w_gate_up.data() + inter * h});
      jobs.push_back({HfNames::Layer(l, "mlp.down_proj.weight"), L.w_down.data()});
    }
    w.final_norm.resize(h);
    jobs.push_back({HfNames::FinalNorm(), w.final_norm.data()});
    if (!spec.tie_word_embeddings) {
      w.lm_head.resize(spec.vocab_size * h);
      jobs.push_back({HfNames::LmHead(), w.lm_head.data()});
    }
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s: allocating %.1f GiB for fp32 weights failed; use the cuda backend or a smaller preset",
        source.Describe(), need / kGiB));
  }

  // Each job writes its own range, so the result does not depend on the thread count.
  std::vector<absl::Status> results(jobs.size());
  std::atomic<size_t> next{0};
  auto worker = [&] {
    size_t i = next.fetch_add(1);
    for (; i < jobs.size(); i = next.fetch_add(1)) {
      results[i] = source.ReadF32(jobs[i].name, jobs[i].dst);
    }
  };
  const size_t n_threads = std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()), jobs.size());
  std::vector<std::thread> threads;
  for (size_t t = 1; t < n_threads; ++t) threads.emplace_back(worker);
  worker();
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) RETURN_IF_ERROR(s);
  return w;
}

}  // namespace tandem
